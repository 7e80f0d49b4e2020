"""Distributed chunk + embed on Ray Data: an actor pool embeds; server stores are written by the
workers, the embedded ones by the caller.

`ray_batches(docs, settings, workers=N)` streams `EmbeddedBatch`es back to `infra.ingest.pipeline`, which
commits them. Who writes what (`direct_stores`): a Milvus server (`milvus_uri`) and
Elasticsearch (`es_url`) take many writers, so each worker writes its own documents' vectors and
text to them, and no vector travels back through the object store; the embedded stores (a
Milvus Lite file, tantivy) allow one writer, so the caller writes those, and always the
docstore, whose commit of a document is what makes it count as ingested (a worker's write of a
document the docstore never committed is redone, by document id, on the next run). The pool's
actors each load the embedding model once (`ChunkEmbedder`), on a GPU when the cluster has GPUs
(`num_gpus` is derived from `ray.cluster_resources()`, so nothing pends on a CPU machine) and on
CPU otherwise. Chunking runs in the actors too, so the driver only parses and writes.

Output blocks may split or merge documents' chunks, so the driver regroups rows by document and
releases a document only when all of its chunks arrived. Chunk ids are `"{doc_id}#p{n}"` as in a
one-process ingest, and every write is by document id / chunk id, so the index is the same.
"""

from __future__ import annotations

import math
import shutil
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
                 static_model: dict[str, bytes] | None = None):
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
        size, overlap = self.chunking["chunk_tokens"], self.chunking["chunk_overlap"]
        for doc_id, title, text in zip(batch["id"], batch["title"], batch["text"]):
            chunks = chunk_text(str(doc_id), str(text), self.counter, size, overlap,
                                title=str(title), head_tokens=self.chunking["head_tokens"])
            for c in chunks:
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
            out["vector"] = self.embedder.embed(bodies)
        if self.dense is not None or self.lexical is not None:
            self._write(batch, out)
        return out

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
            self.dense.write(items, out.pop("vector"), ids)
        if self.lexical is not None:
            self.lexical.write(items, ids)


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
                embedder=None, dim: int = 0, static_folder: Path | None = None) -> Iterator:
    """Chunk and embed `docs` on a pool of `workers` actors, which also write the server
    stores (`direct_stores`); yield `EmbeddedBatch`es of about `batch_docs` complete documents,
    as the pool produces them. `embedder` (picklable, with `embed(texts)`) replaces the
    configured model in the actors (benchmarks); `dim` is the dense store's dimension;
    `static_folder`: the static model fitted to the index, which the actors embed with (its
    files travel with the actors' arguments)."""
    import json
    import time

    import numpy as np

    from branchsearch.infra.ingest.batches import EmbeddedBatch

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
    rows = [{"id": d.id, "title": d.title, "text": d.text, "acl": json.dumps(list(d.acl))}
            for d in docs]
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
            "static_model": _packed(static_folder) if static_folder else None})

    from branchsearch.infra.ingest.batches import BATCH_CHARS

    waiting: dict[str, list] = {}  # doc id -> [(chunk, vector)] until all its chunks arrived
    ready_chars = 0  # the ready chunks' text: a batch closes past BATCH_CHARS, as doc_batches
    ready_docs: list[Document] = []
    ready: list[tuple[Chunk, object]] = []
    started = time.perf_counter()
    for out in ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=2):
        vectors = out.get("vector")
        for i in range(len(out["chunk_id"])):
            doc_id = str(out["doc_id"][i])
            chunk = Chunk(str(out["chunk_id"][i]), doc_id, int(out["n"][i]), str(out["text"][i]),
                          int(out["start_token"][i]), int(out["n_tokens"][i]),
                          int(out["text_tokens"][i]), int(out["label_tokens"][i]),
                          None if out["head_tokens"][i] < 0
                          else (int(out["head_tokens"][i]), int(out["head_chars"][i])))
            parts = waiting.setdefault(doc_id, [])
            parts.append((chunk, None if vectors is None else vectors[i]))
            if len(parts) == int(out["doc_chunks"][i]):
                ready_docs.append(by_id[doc_id])
                parts = sorted(waiting.pop(doc_id), key=lambda p: p[0].n)
                ready += parts
                ready_chars += sum(len(c.text) for c, _ in parts)
        if len(ready_docs) >= batch_docs or ready_chars >= BATCH_CHARS:
            yield _batch(EmbeddedBatch, np, ready_docs, ready, embed, started, direct)
            ready_docs, ready, ready_chars = [], [], 0
            started = time.perf_counter()
    if waiting:
        raise BranchsearchError(f"ingest: the worker pool lost chunks of {len(waiting)} "
                                f"documents (e.g. {next(iter(waiting))!r}); run it again")
    if ready_docs:
        yield _batch(EmbeddedBatch, np, ready_docs, ready, embed, started, direct)


def _batch(cls, np, docs, pairs, embed: bool, started: float, written: frozenset[str]):
    import time

    embed = embed and "dense" not in written  # else the vectors are in Milvus already
    vectors = np.stack([v for _, v in pairs]).astype(np.float32) if embed and pairs else None
    # the pool's time (chunk + embed, overlapped with this process's writes) counts as embed
    return cls(list(docs), [c for c, _ in pairs], vectors,
               embed_s=time.perf_counter() - started, written=written)


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
