"""An index may be named in any script (`index_name_problem`): `café`, `Отдел-1`, `Foo` and `foo`
side by side ingest, search (bm25, dense, hybrid) and re-ingest a changed document on tantivy +
Milvus Lite, on the Elasticsearch emulator + a Milvus server, and over HTTP.

Milvus takes only `[A-Za-z_][A-Za-z0-9_]*` as a collection name and Elasticsearch only lowercase
index names, so each backend's name comes from one function (`collection_for`,
`es_index_for`): a name the backend already took keeps exactly the backend name it had, any
other gets a safe form plus a hash of the name, and no two index names share a collection or an
Elasticsearch index, except 'a-b' and 'a_b' in Milvus, which always shared one: the collection
records the index it holds, and the other name is refused.
"""

from __future__ import annotations

import json
import re
import uuid

import httpx
import pytest
from hypothesis import given, settings as hsettings
from hypothesis import strategies as st

from branchsearch.infra.stores.milvus import collection_for
from branchsearch.infra.stores.elastic import es_index_for
from branchsearch.infra.ingest.pipeline import ingest
from branchsearch.infra.config.settings import index_name_problem, load_settings

MILVUS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,254}", re.ASCII)
ES_REFUSED = set('\\/*?"<>|, #:')
NAMES = ["café", "Отдел-1", "Foo", "foo"]
MARKERS = dict(zip(NAMES, ["amberwing", "basaltfern", "cobaltmoss", "driftquill"]))


def es_name_ok(name: str) -> bool:
    """Elasticsearch's rule for an index name (the emulator's too)."""
    return (name == name.lower() and not ES_REFUSED & set(name) and name[0] not in "-_+."
            and len(name.encode("utf-8")) <= 255)


# --- the names ----------------------------------------------------------------------------------


def test_names_the_backends_took_before_are_kept_exactly():
    for index, collection in [("hotpot", "chunks_hotpot"), ("a-b", "chunks_a_b"),
                              ("my_index2", "chunks_my_index2"), ("Foo", "chunks_Foo"),
                              ("foo", "chunks_foo"), ("x" * 100, "chunks_" + "x" * 100)]:
        assert collection_for(index) == collection
    for index in ["hotpot", "a-b", "my_index2", "foo", "café", "відділ", "отдел-1", "中文"]:
        assert es_index_for(index) == f"branchsearch-{index}"


def test_other_names_get_a_safe_name_with_a_hash():
    assert re.fullmatch(r"uchunks_cafe_[0-9a-f]{12}", collection_for("café"))
    assert re.fullmatch(r"uchunks_1_[0-9a-f]{12}", collection_for("Отдел-1"))
    assert re.fullmatch(r"uchunks_[0-9a-f]{12}", collection_for("відділ"))
    assert re.fullmatch(r"branchsearch-foo\.[0-9a-f]{12}", es_index_for("Foo"))
    assert re.fullmatch(r"branchsearch-отдел-1\.[0-9a-f]{12}", es_index_for("Отдел-1"))
    tricky = ["café", "cafè", "cafe", "Café", "Отдел-1", "отдел-1", "ОТДЕЛ-1", "Foo", "foo",
              "FOO", "fOO", "İ", "i", "ß", "SS", "ss", "Σ", "σ", "ς"]
    tricky = [n for n in tricky if not index_name_problem(n)]
    for fn in (collection_for, es_index_for):
        assert len({fn(n) for n in tricky}) == len(tricky), fn.__name__
        assert all(fn(n) == fn(n) for n in tricky)  # deterministic


NAME = st.text(st.characters(categories=("L", "N"), include_characters="-_"), min_size=1,
               max_size=100).filter(lambda n: not index_name_problem(n))


@hsettings(max_examples=300, deadline=None)
@given(st.lists(NAME, min_size=2, max_size=6, unique=True))
def test_every_index_name_gets_valid_distinct_backend_names(names):
    for name in names:
        assert MILVUS_NAME.fullmatch(collection_for(name)), name
        assert es_name_ok(es_index_for(name)), name
    assert len({es_index_for(n) for n in names}) == len(names)
    shared = {n.replace("-", "_") if n.isascii() else n for n in names}  # 'a-b' is 'a_b'
    assert len({collection_for(n) for n in names}) == len(shared)


# --- the same names on real backends ------------------------------------------------------------


def _corpus(index: str, changed: bool) -> list[dict]:
    mark = MARKERS[index.split("-x")[0]]
    memo = f"now speaks of {mark} harbors" if changed else f"speaks of {mark} lanterns"
    return [{"id": "note", "title": f"Note {mark}", "text": f"A quokka note on {mark} in {index}."},
            {"id": "memo", "title": f"Memo {mark}", "text": f"The quokka memo {memo}."}]


def _write(path, rows) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def _search(settings, query: str) -> dict[str, list[str]]:
    """Each mode's hit texts for `query` on the index of `settings`."""
    from branchsearch.infra.index.open import open_retriever

    r = open_retriever(settings)
    try:
        return {mode: [h.text for h in r.search(query, mode=mode, k=5)]
                for mode in ("bm25", "dense", "hybrid")}
    finally:
        r.close()


def _ingest_search_reingest(base, indexes: list[str], tmp_path) -> None:
    """Every index ingested next to the others, searched in each mode (each sees only its own
    documents), then one document changed and ingested again."""
    marks = {i: MARKERS[i.split("-x")[0]] for i in indexes}
    for index in indexes:
        _write(tmp_path / f"{index}.jsonl", _corpus(index, changed=False))
        report = ingest(tmp_path / f"{index}.jsonl", base.replace(index=index))
        assert report.documents == 2 and len(set(report.counts.values())) == 1, report.counts
    for index in indexes:
        found = _search(base.replace(index=index), f"quokka {marks[index]} lanterns")
        for mode, texts in found.items():
            assert len(texts) == 2 and all(marks[index] in t for t in texts), (index, mode, texts)
            assert not any(m in t for t in texts for i, m in marks.items() if i != index)
    for index in indexes:
        _write(tmp_path / f"{index}.jsonl", _corpus(index, changed=True))
        report = ingest(tmp_path / f"{index}.jsonl", base.replace(index=index))
        assert report.resumed == 1 and len(set(report.counts.values())) == 1, report.counts
        assert report.counts["dense"] == 2, report.counts  # the old memo's chunk was deleted
    for index in indexes:
        found = _search(base.replace(index=index), f"quokka {marks[index]} memo harbors")
        for mode, texts in found.items():
            memo = [t for t in texts if "memo" in t]
            assert len(memo) == 1 and "harbors" in memo[0], (index, mode, texts)
            assert all(marks[index] in t for t in texts), (index, mode, texts)


def test_any_script_index_names_on_tantivy_and_milvus_lite(tmp_path):
    base = load_settings(overrides={"home": tmp_path / "home", "index": "default"},
                         read_env=False, read_file=False)
    _ingest_search_reingest(base, NAMES, tmp_path)


@pytest.mark.es
def test_any_script_index_names_on_elasticsearch_and_a_milvus_server(tmp_path, es_url,
                                                                     milvus_uri):
    """One Elasticsearch and one Milvus server for all four: `Foo` and `foo` would share an
    Elasticsearch index if the names were only lowercased. A suffix keeps runs against a shared
    server apart; it keeps each name's case and script."""
    from elasticsearch import Elasticsearch
    from pymilvus import MilvusClient

    tag = f"-x{uuid.uuid4().hex[:6]}"
    indexes = [n + tag for n in NAMES]
    base = load_settings(overrides={"home": tmp_path / "home", "index": "default",
                                    "es_url": es_url, "milvus_uri": milvus_uri,
                                    "milvus_consistency": "Strong"},
                         read_env=False, read_file=False)
    es, milvus = Elasticsearch(es_url), MilvusClient(uri=milvus_uri)
    try:
        _ingest_search_reingest(base, indexes, tmp_path)
        foo, Foo = "foo" + tag, "Foo" + tag
        assert es.indices.exists(index=f"branchsearch-{foo}")  # the name it always had
        assert milvus.has_collection(f"chunks_{foo}".replace("-", "_"))
        assert milvus.has_collection(f"chunks_{Foo}".replace("-", "_"))
        for index in indexes:
            assert es.count(index=es_index_for(index))["count"] == 2, index
            rows = milvus.query(collection_for(index), output_fields=["count(*)"],
                                consistency_level="Strong")
            assert rows[0]["count(*)"] == 2, index
    finally:
        for index in indexes:
            es.indices.delete(index=es_index_for(index), ignore_unavailable=True)
            milvus.drop_collection(collection_for(index))
        es.close()
        milvus.close()


def test_names_sharing_a_milvus_collection_are_refused_on_a_server(tmp_path, milvus_uri):
    """'a-b' and 'a_b' map to one collection (the name 'a-b' always had). Ingested second, the
    other name was merged into it: with the same document ids the counts agreed, both indexes
    said ok, and the first searched the second's vectors. Now the collection records its index:
    the second is refused with one line before anything is written, and the first is searched
    and ingested again unharmed. A collection made before it recorded its index keeps serving
    that index, and a new index that maps to it is refused as well."""
    from pymilvus import MilvusClient

    from branchsearch.infra.errors import IndexNameTaken
    from branchsearch.infra.index.catalog import list_indexes
    from branchsearch.infra.stores.milvus import MilvusStore, acl_sets_collection

    tag = uuid.uuid4().hex[:6]
    hyphen, under = f"o{tag}-b", f"o{tag}_b"
    base = load_settings(overrides={"home": tmp_path / "home", "index": "default",
                                    "milvus_uri": milvus_uri, "milvus_consistency": "Strong"},
                         read_env=False, read_file=False)
    ours, theirs = tmp_path / "ours.jsonl", tmp_path / "theirs.jsonl"
    _write(ours, [{"id": d, "title": d, "text": f"A quokka {d} in the amberwing valley."}
                  for d in ("note", "memo")])
    _write(theirs, [{"id": d, "title": d, "text": f"A {d} of basaltfern tax invoices."}
                    for d in ("note", "memo")])
    collection = collection_for(hyphen)
    assert collection == collection_for(under)
    milvus = MilvusClient(uri=milvus_uri)

    def refused(why: str) -> None:
        with pytest.raises(IndexNameTaken) as caught:
            ingest(theirs, base.replace(index=under))
        line = str(caught.value)
        assert "\n" not in line and why in line and f"index {under!r} cannot use Milvus " \
            f"collection {collection!r}" in line, line
        assert not base.replace(index=under).index_dir.exists()  # nothing half-made
        assert milvus.query(collection, output_fields=["count(*)"],
                            consistency_level="Strong")[0]["count(*)"] == 2
        found = _search(base.replace(index=hyphen), "quokka amberwing valley")
        assert all(len(texts) == 2 for texts in found.values()), found
        assert ingest(ours, base.replace(index=hyphen)).resumed == 2  # counts agree
        assert [(i.name, i.documents, i.health) for i in list_indexes(base)] == \
            [(hyphen, 2, "ok")]

    try:
        assert ingest(ours, base.replace(index=hyphen)).counts["dense"] == 2
        refused(f"it holds index {hyphen!r}")
        # as an earlier version made it: the same rows, no index recorded
        rows = milvus.query(collection, filter='chunk_id != ""', consistency_level="Strong",
                            output_fields=["chunk_id", "doc_id", "acl", "acl_key", "vector"])
        milvus.drop_collection(collection)
        old = MilvusStore(milvus_uri, len(rows[0]["vector"]), collection=collection)
        old._client.insert(collection, rows)
        old.close()
        assert milvus.describe_collection(collection)["description"] == ""
        refused("it holds 2 vectors of an index made before collections named theirs")
    finally:
        for name in (collection, acl_sets_collection(collection)):
            milvus.drop_collection(name)
        milvus.close()


# --- over HTTP ----------------------------------------------------------------------------------


def test_a_cafe_index_is_searched_over_http(tmp_path):
    from branchsearch.orchestrator.service import deploy as service
    from branchsearch.orchestrator.service.auth import KeyStore

    from service_fixtures import start_uvicorn

    settings = load_settings(overrides={"home": tmp_path, "index": "café", "branches": 1},
                             read_env=False, read_file=False)
    _write(tmp_path / "café.jsonl", _corpus("café", changed=False))
    ingest(tmp_path / "café.jsonl", settings)
    key = KeyStore(tmp_path / "keys.json").add("reader", (), ("café",))
    state = service.local_state(settings, executor="local", keys_path=tmp_path / "keys.json")
    server = start_uvicorn(service.create_app(state), state)
    try:
        with httpx.Client(base_url=server.url, timeout=120,
                          headers={"Authorization": f"Bearer {key}"}) as client:
            listed = client.get("/v1/indexes")
            assert listed.status_code == 200 and "café" in listed.json()["indexes"], listed.text
            r = client.post("/v1/search", json={"question": "amberwing quokka note",
                                                "index": "café", "branches": 1})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["status"] == "ok", body
            assert "note" in {d["doc_id"] for d in body["evidence"]}, body
    finally:
        server.stop()
        state.searcher.target.close()


def test_names_written_with_vowel_signs_and_combining_marks_are_names(tmp_path):
    """A letter of Devanagari, Thai or Tamil is often a consonant and a vowel sign (a combining
    mark): 'हिन्दी', 'ที่ดิน' and 'தமிழ்' are words of letters to their readers, and so is an accent
    NFC has no composed form for ('ạ̈'). They name indexes, ingested and searched on tantivy and
    Milvus Lite; a mark that sits on no letter or digit (first, after '-') is still refused."""
    for good in ("हिन्दी", "ที่ดิน", "தமிழ்", "عَرَبِيّ", "a\u0323\u0308", "x-हिन्दी_2"):
        assert index_name_problem(good) == "", good
    for bad in ("\u0301a", "\u0301", "a-\u0301b", "_\u093f", "a \u093f"):
        assert index_name_problem(bad), ascii(bad)
    base = load_settings(overrides={"home": tmp_path / "home", "index": "default"},
                         read_env=False, read_file=False)
    for index in ("हिन्दी", "ที่ดิน"):
        _write(tmp_path / "c.jsonl",
               [{"id": "note", "title": "Note", "text": f"A quokka in {index}."}])
        assert ingest(tmp_path / "c.jsonl", base.replace(index=index)).documents == 1
        found = _search(base.replace(index=index), "quokka")
        assert all(texts == [f"A quokka in {index}."] for texts in found.values()), found
