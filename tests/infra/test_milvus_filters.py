"""Milvus's ACL and exclusion filters give exactly what the rule gives, on Milvus Lite and on a
Milvus server: each caller's top k (public, one group, two groups, a group nobody holds, admin;
with and without excluded chunks) equals a brute-force search over the same rows, and equals
the per-row filters the store used before (`array_contains_any(acl, …)`, `chunk_id not in
…`). Group names are non-ASCII, quoted and look-alike. A collection made before `acl_key` keeps
working with the array filter; a group set written by another process is searched once this
process's copy of the sets is refreshed."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from branchsearch.infra.stores import milvus as milvus_mod
from branchsearch.infra.stores.acl import ACL_ALL, acl_visible
from branchsearch.infra.stores.protocols import MAX_K, IndexedChunk
from branchsearch.infra.stores.milvus import (ACL_KEY_PUBLIC, IndexSpec, MilvusStore, acl_key,
                                              acl_sets_collection)

DIM = 8
N = 400
GROUPS = ["café", "fіnance", "finance", 'say "hi"', "g1", "😀 crew"]  # fіnance: Cyrillic і
CALLERS = [None, ["café"], ["fіnance"], ["finance", "g1"], ["café", "😀 crew"], ["nobody"],
           [ACL_ALL]]


def _corpus(seed: int = 7):
    """N chunks of N // 2 documents: 60 % public, the rest one or two of GROUPS."""
    rng = np.random.default_rng(seed)
    chunks = []
    for i in range(N):
        d = i // 2
        pick = d % 10
        acl = () if pick < 6 else (GROUPS[d % len(GROUPS)],) if pick < 9 else \
            (GROUPS[d % len(GROUPS)], GROUPS[(d + 1) % len(GROUPS)])
        chunks.append(IndexedChunk(f"doc{d}#p{i % 2}", f"doc{d}", "", "", acl))
    vectors = rng.standard_normal((N, DIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return chunks, vectors


def _brute(chunks, vectors, query, k, groups, exclude) -> list[str]:
    scores = vectors @ query
    keep = [i for i, c in enumerate(chunks)
            if acl_visible(c.acl, groups) and c.chunk_id not in set(exclude)]
    keep.sort(key=lambda i: -scores[i])
    return [chunks[i].chunk_id for i in keep[:k]]


def _check_against_brute_force(store: MilvusStore) -> None:
    chunks, vectors = _corpus()
    store.write(chunks, vectors, [])
    assert store.count() == N and store.keyed
    rng = np.random.default_rng(3)
    for q in range(4):
        query = rng.standard_normal(DIM).astype(np.float32)
        query /= np.linalg.norm(query)
        for groups in CALLERS:
            top = _brute(chunks, vectors, query, 30, groups, ())
            excludes = [(), top[:5], top[::3] + ["doc0#p0", "no-such#p0"],
                        top[:3] + [f"gone{i}#p0" for i in range(MAX_K)]]  # past MAX_K: `not in`
            for exclude in excludes:
                want = _brute(chunks, vectors, query, 10, groups, exclude)
                got = store.search(query, 10, exclude, groups)
                assert [h.chunk_id for h in got] == want, (groups, len(exclude))
                assert [h.rank for h in got] == list(range(1, len(want) + 1))
                before = store.search(query, 10, exclude, groups, per_row=True)
                assert [h.chunk_id for h in before] == want, (groups, len(exclude))
                assert [h.score for h in got] == pytest.approx([h.score for h in before])


def _filters_of(store: MilvusStore) -> dict:
    return {str(g): store.acl_filter(g) for g in (None, ["café"], ["nobody"], [ACL_ALL])}


def test_acl_key_is_one_key_per_group_set():
    assert acl_key(["__public__"]) == acl_key(["a", "__public__"]) == ACL_KEY_PUBLIC
    assert acl_key(["b", "a", "a"]) == acl_key(["a", "b"]) != acl_key(["a"])
    assert acl_key(["café"]) != acl_key(["cafe\u0301"])  # another name, another key
    assert acl_key(["fіnance"]).isascii() and len(acl_key(["fіnance"])) == 33


def test_filters_match_brute_force_milvus_lite(tmp_path):
    store = MilvusStore(tmp_path / "d.db", DIM, collection="filters")
    try:
        _check_against_brute_force(store)
        f = _filters_of(store)
        assert f["None"] == f'acl_key == "{ACL_KEY_PUBLIC}"' and f[str([ACL_ALL])] == ""
        assert f["['café']"].startswith("acl_key in [") and "acl" not in f["['café']"][7:]
        assert f["['nobody']"] == f["None"]
    finally:
        store.drop()
        store.close()


def test_filters_match_brute_force_milvus_server(milvus_uri):
    name = f"filters_{uuid.uuid4().hex[:8]}"
    store = MilvusStore(milvus_uri, DIM, collection=name, index=IndexSpec(
        "FLAT", consistency="Strong"))  # exact, and reads right after the write
    try:
        _check_against_brute_force(store)
        info = store._client.describe_collection(name)
        key = next(f for f in info["fields"] if f["name"] == "acl_key")
        assert key.get("is_partition_key") is True  # the filter prunes partitions
        assert "acl_key" in store._client.list_indexes(name)  # and reads a scalar index
    finally:
        store.drop()
        store.close()


def _legacy_collection(uri: str, name: str, chunks, vectors) -> None:
    """A collection as the store made it before `acl_key` (chunk id, doc id, acl, vector)."""
    from pymilvus import DataType, MilvusClient

    client = MilvusClient(uri=uri)
    try:
        schema = client.create_schema(auto_id=False, enable_dynamic_field=False)
        schema.add_field("chunk_id", DataType.VARCHAR, is_primary=True, max_length=1024)
        schema.add_field("doc_id", DataType.VARCHAR, max_length=1024)
        schema.add_field("acl", DataType.ARRAY, element_type=DataType.VARCHAR,
                         max_capacity=64, max_length=256)
        schema.add_field("vector", DataType.FLOAT_VECTOR, dim=DIM)
        index = client.prepare_index_params()
        index.add_index(field_name="vector", index_type="FLAT", metric_type="IP")
        client.create_collection(name, schema=schema, index_params=index,
                                 consistency_level="Strong")
        client.insert(name, [{"chunk_id": c.chunk_id, "doc_id": c.doc_id, "acl": c.acl_terms,
                              "vector": v.tolist()} for c, v in zip(chunks, vectors)])
    finally:
        client.close()


@pytest.mark.parametrize("where", ["lite", "server"])
def test_a_collection_without_acl_key_keeps_working(where, tmp_path, request):
    uri = str(tmp_path / "old.db") if where == "lite" else request.getfixturevalue("milvus_uri")
    name = f"legacy_{uuid.uuid4().hex[:8]}"
    chunks, vectors = _corpus(11)
    _legacy_collection(uri, name, chunks[:300], vectors[:300])
    store = MilvusStore(uri, DIM, collection=name, create=False,
                        index=IndexSpec("FLAT", consistency="Strong"))
    try:
        assert not store.keyed and not store.has_key
        assert store.acl_filter(["café"]).startswith("array_contains_any(acl, ")
        store.write(chunks[300:], vectors[300:], [])  # rows without `acl_key`
        assert store.count() == N
        query = vectors[5]
        for groups in CALLERS:
            exclude = _brute(chunks, vectors, query, 4, groups, ())
            assert [h.chunk_id for h in store.search(query, 10, exclude, groups)] == \
                _brute(chunks, vectors, query, 10, groups, exclude), groups
        assert not store._client.has_collection(acl_sets_collection(name))
    finally:
        store.drop()
        store.close()


WRITER = """
import sys, numpy as np
from branchsearch.infra.stores.protocols import IndexedChunk
from branchsearch.infra.stores.milvus import IndexSpec, MilvusStore
s = MilvusStore(sys.argv[1], int(sys.argv[3]), collection=sys.argv[2], create=False,
                index=IndexSpec("FLAT", consistency="Strong"))
v = np.zeros((1, int(sys.argv[3])), dtype=np.float32); v[0, 0] = 1
s.write([IndexedChunk("late#p0", "late", "", "", ("zürich-late",))], v, [])
s.close()
"""


def test_a_group_set_written_elsewhere_is_searched_after_the_refresh(milvus_uri):
    """Another process (an ingest) adds a document of a new group set: this process, which had
    read the sets already, searches it once its copy is older than ACL_SETS_REFRESH_S; it never
    shows the document to a caller outside the group."""
    name = f"late_{uuid.uuid4().hex[:8]}"
    store = MilvusStore(milvus_uri, DIM, collection=name,
                        index=IndexSpec("FLAT", consistency="Strong"))
    try:
        chunks, vectors = _corpus()
        store.write(chunks[:20], vectors[:20], [])
        query = np.zeros(DIM, dtype=np.float32)
        query[0] = 1
        assert store.search(query, 5, acl_groups=["zürich-late"])  # reads the sets
        out = subprocess.run([sys.executable, "-c", WRITER, milvus_uri, name, str(DIM)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-500:]
        time.sleep(milvus_mod.ACL_SETS_REFRESH_S + 0.1)
        assert store.search(query, 1, acl_groups=["zürich-late"])[0].chunk_id == "late#p0"
        assert "late#p0" not in {h.chunk_id for h in store.search(query, 30)}
        assert "late#p0" not in {h.chunk_id for h in store.search(query, 30, acl_groups=["g1"])}
    finally:
        store.drop()
        store.close()
