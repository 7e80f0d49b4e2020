"""Distributed ingest (Ray Data actor pool embeds, one writer commits) builds the same index as a
one-process ingest: same chunk ids and counts, same retrieval results."""

from __future__ import annotations

import numpy as np
import pytest

from branchsearch.infra.ingest.corpus import read_corpus
from branchsearch.infra.ingest.batches import chunk_documents
from branchsearch.infra.ingest.pipeline import ingest
from branchsearch.infra.ingest.distributed import ChunkEmbedder, actor_resources
from branchsearch.infra.index.manifest import read_manifest
from branchsearch.infra.index.open import open_retriever
from branchsearch.infra.config.settings import load_settings

from conftest import HOTPOT


def test_chunk_embedder_is_plain_python():
    settings = load_settings(read_env=False, read_file=False)
    docs = read_corpus(HOTPOT)[:5]
    udf = ChunkEmbedder({"encoding": settings.encoding, "chunk_tokens": 32,
                         "chunk_overlap": 4, "head_tokens": 20}, settings.embed_model, 16)
    out = udf({"id": np.array([d.id for d in docs]), "title": np.array([d.title for d in docs]),
               "text": np.array([d.text for d in docs])})
    expected = chunk_documents(docs, settings.replace(chunk_tokens=32, chunk_overlap=4,
                                                      result_token_cap=21))
    assert list(out["chunk_id"]) == [c.id for c in expected]
    assert list(out["label_tokens"]) == [c.label_tokens for c in expected]
    assert [(h, c) if h >= 0 else None for h, c in zip(out["head_tokens"], out["head_chars"])] \
        == [c.head for c in expected]
    assert any(c.head for c in expected)
    assert out["vector"].shape == (len(expected), 384)
    assert set(out["doc_chunks"]) and all(n >= 1 for n in out["doc_chunks"])


def test_the_pool_embeds_only_what_the_cache_lacks(tmp_path):
    """Plain Python, no Ray: `from_the_cache` commits fully cached documents itself and hands
    the pool the rest with their cached vectors (one ending in a zero byte survives the trip);
    the pool's UDF embeds only the misses."""
    from branchsearch.infra.ingest.batches import indexed
    from branchsearch.infra.ingest.distributed import from_the_cache
    from branchsearch.infra.models.embed_cache import EmbeddingCache

    settings = load_settings(overrides={"chunk_tokens": 32, "chunk_overlap": 4},
                             read_env=False, read_file=False)
    docs = read_corpus(HOTPOT)[:4]
    chunks = chunk_documents(docs, settings)
    bodies = [c.body for c in indexed(docs, chunks)]
    first = [i for i, c in enumerate(chunks) if c.doc_id == docs[0].id]
    last = [i for i, c in enumerate(chunks) if c.doc_id == docs[-1].id]
    assert len(last) > 1
    known = first + last[:1]  # all of the first document, one chunk of the last
    vectors = np.random.default_rng(0).random((len(known), 384)).astype(np.float32)
    vectors[:, -1] = 0.0  # its last byte is zero
    cache = EmbeddingCache(tmp_path / "e.sqlite", settings.embed_model)
    cache.put_many([bodies[i] for i in known], vectors)
    rows: list[dict] = []
    local = list(from_the_cache(docs, settings, cache, 16, rows))
    assert [d.id for b in local for d in b.docs] == [docs[0].id]
    assert local[0].cached == len(first) and local[0].embedded == 0
    assert np.array_equal(local[0].vectors, vectors[:len(first)])
    assert [r["id"] for r in rows] == [d.id for d in docs[1:]]
    udf = ChunkEmbedder({"encoding": settings.encoding, "chunk_tokens": 32, "chunk_overlap": 4,
                         "head_tokens": 20}, settings.embed_model, 16)
    out = udf({k: np.array([r[k] for r in rows]) for k in rows[0]})
    pooled = [i for i, c in enumerate(chunks) if c.doc_id != docs[0].id]
    assert list(out["chunk_id"]) == [chunks[i].id for i in pooled]
    assert list(out["fresh"]) == [i != last[0] for i in pooled]
    assert np.array_equal(out["vector"][pooled.index(last[0])], vectors[-1])
    assert np.allclose(out["vector"][0], udf.embedder.embed([bodies[pooled[0]]])[0], atol=1e-5)


def test_actor_resources_fit_the_cluster():
    assert actor_resources({"CPU": 2.0}, 2) == {"num_cpus": 1.0}
    assert actor_resources({"CPU": 2.0}, 4) == {"num_cpus": 0.5}  # never pends
    assert actor_resources({"CPU": 16.0, "GPU": 2.0}, 4)["num_gpus"] == 0.5


@pytest.mark.ray
@pytest.mark.parametrize("model", ["all-MiniLM-L6-v2", "static-minilm"])
def test_workers_build_the_same_index(tmp_path, model):
    """static-minilm: each ingest fits its own model to the corpus (the same one), and the
    workers embed with the fitted model, not the distilled one."""
    import ray

    home = tmp_path / "h"
    one = load_settings(overrides={"home": home, "index": "one", "chunk_tokens": 64,
                                   "chunk_overlap": 8, "result_token_cap": 40,
                                   "embed_model": model},
                        read_env=False, read_file=False)  # cap < window: long chunks have heads
    two = one.replace(index="two")
    a = ingest(HOTPOT, one)
    try:
        b = ingest(HOTPOT, two, workers=2, batch_docs=16)
    finally:
        ray.shutdown()
    assert a.chunks == b.chunks and b.workers == 2
    ma, mb = read_manifest(one.index_dir), read_manifest(two.index_dir)
    assert ma.chunks == mb.chunks and ma.documents == mb.documents
    assert ma.embedding == mb.embedding
    if model == "static-minilm":
        assert ma.embedding["fitted"] and a.fitted and b.fitted
        fitted = [s.index_dir / ma.embedding["fitted"] / "model.safetensors" for s in (one, two)]
        assert fitted[0].read_bytes() == fitted[1].read_bytes()
    ra, rb = open_retriever(one), open_retriever(two)
    try:
        ids = lambda r: sorted(c for d in r.titles() for c in r.read_document(d)["chunk_ids"])  # noqa
        assert ids(ra) == ids(rb)
        every = ids(ra)  # the same chunk texts, and each its own token count, from either way
        rows_a, rows_b = ra.get_chunks(every), rb.get_chunks(every)
        kept = ("text", "text_tokens", "label_tokens", "head")
        assert {c: [r[k] for k in kept] for c, r in rows_a.items()} == \
            {c: [r[k] for k in kept] for c, r in rows_b.items()}
        assert all(isinstance(r["text_tokens"], int) and isinstance(r["label_tokens"], int)
                   for r in rows_b.values())
        assert any(r["head"] for r in rows_b.values())
        for q in ("Were Scott Derrickson and Ed Wood of the same nationality?",
                  "Which magazine was started first?"):
            for mode in ("bm25", "dense", "hybrid"):
                ha, hb = ra.search(q, mode, 8), rb.search(q, mode, 8)
                assert [h.chunk_id for h in ha] == [h.chunk_id for h in hb], (q, mode)
                if mode != "hybrid":  # hybrid scores are RRF over deeper lists, where vectors
                    # embedded in other batches (1e-7 apart) may swap near-ties
                    assert np.allclose([h.score for h in ha], [h.score for h in hb],
                                       atol=1e-4), (q, mode)
    finally:
        ra.close()
        rb.close()


@pytest.mark.ray
@pytest.mark.es
def test_workers_write_server_stores_themselves(tmp_path, milvus_uri, es_url):
    """With a Milvus server and Elasticsearch, the pool's workers write vectors and text to them
    (the caller writes neither); the index equals a one-process ingest's. The pool's ingest has
    a home of its own: in the first one's, every vector would come from the embedding cache and
    the caller would write them all, with no pool."""
    import uuid

    import ray

    from branchsearch.infra.ingest.distributed import direct_stores

    tag = uuid.uuid4().hex[:6]
    base = load_settings(overrides={"home": tmp_path / "h", "chunk_tokens": 64,
                                    "chunk_overlap": 8, "milvus_uri": milvus_uri,
                                    "es_url": es_url, "milvus_consistency": "Strong"},
                         read_env=False, read_file=False)
    one, two = base.replace(index=f"one{tag}"), base.replace(index=f"two{tag}",
                                                            home=tmp_path / "h2")
    assert direct_stores(two, embed=True) == {"dense", "lexical"}
    assert direct_stores(two.replace(milvus_uri="", es_url=""), embed=True) == set()
    a = ingest(HOTPOT, one)
    try:
        b = ingest(HOTPOT, two, workers=2, batch_docs=16)
    finally:
        ray.shutdown()
    assert b.seconds.get("dense", 0) == 0 and b.seconds.get("lexical", 0) == 0  # not the caller
    ma, mb = read_manifest(one.index_dir), read_manifest(two.index_dir)
    assert ma.chunks == mb.chunks and mb.chunks["dense"] == mb.chunks["lexical"] == a.chunks
    ra, rb = open_retriever(one), open_retriever(two)
    try:
        for q in ("Were Scott Derrickson and Ed Wood of the same nationality?",
                  "Which magazine was started first?"):
            for mode in ("bm25", "dense", "hybrid"):
                ha, hb = ra.search(q, mode, 8), rb.search(q, mode, 8)
                assert [h.chunk_id for h in ha] == [h.chunk_id for h in hb], (q, mode)
    finally:
        for r in (ra, rb):
            r.dense.drop() if getattr(r, "dense", None) else None
            r.close()


def _cached_rows(home) -> int:
    import sqlite3

    with sqlite3.connect(home / "cache" / "embeddings.sqlite") as db:
        return db.execute("SELECT COUNT(*) FROM vectors").fetchone()[0]


@pytest.mark.ray
def test_workers_share_the_home_embedding_cache(tmp_path):
    """An ingest on the pool looks chunks up in the home's embedding cache before dispatching
    (a renamed corpus file re-embeds nothing, an edited document only its new chunks) and puts
    what the workers embed into it, so a later plain ingest embeds nothing; both paths count
    embedded vs cached chunks alike."""
    import json

    import ray

    home = tmp_path / "h"
    one = load_settings(overrides={"home": home, "index": "one", "chunk_tokens": 64,
                                   "chunk_overlap": 8}, read_env=False, read_file=False)
    try:
        a = ingest(HOTPOT, one, workers=2, batch_docs=16)
        assert (a.embedded, a.cached) == (a.chunks, 0)
        assert _cached_rows(home) == a.chunks  # the workers' vectors, written by the driver
        b = ingest(HOTPOT, one.replace(index="two"))  # the plain path finds them all
        assert (b.embedded, b.cached) == (0, b.chunks)
        assert b.to_dict()["embedded"] == 0 and b.to_dict()["cached"] == b.chunks
        rows = [json.loads(line) for line in (HOTPOT / "corpus.jsonl").read_text().splitlines()]
        rows[0]["text"] += " He also wrote pulp novels under several pen names."
        renamed = tmp_path / "renamed.jsonl"  # another source: every fingerprint changes
        renamed.write_text("".join(json.dumps(r) + "\n" for r in rows))
        c = ingest(renamed, one, workers=2, batch_docs=16)
        assert c.resumed == 0 and c.chunks == a.chunks
        edited = len(chunk_documents(read_corpus(renamed)[:1], one))
        assert 1 <= c.embedded <= edited and c.cached == c.chunks - c.embedded
        assert _cached_rows(home) == a.chunks + c.embedded
    finally:
        ray.shutdown()
    d = ingest(renamed, one.replace(index="three"))  # the edited chunks the pool cached
    assert (d.embedded, d.cached) == (0, d.chunks)
    rc, rd = open_retriever(one), open_retriever(one.replace(index="three"))
    try:  # vectors from the cache and from the pool search alike
        for q in ("Were Scott Derrickson and Ed Wood of the same nationality?",
                  "Who wrote pulp novels under pen names?"):
            hc, hd = rc.search(q, "dense", 8), rd.search(q, "dense", 8)
            assert [h.chunk_id for h in hc] == [h.chunk_id for h in hd]
            assert np.allclose([h.score for h in hc], [h.score for h in hd], atol=1e-4)
    finally:
        rc.close()
        rd.close()
