"""The one result type every backend returns."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Hit:
    """A retrieved chunk. `rank` is 1-based within the list that produced it."""

    chunk_id: str
    doc_id: str
    score: float
    rank: int = 0
    source: str = ""  # bm25 | dense | hybrid | grep
    text: str = ""
    title: str = ""
    ranks: dict[str, int] = field(default_factory=dict)  # per-source rank for fused hits

    def to_dict(self) -> dict:
        return {"chunk_id": self.chunk_id, "doc_id": self.doc_id, "score": round(self.score, 6),
                "rank": self.rank, "source": self.source, "title": self.title, "text": self.text,
                "ranks": self.ranks}
