"""Ingest: read → chunk → embed → dense store → lexical store → docstore.

Order matters for failure behaviour. The input is fully parsed and validated before any store is
touched (a malformed line changes nothing). The docstore, which is what readers see, commits
last in one transaction: if anything fails before, the visible index is exactly as it was, and
re-running the same command finishes the job (every write replaces by document id, so a rerun
never duplicates chunks).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from branchsearch.infra.chunking import Chunk, chunk_text
from branchsearch.infra.corpus import read_corpus
from branchsearch.infra.settings import Settings
from branchsearch.infra.backends import IndexedChunk
from branchsearch.infra.tokenizer import TokenCounter


@dataclass
class IngestReport:
    documents: int = 0
    chunks: int = 0
    seconds: dict[str, float] = field(default_factory=dict)  # stage -> seconds

    @property
    def chunks_per_s_without_embedding(self) -> float:
        busy = sum(v for k, v in self.seconds.items() if k != "embed")
        return self.chunks / busy if busy else 0.0

    def to_dict(self) -> dict:
        return {"documents": self.documents, "chunks": self.chunks,
                "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
                "chunks_per_s_without_embedding": round(self.chunks_per_s_without_embedding, 1)}


def ingest(path: str | Path, settings: Settings, *, dense: bool = True, batch_docs: int = 512,
           progress: Callable[[int, int], None] | None = None, embedder=None) -> IngestReport:
    """Ingest a corpus into `settings.index`. `progress(docs, chunks)` is called per batch;
    `embedder` replaces the configured one (benchmarks use a hashing embedder)."""
    from branchsearch.infra.retriever import open_stores

    report = IngestReport()
    t = time.perf_counter()
    docs = read_corpus(path)
    report.seconds["read"] = time.perf_counter() - t

    docstore, lexical, dense_store, embedder = open_stores(settings, create=True, need_dense=dense,
                                                           embedder=embedder)
    counter = TokenCounter(settings.encoding)
    all_chunks: list[Chunk] = []
    indexed: list[IndexedChunk] = []
    try:
        for start in range(0, len(docs), batch_docs):
            batch = docs[start:start + batch_docs]
            t = time.perf_counter()
            chunks = [c for d in batch for c in chunk_text(
                d.id, d.text, counter, settings.chunk_tokens, settings.chunk_overlap)]
            titles = {d.id: d for d in batch}
            batch_indexed = [IndexedChunk(c.id, c.doc_id, titles[c.doc_id].title, c.text,
                                          titles[c.doc_id].acl) for c in chunks]
            _add(report, "chunk", t)
            if dense_store is not None:
                t = time.perf_counter()
                vectors = embedder.embed([c.body for c in batch_indexed])
                _add(report, "embed", t)
                t = time.perf_counter()
                dense_store.write(batch_indexed, vectors, [d.id for d in batch])
                _add(report, "dense", t)
            all_chunks += chunks
            indexed += batch_indexed
            if progress:
                progress(len(batch), len(chunks))
        t = time.perf_counter()
        lexical.write(indexed, [d.id for d in docs])
        _add(report, "lexical", t)
        t = time.perf_counter()
        docstore.replace_documents(docs, all_chunks)
        _add(report, "docstore", t)
    finally:
        for store in (lexical, dense_store, docstore):
            if store is not None:
                store.close()
    report.documents, report.chunks = len(docs), len(all_chunks)
    return report


def _add(report: IngestReport, stage: str, started: float) -> None:
    report.seconds[stage] = report.seconds.get(stage, 0.0) + time.perf_counter() - started
