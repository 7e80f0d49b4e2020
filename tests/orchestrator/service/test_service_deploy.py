"""The service started the ways the README says — `serve --standalone` with each executor, and
Ray Serve — as its own process, with an owned index and a declared external one whose backend
URL holds credentials, many keys, a burst of 30 searches, callers that disconnect, the owned
index's Milvus Lite process killed, and SIGTERM in the middle of a stream. Real processes, real HTTP; nothing mocked."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from branchsearch.infra.ingest.pipeline import ingest
from branchsearch.infra.config.settings import load_settings
from branchsearch.orchestrator.service.auth import KeyStore
from branchsearch.orchestrator.service.events import parse_sse

from conftest import HOTPOT, prepared
from service_fixtures import free_port, write_corpus

pytestmark = [pytest.mark.ray, pytest.mark.es]
RESTRICTED = {"scott-derrickson": ["film-dept"]}  # in the external index, one group only
COMPARE = "Were Scott Derrickson and Ed Wood of the same nationality?"
BURST = 30


@pytest.fixture(scope="module")
def site(tmp_path_factory, es_url):
    """A home with an owned index ('acl') and a declared external one ('corp': a foreign-schema
    Elasticsearch index, reached through a URL with a user and password), and the keys."""
    from elasticsearch import Elasticsearch

    home = tmp_path_factory.mktemp("deploy-home")
    settings = load_settings(overrides={"home": home, "index": "acl"}, read_env=False,
                             read_file=False)
    ingest(write_corpus(home / "corpus.jsonl"), settings)
    es_index = f"corp-{uuid.uuid4().hex[:8]}"
    es = Elasticsearch(es_url)
    es.indices.create(index=es_index, mappings={"properties": {
        "doc_key": {"type": "keyword"}, "headline": {"type": "text"}, "body": {"type": "text"},
        "groups": {"type": "keyword"}}})
    for line in (HOTPOT / "corpus.jsonl").read_text().splitlines():
        d = json.loads(line)
        es.index(index=es_index, id=d["_id"], document={
            "doc_key": d["_id"], "headline": d["title"], "body": d["text"],
            **({"groups": RESTRICTED[d["_id"]]} if d["_id"] in RESTRICTED else {})})
    es.indices.refresh(index=es_index)
    url = es_url.replace("://", "://svc:hunter2@")  # credentials in the URL, never to a caller
    config = home / "branchsearch.toml"
    config.write_text(f'es_url = "{url}"\n[indexes.corp]\nlexical = "elasticsearch"\n'
                      f'es_index = "{es_index}"\n[indexes.corp.fields]\nid = "doc_key"\n'
                      'title = "headline"\ntext = "body"\nacl = "groups"\n')
    store = KeyStore(home / "keys.json")
    keys = {f"u{i}": store.add(f"u{i}", ("alpha",)) for i in range(BURST)}
    keys["film"] = store.add("film", ("film-dept",))
    keys["public"] = store.add("public", ())
    yield {"home": home, "config": config, "keys": keys, "es_host": es_url.split("//")[1]}
    es.indices.delete(index=es_index, ignore_unavailable=True)
    es.close()


def start(site, mode: str, *, sigint_default: bool = False) -> tuple[subprocess.Popen, str]:
    """`serve` in `mode`, once ready; `sigint_default`: SIGINT as a terminal gives it (^C)."""
    port = free_port()
    args = {"standalone-local": ["--standalone", "--executor", "local"],
            "standalone-ray": ["--standalone", "--executor", "ray"],
            "serve": [], "serve-local": ["--executor", "local"],
            "serve-2": ["--replicas", "2", "--executor", "local"]}[mode]
    cmd = [sys.executable, "-m", "branchsearch.orchestrator.cli", "serve", *args,
           "--home", str(site["home"]), "--config", str(site["config"]), "--index", "acl",
           "--keys", str(site["home"] / "keys.json"), "--port", str(port)]
    if sigint_default:
        cmd = prepared(cmd, sigint_default=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BRANCHSEARCH_", "RAY_"))}
    log = open(site["home"] / f"{mode}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)  # its own group: a stray kill hits only it
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 420
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{mode} exited {proc.returncode}: {_log(site, mode)}")
        try:
            if httpx.get(url + "/readyz", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop(proc)
    raise AssertionError(f"{mode} not ready in time: {_log(site, mode)}")


def kill_lite(db: Path) -> None:
    """SIGKILL the Milvus Lite process serving `db` (this test's own file, found by its
    command line), and wait until it is dead."""
    import psutil

    procs = [p for p in psutil.process_iter(["cmdline"])
             if str(db.resolve()) in (p.info["cmdline"] or []) and p.info["cmdline"][0].endswith("milvus")]
    assert len(procs) == 1, procs
    procs[0].kill()
    for _ in range(300):  # dead: a zombie until the service's next request reaps it
        try:
            if procs[0].status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.1)
    raise AssertionError("the Milvus Lite process outlived SIGKILL")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(30)


def _log(site, mode: str) -> str:
    return (site["home"] / f"{mode}.log").read_text()[-3000:]


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def burst(url: str, keys: list[str]) -> list[tuple[int, float, dict]]:
    """One 3-branch search per key at once, alternating the two indexes."""
    async def one(client, i, key):
        began = time.perf_counter()
        r = await client.post("/v1/search", headers=bearer(key), json={
            "question": COMPARE, "index": ("corp", "acl")[i % 2], "branches": 3,
            "deadline_s": 120})
        return r.status_code, time.perf_counter() - began, r.json()

    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        return await asyncio.gather(*[one(client, i, k) for i, k in enumerate(keys)])


async def walk_away(url: str, key: str, n: int) -> None:
    """n searches at once whose client gives up after 0.1 s (the connection closes). A warm
    service may answer one before that (a 200): that one gave its slot back by finishing; at
    least one must have been walked away from."""
    async with httpx.AsyncClient(base_url=url, timeout=0.1) as client:
        outcomes = await asyncio.gather(*[client.post("/v1/search", headers=bearer(key),
                                                      json={"question": COMPARE,
                                                            "index": "corp"})
                                          for _ in range(n)], return_exceptions=True)
    for outcome in outcomes:
        assert isinstance(outcome, httpx.TimeoutException) or (
            isinstance(outcome, httpx.Response) and outcome.status_code == 200), outcome
    assert any(isinstance(o, httpx.TimeoutException) for o in outcomes), outcomes


def ray_session(proc: subprocess.Popen) -> Path | None:
    """The Ray session folder of the cluster `proc` started (named in its raylet's command
    line), or None (no Ray under it)."""
    import psutil

    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            args = child.cmdline()
        except psutil.Error:
            continue
        for arg in args:
            found = re.search(r"(/\S*?/session_\d{4}-[^/\s]+)", arg)
            if found:
                return Path(found.group(1))
    return None


@pytest.mark.parametrize("mode", ["standalone-local", "standalone-ray", "serve"])
def test_the_service_as_deployed(site, mode):
    proc, url = start(site, mode)
    keys = site["keys"]
    session = ray_session(proc) if mode == "serve" else None
    try:
        with httpx.Client(base_url=url, timeout=300) as client:
            # both indexes listed and searched; ACL of the external index from the key
            listed = client.get("/v1/indexes", headers=bearer(keys["u0"])).json()["indexes"]
            assert listed == ["acl", "corp"], listed
            q = {"question": "Scott Derrickson director", "index": "corp", "branches": 1}
            film = client.post("/v1/search", headers=bearer(keys["film"]), json=q)
            assert film.status_code == 200, film.text
            assert "scott-derrickson" in {d["doc_id"] for d in film.json()["evidence"]}
            public = client.post("/v1/search", headers=bearer(keys["public"]), json=q).json()
            assert public["status"] == "ok" and public["evidence"]
            assert "scott-derrickson" not in {d["doc_id"] for d in public["evidence"]}
            sse = client.post("/v1/search", headers={**bearer(keys["film"]),
                                                     "Accept": "text/event-stream"}, json=q)
            final = parse_sse(sse.text)[-1]
            assert final["type"] == "result" and final["result"]["index"] == "corp"
            put = client.put("/v1/indexes/corp/documents", headers=bearer(keys["u0"]),
                             json=[{"id": "x", "text": "y"}])
            assert put.status_code in (403, 409) and put.json()["error"] in (
                "forbidden", "read_only_index")

            # a burst of 30 three-branch searches over both indexes: every one answers
            answers = asyncio.run(burst(url, [keys[f"u{i}"] for i in range(BURST)]))
            statuses = [(code, body.get("status") or body.get("error")) for code, _, body
                        in answers]
            assert statuses == [(200, "ok")] * BURST, statuses
            latencies = sorted(s for _, s, _ in answers)
            print(f"{mode}: burst of {BURST}: p50 {latencies[BURST // 2]:.2f} s, "
                  f"max {latencies[-1]:.2f} s")

            # callers that walk away call their searches off: the slots are back once those
            # have stopped, a turn later (the limit is 4 a key)
            asyncio.run(walk_away(url, keys["u1"], 4))
            time.sleep(0.5)
            again = client.post("/v1/search", headers=bearer(keys["u1"]),
                                json={"question": "Harbor Festival", "branches": 1})
            assert again.status_code == 200, again.text
            metrics = client.get("/metrics").text
            if mode != "serve":  # under Serve the proxy answers the closed connection itself
                assert 'status="499"' in metrics, metrics[-2000:]
            assert 'status="500"' not in metrics, metrics

            # the owned index's Milvus Lite process dies (standalone: the service's child;
            # Ray: the retriever actor's): the next search starts it again, same answer
            lite = {"question": "Harbor Festival", "branches": 1}
            before = client.post("/v1/search", headers=bearer(keys["u3"]), json=lite).json()
            kill_lite(site["home"] / "indexes" / "acl" / "dense.db")
            after = client.post("/v1/search", headers=bearer(keys["u3"]), json=lite)
            assert after.status_code == 200, after.text
            assert after.json()["status"] == "ok", after.json()["branches"]
            assert after.json()["evidence"] == before["evidence"]

            # nothing a caller saw holds the backend's password or address
            for _, _, body in answers:
                assert "hunter2" not in json.dumps(body) and site["es_host"] not in json.dumps(
                    body)

            # SIGTERM in the middle of a stream: the stream ends with its result, exit 0;
            # meanwhile new requests are refused in JSON (Ray Serve: 503 shutting_down, not
            # its proxy's plain-text 404 "Path not found"), or not connected at all
            probes: list = []
            watching = threading.Event()

            def probe() -> None:
                with httpx.Client(base_url=url, timeout=10) as other:
                    while watching.is_set():
                        try:
                            r = other.get("/readyz")
                            probes.append((r.status_code, r.headers.get("content-type", "")))
                        except httpx.TransportError:
                            probes.append("refused")
                        time.sleep(0.2)

            with client.stream("POST", "/v1/search", headers={
                    **bearer(keys["u2"]), "Accept": "text/event-stream"},
                    json={"question": COMPARE, "index": "corp", "branches": 3}) as stream:
                lines = stream.iter_lines()
                first = next(lines)
                assert first.startswith("event: plan"), first
                os.kill(proc.pid, signal.SIGTERM)
                watching.set()
                prober = threading.Thread(target=probe, daemon=True)
                prober.start()
                rest = "\n".join([first, *lines])
            events = parse_sse(rest + "\n\n")
            assert events[-1]["type"] == "result", events[-1]
        assert proc.wait(120) == 0, _log(site, mode)
        watching.clear()
        prober.join(15)
        assert all(p == "refused" or p[0] in (200, 503) and p[1].startswith(
            "application/json") for p in probes), probes
        if mode == "serve":
            assert (503, "application/json") in probes, probes
        # a caller's mistake (the 403 above) is no failed request with a traceback in the
        # service's log (a refusal crosses the Searcher handle as a value)
        logged = [(site["home"] / f"{mode}.log").read_text()]
        if mode == "serve":  # the Searcher replica's own log
            assert session is not None
            logged += [f.read_text() for f in (session / "logs" / "serve").glob(
                "replica_*Searcher*.log")]
            assert len(logged) > 1
            # the service's own lines are there too, not in a Ray worker's stderr file alone
            assert any("branch pool: " in text for text in logged[1:]), logged[1:]
        assert not any("ApiError" in text for text in logged), logged
    finally:
        stop(proc)


@pytest.mark.parametrize("mode, sig, code, last", [
    ("standalone-local", "SIGTERM", 0, "stopped (SIGTERM): requests in flight drained, every "
                                       "index closed"),
    ("standalone-local", "SIGINT", 130, "interrupted"),
    ("serve-local", "SIGTERM", 0, "stopped (SIGTERM): requests in flight drained; the "
                                  "application 'branchsearch' taken off the cluster"),
    ("serve-local", "SIGINT", 130, "interrupted")])
def test_a_stopped_service_says_last_that_it_stopped_and_why(site, mode, sig, code, last):
    """A supervisor's SIGTERM, or ^C, to a serving `serve`: the last line of its log says it
    stopped and why, and it exits as documented: 0 for SIGTERM (a stop asked for, drained),
    130 and `interrupted` for ^C, as every command. Before, standalone ended a SIGTERM
    without a word, and Ray Serve's ^C exited 0 as if SIGTERM had stopped it."""
    proc, _ = start(site, mode, sigint_default=True)
    try:
        deadline = time.time() + 120  # (Serve answers /readyz a moment before `serving on`)
        while "serving on" not in _log(site, mode) and time.time() < deadline:
            time.sleep(0.2)
        proc.send_signal(getattr(signal, sig))
        assert proc.wait(120) == code, _log(site, mode)
    finally:
        stop(proc)
    lines = [line for line in _log(site, mode).splitlines() if line.strip()]
    assert lines[-1].startswith(last), lines[-4:]
    assert "Traceback" not in _log(site, mode)


def test_two_ingress_replicas_answer_metrics_for_both(site):
    """Ray Serve with two ingress replicas: the proxy sends each request, and each scrape, to
    either. Every scrape counts every request (each replica shares its counts on the
    application's board), not one replica's share at random; the text passes promtool."""
    import shutil

    proc, url = start(site, "serve-2")
    keys = site["keys"]
    try:
        with httpx.Client(base_url=url, timeout=300) as client:
            for i in range(12):
                r = client.post("/v1/search", headers=bearer(keys[f"u{i}"]),
                                json={"question": "Harbor Festival", "branches": 1})
                assert r.status_code == 200, r.text
            for _ in range(4):
                assert client.post("/v1/search", headers=bearer("nope"),
                                   json={"question": "q"}).status_code == 401
            time.sleep(3 * 2.0)  # a few of the replicas' pushes (SharedMetrics.PUSH_S)

            def counted(text: str, status: str) -> float:
                return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                           if line.startswith("branchsearch_http_requests_total{")
                           and 'endpoint="/v1/search"' in line and f'status="{status}"' in line)

            scrapes = [client.get("/metrics").text for _ in range(8)]
            assert [(counted(t, "200"), counted(t, "401")) for t in scrapes] == [(12, 4)] * 8
            assert all("branchsearch_searches_total{status=\"ok\"} 12.0" in t for t in scrapes)
            if shutil.which("promtool"):
                check = subprocess.run(["promtool", "check", "metrics"], input=scrapes[-1],
                                       capture_output=True, text=True)
                assert check.returncode == 0, check.stdout + check.stderr
    finally:
        stop(proc)
