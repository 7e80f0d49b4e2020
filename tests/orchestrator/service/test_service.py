"""The service against a live server on loopback, through a real HTTP client (httpx): the auth
matrix, the ACL leak test, limits, streaming, upsert/delete, a backend going down. Real stores
(tantivy, Milvus Lite, the Elasticsearch emulator), the in-process executor, uvicorn.
The Ray Serve test (replicas) and the browser test live in test_service_serve.py and
test_service_web.py."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import html
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote, urljoin, urlsplit

import httpx
import pytest

from branchsearch.infra.ingest.pipeline import ingest
from branchsearch.infra.config.settings import load_settings
from branchsearch.orchestrator.service import deploy as service
from branchsearch.orchestrator.service.auth import KeyStore
from branchsearch.orchestrator.service.admission import Limits
from branchsearch.orchestrator.service.errors import ApiError
from branchsearch.orchestrator.service.events import parse_sse

from conftest import read_only_folder
from store_copy import copy_store
from service_fixtures import (CORPUS, KEPT_IDS, LEAK_MARKER, LOOKALIKE_IDS, mounted_at,
                              start_uvicorn, write_corpus)

LIMITS = Limits(max_body_bytes=64 * 1024, max_question_chars=300, per_key_concurrency=2,
                per_key_queue=3, max_in_flight=8, default_deadline_s=60)
BRAVO_DOCS = [d["_id"] for d in CORPUS if d.get("acl") == ["bravo"]]
ALPHA_DOCS = [d["_id"] for d in CORPUS if d.get("acl") == ["alpha"]]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    home = tmp_path_factory.mktemp("svc-home")
    settings = load_settings(overrides={"home": home, "index": "acl", "branches": 2},
                             read_env=False, read_file=False)
    ingest(write_corpus(home / "corpus.jsonl"), settings)
    ingest(write_corpus(home / "other.jsonl", CORPUS[:2]), settings.replace(index="other"))
    store = KeyStore(home / "keys.json")
    keys = {"alpha": store.add("alpha", ("alpha",), ("acl",)),
            "bravo": store.add("bravo", ("bravo",)),
            "public": store.add("public", ()),
            "admin": store.add("admin", (), admin=True, everything=True),
            "alpha-admin": store.add("alpha-admin", ("alpha",), admin=True),
            "gone": store.add("gone", ("bravo",))}
    store.revoke("gone")
    state = service.local_state(settings, executor="local", keys_path=home / "keys.json",
                                limits=LIMITS)
    state.searcher.target.drivers.open("acl")
    server = start_uvicorn(service.create_app(state), state)
    client = httpx.Client(base_url=server.url, timeout=120)
    yield client, keys, state
    client.close()
    server.stop()
    state.searcher.target.close()


def serve_here(settings, limits: Limits = LIMITS):
    """The service in this process over `settings`' home, the Ray executor, dev mode (every
    caller an admin): (state, the uvicorn server, the searcher)."""
    state = service.local_state(settings, executor="ray", limits=limits)
    return state, start_uvicorn(service.create_app(state), state), state.searcher.target


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def assert_error(r: httpx.Response, status: int, error: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    # a key's 429 and an overloaded 503 add why and the figures as fields (`KeyRefusal`,
    # `Overload`; `max_in_flight`'s also how many of its requests are past their deadline)
    fields = {"reason", "running", "waiting", "limits"} if status == 429 else \
        {"reason", "in_use", "limits"} if body.get("error") == "overloaded" else set()
    if body.get("reason") == "max_in_flight":
        fields |= {"past_deadline"}
    assert set(body) == {"error", "detail"} | fields and body["detail"], body
    assert "Traceback" not in r.text
    # every error is written alike: compact JSON, UTF-8 as is (not \u-escaped)
    assert r.content == json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    if error:
        assert body["error"] == error, body
    return body


def test_auth_matrix(site):
    client, keys, _ = site
    q = {"question": "harbor lighthouse"}
    doc = [{"id": "x1", "text": "x"}]
    cases = [  # (method, path, key, json, status)
        ("POST", "/v1/search", None, q, 401),
        ("POST", "/v1/search", "bsk_not-a-key", q, 401),
        ("POST", "/v1/search", keys["gone"], q, 401),
        ("GET", "/v1/indexes", None, None, 401),
        ("GET", "/v1/whoami", keys["gone"], None, 401),
        ("PUT", "/v1/indexes/acl/documents", None, doc, 401),
        ("DELETE", "/v1/indexes/acl/documents/pub-harbor", "bsk_x", None, 401),
        ("POST", "/v1/search", keys["alpha"], {**q, "index": "other"}, 403),  # index not allowed
        ("PUT", "/v1/indexes/acl/documents", keys["alpha"], doc, 403),  # not admin
        ("DELETE", "/v1/indexes/acl/documents/pub-harbor", keys["bravo"], None, 403),
        ("POST", "/v1/search", keys["alpha"], q, 200),
        ("POST", "/v1/search", keys["bravo"], {**q, "index": "other"}, 200),
        ("GET", "/v1/indexes", keys["public"], None, 200),
        ("GET", "/healthz", None, None, 200),
        ("GET", "/readyz", None, None, 200),
        ("GET", "/metrics", None, None, 200),
        ("GET", "/docs", None, None, 200),
        ("GET", "/openapi.json", None, None, 200),
        ("GET", "/", None, None, 200),
        ("HEAD", "/healthz", None, None, 200),  # load balancers check with HEAD
        ("HEAD", "/readyz", None, None, 200),
        ("HEAD", "/", None, None, 200),
    ]
    for method, path, key, body, status in cases:
        r = client.request(method, path, json=body, headers=auth(key) if key else {})
        if status >= 400:
            err = assert_error(r, status)
            if status == 401:
                assert r.headers["www-authenticate"].startswith("Bearer")
                assert (key or "") not in err["detail"] or not key
        else:
            assert r.status_code == 200, (method, path, r.text)
    assert client.get("/v1/indexes", headers=auth(keys["alpha"])).json() == {"indexes": ["acl"]}
    assert client.get("/v1/indexes", headers=auth(keys["bravo"])).json() == {
        "indexes": ["acl", "other"]}
    alpha = client.get("/v1/whoami", headers=auth(keys["alpha"])).json()
    assert alpha["groups"] == ["alpha"]
    assert alpha["indexes"] == ["acl"] and alpha["all_indexes"] is False
    bravo = client.get("/v1/whoami", headers=auth(keys["bravo"])).json()
    assert bravo["indexes"] == [] and bravo["all_indexes"] is True  # [] alone read as "none"
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/search", "/v1/indexes/{index}/documents", "/readyz", "/metrics"} <= set(paths)
    assert "question" in json.dumps(paths["/v1/search"])


def test_a_key_that_may_not_use_the_default_index_is_not_told_its_name(site):
    """A search that names no index runs on the server's default. A key scoped to other
    indexes is refused it (403) without learning its name, which GET /v1/indexes does not
    list to it either; an index the caller names itself is named back."""
    client, _, state = site
    key = KeyStore(state.keys.path).add("other-only", ("bravo",), ("other",))
    q = {"question": "harbor lighthouse", "branches": 1}
    assert client.get("/v1/indexes", headers=auth(key)).json() == {"indexes": ["other"]}
    for accept in ("application/json", "text/event-stream"):
        r = client.post("/v1/search", json=q, headers={**auth(key), "Accept": accept})
        err = assert_error(r, 403, "forbidden")
        assert "'acl'" not in err["detail"] and "GET /v1/indexes" in err["detail"], err
    named = client.post("/v1/search", json={**q, "index": "acl"}, headers=auth(key))
    assert "may not use index 'acl'" in assert_error(named, 403, "forbidden")["detail"]
    r = client.post("/v1/search", json={**q, "index": "other"}, headers=auth(key))
    assert r.status_code == 200, r.text


QUESTIONS = ["What is Quokkavault?", "zephyrledger obsidianpact", "Bravo secret harbor project",
             "Zephyrledger Plan quokkavault archive", "Who are the obsidianpact members?",
             "Which boats does the lighthouse record?", "b-vault b-ledger",
             "Bravo Quokkavault and the Zephyrledger Plan"]


_DOC_FIELDS = {"doc_id", "chunk_id", "new_ids", "ids", "ranked_chunk_ids", "pruned_ids",
               "final_context_ids", "retrieved_ids", "text", "title"}


def _doc_values(obj) -> list[str]:
    """Every value of a response that carries documents (ids, text, titles) — not the echoes of
    the question (question, subqueries, queries), which may name anything the caller typed."""
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in _DOC_FIELDS:
                out += [json.dumps(v)]
            else:
                out += _doc_values(v)
    elif isinstance(obj, list):
        for v in obj:
            out += _doc_values(v)
    return out


def _leaks(text: str, docs: list[str], marker: str = "") -> list[str]:
    """Ids of `docs` in the document-bearing fields of a response (JSON or SSE), and the marker
    only their text holds anywhere in it (no question contains the marker)."""
    if text.startswith("event:"):
        body = parse_sse(text)
    else:
        try:
            body = json.loads(text)
        except ValueError:  # /metrics: plain text, no question in it: check all of it
            return ([d for d in docs if d in text]
                    + ([marker] if marker and marker in text.lower() else []))
    values = " ".join(_doc_values(body))
    return ([d for d in docs if f'"{d}' in values or f"{d}#" in values]
            + ([marker] if marker and marker in text.lower() else []))


def test_readyz_is_not_ready_while_the_keys_file_cannot_be_read(site):
    """While the keys file cannot be read, every keyed request answers 503 keys_unavailable,
    so /readyz answers 503 too: a balancer sends callers elsewhere."""
    client, keys, state = site
    path = state.keys.path
    saved = path.read_bytes()
    try:
        for broken in ("{bad", "", "{}"):  # not valid; emptied (no key: every caller refused)
            path.write_text(broken)
            ready = assert_error(client.get("/readyz"), 503, "not_ready")
            assert "keys file" in ready["detail"] and str(path) not in ready["detail"]
        path.write_text("{bad")
        assert_error(client.get("/v1/whoami", headers=auth(keys["alpha"])), 503,
                     "keys_unavailable")
    finally:
        path.write_bytes(saved)
    assert client.get("/readyz").status_code == 200


def test_acl_leak(site, capsys):
    """A group-A key never sees a group-B document: JSON search, the stream, indexes, whoami,
    metrics. The bravo key finding them with the same questions shows the test can fail."""
    client, keys, state = site
    tried, leaks = 0, []
    for question in QUESTIONS:
        for key in ("alpha", "public"):
            body = {"question": question}
            for accept in ("application/json", "text/event-stream"):
                r = client.post("/v1/search", json=body,
                                headers={**auth(keys[key]), "Accept": accept})
                assert r.status_code == 200, r.text
                tried += 1
                leaks += _leaks(r.text, BRAVO_DOCS, LEAK_MARKER)
                if key == "public":
                    leaks += _leaks(r.text, ALPHA_DOCS)
    for path in ("/v1/indexes", "/v1/whoami", "/metrics", "/readyz"):
        r = client.get(path, headers=auth(keys["alpha"]))
        tried += 1
        leaks += _leaks(r.text, BRAVO_DOCS, LEAK_MARKER)
    ready = client.get("/readyz").json()  # asked with no key: how many, not which indexes
    assert ready == {"status": "ready", "indexes": ready["indexes"], "indexes_not_ready": 0} \
        and isinstance(ready["indexes"], int) and ready["indexes"] >= 1
    found, marked = set(), 0
    for question in QUESTIONS[:3]:  # positive control: the same questions as group B
        r = client.post("/v1/search", json={"question": question}, headers=auth(keys["bravo"]))
        found |= {d["doc_id"] for d in r.json()["evidence"]}
        marked += LEAK_MARKER in r.text
    with capsys.disabled():
        print(f"\nACL leak test: {tried} requests as group-A/public keys, {len(leaks)} leaks; "
              f"ACL guard dropped {state.searcher.target.acl_guard_dropped} ids")
    assert leaks == []
    assert set(BRAVO_DOCS) <= found and marked
    assert state.searcher.target.acl_guard_dropped == 0  # the backends' filter held


def test_an_opened_index_has_loaded_its_model(site):
    """With the in-process executor a service opened its indexes without the query embedder:
    the first request after a start (or a reopen) loaded it inside its deadline. Opening an
    index now loads it."""
    client, keys, state = site
    driver = state.searcher.target.drivers.open("acl")
    assert driver.executor.retriever.embedder._model is not None


def test_stream_events_in_order(site):
    client, keys, _ = site
    r = client.post("/v1/search", json={"question": "Alpha roadmap harbor sensors", "branches": 2},
                    headers={**auth(keys["alpha"]), "Accept": "text/event-stream"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(r.text)
    types = [e["type"] for e in events]
    assert types[0] == "plan" and types[-1] == "result" and types.count("result") == 1
    assert "error" not in types and "search" in types
    n = len(events[0]["subqueries"])
    assert types.count("branch_started") == types.count("branch_done") == n
    for i in range(n):  # per branch: started < its searches/prunes < done
        mine = [k for k, e in enumerate(events) if e.get("branch") == i]
        assert events[mine[0]]["type"] == "branch_started"
        assert events[mine[-1]]["type"] == "branch_done"
    result = events[-1]["result"]
    assert result["status"] == "ok" and len(result["trace_id"]) == 32
    assert result["branches"] and not any("pid" in b for b in result["branches"])  # internal
    assert {d["doc_id"] for d in result["evidence"]} & set(ALPHA_DOCS)
    for doc in result["evidence"]:
        for chunk in doc["chunks"]:
            assert chunk["found_by"] and chunk["provenance"]


def test_upsert_then_search_finds_delete_then_not(site):
    client, keys, _ = site
    admin, alpha = auth(keys["admin"]), auth(keys["alpha"])
    q = {"question": "flamingo orbital station", "branches": 1}
    ids = lambda: {d["doc_id"] for d in client.post("/v1/search", json=q,  # noqa: E731
                                                   headers=alpha).json()["evidence"]}
    assert "flamingo" not in ids()
    body = "\n".join(json.dumps(d) for d in [
        {"id": "flamingo", "title": "Flamingo Orbital", "text": "The flamingo orbital station "
         "circles the harbor moon.", "acl": ["alpha"]},
        {"id": "flamingo-b", "title": "Flamingo Bravo", "text": "Flamingo orbital station "
         "bravo copy.", "acl": ["bravo"]}])
    r = client.put("/v1/indexes/acl/documents", content=body, headers=admin)
    assert r.status_code == 200 and r.json()["upserted"] == ["flamingo", "flamingo-b"]
    found = ids()
    assert "flamingo" in found and "flamingo-b" not in found  # the upsert kept its ACL
    r = client.put("/v1/indexes/acl/documents", headers=admin, json=[
        {"id": "flamingo", "title": "Flamingo Orbital", "text": "Renamed: the heron orbital "
         "station.", "acl": ["alpha"]}])
    assert r.status_code == 200
    heron = client.post("/v1/search", json={"question": "heron orbital", "branches": 1},
                        headers=alpha).json()
    assert any("heron" in c["text"] for d in heron["evidence"] for c in d["chunks"])
    r = client.put("/v1/indexes/acl/documents", headers=admin, json=[
        {"id": "https://wiki/a/b", "text": "An id with slashes, as a URL.", "acl": ["alpha"]}])
    assert r.status_code == 200, r.text
    for doc_id in ("flamingo", "flamingo-b", "https://wiki/a/b"):  # a '/' id is deletable
        assert client.delete(f"/v1/indexes/acl/documents/{doc_id}", headers=admin).json() == {
            "index": "acl", "deleted": doc_id}
    assert "flamingo" not in ids()
    assert_error(client.delete("/v1/indexes/acl/documents/flamingo", headers=admin), 404)
    metrics = client.get("/metrics").text  # the route's template, without routing syntax
    assert 'endpoint="/v1/indexes/{index}/documents/{doc_id}",method="DELETE"' in metrics
    assert ":path}" not in metrics
    import unicodedata  # an id typed decomposed (macOS) deletes the composed one stored

    r = client.put("/v1/indexes/acl/documents", headers=admin, json=[
        {"id": "pub-ü-2", "text": "A composed id.", "acl": ["alpha"]}])
    assert r.status_code == 200, r.text
    nfd = unicodedata.normalize("NFD", "pub-ü-2")
    assert client.delete(f"/v1/indexes/acl/documents/{nfd}", headers=admin).json() == {
        "index": "acl", "deleted": "pub-ü-2"}
    # an id written decomposed is stored composed, and a write in the other form replaces it
    nfd = unicodedata.normalize("NFD", "résumé-9")
    walrus = {"question": "walrus resume", "branches": 1}

    def walruses() -> list[tuple[str, str]]:
        evidence = client.post("/v1/search", json=walrus, headers=alpha).json()["evidence"]
        return [(d["doc_id"], c["text"]) for d in evidence for c in d["chunks"]
                if "Walrus" in c["text"]]

    for doc_id, text in ((nfd, "Walrus resume one."), ("résumé-9", "Walrus resume two.")):
        r = client.put("/v1/indexes/acl/documents", headers=admin, json=[
            {"id": doc_id, "text": text, "acl": ["alpha"]}])
        assert r.status_code == 200 and r.json()["upserted"] == ["résumé-9"], r.text
    assert walruses() == [("résumé-9", "Walrus resume two.")]
    # an index an earlier version wrote may hold the id decomposed (as its corpus typed it):
    # a write in either form replaces that document, a delete in either form removes it
    _, _, state = site
    with state.searcher.target.drivers.using("acl") as (driver, _):
        from branchsearch.infra.ingest.corpus import Document
        from branchsearch.orchestrator.service import documents

        documents.upsert(driver.retriever, driver.settings,
                         [Document(nfd, "", "Walrus resume as typed.", acl=("alpha",))])
    assert walruses() == [(nfd, "Walrus resume as typed.")]
    assert client.put("/v1/indexes/acl/documents", headers=admin, json=[
        {"id": "résumé-9", "text": "Walrus resume three.", "acl": ["alpha"]}]).status_code == 200
    assert walruses() == [("résumé-9", "Walrus resume three.")]
    assert client.delete(f"/v1/indexes/acl/documents/{nfd}", headers=admin).json() == {
        "index": "acl", "deleted": "résumé-9"}
    with state.searcher.target.drivers.using("acl") as (driver, _):
        documents.upsert(driver.retriever, driver.settings,
                         [Document(nfd, "", "Walrus resume as typed.", acl=("alpha",))])
    assert client.delete("/v1/indexes/acl/documents/résumé-9", headers=admin).json() == {
        "index": "acl", "deleted": nfd}
    assert_error(client.delete(f"/v1/indexes/acl/documents/{nfd}", headers=admin), 404)
    assert walruses() == []
    bad = client.put("/v1/indexes/acl/documents", headers=admin,
                     content=b'{"id": "ok", "text": "fine"}\n{"id": "bad"}\n')
    assert "body:2" in assert_error(bad, 422)["detail"]
    assert_error(client.put("/v1/indexes/acl/documents", headers=admin,
                            json=[{"id": "x", "text": "y", "acl": "not a list" and 5}]), 422)


def test_a_bad_element_of_a_json_array_upload_is_named_as_the_element(site):
    """A bad document of a JSON array upload is a 422 naming the element, counting from 1,
    and how many the array holds (the array may be on one line: it has no lines to name); a
    JSONL upload names its line. Nothing is written."""
    client, keys, _ = site
    admin = auth(keys["admin"])
    good = {"id": "element-ok", "text": "A good document.", "acl": ["alpha"]}
    for body, says in (
            ([good, {"text": "no id"}, good | {"id": "element-3"}],
             "body element 2 of 3: missing document id ('_id' or 'id')"),
            ([good, good], "body element 2 of 2: duplicate document id 'element-ok' (first as "
                           "element 1)"),
            ([good, "not an object"], "body element 2 of 2: expected a JSON object")):
        r = client.put("/v1/indexes/acl/documents", headers=admin, json=body)
        assert assert_error(r, 422, "bad_request")["detail"] == says
    twice = b'[{"id": "a1", "text": "x"}, {"id": "a2", "text": "y", "text": "z"}, {"id": "a3"}]'
    r = client.put("/v1/indexes/acl/documents", content=twice,
                   headers={**admin, "Content-Type": "application/json"})
    assert assert_error(r, 422)["detail"].startswith(
        "body element 2 of 3: the key 'text' is given twice"), r.text
    r = client.put("/v1/indexes/acl/documents", headers=admin,
                   content=b'{"id": "element-ok", "text": "fine"}\n{"text": "no id"}\n')
    assert assert_error(r, 422)["detail"] == "body:2: missing document id ('_id' or 'id')"
    r = client.delete("/v1/indexes/acl/documents/element-ok", headers=admin)
    assert_error(r, 404)  # none of them was written


def test_an_uploaded_document_id_that_shows_nothing_is_a_422(site):
    """A document PUT with the id "\\u200b" (a zero-width space) was written: a document whose
    id every listing shows as nothing, which an empty id is refused for. Now a 422 naming the
    element and the id escaped, and nothing of the body is written."""
    client, keys, _ = site
    admin = auth(keys["admin"])
    for blank in ("\u200b", "\ufeff", "\u2060\u3164"):
        body = [{"id": "shows-nothing-ok", "text": "A good document."},
                {"id": blank, "text": "An id nobody can see."}]
        r = client.put("/v1/indexes/acl/documents", headers=admin, json=body)
        assert assert_error(r, 422, "bad_request")["detail"] == (
            f"body element 2 of 2: document id {ascii(blank)} has no character that shows")
    assert_error(client.delete("/v1/indexes/acl/documents/shows-nothing-ok", headers=admin),
                 404)


def test_an_uploaded_document_id_that_reads_as_another_is_a_422(site):
    """A document PUT whose id holds a zero-width space, a byte-order mark, a word joiner, a
    soft hyphen or full-width letters (an id that looks like another's) is a 422 naming the
    element and the character, and nothing of the body is written; CJK, RTL, emoji and NFD
    ids are written."""
    client, keys, _ = site
    admin = auth(keys["admin"])
    for doc_id, says in LOOKALIKE_IDS:
        body = [{"id": "lookalike-ok", "text": "A good document."},
                {"id": doc_id, "text": "An id that reads as another."}]
        r = client.put("/v1/indexes/acl/documents", headers=admin, json=body)
        assert assert_error(r, 422, "bad_request")["detail"].startswith(
            f"body element 2 of 2: document id {doc_id!r} holds the {says}"), doc_id
    assert_error(client.delete("/v1/indexes/acl/documents/lookalike-ok", headers=admin), 404)
    r = client.put("/v1/indexes/acl/documents", headers=admin,
                   json=[{"id": d, "text": "A harbor note."} for d in KEPT_IDS])
    assert r.status_code == 200, r.text
    for doc_id in r.json()["upserted"]:
        assert client.delete(f"/v1/indexes/acl/documents/{quote(doc_id, safe='')}",
                             headers=admin).status_code == 200, doc_id


def test_an_uploaded_document_holding_a_nul_is_a_422(site):
    """A document PUT whose text or title holds U+0000 is a 422 naming the element, the
    document and the field, as a question holding one is, and nothing is written."""
    client, keys, _ = site
    admin = auth(keys["admin"])
    for field in ("text", "title"):
        body = [{"id": "nul-ok", "text": "A good document."},
                {"id": "nul-doc", "title": "Memo", "text": "A harbor note.",
                 field: "harbor\u0000note"}]
        r = client.put("/v1/indexes/acl/documents", headers=admin, json=body)
        assert assert_error(r, 422, "bad_request")["detail"] == (
            f"body element 2 of 2: document 'nul-doc': {field!r} holds a NUL character "
            "(U+0000) at character 7; remove it")
    for doc_id in ("nul-ok", "nul-doc"):
        assert_error(client.delete(f"/v1/indexes/acl/documents/{doc_id}", headers=admin), 404)


def test_a_scoped_admin_writes_only_its_groups_and_cannot_probe_other_ids(site):
    """An admin key with groups writes and deletes only documents whose acl is within them,
    and a refusal says which rule it met (public, groups beyond its own, another group's id);
    a DELETE of an id it may not see answers exactly as a missing id does (an admin could
    overwrite or delete any group's documents and learn which ids exist)."""
    client, keys, _ = site
    scoped, admin = auth(keys["alpha-admin"]), auth(keys["admin"])
    ok = client.put("/v1/indexes/acl/documents", headers=scoped, json=[
        {"id": "alpha-note", "text": "An alpha harbor note.", "acl": ["alpha"]}])
    assert ok.status_code == 200, ok.text
    said = "key 'alpha-admin' may write only documents whose acl is within its groups (alpha); "
    for doc, why in (
            ({"id": "bravo-note", "text": "x", "acl": ["bravo"]},
             "document 'bravo-note' names groups beyond them: bravo"),
            ({"id": "mixed-note", "text": "x", "acl": ["alpha", "bravo"]},
             "document 'mixed-note' names groups beyond them: bravo"),
            ({"id": "public-note", "text": "x"}, "document 'public-note' is sent without an "
             "acl, which makes it public: only a global admin key writes public documents"),
            ({"id": "pub-harbor", "text": "replaced", "acl": ["alpha"]}, "document "
             "'pub-harbor' is held in this index as a public document: only a global admin "
             "key replaces it"),
            ({"id": "b-vault", "text": "overwritten", "acl": ["alpha"]},  # bravo's id
             "document 'b-vault' is held in this index by another group")):
        body = assert_error(client.put("/v1/indexes/acl/documents", headers=scoped,
                                       json=[doc]), 403, "forbidden")
        assert body["detail"] == said + why, body
    hidden = client.delete("/v1/indexes/acl/documents/b-vault", headers=scoped)
    missing = client.delete("/v1/indexes/acl/documents/no-such-id", headers=scoped)
    assert hidden.status_code == missing.status_code == 404
    assert hidden.json()["error"] == missing.json()["error"] == "document_not_found"
    assert hidden.json()["detail"].replace("b-vault", "X") == \
        missing.json()["detail"].replace("no-such-id", "X")
    body = assert_error(client.delete("/v1/indexes/acl/documents/pub-harbor", headers=scoped),
                        403)
    assert body["detail"].endswith("document 'pub-harbor' is public: only a global admin key "
                                   "deletes public documents"), body
    assert client.delete("/v1/indexes/acl/documents/alpha-note", headers=scoped).json() == {
        "index": "acl", "deleted": "alpha-note"}
    bravo = client.post("/v1/search", headers=auth(keys["bravo"]), json={
        "question": "Quokkavault zephyrledger", "branches": 1}).json()
    assert "b-vault" in {d["doc_id"] for d in bravo["evidence"]}  # untouched
    assert client.get("/v1/whoami", headers=admin).json()["groups"] == ["*"]


def test_a_scoped_admin_cannot_delete_another_groups_document_written_while_it_waited(site):
    """A DELETE of an id the caller may not see is a 404 and leaves the document, also when
    the document is written while the DELETE waits its turn: alpha's admin sent the DELETE of
    an id bravo's document was being written under, and it deleted bravo's document (200)."""
    client, keys, state = site
    lock = state.searcher.target.drivers.write_lock("acl")
    words = "Pelicanmemo of the bravo group: the quay cranes move at dawn. "
    late = {"id": "late-bravo", "acl": ["bravo"], "text": " ".join([words] * 300)}
    with httpx.Client(base_url=str(client.base_url), timeout=120) as other:
        put = ThreadPoolExecutor(1).submit(other.put, "/v1/indexes/acl/documents",
                                           headers=auth(keys["admin"]), json=[late])
        deadline = time.time() + 30
        while not lock.locked():  # the PUT holds the index's write turn, embedding its chunks
            assert time.time() < deadline and not put.done(), put.result().text
            time.sleep(0.01)
        gone = client.delete("/v1/indexes/acl/documents/late-bravo",
                             headers=auth(keys["alpha-admin"]))
        assert put.result().status_code == 200, put.result().text
    assert_error(gone, 404, "document_not_found")
    bravo = client.post("/v1/search", headers=auth(keys["bravo"]), json={
        "question": "Pelicanmemo quay cranes", "branches": 1}).json()
    assert "late-bravo" in {d["doc_id"] for d in bravo["evidence"]}
    assert client.delete("/v1/indexes/acl/documents/late-bravo",
                         headers=auth(keys["admin"])).status_code == 200


def test_a_delete_of_an_id_with_a_trailing_newline_is_not_a_delete_of_the_id_without(site):
    """`DELETE …/documents/memo%0A` names an id no document can have (a PUT refuses whitespace
    in ids): a 404 naming it, and `memo` stays. It deleted `memo` (200), the route's pattern
    matching before a trailing newline."""
    client, keys, _ = site
    admin = auth(keys["admin"])
    r = client.put("/v1/indexes/acl/documents", headers=admin,
                   json=[{"id": "nl-memo", "text": "A memo about the ferry timetable."}])
    assert r.status_code == 200, r.text
    body = assert_error(client.delete("/v1/indexes/acl/documents/nl-memo%0A", headers=admin),
                        404, "document_not_found")
    assert body["detail"] == "no document 'nl-memo\\n' in 'acl'", body
    assert client.delete("/v1/indexes/acl/documents/nl-memo", headers=admin).json() == {
        "index": "acl", "deleted": "nl-memo"}


def test_a_write_through_the_service_renews_the_index_version(site):
    """A document upserted or deleted through the service changes what the index holds: its
    manifest gets a new `version`, so a `batch` resumed on it asks again what it answered
    before; a refused write and a delete of no document keep it."""
    from branchsearch.infra.index.manifest import read_manifest

    client, keys, state = site
    folder = state.searcher.target.settings.index_dir
    version = lambda: read_manifest(folder).version  # noqa: E731
    before = version()
    r = client.put("/v1/indexes/acl/documents", headers=auth(keys["admin"]),
                   json=[{"id": "ver-memo", "text": "A memo about the lighthouse rota."}])
    assert r.status_code == 200, r.text
    upserted = version()
    assert upserted and upserted != before
    r = client.put("/v1/indexes/acl/documents", headers=auth(keys["alpha-admin"]),
                   json=[{"id": "ver-b", "text": "A bravo memo.", "acl": ["bravo"]}])
    assert_error(r, 403, "forbidden")
    assert_error(client.delete("/v1/indexes/acl/documents/no-such-memo",
                               headers=auth(keys["admin"])), 404, "document_not_found")
    assert version() == upserted
    r = client.delete("/v1/indexes/acl/documents/ver-memo", headers=auth(keys["admin"]))
    assert r.status_code == 200, r.text
    assert version() not in (before, upserted)
    r = client.post("/v1/search", headers=auth(keys["admin"]), json={"question": "lighthouse"})
    assert r.status_code == 200, r.text  # the rewritten manifest is the same index to the driver


def test_a_compressed_body_is_a_415_that_says_so(site):
    """A body sent with `Content-Encoding: gzip` (as log shippers and bulk clients send
    uploads) is a 415 naming the encoding, to a PUT and to a search (not a 422 about the
    text's UTF-8), and so is a body labelled `br` but sent plain: nothing is written;
    `identity` is a plain body."""
    client, keys, _ = site
    admin = {**auth(keys["admin"]), "Content-Type": "application/json"}
    docs = json.dumps([{"id": "gz-memo", "text": "A gzipped memo on the tern census."}]).encode()
    for encoding, body in (("gzip", gzip.compress(docs)), ("br", docs), ("GZIP", docs)):
        r = client.put("/v1/indexes/acl/documents", content=body,
                       headers={**admin, "Content-Encoding": encoding})
        detail = assert_error(r, 415, "unsupported_encoding")["detail"]
        assert detail == (f"the body is sent with Content-Encoding {encoding}; this API takes "
                          "bodies uncompressed (no Content-Encoding, or identity)"), detail
    r = client.post("/v1/search", content=gzip.compress(b'{"question": "tern census"}'),
                    headers={**admin, "Content-Encoding": "gzip"})
    assert_error(r, 415, "unsupported_encoding")
    assert_error(client.delete("/v1/indexes/acl/documents/gz-memo", headers=admin), 404)
    r = client.put("/v1/indexes/acl/documents", content=docs,
                   headers={**admin, "Content-Encoding": "identity"})
    assert r.status_code == 200, r.text
    assert client.delete("/v1/indexes/acl/documents/gz-memo", headers=admin).status_code == 200


def test_a_body_declared_as_another_type_than_json_is_a_415_that_names_the_fix(site):
    """A search or a PUT sent as `Content-Type: text/plain` or
    `application/x-www-form-urlencoded` (curl -d without -H) is a 415 `unsupported_media_type`
    naming the type and the header to send, and nothing is written; a body with no
    Content-Type, or any JSON type (with a charset, in any case, `application/*+json`, JSONL's
    `application/x-ndjson`), is read."""
    client, keys, _ = site
    admin = auth(keys["admin"])
    docs = json.dumps([{"id": "typed-memo", "text": "A memo on the tern census."}]).encode()
    search = json.dumps({"question": "harbor lighthouse", "branches": 1}).encode()
    for declared in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                     "application/json; charset=latin-1", "text/json"):
        for method, path, body in (("PUT", "/v1/indexes/acl/documents", docs),
                                   ("POST", "/v1/search", search)):
            r = client.request(method, path, content=body,
                               headers={**admin, "Content-Type": declared})
            assert assert_error(r, 415, "unsupported_media_type")["detail"] == (
                f"the body is sent as Content-Type {declared}; this API reads JSON in UTF-8: "
                "send Content-Type: application/json"), (method, declared)
    assert_error(client.delete("/v1/indexes/acl/documents/typed-memo", headers=admin), 404)
    for declared in (None, "application/json", "application/json; charset=utf-8",
                     "Application/JSON;charset=UTF-8", "application/json; charset=us-ascii",
                     "application/vnd.api+json", "application/x-ndjson"):
        typed = {**admin, **({"Content-Type": declared} if declared else {})}
        r = client.post("/v1/search", content=search, headers=typed)
        assert r.status_code == 200, (declared, r.text)
        r = client.put("/v1/indexes/acl/documents", content=docs, headers=typed)
        assert r.status_code == 200, (declared, r.text)
        assert client.delete("/v1/indexes/acl/documents/typed-memo",
                             headers=admin).status_code == 200


def test_a_body_that_is_not_json_is_judged_after_the_path_and_the_key(site):
    """A `text/plain` (or gzipped) body to a path no route takes is a 404, to a path that
    takes another method a 405, and without a key or with a bad or revoked one a 401, as it
    would be with a JSON body: the 415 is for a request the service would otherwise take
    (and a key that may not write is a 403 before its body is looked at)."""
    client, keys, _ = site
    for sent in ({"Content-Type": "text/plain"}, {"Content-Encoding": "gzip"}):
        body = {"content": b"harbor", "headers": sent}
        assert_error(client.post("/v1/nowhere", **body), 404, "not_found")
        keyed = {"content": b"harbor", "headers": {**sent, **auth(keys["admin"])}}
        assert_error(client.post("/v1/nowhere", **keyed), 404, "not_found")
        assert_error(client.put("/v1/indexes/acl/nowhere", **keyed), 404, "not_found")
        assert_error(client.post("/healthz", **body), 405, "method_not_allowed")
        assert_error(client.post("/v1/whoami", **keyed), 405, "method_not_allowed")
        for key in (None, "bsk_not-a-key", keys["gone"]):
            headers = {**sent, **(auth(key) if key else {})}
            for method, path in (("POST", "/v1/search"), ("PUT", "/v1/indexes/acl/documents")):
                r = client.request(method, path, content=b"harbor", headers=headers)
                assert_error(r, 401, "unauthorized")
                assert r.headers["www-authenticate"].startswith("Bearer")
        r = client.put("/v1/indexes/acl/documents", content=b"harbor",
                       headers={**sent, **auth(keys["alpha"])})
        assert_error(r, 403, "forbidden")  # a key that may not write, whatever it sends
        for method, path in (("POST", "/v1/search"), ("PUT", "/v1/indexes/acl/documents")):
            r = client.request(method, path, **keyed)
            assert_error(r, 415)


def test_a_jsonl_upload_under_each_jsonl_type_is_written(site):
    """A JSONL document upload declared as `application/jsonlines` (the type SageMaker and
    other JSON Lines tools send) was a 415 telling the caller to send application/json. Every
    JSONL type in use is read as JSONL, as `application/x-ndjson` is."""
    client, keys, _ = site
    admin = auth(keys["admin"])
    lines = "".join(json.dumps({"id": f"lines-{i}", "text": f"A tern census note {i}."}) + "\n"
                    for i in range(2)).encode()
    for declared in ("application/x-ndjson", "application/jsonl", "application/x-jsonlines",
                     "application/jsonlines", "application/jsonlines; charset=utf-8"):
        r = client.put("/v1/indexes/acl/documents", content=lines,
                       headers={**admin, "Content-Type": declared})
        assert r.status_code == 200, (declared, r.text)
        assert r.json()["upserted"] == ["lines-0", "lines-1"], declared
    for i in range(2):
        assert client.delete(f"/v1/indexes/acl/documents/lines-{i}",
                             headers=admin).status_code == 200


def test_an_oversized_body_or_a_query_string_is_judged_after_the_path_and_the_key(site):
    """A body over `max_body_bytes` and a query string on a `/v1` route were refused in a
    middleware before routing and authentication: to a path no route takes a 413 or a 422, not
    the 404 any other request there meets; with a method the path does not take, not the 405;
    without a key or with a bad one, not the 401. They are now judged, as the 415 is, once the
    path, method and key are known good (a key that may not write is a 403 first too)."""
    client, keys, _ = site
    big = b"x" * (LIMITS.max_body_bytes + 1)
    admin, alpha = auth(keys["admin"]), auth(keys["alpha"])
    for body, query in (({"content": big}, ""), ({"json": {"question": "harbor"}}, "?k=3")):
        for headers in ({}, admin):
            for method, path in (("POST", "/v1/nowhere"), ("PUT", "/v1/indexes/acl/nowhere"),
                                 ("POST", "/nope")):
                r = client.request(method, path + query, headers=headers, **body)
                assert_error(r, 404, "not_found")
            r = client.request("PUT", "/v1/search" + query, headers=headers, **body)
            assert_error(r, 405, "method_not_allowed")
        for key in (None, "bsk_not-a-key", keys["gone"]):
            headers = auth(key) if key else {}
            for method, path in (("POST", "/v1/search"), ("PUT", "/v1/indexes/acl/documents")):
                r = client.request(method, path + query, headers=headers, **body)
                assert_error(r, 401, "unauthorized")
        r = client.request("PUT", "/v1/indexes/acl/documents" + query, headers=alpha, **body)
        assert_error(r, 403, "forbidden")
        status = 413 if query == "" else 422
        for method, path in (("POST", "/v1/search"), ("PUT", "/v1/indexes/acl/documents")):
            assert_error(client.request(method, path + query, headers=admin, **body), status)
    for path in ("/v1/whoami", "/v1/indexes"):  # the GET routes: a key, then the query
        assert_error(client.get(path + "?x=1"), 401, "unauthorized")
        r = client.get(path + "?x=1", headers=alpha)
        assert "unknown query parameter(s): x;" in assert_error(r, 422, "bad_request")["detail"]
    r = client.delete("/v1/indexes/acl/documents/none?x=1", headers=admin)
    assert_error(r, 422, "bad_request")


def test_input_that_gave_500s_is_a_422(site):
    """A 300-character index name, a lone surrogate in the question and JSON nested 100,000
    deep each answered 500; now a 422 naming the problem (as do a U+0000 in the question and a
    key given twice, which were searched)."""
    client, keys, _ = site
    alpha = auth(keys["alpha"])
    long = "x" * 300
    r = client.post("/v1/search", headers=alpha, json={"question": "harbor", "index": long})
    assert "too long" in assert_error(r, 422, "bad_request")["detail"]
    # a query string is no way to pass a field: ?index=other would search the default index
    r = client.post("/v1/search?index=other&bogus", headers=alpha, json={"question": "harbor"})
    assert "unknown query parameter(s): bogus, index;" in assert_error(r, 422)["detail"]
    assert_error(client.put(f"/v1/indexes/{long}/documents", headers=auth(keys["admin"]),
                            json=[{"id": "a", "text": "b"}]), 422, "bad_request")
    r = client.post("/v1/search", headers={**alpha, "Content-Type": "application/json"},
                    content=b'{"question": "harbor \\ud800 festival"}')
    assert "surrogate" in assert_error(r, 422, "bad_request")["detail"]
    r = client.post("/v1/search", headers=alpha, json={"question": "harbor\u0000festival"})
    assert "control character U+0000" in assert_error(r, 422, "bad_request")["detail"]
    r = client.post("/v1/search", headers={**alpha, "Content-Type": "application/json"},
                    content=b'{"question": "harbor\x01"}')  # a raw control byte inside a string
    assert assert_error(r, 422, "bad_request")["detail"] == \
        "body is not JSON (Invalid control character at character 21)"
    # a key given twice: which one a parser keeps is its own choice (the last, here, searched)
    r = client.post("/v1/search", headers={**alpha, "Content-Type": "application/json"},
                    content=b'{"question": "harbor", "index": "acl", "index": "other"}')
    assert "body gives 'index' twice" in assert_error(r, 422, "bad_request")["detail"]
    deep = b"[" * 100_000 + b"]" * 100_000
    r = client.post("/v1/search", headers={**alpha, "Content-Type": "application/json"},
                    content=deep)
    assert_error(r, 422 if len(deep) <= LIMITS.max_body_bytes else 413)
    nested = b'{"question": "harbor", "k": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"
    r = client.post("/v1/search", headers={**alpha, "Content-Type": "application/json"},
                    content=nested)
    assert_error(r, 422, "bad_request")
    huge = b"1" * 5000  # past Python's 4,300-digit int limit: a ValueError, not a JSON error
    r = client.post("/v1/search", headers={**alpha, "Content-Type": "application/json"},
                    content=b'{"question": "harbor", "k": ' + huge + b"}")
    assert_error(r, 422, "bad_request")
    admin = {**auth(keys["admin"]), "Content-Type": "application/json"}
    for body in (b"[" + b'{"id": ' + huge + b', "text": "x"}]', b'{"id": ' + huge + b"}\n"):
        assert_error(client.put("/v1/indexes/acl/documents", headers=admin, content=body), 422)
    # a document whose groups are spelt as no ACL field would have been public
    for doc, says in (({"id": "o12", "text": "w", "acl": [], "acl_groups": ["hr"]},
                       "both 'acl' and 'acl_groups'"),
                      ({"id": "o15", "text": "k", "acl": None, "acl_groups": ["hr"],
                        "acl-groups": ["hr"]}, "field 'acl-groups' is not read"),
                      ({"id": "o16", "text": "k", "ACL": ["hr"]}, "field 'ACL' is not read"),
                      ({"id": True, "text": "k"}, "must be a string or a whole number")):
        r = client.put("/v1/indexes/acl/documents", headers=auth(keys["admin"]), json=[doc])
        assert says in assert_error(r, 422, "bad_request")["detail"]


def test_a_bm25_service_writes_every_store_so_the_next_ingest_agrees(tmp_path):
    """A service searching BM25 only still writes the dense store of a hybrid index: before,
    an upsert skipped it, and the next ingest stopped on 'stores disagree' and left the index
    incomplete."""
    from branchsearch.infra.index.open import open_retriever

    settings = load_settings(overrides={"home": tmp_path, "index": "acl"}, read_env=False,
                             read_file=False)
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    ingest(corpus, settings)
    admin = KeyStore(tmp_path / "keys.json").add("admin", (), admin=True, everything=True)
    state = service.local_state(settings.replace(search_mode="bm25"), executor="local",
                                keys_path=tmp_path / "keys.json", limits=LIMITS)
    server = start_uvicorn(service.create_app(state), state)
    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            r = client.put("/v1/indexes/acl/documents", headers=auth(admin), json=[
                {"id": "osprey", "title": "Osprey Relay", "text": "The osprey relay beacon.",
                 "acl": ["alpha"]}])
            assert r.status_code == 200, r.text
            r = client.delete("/v1/indexes/acl/documents/pub-harbor", headers=auth(admin))
            assert r.status_code == 200, r.text
        # the service holds no Milvus Lite file between writes: another process opens it
        code = ("import sys; from branchsearch.infra.config.settings import load_settings; "
                "from branchsearch.infra.index.open import open_retriever; "
                "r = open_retriever(load_settings(overrides={'home': sys.argv[1], 'index': "
                "'acl'}, read_env=False, read_file=False)); "
                "print([h.doc_id for h in r.search('osprey relay', mode='dense', k=1, "
                "acl_groups=['alpha'])]); r.close()")
        other = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                               text=True, timeout=300)
        assert other.returncode == 0 and "osprey" in other.stdout, other.stderr[-2000:]
    finally:
        server.stop()
        state.searcher.target.close()
    report = ingest(corpus, settings)  # puts pub-harbor back; keeps the upload
    assert set(report.counts) == {"docstore", "lexical", "dense"}
    assert len(set(report.counts.values())) == 1, report.counts
    retriever = open_retriever(settings)
    try:
        dense = retriever.search("osprey relay beacon", mode="dense", k=3, acl_groups=["alpha"])
        assert dense and dense[0].doc_id == "osprey"
    finally:
        retriever.close()


def _bm25_service(tmp_path, prefix: str | None = None):
    """A development-mode service (every request an admin) over a BM25 index `acl`, its
    driver open: (settings, state, server); under a route `prefix` alone if one is given."""
    settings = load_settings(overrides={"home": tmp_path, "index": "acl", "branches": 1,
                                        "search_mode": "bm25"}, read_env=False, read_file=False)
    ingest(write_corpus(tmp_path / "corpus.jsonl"), settings)
    state = service.local_state(settings, executor="local", limits=LIMITS)
    state.searcher.target.drivers.open("acl")
    app = service.create_app(state)
    return settings, state, start_uvicorn(mounted_at(app, prefix) if prefix else app, state)


def test_the_web_page_resolves_under_a_route_prefix(tmp_path):
    """The web page under a route prefix (Serve's `route_prefix`, a proxy's ASGI `root_path`)
    named its script and the API by absolute paths (/web/app.js, /v1/whoami): a browser asked
    the host's root for them, outside the application, and got 404s. Resolved as a browser
    does (against the page's URL and its <base>), every script and every API path the script
    calls is now under the prefix and answers, the page asked for with or without the slash."""
    prefix = "/team a/search"  # two segments, one with a character a URL encodes
    _, state, server = _bm25_service(tmp_path, prefix=prefix)
    try:
        with httpx.Client(timeout=120, follow_redirects=True) as client:
            for asked in (prefix, prefix + "/"):
                page = client.get(server.url + asked)
                assert page.status_code == 200, (asked, page.text)
                base = re.findall(r'<base href="([^"]*)"', page.text)
                here = urljoin(str(page.url), html.unescape(base[0]) if base else "")
                scripts = [urljoin(here, html.unescape(src)) for src in
                           re.findall(r'<script[^>]*\bsrc="([^"]+)"', page.text)]
                assert scripts
                calls = []
                for src in scripts:
                    script = client.get(src)
                    assert script.status_code == 200, (src, script.text)
                    calls += [urljoin(here, p) for p in re.findall(r'\bapi\("([^"]+)"',
                                                                    script.text)]
                paths = [urlsplit(u).path for u in scripts + calls]
                assert all(p.startswith("/team%20a/search/") for p in paths), paths
                assert {p.rsplit("/search/", 1)[1] for p in paths} == {
                    "web/app.js", "v1/whoami", "v1/indexes", "v1/search"}
                for call in calls:
                    if call.endswith("/v1/search"):  # as the page asks: a stream
                        r = client.post(call, json={"question": "harbor sensors"},
                                        headers={"Accept": "text/event-stream"})
                        assert r.status_code == 200, r.text
                        assert parse_sse(r.text)[-1]["type"] == "result"
                    else:
                        r = client.get(call)
                        assert r.status_code == 200, (call, r.text)
            # outside the prefix nothing answers, as where it is deployed
            assert client.get(server.url + "/web/app.js").status_code == 404
    finally:
        server.stop()
        state.searcher.target.close()


def test_a_store_gone_under_a_running_service_makes_a_write_503_not_500(tmp_path):
    """The tantivy folder renamed under a running service (found by a hostile pass): a PUT was
    a 500 internal_error. A store file gone (tantivy, or the dense.db a write would have put
    into the deleted file and lost) is now a 503 before anything is written; the documents
    that were there are still found once the file is back, and writes go on."""
    settings, state, server = _bm25_service(tmp_path)
    folder = settings.index_dir / "tantivy"
    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            # the web page of a development server calls without a key (test_service_web:
            # a server with keys asks for one)
            page = client.get("/")
            assert page.status_code == 200 and '<meta name="bs-auth" content="dev">' in page.text
            assert client.head("/web/app.js").status_code == 200  # (was 405)
            put = lambda: client.put("/v1/indexes/acl/documents", json=[  # noqa: E731
                {"id": "osprey", "text": "The osprey relay beacon."}])
            dense = settings.index_dir / "dense.db"
            for gone, away in ((folder, folder.with_name("tantivy-away")),
                               (dense, dense.with_name("dense-away.db"))):
                gone.rename(away)
                err = assert_error(put(), 503, "index_incomplete")
                assert str(tmp_path) not in err["detail"], err
                assert_error(client.delete("/v1/indexes/acl/documents/pub-harbor"), 503,
                             "index_incomplete")
                away.rename(gone)
            with read_only_folder(settings.index_dir):  # the operator's to fix: a 503
                err = assert_error(put(), 503, "index_not_writable")
                assert str(tmp_path) not in err["detail"], err
            r = client.post("/v1/search", json={"question": "Harbor Festival in June"})
            assert r.status_code == 200 and r.json()["evidence"], r.text
            assert put().status_code == 200
            assert client.delete("/v1/indexes/acl/documents/pub-harbor").status_code == 200
    finally:
        server.stop()
        state.searcher.target.close()


def test_a_write_whose_index_folder_is_removed_while_it_runs_says_it_is_lost(tmp_path,
                                                                            monkeypatch):
    """The index folder removed while a document write runs, after the write's checks: the
    write goes to the removed files. The answer is a 503 `index_changed` saying the write is
    lost, not a 200 or a `write_failed` saying searches still see the old documents; the next
    write is a 404, and no answer names the server's paths."""
    import shutil

    from branchsearch.orchestrator.service import documents

    settings, state, server = _bm25_service(tmp_path)
    real = documents.upsert

    def removed_meanwhile(*args, **kwargs):
        shutil.rmtree(settings.index_dir)
        return real(*args, **kwargs)

    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            put = lambda: client.put("/v1/indexes/acl/documents", json=[  # noqa: E731
                {"id": "osprey", "text": "The osprey relay beacon."}])
            monkeypatch.setattr(documents, "upsert", removed_meanwhile)
            err = assert_error(put(), 503, "index_changed")
            assert "lost" in err["detail"] and str(tmp_path) not in err["detail"], err
            monkeypatch.setattr(documents, "upsert", real)
            assert_error(put(), 404, "index_not_found")
    finally:
        server.stop()
        state.searcher.target.close()


def test_a_write_that_fails_midway_renews_the_index_version(tmp_path, monkeypatch):
    """A document write whose second store fails after the first one landed (a delete that
    removed the document from the docstore, then met a full disk in the lexical store; an
    upsert that wrote the lexical store, then met a docstore error) is a 503 `write_failed`,
    and the manifest's `version` moves all the same: the index holds something else now, and
    a `batch` resumed on it asks again what it answered before, never keeping rows whose
    evidence quotes a document the index no longer has. A write whose version cannot be
    moved before it begins (the manifest not rewritable: a full disk) is refused, 503
    `write_failed`, with nothing written."""
    import sqlite3

    from branchsearch.infra.index.manifest import read_manifest
    from branchsearch.infra.stores.docstore import DocStore
    from branchsearch.infra.stores.tantivy import TantivyStore

    settings, state, server = _bm25_service(tmp_path)
    version = lambda: read_manifest(settings.index_dir).version  # noqa: E731

    def disk_full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    real_replace = DocStore.replace_documents

    def docstore_error(self, *args, **kwargs):
        raise sqlite3.OperationalError("disk I/O error")

    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            search = lambda: client.post("/v1/search", json={  # noqa: E731
                "question": "Harbor Festival in June"}).json()
            assert "pub-harbor" in {e["doc_id"] for e in search()["evidence"]}
            before = version()
            with monkeypatch.context() as patch:
                patch.setattr(TantivyStore, "write", disk_full)
                assert_error(client.delete("/v1/indexes/acl/documents/pub-harbor"), 503,
                             "write_failed")
            assert "pub-harbor" not in {e["doc_id"] for e in search()["evidence"]}
            deleted = version()
            assert deleted and deleted != before
            with monkeypatch.context() as patch:
                patch.setattr(DocStore, "replace_documents", docstore_error)
                assert_error(client.put("/v1/indexes/acl/documents", json=[
                    {"id": "osprey", "text": "The osprey relay beacon."}]), 503,
                    "write_failed")
            assert version() not in (before, deleted)
            assert DocStore.replace_documents is real_replace
            kept = version()
            with monkeypatch.context() as patch:
                patch.setattr("branchsearch.infra.index.manifest.renew_version", disk_full)
                r = client.put("/v1/indexes/acl/documents", json=[
                    {"id": "kestrel", "text": "The kestrel lantern regatta."}])
                assert_error(r, 503, "write_failed")
                assert "nothing was written" in r.json()["detail"], r.text
                assert str(settings.index_dir) not in r.text  # the path is the log's
            assert version() == kept
            assert "kestrel" not in {e["doc_id"] for e in client.post("/v1/search", json={
                "question": "kestrel lantern regatta"}).json()["evidence"]}
    finally:
        server.stop()
        state.searcher.target.close()


@pytest.mark.parametrize("executor", ["local", pytest.param("ray", marks=pytest.mark.ray)])
def test_ingests_under_a_running_service_are_what_it_searches_next(tmp_path, executor):
    """Ingests run as a user would (the CLI, its own process) while a service with either
    executor serves two indexes. Documents added to one are found (and nothing is reopened);
    `--no-dense` over the hybrid one is refused, the index unchanged; the hybrid index removed
    and ingested anew BM25-only, then hybrid again, is searched as a service started afresh
    searches it. Before: the service kept the stores it had opened, so it ranked a relaid index
    with its old stores under a policy reading the new manifest (rankings that matched neither)
    or searched a removed folder's files, and `--no-dense` over a hybrid index left a dense
    side that a later ingest found disagreeing."""
    import shutil
    import time

    from branchsearch.orchestrator.service.auth import ApiKey
    from branchsearch.orchestrator.service.protocol import SearchRequest
    from branchsearch.orchestrator.service.searcher import Searcher

    settings = load_settings(overrides={"home": tmp_path, "index": "acl", "branches": 1},
                             read_env=False, read_file=False)
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    ingest(corpus, settings)
    ingest(corpus, settings.replace(index="bm"), dense=False)
    museum = "When was the museum of maritime history opened?"
    questions = [museum, "Which sensors does the harbor budget fund?", "lighthouse relay"]
    state = service.local_state(settings, executor=executor, limits=LIMITS)  # dev mode: admin
    server = start_uvicorn(service.create_app(state), state)
    searcher = state.searcher.target

    def ranked(search, index: str = "acl") -> list[list[str]]:
        return [[e["doc_id"] for e in search(q, index)["evidence"]] for q in questions]

    def over_http(q: str, index: str) -> dict:
        r = client.post("/v1/search", json={"question": q, "index": index})
        assert r.status_code == 200, r.text
        return r.json()

    def cli_ingest(path, index: str, *flags: str, rc: int = 0) -> str:
        done = subprocess.run([sys.executable, "-m", "branchsearch.orchestrator.cli", "ingest",
                               str(path), "--home", str(tmp_path), "--index", index, *flags],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == rc, done.stdout[-2000:] + done.stderr[-2000:]
        return done.stderr

    def as_fresh() -> list[list[str]]:
        fresh = Searcher(settings, executor="local")
        try:
            key = ApiKey("dev", ("*",), admin=True)
            return ranked(lambda q, index: asyncio.run(fresh.search(
                SearchRequest(question=q, index=index), key)))
        finally:
            fresh.close()

    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            hybrid, bm25 = ranked(over_http), ranked(over_http, "bm")
            assert "pub-museum" not in bm25[0]
            opened = dict(searcher.drivers.by_index)
            more = write_corpus(tmp_path / "more.jsonl", CORPUS + [
                {"_id": "pub-museum", "title": "Seafaring Exhibit Hall",
                 "text": "The maritime history museum opened its doors in 1999 by the quay."}])
            cli_ingest(more, "bm")  # no flag: as the index was made, BM25 only
            waited = time.monotonic()  # tantivy's reader reloads itself within a second
            while over_http(museum, "bm")["evidence"][0]["doc_id"] != "pub-museum":
                assert time.monotonic() - waited < 30, "the added document was not found"
                time.sleep(0.2)
            assert searcher.drivers.by_index == opened  # the same stores, nothing reopened
            refused = cli_ingest(corpus, "acl", "--no-dense", rc=2)
            assert refused.count("\n") == 1 and "has vectors" in refused, refused
            assert ranked(over_http) == hybrid and searcher.drivers.by_index == opened
            shutil.rmtree(settings.index_dir)  # made anew, BM25 only
            cli_ingest(corpus, "acl", "--no-dense")
            relaid = ranked(over_http)
            assert searcher.drivers.by_index["acl"] is not opened["acl"]
            assert relaid == as_fresh(), "not what a fresh service ranks"
            shutil.rmtree(settings.index_dir)  # and hybrid again: the Lite file is free
            cli_ingest(corpus, "acl")
            assert ranked(over_http) == hybrid
    finally:
        server.stop()
        searcher.close()
        if executor == "ray":
            import ray

            ray.shutdown()


@pytest.mark.ray
def test_an_index_whose_retriever_actor_died_for_good_is_started_again(tmp_path):
    """The Ray executor serving two indexes; one index's retriever actor is killed past its
    restarts. A search that meets the death is answered: the executor starts the retriever
    again and runs the question once more. A document write that meets it gets one 503 to
    retry, naming no process (no pid, actor id or namespace), and the next request starts the
    index afresh. The other index never notices."""
    import ray

    settings = load_settings(overrides={"home": tmp_path, "index": "acl", "branches": 1},
                             read_env=False, read_file=False)
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    ingest(corpus, settings)
    ingest(corpus, settings.replace(index="bm"), dense=False)
    _, server, searcher = serve_here(settings)
    question = {"question": "Which sensors does the harbor budget fund?"}
    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            def search(index: str) -> httpx.Response:
                return client.post("/v1/search", json={**question, "index": index})

            def evidence(r: httpx.Response) -> list[str]:
                return [e["doc_id"] for e in r.json()["evidence"]]

            first = search("acl")
            assert first.status_code == 200, first.text
            bm = search("bm")
            assert bm.status_code == 200, bm.text
            driver = searcher.drivers.by_index["acl"]
            killed = driver.executor.retriever
            ray.kill(killed, no_restart=True)
            again = search("acl")  # met the death: started again, asked again
            assert again.status_code == 200, again.text
            assert evidence(again) == evidence(first)
            assert searcher.drivers.by_index["acl"] is driver
            assert driver.executor.retriever is not killed
            assert driver.executor.revived == 1
            # streamed: a `rerun` event, then the branches again, and the same result
            ray.kill(driver.executor.retriever, no_restart=True)
            streamed = client.post("/v1/search", json={**question, "index": "acl"},
                                   headers={"Accept": "text/event-stream"})
            events = parse_sse(streamed.text)
            kinds = [e["type"] for e in events]
            assert streamed.status_code == 200 and kinds[-1] == "result", kinds
            assert kinds.count("rerun") == 1 and "branch_started" in kinds[kinds.index("rerun"):]
            assert [d["doc_id"] for d in events[-1]["result"]["evidence"]] == evidence(first)
            assert driver.executor.revived == 2
            # a write that meets a death is not repeated for the caller: one 503 to retry
            pid = ray.get(driver.executor.retriever.ping.remote())
            ray.kill(driver.executor.retriever, no_restart=True)
            refused = client.put("/v1/indexes/acl/documents", json=[
                {"id": "late", "text": "A harbor note written as the retriever died."}])
            assert refused.status_code == 503, refused.text
            body = refused.json()
            assert body["error"] == "backend_unavailable" and "retry" in body["detail"]
            assert str(pid) not in refused.text and "actor_id" not in refused.text
            assert search("bm").status_code == 200  # the other index never noticed
            after = search("acl")
            assert after.status_code == 200, after.text
            assert searcher.drivers.by_index["acl"] is not driver  # started afresh
            assert evidence(after) == evidence(first)
            assert client.get("/readyz").status_code == 200
    finally:
        server.stop()
        searcher.close()
        ray.shutdown()


def test_indexes_made_while_the_ray_service_runs_are_served(tmp_path):
    """The Ray executor's branch pool is planned at the first request, with CPU room for the
    retrievers of the indexes there are then, and one more. Indexes ingested after that are
    served too: past the room, their retriever actors reserve no CPU and share the CPUs
    rather than wait for CPUs the pool holds. Closing the service gives the room back."""
    import ray

    settings = load_settings(overrides={"home": tmp_path, "index": "first",  # 3 branches:
                                        "actor_start_timeout_s": 30},  # the pool takes the rest
                             read_env=False, read_file=False)
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    ingest(corpus, settings, dense=False)
    _, server, searcher = serve_here(settings)
    question = {"question": "Which sensors does the harbor budget fund?"}
    later = ["later", "später-ü", "third"]
    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            first = client.post("/v1/search", json={**question, "index": "first"})
            assert first.status_code == 200, first.text
            for name in later:  # the CLI would do this, beside the running service
                ingest(corpus, settings.replace(index=name), dense=False)
            for name in later:
                r = client.post("/v1/search", json={**question, "index": name})
                assert r.status_code == 200, (name, r.text)
                assert ([e["doc_id"] for e in r.json()["evidence"]]
                        == [e["doc_id"] for e in first.json()["evidence"]])
            assert searcher._retriever_room == 0 and len(searcher._cpu_holders) == 2
            assert client.get("/readyz").status_code == 200
    finally:
        server.stop()
        searcher.close()
        ray.shutdown()
    assert searcher._retriever_room == 2 and not searcher._cpu_holders


def test_an_index_left_unused_is_closed_and_opens_again(tmp_path):
    """A service in front of many indexes does not keep a retriever process for every index
    ever asked once: one unused for `index_idle_close_s` is closed (its retriever actor gone,
    its CPU room back), the default index never; its next request opens it again and gets
    the same answer."""
    import ray

    settings = load_settings(overrides={"home": tmp_path, "index": "first",
                                        "actor_start_timeout_s": 30},
                             read_env=False, read_file=False)
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    for name in ("first", "zweite-ü"):
        ingest(corpus, settings.replace(index=name), dense=False)
    limits = Limits(**{**LIMITS.__dict__, "index_idle_close_s": 4.0})  # room on a busy CI
    _, server, searcher = serve_here(settings, limits)
    question = {"question": "Which sensors does the harbor budget fund?"}
    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            first = client.post("/v1/search", json=question)
            other = client.post("/v1/search", json={**question, "index": "zweite-ü"})
            assert first.status_code == other.status_code == 200, (first.text, other.text)
            actor = searcher.drivers.by_index["zweite-ü"].executor.retriever
            assert ray.get(actor.ping.remote(), timeout=30) is not None
            deadline = time.monotonic() + 30
            while "zweite-ü" in searcher.drivers.by_index or searcher.drivers.retiring:
                assert time.monotonic() < deadline, "the unused index was not closed"
                time.sleep(0.2)
            assert list(searcher.drivers.by_index) == ["first"]  # the default index stays open
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(actor.ping.remote(), timeout=30)  # its retriever process is gone
            again = client.post("/v1/search", json={**question, "index": "zweite-ü"})
            assert again.status_code == 200, again.text
            assert ([e["doc_id"] for e in again.json()["evidence"]]
                    == [e["doc_id"] for e in other.json()["evidence"]])
            assert client.get("/readyz").status_code == 200
    finally:
        server.stop()
        searcher.close()
        ray.shutdown()
    assert not searcher._cpu_holders


def _three_indexes(home) -> dict[str, tuple[str, set[str]]]:
    """Indexes a, b, c of the shipped fixtures (BM25 only) in `home`: name -> (a question,
    the index's document ids)."""
    from conftest import FIXTURES, HOTPOT, MUSIQUE

    made = {}
    for name, corpus, question in (
            ("a", HOTPOT, "Were Scott Derrickson and Ed Wood of the same nationality?"),
            ("b", MUSIQUE, "Who published the Journal of Psychotherapy Integration?"),
            ("c", FIXTURES / "injection.jsonl", "Corliss Archer trivia")):
        ingest(corpus, load_settings(overrides={"home": home, "index": name}, read_env=False,
                                     read_file=False), dense=False)
        rows = corpus / "corpus.jsonl" if corpus.is_dir() else corpus
        ids = {row.get("_id", row.get("id")) for row in map(json.loads,
                                                            rows.read_text().splitlines())}
        made[name] = question, ids
    return made


def test_a_server_with_max_in_flight_requests_answers_503_with_its_figures(site):
    """A search while the server runs `max_in_flight` requests is a 503 `overloaded` whose
    body gives, as a key's 429 does, its figures as fields: `reason`, `in_use` and `limits`
    (the `Overload` schema), over JSON and over SSE alike, and says them in words."""
    client, keys, state = site
    concurrency = state.searcher.target.concurrency
    held = [concurrency.take(f"holder-{i}") for i in range(LIMITS.max_in_flight)]
    try:
        for accept in ("application/json", "text/event-stream"):
            r = client.post("/v1/search", headers={**auth(keys["alpha"]), "Accept": accept},
                            json={"question": "harbor lighthouse"})
            body = assert_error(r, 503, "overloaded")
            assert r.headers["Retry-After"] == str(LIMITS.retry_after_s)
            assert (body["reason"], body["in_use"], body["limits"]) == (
                "max_in_flight", LIMITS.max_in_flight,
                {"max_in_flight": LIMITS.max_in_flight}), body
            many = "request" if LIMITS.max_in_flight == 1 else "requests"
            assert body["detail"] == (f"{LIMITS.max_in_flight} {many} in flight; the server "
                                      f"takes {LIMITS.max_in_flight}"), body
    finally:
        for slot in held:
            slot.let_go()
    r = client.post("/v1/search", headers=auth(keys["alpha"]),
                    json={"question": "harbor lighthouse", "branches": 1})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("executor", ["local", "ray"])
def test_the_service_keeps_at_most_max_open_indexes_open(tmp_path, executor):
    """A service in front of many indexes does not grow without bound: with
    `max_open_indexes = 2`, a search of a third index first closes the least recently used
    open index no request is using (the default one last; its retriever process gone), and a
    search of the closed one opens it again. When every open index has a request in flight,
    the search of another is a 503 `overloaded` with Retry-After at once, not a wait."""
    import ray

    indexes = _three_indexes(tmp_path)
    settings = load_settings(overrides={"home": tmp_path, "index": "c", "branches": 2,
                                        "max_open_indexes": 2, "actor_start_timeout_s": 30},
                             read_env=False, read_file=False)
    state = service.local_state(settings, executor=executor, limits=Limits.of(settings))
    searcher = state.searcher.target
    server = start_uvicorn(service.create_app(state), state)
    drivers = searcher.drivers

    def search(client, name):
        question, ids = indexes[name]
        r = client.post("/v1/search", json={"question": question, "index": name})
        assert r.status_code == 200, (name, r.text)
        found = [e["doc_id"] for e in r.json()["evidence"]]
        assert found and set(found) <= ids, (name, found)  # that index's documents

    def open_now() -> set[str]:
        deadline = time.monotonic() + 30
        while drivers.retiring:  # (a closed index's stores close on their own thread)
            assert time.monotonic() < deadline, "a retired index did not close"
            time.sleep(0.1)
        return set(drivers.by_index)

    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            search(client, "a")
            search(client, "b")
            first_a = drivers.by_index["a"]
            assert open_now() == {"a", "b"}
            search(client, "c")  # the cap: a, least recently used, is closed first
            assert open_now() == {"b", "c"}
            if executor == "ray":
                with pytest.raises(ray.exceptions.RayActorError):  # its retriever is gone
                    ray.get(first_a.executor.retriever.ping.remote(), timeout=30)
            search(client, "a")  # opened again; b goes (c is the default: closed last)
            assert open_now() == {"c", "a"} and drivers.by_index["a"] is not first_a
            held = [(i, d) for i, d in drivers.opened()]  # a request in flight on each
            for index, driver in held:
                assert drivers.hold(index, driver) is not None
            try:
                started = time.monotonic()
                r = client.post("/v1/search", json={"question": indexes["b"][0], "index": "b"})
                body = assert_error(r, 503, "overloaded")
                assert r.headers["Retry-After"] == "1" and "max_open_indexes" in body["detail"]
                assert (body["reason"], body["in_use"], body["limits"]) == (
                    "max_open_indexes", 2, {"max_open_indexes": 2}), body
                assert time.monotonic() - started < 10  # at once, not at the deadline
                assert open_now() == {"c", "a"}
            finally:
                for _, driver in held:
                    drivers.let_go(driver, None)
            search(client, "b")
            assert open_now() == {"c", "b"}
            assert client.get("/readyz").status_code == 200
    finally:
        server.stop()
        searcher.close()
        if executor == "ray":
            ray.shutdown()


def test_a_document_read_racing_a_put_is_one_version_of_it(tmp_path):
    """A branch's `read_document` reads the document (its groups) and its chunks (its text);
    they were two reads, and a PUT that landed between them paired the groups it replaced
    with the text it wrote — a document of group alpha read with bravo's text. Now they are
    one read: a PUT over HTTP made to land between the two (the first part) and PUTs racing
    reads on threads (the second) never mix two versions."""
    import threading

    from branchsearch.infra.stores.acl import ACL_ALL

    settings = load_settings(overrides={"home": tmp_path, "index": "race"}, read_env=False,
                             read_file=False)
    versions = {  # one chunk, then several: the chunk ids change with the text
        "alpha": {"id": "doc-x", "acl": ["alpha"], "text": "alphaword harbor. " * 10},
        "bravo": {"id": "doc-x", "acl": ["bravo"], "text": "bravoword lighthouse. " * 300}}
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps(versions["alpha"]) + "\n")
    ingest(corpus, settings, dense=False)
    state = service.local_state(settings, executor="local", limits=LIMITS)
    searcher = state.searcher.target
    server = start_uvicorn(service.create_app(state), state)
    client = httpx.Client(base_url=server.url, timeout=120)

    def put(group: str) -> None:
        r = client.put("/v1/indexes/race/documents", json=[versions[group]])
        assert r.status_code == 200, r.text

    def one_version(doc: dict) -> str:
        [group] = doc["acl"]
        words = {w for c in doc["chunks"] for w in c["text"].split() if w.endswith("word")}
        assert words == {f"{group}word"}, (doc["acl"], words)  # its groups, its text
        assert doc["chunk_ids"] == [c["chunk_id"] for c in doc["chunks"]] and doc["n_chunks"] \
            == len(doc["chunks"]), doc["chunk_ids"]
        return group

    try:
        search = {"question": "harbor", "index": "race"}
        assert client.post("/v1/search", json=search).status_code == 200  # the index is open
        with searcher.drivers.using("race") as (driver, _):
            retriever = driver.executor.retriever
            store = retriever.docstore
            landed = threading.Event()
            chunks_read = type(store).document_chunks

            def after_the_first_read(self_, doc_id):  # a PUT, given the time to land here
                if not landed.is_set():
                    threading.Thread(target=lambda: (put("bravo"), landed.set())).start()
                    landed.wait(3)
                return chunks_read(self_, doc_id)

            store.document_chunks = after_the_first_read.__get__(store)
            try:
                assert one_version(retriever.read_document("doc-x", acl_groups=[ACL_ALL])) \
                    in ("alpha", "bravo")
            finally:
                del store.document_chunks
            assert landed.wait(30)
            assert one_version(retriever.read_document("doc-x", acl_groups=[ACL_ALL])) \
                == "bravo"
            seen, stop, failures = set(), threading.Event(), []

            def read_on():
                while not stop.is_set():
                    try:
                        seen.add(one_version(retriever.read_document("doc-x",
                                                                     acl_groups=[ACL_ALL])))
                    except Exception as exc:  # noqa: BLE001 — the assertion, said below
                        failures.append(exc)
                        return

            readers = [threading.Thread(target=read_on) for _ in range(3)]
            for reader in readers:
                reader.start()
            try:
                for n in range(16):
                    put("alpha" if n % 2 == 0 else "bravo")
            finally:
                stop.set()
                for reader in readers:
                    reader.join(30)
            assert not failures, failures[0]
            assert seen == {"alpha", "bravo"}
    finally:
        client.close()
        server.stop()
        searcher.close()


def test_the_deadline_counts_from_the_requests_arrival_at_the_service(site):
    """The deadline counts from the HTTP arrival (`received_at`, set by the app), so time in
    Serve's queue to the searcher counts: a request that waited past its deadline is a 504 at
    once, not searched, nor refused 429 for a slot it no longer needs."""
    from branchsearch.orchestrator.service.auth import ApiKey
    from branchsearch.orchestrator.service.protocol import SearchRequest

    _, _, state = site
    searcher, key = state.searcher.target, ApiKey("alpha", ("alpha",))
    late = SearchRequest("harbor festival", deadline_s=5, received_at=time.time() - 6)
    started = time.monotonic()
    with pytest.raises(ApiError, match=r"waited 6\.\d s in the service's queues") as refused:
        asyncio.run(searcher.search(late, key))
    assert refused.value.status == 504 and time.monotonic() - started < 1
    fresh = SearchRequest("harbor festival", deadline_s=60, received_at=time.time() - 1)
    assert asyncio.run(searcher.search(fresh, key))["status"] in ("ok", "partial")


def test_a_stream_its_client_leaves_is_counted_as_499(site):
    """A streamed search the client abandons is counted under status 499, as a JSON one is,
    not as a 200 (Starlette ends a stream whose client left without an error)."""
    client, keys, _ = site

    def counted(status: str) -> float:
        for line in client.get("/metrics").text.splitlines():
            if (line.startswith("branchsearch_http_requests_total{")
                    and 'endpoint="/v1/search"' in line and f'status="{status}"' in line):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = counted("499"), counted("200")
    with client.stream("POST", "/v1/search", headers={**auth(keys["alpha"]),
                                                      "Accept": "text/event-stream"},
                       json={"question": "harbor festival lighthouse", "branches": 2}) as r:
        assert r.status_code == 200  # the first event is under way: the client goes now
    deadline = time.monotonic() + 30
    while counted("499") == before[0]:
        assert time.monotonic() < deadline, "the abandoned stream was not counted as 499"
        time.sleep(0.2)
    assert counted("499") == before[0] + 1 and counted("200") == before[1]


@pytest.mark.parametrize("executor", ["local", pytest.param("ray", marks=pytest.mark.ray)])
def test_a_key_that_walks_away_from_its_searches_runs_no_more_of_them_than_its_limit(
        tmp_path, executor):
    """A key at its limit of 2 opens searches and drops them at once, JSON and SSE, over and
    over for a few seconds, while another key searches. A caller gone calls its search off
    (its branches end at their next turn) and its slot is free only once they have: no more
    than 2 of the key's searches run at any moment (the service's `search` threads, counted
    meanwhile; with Ray, one ends only once its branches' tasks have), and the other key's
    searches take about what they take beside two searches. Before, a disconnect freed the
    slot and left the search running to its end: dozens ran at once (each branch a busy CPU),
    and the other key's searches waited seconds."""
    import threading

    from branchsearch.workers.scripted import busy_factory

    settings = load_settings(overrides={"home": tmp_path, "index": "acl", "branches": 2,
                                        "max_turns": 20, "no_progress_turns": 20},
                             read_env=False, read_file=False)
    ingest(write_corpus(tmp_path / "corpus.jsonl"), settings, dense=False)
    store = KeyStore(tmp_path / "keys.json")
    walker, other = store.add("walker", ()), store.add("other", ())
    limits = Limits(per_key_concurrency=2, max_in_flight=64, default_deadline_s=30)
    state = service.local_state(settings, executor=executor, keys_path=tmp_path / "keys.json",
                                limits=limits)
    searcher = state.searcher.target
    searcher.drivers.open("acl").policy_factory = busy_factory  # 20 ms of CPU a turn
    server = start_uvicorn(service.create_app(state), state)
    question = {"question": "harbor festival lighthouse"}

    def running() -> int:
        return sum(t.name == "search" and t.is_alive() for t in threading.enumerate())

    async def searches(client, until: float) -> list[float]:
        took = []
        while time.monotonic() < until or not took:
            began = time.perf_counter()
            r = await client.post("/v1/search", headers=auth(other), json=question)
            assert r.status_code == 200, r.text
            took.append(time.perf_counter() - began)
        return took

    async def walk_away(until: float, stream: bool) -> dict:
        seen: dict = {}
        headers = {**auth(walker), **({"Accept": "text/event-stream"} if stream else {})}
        async with httpx.AsyncClient(base_url=server.url, timeout=60 if stream else 0.1) as c:
            while time.monotonic() < until:
                try:  # a stream: gone once its 200 arrives; JSON: gone after 0.1 s
                    async with c.stream("POST", "/v1/search", headers=headers,
                                        json=question) as r:
                        seen[r.status_code] = seen.get(r.status_code, 0) + 1
                        if r.status_code == 429:
                            await asyncio.sleep(0.01)
                except httpx.TimeoutException:
                    seen["gone"] = seen.get("gone", 0) + 1
        return seen

    async def flood() -> tuple[list[float], list[float], list[dict]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            alone = await searches(client, time.monotonic() + 2)
            json_until = time.monotonic() + 2.5
            until = json_until + 2.5

            async def walkers() -> list[dict]:  # JSON, then streams: two at a time
                walked = await asyncio.gather(walk_away(json_until, False),
                                              walk_away(json_until, False))
                return walked + await asyncio.gather(walk_away(until, True),
                                                     walk_away(until, True))

            walked, beside = await asyncio.gather(walkers(), searches(client, until))
            return alone, beside, walked

    peak, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], running())
            time.sleep(0.003)

    watcher = threading.Thread(target=watch, daemon=True)
    try:
        watcher.start()
        alone, beside, walked = asyncio.run(flood())
        ended = time.monotonic()
        while running() and time.monotonic() < ended + 5:
            time.sleep(0.05)
        drained = time.monotonic() - ended
        done.set()
        watcher.join()
        gone = sum(w.get("gone", 0) for w in walked[:2])
        left = sum(w.get(200, 0) for w in walked[2:])
        print(f"{executor}: {gone} JSON and {left} SSE searches walked away from; "
              f"{sum(w.get(429, 0) for w in walked)} refused 429; at most {peak[0]} running; "
              f"the other key's: {max(alone):.2f} s alone, {max(beside):.2f} s beside; "
              f"drained {drained:.2f} s after")
        assert gone > 2 and left > 2, walked  # the key did walk away, again and again
        assert peak[0] <= 3, peak  # the walker's 2, and the other key's one
        assert drained < 2 and searcher.concurrency.total == 0
        assert max(beside) < 3 * max(alone) + 1.0, (alone, beside)
    finally:
        done.set()
        server.stop()
        searcher.close()
        if executor == "ray":
            import ray

            ray.shutdown()


def test_limits(site):
    client, keys, state = site
    alpha = auth(keys["alpha"])
    assert_error(client.post("/v1/search", headers=alpha, content=b"x" * (LIMITS.max_body_bytes
                                                                          + 1)), 413)
    assert_error(client.post("/v1/search", headers=alpha, json={"question": "q" * 301}), 422,
                 "question_too_long")
    assert_error(client.post("/v1/search", headers=alpha, content=b"{not json"), 422)
    assert_error(client.post("/v1/search", headers=alpha,
                             json={"question": "q", "acl_groups": ["bravo"]}), 422)
    conc = state.searcher.target.concurrency
    until = time.monotonic() + 10  # a search whose client left (the tests before) holds its
    while conc.total and time.monotonic() < until:  # slot until it has stopped, a turn later
        time.sleep(0.05)
    with conc.slot("alpha"), conc.slot("alpha"):  # the key's two slots are busy
        # it waits for one within its deadline, then 429
        began = time.monotonic()
        r = client.post("/v1/search", headers=alpha, json={"question": "harbor",
                                                           "deadline_s": 0.5})
        body = assert_error(r, 429, "too_many_requests")
        assert "(its deadline)" in body["detail"]
        assert (body["reason"], body["running"], body["waiting"], body["limits"]) == (
            "deadline_in_queue", 2, 0, {"per_key_concurrency": LIMITS.per_key_concurrency,
                                        "per_key_queue": LIMITS.per_key_queue}), body
        assert r.headers["retry-after"] == "1" and 0.5 <= time.monotonic() - began < 5
        r = client.post("/v1/search", headers={**alpha, "Accept": "text/event-stream"},
                        json={"question": "harbor", "deadline_s": 0.5})
        assert_error(r, 429)  # the stream too, before it starts
        assert client.post("/v1/search", headers=auth(keys["bravo"]),
                           json={"question": "harbor"}).status_code == 200  # other keys go on
    # a deadline nothing can meet: 504 (or a partial result when the driver cuts branches)
    r = client.post("/v1/search", headers=alpha, json={"question": "harbor festival lighthouse",
                                                       "deadline_s": 0.001})
    if r.status_code == 200:
        assert r.json()["status"] == "partial"
    else:
        assert_error(r, 504, "deadline_exceeded")
    assert_error(client.get("/nope"), 404)
    assert "/v1/índice" in assert_error(client.get("/v1/índice"), 404)["detail"]
    for path in ("/v2/foo/bar", "/passwd", "/etc/token"):  # the caller's path, not "<path>"
        assert assert_error(client.get(path), 404)["detail"] == \
            f"no such path: GET {path} (see /docs)"
    assert_error(client.delete("/v1/search"), 405)
    metrics = client.get("/metrics").text
    for name in ("branchsearch_http_requests_total", "branchsearch_refusals_total",
                 "branchsearch_branches_total", "branchsearch_tokens_read_total",
                 "branchsearch_http_request_duration_seconds_bucket",
                 "branchsearch_http_requests_in_flight", "branchsearch_backend_errors_total"):
        assert name in metrics
    assert 'branchsearch_refusals_total{reason="too_many_requests"} 2.0' in metrics
    assert 'endpoint="/v1/search",method="POST",status="429"' in metrics
    # refused from its Content-Length, before its body is read: counted under its endpoint
    assert 'endpoint="/v1/search",method="POST",status="413"' in metrics
    assert 'endpoint="unmatched",method="GET",status="404"' in metrics  # /nope, /passwd, …


def test_a_burst_from_one_key_waits_for_its_slots_and_other_keys_go_on(site):
    """A burst of concurrent searches from one key (a web app behind it) past its
    `per_key_concurrency`: `per_key_queue` of them wait for its slots, first come first
    served, and are answered 200 as slots free; the rest are refused 429 at once, with
    Retry-After, saying how many wait. Another key's search is answered meanwhile: the waiting
    ones run nothing and hold none of the server's room. (Every one past the slots was
    refused 429 at once: 16 of a burst of 20 with the default limit of 4.)"""
    client, keys, state = site
    conc = state.searcher.target.concurrency
    until = time.monotonic() + 10  # a search whose client left (the tests before) holds its
    while conc.total and time.monotonic() < until:  # slot until it has stopped
        time.sleep(0.05)
    alpha, burst = auth(keys["alpha"]), LIMITS.per_key_queue + 3

    async def run():
        async with httpx.AsyncClient(base_url=str(client.base_url), timeout=60) as c:
            busy = [conc.take("alpha") for _ in range(LIMITS.per_key_concurrency)]
            try:
                sent = [asyncio.create_task(c.post("/v1/search", headers=alpha, json={
                    "question": f"harbor festival {i}"})) for i in range(burst)]
                end = time.monotonic() + 30
                while (conc.waiting("alpha") < LIMITS.per_key_queue
                       or sum(t.done() for t in sent) < burst - LIMITS.per_key_queue):
                    assert time.monotonic() < end, (conc.waiting("alpha"), sent)
                    await asyncio.sleep(0.02)
                refused = [t.result() for t in sent if t.done()]
                waiting = [t for t in sent if not t.done()]
                other = await c.post("/v1/search", headers=auth(keys["bravo"]),
                                     json={"question": "harbor festival"})
                assert conc.waiting("alpha") == LIMITS.per_key_queue  # still waiting
            finally:
                for slot in busy:
                    slot.let_go()
            return refused, other, await asyncio.gather(*waiting)

    refused, other, waited = asyncio.run(run())
    assert len(refused) == burst - LIMITS.per_key_queue
    for r in refused:
        body = assert_error(r, 429, "too_many_requests")
        assert f"{LIMITS.per_key_queue} waiting" in body["detail"]
        assert r.headers["retry-after"] == "1"
        assert (body["reason"], body["running"], body["waiting"]) == (
            "queue_full", LIMITS.per_key_concurrency, LIMITS.per_key_queue), body
    assert other.status_code == 200, other.text
    assert [r.status_code for r in waited] == [200] * LIMITS.per_key_queue, [r.text for r in
                                                                            waited]
    assert conc.total == 0 and conc.waiting("alpha") == 0


def test_backend_down_readyz_and_search_503(tmp_path_factory):
    """Lexical store on Elasticsearch (the emulator) at a URL with credentials; stop it:
    /readyz and search answer 503, search with the reason; no answer holds the password or the
    backend's address (they reached every caller before). A server whose default index is
    elsewhere stays ready and counts the es index not ready."""
    from es_emulator import start_es_emulator

    home = tmp_path_factory.mktemp("svc-es")
    es = start_es_emulator(home / "es")
    try:
        url = es.url.replace("://", "://elastic:hunter2@")
        settings = load_settings(overrides={"home": home, "index": "es", "es_url": url,
                                            "branches": 1}, read_env=False, read_file=False)
        ingest(write_corpus(home / "c.jsonl", CORPUS[:3]), settings)
        state = service.local_state(settings, executor="local", limits=LIMITS)  # dev mode
        state.searcher.target.drivers.open("es")
        server = start_uvicorn(service.create_app(state), state)
        client = httpx.Client(base_url=server.url, timeout=120)
        try:
            q = {"question": "Harbor Festival in June"}
            r = client.post("/v1/search", json=q)
            assert r.status_code == 200 and r.json()["evidence"]
            assert client.get("/readyz").status_code == 200
            # served without the es_url its index needs: the operator's mistake, not the
            # caller's (a 503, not a 400)
            bare = service.local_state(settings.replace(es_url=""), executor="local",
                                       limits=LIMITS)
            bare_server = start_uvicorn(service.create_app(bare), bare)
            try:
                with httpx.Client(base_url=bare_server.url, timeout=120) as other:
                    assert_error(other.post("/v1/search", json=q), 503, "index_misconfigured")
            finally:
                bare_server.stop()
                bare.searcher.target.close()
            # frozen (a node that stops answering, not one that is gone): each probe shares
            # one check and is answered 503 within its few seconds' wait, not after the whole
            # backend timeout (30 s)
            os.killpg(es.pid, signal.SIGSTOP)
            try:
                probes = []
                for _ in range(3):
                    began = time.monotonic()
                    frozen = assert_error(client.get("/readyz"), 503, "not_ready")
                    probes.append(time.monotonic() - began)
                assert "has not ended within 5 s" in frozen["detail"]
                assert max(probes) < 20, probes  # well under backend_timeout_s (30 s)
                # a search asks for 3 s: its answer (a 504, or what the dense side found)
                # comes within a few seconds of that, whatever the frozen backend does
                began = time.monotonic()
                late = client.post("/v1/search", json={**q, "deadline_s": 3})
                assert late.status_code in (200, 503, 504), late.text
                assert time.monotonic() - began < 3 + 4, (time.monotonic() - began, late.text)
            finally:
                os.killpg(es.pid, signal.SIGCONT)
            # thawed: the check that waited on it ends, and a probe after it is ready again
            deadline = time.monotonic() + 90
            while client.get("/readyz").status_code != 200:
                assert time.monotonic() < deadline, "not ready again after the backend thawed"
                time.sleep(0.5)
            # a second server whose default index keeps its BM25 side in tantivy, serving
            # the es index beside it
            ingest(write_corpus(home / "l.jsonl", CORPUS[:3]),
                   settings.replace(index="local", es_url=""))
            mixed = service.local_state(settings.replace(index="local"), executor="local",
                                        limits=LIMITS)
            for name in ("local", "es"):
                mixed.searcher.target.drivers.open(name)
            mixed_server = start_uvicorn(service.create_app(mixed), mixed)
            both = httpx.Client(base_url=mixed_server.url, timeout=120)
            es_down = [{"index": "es", "error": "backend_unavailable"}]  # (dev mode: named)
            assert both.get("/readyz").json() == {"status": "ready", "indexes": 2,
                                                  "indexes_not_ready": 0, "not_ready": []}
            # frozen, the es index is counted once its answer of before (kept 2 s) is out of
            # date, then probe after probe, each answered within a second, and the server
            # stays ready
            os.killpg(es.pid, signal.SIGSTOP)
            try:
                counted = time.monotonic() + 10
                while not both.get("/readyz").json()["indexes_not_ready"]:
                    assert time.monotonic() < counted, "the frozen es index is not counted"
                    time.sleep(0.2)
                for _ in range(3):
                    began = time.monotonic()
                    assert both.get("/readyz").json() == {"status": "ready", "indexes": 2,
                                                          "indexes_not_ready": 1,
                                                          "not_ready": es_down}
                    assert time.monotonic() - began < 1
            finally:
                os.killpg(es.pid, signal.SIGCONT)
            deadline = time.monotonic() + 90
            while both.get("/readyz").json()["indexes_not_ready"]:
                assert time.monotonic() < deadline, "the es index not ready after the thaw"
                time.sleep(0.5)
            es.stop()
            ready = assert_error(client.get("/readyz"), 503, "not_ready")
            assert ready["detail"] == "the default index is not ready (the server log says why)"
            # the es index's backend is down, not the default's: still ready (a balancer
            # pulling every replica for one index would take the others down), the es index
            # counted, its searches 503 and the default index's served
            try:
                counted = time.monotonic() + 10
                while not both.get("/readyz").json()["indexes_not_ready"]:  # (see above)
                    assert time.monotonic() < counted, "the stopped es index is not counted"
                    time.sleep(0.2)
                assert both.get("/readyz").json() == {"status": "ready", "indexes": 2,
                                                      "indexes_not_ready": 1,
                                                      "not_ready": es_down}
                assert both.post("/v1/search", json=q).status_code == 200
                gone = assert_error(both.post("/v1/search", json={**q, "index": "es"}), 503)
                assert gone["error"] in ("backend_unavailable", "search_failed"), gone
            finally:
                both.close()
                mixed_server.stop()
                mixed.searcher.target.close()
            down = assert_error(client.post("/v1/search", json=q), 503)
            assert down["error"] in ("backend_unavailable", "search_failed"), down
            stream = client.post("/v1/search", json=q, headers={"Accept": "text/event-stream"})
            host = es.url.split("//")[1]
            for answer in (ready, down, stream.text):
                assert "hunter2" not in str(answer) and host not in str(answer), answer
            if stream.status_code == 200:  # events came first: the stream ends with the error
                last = parse_sse(stream.text)[-1]
                assert last["type"] == "error" and last["status"] == 503
            else:
                assert_error(stream, 503)
            assert client.get("/healthz").status_code == 200  # up, not ready
            errors = re.search(r"^branchsearch_backend_errors_total (\S+)$",
                               client.get("/metrics").text, re.M)
            assert errors and float(errors.group(1)) >= 3  # (+ the frozen check's, if counted)
            put = assert_error(client.put("/v1/indexes/es/documents", json=[
                {"id": "late", "text": "Written while the lexical store is down."}]), 503)
            assert put["error"] in ("backend_unavailable", "write_failed"), put
            assert "hunter2" not in str(put) and host not in str(put), put
        finally:
            client.close()
            server.stop()
            state.searcher.target.close()
    finally:
        es.stop()


def test_a_document_write_to_a_frozen_backend_is_answered_within_the_deadline(tmp_path):
    """A PUT whose Elasticsearch stops answering (SIGSTOP) is a 504 within the service's
    deadline and the join grace, saying it may still land and that repeating it is safe; a
    DELETE queued behind it never begins (504, nothing written). Both waited out the backend's
    timeout whatever the deadline (30.6 s each for a 4 s deadline). Thawed, the PUT lands
    whole, and repeating it changes nothing."""
    from concurrent.futures import ThreadPoolExecutor
    from dataclasses import replace

    from es_emulator import start_es_emulator

    def memo(version: str) -> list[dict]:  # several chunks, each naming its version
        return [{"id": "memo", "title": "Heliotrope memo", "text": " ".join(
            f"Heliotrope paragraph {n} of version {version} ships in March." * 12
            for n in range(6))}]

    def memo_chunks() -> list[str]:
        r = client.post("/v1/search", json={"question": "heliotrope memo ships", "branches": 1})
        assert r.status_code == 200, r.text
        return [c["text"] for d in r.json()["evidence"] if d["doc_id"] == "memo"
                for c in d["chunks"]]

    with start_es_emulator(tmp_path / "es") as es:
        settings = load_settings(overrides={"home": tmp_path / "home", "index": "es",
                                            "es_url": es.url, "search_mode": "bm25",
                                            "branches": 1}, read_env=False, read_file=False)
        ingest(write_corpus(tmp_path / "c.jsonl", CORPUS[:3]), settings)
        deadline = 4
        state = service.local_state(settings, executor="local",  # dev mode
                                    limits=replace(LIMITS, default_deadline_s=deadline))
        state.searcher.target.drivers.open("es")
        server = start_uvicorn(service.create_app(state), state)
        client = httpx.Client(base_url=server.url, timeout=120)
        try:
            first = client.put("/v1/indexes/es/documents", json=memo("one")).json()
            texts = memo_chunks()
            assert first["chunks"] > 1 and texts and all("version one" in t for t in texts)
            os.killpg(es.pid, signal.SIGSTOP)
            try:
                with ThreadPoolExecutor(2) as pool:
                    began = time.monotonic()
                    put = pool.submit(client.put, "/v1/indexes/es/documents", json=memo("two"))
                    time.sleep(0.5)
                    delete = pool.submit(client.delete, "/v1/indexes/es/documents/pub-harbor")
                    late = assert_error(put.result(), 504, "deadline_exceeded")
                    waited = time.monotonic() - began
                    queued = assert_error(delete.result(), 504, "deadline_exceeded")
                assert waited < deadline + 2 + 1.5, (waited, late)
                assert "lands whole or not at all" in late["detail"], late
                assert "nothing was written" in queued["detail"], queued
                assert es.url.split("//")[1] not in str((late, queued))
            finally:
                os.killpg(es.pid, signal.SIGCONT)
            # thawed within the backend's timeout: the PUT under way lands, whole
            end = time.monotonic() + 60
            while True:
                texts = memo_chunks()
                if texts and all("version two" in t for t in texts):
                    break
                assert all("version one" in t for t in texts), texts  # never a mix
                assert time.monotonic() < end, "the late write never landed"
                time.sleep(0.5)
            again = client.put("/v1/indexes/es/documents", json=memo("two"))
            assert again.status_code == 200 and again.json() == {**first, "upserted": ["memo"]}
            assert memo_chunks() == texts
            # the DELETE that never began deleted nothing
            assert client.delete("/v1/indexes/es/documents/pub-harbor").status_code == 200
        finally:
            client.close()
            server.stop()
            state.searcher.target.close()


@pytest.mark.parametrize("executor", ["local", "ray"])
def test_standalone_serve_stops_at_once_though_a_probe_waits_on_a_frozen_backend(tmp_path,
                                                                                 executor):
    """`serve --standalone` over an index on Elasticsearch, the backend frozen (SIGSTOP): a
    /readyz answered 503 within its 5 s, no request in flight, then SIGTERM. The probe's
    thread, still waiting on the backend, held the exit: 24.5 s (local) and 26.4 s (ray) to
    exit 0. Now it exits 0 within a few seconds, leaving no child process."""
    import psutil
    from es_emulator import start_es_emulator

    home = tmp_path / "home"
    home.mkdir()
    with start_es_emulator(tmp_path / "es") as es:
        (home / "branchsearch.toml").write_text(f'es_url = "{es.url}"\nsearch_mode = "bm25"\n')
        settings = load_settings(overrides={"home": home, "index": "es", "es_url": es.url},
                                 read_env=False, read_file=False)
        ingest(write_corpus(tmp_path / "c.jsonl", CORPUS[:3]), settings, dense=False)
        proc = subprocess.Popen(
            [sys.executable, "-m", "branchsearch.orchestrator.cli", "serve", "--standalone",
             "--host", "127.0.0.1", "--port", "0", "--home", str(home), "--index", "es",
             "--executor", executor], stderr=subprocess.PIPE, text=True,
            env={**os.environ, "BRANCHSEARCH_TRACE_EXPORTER": "none"})
        try:
            url = _served_url(proc)
            assert httpx.get(url + "/readyz", timeout=60).status_code == 200
            children = psutil.Process(proc.pid).children(recursive=True)
            os.killpg(es.pid, signal.SIGSTOP)
            try:
                assert_error(httpx.get(url + "/readyz", timeout=60), 503, "not_ready")
                began = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(timeout=60) == 0
                assert time.monotonic() - began < 8, time.monotonic() - began
            finally:
                os.killpg(es.pid, signal.SIGCONT)
            _, alive = psutil.wait_procs(children, timeout=10)
            assert not alive, [p.pid for p in alive]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)


@pytest.mark.parametrize("when", ["starting", "serving"])
def test_standalone_serve_sent_sigterm_as_it_starts_stops_cleanly(tmp_path, when):
    """SIGTERM to `serve --standalone` while it opens its default index (the models load), or
    the moment it says `serving on` (before uvicorn's own signal handling is in place): the
    same clean stop as later — exit 0, the index's stores closed, no child process (the Milvus
    Lite server) left, the port free, the index openable by another process. Before, the
    process died of the signal (exit -15), its searcher never closed."""
    import socket

    import psutil

    from branchsearch.infra.stores.milvus_lite import held_elsewhere

    home = tmp_path / "home"
    settings = load_settings(overrides={"home": home, "index": "acl"}, read_env=False,
                             read_file=False)
    ingest(write_corpus(tmp_path / "corpus.jsonl"), settings)  # hybrid: a Milvus Lite file
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "branchsearch.orchestrator.cli", "serve", "--standalone",
         "--host", "127.0.0.1", "--port", str(port), "--home", str(home), "--index", "acl",
         "--executor", "local"], stderr=subprocess.PIPE, text=True,
        env={**os.environ, "BRANCHSEARCH_TRACE_EXPORTER": "none"})
    try:
        children: list = []
        if when == "serving":
            _served_url(proc)
        else:  # its first line (the development-mode banner) comes as it begins to start
            assert proc.stderr.readline().startswith("development mode"), "no banner"
            deadline = time.monotonic() + 120  # its Milvus Lite server started: mid-start
            while not children and time.monotonic() < deadline:
                children = psutil.Process(proc.pid).children(recursive=True)
                time.sleep(0.02)
        children = children or psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, proc.stderr.read()
        err = proc.stderr.read()
        assert "Traceback" not in err, err
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, [p.pid for p in alive]
        with socket.socket() as again:  # the port is free
            again.bind(("127.0.0.1", port))
        assert not held_elsewhere(settings.index_dir / "dense.db")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def _served_url(proc: subprocess.Popen) -> str:
    """The address a `serve --standalone` process says it serves on (within 180 s)."""
    line, deadline = "", time.monotonic() + 180
    while "serving on" not in line and time.monotonic() < deadline:
        line = proc.stderr.readline()
        assert line or proc.poll() is None, "serve exited before listening"
    return re.search(r"serving on (http://127\.0\.0\.1:\d+)", line).group(1)


def test_standalone_serve_says_where_it_listens_and_a_taken_port_is_one_line(tmp_path):
    """`branchsearch serve --standalone` (its own process, a real socket): one line naming the
    address it serves, /healthz answers there; a port already taken is one error line, exit 2."""
    home = tmp_path / "home"
    settings = load_settings(overrides={"home": home, "index": "acl"}, read_env=False,
                             read_file=False)
    ingest(write_corpus(tmp_path / "corpus.jsonl"), settings)
    (home / "branchsearch.toml").write_text("[service]\nmax_question_chars = 40\n")  # a limit
    cmd = [sys.executable, "-m", "branchsearch.orchestrator.cli", "serve", "--standalone",
           "--host", "127.0.0.1", "--port", "0", "--home", str(home), "--index", "acl",
           "--executor", "local"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "BRANCHSEARCH_TRACE_EXPORTER": "none"})
    try:
        port = int(_served_url(proc).rsplit(":", 1)[1])
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=30).status_code == 200
        long = httpx.post(f"http://127.0.0.1:{port}/v1/search", timeout=60,
                          json={"question": "Harbor Festival in June, and who ran it that year?"})
        assert long.status_code == 422 and "40" in long.json()["detail"], long.text  # the file's
        taken = subprocess.run([str(port) if a == "0" else a for a in cmd],
                               capture_output=True, text=True, timeout=120)
        assert taken.returncode == 2, taken.stderr
        errors = [ln for ln in taken.stderr.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0], taken.stderr
        # the service's own log, with its times: why /readyz says 503, an index retired
        moved = home / "moved-away"
        settings.index_dir.rename(moved)
        try:
            assert httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=60).status_code == 503
        finally:
            moved.rename(settings.index_dir)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    logged = proc.stderr.read()
    assert re.search(r"\d\d:\d\d:\d\d,\d+ INFO index 'acl' changed on disk", logged), logged
    assert re.search(r"WARNING not ready: index 'acl': .*not found", logged), logged
    # no --index, and no index named 'default' in this home: its only index is served (said
    # first), the default; with two there, both, and no default
    bare = [a for a in cmd if a not in ("--index", "acl")]
    proc = subprocess.Popen(bare, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "BRANCHSEARCH_TRACE_EXPORTER": "none"})
    try:
        said, deadline = [], time.monotonic() + 180
        while not (said and "serving on" in said[-1]) and time.monotonic() < deadline:
            said.append(proc.stderr.readline())
            assert said[-1] or proc.poll() is None, "serve exited before listening: " + \
                "".join(said)
        assert any("index 'acl' (the only one in" in line for line in said), said
        port = int(re.search(r"serving on http://127\.0\.0\.1:(\d+)", said[-1]).group(1))
        r = httpx.post(f"http://127.0.0.1:{port}/v1/search", timeout=120,
                       json={"question": "Harbor Festival in June", "branches": 1})
        assert r.status_code == 200 and r.json()["evidence"], r.text  # the default: 'acl'
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    ingest(write_corpus(tmp_path / "corpus.jsonl"), settings.replace(index="zweiter"))
    proc = subprocess.Popen(bare, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "BRANCHSEARCH_TRACE_EXPORTER": "none"})
    try:
        served = _served_url(proc)
        assert_several_served_without_a_default(served, ["acl", "zweiter"])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    said = proc.stderr.read()
    assert proc.returncode == 0 and "Traceback" not in said, said


def assert_several_served_without_a_default(url: str, names: list[str]) -> None:
    """A `serve` without --index in a home of several indexes (`names`) serves every one and
    has no default index: a search that names none is a 422 in JSON saying so (not a search of
    some index, nor a start refused), one that names an index is answered, and /readyz is
    ready, counting them all. (A development server: no keys.)"""
    question = {"question": "Harbor Festival in June", "branches": 1}
    with httpx.Client(base_url=url, timeout=120) as client:
        for accept in ("application/json", "text/event-stream"):
            r = client.post("/v1/search", json=question, headers={"Accept": accept})
            assert r.status_code == 422, r.text
            assert r.json()["error"] == "bad_request", r.text
            assert "no default index" in r.json()["detail"], r.text
        for name in names:
            r = client.post("/v1/search", json={**question, "index": name})
            assert r.status_code == 200 and r.json()["index"] == name, r.text
            assert r.json()["evidence"], r.text
        ready = client.get("/readyz")
        assert ready.status_code == 200, ready.text
        assert ready.json()["indexes"] == len(names) and not ready.json()["not_ready"], \
            ready.text
        assert client.get("/v1/indexes").json()["indexes"] == names



@pytest.mark.ray
def test_ray_serve_without_index_serves_every_index_of_the_home(tmp_path):
    """`serve` (Ray Serve) in a home of two indexes, no --index: it stopped with 'which
    index?' while its --help called --index the *default* index. It serves both, with no
    default, as `serve --standalone` does."""
    from service_fixtures import free_port

    home = tmp_path / "home"
    for name in ("acl", "zweiter"):
        ingest(write_corpus(tmp_path / "corpus.jsonl"),
               load_settings(overrides={"home": home, "index": name}, read_env=False,
                             read_file=False), dense=False)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "branchsearch.orchestrator.cli", "serve",
                             "--host", "127.0.0.1", "--port", str(port), "--home", str(home),
                             "--executor", "local"], stderr=subprocess.PIPE, text=True,
                            env={k: v for k, v in os.environ.items()
                                 if not k.startswith(("BRANCHSEARCH_", "RAY_"))},
                            start_new_session=True)
    try:
        said, deadline = [], time.monotonic() + 300
        while not (said and "serving on" in said[-1]) and time.monotonic() < deadline:
            said.append(proc.stderr.readline())
            assert said[-1] or proc.poll() is None, "serve exited: " + "".join(said)
        assert any("no default index" in line and "'acl', 'zweiter'" in line
                   for line in said), said
        assert_several_served_without_a_default(f"http://127.0.0.1:{port}", ["acl", "zweiter"])
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    assert proc.returncode == 0, proc.stderr.read()


@pytest.mark.ray
def test_standalone_serve_says_where_its_branches_run(hotpot_settings, tmp_path):
    """`serve --standalone` said "one process" for every executor; with `--executor ray` its
    branches run on Ray actors (a local cluster it starts, here). The line says which."""

    home = tmp_path / "home"
    copy_store(hotpot_settings.index_dir, home / "indexes" / "hotpot")
    for executor, said, unsaid in (("ray", "its branches on Ray actors (a local cluster "
                                    "started here)", "one process"),
                                   ("local", "one process: the service and its branches",
                                    "Ray")):
        proc = subprocess.Popen(
            [sys.executable, "-m", "branchsearch.orchestrator.cli", "serve", "--standalone",
             "--host", "127.0.0.1", "--port", "0", "--home", str(home), "--index", "hotpot",
             "--executor", executor], stderr=subprocess.PIPE, text=True,
            env={**os.environ, "BRANCHSEARCH_TRACE_EXPORTER": "none", "RAY_ADDRESS": ""})
        try:
            line, deadline = "", time.monotonic() + 300
            while "serving on" not in line and time.monotonic() < deadline:
                line = proc.stderr.readline()
                assert line or proc.poll() is None, "serve exited before listening"
            assert said in line and unsaid not in line, (executor, line)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)

def test_a_failed_search_asks_its_backends_only_until_its_deadline(tmp_path_factory):
    """A search whose branches failed on a backend asks the backends whether they are down
    before it answers. Elasticsearch frozen (SIGSTOP: it takes connections and never answers,
    as a server still starting does): each branch fails at its `backend_timeout_s`, and the
    check then waited that timeout again, past the caller's deadline (a burst of 20 callers
    during a Milvus restart got their 503s 31-42 s after asking with a 20 s deadline). The
    check ends with the deadline, and the searches failing at once share it."""
    from es_emulator import start_es_emulator

    home = tmp_path_factory.mktemp("svc-es-frozen")
    es = start_es_emulator(home / "es")
    try:
        settings = load_settings(overrides={
            "home": home, "index": "es", "es_url": es.url.replace("://", "://elastic:hunter2@"),
            "branches": 1, "backend_timeout_s": 8, "backend_retries": 0},
            read_env=False, read_file=False)
        ingest(write_corpus(home / "c.jsonl", CORPUS[:3]), settings)
        state = service.local_state(settings, executor="local", limits=Limits(
            per_key_concurrency=8, max_in_flight=8))
        state.searcher.target.drivers.open("es")
        server = start_uvicorn(service.create_app(state), state)
        try:
            deadline = 12

            async def ask(client, sse: bool):
                began = time.monotonic()
                r = await client.post("/v1/search", json={
                    "question": "Harbor Festival in June", "deadline_s": deadline},
                    headers={"Accept": "text/event-stream"} if sse else {})
                return r, time.monotonic() - began

            async def burst():
                async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                    return await asyncio.gather(*[ask(client, i % 2 == 1) for i in range(4)])

            os.killpg(es.pid, signal.SIGSTOP)
            try:
                answers = asyncio.run(burst())
            finally:
                os.killpg(es.pid, signal.SIGCONT)
            for r, took in answers:
                if r.headers["content-type"].startswith("text/event-stream"):
                    last = parse_sse(r.text)[-1]
                    assert last["type"] == "error" and last["status"] == 503, r.text
                    body = {"error": last["error"], "detail": last["detail"]}
                else:
                    body = assert_error(r, 503)
                assert body["error"] == "backend_unavailable", body  # the branches failed
                assert took < deadline + 2, (took, body)  # (the old check: 8 s more, ~16 s)
                assert "hunter2" not in r.text and str(es.port) not in r.text, r.text
        finally:
            server.stop()
            state.searcher.target.close()
    finally:
        es.stop()


def test_a_request_running_past_the_shutdown_grace_gets_a_json_503(tmp_path, caplog):
    """A search still running when a stopping server's grace for requests in flight runs out:
    its caller gets a JSON 503 `shutting_down` with Retry-After, as a request arriving at a
    stopping service does — not uvicorn's plain-text 500, and no "Exception in ASGI
    application" traceback in the log."""
    import logging
    import threading

    from branchsearch.orchestrator.driver import open_driver

    settings = load_settings(overrides={"home": tmp_path, "index": "acl", "search_mode": "bm25"},
                             read_env=False, read_file=False)
    ingest(write_corpus(tmp_path / "corpus.jsonl"), settings)
    entered, release = threading.Event(), threading.Event()

    class Held:
        """The real driver, its searches held until released (a backend that hangs)."""

        def __init__(self, driver):
            self.driver = driver

        def __getattr__(self, name):
            return getattr(self.driver, name)

        def search(self, *args, **kwargs):
            entered.set()
            release.wait(60)
            return self.driver.search(*args, **kwargs)

    state = service.local_state(settings, executor="local", limits=LIMITS,
                                driver_factory=lambda s, executor: Held(open_driver(s, executor)))
    server = start_uvicorn(service.create_app(state), state, grace_s=1)
    answer: dict = {}
    caller = threading.Thread(target=lambda: answer.update(r=httpx.post(
        f"{server.url}/v1/search", json={"question": "harbor lighthouse"}, timeout=60)))
    try:
        with caplog.at_level(logging.ERROR, logger="uvicorn.error"):
            caller.start()
            assert entered.wait(60)
            server.stop()  # as SIGTERM: stop taking connections, wait 1 s, cancel the rest
            caller.join(60)
        assert_error(answer["r"], 503, "shutting_down")
        assert answer["r"].headers["retry-after"] == "5"
        assert not [r for r in caplog.records if "Exception in ASGI" in r.getMessage()]
    finally:
        release.set()
        state.searcher.target.close()


def test_readyz_answers_within_a_probe_timeout_with_many_indexes_and_one_hung_backend(
        tmp_path):
    """/readyz of a service with many indexes, one of them on an Elasticsearch that takes
    connections and never answers, answers each probe well within a balancer's timeout
    (Kubernetes: 1 s): the other indexes' probes run on a few threads, their answers are kept
    a short while, and a check waits for them half a second at most (it took the hung
    backend's 3 s, every probe). The hung index is counted not ready, the server is ready."""
    import socket

    from es_emulator import start_es_emulator

    hung = socket.socket()  # the kernel takes its connections; no one reads them
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)
    settings = load_settings(overrides={"home": tmp_path / "home", "index": "i00",
                                        "branches": 1}, read_env=False, read_file=False)
    corpus = write_corpus(tmp_path / "c.jsonl", CORPUS[:2])
    for i in range(16):
        ingest(corpus, settings.replace(index=f"i{i:02d}"), dense=False)
    with start_es_emulator(tmp_path / "es") as es:
        ingest(corpus, settings.replace(index="es", es_url=es.url), dense=False)
    settings = settings.replace(es_url=f"http://127.0.0.1:{hung.getsockname()[1]}")
    state = service.local_state(settings, executor="local", limits=LIMITS)
    server = start_uvicorn(service.create_app(state), state)
    try:
        client = httpx.Client(base_url=server.url, timeout=60)
        assert client.get("/readyz").status_code == 200  # (the default index opens)
        took = []
        for _ in range(6):
            began = time.monotonic()
            ready = client.get("/readyz")
            took.append(time.monotonic() - began)
            assert ready.json() == {"status": "ready", "indexes": 17, "indexes_not_ready": 1,
                                    "not_ready": [{"index": "es",
                                                   "error": "backend_unavailable"}]}
            time.sleep(0.7)
        assert max(took) < 0.9, took
        client.close()
    finally:
        server.stop()
        state.searcher.target.close()
        hung.close()


def _counted_port(upstream: tuple[str, int] | None = None):
    """A loopback port that counts the connections made to it (how often a server backend is
    asked) and forwards each to `upstream` (None: closes it once taken, as a TCP probe needs
    no more; an upstream that refuses: closed too). Returns (the listening socket, the
    count: a one-item list)."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    count = [0]

    def pipe(src, dst):
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed: the test is over
                return
            count[0] += 1
            try:
                up = socket.create_connection(upstream) if upstream else None
            except OSError:
                up = None
            if up is None:
                conn.close()
                continue
            for ends in ((conn, up), (up, conn)):
                threading.Thread(target=pipe, args=ends, daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return listener, count


def test_indexes_on_the_same_servers_cost_one_probe_of_each_server_per_readiness_check(
        tmp_path, monkeypatch):
    """An operator declares many indexes on one Elasticsearch cluster and one Milvus server.
    Every readiness check (every 2 s on each searcher replica under Ray Serve, and every
    /readyz standalone) asked each index not open whether its servers answer: one
    Elasticsearch client and request, one Milvus connection, an index (12 of each here, for
    12 indexes on each). Each server is now asked once a check for all the indexes on it, and
    its answer is still each index's: with the Elasticsearch down, its 12 indexes are not
    ready and the Milvus ones are. And each probe made its index's settings anew, which
    parses every declared index again (quadratic: 300 external indexes took 46 CPU-seconds a
    minute); each index's are now made once."""
    from es_emulator import start_es_emulator

    from branchsearch.infra.config.settings import Settings
    from branchsearch.orchestrator.service.searcher import PROBE_FRESH_S

    made, replace = [], Settings.replace
    monkeypatch.setattr(Settings, "replace", lambda self, **changes: (
        made.append(changes.get("index")), replace(self, **changes))[1])

    es = start_es_emulator(tmp_path / "es")
    es_port, es_asked = _counted_port(("127.0.0.1", es.port))
    mv_port, mv_asked = _counted_port()
    state = None
    try:
        config = tmp_path / "branchsearch.toml"
        config.write_text("".join(
            f'[indexes.es{i:02d}]\nlexical = "elasticsearch"\nes_index = "corp{i}"\n'
            f'es_url = "http://127.0.0.1:{es_port.getsockname()[1]}"\n'
            f'[indexes.mv{i:02d}]\ndense = "milvus"\nmilvus_collection = "c{i}"\n'
            f'milvus_uri = "http://127.0.0.1:{mv_port.getsockname()[1]}"\n' for i in range(12)))
        settings = load_settings(config, {"home": tmp_path / "home", "index": "local",
                                          "branches": 1}, read_env=False)
        ingest(write_corpus(tmp_path / "c.jsonl", CORPUS[:2]), settings, dense=False)
        state = service.local_state(settings, executor="local", limits=LIMITS)
        searcher = state.searcher.target
        deadline = time.monotonic() + 60
        while searcher._ready_now()["indexes_not_ready"]:  # (the first probes may not end
            assert time.monotonic() < deadline  # within the check's wait on a busy machine)
            time.sleep(0.5)
        asked, made_before = [], len(made)
        for stop_es in (False, False, True):
            if stop_es:
                es.stop()
            time.sleep(PROBE_FRESH_S + 0.5)  # every index's answer is out of date: asked anew
            before = es_asked[0], mv_asked[0]
            ready = searcher._ready_now()
            time.sleep(1)  # (the probes a check waits for at most 0.5 s have ended)
            asked.append((es_asked[0] - before[0], mv_asked[0] - before[1]))
        assert ready == {"status": "ready", "indexes": 25, "indexes_not_ready": 12,
                         "not_ready": [{"index": f"es{i:02d}", "error": "backend_unavailable"}
                                       for i in range(12)]}, ready
        # once a server a check (12 before: once an index); twice at most on a starved CPU,
        # whose probes of one check spread over more than the half second an answer is kept
        assert all(1 <= n <= 2 for n in sum(asked, ())), asked
        assert made[made_before:] == [], made[made_before:]  # (24 a check before)
    finally:
        if state is not None:
            state.searcher.target.close()
        es.stop()
        es_port.close()
        mv_port.close()


def test_an_index_whose_backend_is_down_is_counted_not_ready_before_any_request(tmp_path,
                                                                                  caplog):
    """An index whose Elasticsearch is down is counted not ready by /readyz at once, before
    any request asked for it (the server stays ready: only the default index decides that),
    and named, with why, to a caller who may use it (here a development server: everyone);
    once a request failed to open it, until its backend answers again (asked without opening
    it: no search need come first). No answer names its backend's
    address or password; the server log says which index, and why."""
    import logging

    from es_emulator import start_es_emulator

    es = start_es_emulator(tmp_path / "es")
    state = server = None
    try:
        url = es.url.replace("://", "://elastic:hunter2@")
        settings = load_settings(overrides={"home": tmp_path / "home", "index": "local",
                                            "es_url": url, "branches": 1},
                                 read_env=False, read_file=False)
        ingest(write_corpus(tmp_path / "c.jsonl", CORPUS[:3]), settings.replace(index="es"),
               dense=False)
        ingest(write_corpus(tmp_path / "c.jsonl", CORPUS[:3]),
               settings.replace(es_url=""), dense=False)  # the default: BM25 in tantivy
        es.stop()
        state = service.local_state(settings, executor="local", limits=LIMITS)  # dev mode
        server = start_uvicorn(service.create_app(state), state)
        client = httpx.Client(base_url=server.url, timeout=120)
        q = {"question": "Harbor Festival in June", "index": "es"}
        unasked = client.get("/readyz")
        assert unasked.json() == {"status": "ready", "indexes": 2, "indexes_not_ready": 1,
                                  "not_ready": [{"index": "es",
                                                 "error": "backend_unavailable"}]}
        # with API keys, an index's name is for keys that may use it (as GET /v1/indexes):
        # no key, the counts only
        store = KeyStore(tmp_path / "keys.json")
        everywhere = store.add("ops", ("g",))
        local_only = store.add("local", ("g",), indexes=("local",))
        keyed_state = service.local_state(settings, executor="local", limits=LIMITS,
                                          keys_path=tmp_path / "keys.json")
        keyed_server = start_uvicorn(service.create_app(keyed_state), keyed_state)
        try:
            keyed = httpx.Client(base_url=keyed_server.url, timeout=120)
            assert keyed.get("/readyz").json() == {"status": "ready", "indexes": 2,
                                                   "indexes_not_ready": 1}
            named = keyed.get("/readyz", headers={"Authorization": f"Bearer {everywhere}"})
            assert named.json()["not_ready"] == [{"index": "es", "error": "backend_unavailable"}]
            mine = keyed.get("/readyz", headers={"Authorization": f"Bearer {local_only}"})
            assert mine.json() == {"status": "ready", "indexes": 2, "indexes_not_ready": 1,
                                   "not_ready": []}
            bad = keyed.get("/readyz", headers={"Authorization": "Bearer bsk_nonsense"})
            assert bad.status_code == 200 and "not_ready" not in bad.json(), bad.text
            keyed.close()
        finally:
            keyed_server.stop()
            keyed_state.searcher.target.close()
        with caplog.at_level(logging.WARNING, logger="branchsearch.service"):
            down = assert_error(client.post("/v1/search", json=q), 503, "backend_unavailable")
            ready = client.get("/readyz")
        assert ready.json() == {"status": "ready", "indexes": 2, "indexes_not_ready": 1,
                                "not_ready": [{"index": "es", "error": "backend_unavailable"}]}
        host = es.url.split("//")[1]
        for answer in (str(down), unasked.text, ready.text):
            assert "hunter2" not in answer and host not in answer, answer
        assert re.search(r"index 'es' not ready \(the server still is\): BackendUnavailable: "
                         r"elasticsearch at", caplog.text)
        es = start_es_emulator(tmp_path / "es", port=es.port)  # back, with its documents
        # seen back by /readyz with no search sent (within its answers' 2 s): a balancer puts
        # the replica back
        back = time.monotonic() + 10
        while client.get("/readyz").json()["indexes_not_ready"]:
            assert time.monotonic() < back, "the index is back; /readyz does not say so"
            time.sleep(0.2)
        assert client.get("/readyz").json() == {"status": "ready", "indexes": 2,
                                                "indexes_not_ready": 0, "not_ready": []}
        r = client.post("/v1/search", json=q)
        assert r.status_code == 200 and r.json()["evidence"], r.text
        assert client.get("/readyz").json() == {"status": "ready", "indexes": 2,
                                                "indexes_not_ready": 0, "not_ready": []}
        client.close()
    finally:
        if server is not None:
            server.stop()
            state.searcher.target.close()
        es.stop()


def test_a_service_whose_indexes_are_closed_answers_503_shutting_down(tmp_path):
    """Once the searcher's indexes are closed (the server is stopping), a request that still
    reaches it starts no index (its driver would never be closed): a JSON 503
    `shutting_down`, with Retry-After."""
    settings = load_settings(overrides={"home": tmp_path, "index": "acl"}, read_env=False,
                             read_file=False)
    ingest(write_corpus(tmp_path / "corpus.jsonl"), settings, dense=False)
    state = service.local_state(settings, executor="local", limits=LIMITS)  # dev mode
    server = start_uvicorn(service.create_app(state), state)
    try:
        state.searcher.target.drivers.close()
        r = httpx.post(f"{server.url}/v1/search", json={"question": "harbor"}, timeout=60)
        assert assert_error(r, 503, "shutting_down")["detail"].startswith(
            "the service is stopping")
        assert r.headers["retry-after"] == "5"
    finally:
        server.stop()
        state.searcher.target.close()


def test_a_request_uvicorn_cannot_parse_is_answered_with_the_json_error_body(tmp_path):
    """A raw non-ASCII byte in the request target (a client that does not percent-encode `é`)
    or a malformed header never reaches the app: uvicorn's parser refuses it. The answer is
    still the service's JSON error body, a 400 `bad_request` saying how to send it, not
    uvicorn's plain text; the same target percent-encoded reaches the app."""
    import socket

    settings = load_settings(overrides={"home": tmp_path}, read_env=False, read_file=False)
    state = service.local_state(settings, executor="local", limits=LIMITS)  # dev mode
    server = start_uvicorn(service.create_app(state), state)
    host, port = server.url.removeprefix("http://").split(":")

    def raw(request: bytes) -> tuple[bytes, dict]:
        with socket.create_connection((host, int(port)), timeout=10) as client:
            client.sendall(request)
            answer = b""
            while chunk := client.recv(65536):
                answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        return head, json.loads(body)

    try:
        for request in (b"GET /v1/indexes?q=\xc3\xa9 HTTP/1.1\r\nHost: x\r\n\r\n",
                        b"GET /v1/ind\xc3\xa9xes HTTP/1.1\r\nHost: x\r\n\r\n",
                        b"GET /v1/indexes HTTP/1.1\r\nHost: x\r\nno colon\r\n\r\n"):
            head, body = raw(request)
            assert head.startswith(b"HTTP/1.1 400 "), head
            assert b"content-type: application/json" in head.lower(), head
            assert body["error"] == "bad_request", body
            assert "percent-encode" in body["detail"], body
        r = httpx.get(f"{server.url}/v1/indexes?q=%C3%A9", timeout=30)
        assert_error(r, 422, "bad_request")
    finally:
        server.stop()
        state.searcher.target.close()


def test_a_client_that_leaves_mid_body_while_the_server_drains_is_counted_499(tmp_path, caplog):
    """A client that disconnects before its body has all arrived, while the server drains, is
    counted 499, as any client gone: not a 500, and no traceback in the log (nobody is left to
    answer, and the server did not fail)."""
    import logging
    import socket

    settings = load_settings(overrides={"home": tmp_path}, read_env=False, read_file=False)
    state = service.local_state(settings, executor="local", limits=LIMITS)  # dev mode
    server = start_uvicorn(service.create_app(state), state)

    def rendered() -> str:
        return state.metrics.render().decode()

    try:
        with caplog.at_level(logging.ERROR):
            host, port = server.url.removeprefix("http://").split(":")
            client = socket.create_connection((host, int(port)))
            client.sendall(b"PUT /v1/indexes/x/documents HTTP/1.1\r\nHost: here\r\n"
                           b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                           b'[{"id": "x1", ')
            deadline = time.monotonic() + 30
            while "branchsearch_http_requests_in_flight 1.0" not in rendered():
                assert time.monotonic() < deadline, "the request did not arrive"
                time.sleep(0.05)
            server.server.should_exit = True  # drain: the request goes on
            while not state.draining:
                assert time.monotonic() < deadline, "the server did not start draining"
                time.sleep(0.05)
            client.close()
            put = re.compile(r'^branchsearch_http_requests_total\{endpoint="/v1/indexes/'
                             r'\{index\}/documents",method="PUT",status="(\d+)"\} 1\.0$', re.M)
            while not put.search(rendered()):
                assert time.monotonic() < deadline, "the request was not counted"
                time.sleep(0.05)
        assert put.search(rendered()).group(1) == "499", rendered()
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    finally:
        server.stop()
        state.searcher.target.close()


def test_a_stream_whose_send_fails_as_the_client_leaves_is_499_without_a_traceback(tmp_path,
                                                                                      caplog):
    """A server of ASGI spec 2.4 raises an OSError from `send` once the client is gone
    (uvicorn 0.55 and Ray Serve drop the message instead; neither is 2.4). Starlette turns it
    into ClientDisconnect mid-stream, which `Observe` logged as "unhandled error" with its
    traceback and raised on to the server (a second traceback, "Exception in ASGI
    application"). It is a client gone: counted 499, one debug line, nothing raised. The app is the
    real one over a real index; the server is this test's, per the spec, since no 2.4 server
    is installed."""
    import errno
    import logging

    settings = load_settings(overrides={"home": tmp_path, "index": "acl", "search_mode": "bm25"},
                             read_env=False, read_file=False)
    ingest(write_corpus(tmp_path / "corpus.jsonl"), settings, dense=False)
    state = service.local_state(settings, executor="local", limits=LIMITS)  # dev mode
    body = json.dumps({"question": "harbor festival lighthouse", "branches": 2}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"},
             "http_version": "1.1", "method": "POST", "scheme": "http", "path": "/v1/search",
             "raw_path": b"/v1/search", "query_string": b"", "root_path": "",
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000),
             "headers": [(b"host", b"here"), (b"content-type", b"application/json"),
                         (b"accept", b"text/event-stream"),
                         (b"content-length", str(len(body)).encode())]}

    async def serve_one() -> list[dict]:
        gone, sent, asked = asyncio.Event(), [], []

        async def receive():
            if not asked:
                asked.append(1)
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if gone.is_set():  # the spec's server: an OSError for a connection that is closed
                raise BrokenPipeError(errno.EPIPE, "Broken pipe")
            sent.append(message)
            if message["type"] == "http.response.body" and message.get("body"):
                gone.set()  # the client reads the first event, then leaves

        await service.create_app(state)(scope, receive, send)
        return sent

    try:
        with caplog.at_level(logging.DEBUG):
            sent = asyncio.run(serve_one())
        assert sent[0]["status"] == 200 and len(sent) == 2, sent  # the head, one event
        counted = re.search(r'^branchsearch_http_requests_total\{endpoint="/v1/search",'
                            r'method="POST",status="(\d+)"\} 1\.0$',
                            state.metrics.render().decode(), re.M)
        assert counted and counted.group(1) == "499", state.metrics.render().decode()
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], \
            caplog.text
        assert len([r for r in caplog.records if "left" in r.getMessage()]) == 1, caplog.text
    finally:
        state.searcher.target.close()


@pytest.mark.parametrize("write", ["narrowed and shortened", "deleted"])
def test_a_search_in_flight_across_a_write_returns_nothing_the_caller_no_longer_sees(
        tmp_path, write):
    """A search that read a document, then answered after an admin's write narrowed the
    document's groups and cut it to fewer chunks (or deleted it), must not hand the caller the
    chunks the write removed: after the write returns, no one outside the document's new
    groups gets its text. The guard dropped the chunks still stored (now another group's) but
    let through the ids the store no longer held, with their old text. Non-ASCII ids and
    groups, the caller's group typed decomposed (NFD)."""
    import threading
    import unicodedata

    from branchsearch.orchestrator.driver import open_driver

    settings = load_settings(overrides={"home": tmp_path, "index": "acl", "search_mode": "bm25",
                                        "chunk_tokens": 32, "chunk_overlap": 0, "branches": 1},
                             read_env=False, read_file=False)
    paragraph = ("The heliotrope ledger of Tokyo keeps the quincefleet records of the "
                 "harbor for the yuzumark office. ")  # the marker: in no question
    memo = {"_id": "東京-memo", "title": "Heliotrope Ledger", "acl": ["café"],
            "text": "\n\n".join(f"Part {i}. {paragraph * 2}" for i in range(4))}
    ingest(write_corpus(tmp_path / "corpus.jsonl", [*CORPUS[:2], memo]), settings)
    store = KeyStore(tmp_path / "keys.json")
    cafe = store.add("cafe", (unicodedata.normalize("NFD", "café"),))
    admin = store.add("admin", (), admin=True, everything=True)
    read, release = threading.Event(), threading.Event()

    class Held:
        """The real driver; a search, once its branches have read the stores, waits to be
        released before it answers (the write lands meanwhile)."""

        def __init__(self, driver):
            self.driver = driver

        def __getattr__(self, name):
            return getattr(self.driver, name)

        def search(self, *args, **kwargs):
            result = self.driver.search(*args, **kwargs)
            read.set()
            release.wait(60)
            return result

    state = service.local_state(settings, executor="local", limits=LIMITS,
                                keys_path=tmp_path / "keys.json",
                                driver_factory=lambda s, executor: Held(open_driver(s, executor)))
    server = start_uvicorn(service.create_app(state), state)
    client = httpx.Client(base_url=server.url, timeout=60)
    question = {"question": "heliotrope ledger quincefleet records", "branches": 1}
    try:
        for accept in ("application/json", "text/event-stream"):
            read.clear(), release.clear()
            answer: dict = {}
            caller = threading.Thread(target=lambda: answer.update(r=client.post(
                "/v1/search", json=question, headers={**auth(cafe), "Accept": accept})))
            caller.start()
            assert read.wait(60)  # the caller's branch has read all four chunks
            if write == "deleted":
                r = client.delete("/v1/indexes/acl/documents/東京-memo", headers=auth(admin))
            else:
                r = client.put("/v1/indexes/acl/documents", headers=auth(admin), json=[
                    {"id": "東京-memo", "title": "Heliotrope Ledger", "acl": ["東京-1"],
                     "text": f"Part 0. {paragraph}"}])
            assert r.status_code == 200, r.text
            release.set()
            caller.join(60)
            assert answer["r"].status_code == 200, answer["r"].text
            # what came after the write: the answer (the stream's `search` events before it
            # named the chunks while the caller could see them)
            after = (json.dumps(parse_sse(answer["r"].text)[-1], ensure_ascii=False)
                     if accept == "text/event-stream" else answer["r"].text)
            assert json.loads(after)["type" if accept != "application/json" else "status"] \
                in ("result", "ok")
            assert "yuzumark" not in after and "東京-memo" not in after
            # put back for the next round, and the caller sees it again (the test can fail)
            r = client.put("/v1/indexes/acl/documents", headers=auth(admin), json=[
                {"id": memo["_id"], "title": memo["title"], "acl": memo["acl"],
                 "text": memo["text"]}])
            assert r.status_code == 200, r.text
            release.set()
            again = client.post("/v1/search", json=question, headers=auth(cafe)).json()
            assert len([c for d in again["evidence"] if d["doc_id"] == "東京-memo"
                        for c in d["chunks"]]) >= 2
    finally:
        release.set()
        client.close()
        server.stop()
        state.searcher.target.close()


def test_a_bad_indexes_table_makes_that_index_misconfigured_not_the_service(tmp_path):
    """A misspelt key in one `[indexes.NAME]` table stopped the whole service at start. Now
    that index answers 503 `index_misconfigured` (one JSON error that names it), /readyz
    counts it not ready, and the other indexes serve."""
    settings = load_settings(overrides={
        "home": tmp_path / "home", "index": "local", "branches": 1,
        "indexes": {"typo": {"lexical": "elasticsearch", "es_idx": "corp-docs",
                             "es_url": "http://elastic:hunter2@127.0.0.1:9"}}},
        read_env=False, read_file=False)
    ingest(write_corpus(tmp_path / "c.jsonl", CORPUS[:3]), settings, dense=False)
    state = service.local_state(settings, executor="local", limits=LIMITS)  # dev mode
    server = start_uvicorn(service.create_app(state), state)
    try:
        client = httpx.Client(base_url=server.url, timeout=120)
        bad = client.post("/v1/search", json={"question": "Harbor Festival in June",
                                               "index": "typo"})
        detail = assert_error(bad, 503, "index_misconfigured")
        assert "hunter2" not in bad.text and "127.0.0.1:9" not in bad.text, bad.text
        assert client.post("/v1/search", json={"question": "Harbor Festival in June",
                                                "index": "local"}).status_code == 200
        ready = client.get("/readyz")
        assert ready.status_code == 200 and ready.json() == {
            "status": "ready", "indexes": 2, "indexes_not_ready": 1,
            "not_ready": [{"index": "typo", "error": "index_misconfigured"}]}, ready.text
        assert detail
    finally:
        server.stop()
        state.searcher.target.close()
