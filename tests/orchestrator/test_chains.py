"""Chains (orchestrator/chains.py): the hop split and the substitution as plain functions, and
the second wave through the real driver, the in-process executor and the heuristic policy over
the hotpot-mini fixture (tantivy + Milvus Lite + docstore)."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from branchsearch.infra import telemetry
from branchsearch.infra.config.settings import load_settings
from branchsearch.infra.errors import SettingsError
from branchsearch.orchestrator.chains import (BRIDGE_WEIGHT, CHAIN_WEIGHT, Hops, answers,
                                             bridges, deeper_bridge_tasks, hops, substitute)
from branchsearch.orchestrator.driver import Driver
from branchsearch.workers.branch import BranchReport
from branchsearch.workers.harness import EpisodeResult

CHAINED = ("What government position was held by the woman who portrayed Corliss Archer in the "
           "film Kiss and Tell?")


def test_hops_split_the_innermost_relative_clause_from_the_outer_hop():
    h = hops("What is the name of the waterfall in the country where the Bubye River is found?")
    assert h == Hops("What is the name of the waterfall in the country", "the country",
                     "Bubye River found")
    # the last clause with two content words is the inner hop ("when he died" has one)
    h = hops("How many Publix stores are in the state that borders the east of the state where "
             "Hello Love's performer lived in when he died?")
    assert h.slot == "the state" and h.inner.startswith("Hello Love's performer lived")
    assert h.outer.endswith("borders the east of the state")
    # a preposition before the relative pronoun stays out of both hops
    h = hops("What county shares a border with the county in which Johnnycake, West Virginia "
             "is located?")
    assert h.outer == "What county shares a border with the county" and h.inner == "Johnnycake West Virginia"


@pytest.mark.parametrize("question", [
    "Were Scott Derrickson and Ed Wood of the same nationality?",  # no relative clause
    "What country was the author of Brand a citizen of?",  # a possessive chain, no clause
    "The arena where the Lewiston Maineiacs played their home games can seat how many people?",
    "Who is the man that died?",  # the clause has one content word
])
def test_a_question_without_a_nested_hop_has_no_chain(question):
    assert hops(question) is None


def test_substitute_puts_the_answer_in_the_slot():
    h = hops("Who was in charge of the country where the composer of Aschenbrodel was a "
             "citizen?")
    assert substitute(h, "Austria") == "Who was in charge of Austria"
    assert substitute(h, "  Carl   Ziehrer ") == "Who was in charge of Carl Ziehrer"
    with pytest.raises(ValueError, match="empty answer"):
        substitute(h, " ")


def _report(titles: list[str]) -> BranchReport:
    ids = [f"d{i}#p0" for i in range(len(titles))]
    ev = [{"chunk_id": c, "doc_id": c[:-3], "title": t} for c, t in zip(ids, titles)]
    return BranchReport(1, "inner", 0.5, "hop",
                        episode=EpisodeResult(subquery="inner", termination="finish",
                                              evidence=ev, ranked_chunk_ids=ids))


def test_answers_are_distinct_titles_the_inner_clause_does_not_name():
    h = hops("What is the name of the waterfall in the country where the Bubye River is found?")
    report = _report(["Bubye River", "Zimbabwe", "Zimbabwe (country)", "Limpopo River",
                      "Botswana"])
    assert answers(report, h, 2) == ["Zimbabwe", "Limpopo River"]
    assert answers(report, h, 9) == ["Zimbabwe", "Limpopo River", "Botswana"]
    assert answers(report, h, 0) == []


def test_chains_must_not_be_negative(tmp_path):
    with pytest.raises(SettingsError, match="chains must be >= 0"):
        load_settings(None, {"home": str(tmp_path), "chains": -1})


@pytest.fixture(scope="module")
def spans():
    exporter = InMemorySpanExporter()
    telemetry.configure(span_exporter=exporter)
    return exporter


@pytest.fixture(scope="module")
def chaining(hotpot_settings):
    driver = Driver(hotpot_settings.replace(chains=2, bridges=0, branches=3), mode="local")
    yield driver
    driver.close()


def test_a_compositional_question_runs_its_hops_in_two_waves(chaining, spans):
    spans.clear()
    events = []
    result = chaining.search(CHAINED, on_event=events.append)
    kinds = [b.kind for b in result.branches]
    assert kinds[0] == "original" and kinds.count("hop") == 1
    hop = next(b for b in result.branches if b.kind == "hop")
    assert hop.subquery == "portrayed Corliss Archer film Kiss Tell"
    chains = [b for b in result.branches if b.kind == "chain"]
    assert len(chains) == 1 and result.metrics["chains"] == len(chains)
    for b in chains:  # the second wave: after the first, from the hop branch's answers
        assert b.index > hop.index and b.parent == hop.index and b.weight == CHAIN_WEIGHT
        assert b.subquery.startswith("What government position was held by ")
        assert "the woman" not in b.subquery and b.status == "ok"
    assert [b.subquery for b in chains] == [  # as many as the budget of 3 leaves: one
        substitute(hops(CHAINED), a) for a in answers(hop, hops(CHAINED), 1)]
    plan = next(s for s in spans.get_finished_spans() if s.name == "plan")
    assert plan.attributes["plan.hops.slot"] == "the woman"
    assert plan.attributes["plan.hops.inner"] == hop.subquery
    chain_spans = [s for s in spans.get_finished_spans() if s.name == "chain"]
    assert [s.attributes["chain.subquery"] for s in chain_spans] == [b.subquery for b in chains]
    nested = {s.context.span_id: s.attributes["chain.branch"] for s in chain_spans}
    chain_branch_spans = [s for s in spans.get_finished_spans() if s.name == "branch"
                          and s.attributes.get("branch.kind") == "chain"]
    assert sorted(nested[s.parent.span_id] for s in chain_branch_spans) == sorted(
        b.index for b in chains)  # each chain branch's span under its chain span
    assert events[0]["hops"]["slot"] == "the woman"
    typed = [e["type"] for e in events]
    for b in chains:  # each chain event precedes its branch's start
        at = next(i for i, e in enumerate(events) if e["type"] == "chain"
                  and e["branch"] == b.index)
        assert typed[at + 1:].count("branch_started") and at < next(
            i for i, e in enumerate(events) if e["type"] == "branch_started"
            and e["branch"] == b.index)
    assert result.ranked_chunk_ids


def test_one_branch_and_chains_off_run_no_chain(chaining, hotpot_settings):
    one = chaining.search(CHAINED, max_branches=1)
    assert [b.kind for b in one.branches] == ["original"] and one.metrics["chains"] == 0
    off = Driver(hotpot_settings.replace(chains=0, bridges=0, branches=3), mode="local")
    try:
        plain = off.search(CHAINED)
    finally:
        off.close()
    assert [b.kind for b in plain.branches] == ["original"]
    assert plain.ranked_chunk_ids == one.ranked_chunk_ids  # the planner's own plan is 1 branch


BIG_EYES = ("Big Eyes is a 2014 American biographical drama film directed by Tim Burton, "
            "written by Scott Alexander and Larry Karaszewski. There were two sequels.")


def _top(title: str, text: str) -> BranchReport:
    ev = [{"chunk_id": "big-eyes#p0", "doc_id": "big-eyes", "title": title, "text": text},
          {"chunk_id": "other#p0", "doc_id": "other", "title": "Other", "text": "Tim Roth."}]
    return BranchReport(0, "q", 1.0, "original", episode=EpisodeResult(
        subquery="q", termination="finish", evidence=ev,
        ranked_chunk_ids=["big-eyes#p0", "other#p0"]))


def test_bridges_are_the_top_chunks_names_nearest_the_questions_words():
    report = _top("Big Eyes", BIG_EYES)
    found = bridges(report, "Who is the spouse of Big Eye's main director?", 3)
    # "directed" answers "director": the name next to it first; the title, a word opening a
    # sentence ("There") and the other chunk's names are not bridges; the sub-query keeps the
    # question's words the chunk lacks ("director" it holds)
    assert found[0] == ("Tim Burton", "Tim Burton spouse Eye's main")
    assert [name for name, _ in found] == ["Tim Burton", "American", "Scott Alexander"]
    every = [name for name, _ in bridges(report, "Who is the spouse of Big Eye's main director?",
                                         9)]
    assert every[:3] == [name for name, _ in found] and "Larry Karaszewski" in every
    assert not {"There", "Big Eyes", "Tim Roth"} & set(every)
    assert bridges(report, "Who is the spouse of Big Eye's main director?", 0) == []
    # a name the question already holds is no next hop
    assert "Tim Burton" not in [n for n, _ in bridges(report, "Whom did Tim Burton marry?", 5)]


def test_a_bridge_branch_follows_a_name_in_the_question_branchs_top_chunk(hotpot_settings):
    driver = Driver(hotpot_settings.replace(bridges=2, bridge_depth=1, branches=3), mode="local")
    events = []
    try:
        result = driver.search(CHAINED, on_event=events.append)
        one = driver.search(CHAINED, max_branches=1)
    finally:
        driver.close()
    own = result.branches[0]
    found = bridges(own, CHAINED, 2)
    made = [b for b in result.branches if b.kind == "bridge"]
    assert found and [b.subquery for b in made] == [sub for _, sub in found]
    for b in made:  # second wave, after the question's branch, fused at half weight
        assert b.parent == own.index and b.weight == BRIDGE_WEIGHT and b.status == "ok"
        event = next(e for e in events if e["type"] == "chain" and e["branch"] == b.index)
        assert event["reason"] == b.reason and b.reason.startswith("bridge = ")
    assert result.metrics["bridges"] == len(made)
    assert [b.kind for b in one.branches] == ["original"]  # --branches 1: never a bridge


def test_the_second_wave_stays_within_the_branch_budget(hotpot_settings):
    """`--branches N` is at most N branches, next hops included: 5 bridges asked for under a
    budget of 2 run one."""
    driver = Driver(hotpot_settings.replace(bridges=5, bridge_depth=1, branches=3), mode="local")
    try:
        two = driver.search(CHAINED, max_branches=2)
        three = driver.search(CHAINED)
    finally:
        driver.close()
    assert [b.kind for b in two.branches] == ["original", "bridge"]
    assert len(three.branches) == 3


# a tiny Chinese corpus: Confucius's page names the book his disciples made in book-title marks
# (《论语》, no capital to tell it by); the book's page shares no word with the question
ANALECTS = [
    {"_id": "kongzi", "title": "孔子",
     "text": "孔子是春秋时期的思想家。他去世以后，弟子们把他的言行编成了《论语》。"},
    {"_id": "lunyu", "title": "论语", "text": "全书共二十篇，成书于战国初期，是儒家经典之一。"},
    {"_id": "laozi", "title": "老子", "text": "老子是道家的创始人，著有《道德经》。"},
    {"_id": "mengzi", "title": "孟子", "text": "孟子是战国时期的思想家，继承了儒家学说。"}]
ANALECTS_Q = "孔子的弟子编成的书有多少篇？"


def test_a_bridge_follows_a_title_a_cjk_text_marks(tmp_path):
    """Chinese has no capitals: the question's branch's top chunk (孔子) names 《论语》 in its
    book-title marks, and a bridge branch (2 characters are a name there) searches it and ranks
    the book's page, which a search of the question alone does not find. BM25 (tantivy's CJK
    bigrams) and the docstore, the in-process executor, the heuristic policy."""
    import json

    from branchsearch.infra.index.open import open_retriever
    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.infra.stores.acl import ACL_ALL

    corpus = tmp_path / "analects.jsonl"
    corpus.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ANALECTS),
                      encoding="utf-8")
    settings = load_settings(overrides={"home": str(tmp_path / "home"), "index": "zh",
                                        "search_mode": "bm25", "bridges": 1,
                                        "bridge_depth": 1, "branches": 3},
                             read_env=False, read_file=False)
    ingest(corpus, settings, dense=False)
    retriever = open_retriever(settings, need_dense=False)
    try:  # the question alone finds Confucius's page, not the book's
        alone = retriever.search(ANALECTS_Q, mode="bm25", k=3, acl_groups=[ACL_ALL])
    finally:
        retriever.close()
    assert alone and alone[0].doc_id == "kongzi" and "lunyu" not in [h.doc_id for h in alone]
    driver = Driver(settings, mode="local")
    try:
        result = driver.search(ANALECTS_Q)
    finally:
        driver.close()
    own = result.branches[0]
    assert own.kind == "original" and own.ranked_chunk_ids[0] == "kongzi#p0"
    made = [b for b in result.branches if b.kind == "bridge"]
    assert [(b.reason, b.parent, b.status) for b in made] == [
        ("bridge = 论语", own.index, "ok")], result.branches
    assert made[0].subquery.startswith("论语 ") and "lunyu#p0" in made[0].ranked_chunk_ids[:2]
    assert result.metrics["bridges"] == 1 and "lunyu#p0" in result.ranked_chunk_ids


def test_a_name_said_twice_is_one_bridge():
    text = ("The Exorcism of Emily Rose is a film by Scott Derrickson. Exorcism of Emily Rose "
            "drew on Anneliese Michel. Derrickson later made Doctor Strange. Doctor Strange "
            "grossed more.")
    names = [n for n, _ in bridges(_top("Sinister", text), "Who directed it?", 9)]
    assert names.count("Doctor Strange") == 1 and len([
        n for n in names if "Exorcism" in n]) == 1, names


def _bridge(index: int, parent: int, name: str, title: str, text: str,
            status: str = "ok") -> BranchReport:
    cid = title.lower().replace(" ", "-") + "#p0"
    ev = [{"chunk_id": cid, "doc_id": cid[:-3], "title": title, "text": text}]
    return BranchReport(index, name, BRIDGE_WEIGHT, "bridge", status=status, parent=parent,
                        reason=f"bridge = {name}", episode=EpisodeResult(
                            subquery=name, termination="finish", evidence=ev,
                            ranked_chunk_ids=[cid]))


def test_a_bridge_of_a_bridge_follows_the_next_name_in_the_bridges_top_chunk():
    """bridge_depth 2: the hop after a bridge is a name of the bridge's own top chunk that no
    bridge took and the question branch's top chunk does not name; its sub-query leaves out
    the words either chunk holds."""
    question = "Where was the spouse of Big Eye's main director born?"
    own = _top("Big Eyes", BIG_EYES)
    burton = _bridge(1, 0, "Tim Burton", "Tim Burton",
                     "Tim Burton worked with Scott Alexander. His spouse Lena Olin was "
                     "Swedish.")
    tasks = deeper_bridge_tasks([own, burton], question, first=2, room=1)
    assert [(t.index, t.parent, t.kind, t.reason) for t in tasks] == [
        (2, 1, "bridge", "bridge = Lena Olin")]  # not Scott Alexander: the first hop names him
    # "spouse" the bridge's chunk holds, "director" the first hop's: neither is left to find
    assert tasks[0].subquery == "Lena Olin Eye's main" and tasks[0].weight == BRIDGE_WEIGHT
    assert tasks[0].hops == 1  # it fetches the named page: one hop, nothing expanded
    # a name an earlier bridge took is no next hop either
    olin = _bridge(2, 0, "Lena Olin", "Lena Olin (actress)", "Lena Olin acted.")
    again = deeper_bridge_tasks([own, burton, olin], question, first=3, room=2)
    assert "bridge = Lena Olin" not in [t.reason for t in again]
    # no room, a failed bridge, or no question branch: no third wave
    assert deeper_bridge_tasks([own, burton], question, first=2, room=0) == []
    failed = _bridge(1, 0, "Tim Burton", "Tim Burton", "His spouse Lena Olin.", status="error")
    assert deeper_bridge_tasks([own, failed], question, first=2, room=1) == []
    assert deeper_bridge_tasks([burton], question, first=2, room=1) == []


def test_a_bridge_of_a_bridge_runs_in_a_third_wave_within_the_budget(hotpot_settings, capsys):
    from branchsearch.orchestrator.cli.render import print_result

    """The defaults (bridges 1, bridge_depth 2, --branches 3): question, bridge, bridge of it."""
    driver = Driver(hotpot_settings, mode="local")
    events = []
    try:
        result = driver.search(CHAINED, on_event=events.append)
        two = driver.search(CHAINED, max_branches=2)
    finally:
        driver.close()
    own, first, deeper = result.branches
    assert (first.kind, first.parent) == ("bridge", own.index)
    assert (deeper.kind, deeper.parent, deeper.status) == ("bridge", first.index, "ok")
    # the bridge follows a hop past its own search; the bridge of it only searches
    turns = lambda b: {s["turn"] for s in b.episode.trace if s.get("tool") == "search_corpus"}
    assert turns(first) == {1, 2} and turns(deeper) == {1} and deeper.ranked_chunk_ids
    assert deeper.reason.startswith("bridge = ") and deeper.reason != first.reason
    event = next(e for e in events if e["type"] == "chain" and e["branch"] == deeper.index)
    assert event["parent"] == first.index and event["subquery"] == deeper.subquery
    assert result.metrics["bridges"] == 2
    print_result(result)  # the terminal says which branch each follows, and why
    out = capsys.readouterr().out
    assert f"(bridge of b{first.index}, {deeper.reason})" in out
    assert f"(bridge of b{own.index}, {first.reason})" in out
    assert [b.kind for b in two.branches] == ["original", "bridge"]  # the budget holds it
    one = Driver(hotpot_settings.replace(bridges=1, bridge_depth=1, branches=3), mode="local")
    try:
        assert [b.kind for b in one.search(CHAINED).branches] == ["original", "bridge"]
    finally:
        one.close()


def test_a_wave_the_deadline_leaves_no_time_for_is_said_in_the_notes(hotpot_settings):
    """With the defaults (a bridge, then a bridge of it), a question whose deadline passes
    once a wave has ended skipped the next wave and said nothing: an `ok` result that looked
    whole. Its notes now say what was not searched. The watcher holds the driver past the
    deadline once the wave before has ended (a deadline short enough to leave no time for the
    first wave ends it too: that result is `failed`, and with nothing found, nothing was there
    to follow)."""
    import time

    deadline_s = 8.0

    def hold_after(branch: int):
        started = time.time()

        def watcher(event):
            if event["type"] == "branch_done" and event["branch"] == branch:
                time.sleep(max(started + deadline_s - time.time(), 0) + 0.1)
        return watcher

    said = ("not searched for lack of time: {} (the question's deadline, or one branch "
            "timeout from its start, was less than 0.25 s away when their wave was to start)")
    driver = Driver(hotpot_settings, mode="local")
    try:
        second = driver.search(CHAINED, deadline_s=deadline_s, on_event=hold_after(0))
        third = driver.search(CHAINED, deadline_s=deadline_s, on_event=hold_after(1))
        whole = driver.search(CHAINED)
        none = driver.search(CHAINED, deadline_s=0)
    finally:
        driver.close()
    assert [b.kind for b in second.branches] == ["original"] and second.status == "ok"
    assert said.format("1 bridge") in second.notes, second.notes
    assert [b.kind for b in third.branches] == ["original", "bridge"] and third.status == "ok"
    assert said.format("1 bridge of a bridge") in third.notes, third.notes
    assert [b.kind for b in whole.branches] == ["original", "bridge", "bridge"]
    assert not [n for n in whole.notes if "lack of time" in n]
    assert none.status == "failed" and not [n for n in none.notes if "lack of time" in n]


def test_a_wave_with_only_ms_left_is_skipped_and_said_not_run_to_a_timeout(hotpot_settings):
    """A wave due with a few ms left before the deadline started: its branch could only time
    out, and the answer was `partial` ("no result within 0.00398 s") with nothing said of
    what was not searched. A wave with less than `MIN_WAVE_S` left is now skipped and said as
    one whose deadline has passed is; the result stays `ok`. The watcher holds the driver
    until 50 ms before the deadline once the first wave has ended."""
    import time

    from branchsearch.orchestrator.driver import MIN_WAVE_S

    deadline_s, left_s = 8.0, 0.05
    assert left_s < MIN_WAVE_S
    held = []

    def watcher(event):
        if event["type"] == "branch_done" and event["branch"] == 0:
            held.append(started + deadline_s - left_s - time.time())
            time.sleep(max(held[-1], 0))

    driver = Driver(hotpot_settings, mode="local")
    try:
        started = time.time()  # (the driver's models are loaded by now)
        result = driver.search(CHAINED, deadline_s=deadline_s, on_event=watcher)
    finally:
        driver.close()
    assert held and held[0] > 0, held  # the first wave ended before the hold's end
    assert [b.kind for b in result.branches] == ["original"], result.branches
    assert result.status == "ok", (result.status, [b.error for b in result.branches])
    assert any(n.startswith("not searched for lack of time: 1 bridge (") for n in result.notes), \
        result.notes


def test_a_branch_timeout_says_its_wait_in_a_readable_unit():
    """A Ray branch's timeout said "no result within 0.00398 s", and "within 0 s" when the
    deadline had passed."""
    from branchsearch.orchestrator.execution.ray import within

    assert within(8) == "8 s"
    assert within(0.00398) == "3.98 ms"
    assert within(0.0) == "0 s (the deadline had passed)"


def test_covered_branches_leave_their_room_to_the_bridges(hotpot_settings):
    """A comparison whose two entity branches the question's branch covers (not run) keeps
    their room under `--branches 3`: a bridge and its bridge run instead (v11); the branches
    run never exceed the budget."""
    driver = Driver(hotpot_settings, mode="local")
    try:
        result = driver.search("Were Scott Derrickson and Ed Wood of the same nationality?")
    finally:
        driver.close()
    assert [c["branch"] for c in result.covered] == [1, 2]
    kinds = [b.kind for b in result.branches]
    assert kinds[0] == "original" and "bridge" in kinds and len(kinds) <= 3, kinds
    assert {b.index for b in result.branches}.isdisjoint({1, 2})  # numbered after the plan


def test_a_third_wave_bridges_the_bridge_of_a_bridge_from_its_top_chunk(hotpot_settings):
    """bridge_depth 3 (reports/bridges.md, v21): once the bridge of a bridge has ended, its top
    chunk seeds one more bridge by the same rule (`deeper_bridge_tasks` on that wave), a
    fetch-only branch within `--branches`; with depth 2 the same budget runs none."""
    three = Driver(hotpot_settings.replace(bridge_depth=3, branches=4), mode="local")
    two = Driver(hotpot_settings.replace(bridge_depth=2, branches=4), mode="local")
    events = []
    try:
        result = three.search(CHAINED, on_event=events.append)
        shallow = two.search(CHAINED)
    finally:
        three.close()
        two.close()
    own, first, second, third = result.branches
    assert (second.kind, second.parent, second.status) == ("bridge", first.index, "ok")
    assert (third.kind, third.parent, third.status) == ("bridge", second.index, "ok")
    # its name and sub-query are the depth-2 branch's top chunk's, by the second wave's rule
    expected = deeper_bridge_tasks([own, first, second], CHAINED, first=third.index, room=1,
                                   wave=(second.index,))
    assert [(t.subquery, t.reason, t.hops) for t in expected] == [
        (third.subquery, third.reason, 1)]
    top = next(c for c in second.evidence if c["chunk_id"] == second.ranked_chunk_ids[0])
    assert third.reason.split(" = ", 1)[1] in top["text"]
    assert third.reason not in (first.reason, second.reason)
    turns = {s["turn"] for s in third.episode.trace if s.get("tool") == "search_corpus"}
    assert turns == {1} and third.ranked_chunk_ids  # it searches once, expands nothing
    event = next(e for e in events if e["type"] == "chain" and e["branch"] == third.index)
    assert event["parent"] == second.index and event["subquery"] == third.subquery
    assert result.metrics["bridges"] == 3
    assert [b.kind for b in shallow.branches] == ["original", "bridge", "bridge"]


def test_bridge_depth_is_one_two_or_three(tmp_path):
    with pytest.raises(SettingsError, match="bridge_depth must be 1, 2 or 3"):
        load_settings(None, {"home": str(tmp_path), "bridge_depth": 4})


def test_bridges_must_not_be_negative(tmp_path):
    with pytest.raises(SettingsError, match="bridges must be >= 0"):
        load_settings(None, {"home": str(tmp_path), "bridges": -1})


def test_eval_runs_the_default_branches_and_pairs_them_with_one_branch(hotpot_settings):
    """`eval --policy` measures what `search` runs: the setting `branches` (3), second wave
    and all, unless `--branches` says otherwise; `--baseline one-branch` runs the same agent
    with one branch beside it, says why the two latencies are no fair ratio, and a second wave
    the user asked for under `--branches 1` is noted as never running."""
    import os
    import subprocess
    import sys

    from conftest import HOTPOT, ingest_copy

    own = ingest_copy(hotpot_settings, "eval-second-wave")  # its own Milvus Lite file

    def run(*flags: str, bridges: str | None = None):
        env = {k: v for k, v in os.environ.items() if k != "BRANCHSEARCH_BRIDGES"}
        return subprocess.run(
            [sys.executable, "-m", "branchsearch.orchestrator.cli", "eval", str(HOTPOT),
             "--home", str(own.home), "--index", own.index,
             "--no-ingest", "--policy", "heuristic", "--limit", "3", *flags],
            capture_output=True, text=True, timeout=600,
            env=env | ({"BRANCHSEARCH_BRIDGES": bridges} if bridges is not None else {}))

    def table(out: str) -> dict[str, list[str]]:
        return {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.split()}

    paired = run("--baseline", "one-branch")
    assert paired.returncode == 0 and "note:" not in paired.stderr, paired.stderr[-2000:]
    rows = table(paired.stdout)
    assert rows["metric"] == ["heuristic", "x3", "heuristic", "x1"], paired.stdout
    assert float(rows["bridges"][0]) > 0 and float(rows["bridges"][1]) == 0, paired.stdout
    assert float(rows["branches"][0]) > 1 and float(rows["branches"][1]) == 1, paired.stdout
    assert "paired vs heuristic x1 on all_recall@5" in paired.stdout
    assert "note: latency: the baseline ran second in this process" in paired.stdout
    one = run("--branches", "1", bridges="2")
    assert one.returncode == 0, one.stderr[-2000:]
    assert "note: bridges = 2 in the settings, but one branch never has a second wave" in \
        one.stderr
    assert table(one.stdout)["metric"] == ["heuristic", "x1"], one.stdout


def test_a_branch_given_its_hops_follows_that_many_whatever_its_kind(hotpot_settings):
    """`make_policy(max_hops=N)` (a task's `hops`) sets the heuristic branch's hops; 0 keeps
    its kind's (3 for the question's branch, 2 for the others); the policy's search mode is
    a knob of its own, untouched by it."""
    from branchsearch.workers.factory import OTHER_MAX_HOPS, make_policy

    assert make_policy(hotpot_settings, kind="bridge", max_hops=1).max_hops == 1
    assert make_policy(hotpot_settings, kind="bridge").max_hops == OTHER_MAX_HOPS
    assert make_policy(hotpot_settings).max_hops == 3
    assert make_policy(hotpot_settings, max_hops=2).hop_mode == make_policy(
        hotpot_settings).hop_mode


def test_a_bridge_never_follows_a_date():
    """A month or weekday, alone or with a day or year, is a date, not the next hop. The next
    name by the same order is taken; a name that only holds a month's word ("Theresa May",
    "April Wine") is still one."""
    own = _top("Kim Hill", "Kim Hill was born on April 16, 1966 in Dayton. In July 1990 she "
               "married Jack Smith, who played in April Wine with Theresa May.")
    names = [name for name, _ in bridges(own, "Who did the singer Kim Hill marry?", 6)]
    assert names == ["Dayton", "Jack Smith", "April Wine", "Theresa May"]  # no April, no July


def test_a_name_is_the_title_only_as_whole_words():
    """The title's name hides a name of its chunk only as whole words: "WILM" (the station's
    page) does not hide "Wilmington", the city it broadcasts to (reports/bridges.md, v19); a
    title ending in punctuation still hides itself."""
    own = _top("WILM (AM)", "WILM (1450 AM) is a radio station licensed to Wilmington, "
               "Delaware, United States.")
    names = [name for name, _ in bridges(own, "What is the airport in the city where WILM is "
                                         "licensed to broadcast?", 3)]
    assert names[0] == "Wilmington"
    song = _top("What Are Little Boys Made Of?", "What Are Little Boys Made Of? is a nursery "
                "rhyme printed by James Orchard Halliwell.")
    names = [name for name, _ in bridges(song, "Which index lists the rhyme?", 5)]
    assert "What Are Little Boys Made Of?" not in names and "James Orchard Halliwell" in names
