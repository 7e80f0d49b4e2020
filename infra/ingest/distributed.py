"""Distributed chunk + embed on Ray Data: an actor pool embeds; server stores are written by the
workers, the embedded ones by the caller.

`ray_batches(docs, settings, workers=N)` streams `EmbeddedBatch`es back to `infra.ingest.pipeline`, which
commits them. Who writes what (`direct_stores`): a Milvus server (`milvus_uri`) and
Elasticsearch (`es_url`) take many writers, so each worker writes its own documents' vectors
and text to them (the vectors travel back only for the embedding cache, below); the embedded
stores (a Milvus Lite file, tantivy) allow one writer, so the caller writes those, and always the
docstore, whose commit of a document is what makes it count as ingested (a worker's write of a
document the docstore never committed is redone, by document id, on the next run). The pool's
actors each load the embedding model once (`ChunkEmbedder`), on a GPU when the cluster has GPUs
(`num_gpus` is derived from `ray.cluster_resources()`, so nothing pends on a CPU machine) and on
CPU otherwise. Chunking runs in the actors too, so the driver only parses and writes.

The home's embedding cache (`infra.models.embed_cache`, an SQLite file: one writer) is the
driver's: before dispatching, it chunks the documents and looks their chunks up
(`from_the_cache`); documents whose chunks are all there are committed from it without the pool
(Ray is not even started when every one is), and a document with some chunks there goes to the
pool with those vectors, so the workers embed only the misses. What the workers embed comes
back with the rows and the driver puts it in the cache, under the key of the runtime that
computed it (a GPU worker's torch, say), so a later ingest of either kind finds it.

Output blocks may split or merge documents' chunks, so the driver regroups rows by document and
releases a document only when all of its chunks arrived. Chunk ids are `"{doc_id}#p{n}"` as in a
one-process ingest, and every write is by document id / chunk id, so the index is the same.
"""

from __future__ import annotations

import json
import math
import shutil
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

from branchsearch.infra.ingest.chunking import Chunk, head_tokens
from branchsearch.infra.ingest.corpus import Document
from branchsearch.infra.errors import BranchsearchError
from branchsearch.infra.config.settings import Settings


class ChunkEmbedder:
    """The pool's UDF: a batch of documents in, one row per chunk (with its vector) out.

    Plain Python: it runs without Ray (a test calls it directly) and holds its model for the
    life of the actor."""

    def __init__(self, chunking: dict, embed_model: str | None, embed_batch: int = 64,
                 device: str = "cpu", embedder=None, settings: Settings | None = None,
                 direct: frozenset[str] = frozenset(), dim: int = 0,
                 static_model: dict[str, bytes] | None = None, keep_vectors: bool = False):
        from branchsearch.infra.models.embedder import Embedder
        from branchsearch.infra.models.tokenizer import TokenCounter

        self.chunking = chunking  # encoding, chunk_tokens, chunk_overlap, head_tokens
        self.counter = TokenCounter(chunking["encoding"])
        backend = getattr(settings, "embed_backend", None)  # the driver's, not the worker's env
        folder = _unpacked(static_model) if static_model else None
        self.embedder = embedder or (Embedder(embed_model, embed_batch, device, backend=backend,
                                              static_folder=folder)
                                     if embed_model else None)
        if folder is not None:  # loaded now, then the private copy goes
            try:
                self.embedder.dim
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        self.keep_vectors = keep_vectors  # the driver caches them: they go back after a write
        self.dense = self.lexical = None  # the server stores this worker writes itself
        if direct:
            from branchsearch.infra.index.open import dense_store, lexical_store

            self.dense = dense_store(settings, dim) if "dense" in direct else None
            self.lexical = lexical_store(settings) if "lexical" in direct else None

    def __call__(self, batch: dict) -> dict:
        import numpy as np

        from branchsearch.infra.ingest.chunking import chunk_text

        cols: dict[str, list] = {k: [] for k in ("chunk_id", "doc_id", "n", "text",
                                                  "start_token", "n_tokens", "text_tokens",
                                                  "label_tokens", "head_tokens", "head_chars",
                                                  "doc_chunks")}
        bodies: list[str] = []
        held: dict[int, bytes] = {}  # row -> its vector from the driver's cache
        size, overlap = self.chunking["chunk_tokens"], self.chunking["chunk_overlap"]
        n_docs = len(batch["id"])
        known = batch.get("cached_n", [""] * n_docs)
        known_vecs = batch.get("cached_vec", [""] * n_docs)
        for doc_id, title, text, ns, vecs in zip(batch["id"], batch["title"], batch["text"],
                                                 known, known_vecs):
            chunks = chunk_text(str(doc_id), str(text), self.counter, size, overlap,
                                title=str(title), head_tokens=self.chunking["head_tokens"])
            cached = _held(str(ns), str(vecs))
            for c in chunks:
                if c.n in cached:
                    held[len(bodies)] = cached[c.n]
                for key in ("doc_id", "n", "text", "start_token", "n_tokens", "text_tokens",
                            "label_tokens"):
                    cols[key].append(getattr(c, key))
                head = c.head or (-1, -1)  # -1: no head (a numpy column holds no None)
                cols["head_tokens"].append(head[0])
                cols["head_chars"].append(head[1])
                cols["chunk_id"].append(c.id)
                cols["doc_chunks"].append(len(chunks))
                bodies.append(f"{title}\n{c.text}" if title else c.text)
        out = {k: np.asarray(v) for k, v in cols.items()}
        if self.embedder is not None:
            out["vector"], out["fresh"] = self._vectors(bodies, held)
            out["cache_key"] = np.asarray([str(getattr(self.embedder, "cache_key", ""))]
                                          * len(bodies))
        if self.dense is not None or self.lexical is not None:
            self._write(batch, out)
        return out

    def _vectors(self, bodies: list[str], held: dict[int, bytes]):
        """One vector per body: the driver's cached ones as they came, the rest embedded now
        (in one call); and which were embedded now."""
        import numpy as np

        todo = [i for i in range(len(bodies)) if i not in held]
        fresh = np.zeros(len(bodies), dtype=bool)
        fresh[todo] = True
        if not held:
            return self.embedder.embed(bodies), fresh
        dim = len(next(iter(held.values()))) // 4
        vectors = np.empty((len(bodies), dim), dtype=np.float32)
        for i, blob in held.items():
            vectors[i] = np.frombuffer(blob, dtype=np.float32)
        if todo:
            vectors[todo] = self.embedder.embed([bodies[i] for i in todo])
        return vectors, fresh

    def _write(self, batch: dict, out: dict) -> None:
        """Write this batch's documents to the server stores (by document id, so a retry
        replaces what an earlier attempt wrote); the vectors then stay here."""
        import json

        from branchsearch.infra.stores.protocols import IndexedChunk

        docs = {str(d): (str(t), tuple(json.loads(str(a))))
                for d, t, a in zip(batch["id"], batch["title"], batch["acl"])}
        items = [IndexedChunk(str(cid), str(did), docs[str(did)][0], str(text),
                              docs[str(did)][1])
                 for cid, did, text in zip(out["chunk_id"], out["doc_id"], out["text"])]
        ids = list(docs)
        if self.dense is not None:
            vectors = out["vector"] if self.keep_vectors else out.pop("vector")
            self.dense.write(items, vectors, ids)
        if self.lexical is not None:
            self.lexical.write(items, ids)


def _held(numbers: str, vectors: str) -> dict[int, bytes]:
    """A document's cached vectors as the driver sent them (`from_the_cache`): chunk number ->
    float32 bytes. They travel as base64 text: a numpy bytes column drops trailing zero bytes."""
    import base64

    ns = json.loads(numbers) if numbers else []
    if not ns:
        return {}
    raw = base64.b64decode(vectors)
    size = len(raw) // len(ns)
    return {n: raw[i * size:(i + 1) * size] for i, n in enumerate(ns)}


def from_the_cache(docs: Sequence[Document], settings: Settings, cache, batch_docs: int,
                   into: list[dict]) -> Iterator:
    """The documents whose chunks `cache` holds every vector of, as `EmbeddedBatch`es of at
    most `batch_docs` (committed without the pool); every other document is appended to `into`
    as a pool row, with the vectors the cache holds of its chunks (`cached_n`: their numbers,
    `cached_vec`: their bytes in that order, as base64). Chunks and looks up one batch at a
    time."""
    import base64

    import numpy as np

    from branchsearch.infra.ingest.batches import (EmbeddedBatch, chunk_documents, doc_batches,
                                                   indexed)
    from branchsearch.infra.models.tokenizer import TokenCounter

    counter = TokenCounter(settings.encoding)
    for batch in doc_batches(docs, batch_docs):
        t = time.perf_counter()
        chunks = chunk_documents(batch, settings, counter)
        found = cache.get_many([c.body for c in indexed(batch, chunks)])
        by_doc: dict[str, list[int]] = {}
        for i, c in enumerate(chunks):
            by_doc.setdefault(c.doc_id, []).append(i)
        whole = []  # (a document without chunks goes to the pool, as before)
        for d in batch:
            rows = by_doc.get(d.id, [])
            hits = [i for i in rows if i in found]
            if rows and len(hits) == len(rows):
                whole.append(d)
                continue
            into.append(_row(d) | {"cached_n": json.dumps([chunks[i].n for i in hits]),
                                   "cached_vec": base64.b64encode(
                                       b"".join(found[i] for i in hits)).decode()})
        if whole:
            rows = [i for d in whole for i in by_doc[d.id]]
            vectors = np.stack([np.frombuffer(found[i], dtype=np.float32) for i in rows])
            yield EmbeddedBatch(whole, [chunks[i] for i in rows], vectors,
                                chunk_s=time.perf_counter() - t, cached=len(rows))


def _row(d: Document) -> dict:
    return {"id": d.id, "title": d.title, "text": d.text, "acl": json.dumps(list(d.acl))}


def _packed(folder: Path) -> dict[str, bytes]:
    """A fitted static model's files, handed to the workers whole: one on another node cannot
    read the index folder."""
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir()) if p.is_file()}


def _unpacked(files: dict[str, bytes]) -> Path:
    """The packed model as a private folder of this machine (the caller loads and removes it)."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="branchsearch-static-"))
    for name, data in files.items():
        (folder / Path(name).name).write_bytes(data)
    return folder


def direct_stores(settings: Settings, embed: bool) -> frozenset[str]:
    """The stores the pool's workers write themselves: those on servers (many writers)."""
    from branchsearch.infra.stores.milvus_lite import is_server

    return frozenset(({"dense"} if embed and is_server(settings.milvus_uri or "") else set())
                     | ({"lexical"} if settings.es_url else set()))


def connect(settings: Settings) -> dict:
    """`ray.init` once (the cluster at `ray_address` / RAY_ADDRESS, else a local one)."""
    try:
        import ray
        import ray.data  # noqa: F401  (needs pyarrow)
    except ImportError as exc:
        raise BranchsearchError(
            f"ingest --workers needs Ray Data ({exc.name} is missing): "
            "pip install 'branchsearch[data]'") from None
    from branchsearch.infra.raycluster import connect as connect_ray

    return connect_ray(settings, object_store_mb=512)


def actor_resources(resources: dict, workers: int) -> dict:
    """Per-actor request that fits: a GPU share when the cluster has GPUs, else a CPU share."""
    gpus = float(resources.get("GPU", 0))
    cpus = float(resources.get("CPU", 1))
    if gpus >= 1:
        return {"num_gpus": round(min(1.0, gpus / workers), 3), "num_cpus": 0.5}
    return {"num_cpus": round(min(1.0, cpus / workers), 3)}


def ray_batches(docs: Sequence[Document], settings: Settings, *, workers: int,
                batch_docs: int = 256, embed: bool = True, embed_batch: int | None = None,
                embedder=None, dim: int = 0, static_folder: Path | None = None,
                cache=None) -> Iterator:
    """Chunk and embed `docs` on a pool of `workers` actors, which also write the server
    stores (`direct_stores`); yield `EmbeddedBatch`es of about `batch_docs` complete documents,
    as the pool produces them. `embedder` (picklable, with `embed(texts)`) replaces the
    configured model in the actors (benchmarks); `dim` is the dense store's dimension;
    `static_folder`: the static model fitted to the index, which the actors embed with (its
    files travel with the actors' arguments); `cache`: the home's embedding cache (an
    `EmbeddingCache`), looked up first (`from_the_cache`) and given what the workers embed."""
    import numpy as np

    from branchsearch.infra.ingest.batches import EmbeddedBatch

    rows: list[dict] = []
    # (an empty cache is not looked up: a first ingest would chunk the whole corpus here,
    # before the pool starts, only to find nothing)
    if cache is not None and embed and not cache.empty():
        yield from from_the_cache(docs, settings, cache, batch_docs, rows)
        if not rows:
            return  # every vector was in the cache: no pool
        pooled = {r["id"] for r in rows}
        docs = [d for d in docs if d.id in pooled]
    else:
        rows = [_row(d) for d in docs]
    resources = connect(settings)
    import ray.data
    from ray.data import ActorPoolStrategy

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.verbose_progress = False
    # our progress line is the user's; Ray Data's execution notices are not
    import logging

    logging.getLogger("ray.data").setLevel(logging.ERROR)
    request = actor_resources(resources, workers)
    device = "cuda" if "num_gpus" in request else "cpu"
    by_id = {d.id: d for d in docs}
    direct = direct_stores(settings, embed)
    # at least two blocks per worker, so a small corpus still keeps every actor busy
    blocks = max(math.ceil(len(rows) / batch_docs), min(len(rows), 2 * workers), 1)
    per_block = math.ceil(len(rows) / blocks)
    with warnings.catch_warnings():  # Ray 2.60 has no named parameter for max_restarts yet
        warnings.filterwarnings("ignore", message=".*ray_remote_args.* is deprecated")
        ds = _embed_pool(ray, ActorPoolStrategy, rows, blocks, per_block, workers, request, {
            "chunking": {"encoding": settings.encoding, "chunk_tokens": settings.chunk_tokens,
                         "chunk_overlap": settings.chunk_overlap,
                         "head_tokens": head_tokens(settings)},
            "embed_model": settings.embed_model if embed else None,
            "embed_batch": embed_batch or settings.embed_batch, "device": device,
            "embedder": embedder if embed else None, "settings": settings,
            "direct": direct, "dim": dim,
            "static_model": _packed(static_folder) if static_folder else None,
            "keep_vectors": cache is not None})
    caches = {} if cache is None else {cache.model: cache}
    try:
        yield from _regrouped(ds, np, EmbeddedBatch, by_id, caches, cache, batch_docs, embed,
                              direct)
    finally:
        for key, other in caches.items():
            if other is not cache:
                other.close()


def _regrouped(ds, np, cls, by_id, caches, cache, batch_docs, embed, direct) -> Iterator:
    """The pool's rows as batches of complete documents (see the module's docstring)."""
    from branchsearch.infra.ingest.batches import BATCH_CHARS

    # doc id -> [(chunk, vector, embedded now)] until all its chunks arrived
    waiting: dict[str, list] = {}
    ready_chars = 0  # the ready chunks' text: a batch closes past BATCH_CHARS, as doc_batches
    ready_docs: list[Document] = []
    ready: list[tuple[Chunk, object, bool]] = []
    started = time.perf_counter()
    for out in ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=2):
        vectors = out.get("vector")
        if caches and vectors is not None:
            _keep(caches, cache, out, by_id)
        fresh = out.get("fresh")
        for i in range(len(out["chunk_id"])):
            doc_id = str(out["doc_id"][i])
            chunk = Chunk(str(out["chunk_id"][i]), doc_id, int(out["n"][i]), str(out["text"][i]),
                          int(out["start_token"][i]), int(out["n_tokens"][i]),
                          int(out["text_tokens"][i]), int(out["label_tokens"][i]),
                          None if out["head_tokens"][i] < 0
                          else (int(out["head_tokens"][i]), int(out["head_chars"][i])))
            parts = waiting.setdefault(doc_id, [])
            parts.append((chunk, None if vectors is None else vectors[i],
                          fresh is None or bool(fresh[i])))
            if len(parts) == int(out["doc_chunks"][i]):
                ready_docs.append(by_id[doc_id])
                parts = sorted(waiting.pop(doc_id), key=lambda p: p[0].n)
                ready += parts
                ready_chars += sum(len(c.text) for c, _, _ in parts)
        if len(ready_docs) >= batch_docs or ready_chars >= BATCH_CHARS:
            yield _batch(cls, np, ready_docs, ready, embed, started, direct)
            ready_docs, ready, ready_chars = [], [], 0
            started = time.perf_counter()
    if waiting:
        raise BranchsearchError(f"ingest: the worker pool lost chunks of {len(waiting)} "
                                f"documents (e.g. {next(iter(waiting))!r}); run it again")
    if ready_docs:
        yield _batch(cls, np, ready_docs, ready, embed, started, direct)


def _keep(caches: dict, cache, out: dict, by_id: dict[str, Document]) -> None:
    """Put the vectors a pool batch embedded now into the driver's cache, keyed by the runtime
    that computed them (`cache_key`, as the worker's embedder names it), under the text the
    worker embedded (the title line, then the chunk's text)."""
    from branchsearch.infra.models.embed_cache import EmbeddingCache

    fresh = out["fresh"]
    by_key: dict[str, list[int]] = {}
    for i in range(len(fresh)):
        if fresh[i] and str(out["cache_key"][i]):
            by_key.setdefault(str(out["cache_key"][i]), []).append(i)
    for key, rows in by_key.items():
        if key not in caches:
            caches[key] = EmbeddingCache(cache.path, key)
        texts = []
        for i in rows:
            title, text = by_id[str(out["doc_id"][i])].title, str(out["text"][i])
            texts.append(f"{title}\n{text}" if title else text)
        caches[key].put_many(texts, out["vector"][rows])


def _batch(cls, np, docs, parts, embed: bool, started: float, written: frozenset[str]):
    embed_all = embed and "dense" not in written  # else the vectors are in Milvus already
    vectors = np.stack([v for _, v, _ in parts]).astype(np.float32) \
        if embed_all and parts else None
    embedded = sum(1 for _, _, fresh in parts if fresh) if embed else 0
    # the pool's time (chunk + embed, overlapped with this process's writes) counts as embed
    return cls(list(docs), [c for c, _, _ in parts], vectors,
               embed_s=time.perf_counter() - started, written=written, embedded=embedded,
               cached=len(parts) - embedded if embed else 0)


def _no_restarts() -> dict:
    return {"max_restarts": 0}


def _embed_pool(ray, pool, rows, blocks, per_block, workers, request, kwargs):
    """The dataset: `ChunkEmbedder` on an actor pool of `workers`. max_restarts 0: a
    restartable actor whose constructor arguments sit in the object store makes Ray's core
    print an error-level notice; a failed batch fails the ingest, which resumes on the next
    run."""
    return ray.data.from_items(rows, override_num_blocks=blocks).map_batches(
        ChunkEmbedder, batch_size=per_block, batch_format="numpy",
        fn_constructor_kwargs=kwargs, compute=pool(size=workers),
        ray_remote_args_fn=_no_restarts, **request)
