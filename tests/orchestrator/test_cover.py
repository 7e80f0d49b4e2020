"""Covered branches (`orchestrator.cover`): the rule as plain functions, then the driver that
applies it, in-process (the covered branch never runs) and on Ray (it runs and is dropped),
with the same fused result either way."""

import pytest

from branchsearch.orchestrator.cover import core, covered_by, covering, head_titles
from branchsearch.orchestrator.plan import HeuristicPlanner
from branchsearch.workers.branch import BranchReport
from branchsearch.workers.harness import EpisodeResult

from conftest import HOTPOT

Q = "Were Scott Derrickson and Ed Wood of the same nationality?"


def test_a_title_core_drops_its_qualifier_case_and_punctuation():
    assert core("Kiss and Tell (1945 film)") == ("kiss", "and", "tell")
    assert core("Ed Wood") == core("ED  wood") == core("Ed Wood (film)") == ("ed", "wood")
    assert core("Zürich–Ost") == ("zurich", "ost")
    # accents aside, however composed (a decomposed "é", a dotted capital I)
    assert core("Cafe\u0301 de Flore") == core("Café de Flore") == ("cafe", "de", "flore")
    assert core("İstanbul Modern") == core("Istanbul Modern") == ("istanbul", "modern")
    assert core("東京タワー") == ("東京タワー",)
    assert core("the Laleli Mosque") == core("Laleli Mosque") == ("laleli", "mosque")
    assert core("The") == ("the",)  # an article alone is a title, not nothing
    assert core("") == ()


def test_a_name_is_covered_only_by_a_title_with_exactly_its_words():
    titles = ["Ed Wood (film)", "Scott Derrickson", "Wood County"]
    assert covering(["Ed Wood"], titles) == ["Ed Wood (film)"]
    assert covering(["Scott Derrickson", "Ed Wood"], titles) == ["Scott Derrickson",
                                                                  "Ed Wood (film)"]
    assert covering(["Wood"], titles) is None  # a part of a title is not the title
    assert covering(["Ed Wood", "Tim Burton"], titles) is None  # every name, or none
    assert covering([], titles) is None  # a sub-query naming nothing is never covered


def test_the_head_is_the_first_distinct_documents():
    ranked = [("a", "A"), ("a", "A"), ("b", "B"), ("c", "C"), ("d", "D"), ("e", "E"),
              ("f", "F")]
    assert head_titles(ranked, 3) == ["A", "B", "C"]
    assert head_titles(ranked) == ["A", "B", "C", "D", "E"]  # the fusion's head: 5


def _report(kind="original", status="ok", titles=("Ed Wood", "Scott Derrickson")):
    evidence = [{"chunk_id": f"{t}#p0", "doc_id": t, "title": t} for t in titles]
    episode = EpisodeResult(Q, "stop", evidence=evidence,
                            ranked_chunk_ids=[e["chunk_id"] for e in evidence])
    return BranchReport(0, Q, kind=kind, status=status, episode=episode)


def test_only_the_question_s_own_branch_that_finished_covers():
    assert covered_by(_report(), ("Ed Wood",)) == [("Ed Wood", "Ed Wood#p0")]
    assert covered_by(_report(status="timeout"), ("Ed Wood",)) is None
    assert covered_by(_report(kind="comparison"), ("Ed Wood",)) is None
    far = ("A", "B", "C", "D", "E", "Ed Wood")  # sixth: below the head
    assert covered_by(_report(titles=far), ("Ed Wood",)) is None


def test_the_planner_names_what_each_branch_is_about():
    original, *others = HeuristicPlanner().plan(Q, 3)
    assert original.names == ()
    assert [s.names for s in others] == [("Scott Derrickson",), ("Ed Wood",)]
    clause = HeuristicPlanner().plan("What year was the director of Alien born, and which "
                                     "studio made Blade Runner?", 3)
    assert [s.kind for s in clause[1:]] == ["clause", "clause"]
    assert clause[1].names == ("Alien",) and clause[2].names == ("Blade Runner",)


@pytest.fixture(scope="module")
def bm25_driver(tmp_path_factory):
    """hotpot-mini, BM25 only, searched in-process with the default settings."""
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.orchestrator.driver import Driver

    # covering alone: the bridges that take a covered branch's room are test_chains'
    settings = load_settings(overrides={"home": tmp_path_factory.mktemp("cover"),
                                        "search_mode": "bm25", "bridges": 0}, read_env=False,
                             read_file=False)
    ingest(HOTPOT, settings, dense=False)
    driver = Driver(settings, mode="local")
    yield driver
    driver.close()


def test_in_process_a_covered_branch_never_runs_and_the_result_is_the_question_s_branch(
        bm25_driver):
    events = []
    result = bm25_driver.search(Q, on_event=events.append)
    assert [b.index for b in result.branches] == [0] and result.metrics["covered"] == 2
    assert result.status == "ok"
    started = [e["branch"] for e in events if e["type"] == "branch_started"]
    assert started == [0]  # the covered branches were never started
    covered = [e for e in events if e["type"] == "covered"]
    assert [(e["branch"], e["subquery"]) for e in covered] == [
        (1, "Scott Derrickson nationality"), (2, "Ed Wood nationality")]
    assert covered[0]["by"] == ["Scott Derrickson"] and covered[1]["by"][0].startswith("Ed Wood")
    assert covered[0]["ids"][0].startswith("scott-derrickson#")  # the guard checks these
    # the result (and `search --json`, a batch's lines) lists them as their events say
    assert [{"type": "covered", **c} for c in result.to_dict()["covered"]] == covered
    assert [e["type"] for e in events][-1] == "result"
    alone = bm25_driver.search(Q, max_branches=1)
    assert result.ranked_chunk_ids == alone.ranked_chunk_ids  # what was fused: one branch


def test_the_terminal_says_which_branches_were_covered_and_by_what(bm25_driver, capsys):
    from branchsearch.orchestrator.cli.render import print_result

    print_result(bm25_driver.search(Q))
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    covered = [line for line in lines if "[covered]" in line]
    assert len(covered) == 2 and covered[0].startswith(
        "branch 1 [covered] 'Scott Derrickson nationality': left out, the question's branch "
        "already ranks Scott Derrickson")
    assert covered[1].startswith("branch 2 [covered] 'Ed Wood nationality'")


def test_a_branch_about_what_the_question_s_branch_missed_still_runs(bm25_driver):
    question = "Were Scott Derrickson and Tim Burton of the same nationality?"
    result = bm25_driver.search(question)
    assert [b.subquery for b in result.branches] == [question, "Tim Burton nationality"]
    assert result.metrics["covered"] == 1  # Scott Derrickson's page: in the question's top 5


def test_covering_off_runs_every_planned_branch(bm25_driver):
    bm25_driver.settings = bm25_driver.settings.replace(skip_covered=False)
    try:
        result = bm25_driver.search(Q)
    finally:
        bm25_driver.settings = bm25_driver.settings.replace(skip_covered=True)
    assert [b.status for b in result.branches] == ["ok", "ok", "ok"]
    assert result.metrics["covered"] == 0
    covered = bm25_driver.search(Q)
    # the covered branches added nothing to the head of the fused list
    assert result.ranked_chunk_ids[:5] == covered.ranked_chunk_ids[:5]


def test_forks_are_numbered_after_every_planned_branch_covered_or_not(bm25_driver):
    bm25_driver.settings = bm25_driver.settings.replace(forks=3, fork_gap=1.0)
    try:
        events = []
        result = bm25_driver.search(Q, on_event=events.append)
    finally:
        bm25_driver.settings = bm25_driver.settings.replace(forks=0, fork_gap=0.15)
    covered = {e["branch"] for e in events if e["type"] == "covered"}
    forks = [b.index for b in result.branches if b.kind == "fork"]
    assert covered == {1, 2} and forks and min(forks) == 3  # no number used twice
    assert len({b.index for b in result.branches} | covered) == len(result.branches) + 2
