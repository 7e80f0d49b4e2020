"""The service as a Ray Serve application on a real local Ray cluster: search and stream through
the Serve proxy, a killed ingress replica replaced while requests keep succeeding, and overload
answered by Serve's queue limit as JSON 503."""

from __future__ import annotations

import contextlib
import concurrent.futures as cf
import time

import httpx
import pytest

from branchsearch.infra.ingest.pipeline import ingest
from branchsearch.infra.config.settings import load_settings
from branchsearch.orchestrator.service.auth import KeyStore
from branchsearch.orchestrator.service.events import parse_sse

from service_fixtures import free_port, write_corpus

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def serve_app(tmp_path_factory):
    import ray
    from ray import serve

    from branchsearch.infra.raycluster import connect
    from branchsearch.orchestrator.service.deploy import ServeOptions, build_application

    home = tmp_path_factory.mktemp("serve-home")
    settings = load_settings(overrides={"home": home, "index": "acl", "branches": 2},
                             read_env=False, read_file=False)
    ingest(write_corpus(home / "corpus.jsonl"), settings)
    store = KeyStore(home / "keys.json")
    keys = {"alpha": store.add("alpha", ("alpha",)), "admin": store.add("admin", (), admin=True, everything=True),
            "elsewhere": store.add("elsewhere", ("alpha",), ("elsewhere",))}  # not index acl
    for attempt in range(3):  # Ray waits a fixed 30 s for its raylet: a loaded machine misses it
        try:
            connect(settings)
            break
        except Exception:  # noqa: BLE001
            if attempt == 2:
                raise
            ray.shutdown()
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    opts = ServeOptions(home=str(home), index="acl", keys=str(home / "keys.json"),
                        executor="local", replicas=2, searcher_max_ongoing=1,
                        searcher_max_queued=1,
                        limits={"per_key_concurrency": 64, "max_in_flight": 64})
    serve.run(build_application(opts), name="branchsearch", route_prefix="/")
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
    yield client, keys
    client.close()
    serve.shutdown()
    ray.shutdown()


def auth(key):
    return {"Authorization": f"Bearer {key}"}


def _ingress_replicas() -> list[str]:
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if "#Ingress#" in a["name"])


def test_search_and_stream_through_serve(serve_app):
    client, keys = serve_app
    r = client.post("/v1/search", json={"question": "Alpha budget harbor sensors"},
                    headers=auth(keys["alpha"]))
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert {d["doc_id"] for d in r.json()["evidence"]} & {"a-budget", "a-roadmap"}
    r = client.post("/v1/search", json={"question": "harbor"})
    assert r.status_code == 401 and r.json()["error"] == "unauthorized"
    plain = {"content": b"harbor", "headers": {"Content-Type": "text/plain"}}
    r = client.post("/v1/search", **plain)  # no key: a 401 whatever the body is
    assert r.status_code == 401 and r.json()["error"] == "unauthorized", r.text
    r = client.post("/v1/nowhere", **plain)  # no route: a 404 whatever the body is
    assert r.status_code == 404 and r.json()["error"] == "not_found", r.text
    r = client.post("/v1/search", content=b"harbor",
                    headers={**auth(keys["alpha"]), "Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"] == "unsupported_media_type", r.text
    r = client.post("/v1/search", json={"question": "Alpha roadmap"},
                    headers={**auth(keys["alpha"]), "Accept": "text/event-stream"})
    types = [e["type"] for e in parse_sse(r.text)]
    assert types[0] == "plan" and types[-1] == "result" and "branch_done" in types
    assert client.get("/readyz").status_code == 200
    assert "branchsearch_http_requests_total" in client.get("/metrics").text


def test_killed_replica_is_replaced_and_requests_keep_succeeding(serve_app):
    import ray
    from ray import serve

    client, keys = serve_app
    before = _ingress_replicas()
    assert len(before) == 2
    ray.kill(ray.get_actor(before[0], namespace="serve"), no_restart=True)
    statuses = []
    for i in range(12):
        r = client.post("/v1/search", json={"question": f"harbor lighthouse {i}", "branches": 1},
                        headers=auth(keys["alpha"]))
        statuses.append(r.status_code)
    deadline = time.time() + 120
    while time.time() < deadline:
        now = _ingress_replicas()
        ingress = serve.status().applications["branchsearch"].deployments["Ingress"]
        if (len(now) == 2 and before[0] not in now
                and ingress.replica_states.get("RUNNING", 0) == 2):
            break
        time.sleep(1)
    else:
        pytest.fail(f"replica not replaced: {_ingress_replicas()}")
    assert statuses == [200] * 12, statuses
    r = client.post("/v1/search", json={"question": "harbor"}, headers=auth(keys["alpha"]))
    assert r.status_code == 200


def test_overload_is_a_json_503_from_serve_queue_limit(serve_app):
    """The searcher takes 1 search at a time and queues 1: a burst gets 503s, as JSON, whose
    fields name the limit met (`Overload`: Serve's queue, and its size; how many wait there,
    Serve does not say); `loadtest`'s note on them names the flag that sets that limit for
    `branchsearch serve`, not only the Serve config's key."""
    from branchsearch.orchestrator.loadtest.run import overload_notes

    client, keys = serve_app

    def one(i):
        return client.post("/v1/search", json={"question": f"Alpha roadmap harbor {i}"},
                           headers=auth(keys["alpha"]))

    with cf.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(8)))
    codes = [r.status_code for r in answers]
    assert 200 in codes and 503 in codes, codes
    for r in answers:
        if r.status_code == 503:
            assert r.json()["error"] == "overloaded" and r.headers.get("retry-after") == "1"
            body = r.json()
            assert (body["reason"], body["in_use"], body["limits"]) == (
                "searcher_queue", None, {"searcher_max_queued": 1}), body
    body = next(r.json() for r in answers if r.status_code == 503)
    [note] = overload_notes({body["reason"]: 1}, {body["reason"]: body["limits"]})
    assert note.startswith("Ray Serve's queue for the searcher was full (searcher_max_queued "
                           "1): 1 request was refused at once"), note
    assert note.endswith("raise searcher_max_queued (`branchsearch serve --max-queued`) or add "
                         "searcher replicas"), note


def test_searcher_replicas_on_the_ray_executor_share_the_cluster(serve_app, tmp_path):
    """Two searcher replicas (as the Serve config offers with server backends), branches as
    Ray actors: each plans its branch pool for its share of the free CPUs, so no replica's
    actors wait for CPUs another holds. No replica dies, and both search."""
    from ray import serve
    from ray._private import state

    from branchsearch.orchestrator.service.deploy import ServeOptions, build_application

    client, _ = serve_app
    home = bm_home(tmp_path / "two")
    config = tmp_path / "settings.toml"
    config.write_text("[execution]\nactor_start_timeout_s = 30\n")
    opts = ServeOptions(home=str(home), index="bm", config=str(config), executor="ray",
                        searcher_replicas=2)

    def searchers(status: str) -> list[str]:
        return [a["ActorID"] for a in state.actors().values()
                if a.get("ActorClassName", "").endswith(":two:Searcher")
                and a.get("State") == status]

    serve.run(build_application(opts), name="two", route_prefix="/two")
    try:
        assert len(searchers("ALIVE")) == 2
        for i in range(6):  # the proxy spreads them over both replicas
            r = client.post("/two/v1/search", json={"question": f"harbor budget sensors {i}"})
            assert r.status_code == 200, r.text
            assert r.json()["evidence"]
        assert searchers("DEAD") == [], "a searcher replica failed to start and was replaced"
    finally:
        serve.delete("two")  # the module's own app goes on


def test_a_client_gone_while_serve_drains_is_counted_499(serve_app, tmp_path):
    """A request in flight when the application starts to drain, whose client then leaves:
    Serve's proxy cancels it in the ingress replica, which counts it 499 (the client left),
    not 503 `shutting_down` (an answer no one receives, from a server that did not fail)."""
    import socket

    import ray
    from ray import serve

    from branchsearch.orchestrator.service.deploy import (BOARD_NAMESPACE, ServeOptions,
                                                          board_name, build_application)

    client, _ = serve_app
    home = bm_home(tmp_path / "drain")
    opts = ServeOptions(home=str(home), index="bm", executor="local")  # dev mode: no keys
    serve.run(build_application(opts), name="drain", route_prefix="/drain")

    def put_statuses(board) -> list[str]:
        """The statuses the ingress counted PUTs under, as it shares them (every 2 s)."""
        _, shared = ray.get(board.share.remote("test", []), timeout=30)
        return [labels["status"] for _, snapshot in shared for family, _, _, samples in snapshot
                if family == "branchsearch_http_requests" for name, labels, _ in samples
                if name.endswith("_total") and labels.get("method") == "PUT"]

    try:
        host, port = str(client.base_url).removeprefix("http://").rstrip("/").split(":")
        caller = socket.create_connection((host, int(port)))
        caller.sendall(b"PUT /drain/v1/indexes/bm/documents HTTP/1.1\r\nHost: here\r\n"
                       b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                       b'[{"id": "x1", ')  # the rest of its body never comes
        deadline = time.monotonic() + 120
        # in flight at the ingress: the PUT, and the scrape asking
        while "branchsearch_http_requests_in_flight 2.0" not in client.get("/drain/metrics").text:
            assert time.monotonic() < deadline, "the request did not reach the ingress"
            time.sleep(0.2)
        board = ray.get_actor(board_name("drain"), namespace=BOARD_NAMESPACE)
        ray.get(board.drain.remote(), timeout=30)
        while client.get("/drain/readyz").status_code != 503:  # the replica knows
            assert time.monotonic() < deadline, "the ingress did not learn of the drain"
            time.sleep(0.2)
        caller.close()
        while not (statuses := put_statuses(board)):
            assert time.monotonic() < deadline, "the request was not counted"
            time.sleep(0.5)
        assert statuses == ["499"], statuses
    finally:
        serve.delete("drain")  # the module's own app goes on


def test_probes_under_a_route_prefix_are_answered_while_serve_drains(serve_app, tmp_path):
    """An application under a route prefix (a Serve config's `route_prefix: /probe`) refused
    /healthz and /metrics with 503 `shutting_down` during the drain, and took a query string
    on a /v1 route: the ingress compared the ASGI path, which holds the prefix, with
    "/healthz" and "/v1/". Under a prefix they now answer as they do at "/"."""
    import ray
    from ray import serve

    from branchsearch.orchestrator.service.deploy import (BOARD_NAMESPACE, ServeOptions,
                                                          board_name, build_application)

    client, _ = serve_app
    home = bm_home(tmp_path / "probe")
    opts = ServeOptions(home=str(home), index="bm", executor="local")  # dev mode: no keys
    serve.run(build_application(opts), name="probe", route_prefix="/probe")
    try:
        r = client.post("/probe/v1/search?k=3", json={"question": "harbor"})
        assert r.status_code == 422 and "unknown query parameter(s): k" in r.json()["detail"]
        deadline = time.monotonic() + 120
        while True:  # the board is made by the ingress replica's first push
            try:
                board = ray.get_actor(board_name("probe"), namespace=BOARD_NAMESPACE)
                break
            except ValueError:
                assert time.monotonic() < deadline, "no metrics board"
                time.sleep(0.5)
        ray.get(board.drain.remote(), timeout=30)
        while client.get("/probe/readyz").status_code != 503:  # the replica knows
            assert time.monotonic() < deadline, "the ingress did not learn of the drain"
            time.sleep(0.2)
        health = client.get("/probe/healthz")
        assert health.status_code == 200 and health.json() == {"status": "up"}, health.text
        metrics = client.get("/probe/metrics")
        assert metrics.status_code == 200, metrics.text
        assert "branchsearch_http_requests_total" in metrics.text
        assert client.head("/probe/healthz").status_code == 200
        refused = client.get("/probe/v1/indexes")
        assert refused.status_code == 503 and refused.json()["error"] == "shutting_down"
    finally:
        serve.delete("probe")  # the module's own app goes on


def test_a_serve_app_shut_down_closes_its_searcher(serve_app, tmp_path):
    """Serve's graceful shutdown of a searcher replica left its Searcher open: the index's
    retriever actor was killed with the replica rather than closed, so its Milvus Lite server
    was never stopped (its lock file stayed in the index folder) and the branch actors went
    only because their owner died. The replica's `__del__` now closes it, as standalone
    closes it on exit."""
    import ray
    from ray import serve
    from ray._private import state

    from branchsearch.orchestrator.service.deploy import ServeOptions, build_application

    client, _ = serve_app
    home = tmp_path / "closing"
    home.mkdir()
    settings = load_settings(overrides={"home": home, "index": "hy"}, read_env=False,
                             read_file=False)
    ingest(write_corpus(home / "corpus.jsonl"), settings)  # hybrid: its own Milvus Lite file
    lock = settings.index_dir / ".dense.db.lock"
    assert not lock.exists()
    config = tmp_path / "settings.toml"
    config.write_text("[execution]\nactor_start_timeout_s = 60\n")
    opts = ServeOptions(home=str(home), index="hy", config=str(config), executor="ray")

    def actors(status: str) -> set[str]:
        return {a["ActorID"] for a in state.actors().values()
                if a.get("ActorClassName", "").endswith(("BranchService", "RetrieverService"))
                and a.get("State") == status}

    before = actors("ALIVE")
    serve.run(build_application(opts), name="closing", route_prefix="/closing")
    try:
        r = client.post("/closing/v1/search", json={"question": "harbor festival boats"})
        assert r.status_code == 200 and r.json()["evidence"], r.text
        assert lock.exists()  # the retriever actor's Milvus Lite server holds the file
        mine = actors("ALIVE") - before
        assert mine, "no branch or retriever actor started"
    finally:
        serve.delete("closing")  # graceful: the replicas drain, then stop
    assert not lock.exists(), "the searcher's index was not closed"
    assert not mine & actors("ALIVE")
    assert ray.is_initialized()


def bm_home(home):
    """A data home holding one BM25 index, `bm`, of the test corpus."""
    home.mkdir()
    settings = load_settings(overrides={"home": home, "index": "bm"}, read_env=False,
                             read_file=False)
    ingest(write_corpus(home / "corpus.jsonl"), settings, dense=False)
    return home


def test_a_404_under_a_route_prefix_names_the_docs_under_it(serve_app, tmp_path):
    """A path with no route, in an application under a route prefix (a Serve config's
    `route_prefix: /team/search`), answered "(see /docs)": the host's root, outside the
    application, where nothing of it answers. The 404 now names the API browser under the
    prefix, and that path answers."""
    from ray import serve

    from branchsearch.orchestrator.service.deploy import ServeOptions, build_application

    client, _ = serve_app
    opts = ServeOptions(home=str(bm_home(tmp_path / "docs")), index="bm", executor="local")
    serve.run(build_application(opts), name="docs404", route_prefix="/team/search")
    try:
        r = client.get("/team/search/nope")
        assert r.status_code == 404 and r.json()["error"] == "not_found", r.text
        assert r.json()["detail"] == \
            "no such path: GET /team/search/nope (see /team/search/docs)"
        assert client.get("/team/search/docs").status_code == 200
    finally:
        serve.delete("docs404")  # the module's own app goes on


def test_readyz_answers_within_its_wait_while_the_searcher_is_not_up(serve_app, tmp_path):
    """Under Ray Serve the ingress answers as soon as its own replica runs, while the
    searcher replica may still be starting (loading the default index's models: a probe right
    after `serve` started took 17 s here) or, as here, waiting for room on the cluster. /readyz
    waited for it with no bound, past any balancer's probe timeout; it now answers 503
    `not_ready` within its wait (`board.READ_WAIT_S`: no searcher has published its
    readiness)."""
    from branchsearch.orchestrator.service.board import READ_WAIT_S

    client, _ = serve_app
    with _searcher_never_placed(client, tmp_path, "late"):
        for _ in range(2):
            began = time.monotonic()
            r = client.get("/late/readyz", timeout=60)
            took = time.monotonic() - began
            assert r.status_code == 503 and r.json()["error"] == "not_ready", r.text
            assert r.headers["retry-after"] == "5"
            assert took < READ_WAIT_S + 2, took


@contextlib.contextmanager
def _searcher_never_placed(client, tmp_path, name: str):
    """An app at /NAME whose searcher replica asks more CPU than the cluster has (it never
    starts), once its ingress is up; deleted after (the module's own app goes on)."""
    from ray import serve
    from ray.serve.api import _run

    from branchsearch.orchestrator.service.deploy import ServeOptions, build_application

    opts = ServeOptions(home=str(bm_home(tmp_path / name)), index="bm", executor="local",
                        searcher_cpus=10_000)
    _run(build_application(opts), name=name, route_prefix=f"/{name}", _blocking=False)
    try:
        deadline = time.monotonic() + 120
        while client.get(f"/{name}/healthz").status_code != 200:  # the ingress is up
            assert time.monotonic() < deadline, "the ingress did not start"
            time.sleep(0.5)
        yield
    finally:
        serve.delete(name)


def test_a_search_the_searcher_never_takes_is_a_504_by_its_deadline(serve_app, tmp_path):
    """A searcher replica that is not there (restarting after its node died: 27 s on a 2-node
    cluster, or waiting for room, as here): a search waited in the ingress for as long as
    that took, whatever its `deadline_s` (deadline 20 s: 504s after 28-30 s on the cluster;
    here with no bound at all), and a balancer's timeout cut it. The ingress now answers 504
    `deadline_exceeded` once the deadline and `JOIN_GRACE_S` have passed, streamed or not."""
    from branchsearch.orchestrator.service.searcher import JOIN_GRACE_S as ANSWER_GRACE_S

    client, _ = serve_app
    with _searcher_never_placed(client, tmp_path, "gone"):
        for accept in ("application/json", "text/event-stream"):
            began = time.monotonic()
            r = client.post("/gone/v1/search", json={"question": "harbor", "deadline_s": 1},
                            headers={"Accept": accept}, timeout=ANSWER_GRACE_S + 30)
            took = time.monotonic() - began
            assert r.status_code == 504 and r.json()["error"] == "deadline_exceeded", r.text
            assert 1 <= took < 1 + ANSWER_GRACE_S + 3, took


@contextlib.contextmanager
def _searcher_queue_full(client, key):
    """Six callers of `key` searching without pause until the block ends; it begins once one of
    them was refused 503 (the searcher's Serve queue full: it takes 1 search at a time and
    queues 1). Yields the statuses they met."""
    import threading

    stop, hammered = threading.Event(), []

    def hammer(i):
        while not stop.is_set():
            hammered.append(client.post("/v1/search", headers=auth(key), json={
                "question": f"Alpha roadmap harbor {i}"}).status_code)

    with cf.ThreadPoolExecutor(6) as pool:
        for i in range(6):
            pool.submit(hammer, i)
        try:
            deadline = time.monotonic() + 60
            while 503 not in hammered:
                assert time.monotonic() < deadline, hammered
                time.sleep(0.05)
            yield hammered
        finally:
            stop.set()


def test_what_the_key_alone_refuses_is_403_also_while_the_searcher_queue_is_full(serve_app):
    """A search of an index the key may not use, or a document write with a key that is no
    admin key, is refused by the ingress itself, 403 whatever the searcher's Serve queue holds:
    never a 503 `overloaded` with `Retry-After`, which would tell a caller with no right to it
    to retry."""
    client, keys = serve_app
    forbidden = []
    with _searcher_queue_full(client, keys["alpha"]) as hammered:
        for i in range(10):
            forbidden += [
                client.post("/v1/search", headers=auth(keys["elsewhere"]),
                            json={"question": "harbor", "index": "acl"}),
                client.put("/v1/indexes/acl/documents", headers=auth(keys["alpha"]),
                           json=[{"id": f"w{i}", "text": "harbor"}]),
                client.delete("/v1/indexes/acl/documents/a-budget",
                              headers=auth(keys["alpha"]))]
    assert 503 in hammered and 200 in hammered, hammered
    assert [r.status_code for r in forbidden] == [403] * 30, [r.text for r in forbidden
                                                              if r.status_code != 403]
    assert {r.json()["error"] for r in forbidden} == {"forbidden"}
    assert "may not use index 'acl'" in forbidden[0].json()["detail"]
    assert "not an admin key" in forbidden[1].json()["detail"]


def test_readyz_and_the_index_list_answer_while_a_burst_fills_the_searcher_queue(serve_app):
    """/readyz and GET /v1/indexes asked the searcher replica through the same Serve queue as
    the searches. A full queue is a searcher that is up and busy: while a burst fills it, both
    answer 200 (from the readiness board the searcher publishes), so a balancer keeps a busy,
    healthy replica in service and a client can list its indexes."""
    client, keys = serve_app
    for _ in range(12):  # each ingress replica has met the searcher's answer once
        assert client.get("/readyz").status_code == 200
        assert client.get("/v1/indexes", headers=auth(keys["alpha"])).status_code == 200
    probes, lists = [], []
    with _searcher_queue_full(client, keys["alpha"]) as hammered:
        for _ in range(15):
            probes.append(client.get("/readyz"))
            lists.append(client.get("/v1/indexes", headers=auth(keys["alpha"])))
    assert 503 in hammered and 200 in hammered, hammered
    assert [r.status_code for r in probes] == [200] * 15, [r.text for r in probes
                                                           if r.status_code != 200]
    assert {r.json()["status"] for r in probes} == {"ready"}
    assert [r.status_code for r in lists] == [200] * 15, [r.text for r in lists
                                                          if r.status_code != 200]
    assert {tuple(r.json()["indexes"]) for r in lists} == {("acl",)}


@contextlib.contextmanager
def _app_over_a_hung_backend(tmp_path, name: str, **options):
    """Application `name` at `/name` on a copy of the bm home, with a second index `hole` on an
    Elasticsearch URL that takes connections and never answers (a search of it holds its
    place until its deadline); yields that listening socket. `options`: `ServeOptions` fields."""
    import socket

    from ray import serve

    from branchsearch.orchestrator.service.deploy import ServeOptions, build_application

    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)
    home = bm_home(tmp_path / name)
    config = home / "branchsearch.toml"
    config.write_text(f'backend_timeout_s = 120\n[indexes.hole]\nlexical = "elasticsearch"\n'
                      f'es_index = "x"\nes_url = "http://127.0.0.1:{hole.getsockname()[1]}"\n')
    serve.run(build_application(ServeOptions(home=str(home), index="bm", config=str(config),
                                             executor="local", **options)),
              name=name, route_prefix=f"/{name}")
    try:
        yield hole
    finally:
        hole.close()
        serve.delete(name)  # the module's own app goes on


def _until_the_searcher_is_held(client, prefix: str, held) -> None:
    """Returns once search `held` (a future) holds the searcher replica of the app at `prefix`
    (one search at a time): a short search then waits behind it until its deadline (504). Not
    from a connection to the held search's backend, which the readiness checks also open; and
    not at once, as Serve refuses simultaneous arrivals at a one-place queue."""
    time.sleep(2)
    deadline = time.monotonic() + 60
    while client.post(f"{prefix}/v1/search", json={"question": "harbor", "deadline_s": 1}
                      ).status_code != 504:
        assert not held.done(), held.result().text
        assert time.monotonic() < deadline, "no search holds the searcher"
        time.sleep(0.2)


def test_readyz_answers_from_the_board_while_long_searches_fill_the_searcher_queue(serve_app,
                                                                                   tmp_path):
    """The searcher replica takes one search and queues one, and both hold it for their 20 s
    deadline (their index's backend takes connections and never answers): its Serve queue is
    full for as long. /readyz and GET /v1/indexes went through that queue, and each ingress
    replica answered them from the searcher's last answer; an application that nobody had
    probed before the burst (a replica just started, a balancer's first probe) had none, so
    /readyz answered 503 `not_ready` and the index list 503 `overloaded` for a searcher that is
    up and healthy. The searcher now publishes its readiness and index list on the
    application's board, and the ingress answers both from it, never through that queue."""
    client, _ = serve_app
    with _app_over_a_hung_backend(tmp_path, "full", searcher_max_ongoing=1,
                                  searcher_max_queued=1):
        with cf.ThreadPoolExecutor(2) as pool:
            hung = {"question": "harbor", "index": "hole", "deadline_s": 20}
            running = pool.submit(client.post, "/full/v1/search", json=hung)
            _until_the_searcher_is_held(client, "/full", running)
            queued = pool.submit(client.post, "/full/v1/search", json=hung)
            deadline = time.monotonic() + 30
            while True:  # the queue is full once a third search is refused
                r = client.post("/full/v1/search", json={"question": "harbor", "deadline_s": 1})
                if r.status_code == 503 and r.json()["error"] == "overloaded":
                    break
                assert time.monotonic() < deadline, r.text
            probe = client.get("/full/readyz", timeout=30)
            listed = client.get("/full/v1/indexes", timeout=30)
            assert not running.done() and not queued.done()  # (still full)
        assert probe.status_code == 200, probe.text
        assert probe.json()["status"] == "ready" and probe.json()["indexes"] == 2, probe.text
        assert listed.status_code == 200, listed.text
        assert listed.json() == {"indexes": ["bm", "hole"]}


def test_metrics_answer_at_once_while_a_long_search_holds_the_searcher(serve_app, tmp_path):
    """A load tester scrapes /metrics while the service is saturated. The scrape asked the
    searcher replica for the ACL guard's count through the searches' Serve queue, with no
    bound: behind a search that holds the searcher (its backend takes connections and never
    answers) it waited for that search's end, ~18 s, and meanwhile held the queue's one place,
    so a search that came then was refused 503 `overloaded`. The searcher now posts the
    count on the application's readiness board with its readiness, and the ingress answers
    the scrape from there, never through that queue."""
    client, _ = serve_app
    with _app_over_a_hung_backend(tmp_path, "scraped", searcher_max_ongoing=1,
                                  searcher_max_queued=1):
        with cf.ThreadPoolExecutor(2) as pool:
            blocker = pool.submit(client.post, "/scraped/v1/search", json={
                "question": "harbor", "index": "hole", "deadline_s": 20})
            _until_the_searcher_is_held(client, "/scraped", blocker)
            began = time.monotonic()
            scrape = pool.submit(client.get, "/scraped/metrics", timeout=30)
            time.sleep(0.5)  # (the old scrape is in the searcher's queue by now)
            queued = client.post("/scraped/v1/search",
                                 json={"question": "harbor", "deadline_s": 2})
            scraped = scrape.result()
            took = time.monotonic() - began
            held = not blocker.done()
    assert scraped.status_code == 200, scraped.text
    assert took < 5, took  # (the old wait: the holding search's end)
    assert held  # (the searcher was held throughout)
    for family in ("branchsearch_http_requests_total", "branchsearch_searches_total",
                   "branchsearch_http_requests_in_flight", "branchsearch_acl_guard_dropped_ids"):
        assert f"# TYPE {family.removesuffix('_total')}" in scraped.text, family
    assert "branchsearch_acl_guard_dropped_ids 0.0" in scraped.text, scraped.text
    # the queue's one place was the search's, not the scrape's: it waited there for its 504
    assert queued.status_code == 504 and queued.json()["error"] == "deadline_exceeded", \
        queued.text


def test_a_search_queued_behind_a_busy_searcher_gets_its_504_by_its_deadline(serve_app,
                                                                              tmp_path):
    """The searcher replica takes one search at a time and queues one (`searcher_max_ongoing`,
    `searcher_max_queued`), and a search holds it for its 20 s deadline (its index's backend
    takes connections and never answers). A search with a 2 s deadline queued behind it in
    Serve waited there until the first ended, ~19 s, for its 504: on a starved CPU callers got
    their 504s 25-30 s after asking with a 20 s deadline. The ingress now waits on the searcher
    only until the deadline (and the searcher's 2 s grace past it): a 504 `deadline_exceeded`
    in JSON, also to a caller that asked for a stream (no event came). Its call is cancelled
    in Serve's queue, whose one place the next such search then takes (not 503 `overloaded`)."""
    client, _ = serve_app
    with _app_over_a_hung_backend(tmp_path, "busy", searcher_max_ongoing=1,
                                  searcher_max_queued=1):
        with cf.ThreadPoolExecutor(1) as pool:
            blocker = pool.submit(client.post, "/busy/v1/search", json={
                "question": "harbor", "index": "hole", "deadline_s": 20})
            _until_the_searcher_is_held(client, "/busy", blocker)
            answers = []
            for accept in ("application/json", "text/event-stream", "application/json"):
                began = time.monotonic()
                r = client.post("/busy/v1/search", json={"question": "harbor", "deadline_s": 2},
                                headers={"Accept": accept})
                answers.append((r, time.monotonic() - began))
            first = blocker.result()
        assert first.status_code == 503 and first.json()["error"] == "index_starting", first.text
        for r, took in answers:
            assert r.status_code == 504, (r.status_code, r.text, took)
            assert r.headers["content-type"] == "application/json", r.headers
            assert r.json()["error"] == "deadline_exceeded", r.text
            assert took < 2 + 2 + 3, (took, r.text)  # (the old wait: the first's end, ~19 s)


def test_the_load_test_counts_every_replicas_searches_from_metrics(serve_app):
    """`branchsearch loadtest` against Serve reads /metrics before and after each step; the
    replica a scrape reaches adds the other's counts as last shared (every 2 s), so a scrape
    right at the step's end missed the other replica's last searches (4-7 of 40-120 a step on
    2 replicas). Read once they are in, the service's count is the load test's."""
    from branchsearch.orchestrator.loadtest import arrivals
    from branchsearch.orchestrator.loadtest.generator import Generator, LoadSpec
    from branchsearch.orchestrator.loadtest.probes import StepProbe, metrics_settle_s
    from branchsearch.orchestrator.loadtest.targets import HttpTarget
    from branchsearch.orchestrator.loadtest.workload import Workload

    client, keys = serve_app
    target = HttpTarget(str(client.base_url), keys["alpha"], branches=1)
    time.sleep(metrics_settle_s())  # earlier tests' searches all counted before the step
    spec = LoadSpec("closed", (arrivals.Step(1, 4.0),), drain_s=60.0, warmup=0)
    out = Generator(target, Workload(["Alpha budget harbor sensors", "Old Lighthouse cape"]),
                    spec, probe=lambda: StepProbe(None, lambda: target.get("/metrics"))).run()
    step = out["steps"][0]
    assert step["ok"] == step["sent"] >= 4, step["errors"]
    probes = step["probes"]
    counted = sum(rate for name, rate in probes["service_metrics"].items()
                  if name.startswith("branchsearch_searches_total"))
    assert round(counted * probes["service_metrics_window_s"]) == step["sent"], probes


def test_a_keys_429_under_serve_gives_the_queue_the_replica_cut(serve_app, tmp_path):
    """Under Ray Serve a searcher replica cuts a key's per_key_queue (`for_replica`: here 16
    to 1, with 1 slot a key and 4 searches a replica). A key's 429 body gives the cut limit
    as data, with why it was refused and the key's counts (the fields cross the Serve handle
    with the refusal), as `serve --standalone` does."""
    import threading

    client, _ = serve_app
    answers = []

    def search(index, deadline_s):
        answers.append(client.post("/keyq/v1/search", json={
            "question": "harbor", "index": index, "deadline_s": deadline_s}))

    with _app_over_a_hung_backend(tmp_path, "keyq", searcher_max_ongoing=4,
                                  searcher_max_queued=4,
                                  limits={"per_key_concurrency": 1}) as hole:
        threading.Thread(target=search, args=("hole", 20), daemon=True).start()
        hole.settimeout(60)
        held, _ = hole.accept()  # the key's one slot is taken (or a readiness probe's: the
        # loop below waits for the refusal itself); kept open, as a closed one ends its search
        deadline = time.monotonic() + 60
        while True:  # until a waiter holds the queue's one place and a probe is refused for it
            if not any(t.name == "waiter" and t.is_alive() for t in threading.enumerate()):
                # the first waiter, or another after a probe held the queue's place when the
                # last one came (that waiter was the one refused, and the probe's 429 is not it)
                threading.Thread(target=search, args=("bm", 20), name="waiter",
                                 daemon=True).start()
                time.sleep(0.5)
            r = client.post("/keyq/v1/search", json={"question": "harbor", "deadline_s": 0.5})
            if r.status_code == 429 and r.json()["reason"] == "queue_full":
                break
            assert time.monotonic() < deadline, (r.status_code, r.text)
        body = r.json()
        assert {k: v for k, v in body.items() if k != "detail"} == {
            "error": "too_many_requests", "reason": "queue_full", "running": 1, "waiting": 1,
            "limits": {"per_key_concurrency": 1, "per_key_queue": 1}}, body
        assert "the limits are 1 and 1 (per_key_queue)" in body["detail"], body
        assert r.headers["retry-after"] == "1"
        held.close()


def test_probes_answer_at_once_while_searches_fill_every_place_the_searchers_have(serve_app,
                                                                                  tmp_path):
    """An operator gives the searcher room for more searches than 64 (`--max-searches`,
    `--max-queued`, or several searcher replicas on server backends), and a burst fills it:
    70 searches each held for its 15 s deadline (their index's backend takes connections and
    never answers). The ingress replica served at most 64 requests at once, so /healthz and
    /metrics waited in Serve's queue in front of it until searches ended — a liveness probe
    with a 1 s timeout failed for as long. The ingress now has room for every search its
    searchers hold and `PROBE_ROOM` more (`deploy.ingress_room`)."""
    from branchsearch.orchestrator.service.deploy import PROBE_ROOM, ServeOptions, ingress_room

    assert ingress_room(ServeOptions()) == 64  # the defaults: one searcher, 16 + 32, and 16
    assert ingress_room(ServeOptions(searcher_replicas=2)) == 2 * 48 + PROBE_ROOM
    client, _ = serve_app
    held = 70
    with _app_over_a_hung_backend(tmp_path, "crowd", searcher_max_ongoing=40,
                                  searcher_max_queued=40,
                                  limits={"per_key_concurrency": held}), \
            httpx.Client(base_url=client.base_url, timeout=60,
                         limits=httpx.Limits(max_connections=held + 8)) as burst, \
            cf.ThreadPoolExecutor(held) as pool:
        assert client.get("/crowd/healthz").status_code == 200
        searches = [pool.submit(burst.post, "/crowd/v1/search",
                                json={"question": "harbor", "index": "hole", "deadline_s": 15})
                    for _ in range(held)]
        time.sleep(4)  # every search has reached the ingress and waits on the searcher
        running = sum(not s.done() for s in searches)
        began = time.monotonic()
        health = client.get("/crowd/healthz", timeout=30)
        health_s = time.monotonic() - began
        scrape = client.get("/crowd/metrics", timeout=30)
        took = time.monotonic() - began
        answers = [s.result() for s in searches]
    assert running == held, f"only {running} searches held: the test shows nothing"
    assert health_s < 3 and took < 5, (health_s, took)  # (the old wait: the searches' 15 s)
    assert health.status_code == 200 and scrape.status_code == 200, (health.text, scrape.text)
    assert {r.status_code for r in answers} <= {503, 504}, {r.status_code for r in answers}
    assert all(r.headers["content-type"].startswith("application/json") for r in answers)


def test_a_search_stuck_past_its_deadline_frees_its_keys_slot_with_its_504(serve_app,
                                                                           tmp_path):
    """A key with one slot and no queue searches an index whose Elasticsearch stops answering
    (SIGSTOP: connections taken, nothing answered; the search's thread waits out the backend's
    timeout, 30 s). The search is answered 504 at its 3 s deadline, and its caller searches
    another index at once. The search's thread held the key's slot until the backend's
    timeout, long past that 504, so the key's next search was refused 429 `no_queue` (on a
    two-node cluster that lost its worker, 30-90 s past the 504s, the thread waiting on a
    retriever actor that Ray could not place again). The 504 now frees the slot: the next
    search is answered 200 while the stuck thread still waits."""
    client, _ = serve_app
    with _app_over_an_es(client, tmp_path, "stuck",
                         {"per_key_concurrency": 1, "per_key_queue": 0}) as es, _frozen(es):
        began = time.monotonic()
        late = client.post("/stuck/v1/search", json=STUCK)
        took = time.monotonic() - began
        assert late.status_code == 504, late.text
        assert late.json()["error"] == "deadline_exceeded", late.text
        assert took < 3 + 2 + 3, took
        after = client.post("/stuck/v1/search",
                            json={"question": "harbor festival", "deadline_s": 10})
        assert after.status_code == 200, after.text  # (before: 429 no_queue)
        assert after.json()["evidence"], after.text
        assert time.monotonic() - began < 25  # (the stuck thread waits 30 s)


def test_searches_stuck_past_their_deadline_are_counted_and_named_in_the_503(serve_app,
                                                                             tmp_path):
    """A server of `max_in_flight` 2 whose Elasticsearch stops answering (SIGSTOP): two
    searches of it are answered 504 at their deadline while their threads wait on it, each
    keeping its place in the server's count. The next search, of another index, was refused
    503 `overloaded` "2 requests in flight; the server takes 2" — plain load, as far as its
    caller and the operator could tell, and /metrics had no figure for them. Now the 503 says
    both are past their deadline and waiting on a backend (and `past_deadline` 2 as a field),
    and `branchsearch_searches_past_deadline` is 2, back to 0 once the backend answers again
    (SIGCONT) and the threads end."""
    client, _ = serve_app
    limits = {"max_in_flight": 2, "per_key_concurrency": 2, "per_key_queue": 0}
    with _app_over_an_es(client, tmp_path, "full", limits) as es:
        assert _past_deadline(client, "/full") == 0
        with _frozen(es), cf.ThreadPoolExecutor(2) as pool:
            late = list(pool.map(lambda _: client.post("/full/v1/search", json=STUCK),
                                 range(2)))
            assert [r.status_code for r in late] == [504, 504], [r.text for r in late]
            refused = client.post("/full/v1/search",
                                  json={"question": "harbor festival", "deadline_s": 10})
            assert refused.status_code == 503, refused.text
            body = refused.json()
            assert (body["error"], body["reason"], body["in_use"], body["past_deadline"]) == (
                "overloaded", "max_in_flight", 2, 2), body
            assert body["detail"] == ("2 requests in flight (2 of them past the deadline, "
                                      "answered 504 and still waiting on a backend); the "
                                      "server takes 2"), body
            _until(lambda: _past_deadline(client, "/full") == 2, "the gauge never read 2")
        _until(lambda: _past_deadline(client, "/full") == 0, "the gauge stayed above 0")
        after = client.post("/full/v1/search", json=STUCK)
        assert after.status_code == 200, after.text


STUCK = {"question": "harbor festival", "index": "es", "deadline_s": 3}


@contextlib.contextmanager
def _app_over_an_es(client, tmp_path, name: str, limits: dict):
    """Application `name` at `/name` with `limits`, on the bm home and a second index `es` on
    an Elasticsearch emulator (BM25 only), opened by a first search; yields the emulator."""
    from ray import serve

    from es_emulator import start_es_emulator

    from branchsearch.orchestrator.service.deploy import ServeOptions, build_application

    with start_es_emulator(tmp_path / "es") as es:
        home = bm_home(tmp_path / name)
        ingest(write_corpus(tmp_path / "es.jsonl"), load_settings(
            overrides={"home": home, "index": "es", "es_url": es.url}, read_env=False,
            read_file=False), dense=False)
        config = home / "branchsearch.toml"
        config.write_text(f'es_url = "{es.url}"\nsearch_mode = "bm25"\n')
        serve.run(build_application(ServeOptions(
            home=str(home), index="bm", config=str(config), executor="local", limits=limits)),
            name=name, route_prefix=f"/{name}")
        try:
            r = client.post(f"/{name}/v1/search", json={**STUCK, "deadline_s": 60})
            assert r.status_code == 200 and r.json()["evidence"], r.text  # (the index open)
            yield es
        finally:
            serve.delete(name)


@contextlib.contextmanager
def _frozen(es):
    """The emulator stopped (SIGSTOP: it takes connections and answers nothing) for the block."""
    import os
    import signal

    os.killpg(es.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(es.pid, signal.SIGCONT)


def _past_deadline(client, prefix: str) -> float:
    import re

    text = client.get(f"{prefix}/metrics").text
    return float(re.search(r"^branchsearch_searches_past_deadline (\S+)$", text, re.M)[1])


def _until(check, failure: str, within_s: float = 30) -> None:
    """Returns once `check()` is true (the readiness board posts every 2 s)."""
    end = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < end, failure
        time.sleep(0.5)
