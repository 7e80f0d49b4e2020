"""An owned index is searched where its ingest put it, whatever `es_url` / `milvus_uri` say for
other indexes; `branchsearch indexes` asks the servers an owned index lives on; no backend error
line carries a password; a Milvus Lite server outlives a ^C sent to its process group."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from conftest import HOTPOT

from branchsearch.infra.config.settings import load_settings
from branchsearch.infra.errors import BackendUnavailable
from branchsearch.infra.index.catalog import external_indexes, owned_indexes
from branchsearch.infra.index.manifest import read_manifest
from branchsearch.infra.index.open import open_retriever
from branchsearch.infra.ingest.pipeline import ingest

DOWN_ES = "http://elastic:hunter2@127.0.0.1:9"  # nothing listens there
DOWN_MILVUS = "http://user:secret@127.0.0.1:9"


def _settings(home, index, **more):
    return load_settings(overrides={"home": home, "index": index, **more}, read_env=False,
                         read_file=False)


def test_a_tantivy_index_is_searched_in_tantivy_when_es_url_is_set(tmp_path):
    settings = _settings(tmp_path / "home", "wiki")
    ingest(HOTPOT, settings, dense=False)
    other = settings.replace(es_url=DOWN_ES, backend_timeout_s=2)  # set for another index
    retriever = open_retriever(other, need_dense=False)  # not the Elasticsearch es_url names
    try:
        hits = retriever.search("Who directed Ed Wood?", k=3, mode="bm25")
        assert "ed-wood" in {h.doc_id for h in hits}  # (an ES index would have been empty)
    finally:
        retriever.close()
    assert [i.health for i in owned_indexes(other)] == ["ok"]
    ingest(HOTPOT, other, dense=False)  # a re-ingest keeps it there too
    assert read_manifest(settings.index_dir).backends["lexical"] == "tantivy"


def test_a_lite_index_is_searched_in_its_file_when_milvus_uri_is_set(hotpot_settings):
    other = hotpot_settings.replace(milvus_uri=DOWN_MILVUS, backend_timeout_s=2)
    retriever = open_retriever(other)  # not the server milvus_uri names
    try:
        hits = retriever.search("Who directed Ed Wood?", k=3, mode="dense")
        assert "ed-wood" in {h.doc_id for h in hits}
    finally:
        retriever.close()


def test_indexes_asks_the_elasticsearch_an_owned_index_lives_on(tmp_path, es_url):
    settings = _settings(tmp_path / "home", "esidx", es_url=es_url)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "a", "title": "A", "text": "alpha beta"}) + "\n")
    ingest(corpus, settings, dense=False)
    assert [i.health for i in owned_indexes(settings)] == ["ok"]
    down = settings.replace(es_url=DOWN_ES, backend_timeout_s=2)
    [info] = owned_indexes(down)  # said "ok": only the files were looked at
    assert "not reachable" in info.health and "hunter2" not in info.health, info.health
    [info] = owned_indexes(down, check=False)
    assert info.health == "not checked"
    [info] = owned_indexes(settings.replace(es_url=""))
    assert "set es_url" in info.health


def test_indexes_counts_the_documents_a_service_wrote_since_the_ingest(tmp_path):
    """`branchsearch indexes` showed the last ingest's counts (the manifest's): documents
    PUT or deleted through a service since were not in them."""
    from branchsearch.infra.ingest.corpus import Document
    from branchsearch.orchestrator.service.documents import delete, upsert

    settings = _settings(tmp_path / "h", "ça-va")
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"d{i}", "title": f"T{i}", "text": "alpha"})
                              + "\n" for i in range(3)))
    ingest(corpus, settings, dense=False)
    assert [(i.documents, i.chunks) for i in owned_indexes(settings)] == [(3, 3)]
    retriever = open_retriever(settings, need_dense=False)
    try:
        upsert(retriever, settings, [Document("ü-1", "Ü", "beta"), Document("ü-2", "Ü", "b")])
        delete(retriever, settings, "d0")
    finally:
        retriever.close()
    assert [(i.documents, i.chunks) for i in owned_indexes(settings)] == [(4, 4)]


def test_backend_errors_carry_no_password(tmp_path):
    from branchsearch.infra.stores.elastic import ElasticStore

    with pytest.raises(BackendUnavailable) as caught:
        ElasticStore(DOWN_ES, index="x", timeout_s=2)
    assert "hunter2" not in str(caught.value) and "127.0.0.1:9" in str(caught.value)
    config = tmp_path / "b.toml"
    config.write_text(f"""
[indexes.corp]
lexical = "elasticsearch"
es_url = "{DOWN_ES}"
es_index = "corp"
dense = "none"
[indexes.corp.fields]
id = "_id"
title = "t"
text = "b"
""")
    settings = load_settings(config, overrides={"home": tmp_path / "home",
                                                "backend_timeout_s": 2}, read_env=False)
    [info] = external_indexes(settings)
    assert "not reachable" in info.health and "hunter2" not in info.health, info.health


def test_a_lite_server_outlives_a_sigint_to_its_process_group(tmp_path):
    """^C at a terminal reaches the whole process group; a batch finishes its questions then,
    and they need the Lite server (its death made each wait out the timeout and fail)."""
    from milvus_lite.server_manager import server_manager_instance

    from branchsearch.infra.stores.milvus import MilvusStore
    from branchsearch.infra.stores.milvus_lite import lite_key

    store = MilvusStore(tmp_path / "dense.db", 4, collection="chunks_t")
    try:
        process = server_manager_instance._servers[lite_key(store.uri)]._p
        os.kill(process.pid, signal.SIGINT)
        time.sleep(1.0)
        assert process.poll() is None  # alive after the ^C
        assert store.count() == 0
    finally:
        store.close()
