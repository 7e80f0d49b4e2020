"""The `fork` tool end to end: a scripted policy (standing in for the LLM policy, which calls
the same tool) forks through the real driver, the in-process executor and the hotpot-mini
fixture (tantivy + Milvus Lite + docstore). With forks on and three branches its candidate
becomes a fork branch seeded with the chunks it handed over, fused after its parent; with forks
off, or one branch, the tool is not offered and a call is rejected."""

from __future__ import annotations

import pytest

from branchsearch.orchestrator.driver import Driver
from branchsearch.workers.scripted import ScriptedPolicy, call

Q = "What government position was held by the woman who portrayed Corliss Archer in the film Kiss and Tell?"
REASON = "two Corliss Archer pages: the radio show's cast may hold the actress"


def seen(view) -> list[str]:
    return [c.id for c in view.visible]


class Scripts:
    """The policy factory: branch 0 searches, forks two of its five chunks and prunes them,
    then finishes with the other three; every other branch finishes with what it sees (a fork:
    what it read of its seeds; a planner branch: nothing)."""

    def __init__(self):
        self.policies: dict[int, ScriptedPolicy] = {}
        self.handed: list[str] = []

    def __call__(self, index: int, subquery: str) -> ScriptedPolicy:
        if index == 0:
            policy = ScriptedPolicy([
                [call("search_corpus", query="Corliss Archer", k=5)],
                self.fork,
                lambda v: [call("finish", ids=seen(v))]])
        else:
            policy = ScriptedPolicy([lambda v: [call("finish", ids=seen(v))]])
        self.policies[index] = policy
        return policy

    def fork(self, view):
        self.handed = seen(view)[3:5]
        return [call("fork", chunk_ids=self.handed, reason=REASON),
                call("prune_chunks", ids=self.handed, reason="the less likely pages")]


def search(settings, **kwargs):
    scripts, events = Scripts(), []
    driver = Driver(settings, mode="local", policy_factory=scripts)
    try:
        return driver.search(Q, on_event=events.append, **kwargs), scripts, events
    finally:
        driver.close()


def test_a_fork_call_runs_a_fork_branch_fused_after_its_parent(hotpot_settings):
    result, scripts, events = search(hotpot_settings.replace(forks=2, branches=3))
    parent = next(b for b in result.branches if b.index == 0)
    forks = [b for b in result.branches if b.kind == "fork"]
    assert len(forks) == 1 and result.metrics["forks"] == 1
    fork = forks[0]
    assert len(scripts.handed) == 2 and fork.seeds == scripts.handed
    assert fork.parent == 0 and fork.reason == f"model: {REASON}" and fork.status == "ok"
    assert fork.subquery == parent.subquery and fork.weight == pytest.approx(parent.weight / 2)
    # it ran seeded: its first turn read the handed-over chunks, in its own context
    assert set(scripts.handed) <= set(fork.retrieved_ids)
    assert fork.ranked_chunk_ids == scripts.handed
    assert not set(scripts.handed) & set(parent.final_context_ids)  # the parent pruned them
    # depth 1: the fork was not offered the tool
    assert all("fork" not in v.allowed_tools for v in scripts.policies[fork.index].views)
    # streamed: the fork event, then the fork's branch
    kinds = [(e["type"], e.get("branch")) for e in events]
    at = kinds.index(("fork", fork.index))
    assert events[at]["handed"] == scripts.handed and events[at]["parent"] == 0
    assert kinds.index(("branch_started", fork.index)) > at
    # fused: the parent anchors its three, the fork's two come after them
    kept = parent.ranked_chunk_ids
    assert len(kept) == 3 and result.ranked_chunk_ids[:3] == kept
    assert set(result.ranked_chunk_ids[3:]) == set(scripts.handed)


@pytest.mark.parametrize("settings_change, kwargs", [
    ({"forks": 0, "branches": 3}, {}),  # forks off
    ({"forks": 2, "branches": 3}, {"max_branches": 1}),  # one branch: the baseline
])
def test_no_fork_tool_without_forks(hotpot_settings, settings_change, kwargs):
    result, scripts, _ = search(hotpot_settings.replace(**settings_change), **kwargs)
    assert result.metrics["forks"] == 0
    assert [b for b in result.branches if b.kind == "fork"] == []
    views = scripts.policies[0].views
    assert all("fork" not in v.allowed_tools for v in views)
    assert all("fork" not in [s["name"] for s in v.tool_schemas] for v in views)
    rejected = views[2].last_results[0]
    assert not rejected.ok and rejected.content == (
        "Error: fork rejected: forks are off for this question (forks = 0 or one branch)")
    assert result.ranked_chunk_ids == next(b for b in result.branches
                                           if b.index == 0).ranked_chunk_ids


def test_the_acl_guard_covers_every_chunk_a_model_fork_hands_over():
    from branchsearch.orchestrator.service.events import guard

    hidden = lambda ids: {i for i in ids if i.startswith("secret")}  # noqa: E731
    mixed = {"chunk_id": "ok#p0", "chunk_ids": ["ok#p0", "secret#p2"], "by": "model"}
    clean = {"chunk_id": "ok#p1", "chunk_ids": ["ok#p1"], "by": "model"}
    result = {"ranked_chunk_ids": ["ok#p0"], "evidence": [], "branches": [
        {"index": 0, "ranked_chunk_ids": ["ok#p0"], "pruned_ids": [], "final_context_ids": [],
         "seeds": [], "fork_candidates": [mixed, clean]}]}
    event, dropped = guard({"type": "result", "result": result}, hidden)
    assert dropped == 1 and event["result"]["branches"][0]["fork_candidates"] == [clean]
