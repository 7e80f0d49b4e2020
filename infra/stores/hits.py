"""The one result type every backend returns."""

from __future__ import annotations

from dataclasses import dataclass, field


def doc_of(chunk_id: str) -> str:
    """Document id of a chunk id `"{doc_id}#p{n}"` (the id itself when it has no `#p`; a
    document id never holds '#')."""
    head, sep, _ = chunk_id.rpartition("#p")
    return head if sep else chunk_id


def label(chunk_id: str, title: str) -> str:
    """What heads a chunk in an agent's context besides its text (counted against the budget)."""
    return f"{chunk_id} {title} "


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
    # Token counts the index kept at ingest, in the agent's encoding (None: count them here):
    text_tokens: int | None = None  # `text`'s tokens
    label_tokens: int | None = None  # `label(chunk_id, title)`'s tokens
    head: tuple[int, int] | None = None  # (n, chars): `text[:chars]` is its first n tokens

    def to_dict(self) -> dict:
        return {"chunk_id": self.chunk_id, "doc_id": self.doc_id, "score": round(self.score, 6),
                "rank": self.rank, "source": self.source, "title": self.title, "text": self.text,
                "ranks": self.ranks}
