"""Forks: a second wave of branches that pursue what the first wave pruned but could not rule
out (issue 34).

A branch of the heuristic policy records, at each prune, the dropped chunks that scored within
`fork_gap` of its keep line and were never expanded (`workers.heuristic.forks`). Once the
question's first wave has ended, `fork_tasks` picks at most `settings.forks` of them over every
branch that finished ok — the smallest gap first, one per document — and makes each a fork:
a branch of kind "fork" with its parent's sub-query (the query state), handed the chunk, in
its own context (its own actor on Ray), following the hops left from it. Forks run in parallel
on the executor like any wave; the driver fuses them with the first wave by the same anchored
RRF (the question's branch anchors, a fork is one more list at `FORK_WEIGHT` of its parent's
weight). Bounds: `settings.forks` a question, depth 1 (a fork records no candidates), the gap.
The LLM policy records its candidates itself, with the `fork` tool (`workers.tools`): the same
shape, gap 0 (the model has no score), up to three chunks handed over.
`--branches 1` runs no fork: the single-context baseline stays single.

Why a second wave and not forks launched mid-episode: the parent's episode is deterministic and
unchanged (a fork can only add a list to fuse), the executors need nothing new (a wave is a
list of tasks), and the candidates are judged with the parent's final scores (a chunk it
recalled or expanded later is no longer a candidate). The cost is latency: a forked question
waits for its first wave, then its forks (reports/forks.md measures it).
"""

from __future__ import annotations

from dataclasses import dataclass

from branchsearch.workers.branch import BranchReport, BranchTask

FORK_WEIGHT = 0.5  # a fork's list in fusion, as a share of its parent's weight


@dataclass(frozen=True)
class Fork:
    parent: int  # the branch's index
    chunk_id: str
    reason: str
    gap: float
    hop_room: int
    seeds: tuple[str, ...] = ()  # what it is handed: the `fork` tool's `chunk_ids`, else
    # the chunk alone
    by: str = ""  # "model": recorded by the `fork` tool (no score, so no gap to show)

    @property
    def why(self) -> str:
        return self.reason if self.by == "model" else f"{self.reason} (gap {self.gap:.3f})"


def choose(reports: list[BranchReport], budget: int) -> list[Fork]:
    """At most `budget` forks from the ok, non-fork branches' candidates: the smallest gap
    first (then branch, chunk id), one per document; none for a document some branch already
    handed to a fork."""
    pool = [(c["gap"], r.index, c["chunk_id"], c) for r in reports
            if r.status == "ok" and r.kind != "fork" for c in r.fork_candidates]
    out, docs = [], set()
    for gap, index, cid, c in sorted(pool, key=lambda p: p[:3]):
        doc = cid.rsplit("#p", 1)[0]
        if len(out) >= budget:
            break
        if doc not in docs:
            docs.update(s.rsplit("#p", 1)[0] for s in c.get("chunk_ids") or (cid,))
            out.append(Fork(index, cid, c.get("reason", ""), gap, int(c.get("hop_room", 1)),
                            tuple(c.get("chunk_ids") or (cid,)), c.get("by", "")))
    return out


def fork_tasks(reports: list[BranchReport], budget: int, *, deadline: float | None = None,
               acl_groups: tuple[str, ...] | None = None,
               first: int | None = None) -> list[BranchTask]:
    """The forks' tasks, numbered from `first` (default: after the reports' branches; the
    driver passes the first wave's planned count, since a covered branch has no report)."""
    parents = {r.index: r for r in reports}
    first = max(parents, default=-1) + 1 if first is None else first
    return [BranchTask(first + i, parents[f.parent].subquery,
                       round(parents[f.parent].weight * FORK_WEIGHT, 4), "fork", acl_groups,
                       deadline, parent=f.parent, reason=f.why, seeds=f.seeds,
                       hop_room=f.hop_room)
            for i, f in enumerate(choose(reports, budget))]
