"""Running the service: standalone (uvicorn in this process) or on Ray Serve (the builder).

Either way Ray is connected once, from the main thread, before any request or start thread (a
cluster started from a thread that later ends dies with it), and one `Searcher` serves every
index. Serve deploys the plain `Searcher` class as is, behind an ingress that holds the FastAPI
app; standalone runs both in this process. SIGTERM drains: requests in flight, streams
included, finish within the grace period, the last line says it stopped and why, and the
process exits 0; ^C stops it the same way and ends as every command's: `interrupted`, 130.

Ray Serve users deploy it with `serve run deploy/serve_config.yaml` (see README, "Service"), or
`serve run branchsearch.orchestrator.service.deploy:app_builder home=… keys=…`.
"""

from __future__ import annotations

import ipaddress
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from branchsearch.infra.errors import BranchsearchError, error_line, redact
from branchsearch.orchestrator.service.admission import Limits, for_replica
from branchsearch.orchestrator.service.app import SearcherClient, ServiceState, create_app
from branchsearch.orchestrator.service.auth import KeyStore
from branchsearch.orchestrator.service.board import (BOARD_NAMESPACE, BoardReader, Publisher,
                                                     readiness_board)
from branchsearch.orchestrator.service.errors import ApiError

log = logging.getLogger("branchsearch.service")
GRACE_S = 30  # SIGTERM: how long requests in flight may take to finish


def check_host(host: str, keys_path: str | Path | None) -> None:
    """Without a keys file the service is a development server: loopback only."""
    if keys_path:
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        raise BranchsearchError(
            f"refusing to listen on {host} without API keys: with no --keys file every caller "
            "is an admin who sees every document (development mode, loopback only). Make keys "
            "with `branchsearch keys add NAME --groups G --keys FILE` and pass --keys FILE")


def dev_mode_banner(host: str, port: int) -> str:
    return (f"development mode: no --keys file, so every request is an admin that sees every "
            f"document; listening on loopback only (http://{host}:{port})")


def listen(host: str, port: int):
    """A listening socket on host:port (port 0: a free one), or one error line saying why not."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        import errno

        sock.close()
        hint = ("pick another --port or stop what holds it" if exc.errno == errno.EADDRINUSE
                else "check --host (an address of this machine) and --port")
        raise BranchsearchError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); "
                                f"{hint}") from None
    return sock


# --- standalone: uvicorn ------------------------------------------------------------------------

def local_state(settings, *, executor: str = "local", keys_path=None,
                limits: Limits = Limits(), driver_factory=None,
                default_index: bool = True) -> ServiceState:
    """The app's state with the Searcher in this process (`default_index`: as the Searcher's).
    With the Ray executor, connect to Ray here — call this from the main thread."""
    from branchsearch.orchestrator.service.searcher import Searcher

    if executor == "ray":
        from branchsearch.infra.raycluster import connect

        connect(settings)
    searcher = Searcher(settings, executor=executor, limits=limits, driver_factory=driver_factory,
                        default_index=default_index)
    return ServiceState(SearcherClient(searcher), KeyStore(keys_path) if keys_path else None,
                        limits)


class StopRequest(BaseException):
    """SIGTERM arrived while `serve --standalone` was starting (not an error: it stops)."""


class Stopping:
    """SIGTERM as a clean stop from the moment `serve --standalone` starts, not only once
    uvicorn has put its own handler in place (the signal's default would kill the process,
    its searcher never closed; Ray's handler, installed when it connects, exits 15). While the
    service starts, SIGTERM interrupts the start (`StopRequest`), which then closes what it
    opened; once it is about to serve, SIGTERM is only noted (`asked`), and uvicorn stops at
    once if it was (`standalone_server`'s `stop_asked`). uvicorn re-raises the SIGTERM it
    drained on under the handler it found: this one, which makes that a clean exit too."""

    def __init__(self):
        self.asked, self.starting = False, True
        self.install()

    def install(self) -> None:
        import signal

        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        self.asked = True
        if self.starting:
            self.starting = False  # (raised once)
            raise StopRequest()

    def serving(self) -> None:
        """From here SIGTERM is noted, not raised (uvicorn starts; it reads `asked`)."""
        self.starting = False


def stopped(why: str) -> None:
    """The last line of a `serve` that SIGTERM stopped: a supervisor's log says it ended, and
    why, after its drain."""
    print(f"stopped (SIGTERM): {why}", file=sys.stderr)


def run_standalone(settings, *, executor: str, keys, sock, default_index: bool = True) -> None:
    """uvicorn on `sock` until SIGTERM or ^C (uvicorn drains in-flight requests, then exits).
    SIGTERM before it serves stops it as cleanly: what it opened is closed, exit 0.
    `default_index` False: no default index (`Searcher`)."""
    _log_to_stderr()
    stopping, state, served = Stopping(), None, False
    try:
        state = local_state(settings, executor=executor, keys_path=keys,
                            limits=Limits.of(settings), default_index=default_index)
        stopping.install()  # again: connecting to Ray put Ray's own handler in its place
        if stopping.asked:
            raise StopRequest()
        state.searcher.target.open_default()  # load models before taking traffic
        stopping.serving()
        if stopping.asked:
            raise StopRequest()
        print(serving_line(sock.getsockname()[:2], settings, executor), file=sys.stderr)
        server = standalone_server(create_app(state), state,
                                   stop_asked=lambda: stopping.asked)
        served = True
        server.run(sockets=[sock])
    except StopRequest:
        pass
    finally:
        stopping.serving()  # a SIGTERM while it closes is noted, not raised into the close
        sock.close()
        if state is not None:
            state.searcher.target.close()
    if stopping.asked:
        stopped("requests in flight drained, every index closed" if served else
                "before it served; what it had opened is closed")


def serving_line(where: tuple, settings, executor: str) -> str:
    """What `serve --standalone` says once it takes traffic: where, and where the branches run
    (in this process with the local executor; on Ray actors with the ray executor)."""
    import os

    host, port = where
    if executor == "ray":
        address = settings.ray_address or os.environ.get("RAY_ADDRESS")
        cluster = f"the cluster at {address}" if address else "a local cluster started here"
        runs = f"the service in this process, its branches on Ray actors ({cluster})"
    else:
        runs = "one process: the service and its branches"
    return f"serving on http://{host}:{port} (docs at /docs; {runs})"


def standalone_server(app, state: ServiceState, grace_s: float = GRACE_S,
                      stop_asked: Callable[[], bool] | None = None, **config):
    """uvicorn for `app`: on SIGTERM (or `should_exit`) it stops taking connections and lets
    requests in flight run for `grace_s`, then cancels those still running. `state.draining`
    is set first, and `state.cut_off` just before that cancellation, so such a request is
    answered 503 `shutting_down` in JSON (`app.Observe`), not with uvicorn's plain 500 and a
    traceback in the log, and a request whose client left meanwhile is still counted 499.
    `stop_asked()` true once uvicorn's signal handling is in place (a SIGTERM that came just
    before, which uvicorn never saw): it stops as it would on SIGTERM."""
    import asyncio

    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if stop_asked is not None and stop_asked():
                self.should_exit = True

        async def shutdown(self, sockets=None):
            state.draining = True
            # uvicorn's own `grace_s` starts a moment later (after it closes the listeners),
            # so this runs before it cancels anything
            cut = asyncio.get_running_loop().call_later(grace_s, setattr, state, "cut_off",
                                                        True)
            try:
                await super().shutdown(sockets)
            finally:
                cut.cancel()

    return Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=grace_s,
                                 **{"http": json_400_protocol(), **config}))


UNPARSED = ApiError(400, "bad_request", "not a valid HTTP/1.1 request: a malformed request "
                    "line or header (a path and query must be ASCII: percent-encode other "
                    "bytes, as %C3%A9 for é)")


def json_400_protocol() -> type:
    """uvicorn's HTTP protocol (httptools, else h11) whose answer to a request it cannot parse
    (a raw non-ASCII byte in the target, a malformed request line or header) is the service's
    JSON error body, not uvicorn's plain text: such a request never reaches the app."""
    from starlette.responses import JSONResponse
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    body = JSONResponse(UNPARSED.body()).body  # as the app renders its errors
    head = (b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n" % len(body))

    class Protocol(AutoHTTPProtocol):
        def send_400_response(self, msg: str) -> None:
            default = b"".join(b"%s: %s\r\n" % pair
                               for pair in self.server_state.default_headers)
            self.transport.write(head + default + b"\r\n" + body)
            self.transport.close()

    return Protocol


def _log_to_stderr() -> None:
    """The service's own log lines (an index retired or closed when idle, a backend down, why
    /readyz answers 503) on stderr with their time, INFO and up: with no handler, Python shows
    only warnings, without a time, and an operator never learns that an index was reopened."""
    service = logging.getLogger("branchsearch.service")
    if not service.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        service.addHandler(handler)
        service.setLevel(logging.INFO)
        service.propagate = False


# --- Ray Serve ----------------------------------------------------------------------------------


def _log_to_replica() -> None:
    """Under Ray Serve, the service's own log lines go where Serve's docs send an operator: the
    replica's log (logs/serve/replica_*.log), beside Serve's lines for the same requests, at
    INFO and up. Without this they went to the Ray worker's stderr file alone."""
    serve_log, service = logging.getLogger("ray.serve"), logging.getLogger("branchsearch.service")
    if serve_log.handlers and not service.handlers:
        for handler in serve_log.handlers:
            service.addHandler(handler)
        service.setLevel(logging.INFO)
        service.propagate = False

class MetricsBoard:
    """The application's metrics board (a Ray actor): each ingress replica's latest snapshot,
    so a scrape that reaches any one replica answers for all. A replica gone keeps its last
    counts while the board lives (counters do not go down); the board is owned by the replica
    that made it, and made anew, empty, if that one goes."""

    def __init__(self):
        self.snapshots: dict[str, tuple[float, list]] = {}
        self.draining = False

    def share(self, replica: str, snapshot: list) -> tuple[bool, list[tuple[float, list]]]:
        """Keep `replica`'s snapshot; whether the application is stopping, and the others'
        snapshots, each with its age in seconds."""
        now = time.monotonic()
        self.snapshots[replica] = (now, snapshot)
        return self.draining, [(now - t, s) for r, (t, s) in self.snapshots.items()
                               if r != replica]

    def drain(self) -> None:
        """The application is stopping: each replica learns it at its next push."""
        self.draining = True

    def in_flight(self, since: float) -> int | None:
        """HTTP requests in flight over the replicas, from snapshots younger than `since`
        seconds; None while some replica's is older (not heard from since the drain began;
        one silent for `SharedMetrics.STALE_S` is gone, and left out)."""
        now, total = time.monotonic(), 0
        for t, snapshot in self.snapshots.values():
            if now - t > SharedMetrics.STALE_S:  # a replica gone (replaced, its node lost)
                continue
            if now - t > since:
                return None
            total += sum(int(value) for name, _, _, samples in snapshot
                         if name == "branchsearch_http_requests_in_flight"
                         for _, _, value in samples)
        return total


class SharedMetrics:
    """An ingress replica's side of the board: its snapshot shared every `PUSH_S` seconds (a
    daemon thread) and at each scrape, which gets the other replicas' back. The board is a
    named actor of the application, made by the first replica that asks (again when it died
    with its owner)."""

    PUSH_S = 2.0
    STALE_S = 30.0

    def __init__(self, metrics, name: str, replica: str, on_drain=None):
        """`on_drain()`: called once the board says the application is stopping."""
        self.metrics, self.name, self.replica, self.on_drain = metrics, name, replica, on_drain
        self._handle = None
        threading.Thread(target=self._push, daemon=True, name="metrics-board").start()

    def _board(self):
        if self._handle is None:
            import ray

            self._handle = ray.remote(MetricsBoard).options(
                name=self.name, namespace=BOARD_NAMESPACE, get_if_exists=True,
                num_cpus=0).remote()
        return self._handle

    def _push(self) -> None:
        import ray

        while True:
            time.sleep(self.PUSH_S)
            try:
                draining, _ = ray.get(self._board().share.remote(
                    self.replica, self.metrics.snapshot()), timeout=30)
            except Exception as exc:  # noqa: BLE001 — the board died with its owner: anew
                log.debug("metrics board: %s", exc)
                self._handle = None
                continue
            if draining and self.on_drain is not None:
                self.on_drain()

    async def others(self) -> list:
        """The other replicas' snapshots; a replica silent for `STALE_S` (gone) adds its
        counts but no gauges (its requests in flight ended with it). [] when the board does
        not answer within 2 s: this replica's own counts still answer the scrape."""
        import asyncio

        try:
            _, shared = await asyncio.wait_for(
                self._board().share.remote(self.replica, self.metrics.snapshot()), 2.0)
        except Exception as exc:  # noqa: BLE001 — a board on a node that died, say
            log.warning("metrics board unreachable: %s", exc)
            self._handle = None
            return []
        return [snapshot if age < self.STALE_S else
                [family for family in snapshot if family[1] != "gauge"]
                for age, snapshot in shared]


@dataclass(frozen=True)
class ServeOptions:
    """What `branchsearch serve` and `app_builder` pass to the deployments."""

    home: str = ".branchsearch"
    index: str = "default"  # the default index; "": none (a search names its index)
    config: str | None = None
    keys: str | None = None
    executor: str = "ray"
    replicas: int = 1  # ingress replicas
    searcher_replicas: int = 1  # > 1 only with server backends (Milvus/ES by URL)
    # `serve` on a cluster (`placed_by_proxies`): the ingress replicas go where Serve's HTTP
    # proxies are ("EveryNode": at most one a node; "HeadOnly": on the head), and one searcher
    # replica on the head node; None: Serve places them
    proxies: str | None = None
    # per ingress replica (HTTP requests being served); None: `ingress_room`
    max_ongoing_requests: int | None = None
    max_queued_requests: int = 256  # per ingress replica; past it Serve's proxy answers 503
    searcher_max_ongoing: int = 16  # searches at once per searcher replica
    searcher_max_queued: int = 32  # waiting searches, then 503 {error: overloaded} (JSON)
    autoscaling: dict | None = None  # Serve's autoscaling_config for the ingress
    # logical CPUs per replica: small; the searcher plans its branch pool from what is free
    # once they are placed (Serve's default is 1 each)
    ingress_cpus: float = 0.05
    searcher_cpus: float = 0.1
    limits: dict = field(default_factory=dict)  # Limits fields


# requests an ingress replica serves beside the searches it waits on: probes, scrapes, the index
# list, the page, and the 429s and 503s being answered
PROBE_ROOM = 16


def ingress_room(opts: ServeOptions) -> int:
    """An ingress replica's `max_ongoing_requests` when none is given: every search the searcher
    replicas can hold (running and in their Serve queues) and `PROBE_ROOM` more. Load is
    bounded by the searchers' queues and the keys' limits, which answer JSON 503s and 429s;
    an ingress cap below them only queues requests in front of the application, where
    /healthz, /readyz and /metrics would wait behind searches (a liveness probe timing out
    in a burst) and no deadline runs. 64 with the defaults (one searcher replica)."""
    return opts.searcher_replicas * (opts.searcher_max_ongoing + opts.searcher_max_queued) \
        + PROBE_ROOM


def check_searcher_replicas(settings, replicas: int) -> None:
    """Several searcher replicas only over server backends: each replica opens every index of
    the home itself, and an index whose dense side is a Milvus Lite file has one owning process
    (`IndexProfile.lite_file`, the rule retriever replicas follow); BranchsearchError naming
    the first such index and the fix."""
    from branchsearch.infra.index.catalog import index_names
    from branchsearch.infra.index.profile import index_profile

    if replicas < 1:
        raise BranchsearchError(f"searcher_replicas = {replicas}: it must be at least 1")
    if replicas == 1:
        return
    for name in index_names(settings):
        lite = index_profile(settings.replace(index=name)).lite_file
        if lite:
            raise BranchsearchError(
                f"searcher_replicas = {replicas}: index {name!r} keeps its vectors in a Milvus "
                "Lite file, which one process owns, and each searcher replica opens it; "
                "several searcher replicas need server backends (milvus_uri, es_url): serve "
                "with one searcher replica, or ingest the index into a Milvus server")


def build_application(opts: ServeOptions):
    """The Serve application (Ingress → Searcher); `serve.run` or `serve deploy` it."""
    from ray import serve

    from branchsearch.orchestrator.service.searcher import Searcher

    @serve.deployment(name="Ingress")
    @serve.ingress()
    class Ingress:
        def __init__(self, searcher, o: dict):
            context = serve.get_replica_context()
            client = SearcherClient(searcher, o["searcher_max_queued"],
                                    BoardReader(readiness_board(context.app_name)))
            self.state = ServiceState(client, KeyStore(o["keys"]) if o["keys"] else None,
                                      Limits(**o["limits"]))
            self.state.peers = SharedMetrics(self.state.metrics, board_name(context.app_name),
                                             context.replica_tag, on_drain=self._drain)

        def _drain(self):
            self.state.draining = True

        def __serve_build_asgi_app__(self):
            return create_app(self.state)

    from branchsearch.infra.config.settings import load_settings

    o = asdict(opts)
    settings = load_settings(opts.config, {"home": opts.home}
                             | ({"index": opts.index} if opts.index else {}))
    check_searcher_replicas(settings, opts.searcher_replicas)
    limits = Limits.of(settings, **opts.limits)  # the config's `limits` over the settings'
    queue = limits.per_key_queue
    limits = for_replica(limits, opts.searcher_max_ongoing)
    if limits.per_key_queue < queue:
        log.info("per_key_queue %d cut to %d: a key's searches in flight and waiting take at "
                 "most half of a searcher replica's %d (searcher_max_ongoing)", queue,
                 limits.per_key_queue, opts.searcher_max_ongoing)
    o["limits"] = asdict(limits)
    grace = {"graceful_shutdown_timeout_s": GRACE_S, "graceful_shutdown_wait_loop_s": 0.5}
    ingress_cfg = {"max_ongoing_requests": opts.max_ongoing_requests or ingress_room(opts),
                   "max_queued_requests": opts.max_queued_requests,
                   "ray_actor_options": {"num_cpus": opts.ingress_cpus}} | grace
    ingress_cfg |= ({"autoscaling_config": opts.autoscaling} if opts.autoscaling
                    else {"num_replicas": opts.replicas})
    searcher_actor = {"num_cpus": opts.searcher_cpus}
    if opts.proxies == "EveryNode":
        ingress_cfg["max_replicas_per_node"] = 1
    elif opts.proxies == "HeadOnly":
        ingress_cfg["ray_actor_options"]["resources"] = {HEAD_NODE: 0.001}
    if opts.proxies and opts.searcher_replicas == 1:
        searcher_actor["resources"] = {HEAD_NODE: 0.001}
    class ReplicaSearcher(Searcher):
        def __init__(self, *args, **kwargs):
            _log_to_replica()
            super().__init__(*args, **kwargs)
            self._serving = True
            context = serve.get_replica_context()  # what /readyz and the index list answer
            self._publisher = Publisher(self, readiness_board(context.app_name),
                                        context.replica_tag)

        def __del__(self):
            """Serve calls this once the replica has drained (its graceful shutdown), before
            it stops the replica's process: take its answers off the readiness board, close
            every index (its stores, Milvus Lite server and retriever actors) and the branch
            pool, as `serve --standalone` does on exit.
            Python calls it again when it collects the object: once is enough."""
            if not self.__dict__.pop("_serving", False):
                return
            self._publisher.stop()
            try:
                self.close()
            except Exception as exc:  # noqa: BLE001 — the replica stops either way
                log.warning("searcher replica: closing failed: %s", error_line(exc, 300))
            else:
                log.info("searcher replica stopped: its indexes and branch pool are closed")

    searcher = serve.deployment(ReplicaSearcher, name="Searcher").options(
        num_replicas=opts.searcher_replicas, max_ongoing_requests=opts.searcher_max_ongoing,
        max_queued_requests=opts.searcher_max_queued,
        ray_actor_options=searcher_actor, **grace).bind(
        settings, executor=opts.executor, limits=limits, warm=True,
        default_index=bool(opts.index))
    return Ingress.options(**ingress_cfg).bind(searcher, o)


def proxy_location(host: str) -> str:
    """Where Serve runs its HTTP proxies: on every node when they listen on every address (or
    on loopback, which every node has); on the head only for one address, which no other node
    has (their proxies would fail to bind it, and be restarted over and over)."""
    try:
        everywhere = host in ("0.0.0.0", "::", "") or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: one machine's, but for localhost
        everywhere = host == "localhost"
    return "EveryNode" if everywhere else "HeadOnly"


HEAD_NODE = "node:__internal_head__"  # Ray's resource that only the head node has


def check_head_port(settings, host: str, port: int) -> None:
    """Joining a cluster (`serve --address`), whether Serve's HTTP proxy can listen on
    host:port on the head node, where `serve.start` starts the proxy it waits for: asked by a
    task there before Serve starts, so a port in use is `listen`'s one line, not the
    traceback of a proxy that failed to bind, after a Serve controller was left on the
    cluster. Not asked when Serve already runs there (its proxies hold their ports, and
    `serve.start` joins it), nor when the task fails or has not run within a minute. Serve
    running there on another host or port is one line naming theirs: `serve.start` would
    join it there, and keep none of ours."""
    import ray
    from ray import serve
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from branchsearch.infra.raycluster import connect

    connect(settings)
    if serve.status().proxies:
        from ray.serve.context import _get_global_client

        check_not_declared(APP)  # said before its port: serving there would replace it
        http = _get_global_client().http_config
        if (http.host, http.port) != (host, port):
            raise BranchsearchError(
                f"Ray Serve already runs on this cluster, its proxies on {http.host}:"
                f"{http.port}, and keeps them: serve there (--host {http.host} --port "
                f"{http.port}), or stop that Serve first (`serve shutdown`)")
        return
    head = next((n["NodeID"] for n in ray.nodes()
                 if n["Alive"] and HEAD_NODE in n["Resources"]), None)
    if head is None:
        return
    task = ray.remote(num_cpus=0, max_retries=0)(_port_problem).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False))
    try:
        problem = ray.get(task.remote(host, port), timeout=60)
    except ray.exceptions.RayError:  # (GetTimeoutError too)
        return
    if problem:
        raise BranchsearchError(problem)


def _port_problem(host: str, port: int) -> str | None:
    """Why this node cannot listen on host:port (`listen`'s line), or None."""
    try:
        listen(host, port).close()
    except BranchsearchError as exc:
        return str(exc)
    return None


def placed_by_proxies(opts: ServeOptions, location: str) -> ServeOptions:
    """`serve`'s placement (`--replicas` not given): an ingress replica on each node a proxy
    runs on (Serve's proxy routes to a replica on its own node when it has one), and the one
    searcher replica on the head. A request then needs only its proxy's node and the head,
    whose loss ends the cluster anyway; an ingress or searcher that Serve placed on another
    node would take every proxy's requests down with that node (docs/service.md, "On a
    cluster")."""
    import ray

    nodes = sum(1 for node in ray.nodes() if node["Alive"])
    return replace(opts, replicas=nodes if location == "EveryNode" else 1, proxies=location)


def run_serve(settings, opts: ServeOptions, host: str, port: int, *, block: bool = True):
    """Start Serve's HTTP proxy on host:port and deploy the application (blocks until SIGTERM
    or ^C unless `block` is False). Uses the settings' Ray cluster, else a local one, connected
    from this (the main) thread. `opts.replicas` 0: `placed_by_proxies`. A stop, also one
    before it serves, takes away what it put on the cluster: the application, and Serve itself
    unless Serve ran there before (others' applications go on)."""
    from ray import serve

    from branchsearch.infra.raycluster import connect

    connect(settings)
    import logging

    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # our line says where it serves
    owner = claim(APP)  # noqa: F841 — held while this process serves
    check_not_declared(APP)
    joined = bool(serve.status().proxies)  # Serve already runs there: it stays after us
    location = proxy_location(host)
    if not opts.replicas:
        opts = placed_by_proxies(opts, location)
    if block:
        import signal

        def stop(signum, frame):
            raise Terminated

        signal.signal(signal.SIGTERM, stop)  # `kill PID` stops it as ^C does: drain, then exit
    serving = False
    try:
        serve.start(http_options={"host": host, "port": port}, proxy_location=location)
        try:
            deploy_and_wait(build_application(opts))
        except RuntimeError:  # a replica that cannot start (the default index's backend
            failed = start_failure(APP)  # down): its reason, and nothing left behind
            if failed is None:
                raise
            serve.delete(APP)
            if not joined:
                serve.shutdown()
            raise BranchsearchError(f"the service did not start: {failed}") from None
        print(f"serving on http://{host}:{port} (docs at /docs; Ray Serve app '{APP}')",
              file=sys.stderr)
        serving = True
        if not block:
            return
        while True:
            time.sleep(3600)
    except KeyboardInterrupt as exc:  # ^C, or SIGTERM (`Terminated`)
        done = _stop_serve(serving, joined)
        if not isinstance(exc, Terminated):
            raise  # as every command's ^C: `interrupted`, exit status 130
        stopped(done)


class Terminated(KeyboardInterrupt):
    """SIGTERM while `serve` (Ray Serve) runs: the stop ^C makes, ending with exit 0."""


def _stop_serve(serving: bool, joined: bool) -> str:
    """Take what `run_serve` put on the cluster away (`serving`: after its `serving on`;
    `joined`: Serve ran there before it, and stays); what it did, in words."""
    from ray import serve

    try:
        over = declared(APP)  # a Serve config deployed over ours: the application is its
    except Exception:  # noqa: BLE001 — Serve's controller unreachable: stop as before
        over = False
    if over:
        print(f"stopping: the application '{APP}' was since deployed from a Serve "
              "config; leaving it, and Serve, running", file=sys.stderr)
        return f"the application '{APP}' deployed from a Serve config left running"
    if serving:
        print(f"stopping: draining requests in flight (up to {GRACE_S} s)", file=sys.stderr)
    else:
        print("stopping before it served: taking the application off the cluster",
              file=sys.stderr)
    done = not serving or drained(APP)
    if joined or not done:  # (requests still running: each replica's graceful
        serve.delete(APP)  # shutdown lets them end)
    if not joined:
        serve.shutdown()
    return (("requests in flight drained; " if serving else "before it served; ")
            + f"the application '{APP}' taken off the cluster"
            + (", Serve left running for the others there" if joined else ", Serve shut down"))

APP = "branchsearch"  # the Serve application `serve` deploys


# how Serve's deployment message begins once a replica's constructor has raised (it retries
# it, and says so, before it gives the deployment up)
REPLICA_FAILED = "A replica failed to start with exception"


def deploy_and_wait(application, poll_s: float = 0.25) -> None:
    """Deploy `application` as `APP` and wait until it runs. A replica whose constructor
    raised (the default index's backend down, say) ends the wait at once, RuntimeError, its
    cause for `start_failure`: Serve would try it again twice, with back-off, each try as long
    as the backend's timeout, before it gave the deployment up (a minute and a half with a
    Milvus server down), and a start that failed for a cause the service knows fails again."""
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    try:  # Serve's own non-blocking deploy (private: checked on Ray 2.60)
        from ray.serve.api import _run
        _run(application, _blocking=False, name=APP, route_prefix="/")
    except (ImportError, TypeError):  # a Ray without it: the public, blocking deploy
        serve.run(application, name=APP, route_prefix="/")
    while True:
        status = serve.status().applications.get(APP)
        if status is not None:
            if status.status == ApplicationStatus.RUNNING:
                return
            if status.status == ApplicationStatus.DEPLOY_FAILED or start_failure(APP):
                raise RuntimeError(f"Deploying application {APP} failed: {status.message}")
        time.sleep(poll_s)


def start_failure(app: str) -> str | None:
    """Why `app` did not start: Serve gave it up (DEPLOY_FAILED), or a replica's constructor
    raised (Serve would retry it): the last line of the deployment's message, the error the
    constructor raised (a backend down, say), without its module path; None when it did not
    fail so."""
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    status = serve.status().applications.get(app)
    if status is None:
        return None
    for deployment in status.deployments.values():
        lines = deployment.message.strip().splitlines()
        if lines and (deployment.status == "DEPLOY_FAILED"
                      or lines[0].startswith(REPLICA_FAILED)):
            kind, _, text = lines[-1].partition(": ")
            return redact(text if text and " " not in kind else lines[-1])
    if status.status != ApplicationStatus.DEPLOY_FAILED:
        return None
    return status.message or None


class Owner:
    """Which `branchsearch serve` process serves the application (a named Ray actor)."""

    def __init__(self, who: str):
        self.who = who

    def name(self) -> str:
        return self.who


def claim(app: str):
    """Mark this process as the one `branchsearch serve` of `app` on the cluster: a named
    actor that dies with this process (kill -9 too: it is not detached), so a `serve` started
    after a crash takes the application over. While another live `serve` holds it, one line
    naming that process: `serve.run` would replace its application (its keys, its default
    index) under its callers, and either one's stop would take the other's down."""
    import os
    import socket

    import ray

    name = f"{app}-owner"
    try:
        return ray.remote(num_cpus=0)(Owner).options(name=name, namespace=BOARD_NAMESPACE).remote(
            f"pid {os.getpid()} on {socket.gethostname()}")
    except ValueError:  # the name is taken: that process still runs
        try:
            who = ray.get(ray.get_actor(name, namespace=BOARD_NAMESPACE).name.remote(),
                          timeout=10)
        except Exception:  # noqa: BLE001 — gone meanwhile, or slow: say it without
            who = "another process"
        raise BranchsearchError(
            f"another `branchsearch serve` ({who}) serves the application '{app}' on this "
            "cluster: one service serves every index of its home (ask it for the index), or "
            "stop that one first") from None


def declared(app: str) -> bool:
    """Whether `app` runs on the cluster deployed from a Serve config (`serve deploy CONFIG`,
    `serve run CONFIG`), not by `serve.run` (`branchsearch serve`): Serve's
    `ApplicationDetails.source`, read as `serve.status()` reads its details."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import APIType, ServeInstanceDetails

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:  # Serve does not run on the cluster
        return False
    details = ServeInstanceDetails(**client.get_serve_details()).applications.get(app)
    return details is not None and details.source == APIType.DECLARATIVE


def check_not_declared(app: str) -> None:
    """One line when `app` was deployed from a Serve config (`declared`): no `branchsearch
    serve` owns it (`claim`), and `serve.run` would replace it under its callers (its keys,
    its default index) and a stop would delete it. An application that `serve.run` deployed
    (a `branchsearch serve` killed with -9) is left to `claim`, which takes it over."""
    if declared(app):
        raise BranchsearchError(
            f"another deployment serves the application '{app}' on this cluster (deployed "
            "from a Serve config, not by `branchsearch serve`): `branchsearch serve` would "
            f"replace it under its callers; take it off with `serve delete {app}` first, or "
            "change that config")


def board_name(app: str) -> str:
    return f"{app}-metrics"


def drained(app: str) -> bool:
    """Drain the application before Serve stops it: its ingress replicas answer every new
    request (`/readyz` too) 503 `shutting_down` as they learn it (at their next metrics push,
    `SharedMetrics.PUSH_S`), and this waits until none has a request in flight, at most
    GRACE_S. Whether they all ended. (`serve.delete` alone takes the application's routes away
    at once: Serve's proxy then answers every new request a plain-text 404 "Path not found"
    while the replicas finish.)"""
    import ray

    try:
        board = ray.get_actor(board_name(app), namespace=BOARD_NAMESPACE)
        ray.get(board.drain.remote(), timeout=5)
    except Exception as exc:  # noqa: BLE001 — no board: no replica ever served a request
        log.info("drain: no metrics board (%s)", error_line(exc, 200))
        return True
    fresh = SharedMetrics.PUSH_S + 1.0
    time.sleep(fresh)  # every replica has pushed once since the drain began
    end = time.monotonic() + GRACE_S
    while time.monotonic() < end:
        try:
            busy = ray.get(board.in_flight.remote(fresh), timeout=5)
        except Exception:  # noqa: BLE001 — the board's replica died: Serve's drain then
            return False
        if busy == 0:
            return True
        time.sleep(0.5)
    return False


def app_builder(args: dict):
    """`serve run branchsearch.orchestrator.service.deploy:app_builder home=… keys=…` and the
    `import_path` of a Serve config file; `args` are `ServeOptions` fields."""
    known = ServeOptions.__dataclass_fields__
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise ValueError(f"unknown serve args {unknown}; known: {sorted(known)}")
    casts = {k: int for k in ("replicas", "searcher_replicas", "max_ongoing_requests",
                              "max_queued_requests", "searcher_max_ongoing",
                              "searcher_max_queued")} | {"ingress_cpus": float,
                                                         "searcher_cpus": float}
    opts = ServeOptions(**{k: casts.get(k, lambda v: v)(v) for k, v in args.items()})
    if opts.keys is None:
        log.warning("no keys file: development mode, every request is an admin "
                    "(bind the Serve proxy to loopback only)")
    return build_application(opts)
