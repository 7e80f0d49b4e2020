"""ACL closed by default, on a real small index with restricted documents.

Documents without groups are public; documents with groups are visible only to a caller holding
one of them; no groups (`acl_groups=None`, no `--acl`) means public only; only the explicit admin
setting (`ACL_ALL`, `--acl-admin`, `acl_admin = true`) sees everything. Checked in every backend
(tantivy, Milvus Lite, Elasticsearch emulator) and through retrieve, search and batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from branchsearch.infra.stores.acl import ACL_ALL, PUBLIC, acl_terms, acl_visible, caller_groups
from branchsearch.infra.errors import BadQuery
from branchsearch.infra.ingest.pipeline import ingest
from branchsearch.infra.index.open import open_retriever
from branchsearch.infra.config.settings import load_settings

DOCS = [
    {"id": "pub", "title": "Falcon roadmap", "text": "The public roadmap of Project Falcon "
     "names the quokka launch for spring."},
    {"id": "fin", "title": "Falcon budget", "text": "The Falcon budget holds four million for "
     "the quokka launch.", "acl": ["finance"]},
    {"id": "hr", "title": "Falcon salaries", "text": "Salaries of the Falcon quokka team.",
     "acl": ["hr", "board"]},
]
EVERY = {"pub", "fin", "hr"}


@pytest.fixture(scope="module")
def acl_settings(tmp_path_factory):
    root = tmp_path_factory.mktemp("acl")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    settings = load_settings(overrides={"home": root / "home", "index": "acl"}, read_env=False,
                             read_file=False)
    ingest(corpus, settings)
    return settings


def test_acl_rules():
    assert acl_terms(None) == [PUBLIC]  # closed by default
    assert acl_terms([]) == [PUBLIC]
    assert acl_terms(["hr", "hr"]) == [PUBLIC, "hr"]
    assert acl_terms([ACL_ALL]) is None and acl_terms(["hr", ACL_ALL]) is None
    assert acl_visible([], None) and not acl_visible(["hr"], None)
    assert acl_visible(["hr", "board"], ["board"]) and not acl_visible(["hr"], ["finance"])
    assert acl_visible(["hr"], [ACL_ALL])
    assert caller_groups(None) is None and caller_groups([]) is None
    assert caller_groups([" hr "]) == ["hr"] and caller_groups(["hr"], admin=True) == [ACL_ALL]
    with pytest.raises(BadQuery, match="reserved: seeing every"):  # '*' only by the admin setting
        caller_groups([ACL_ALL])
    with pytest.raises(BadQuery, match="'__public__' is reserved: every caller sees"):
        caller_groups(["hr", PUBLIC])
    with pytest.raises(BadQuery, match="may not be empty"):  # `--acl "$UNSET"`: not public-only
        caller_groups(["hr", " "])
    with pytest.raises(BadQuery, match="may not be empty"):  # checked for an admin too
        caller_groups([""], admin=True)
    with pytest.raises(BadQuery, match="holds a comma"):  # not one group named "hr,board"
        caller_groups(["hr,board"])


def test_group_names_are_one_group_in_nfc_and_nfd(tmp_path):
    """`café` typed on macOS is NFD (e + a combining accent), elsewhere NFC: one group for a
    document's acl, a caller's --acl and a key (hostile pass: each saw only its own form). A
    Cyrillic look-alike stays another group."""
    import unicodedata

    nfc, nfd = unicodedata.normalize("NFC", "café"), unicodedata.normalize("NFD", "café")
    assert nfc != nfd and caller_groups([f" {nfd}"]) == [nfc]
    assert acl_visible([nfd], [nfc]) and acl_visible([nfc], [nfd])
    assert not acl_visible(["сafé"], [nfc])  # Cyrillic 'с'
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in [
        {"id": "a", "title": "Rota A", "text": "The espresso rota of the cafe.", "acl": [nfc]},
        {"id": "b", "title": "Rota B", "text": "The espresso rota of the cafe.", "acl": [nfd]},
        {"id": "c", "title": "Rota C", "text": "The espresso rota of the cafe.", "acl": ["сafé"]},
    ]))
    settings = load_settings(overrides={"home": tmp_path / "home", "index": "cafe"},
                             read_env=False, read_file=False)
    ingest(corpus, settings, dense=False)
    r = open_retriever(settings, need_dense=False)
    try:
        for caller in (nfc, nfd):
            seen = {h.doc_id for h in r.search("espresso rota", mode="bm25", k=10,
                                               acl_groups=caller_groups([caller]))}
            assert seen == {"a", "b"}, (ascii(caller), seen)
        assert r.docstore.get_document("b")["acl"] == [nfc]  # stored as NFC
    finally:
        r.close()


def _seen(retriever, mode, groups):
    return {h.doc_id for h in retriever.search("Falcon quokka launch budget salaries", mode=mode,
                                               k=10, acl_groups=groups)}


def test_retriever_every_mode(acl_settings):
    r = open_retriever(acl_settings)
    try:
        for mode in ("bm25", "dense", "hybrid"):  # tantivy, Milvus Lite, both fused
            assert _seen(r, mode, None) == {"pub"}, mode
            assert _seen(r, mode, []) == {"pub"}, mode
            assert _seen(r, mode, ["finance"]) == {"pub", "fin"}, mode
            assert _seen(r, mode, ["board"]) == {"pub", "hr"}, mode
            assert _seen(r, mode, [ACL_ALL]) == EVERY, mode
        assert {h.doc_id for h in r.grep("falcon", k=10)} == {"pub"}
        assert {h.doc_id for h in r.grep("falcon", k=10, acl_groups=["hr"])} == {"pub", "hr"}
    finally:
        r.close()


def test_a_named_search_opens_no_restricted_page(acl_settings):
    """The page a `named` search puts first is filtered like every hit: 'Falcon budget' is
    restricted to finance."""
    r = open_retriever(acl_settings)
    try:
        for groups in (None, ["hr"]):
            hits = r.search("Falcon budget", mode="bm25", k=3, acl_groups=groups, named=True)
            assert "fin" not in {h.doc_id for h in hits} and hits[0].source == "bm25"
        [first, *_] = r.search("falcon budget", mode="bm25", k=3, acl_groups=["finance"],
                               named=True)
        assert first.doc_id == "fin"
    finally:
        r.close()


def test_a_hidden_namesake_neither_shows_nor_stops_the_visible_one(tmp_path):
    """A page titled exactly as the query that the caller may not see is skipped, and the
    visible namesake still comes first; among pages of one title the search's order holds."""
    corpus = tmp_path / "names.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in [
        {"id": "k-secret", "title": "Kansas", "text": "Plans.", "acl": ["secret"]},
        {"id": "k-band", "title": "Kansas (band)", "text": "A rock band."},
        {"id": "kc", "title": "Kansas City", "text": "Kansas City, Kansas, on the Kansas."},
        {"id": "m-a", "title": "Mercury", "text": "A planet."},
        {"id": "m-b", "title": "Mercury", "text": "Mercury, the element Mercury."}] + [
        {"id": f"k-hr{i:02}", "title": "Kansas", "text": "Pay.", "acl": ["hr"]}
        for i in range(25)]))  # more hidden namesakes than `named` reads
    settings = load_settings(overrides={"home": tmp_path / "home", "index": "names",
                                        "search_mode": "bm25"}, read_env=False, read_file=False)
    ingest(corpus, settings, dense=False)
    r = open_retriever(settings, need_dense=False)
    try:
        def ids(query, groups=None):
            return [h.doc_id for h in r.search(query, mode="bm25", k=3, acl_groups=groups,
                                               named=True)]

        assert ids("Kansas")[0] == "k-band" and "k-secret" not in ids("Kansas")
        assert not {d for d in ids("Kansas") if d.startswith("k-hr")}
        assert ids("Kansas", ["secret"])[0] == "k-secret"
        plain = [h.doc_id for h in r.search("Mercury", mode="bm25", k=2)]
        assert plain == ["m-b", "m-a"] and ids("Mercury")[:2] == plain
    finally:
        r.close()


def test_search_reads_no_restricted_document(acl_settings):
    """The agent (heuristic policy, in-process driver) searches and reads documents; without
    groups nothing restricted reaches its evidence, with a group that group's documents do."""
    from branchsearch.orchestrator.driver import Driver

    driver = Driver(acl_settings.replace(branches=1), mode="local")
    try:
        def evidence(groups):
            result = driver.search("What is the Falcon budget for the quokka launch?",
                                   acl_groups=groups)
            return {d["doc_id"] for d in result.evidence}

        assert evidence(None) == {"pub"}
        assert "fin" in evidence(["finance"]) and "hr" not in evidence(["finance"])
        assert "fin" in evidence([ACL_ALL])
    finally:
        driver.close()


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "branchsearch.orchestrator.cli", *args],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def test_cli_retrieve_and_batch(acl_settings, tmp_path):
    where = ["--home", str(acl_settings.home), "--index", acl_settings.index]

    def retrieve(*extra, env=None):
        done = _cli("retrieve", "Falcon quokka", "--mode", "bm25", "--json", *where, *extra,
                    env=env)
        assert done.returncode == 0, done.stderr[-1500:]
        return {h["doc_id"] for h in json.loads(done.stdout)}

    assert retrieve() == {"pub"}
    assert retrieve("--acl", "finance") == {"pub", "fin"}
    assert retrieve("--acl", "finance", "--acl", "hr") == EVERY
    assert retrieve("--acl-admin") == EVERY
    assert retrieve(env={"BRANCHSEARCH_ACL_ADMIN": "true"}) == EVERY
    denied = _cli("retrieve", "Falcon", "--acl", "*", *where)
    assert denied.returncode == 2 and "reserved" in denied.stderr
    assert "Traceback" not in denied.stderr

    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"id": "q1", "question": "Falcon budget quokka launch"})
                         + "\n")

    def batch(out, *extra):
        done = _cli("batch", str(questions), "-o", str(out), "--executor", "local",
                    "--branches", "1", *where, *extra)
        assert done.returncode == 0, done.stderr[-1500:]
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        return {d["doc_id"] for row in rows for d in row["evidence"]}

    assert batch(tmp_path / "public.jsonl") == {"pub"}
    assert "fin" in batch(tmp_path / "finance.jsonl", "--acl", "finance")

    # a malformed line: the good question still runs and is written, the bad one is named,
    # and the exit status says not every question was answered
    questions.write_text(questions.read_text() + "{not json\n")
    out = tmp_path / "mixed.jsonl"
    done = _cli("batch", str(questions), "-o", str(out), "--executor", "local",
                "--branches", "1", *where)
    assert done.returncode == 1, done.stderr[-1500:]
    assert "q.jsonl:2" in done.stderr and "1 malformed input lines skipped" in done.stdout
    assert [json.loads(line)["status"] for line in out.read_text().splitlines()] == ["ok"]


@pytest.mark.es
def test_elasticsearch_backend(acl_settings, es_url, tmp_path):
    """The same rule with Elasticsearch (the emulator) as the lexical store."""
    import uuid

    settings = acl_settings.replace(es_url=es_url, index=f"acl-es-{uuid.uuid4().hex[:6]}")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    ingest(corpus, settings)
    r = open_retriever(settings, need_dense=False)
    try:
        assert _seen(r, "bm25", None) == {"pub"}
        assert _seen(r, "bm25", ["finance"]) == {"pub", "fin"}
        assert _seen(r, "bm25", [ACL_ALL]) == EVERY
        assert {h.doc_id for h in r.grep("falcon", k=10)} == {"pub"}
    finally:
        r.close()
    from branchsearch.infra.errors import SettingsError

    # searched without es_url: where its BM25 side is, not "damaged: tantivy missing"
    with pytest.raises(SettingsError, match=f"BM25 side in elasticsearch {es_url}; set es_url"):
        open_retriever(settings.replace(es_url=""), need_dense=False)


def test_acl_as_one_string_is_one_group_and_a_comma_is_refused(tmp_path):
    """`"acl": "finance,hr"` once became one group named "finance,hr", which no caller can
    hold (`--acl` and a key's groups read a comma as two groups): refused, naming the list to
    write. One group as a plain string stays one group. Uploads share the parser."""
    from branchsearch.infra.errors import CorpusError
    from branchsearch.orchestrator.service.documents import parse_documents

    home = ["--home", str(tmp_path / "home"), "--index", "strings"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(DOCS[0]) + "\n"
                   + json.dumps({"id": "fin", "text": "Falcon budget.", "acl": "finance,hr"})
                   + "\n")
    done = _cli("ingest", str(bad), "--no-dense", *home)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-1500:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-1500:]
    assert "bad.jsonl:2: 'acl' is the string \"finance,hr\"" in lines[0]
    assert '"acl": ["finance", "hr"]' in lines[0]
    assert not (tmp_path / "home" / "indexes" / "strings").exists()  # nothing written

    item = tmp_path / "item.jsonl"
    item.write_text(json.dumps({"id": "fin", "text": "Falcon budget.", "acl": ["finance, hr"]})
                    + "\n")
    done = _cli("ingest", str(item), "--no-dense", *home)
    assert done.returncode == 2 and "holds a comma" in done.stderr, done.stderr[-1500:]

    with pytest.raises(CorpusError, match=r"body element 1 of 1: 'acl' is the string \"a,b\"; give the "
                                          r"groups as a list: \"acl\": \[\"a\", \"b\"\]"):
        parse_documents(json.dumps([{"id": "x", "text": "y", "acl": "a,b"}]).encode())
    assert parse_documents(b'{"id": "x", "text": "y", "acl": "finance"}\n')[0].acl == ("finance",)

    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(DOCS[0]) + "\n" + json.dumps(
        {"id": "fin", "title": "Falcon budget", "text": "The Falcon quokka budget.",
         "acl": "finance"}) + "\n")
    done = _cli("ingest", str(good), "--no-dense", *home)
    assert done.returncode == 0, done.stderr[-1500:]
    for extra, seen in (((), {"pub"}), (("--acl", "finance"), {"pub", "fin"})):
        done = _cli("retrieve", "Falcon quokka", "--mode", "bm25", "--json", *home, *extra)
        assert done.returncode == 0, done.stderr[-1500:]
        assert {h["doc_id"] for h in json.loads(done.stdout)} == seen
