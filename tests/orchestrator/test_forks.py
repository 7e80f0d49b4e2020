"""Forks (orchestrator/forks.py, workers/heuristic/forks.py) through the real driver, the
in-process executor and the heuristic policy over the hotpot-mini fixture (tantivy + Milvus
Lite + docstore): bounds, the one-branch baseline, the `fork` span and event, and fusion."""

from __future__ import annotations

import json

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from branchsearch.infra import telemetry
from branchsearch.orchestrator.driver import Driver
from branchsearch.orchestrator.forks import FORK_WEIGHT, choose
from branchsearch.orchestrator.result import LINK_HEAD, fuse_branches, named_in
from branchsearch.workers.rank import doc_of

from conftest import HOTPOT

QUESTIONS = [json.loads(line)["text"] for line in (HOTPOT / "queries.jsonl").read_text()
             .splitlines()]
BUDGET = 2


@pytest.fixture(scope="module")
def spans():
    exporter = InMemorySpanExporter()
    telemetry.configure(span_exporter=exporter)
    return exporter


@pytest.fixture(scope="module")
def forking(hotpot_settings):
    # gap 1: every pruned, unexpanded chunk with hop room is a candidate, so the small fixture
    # forks; the budget is what bounds them
    driver = Driver(hotpot_settings.replace(forks=BUDGET, fork_gap=1.0, branches=3),
                    mode="local")
    yield driver
    driver.close()


@pytest.fixture(scope="module")
def runs(forking, spans):
    spans.clear()
    out = []
    for q in QUESTIONS:
        events = []
        out.append((forking.search(q, on_event=events.append), events))
    return out


def test_forks_happen_within_the_bounds(runs):
    forked = 0
    for result, _ in runs:
        first = [b for b in result.branches if b.kind != "fork"]
        forks = [b for b in result.branches if b.kind == "fork"]
        assert len(forks) <= BUDGET and result.metrics["forks"] == len(forks)
        forked += bool(forks)
        by_index = {b.index: b for b in first}
        for fork in forks:
            parent = by_index[fork.parent]  # depth 1: a fork's parent is a first-wave branch
            assert fork.status == "ok" and fork.subquery == parent.subquery
            assert fork.weight == pytest.approx(parent.weight * FORK_WEIGHT)
            (seed,) = fork.seeds
            assert seed in parent.pruned_ids  # what it was handed, its parent had pruned
            assert seed in {c["chunk_id"] for c in parent.fork_candidates}
            assert fork.reason.split(" ")[0] in ("near_keep_line", "look_alike",
                                                 "competing_bridge")
            assert seed in fork.retrieved_ids  # it started from the handed-over chunk
            assert fork.fork_candidates == []  # and forks never fork
        seeds = [doc_of(f.seeds[0]) for f in forks]
        assert len(seeds) == len(set(seeds))  # one fork a document
    assert forked >= len(runs) // 2  # the rule fires on this fixture: the bound is tested


def test_one_branch_never_forks(forking, hotpot_settings):
    plain = Driver(hotpot_settings.replace(forks=0), mode="local")
    try:
        for q in QUESTIONS[:4]:
            one = forking.search(q, max_branches=1)
            assert [b.kind for b in one.branches] == ["original"]
            assert one.metrics["forks"] == 0
            assert one.ranked_chunk_ids == plain.search(q, max_branches=1).ranked_chunk_ids
    finally:
        plain.close()


def test_a_fork_is_a_span_and_an_event(runs, spans):
    fork_spans = [s for s in spans.get_finished_spans() if s.name == "fork"]
    forks = [b for result, _ in runs for b in result.branches if b.kind == "fork"]
    assert len(fork_spans) == len(forks) > 0
    by_branch = {(s.context.trace_id, s.attributes["fork.branch"]): s for s in fork_spans}
    for result, events in runs:
        for fork in (b for b in result.branches if b.kind == "fork"):
            span = by_branch[int(result.trace_id, 16), fork.index]
            assert span.attributes["fork.parent"] == fork.parent
            assert span.attributes["fork.reason"] == fork.reason
            assert list(span.attributes["fork.handed"]) == fork.seeds
            kinds = [(e["type"], e.get("branch")) for e in events]
            # the fork event, then the fork runs as a branch whose events stream like any
            at = kinds.index(("fork", fork.index))
            assert kinds.index(("branch_started", fork.index)) > at
            assert ("branch_done", fork.index) in kinds
            event = events[at]
            assert event["parent"] == fork.parent and event["handed"] == fork.seeds
    fork_branch_spans = [s for s in spans.get_finished_spans()
                         if s.name == "branch" and s.attributes.get("branch.kind") == "fork"]
    assert len(fork_branch_spans) == len(forks)
    # each fork's branch span nests under its fork span (it was a sibling, joined by ids)
    for s in fork_branch_spans:
        fork_span = by_branch[s.context.trace_id, s.attributes["branch.index"]]
        assert s.parent is not None and s.parent.span_id == fork_span.context.span_id


def test_fork_finds_enter_the_fused_top_only_where_the_parent_names_them(runs, hotpot_settings):
    """A document only forks found is second-wave: it takes one of the first `final_k` places
    only when the text of the question's branch's first documents names its title, or to fill
    places that branch left empty (`fusion.admission`)."""
    limit, held = hotpot_settings.final_k, 0
    for result, _ in runs:
        first = [b for b in result.branches if b.kind != "fork"]
        if len(first) == len(result.branches):
            continue
        without, _ = fuse_branches(first, k=hotpot_settings.branch_rrf_k, limit=limit)
        first_docs = {doc_of(c) for b in first if b.status == "ok"
                      for c in b.ranked_chunk_ids}
        docs = list(dict.fromkeys(doc_of(c) for c in result.ranked_chunk_ids))
        fork_only = [d for d in docs if d not in first_docs]
        anchor = next(b for b in first if b.kind == "original")
        anchor_docs = list(dict.fromkeys(doc_of(c) for c in anchor.ranked_chunk_ids))
        head = " ".join(c["text"] for c in anchor.evidence
                        if doc_of(c["chunk_id"]) in anchor_docs[:LINK_HEAD])
        titles = {doc_of(c["chunk_id"]): c["title"] for b in result.branches for c in b.evidence}
        for d in fork_only:
            assert named_in(head, titles[d]) or len(first_docs) < limit, (d, titles[d])
        # every fork-only document comes from a fork's own ranking
        fork_docs = {doc_of(c) for b in result.branches if b.kind == "fork"
                     for c in b.ranked_chunk_ids}
        assert set(fork_only) <= fork_docs
        assert without != result.ranked_chunk_ids or not fork_only
        held += len(fork_docs - first_docs - set(docs))
    assert held > 0  # forks did find documents of their own, and the fused lists left them out


def test_choose_keeps_the_budget_the_order_and_one_fork_a_document(runs):
    for result, _ in runs:
        picked = choose(result.branches, 1)
        pool = sorted(c["gap"] for b in result.branches if b.kind != "fork"
                      for c in b.fork_candidates)
        assert len(picked) == min(1, len(pool))
        if picked:
            assert picked[0].gap == pool[0]
    assert choose(runs[0][0].branches, 0) == []


def test_the_acl_guard_covers_what_forks_carry():
    from branchsearch.orchestrator.service.events import guard

    hidden = lambda ids: {i for i in ids if i.startswith("secret")}  # noqa: E731
    event, dropped = guard({"type": "fork", "branch": 3, "parent": 0, "reason": "r",
                            "handed": ["secret#p0", "ok#p1"]}, hidden)
    assert event["handed"] == ["ok#p1"] and dropped == 1
    result = {"ranked_chunk_ids": ["ok#p0"], "evidence": [], "branches": [
        {"ranked_chunk_ids": ["ok#p0"], "pruned_ids": ["secret#p1"], "final_context_ids": [],
         "seeds": [], "fork_candidates": [{"chunk_id": "secret#p1", "title": "Secret"},
                                          {"chunk_id": "ok#p2", "title": "Ok"}]},
        {"ranked_chunk_ids": [], "pruned_ids": [], "final_context_ids": [], "kind": "fork",
         "seeds": ["secret#p1"], "fork_candidates": []}]}
    event, dropped = guard({"type": "result", "result": result}, hidden)
    assert "secret" not in json.dumps(event).lower() and dropped == 1
    assert event["result"]["branches"][0]["fork_candidates"] == [
        {"chunk_id": "ok#p2", "title": "Ok"}]


def test_no_fork_starts_past_the_questions_deadline(forking):
    # the first wave ends in time; the watcher then holds the driver past the deadline: no fork
    # starts (none reported as a timeout, which would make the result partial)
    import time

    deadline_s = 8.0
    started = time.time()

    def slow_watcher(event):
        if event["type"] == "branch_done" and event["branch"] == 0:
            time.sleep(max(started + deadline_s - time.time(), 0) + 0.1)

    result = forking.search(QUESTIONS[1], deadline_s=deadline_s, on_event=slow_watcher)
    assert [b.kind for b in result.branches] == ["original"]  # planned alone, finished ok
    assert result.status == "ok" and result.branches[0].fork_candidates  # it could have forked
    assert result.metrics["forks"] == 0
    # and says so: an ok result without its forks is not a whole one
    assert any(n.startswith(f"not searched for lack of time: {BUDGET} forks")
               for n in result.notes), result.notes
