"""Evidence: the ranked chunks a branch returns, each with its provenance.

One chunk shape from the branch to the fused result: `{chunk_id, doc_id, title, text, rank,
score, provenance}`. Branches return these flat, in rank order; only branch fusion
(`orchestrator.result.fuse_branches`) groups chunks by document.
"""

from __future__ import annotations

from branchsearch.workers.context import Provenance, RetrievalCache


def build_evidence(ranked_ids: list[str], cache: RetrievalCache,
                   provenance: Provenance) -> list[dict]:
    """The ranked chunks with their text; chunk score = 1 / rank in the branch's ranking."""
    out = []
    for cid in ranked_ids:
        hit = cache.get(cid)
        if hit is None:
            continue
        rank = len(out) + 1
        out.append({
            "chunk_id": cid, "doc_id": hit.doc_id, "title": hit.title, "text": hit.text,
            "rank": rank, "score": round(1.0 / rank, 6),
            "provenance": [
                {"turn": r.turn, "tool": r.tool, "query": r.query, "rank": r.rank,
                 "score": r.score, "parents": list(r.parents)} for r in provenance.of(cid)]})
    return out
