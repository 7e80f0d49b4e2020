"""Evidence: the ranked chunks a branch returns, grouped by document, with provenance."""

from __future__ import annotations

from branchsearch.workers.context import Provenance, RetrievalCache


def build_evidence(ranked_ids: list[str], cache: RetrievalCache,
                   provenance: Provenance) -> list[dict]:
    """Documents in order of their best chunk; chunk score = 1 / rank in the branch's ranking."""
    docs: dict[str, dict] = {}
    for rank, cid in enumerate(ranked_ids, start=1):
        chunk = cache.get(cid)
        if chunk is None:
            continue
        doc = docs.setdefault(chunk["doc_id"], {"doc_id": chunk["doc_id"],
                                                "title": chunk["title"], "score": 1.0 / rank,
                                                "chunks": []})
        doc["chunks"].append({
            "chunk_id": cid, "rank": rank, "score": round(1.0 / rank, 6), "text": chunk["text"],
            "provenance": [
                {"turn": r.turn, "tool": r.tool, "query": r.query, "rank": r.rank,
                 "score": r.score, "parents": list(r.parents)} for r in provenance.of(cid)],
        })
    return list(docs.values())
