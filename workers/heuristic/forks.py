"""Fork candidates: the hypotheses a prune drops that the policy cannot rule out.

At a prune (not a forced one, past the hard limit) a dropped chunk is a candidate when the
choice was close: it was never expanded (what it bridges to was never searched), never
recalled, it has hop room left, and its score is within the confidence gap of the keep line —
the score of the last chunk kept:

    gap = (keep_line - score) / keep_line <= fork_gap

The rule is the gap; the reason is a label of what kind of choice it was: `look_alike` (a
kept chunk's title has the same core: 'X (2015)' kept, 'X (2017)' dropped), `competing_bridge`
(a bridge hit dropped while a sibling from the same parent chunk was kept), else
`near_keep_line`. The driver (`orchestrator.forks`) turns the best candidates of a question's
branches into fork branches; this module only records them.
"""

from __future__ import annotations

from branchsearch.workers.heuristic.config import HeuristicConfig
from branchsearch.workers.heuristic.state import EpisodeState
from branchsearch.workers.heuristic.titles import series_core

REPORTED = 4  # candidates a branch reports (the driver's budget is smaller)


def note(state: EpisodeState, config: HeuristicConfig, ranked: list[str], keep: int,
         drop: list[str]) -> None:
    """Record the candidates among `drop` (a prune of `ranked`, the first `keep` kept)."""
    if not config.fork_gap or len(ranked) <= keep or keep < 1:
        return
    line = state.scores.get(ranked[keep - 1], 0.0)
    if line <= 0:
        return
    kept = [cid for cid in ranked[:keep] if cid not in drop]
    for cid in drop:
        score = state.scores.get(cid, 0.0)
        gap = round((line - score) / line, 4)  # as reported: the driver compares this one
        if (gap > config.fork_gap or cid in state.expanded or cid in state.recalled
                or state.depth.get(cid, 0) >= config.max_hops - 1):
            continue
        old = state.fork_candidates.get(cid)
        if old is None or gap < old["gap"]:
            state.fork_candidates[cid] = {
                "chunk_id": cid, "gap": gap, "score": round(score, 4),
                "keep_line": round(line, 4), "reason": _reason(state, cid, kept),
                "hop_room": config.max_hops - 1 - state.depth.get(cid, 0)}


def _reason(state: EpisodeState, cid: str, kept: list[str]) -> str:
    chunk = state.chunks.get(cid)
    if chunk is not None:
        core = series_core(chunk.title)
        if core and any(state.chunks[k].doc_id != chunk.doc_id
                        and series_core(state.chunks[k].title) == core
                        for k in kept if k in state.chunks):
            return "look_alike"
    origin = state.origins.get(cid)
    if origin is not None and origin.kind == "bridge" and origin.parent and any(
            state.origins.get(k) is not None and state.origins[k].parent == origin.parent
            and state.origins[k].kind == "bridge" for k in kept):
        return "competing_bridge"
    return "near_keep_line"


def candidates(state: EpisodeState) -> list[dict]:
    """The episode's candidates at its end: still pruned, never expanded nor recalled; one per
    document, the smallest gap first (then chunk id), at most `REPORTED`."""
    out, docs = [], set()
    live = [c for cid, c in state.fork_candidates.items()
            if cid in state.pruned and cid not in state.expanded and cid not in state.recalled]
    for c in sorted(live, key=lambda c: (c["gap"], c["chunk_id"])):
        chunk = state.chunks.get(c["chunk_id"])
        doc = chunk.doc_id if chunk is not None else c["chunk_id"].rsplit("#p", 1)[0]
        if doc in docs:
            continue
        docs.add(doc)
        out.append({**c, "title": chunk.title if chunk is not None else ""})
        if len(out) == REPORTED:
            break
    return out
