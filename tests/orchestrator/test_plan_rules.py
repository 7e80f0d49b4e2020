"""The planner's candidate sub-queries and its rules (orchestrator/plan.py), and the offline
simulation of a rule over a dump of every candidate branch (reports/recall/branch_eval.py).
Pure, fast."""

import importlib.util
from pathlib import Path

import pytest

from branchsearch.orchestrator.plan import HeuristicPlanner, SubQuery, candidates, select

MUSIQUE = ("What is the name of the waterfall in the country where the Bubye River is found?")
KISS = ("What government position was held by the woman who portrayed Corliss Archer in the "
        "film Kiss and Tell?")
COMPARE = "Were Scott Derrickson and Ed Wood of the same nationality?"


def kinds(subs):
    return [s.kind for s in subs]


def test_candidates_list_every_kind_once_original_first():
    subs = candidates(KISS)
    assert subs[0] == SubQuery(KISS, 1.0, "original")
    assert kinds(subs) == ["original", "entity", "entity_last", "residual", "relative",
                           "relative"]
    assert subs[1].text.startswith("Corliss Archer") and "Kiss and Tell" not in subs[1].text
    assert subs[2].text.startswith("Kiss and Tell") and "Corliss" not in subs[2].text
    # the residual names nothing the question names; relative: the head and the clause
    assert subs[3].text == "government position held woman portrayed film"
    assert [s.text for s in subs[4:]] == ["government position held woman",
                                          "portrayed Corliss Archer film Kiss Tell"]
    assert [s.text for s in candidates(MUSIQUE) if s.kind == "relative"] == [
        "waterfall country", "Bubye River found"]
    assert len({s.text.lower() for s in subs}) == len(subs)


def test_v2_the_default_branches_only_comparisons_and_clauses():
    planner = HeuristicPlanner()
    assert planner.rule == "v2"
    assert kinds(planner.plan(KISS, 3)) == ["original"]  # two names, no comparison: no branch
    assert kinds(planner.plan(COMPARE, 3)) == ["original", "comparison", "comparison"]
    assert kinds(planner.plan(MUSIQUE, 3)) == ["original"]
    assert kinds(planner.plan(COMPARE, 2)) == ["original", "comparison"]


def test_v1_is_the_planner_of_sessions_1_to_12():
    planner = HeuristicPlanner("v1")
    assert kinds(planner.plan(KISS, 3)) == ["original", "entity"]
    assert kinds(planner.plan(COMPARE, 3)) == ["original", "comparison", "comparison"]
    assert kinds(planner.plan(MUSIQUE, 3)) == ["original"]  # one entity: no entity branch
    assert kinds(planner.plan(KISS, 1)) == ["original"]


def test_kinds_rule_takes_kinds_in_the_order_given_up_to_the_cap():
    subs = candidates(KISS)
    assert kinds(select(subs, "kinds:relative,residual", 3)) == ["original", "relative",
                                                                 "relative"]
    assert kinds(select(subs, "kinds:residual,relative", 3)) == ["original", "residual",
                                                                 "relative"]
    assert kinds(select(subs, "kinds:entity_last,entity", 2)) == ["original", "entity_last"]
    assert kinds(select(subs, "kinds:comparison", 3)) == ["original"]  # none: the question
    assert kinds(select(subs, "candidates", 10)) == kinds(subs)


def test_an_unknown_rule_or_kind_fails_when_the_planner_is_made():
    with pytest.raises(ValueError, match="unknown planner rule 'v9'"):
        HeuristicPlanner("v9")
    with pytest.raises(ValueError, match="unknown sub-query kind 'entities'"):
        HeuristicPlanner("kinds:relative,entities")


def _branch_eval():
    path = Path(__file__).resolve().parents[2] / "reports" / "recall" / "branch_eval.py"
    spec = importlib.util.spec_from_file_location("branch_eval", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("rule,cap", [("v2", 3), ("v1", 3), ("kinds:residual,relative", 3),
                                      ("kinds:entity_last", 2), ("candidates", 10)])
def test_the_offline_simulation_launches_what_the_planner_launches(rule, cap):
    be = _branch_eval()
    for question in (KISS, COMPARE, MUSIQUE):
        dumped = [{"index": i, "kind": s.kind, "subquery": s.text, "weight": s.weight}
                  for i, s in enumerate(candidates(question))]
        kept = be.plan_rule(rule, cap)(dumped)
        assert [(b["kind"], b["subquery"]) for b in kept] == [
            (s.kind, s.text) for s in HeuristicPlanner(rule).plan(question, cap)]


def test_novel_tail_keeps_the_anchor_head_and_adds_only_what_it_lacks():
    be = _branch_eval()
    anchor = [f"a{i}#p0" for i in range(10)]
    other = ["a0#p1", "x#p0", "a9#p0", "y#p0", "z#p0"]
    got = be.novel_tail(anchor, [other], head=7, novel=2)
    # the anchor's 7 documents, then x and y (in the other's top 10, not in the anchor's top
    # 10: a0#p1 is a0's document, a9 is the anchor's), then the anchor's next one
    assert got == anchor[:7] + ["x#p0", "y#p0", "a7#p0"]
    assert be.novel_tail(anchor, [], head=5, novel=3) == anchor


def test_policy_args_are_read_as_their_field_type():
    be = _branch_eval()
    assert be.policy_arg("question_k=8") == ("question_k", 8)
    assert be.policy_arg("prune=false") == ("prune", False)  # was the truthy string 'false'
    assert be.policy_arg("branch.expand_floor=1") == ("branch.expand_floor", 1.0)
    assert be.policy_arg("hop_mode=hybrid") == ("hop_mode", "hybrid")
    for bad in ("prune=0", "question_k=1O", "hop_mode=bm52", "q_terms=x", "nope=1", "question_k"):
        with pytest.raises(ValueError, match="--policy-arg"):
            be.policy_arg(bad)


def test_pair_fuses_two_runs_with_the_first_anchoring(tmp_path):
    """Two runs of the same question: the pair keeps ONE's top and adds OTHER's find below it;
    all found counts the gold either run retrieved."""
    import json

    be = _branch_eval()

    def dump(path, ranked, tokens):
        branch = {"ranked": ranked, "retrieved": ranked, "pruned": [], "final_context": ranked,
                  "searches": [["search_corpus", "q"]], "tokens_read": tokens}
        path.write_text(json.dumps({"index": "x", "rows": [
            {"question": "q", "gold": {"g1": 1, "g2": 1}, "branches": [branch]}]}))
        return str(path)

    one = dump(tmp_path / "one.json", ["g1#p0"] + [f"a{i}#p0" for i in range(9)], 100)
    other = dump(tmp_path / "other.json", ["b0#p0", "g2#p0"], 50)
    got = be.pair(one, other, share=0.0, k=5)
    assert got["one"]["all_recall@10"] == 0 and got["other"]["all_recall@10"] == 0
    assert got["pair"]["all_found"] == 1 and got["pair"]["all_recall@10"] == 1
    assert got["pair"]["all_recall@5"] == 0  # share 0: ONE's first five stay the head
    assert got["other_tokens_over_one"] == 0.5
    (tmp_path / "other.json").write_text((tmp_path / "other.json").read_text().replace(
        '"question": "q"', '"question": "another"'))
    with pytest.raises(ValueError, match="same questions"):
        be.pair(one, other, share=0.0, k=5)


def test_branch_eval_errors_are_one_line(tmp_path):
    """A dump missing, not JSON or not one `run` wrote, a missing argument, a NaN setting: one
    line and exit 2, never a traceback or a run that quietly goes on."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "reports" / "recall" / "branch_eval.py"
    (tmp_path / "empty.json").write_text('{"rows": []}')
    (tmp_path / "text.json").write_text("not json")
    for args, words in ((["pair", "missing.json", "empty.json"], "No such file"),
                        (["pair", "empty.json", "empty.json"], "not a dump"),
                        (["table", "text.json"], "not JSON"),
                        (["run", "data", "index"], "takes DATASET INDEX OUT.json"),
                        (["run", "a", "b", "c", "--policy-arg", "rank_decay=nan"], "finite")):
        done = subprocess.run([sys.executable, str(script), *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and words in lines[0], done.stderr
