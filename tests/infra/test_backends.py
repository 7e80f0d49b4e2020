"""Stores and the retriever on real embedded backends; the Elasticsearch adapter on the
noida-db emulator (or a real cluster when BRANCHSEARCH_ES_URL is set)."""

import json
import os
import uuid

import pytest

from branchsearch.infra.errors import BadQuery, CorpusError
from branchsearch.infra.ingest.pipeline import ingest
from branchsearch.infra.stores.tantivy import TantivyStore
from branchsearch.infra.index.open import open_retriever
from branchsearch.infra.config.settings import load_settings
from branchsearch.infra.stores.protocols import IndexedChunk

from conftest import HOTPOT

CHUNKS = [
    IndexedChunk("apple#p0", "apple", "Apple", "Apples grow on trees; harvest 1999.", ()),
    IndexedChunk("bank#p0", "bank", "River bank", "The bank of the river floods.", ("finance",)),
    IndexedChunk("bank#p1", "bank", "River bank", "Herons nest by the river.", ("finance",)),
    IndexedChunk("ballet#p0", "ballet", "Aschenbrödel", "A ballet by Johann Strauß by the Tekezé "
                 "falls.", ()),
]


def lexical_contract(store):
    store.write(CHUNKS, [])
    assert store.count() == 4
    assert [h.chunk_id for h in store.search("apple trees", 5)] == ["apple#p0"]
    # accents fold: a question typed without them finds the page, and with them too
    for query in ("Aschenbrodel", "aschenbrödel", "Tekeze", "Strauss"):
        assert [h.chunk_id for h in store.search(query, 5)] == ["ballet#p0"], query
    assert store.search("river", 5, acl_groups=["hr"]) == []
    assert {h.chunk_id for h in store.search("river", 5, acl_groups=["finance"])} == \
        {"bank#p0", "bank#p1"}
    assert store.search("river", 5) == []  # no groups: public documents only
    assert [h.chunk_id for h in store.search("river", 5, exclude_ids=["bank#p0"],
                                             acl_groups=["finance"])] == ["bank#p1"]
    assert [h.chunk_id for h in store.grep("19[0-9]{2}", 5)] == ["apple#p0"]
    assert store.grep("her.n.*", 5) == []
    assert [h.chunk_id for h in store.grep("her.n.*", 5, acl_groups=["*"])] == ["bank#p1"]
    assert [h.chunk_id for h in store.grep("[^x]pples", 5)] == ["apple#p0"]  # not an anchor
    assert store.grep("[^a]pples", 5) == []
    with pytest.raises(BadQuery):
        store.grep("(unclosed", 5)
    with pytest.raises(BadQuery):
        store.grep("a" * 500, 5)
    # re-writing a document replaces all of its chunks
    store.write([IndexedChunk("bank#p0", "bank", "Bank", "Savings accounts.", ())], ["bank"])
    assert store.count() == 3
    assert store.search("herons", 5, acl_groups=["*"]) == []
    assert [h.chunk_id for h in store.search("savings", 5)] == ["bank#p0"]
    assert store.search("!!! ::: ((", 5) == []  # query syntax is never interpreted
    # Chinese and Japanese, written without spaces, are found by their words
    store.write([IndexedChunk("tower#p0", "tower", "東京タワー", "東京タワーは東京都港区芝公園にある"
                              "総合電波塔である。高さは333メートル。", ()),
                 IndexedChunk("beijing#p0", "beijing", "北京", "北京是中华人民共和国的首都。", ()),
                 IndexedChunk("kyoto#p0", "kyoto", "京都", "京都は日本の古都であり、寺院が多い。", ()),
                 IndexedChunk("case#p0", "case", "ケース", "iPhone用のケースを2024年3月に発売した。"
                              "Pythonで書かれたツール。", ())],
                [])
    for query, found in (("東京", "tower#p0"), ("333メートル", "tower#p0"), ("電波塔", "tower#p0"),
                         ("首都", "beijing#p0"), ("中华人民共和国", "beijing#p0"), ("寺院", "kyoto#p0"),
                         ("iPhone", "case#p0"), ("Python", "case#p0"), ("2024年", "case#p0")):
        assert [h.chunk_id for h in store.search(query, 1)] == [found], query


def test_cjk_documents_ingested_before_bigrams_get_them_at_the_next_ingest(tmp_path,
                                                                            monkeypatch):
    """An index written before Chinese and Japanese were split into bigrams: ingesting the same
    corpus again redoes the documents holding such text (and only those), so they are found."""
    import branchsearch.infra.stores.tantivy as tantivy_store

    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"_id": "tower", "title": "東京タワー",
                                  "text": "東京タワーは東京都港区芝公園にある総合電波塔である。"},
                                 ensure_ascii=False) + "\n"
                      + json.dumps({"_id": "apple", "title": "Apple", "text": "Apples."}) + "\n")
    settings = load_settings(overrides={"home": tmp_path, "index": "ja"}, read_env=False,
                             read_file=False)
    monkeypatch.setattr(tantivy_store, "cjk_terms", lambda text: text)  # as before bigrams
    monkeypatch.setattr(tantivy_store, "has_cjk", lambda text: False)
    ingest(corpus, settings, dense=False)
    monkeypatch.undo()

    def found(query: str) -> list[str]:
        retriever = open_retriever(settings, need_dense=False)
        try:
            return [h.doc_id for h in retriever.search(query, "bm25", 3)]
        finally:
            retriever.close()

    assert found("電波塔") == []  # the sentence was one token, too long to keep
    report = ingest(corpus, settings, dense=False)
    assert report.resumed == 1  # the English document is not redone
    assert found("電波塔") == ["tower"] and found("東京") == ["tower"]


def test_tantivy_store(tmp_path):
    lexical_contract(TantivyStore(tmp_path / "t"))
    reopened = TantivyStore(tmp_path / "t")  # the folding analyzer is registered on open
    assert [h.chunk_id for h in reopened.search("Aschenbrodel", 5)] == ["ballet#p0"]


def test_tantivy_index_written_before_folding_still_opens(tmp_path):
    """An index made with the old schema (`en_stem`, no folding) is searched with its own
    analyzer: opening it must not fail on the schema, and exact words still match; `folds`
    tells it from a new one (which the policy's hop searches need: workers.factory)."""
    import tantivy

    from branchsearch.infra.stores.tantivy import folds

    TantivyStore(tmp_path / "t")  # a new one, beside it

    sb = tantivy.SchemaBuilder()
    sb.add_text_field("chunk_id", stored=True, tokenizer_name="raw")
    sb.add_text_field("doc_id", stored=True, tokenizer_name="raw")
    sb.add_text_field("body", stored=False, tokenizer_name="en_stem")
    sb.add_text_field("terms", stored=False, tokenizer_name="default", index_option="basic")
    sb.add_text_field("acl", stored=False, tokenizer_name="raw", index_option="basic")
    (tmp_path / "old").mkdir()
    tantivy.Index(sb.build(), path=str(tmp_path / "old"))
    store = TantivyStore(tmp_path / "old")
    store.write(CHUNKS, [])
    assert not folds(tmp_path / "old") and folds(tmp_path / "t") and folds(tmp_path / "none")
    assert [h.chunk_id for h in store.search("aschenbrödel", 5)] == ["ballet#p0"]
    assert store.search("Aschenbrodel", 5) == []  # no folding until it is ingested again


@pytest.mark.es
def test_elasticsearch_store(es_url):
    from branchsearch.infra.stores.elastic import ElasticStore

    store = ElasticStore(es_url, index=f"bs-test-{uuid.uuid4().hex[:8]}")
    try:
        lexical_contract(store)
        assert store.folds()
    finally:
        store.drop()
        store.close()


def test_elasticsearch_index_made_before_folding_is_told_apart(es_url):
    """An index with the plain `english` analyzer (made before folding; ingesting again keeps
    its mapping): `folds` says so, and the policy's hops then stay hybrid on it, as on an old
    tantivy index. Asking never creates an index."""
    from elasticsearch import Elasticsearch

    from branchsearch.infra.stores.elastic import MAPPINGS, ElasticStore
    from branchsearch.infra.config.settings import Settings
    from branchsearch.workers.factory import hop_mode

    name = f"bs-old-{uuid.uuid4().hex[:8]}"
    es = Elasticsearch(es_url)
    old = {"properties": MAPPINGS["properties"] | {"body": {"type": "text",
                                                            "analyzer": "english"}}}
    es.indices.create(index=f"branchsearch-{name}", mappings=old)
    try:
        store = ElasticStore(es_url, index=f"branchsearch-{name}", create=False)
        assert not store.folds()
        settings = Settings(es_url=es_url, index=name)
        assert hop_mode(settings, "hybrid") == ""
        assert hop_mode(settings.replace(index=f"{name}-new"), "hybrid") == "bm25"
        assert not es.indices.exists(index=f"branchsearch-{name}-new")
        store.close()
        # the README's fix, in a process that keeps running: drop it, make it anew (folding)
        es.indices.delete(index=f"branchsearch-{name}")
        ElasticStore(es_url, index=f"branchsearch-{name}").close()
        assert hop_mode(settings, "hybrid") == "bm25"
    finally:
        es.indices.delete(index=f"branchsearch-{name}", ignore_unavailable=True)
        es.close()


def test_elasticsearch_down_is_one_clear_error():
    from branchsearch.infra.stores.elastic import ElasticStore
    from branchsearch.infra.errors import BackendUnavailable

    with pytest.raises(BackendUnavailable, match="not reachable"):
        ElasticStore("http://127.0.0.1:9", index="x", timeout_s=2)


def test_elasticsearch_slower_than_the_timeout_is_not_called_down(tmp_path):
    """An Elasticsearch that is up but answers nothing within `backend_timeout_s` (frozen by
    SIGSTOP: an overloaded node, a long GC pause) was reported as "is not reachable
    (ConnectionTimeout); start it or fix es_url". It now says that it did not answer within
    the timeout, and how long that was; the service's caller gets the same 503
    backend_unavailable, without the address."""
    import signal

    from es_emulator import start_es_emulator

    from branchsearch.infra.errors import BackendUnavailable
    from branchsearch.infra.stores.elastic import ElasticStore
    from branchsearch.orchestrator.service.errors import api_error

    es = start_es_emulator(tmp_path / "es")
    store = None
    try:
        store = ElasticStore(es.url, index="bs-slow", timeout_s=0.5)
        store.write([IndexedChunk("a#p0", "a", "A", "alpha text", ())], [])
        os.kill(es.pid, signal.SIGSTOP)
        try:
            with pytest.raises(BackendUnavailable) as raised:
                store.search("alpha", 5)
        finally:
            os.kill(es.pid, signal.SIGCONT)
        line = str(raised.value)
        assert "did not answer within backend_timeout_s = 0.5 s" in line, line
        assert "start it" not in line and "not reachable" not in line, line
        answer = api_error(raised.value)
        assert (answer.status, answer.error) == (503, "backend_unavailable"), answer.body()
        assert "backend_timeout_s = 0.5 s" in answer.detail, answer.detail
        assert es.url.split("//")[1] not in answer.detail, answer.detail
        assert store.search("alpha", 5)[0].chunk_id == "a#p0"  # thawed: answers again
    finally:
        if store is not None:
            store.close()
        es.stop()


def test_retriever_modes(hotpot_retriever):
    q = "Were Scott Derrickson and Ed Wood of the same nationality?"
    for mode in ("bm25", "dense", "hybrid"):
        hits = hotpot_retriever.search(q, mode=mode, k=5)
        assert len(hits) == 5 and [h.rank for h in hits] == [1, 2, 3, 4, 5]
        assert hits[0].text and hits[0].title
        assert {"scott-derrickson", "ed-wood"} & {h.doc_id for h in hits}
    hybrid = hotpot_retriever.search(q, mode="hybrid", k=5)
    assert all(set(h.ranks) <= {"bm25", "dense"} and h.ranks for h in hybrid)
    seen = [h.chunk_id for h in hybrid]
    again = hotpot_retriever.search(q, mode="hybrid", k=5, exclude_ids=seen)
    assert not set(seen) & {h.chunk_id for h in again}
    with pytest.raises(BadQuery):
        hotpot_retriever.search(q, mode="fuzzy")


def test_read_document_and_get_chunks(hotpot_retriever):
    doc = hotpot_retriever.read_document("ed-wood")
    assert doc["title"] == "Ed Wood" and doc["chunks"][0]["chunk_id"] == "ed-wood#p0"
    got = hotpot_retriever.get_chunks(["ed-wood#p0", "nope#p0"])
    assert list(got) == ["ed-wood#p0"]
    with pytest.raises(BadQuery):
        hotpot_retriever.read_document("nope")


def test_acl_filter_end_to_end(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps(r) for r in [
        {"id": "pub", "title": "Roadmap", "text": "The public roadmap for Falcon."},
        {"id": "sec", "title": "Falcon budget", "text": "Falcon budget is secret.",
         "acl": ["finance"]}]) + "\n")
    settings = load_settings(overrides={"home": tmp_path / "h"}, read_env=False, read_file=False)
    ingest(corpus, settings)
    r = open_retriever(settings)
    for mode in ("bm25", "dense", "hybrid"):
        assert {h.doc_id for h in r.search("Falcon budget", mode, 5, acl_groups=[])} == {"pub"}
        assert {h.doc_id for h in r.search("Falcon budget", mode, 5,
                                           acl_groups=["finance"])} == {"pub", "sec"}
    r.close()


def test_reingest_replaces_and_bad_input_changes_nothing(tmp_path):
    settings = load_settings(overrides={"home": tmp_path / "h", "chunk_tokens": 32,
                                        "chunk_overlap": 4}, read_env=False, read_file=False)
    corpus = tmp_path / "c.jsonl"
    long_text = " ".join(f"alpha{i}" for i in range(120))
    corpus.write_text(json.dumps({"id": "d", "title": "D", "text": long_text}) + "\n")
    first = ingest(corpus, settings)
    assert first.chunks > 3
    corpus.write_text(json.dumps({"id": "d", "title": "D", "text": "short now"}) + "\n")
    assert ingest(corpus, settings).chunks == 1
    r = open_retriever(settings)
    assert r.read_document("d")["n_chunks"] == 1
    assert r.lexical.count() == 1 and r.dense.count() == 1
    assert [h.chunk_id for h in r.search("alpha5", "bm25", 5)] == []
    r.close()
    corpus.write_text(json.dumps({"id": "e", "text": "new"}) + "\n{broken\n")
    with pytest.raises(CorpusError, match=":2:"):
        ingest(corpus, settings)
    r = open_retriever(settings)
    assert r.docstore.doc_count() == 1 and r.lexical.count() == 1
    r.close()


def test_unknown_index_is_a_clear_error(tmp_path):
    from branchsearch.infra.errors import IndexNotFound

    settings = load_settings(overrides={"home": tmp_path, "index": "missing"}, read_env=False,
                             read_file=False)
    with pytest.raises(IndexNotFound, match="branchsearch ingest"):
        open_retriever(settings)


def test_hotpot_fixture_is_what_conftest_ingests(hotpot_settings):
    assert (hotpot_settings.index_dir / "docs.sqlite").exists() and HOTPOT.exists()


def test_embedding_cache_returns_the_same_vectors(tmp_path):
    import numpy as np

    from branchsearch.infra.models.embedder import Embedder

    texts = ["Ed Wood was a filmmaker.", "Shirley Temple was an actress.", "x"]
    plain = Embedder().embed(texts)
    cached = Embedder(cache_path=tmp_path / "e.sqlite")
    first = cached.embed(texts[:2])
    assert len(cached._open_cache().get_many(texts)) == 2
    mixed = cached.embed(texts)  # two from the cache, one fresh
    assert np.allclose(mixed, plain, atol=1e-5) and np.allclose(first, plain[:2], atol=1e-5)
    assert abs(float(np.linalg.norm(mixed[0])) - 1.0) < 1e-4


def test_a_hit_is_never_hydrated_with_text_its_caller_may_not_see(tmp_path):
    """An upsert writes the search stores first and the docstore (the text hits are hydrated
    from) last. A document moved from one group to another with new text: in between, a search
    of the new group found it in the stores already written and was handed the old text from
    the docstore, which only the old group may see (a live service gave bravo callers alpha's
    text, and the guard, which runs after the docstore's write, let it through). A hit is
    hydrated only with a row its caller may see; ids and groups in non-ASCII, the group as
    stored in NFD by an earlier version."""
    import unicodedata

    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "東京-memo", "title": "Falcon memo", "acl": ["café"],
                                  "text": "The Falcon memo: quincemark harbor plans."}) + "\n")
    settings = load_settings(overrides={"home": tmp_path / "h"}, read_env=False, read_file=False)
    ingest(corpus, settings)
    r = open_retriever(settings)
    moved = IndexedChunk("東京-memo#p0", "東京-memo", "Falcon memo",
                         "The Falcon memo: harbor plans, rewritten.", ("東京-1",))
    r.dense.write([moved], r.embedder.embed([moved.body]), ["東京-memo"])
    r.lexical.write([moved], ["東京-memo"])  # the docstore still holds café's text
    nfd_cafe = [unicodedata.normalize("NFD", "café")]
    for mode in ("bm25", "dense", "hybrid"):
        for named in (False, True):
            hits = r.search("Falcon memo", mode, 5, acl_groups=["東京-1"], named=named)
            assert not [h for h in hits if "quincemark" in h.text], (mode, named)
            # café's callers see their text still (the stores they search no longer hold it
            # for them, the docstore does: a hit of theirs may come only from `named`)
            assert all("quincemark" in h.text for h in r.search(
                "Falcon memo", mode, 5, acl_groups=nfd_cafe, named=named))
    assert not [h for h in r.grep("quincemark|Falcon", 5, acl_groups=["東京-1"])
                if "quincemark" in h.text]
    r.close()
