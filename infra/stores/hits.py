"""The one result type every backend returns."""

from __future__ import annotations

from dataclasses import dataclass, field


def doc_of(chunk_id: str) -> str:
    """Document id of a chunk id `"{doc_id}#p{n}"` (the id itself when it has no `#p`; a
    document id never holds '#')."""
    head, sep, _ = chunk_id.rpartition("#p")
    return head if sep else chunk_id


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
    text_tokens: int | None = None  # `text`'s tokens in the agent's encoding, when the index
    # knows them (an owned index ingested with counts in that encoding); None: count them

    def to_dict(self) -> dict:
        return {"chunk_id": self.chunk_id, "doc_id": self.doc_id, "score": round(self.score, 6),
                "rank": self.rank, "source": self.source, "title": self.title, "text": self.text,
                "ranks": self.ranks}
