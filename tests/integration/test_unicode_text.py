"""Text in either Unicode form is one text: a word typed decomposed (NFD, as macOS types `ü`:
`u` + U+0308) finds the document stored composed (NFC), and a corpus written in NFD is found by
the composed word. Documents' titles and texts are stored and indexed in NFC, and every query,
question and grep pattern is searched in NFC (`infra.nfc`). Real components: the CLI in a
subprocess, tantivy, Milvus Lite, the Elasticsearch emulator, the docstore, the driver."""

from __future__ import annotations

import json
import subprocess
import sys
import unicodedata

import pytest

from branchsearch.infra.stores.acl import ACL_ALL


def nfd(text: str) -> str:
    return unicodedata.normalize("NFD", text)


def is_nfc(text: str) -> bool:
    return unicodedata.is_normalized("NFC", text)


ZURICH, GOTTINGEN = "Zürich", "Göttingen"
ROWS = [{"_id": "zh", "title": ZURICH, "text": "Zürich is the largest city in Switzerland."},
        # written decomposed, title and text: a corpus exported on macOS
        {"_id": "go", "title": nfd(GOTTINGEN),
         "text": nfd("Göttingen is a university town in Lower Saxony.")},
        {"_id": "pa", "title": "Paris", "text": "Paris is the capital of France, on the Seine."}]


def _write(path, rows=ROWS):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                    encoding="utf-8")
    return path


def _cli(*args) -> str:
    done = subprocess.run([sys.executable, "-m", "branchsearch.orchestrator.cli",
                           *map(str, args)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """One index (tantivy, Milvus Lite, docstore) ingested by the CLI from ROWS."""
    tmp = tmp_path_factory.mktemp("nfc")
    _cli("ingest", _write(tmp / "corpus.jsonl"), "--index", "u", "--home", tmp / "home")
    return tmp / "home"


@pytest.mark.parametrize("mode", ["bm25", "hybrid"])
@pytest.mark.parametrize("query, doc_id", [(nfd(ZURICH), "zh"),  # NFD query, NFC corpus
                                           (GOTTINGEN, "go"),  # NFC query, NFD corpus
                                           (nfd(GOTTINGEN), "go")])
def test_retrieve_finds_a_word_in_either_unicode_form(home, mode, query, doc_id):
    hits = json.loads(_cli("retrieve", query, "--mode", mode, "--index", "u", "--home", home,
                           "--json"))
    assert hits and hits[0]["doc_id"] == doc_id, hits
    if mode == "hybrid":  # found by its words too, not only by its vector's neighbourhood
        assert "bm25" in hits[0]["ranks"], hits[0]
    # the docstore holds the NFC text: what a hit shows is what was indexed and matched
    assert is_nfc(hits[0]["title"]) and is_nfc(hits[0]["text"])
    assert GOTTINGEN in hits[0]["title"] or ZURICH in hits[0]["title"]


def test_the_retriever_searches_and_greps_in_nfc(home):
    """The retriever's own entry (an agent's search_corpus and grep tools call it): an NFD
    query or pattern finds the NFC-indexed word, on tantivy and Milvus Lite."""
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.index.open import open_retriever

    settings = load_settings(overrides={"home": str(home), "index": "u"}, read_env=False,
                             read_file=False)
    r = open_retriever(settings)
    try:
        for mode in ("bm25", "hybrid"):
            hits = r.search(nfd(ZURICH), mode=mode, k=3, acl_groups=[ACL_ALL])
            assert hits and hits[0].doc_id == "zh", (mode, hits)
            assert mode == "bm25" or "bm25" in hits[0].ranks, hits[0]  # by its word too
        for pattern in (nfd("zürich"), nfd("göttingen"), "göttingen"):
            assert [h.doc_id for h in r.grep(pattern, k=3, acl_groups=[ACL_ALL])] == \
                [{"z": "zh", "g": "go"}[pattern[0]]], pattern
    finally:
        r.close()


def test_elasticsearch_gets_the_nfc_text_and_queries(tmp_path, es_url):
    """The Elasticsearch backend (the noida-db emulator here) indexes the NFC text and is
    searched and grepped in NFC, as tantivy is."""
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.index.open import open_retriever
    from branchsearch.infra.ingest.pipeline import ingest

    settings = load_settings(overrides={"home": str(tmp_path / "home"), "index": "es-nfc",
                                        "es_url": es_url}, read_env=False, read_file=False)
    ingest(_write(tmp_path / "c.jsonl"), settings, dense=False)
    r = open_retriever(settings, need_dense=False)
    try:
        for query, doc_id in ((nfd(ZURICH), "zh"), (GOTTINGEN, "go")):
            hits = r.search(query, mode="bm25", k=3, acl_groups=[ACL_ALL])
            assert [h.doc_id for h in hits] == [doc_id], (query, hits)
        for pattern, doc_id in ((nfd("zürich"), "zh"), ("göttingen", "go")):
            assert [h.doc_id for h in r.grep(pattern, k=3, acl_groups=[ACL_ALL])] == [doc_id]
    finally:
        r.close()


def test_an_index_holding_nfd_text_is_fixed_by_ingesting_again(tmp_path):
    """A document an earlier version stored with its text as typed (NFD) is not found by the
    composed word; ingesting the corpus again (the fingerprint changes with the text) rewrites
    it in NFC, and then it is."""
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.index.open import open_retriever
    from branchsearch.infra.ingest.corpus import Document
    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.orchestrator.service import documents

    settings = load_settings(overrides={"home": str(tmp_path / "home"), "index": "old"},
                             read_env=False, read_file=False)
    corpus = _write(tmp_path / "c.jsonl")
    ingest(corpus, settings, dense=False)
    r = open_retriever(settings, need_dense=False)
    try:  # as an earlier version wrote it: the text as the corpus typed it
        documents.upsert(r, settings, [Document("go", nfd(GOTTINGEN),
                                                nfd("Göttingen is a university town."))])
        assert r.search(GOTTINGEN, mode="bm25", k=3, acl_groups=[ACL_ALL]) == []
    finally:
        r.close()
    ingest(corpus, settings, dense=False)
    r = open_retriever(settings, need_dense=False)
    try:
        hits = r.search(GOTTINGEN, mode="bm25", k=3, acl_groups=[ACL_ALL])
        assert [h.doc_id for h in hits] == ["go"] and is_nfc(hits[0].text)
    finally:
        r.close()


def test_an_nfd_question_plans_and_bridges_with_the_composed_word(tmp_path):
    """`search` with a question typed decomposed: the question's branch and its bridges (a
    name in its top chunk and the question's words the chunk lacks) search `Étoile`, not the
    `E toile` that splitting at the combining accent made."""
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.orchestrator.driver import Driver

    rows = [{"_id": "arc", "title": "Arc de Triomphe", "text": "The Arc de Triomphe is a "
             "triumphal arch in Paris. Its architect was Jean Chalgrin, who died in 1811."},
            {"_id": "cha", "title": "Jean Chalgrin", "text": "Jean Chalgrin was a French "
             "architect. His spouse was Louise-Marie-Jeanne Vernet."}]
    settings = load_settings(overrides={"home": str(tmp_path / "home"), "index": "e"},
                             read_env=False, read_file=False)
    ingest(_write(tmp_path / "c.jsonl", rows), settings, dense=False)
    driver = Driver(settings.replace(bridges=2, bridge_depth=1, branches=3), mode="local")
    try:
        result = driver.search(nfd("Who was the spouse of the architect of the triumphal arch "
                                   "at the Étoile?"))
    finally:
        driver.close()
    subs = [b.subquery for b in result.branches]
    assert all(is_nfc(s) for s in subs), subs
    assert is_nfc(result.question) and "Étoile" in result.question
    made = [b.subquery for b in result.branches if b.kind == "bridge"]
    assert "Jean Chalgrin spouse Étoile" in made, subs
    assert not any("E toile" in s for s in subs), subs


def test_the_service_reads_a_question_in_nfc():
    from branchsearch.orchestrator.service.admission import Limits
    from branchsearch.orchestrator.service.protocol import parse_search

    req = parse_search({"question": nfd(" Where is Zürich? ")}, Limits())
    assert req.question == "Where is Zürich?"
