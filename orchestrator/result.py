"""Fusing branch rankings into one evidence list, and the result of a question."""

from __future__ import annotations

from dataclasses import dataclass, field

from branchsearch.fusion import rrf


@dataclass
class BranchReport:
    index: int
    subquery: str
    weight: float
    kind: str
    status: str  # ok | error | timeout
    error: str = ""
    termination: str = ""
    turns: int = 0
    tool_calls: int = 0
    context_tokens_final: int = 0
    tokens_read: int = 0
    latency_s: float = 0.0
    ranked_chunk_ids: list[str] = field(default_factory=list)
    retrieved_ids: list[str] = field(default_factory=list)
    pruned_ids: list[str] = field(default_factory=list)
    final_context_ids: list[str] = field(default_factory=list)
    context_tokens_per_turn: list[int] = field(default_factory=list)
    trace: list[dict] = field(default_factory=list, repr=False)
    pid: int = 0
    policy_s: float = 0.0
    fetch_s: float = 0.0
    backend_s: float = 0.0
    rpc_s: float = 0.0

    def summary(self) -> dict:
        return {k: v for k, v in self.__dict__.items()
                if k not in ("trace", "retrieved_ids", "context_tokens_per_turn")}


@dataclass
class SearchResult:
    question: str
    evidence: list[dict]
    ranked_chunk_ids: list[str]
    branches: list[BranchReport]
    metrics: dict
    trace_id: str

    @property
    def status(self) -> str:
        """ok (every branch ok) | partial (some failed; evidence from the rest) | failed."""
        ok = sum(b.status == "ok" for b in self.branches)
        return "ok" if ok and ok == len(self.branches) else "partial" if ok else "failed"

    def to_dict(self, full: bool = False) -> dict:
        return {"question": self.question, "status": self.status, "evidence": self.evidence,
                "ranked_chunk_ids": self.ranked_chunk_ids,
                "branches": [b.__dict__ if full else b.summary() for b in self.branches],
                "metrics": self.metrics, "trace_id": self.trace_id}


def fuse_branches(branches: list[BranchReport], chunks: dict[str, dict], k: int = 60,
                  limit: int = 10) -> tuple[list[str], list[dict]]:
    """RRF over the rankings of the branches that finished (weights from the planner).

    Returns the fused chunk ids and the evidence: documents in order of their best chunk, each
    chunk with its fused score and which branches found it at what rank."""
    ok = [b for b in branches if b.status == "ok" and b.ranked_chunk_ids]
    fused = rrf([b.ranked_chunk_ids for b in ok], weights=[b.weight for b in ok], k=k,
                limit=limit)
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
