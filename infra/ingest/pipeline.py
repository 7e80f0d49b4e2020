"""Ingest: read → chunk → embed → commit batch by batch → check counts → manifest (last).

Failure behaviour, in order:

* The input is fully parsed and validated before anything is touched (a malformed line changes
  nothing, not even the manifest).
* The ingest takes the index's lock (`infra.index.manifest.IngestLock`): a second ingest, or a reader,
  stops with one line naming this one. It opens the stores (a Milvus Lite file held by a running
  search stops it here, index untouched), then removes the manifest: from here until the end the
  index is *incomplete*, and every reader refuses it with one line that says what to run.
* Documents already committed with the same content and settings (same fingerprint) are kept:
  re-running a killed ingest resumes where it stopped.
* Each batch is committed docstore-first-and-last: its documents are removed from the docstore
  and marked pending, then the dense store (delete by doc id, insert), the lexical
  store (delete by doc id, add), then the docstore inserts them with their fingerprints. A kill
  anywhere leaves pending documents whose vectors and terms are rewritten by the next run, or
  purged if the next run's corpus no longer has them: no orphans.
* At the end the three stores must hold the same number of chunks; then the manifest (counts,
  embedding model and dimension, encoding, chunking, time) is written atomically, and the lock
  is released.

Embedding runs here (one process: `infra.ingest.batches`) or on a Ray Data actor pool
(`workers > 1`, see `infra.ingest.distributed`); in both cases this process is the one writer,
so the embedded single-writer stores (Milvus Lite, tantivy) work unchanged and the result is the
same index. Both look chunks up in the home's embedding cache first and put what they embed into
it (the pool's vectors by this process), and the report counts the chunks embedded and those
taken from the cache. In one process, chunking and embedding run on a producer thread one or
two batches ahead of the writes (`overlapped`): the model, the tokenizer and the stores' own
servers release the GIL, so the writes of batch n cost no wall time beside the embedding of
batch n+1. The batches, their
order and their vectors are the same as without the thread.

An index keeps what it was made with (`infra.ingest.agreement`): vectors or none, its encoding,
its embedding model (recorded in the manifest; its readers embed queries with it:
`infra.index.open.query_model`). Re-ingesting it otherwise is refused.
"""

from __future__ import annotations

import errno
import hashlib
import json
import re
import shutil
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

from branchsearch.infra.config.settings import Settings
from branchsearch.infra.errors import (BackendUnavailable, BranchsearchError, IndexNameTaken,
                                       redact)
from branchsearch.infra.index.manifest import (IngestLock, Manifest, check_name, index_id_for,
                                               next_version, read_manifest, remove_manifest,
                                               write_manifest)
from branchsearch.infra.ingest import agreement
from branchsearch.infra.ingest.batches import (BATCH_DOCS, STATIC_BATCH_DOCS, EmbeddedBatch,
                                               chunk_documents, embedder_name, indexed,
                                               local_batches, overlapped)
from branchsearch.infra.ingest.chunking import head_tokens, token_counts
from branchsearch.infra.ingest.corpus import Document, read_corpus
from branchsearch.infra.models.static import STATIC_BACKEND
from branchsearch.infra.models.tokenizer import TokenCounter


@dataclass
class IngestReport:
    documents: int = 0  # documents in the corpus
    chunks: int = 0  # chunks of those documents
    resumed: int = 0  # documents already committed with the same content (kept, not redone)
    # the index when this ingest began: "new" (nothing committed), "stopped" (an ingest stopped
    # unfinished had committed some of it) or "complete" (it had a manifest)
    before: str = "new"
    # documents a stopped ingest left pending and this corpus no longer has, and documents
    # held under another Unicode form of a corpus id (replaced by the corpus's own)
    purged: int = 0
    recounted: int = 0  # chunks committed before their token counts were kept, counted now
    # documents the index holds that this corpus lacks: kept (an ingest adds and updates; the
    # service's DELETE removes a document)
    absent: int = 0
    uncounted: str = ""  # why some such chunks were not (searches count them as before)
    stale_lock: str = ""  # the stopped ingest this one took over, if any
    fitted: dict = field(default_factory=dict)  # the static model fitted to the corpus, if any
    workers: int = 1
    embedded: int = 0  # chunks whose vectors this ingest computed
    cached: int = 0  # chunks whose vectors it took from the home's embedding cache
    counts: dict[str, int] = field(default_factory=dict)  # store -> chunks in the whole index
    seconds: dict[str, float] = field(default_factory=dict)  # stage -> seconds

    @property
    def chunks_per_s_without_embedding(self) -> float:
        busy = sum(v for k, v in self.seconds.items()
                   if k not in ("embed", "total", "wait", "open", "close", "count", "fit"))
        return (self.chunks - self._resumed_chunks) / busy if busy else 0.0

    _resumed_chunks: int = 0

    @property
    def chunks_per_s(self) -> float:
        total = self.seconds.get("total", 0.0)
        return (self.chunks - self._resumed_chunks) / total if total else 0.0

    def to_dict(self) -> dict:
        return {"documents": self.documents, "chunks": self.chunks, "before": self.before,
                "resumed": self.resumed, "absent": self.absent,
                "purged": self.purged, "recounted": self.recounted,
                "uncounted": self.uncounted, "workers": self.workers,
                "embedded": self.embedded, "cached": self.cached,
                "counts": self.counts, "fitted": self.fitted,
                "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
                "chunks_per_s": round(self.chunks_per_s, 1),
                "chunks_per_s_without_embedding": round(self.chunks_per_s_without_embedding, 1)}


def fingerprint(doc: Document, settings: Settings, embedding: str) -> str:
    """Content + everything that shapes its chunks, vectors and terms: equal means nothing to
    redo. A document with Chinese or Japanese text also carries the lexical store's way of
    splitting it (`cjk_terms`): one ingested before it gets its bigrams at the next ingest."""
    from branchsearch.infra.stores.tantivy import has_cjk

    parts = [doc.id, doc.title, doc.text, doc.source, doc.date, list(doc.acl), doc.meta,
             settings.encoding, settings.chunk_tokens, settings.chunk_overlap, embedding]
    if has_cjk(doc.title) or has_cjk(doc.text):
        parts.append("cjk-bigrams")
    key = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha1(key.encode()).hexdigest()


def ingest(path: str | Path, settings: Settings, *, dense: bool | None = None,
           batch_docs: int | None = None,
           progress: Callable[[int, int], None] | None = None, embedder=None,
           workers: int = 1, embed_batch: int | None = None,
           embedded: Callable[[int, int], None] | None = None) -> IngestReport:
    """Ingest a corpus into `settings.index` (resuming a stopped ingest of it).

    `dense`: embed and index vectors; None: as the index was made (vectors for a new one). An
    index keeps what it was made with: asking it for the other is refused.

    `progress(docs, chunks)` is called per committed batch, `embedded(done, total)` within a
    long batch's embedding (`embed_in_slices`, in this process); `embedder` replaces the configured
    one (benchmarks use a hashing embedder); `workers > 1` embeds on a Ray Data actor pool of
    that size (`embed_batch` texts per model call there). `batch_docs` documents are committed
    at a time (default `BATCH_DOCS`, `STATIC_BATCH_DOCS` with the static embedder)."""
    override = embedder
    report = IngestReport(workers=workers)
    started = time.perf_counter()
    t = time.perf_counter()
    docs = read_corpus(path)
    report.seconds["read"] = time.perf_counter() - t
    report.documents = len(docs)
    complete = [False]  # whether the index has a manifest (is usable) at this moment
    new = not settings.index_dir.exists()
    try:
        return _ingest_locked(path, settings, docs, report, started, complete, dense=dense,
                              batch_docs=batch_docs, progress=progress, embedder=embedder,
                              override=override, workers=workers, embed_batch=embed_batch,
                              embedded=embedded)
    except (StoresNotOpened, IndexNameTaken):
        if new:  # refused before anything was written: no half-made index is left
            shutil.rmtree(settings.index_dir, ignore_errors=True)
        raise
    except Exception as exc:
        line = _disk_full(exc, settings, complete[0])
        if line is None:
            raise
        raise BranchsearchError(line) from exc


class StoresNotOpened(BackendUnavailable):
    """A store of the index could not be opened (a server down): nothing was written."""


def _ingest_locked(path, settings: Settings, docs: list[Document], report: IngestReport,
                   started: float, complete: list[bool], *, dense, batch_docs, progress, embedder,
                   override, workers, embed_batch, embedded=None) -> IngestReport:
    from branchsearch.infra.index.open import as_recorded, open_stores, refuse_external

    refuse_external(settings)  # before the lock makes the index's folder
    root = settings.index_dir
    with IngestLock(root, settings.index, corpus=str(Path(path).resolve())) as lock:
        if lock.stale is not None:
            report.stale_lock = lock.stale.describe()
        previous = read_manifest(root)
        settings = as_recorded(settings, previous)  # its stores stay where they are
        complete[0] = previous is not None
        if previous is not None:  # a copied or renamed folder: refuse before touching it
            check_name(root, settings.index, previous)
        dense = agreement.dense_as_made(settings, root, previous, dense)  # before a store is made
        unfinished = agreement.unfinished_embedding(root) if previous is None else None
        agreement.same_encoding(settings, previous)
        # open first: a store that cannot be opened (a Milvus Lite file held by a running
        # search, a server down) stops the ingest before the index is marked incomplete
        t = time.perf_counter()
        try:
            docstore, lexical, dense_store, embedder = open_stores(
                settings, create=True, need_dense=dense, embedder=embedder)
        except BackendUnavailable as exc:
            raise StoresNotOpened(str(exc)) from exc
        try:
            agreement.same_model(settings, previous, embedder if dense_store else None)
            agreement.same_fitted(settings, previous, embedder if dense_store else None)
            agreement.same_unfinished_model(settings, unfinished, embedder if dense_store else None)
            report.seconds["open"] = time.perf_counter() - t
            if dense_store is not None and override is None and previous is None:
                embedder = _fit_static(settings, root, docs, embedder, docstore, report)
            if batch_docs is None:
                fast = dense_store is not None and \
                    getattr(embedder, "backend", "") == STATIC_BACKEND
                batch_docs = STATIC_BATCH_DOCS if fast else BATCH_DOCS
            report.before = index_state(previous is not None, docstore, report.stale_lock)
            remove_manifest(root)
            complete[0] = False
            embedding = f"{embedder_name(embedder)}/{dense_store.dim}" if dense_store else "-"
            prints = {d.id: fingerprint(d, settings, embedding) for d in docs}
            done = docstore.fingerprints(list(prints))
            cut = docstore.with_u_fffd()  # characters an earlier version's chunking cut
            todo = [d for d in docs if done.get(d.id) != prints[d.id]
                    or (d.id in cut and "\ufffd" not in d.text)]
            report.resumed = len(docs) - len(todo)
            redo = {d.id for d in todo}
            report._resumed_chunks = docstore.chunk_counts(
                [d.id for d in docs if d.id not in redo])
            report.chunks = report._resumed_chunks
            if progress and report.resumed:
                progress(report.resumed, report._resumed_chunks)
            _purge(docstore, lexical, dense_store, docs, redo, report)
            if workers > 1 and todo:
                from branchsearch.infra.ingest.distributed import ray_batches

                batches: Iterator[EmbeddedBatch] = ray_batches(
                    todo, settings, workers=workers, batch_docs=batch_docs,
                    embed=dense_store is not None, embed_batch=embed_batch, embedder=override,
                    dim=dense_store.dim if dense_store else 0,
                    static_folder=getattr(embedder, "static_folder", None),
                    cache=_embedding_cache(embedder, dense_store, override))
            else:
                batches = overlapped(local_batches(
                    todo, settings, embedder if dense_store else None, batch_docs, embedded))
            t = time.perf_counter()
            with closing(batches):  # a ^C or an error while writing stops the embedding here
                for batch in batches:
                    _add(report, "wait", t)  # the writer idle, waiting for chunks and vectors
                    _spent(report, "chunk", batch.chunk_s)
                    _spent(report, "embed", batch.embed_s)
                    report.embedded += batch.embedded
                    report.cached += batch.cached
                    _commit(batch, docstore, lexical, dense_store, prints, report)
                    report.chunks += len(batch.chunks)
                    if progress:
                        progress(len(batch.docs), len(batch.chunks))
                    t = time.perf_counter()
            t = time.perf_counter()
            report.recounted, report.uncounted = _count_earlier_chunks(docstore, settings)
            _add(report, "count", t)
            t = time.perf_counter()
            report.counts = _check_counts(settings, docstore, lexical, dense_store)
            report.absent = max(0, docstore.doc_count() - len(docs))
            embedding = None
            if dense_store is not None:
                embedding = {"model": embedder_name(embedder), "dim": dense_store.dim}
                if getattr(embedder, "static_folder", None) is not None:
                    embedding["fitted"] = embedder.static_folder.name  # in the index folder
            manifest = Manifest(
                documents=docstore.doc_count(), chunks=report.counts, embedding=embedding,
                encoding=settings.encoding, chunk_tokens=settings.chunk_tokens,
                chunk_overlap=settings.chunk_overlap,
                backends=_backends(settings, dense_store), corpus=str(Path(path).resolve()),
                version=next_version(previous, len(todo)))
            manifest.index_id = index_id_for(previous, manifest.layout())
        finally:
            for store in (lexical, dense_store, docstore):
                if store is not None:
                    store.close()
        _add(report, "close", t)  # counts checked, stores flushed and closed
        report.seconds["total"] = time.perf_counter() - started
        manifest.seconds = {k: round(v, 3) for k, v in report.seconds.items()}
        write_manifest(root, manifest)  # the last write: from here the index is complete
    return report


def _embedding_cache(embedder, dense_store, override):
    """The home's embedding cache for the pool path, which the driver looks up and fills (one
    writer); None without vectors, with the static model (no cache) or a replaced embedder."""
    if dense_store is None or override is not None:
        return None
    vector_cache = getattr(embedder, "vector_cache", None)
    return vector_cache() if vector_cache else None


def index_state(complete: bool, docstore, stale_lock: str) -> str:
    """What an ingest finds: "complete" (a manifest), "stopped" (no manifest, but an ingest
    that stopped unfinished committed documents, left some pending, or left its lock) or
    "new" (nothing committed yet)."""
    if complete:
        return "complete"
    return "stopped" if docstore.doc_count() or docstore.pending() or stale_lock else "new"


def _fit_static(settings: Settings, root: Path, docs: Sequence[Document], embedder, docstore,
                report: IngestReport):
    """The embedder this ingest embeds with: with static-minilm, a new index's first ingest
    fits the static model to a sample of its corpus (`infra.models.static_tune`) and embeds
    with that; an index that holds chunks already keeps the model they were embedded with."""
    from branchsearch.infra.index.open import index_embedder
    from branchsearch.infra.models import static_tune
    from branchsearch.infra.models.embedder import DEFAULT_MODEL, resolve_model_path
    from branchsearch.infra.models.static import STATIC_MODEL, ensure_static

    wanted = settings.static_tune_chunks
    if (embedder_name(embedder) != STATIC_MODEL or not wanted
            or getattr(embedder, "static_folder", None) is not None or docstore.chunk_count()):
        return embedder
    counter = TokenCounter(settings.encoding)
    sample: list[str] = []
    for i in static_tune.sample_order([d.id for d in docs]):
        sample += [c.body for c in indexed([docs[i]], chunk_documents([docs[i]], settings,
                                                                     counter))]
        if len(sample) >= wanted:
            break
    sample = sample[:wanted]
    if len(sample) < static_tune.MIN_CHUNKS:
        static_tune.say(f"ingest: {settings.index!r} has {len(sample)} chunks, fewer than "
                        f"{static_tune.MIN_CHUNKS}: {STATIC_MODEL} is not fitted to it (the "
                        "distilled model embeds it, and its later chunks)")
        return embedder
    texts = sample + static_tune.windows(sample)
    static_tune.say(f"ingest: fitting {STATIC_MODEL} to index {settings.index!r}: MiniLM reads "
                    f"{len(sample):,} of its chunks and {len(texts) - len(sample):,} word windows "
                    f"of them once (static_tune_chunks)")
    t = time.perf_counter()
    teacher = index_embedder(settings.replace(embed_model=DEFAULT_MODEL), reader=False)
    teacher.cache_at(None)  # computed afresh, in the same batches: the same corpus, the same model
    base = ensure_static(embedder.export_root, resolve_model_path(DEFAULT_MODEL))
    report.fitted = static_tune.fit(
        base, texts, teacher.embed, root / static_tune.FITTED_DIR,
        note=lambda line: static_tune.say(f"ingest: fitting {STATIC_MODEL}: {line}"))
    report.seconds["fit"] = time.perf_counter() - t
    return index_embedder(settings, reader=False)  # now the fitted one


def _count_earlier_chunks(docstore, settings: Settings, batch: int = 2000) -> tuple[int, str]:
    """Give the chunks committed without token counts (by an earlier version), or with the
    head of another `result_token_cap`, their counts, so searches stop encoding them (the
    index's encoding is this ingest's: `agreement.same_encoding`). Returns (how many, why not
    all: a docstore this process may not write, where searches count them as before; "" when
    all)."""
    counter = TokenCounter(settings.encoding)
    n = head_tokens(settings)
    done = 0
    try:
        while rows := docstore.uncounted(batch, n):
            docstore.set_counts({cid: token_counts(counter, cid, text, title, n)
                                 for cid, text, title in rows})
            done += len(rows)
    except sqlite3.OperationalError as exc:
        if "readonly" not in str(exc) and "read-only" not in str(exc):
            raise
        return done, "the docstore is read-only"
    return done, ""


_FULL_TEXT = re.compile(r"no space left on device|disk quota exceeded|database or disk is full|"
                        r"os error (?:28|122)\b", re.I)  # OSError, SQLite, tantivy (Rust)
_LARGE_TEXT = re.compile(r"file too large|os error 27\b", re.I)
_NEARLY_FULL = 16 << 20  # bytes free below which a store's unexplained write error is the disk


def _disk_full(exc: BaseException, settings: Settings, complete: bool) -> str | None:
    """The one line for an ingest stopped by a full disk or a file size limit; None for any
    other error. The OS, SQLite and tantivy say which; Milvus Lite's server answers a bare
    "Unexpected error in RPC handling" (or is killed by SIGXFSZ), and SQLite past a file size
    limit says "disk I/O error", so such a store error counts when the disk holding the index
    has under 16 MiB free, or when this process runs under a finite `ulimit -f`."""
    kind = ""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen and not kind:
        seen.add(id(error))
        code = getattr(error, "errno", None) if isinstance(error, OSError) else None
        if code == errno.EFBIG or _LARGE_TEXT.search(str(error)):
            kind = "large"
        elif code in (errno.ENOSPC, errno.EDQUOT) or _FULL_TEXT.search(str(error)) or (
                isinstance(error, sqlite3.Error) and getattr(error, "sqlite_errorcode", 0) == 13):
            kind = "full"  # 13: SQLITE_FULL
        error = error.__cause__ or error.__context__
    local = isinstance(exc, BackendUnavailable) and str(settings.index_dir) in str(exc)
    unexplained = local or (  # a store in the index folder (Milvus Lite), or SQLITE_IOERR (10)
        isinstance(exc, sqlite3.Error) and getattr(exc, "sqlite_errorcode", 0) & 0xFF == 10)
    if not kind and unexplained:
        if _size_limit():
            kind = "large"
        elif _free_bytes(settings.index_dir) < _NEARLY_FULL:
            kind = "full"
    if not kind:
        return None
    root, limit = settings.index_dir, _size_limit()
    if kind == "full":
        what = f"the disk is full ({_free_bytes(root) // 1024:,} KiB free)"
        fix = "Free space on that disk"
    elif limit:
        what = f"a file reached this process's file size limit (ulimit -f: {limit:,} bytes)"
        fix = "Raise the limit"
    else:
        what = "a file grew past the largest file this file system holds"
        fix = "Move the data home to another file system"
    state = ("it is as it was, complete" if complete else "it is left incomplete (every "
             "command refuses it until an ingest finishes)")
    return (f"ingest: {what} while writing index {settings.index!r} ({root}); {state}. {fix} "
            "and run the same command again: it resumes where it stopped")


def _free_bytes(path: Path) -> int:
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 1 << 62


def _size_limit() -> int:
    """This process's `ulimit -f` in bytes; 0 when unlimited."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    except (ImportError, OSError, ValueError):
        return 0
    return 0 if soft == resource.RLIM_INFINITY else soft


def _commit(batch: EmbeddedBatch, docstore, lexical, dense_store, prints: dict[str, str],
            report: IngestReport) -> None:
    ids = [d.id for d in batch.docs]
    items = indexed(batch.docs, batch.chunks)
    t = time.perf_counter()
    docstore.begin_batch(ids)
    _add(report, "docstore", t)
    if dense_store is not None and "dense" not in batch.written:
        t = time.perf_counter()
        dense_store.write(items, batch.vectors, ids)
        _add(report, "dense", t)
    if "lexical" not in batch.written:
        t = time.perf_counter()
        lexical.write(items, ids)
        _add(report, "lexical", t)
    t = time.perf_counter()
    docstore.replace_documents(batch.docs, batch.chunks, {i: prints[i] for i in ids})
    _add(report, "docstore", t)


def _purge(docstore, lexical, dense_store, docs: Sequence[Document], redo: set[str],
           report: IngestReport) -> None:
    """Remove what a stopped ingest left of documents this run will not rewrite, and the
    documents held under another Unicode form of a corpus id (`corpus.document_id`: the
    corpus's document replaces them). Those are marked pending first, so a kill on the way
    leaves them to the next run's purge."""
    docstore.begin_batch(docstore.other_forms([d.id for d in docs]))
    stale = [d for d in docstore.pending() if d not in redo]
    if not stale:
        return
    if dense_store is not None:
        dense_store.delete_documents(stale)
    lexical.write([], stale)
    docstore.clear_pending(stale)
    report.purged = len(stale)


def _check_counts(settings: Settings, docstore, lexical, dense_store) -> dict[str, int]:
    counts = {"docstore": docstore.chunk_count(), "lexical": lexical.count()}
    if dense_store is not None:
        counts["dense"] = dense_store.count()
    if len(set(counts.values())) > 1:
        shown = ", ".join(f"{k} {v}" for k, v in counts.items())
        raise BranchsearchError(
            f"ingest: the stores of index {settings.index!r} disagree after the ingest (chunks: "
            f"{shown}); another writer shares its Elasticsearch index or Milvus collection? "
            f"The index stays incomplete: give it its own backends, or remove it and ingest "
            f"again")
    return counts


def _backends(settings: Settings, dense_store) -> dict[str, str]:
    # the manifest is readable by anyone who can list the index: no credentials in it
    out = {"lexical": f"elasticsearch {redact(settings.es_url)}" if settings.es_url
           else "tantivy"}
    if dense_store is not None:
        kind = "milvus" if dense_store.server else "milvus-lite"
        out["dense"] = f"{kind} {redact(dense_store.uri)} ({dense_store.index_kind})"
    return out


def _add(report: IngestReport, stage: str, started: float) -> None:
    _spent(report, stage, time.perf_counter() - started)


def _spent(report: IngestReport, stage: str, seconds: float) -> None:
    report.seconds[stage] = report.seconds.get(stage, 0.0) + seconds
