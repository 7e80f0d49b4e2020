"""The result of a question, and fusing branch rankings into its evidence."""

from __future__ import annotations

from dataclasses import dataclass, field

from branchsearch.fusion.anchored import anchored_rrf
from branchsearch.workers.branch import BranchReport

__all__ = ["BranchReport", "SearchResult", "fuse_branches"]


@dataclass
class SearchResult:
    question: str
    evidence: list[dict]  # documents in order of their best chunk, each with its chunks
    ranked_chunk_ids: list[str]
    branches: list[BranchReport]
    metrics: dict
    trace_id: str
    notes: list[str] = field(default_factory=list)  # what was changed about the question

    @property
    def status(self) -> str:
        """ok (every branch ok) | partial (some failed; evidence from the rest) | failed."""
        ok = sum(b.status == "ok" for b in self.branches)
        return "ok" if ok and ok == len(self.branches) else "partial" if ok else "failed"

    def to_dict(self, full: bool = False) -> dict:
        return {"question": self.question, "status": self.status, "notes": self.notes,
                "evidence": self.evidence, "ranked_chunk_ids": self.ranked_chunk_ids,
                "branches": [b.to_dict(full) for b in self.branches],
                "metrics": self.metrics, "trace_id": self.trace_id}


def fuse_branches(branches: list[BranchReport], k: int = 60,
                  limit: int = 10) -> tuple[list[str], list[dict]]:
    """Anchored RRF (`fusion.anchored`) over the rankings of the branches that finished
    (weights from the planner; the question's own branch anchors, the others add).

    Returns the fused chunk ids and the evidence: documents in order of their best chunk, each
    chunk (as the branches returned it: `workers.evidence`) with its fused score and which
    branches found it at what rank. This is the only place chunks are grouped by document."""
    ok = [b for b in branches if b.status == "ok" and b.ranked_chunk_ids]
    anchor = next((i for i, b in enumerate(ok) if b.kind == "original"), None)
    fused = anchored_rrf([b.ranked_chunk_ids for b in ok], weights=[b.weight for b in ok],
                         anchor=anchor, k=k, limit=limit)  # fusion/anchored.py
    chunks = {c["chunk_id"]: c for b in ok for c in b.evidence}
    docs: dict[str, dict] = {}
    for rank, item in enumerate(fused, start=1):
        chunk = chunks.get(item.id, {})
        doc_id = chunk.get("doc_id", item.id.rpartition("#p")[0])
        doc = docs.setdefault(doc_id, {"doc_id": doc_id, "title": chunk.get("title", ""),
                                       "score": round(item.score, 6), "chunks": []})
        doc["chunks"].append({
            "chunk_id": item.id, "rank": rank, "score": round(item.score, 6),
            "text": chunk.get("text", ""), "provenance": chunk.get("provenance", []),
            "found_by": [{"branch": ok[li].index, "subquery": ok[li].subquery, "rank": r}
                         for li, r in sorted(item.ranks.items())]})
    return [f.id for f in fused], list(docs.values())
