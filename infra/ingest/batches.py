"""A corpus in batches, chunked and embedded: the unit an ingest commits, shows progress by and
resumes from.

`doc_batches` cuts the documents (never one document in two); `local_batches` chunks and embeds
each in this process (`embed_in_slices`: a long document's embedding reports as it goes), and
`overlapped` runs that on a producer thread a batch or two ahead of the writes. The Ray Data path
(`infra.ingest.distributed`) makes the same `EmbeddedBatch`es on an actor pool.
"""

from __future__ import annotations

import ctypes
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from branchsearch.infra.config.settings import Settings
from branchsearch.infra.ingest.chunking import Chunk, chunk_text, head_tokens
from branchsearch.infra.ingest.corpus import Document
from branchsearch.infra.models.tokenizer import TokenCounter
from branchsearch.infra.stores.protocols import IndexedChunk

BATCH_DOCS = 256  # documents per committed batch (a unit of resume)
BATCH_CHARS = 2_000_000  # text per committed batch, at most (past one document): ~2,000 chunks
# with the static embedder a batch of 256 takes well under a second and the stores' per-batch
# commit (a tantivy writer, a segment) dominates: 1024 cut its CPU per chunk by ~25 %
# (bench/ingest_throughput.py --batch-docs, reports/embedding.md)
STATIC_BATCH_DOCS = 1024
EMBED_SLICE = 256  # chunks embedded between two progress reports inside one batch (a multiple
# of embed_batch)


@dataclass
class EmbeddedBatch:
    """One batch ready to commit: documents, their chunks, and one vector per chunk (or None)."""

    docs: list[Document]
    chunks: list[Chunk]
    vectors: object | None  # float32 array (len(chunks), dim)
    embed_s: float = 0.0
    chunk_s: float = 0.0
    written: frozenset[str] = frozenset()  # stores the workers already wrote: dense, lexical
    embedded: int = 0  # chunks whose vectors were computed for this batch
    cached: int = 0  # chunks whose vectors came from the home's embedding cache


def chunk_documents(docs: Sequence[Document], settings: Settings,
                    counter: TokenCounter | None = None) -> list[Chunk]:
    counter = counter or TokenCounter(settings.encoding)
    return [c for d in docs for c in chunk_text(d.id, d.text, counter, settings.chunk_tokens,
                                                settings.chunk_overlap, title=d.title,
                                                head_tokens=head_tokens(settings))]


def indexed(docs: Sequence[Document], chunks: Sequence[Chunk]) -> list[IndexedChunk]:
    by_id = {d.id: d for d in docs}
    return [IndexedChunk(c.id, c.doc_id, by_id[c.doc_id].title, c.text, by_id[c.doc_id].acl)
            for c in chunks]


def embedder_name(embedder) -> str:
    return str(getattr(embedder, "model_name", None) or type(embedder).__name__)


def doc_batches(docs: Sequence[Document], batch_docs: int,
                batch_chars: int | None = None) -> Iterator[list[Document]]:
    """`docs` in order, `batch_docs` at a time, a batch closing early once its text passes
    `batch_chars` (default BATCH_CHARS): a corpus of books commits (and shows progress, and
    can resume) every few thousand chunks, and holds no more than that in memory, instead of
    256 books at once. A document is never split."""
    limit = BATCH_CHARS if batch_chars is None else batch_chars
    batch: list[Document] = []
    chars = 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc.text) + len(doc.title)
        if len(batch) >= batch_docs or chars >= limit:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def local_batches(docs: Sequence[Document], settings: Settings, embedder, batch_docs: int,
                  embedded: Callable[[int, int], None] | None = None
                  ) -> Iterator[EmbeddedBatch]:
    """Chunk and embed in this process, one batch (`doc_batches`) at a time; `embedded`: see
    `embed_in_slices`."""
    counter = TokenCounter(settings.encoding)
    for batch in doc_batches(docs, batch_docs):
        t = time.perf_counter()
        chunks = chunk_documents(batch, settings, counter)
        chunk_s = time.perf_counter() - t
        vectors, embed_s, counted = None, 0.0, (0, 0)
        if embedder is not None:
            t = time.perf_counter()
            before = _counts(embedder)
            vectors = embed_in_slices(embedder, [c.body for c in indexed(batch, chunks)],
                                      embedded)
            embed_s = time.perf_counter() - t
            after = _counts(embedder)
            counted = (after[0] - before[0], after[1] - before[1]) if after else (len(chunks), 0)
        yield EmbeddedBatch(batch, chunks, vectors, embed_s, chunk_s, embedded=counted[0],
                            cached=counted[1])


def _counts(embedder) -> tuple[int, int] | None:
    """(texts embedded, texts taken from the cache) so far by `embedder`; None for one that
    does not count (a benchmark's hashing embedder: it computes every vector)."""
    counts = getattr(embedder, "counts", None)
    return (counts["embedded"], counts["cached"]) if counts else None


def embed_in_slices(embedder, texts: list[str],
                    embedded: Callable[[int, int], None] | None = None):
    """`embedder.embed(texts)`; with `embedded`, a batch of more than EMBED_SLICE chunks (one
    long document is one batch) is embedded a slice at a time, and `embedded(done, total)`
    said after each: its progress is otherwise silent until the batch commits, minutes for a
    book on a CPU."""
    if embedded is None or len(texts) <= EMBED_SLICE:
        with _model_call():
            return embedder.embed(texts)
    import numpy as np

    parts = []
    for start in range(0, len(texts), EMBED_SLICE):
        with _model_call():
            parts.append(embedder.embed(texts[start:start + EMBED_SLICE]))
        embedded(min(start + EMBED_SLICE, len(texts)), len(texts))
    return np.concatenate(parts)


# `overlapped` stops its producer inside a model call, where it spends its time, and nowhere
# else: stopped in a progress bar's locked section it would leave the lock held and the exit hung
_calls_lock = threading.Lock()
_in_call: set[int] = set()  # threads inside `_model_call` now
_stopping: set[int] = set()  # producer threads `overlapped` has stopped


class _Stopped(BaseException):
    """Raised in a producer thread that `overlapped` stops (see `_model_call`)."""


@contextmanager
def _model_call():
    """Around one embedding call. In a producer thread `overlapped` stops, `_Stopped` is raised
    at its next Python line inside the call (between two layers of the model, not when the call
    returns, which can be a minute away on a CPU), or at once when it enters one."""
    me = threading.get_ident()
    with _calls_lock:
        if me in _stopping:
            raise _Stopped
        _in_call.add(me)
    try:
        yield
    finally:
        with _calls_lock:
            _in_call.discard(me)
        _checkpoint()


def _checkpoint() -> None:
    """A Python call: a `_Stopped` set on this thread before it got here is raised here."""


def _stop(thread: threading.Thread) -> None:
    """Stop `thread`, a producer, inside its model call (now, if it is in one) and wait for it."""
    with _calls_lock:
        _stopping.add(thread.ident)
        if thread.ident in _in_call and thread.is_alive():
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                       ctypes.py_object(_Stopped))
    thread.join()
    with _calls_lock:  # (the ident may be a new thread's next)
        _stopping.discard(thread.ident)
        _in_call.discard(thread.ident)


_DONE = object()


def overlapped(batches: Iterator[EmbeddedBatch], ahead: int = 2) -> Iterator[EmbeddedBatch]:
    """The same batches in the same order, produced on a thread up to `ahead` batches before
    the caller asks for them. An error in the producer is raised here.

    A caller that stops early (an error while writing, a ^C) stops the producer: at its next
    batch, or inside the model call it is in (`_model_call`), and waits for it. A producer left
    inside torch when the interpreter exits is killed there by the exit, and torch then aborts
    the process ("terminate called without an active exception", SIGABRT, not exit status 130)."""
    out: queue.Queue = queue.Queue(maxsize=max(1, ahead))
    stop = threading.Event()

    def produce() -> None:
        try:
            for batch in batches:
                while not stop.is_set():
                    try:
                        out.put(batch, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            item = _DONE
        except _Stopped:
            return
        except BaseException as exc:  # handed to the consumer, raised there
            item = exc
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    thread = threading.Thread(target=produce, name="ingest-embed", daemon=True)
    thread.start()
    try:
        while True:
            item = out.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        _stop(thread)
