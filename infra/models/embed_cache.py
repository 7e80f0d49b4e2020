"""A persistent embedding cache: sha1(model, text) -> float32 vector, in SQLite.

Re-ingesting a corpus, or asking the same query again, never embeds the same text twice.
"""

from __future__ import annotations

import hashlib
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path


class EmbeddingCache:
    def __init__(self, path: str | Path, model: str):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.model = model
        self._db = sqlite3.connect(self.path, check_same_thread=False, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS vectors (key BLOB PRIMARY KEY, vec BLOB)")
        self._lock = threading.Lock()

    def _key(self, text: str) -> bytes:
        return hashlib.sha1(f"{self.model}\0{text}".encode()).digest()

    def get_many(self, texts: Sequence[str]) -> dict[int, bytes]:
        """Index in `texts` -> cached vector bytes, for the texts that are cached."""
        keys = [self._key(t) for t in texts]
        found: dict[bytes, bytes] = {}
        with self._lock:
            for i in range(0, len(keys), 500):
                batch = keys[i:i + 500]
                marks = ",".join("?" * len(batch))
                found.update(self._db.execute(
                    f"SELECT key, vec FROM vectors WHERE key IN ({marks})", batch).fetchall())
        return {i: found[k] for i, k in enumerate(keys) if k in found}

    def empty(self) -> bool:
        """Whether the cache holds no vector at all (of any model): nothing to look up."""
        with self._lock:
            return self._db.execute("SELECT 1 FROM vectors LIMIT 1").fetchone() is None

    def put_many(self, texts: Sequence[str], vectors) -> None:
        rows = [(self._key(t), v.tobytes()) for t, v in zip(texts, vectors)]
        with self._lock, self._db:
            self._db.executemany("INSERT OR REPLACE INTO vectors VALUES (?, ?)", rows)

    def close(self) -> None:
        self._db.close()
