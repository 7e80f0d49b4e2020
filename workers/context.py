"""The four stores of one episode.

* `ActiveContext`  — chunks visible to the policy, in the order they arrived; prunable.
* `RetrievalCache` — every chunk fetched this episode, full text, by id; append-only.
* `Provenance`     — for each chunk, how it arrived (turn, tool, query, rank, score, and the
                     chunks whose content led to it); append-only.
* `EpisodeTrace`   — ordered records of proposals, what was applied or rejected and why, the
                     query state and tokens before/after; append-only, exportable as JSONL.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from branchsearch.infra.stores.hits import Hit
from branchsearch.workers.policy import VisibleChunk


class ActiveContext:
    """Keeps its token total as chunks come and go: the budget asks for it at every hit."""

    def __init__(self) -> None:
        self._chunks: dict[str, VisibleChunk] = {}
        self._tokens = 0

    def add(self, chunk: VisibleChunk) -> None:
        before = self._chunks.get(chunk.id)
        self._tokens += chunk.tokens - (before.tokens if before is not None else 0)
        self._chunks[chunk.id] = chunk

    def remove(self, ids: list[str]) -> None:
        for cid in ids:
            gone = self._chunks.pop(cid, None)
            if gone is not None:
                self._tokens -= gone.tokens

    def get(self, cid: str) -> VisibleChunk | None:
        return self._chunks.get(cid)

    def __contains__(self, cid: str) -> bool:
        return cid in self._chunks

    def __len__(self) -> int:
        return len(self._chunks)

    def chunks(self) -> list[VisibleChunk]:
        return list(self._chunks.values())

    def ids(self) -> list[str]:
        return list(self._chunks)

    @property
    def tokens(self) -> int:
        return self._tokens


class RetrievalCache:
    """Retrieved chunks as the retriever returned them (`Hit`, full text), by chunk id."""

    def __init__(self) -> None:
        self._chunks: dict[str, Hit] = {}

    def add(self, hit: Hit) -> bool:
        """Store a chunk; False (and no change) if it was already cached."""
        if hit.chunk_id in self._chunks:
            return False
        self._chunks[hit.chunk_id] = hit
        return True

    def get(self, cid: str) -> Hit | None:
        return self._chunks.get(cid)

    def __contains__(self, cid: str) -> bool:
        return cid in self._chunks

    def __len__(self) -> int:
        return len(self._chunks)

    def ids(self) -> list[str]:
        return list(self._chunks)


@dataclass(frozen=True)
class ProvenanceRecord:
    chunk_id: str
    turn: int
    tool: str
    query: str
    rank: int
    score: float
    parents: tuple[str, ...] = ()


class Provenance:
    def __init__(self) -> None:
        self._records: list[ProvenanceRecord] = []
        self._by_chunk: dict[str, list[ProvenanceRecord]] = {}

    def add(self, record: ProvenanceRecord) -> None:
        self._records.append(record)
        self._by_chunk.setdefault(record.chunk_id, []).append(record)

    def of(self, cid: str) -> list[ProvenanceRecord]:
        return list(self._by_chunk.get(cid, ()))

    def records(self) -> list[dict]:
        return [asdict(r) for r in self._records]


class EpisodeTrace:
    def __init__(self) -> None:
        self._records: list[dict] = []

    def record(self, kind: str, **fields) -> dict:
        entry = {"seq": len(self._records), "t": round(time.time(), 3), "kind": kind, **fields}
        self._records.append(entry)
        return entry

    def records(self, kind: str | None = None) -> list[dict]:
        return [dict(r) for r in self._records if kind is None or r["kind"] == kind]

    def to_jsonl(self) -> str:
        return "".join(json.dumps(r, default=str) + "\n" for r in self._records)

    def export(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(self.to_jsonl())
        tmp.replace(path)
