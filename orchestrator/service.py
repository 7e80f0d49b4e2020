"""The search service: a FastAPI app (`create_app`) and the Ray Serve application around it.

    Ingress (FastAPI, N replicas: auth, limits, streaming, metrics)
        └─ Searcher (one replica per store owner: Driver per index, the executor the CLI uses)

The app only talks to a backend with `AsyncSearcher`'s methods: the searcher itself (uvicorn, one
process — `serve_local`) or `ServeBackend`, a deployment handle to the Searcher deployment. Auth
(`keys`), limits (`limits`), event framing (`stream`) and metrics (`service_metrics`) are plain
modules; this one wires them to HTTP. Every error is JSON `{error, detail}`.

Ray Serve users deploy it with `serve run deploy/serve_config.yaml` (see README, "Service"), or
`serve run branchsearch.orchestrator.service:app_builder home=… keys=…`.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fastapi import Request  # module level: FastAPI resolves the string annotations here

from branchsearch.infra.errors import BranchsearchError
from branchsearch.orchestrator.keys import ApiKey, AuthError, KeyStore, bearer
from branchsearch.orchestrator.limits import (ApiError, Limits, api_error, check_body_size,
                                              parse_search)
from branchsearch.orchestrator.service_metrics import ServiceMetrics
from branchsearch.orchestrator.stream import sse

log = logging.getLogger("branchsearch.service")
WEB = Path(__file__).parent / "web"
DEV_KEY = ApiKey("dev", ("*",), (), admin=True)  # development mode (loopback, no keys file)


@dataclass
class ServiceState:
    backend: object  # AsyncSearcher or ServeBackend
    keys: KeyStore | None  # None: development mode
    limits: Limits = field(default_factory=Limits)
    metrics: ServiceMetrics = field(default_factory=ServiceMetrics)

    def principal(self, authorization: str | None) -> ApiKey:
        if self.keys is None:
            return DEV_KEY
        try:
            return self.keys.authenticate(bearer(authorization))
        except AuthError as exc:
            raise ApiError(401, "unauthorized", str(exc),
                           {"WWW-Authenticate": 'Bearer realm="branchsearch"'}) from None


def check_host(host: str, keys_path: str | Path | None) -> None:
    """Without a keys file the service is a development server: loopback only."""
    if keys_path:
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        from branchsearch.infra.errors import BranchsearchError

        raise BranchsearchError(
            f"refusing to listen on {host} without API keys: with no --keys file every caller "
            "is an admin who sees every document (development mode, loopback only). Make keys "
            "with `branchsearch keys add NAME --groups G --keys FILE` and pass --keys FILE")


def dev_mode_banner(host: str, port: int) -> str:
    return (f"development mode: no --keys file, so every request is an admin that sees every "
            f"document; listening on loopback only (http://{host}:{port})")


# --- the FastAPI app ----------------------------------------------------------------------------

def create_app(state: ServiceState):
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    from branchsearch.orchestrator.limits import SearchRequest

    app = FastAPI(title="branchsearch", version="1",
                  description="Parallel-branch evidence search. Send `Authorization: Bearer KEY`"
                              "; ACL groups come from the key.")
    app.state.service = state
    metrics, limits = state.metrics, state.limits

    def error_response(err: ApiError) -> JSONResponse:
        metrics.observe_error(err.status, err.error)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return error_response(ApiError(422, "bad_request", f"{where}: {first.get('msg', exc)}"))

    @app.exception_handler(HTTPException)
    async def _http(request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_response(ApiError(exc.status_code, code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _crash(request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(api_error(exc))

    @app.middleware("http")
    async def _observe(request: Request, call_next):
        started = time.perf_counter()
        metrics.in_flight.inc()
        status = 500
        try:
            check_body_size(_int(request.headers.get("content-length")), limits)
            response = await call_next(request)
            status = response.status_code
            return response
        except Exception as exc:  # noqa: BLE001 — domain errors and crashes: JSON, no traceback
            err = api_error(exc)
            if err.status == 500:
                log.error("unhandled error on %s %s", request.method, request.url.path,
                          exc_info=exc)
            status = err.status
            return error_response(err)
        finally:
            metrics.in_flight.dec()
            route = request.scope.get("route")
            endpoint = getattr(route, "path", None) or "unmatched"
            metrics.observe_request(endpoint, request.method, status,
                                    time.perf_counter() - started)

    async def read_body(request: Request) -> bytes:
        """The body, refused with 413 as soon as it passes the limit (chunked bodies too)."""
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            check_body_size(size, limits)
            parts.append(part)
        return b"".join(parts)

    # --- public ---------------------------------------------------------------------------

    @app.get("/", include_in_schema=False)
    async def index_page():
        return FileResponse(WEB / "index.html", media_type="text/html")

    @app.get("/web/{name}", include_in_schema=False)
    async def web_file(name: str):
        path = WEB / name
        if name not in {p.name for p in WEB.iterdir()} or not path.is_file():
            raise ApiError(404, "not_found", f"no file {name!r}")
        return FileResponse(path)

    @app.get("/healthz", tags=["health"])
    async def healthz():
        """The process is up (it answers)."""
        return {"status": "up"}

    @app.get("/readyz", tags=["health"])
    async def readyz():
        """Backends reachable and engines loaded; 503 with the reason otherwise."""
        ready = await state.backend.ready()
        return {"status": ready["status"], "executor": ready.get("executor"),
                "indexes": sorted(ready.get("indexes", {}))}

    @app.get("/metrics", tags=["health"])
    async def prometheus():
        """Prometheus text exposition (names prefixed `branchsearch_`)."""
        try:
            metrics.acl_guard_dropped.set(await state.backend.guard_dropped())
        except Exception:  # noqa: BLE001 — metrics must answer even when the searcher cannot
            pass
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    # --- with a key -----------------------------------------------------------------------

    @app.get("/v1/whoami", tags=["keys"])
    async def whoami(request: Request):
        """The calling key: name, groups, indexes, admin."""
        return state.principal(request.headers.get("authorization")).public()

    @app.get("/v1/indexes", tags=["indexes"])
    async def indexes(request: Request):
        """The indexes this key may search."""
        key = state.principal(request.headers.get("authorization"))
        return {"indexes": [i for i in await state.backend.indexes() if key.may_use(i)]}

    @app.post("/v1/search", tags=["search"], openapi_extra=_SEARCH_OPENAPI)
    async def search(request: Request):
        """Parallel-branch search. JSON result, or with `Accept: text/event-stream` the events
        plan, branch_started, search, prune, branch_done and result as they happen."""
        key = state.principal(request.headers.get("authorization"))
        body = await read_body(request)
        try:
            data = json.loads(body or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(422, "bad_request", f"body is not JSON ({exc})") from None
        req: SearchRequest = parse_search(data, limits)
        if "text/event-stream" in request.headers.get("accept", ""):
            events = state.backend.stream(req, key)
            first = await events.__anext__()  # a refusal still gets its HTTP status
            return StreamingResponse(_frames(first, events, metrics),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"})
        result = await state.backend.search(req, key)
        metrics.observe_result(result)
        return result

    @app.put("/v1/indexes/{index}/documents", tags=["documents"],
             openapi_extra=_DOCS_OPENAPI)
    async def put_documents(index: str, request: Request):
        """Upsert documents by id (JSON array or JSONL of {id, title?, text, acl?}): admin
        keys only; a search after the answer sees them."""
        key = state.principal(request.headers.get("authorization"))
        body = await read_body(request)
        return await state.backend.upsert(index, body, key)

    @app.delete("/v1/indexes/{index}/documents/{doc_id:path}", tags=["documents"])  # ids
    # may hold '/' (a URL as the id), which a PUT accepts
    async def delete_document(index: str, doc_id: str, request: Request):
        """Delete a document and its chunks: admin keys only."""
        key = state.principal(request.headers.get("authorization"))
        return await state.backend.delete(index, doc_id, key)

    return app


async def _frames(first: dict, events, metrics: ServiceMetrics):
    event = first
    try:
        while True:
            if event.get("type") == "result":
                metrics.observe_result(event["result"])
            elif event.get("type") == "error":
                metrics.observe_error(event.get("status", 500), event.get("error", ""))
            yield sse(event)
            event = await events.__anext__()
    except StopAsyncIteration:
        return


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


_SEARCH_OPENAPI = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["question"], "properties": {
        "question": {"type": "string"}, "index": {"type": "string"},
        "branches": {"type": "integer", "minimum": 1}, "k": {"type": "integer", "minimum": 1},
        "deadline_s": {"type": "number", "exclusiveMinimum": 0}}}}}}}
_DOCS_OPENAPI = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": {"type": "array", "items": {"type": "object"}}},
    "application/x-ndjson": {"schema": {"type": "string"}}}}}


# --- one process: uvicorn -----------------------------------------------------------------------

def local_state(settings, *, executor: str = "local", keys_path=None,
                limits: Limits = Limits(), driver_factory=None) -> ServiceState:
    from branchsearch.orchestrator.searcher import AsyncSearcher, Searcher

    searcher = Searcher(settings, executor=executor, limits=limits, driver_factory=driver_factory)
    return ServiceState(AsyncSearcher(searcher), KeyStore(keys_path) if keys_path else None,
                        limits)


# --- Ray Serve ----------------------------------------------------------------------------------

class ServeBackend:
    """`AsyncSearcher`'s interface over a handle to the Searcher deployment."""

    def __init__(self, handle):
        self.handle = handle

    async def _call(self, method: str, *args):
        try:
            return await getattr(self.handle, method).remote(*args)
        except Exception as exc:  # noqa: BLE001
            raise _unwrap(exc) from None

    async def search(self, req, key):
        return await self._call("search", req, key)

    async def stream(self, req, key):
        gen = self.handle.options(stream=True).stream.remote(req, key)
        try:
            async for event in gen:
                yield event
        except Exception as exc:  # noqa: BLE001
            raise _unwrap(exc) from None

    async def upsert(self, index, body, key):
        return await self._call("upsert", index, body, key)

    async def delete(self, index, doc_id, key):
        return await self._call("delete", index, doc_id, key)

    async def ready(self):
        return await self._call("ready")

    async def indexes(self):
        return await self._call("indexes")

    async def guard_dropped(self):
        return await self._call("guard_dropped")


def _unwrap(exc: BaseException) -> ApiError:
    """An ApiError raised in the Searcher replica, Serve's back-pressure, or a dead replica."""
    cause = getattr(exc, "cause", None)
    if isinstance(exc, ApiError) or isinstance(cause, ApiError):
        return exc if isinstance(exc, ApiError) else cause
    if isinstance(cause, BranchsearchError):  # raised by the replica's own code: its status
        return api_error(cause)  # (a RayTaskError(BackendUnavailable) is not a restart)
    name = type(exc).__name__
    if "BackPressure" in name:
        return ApiError(503, "overloaded", "the searcher's queue is full; retry later",
                        {"Retry-After": "1"})
    if "ActorDied" in name or "Unavailable" in name:
        return ApiError(503, "searcher_unavailable", f"the searcher replica is restarting "
                                                     f"({name}); retry", {"Retry-After": "1"})
    return api_error(cause if isinstance(cause, BaseException) else exc)


@dataclass(frozen=True)
class ServeOptions:
    """What `branchsearch serve` and `app_builder` pass to the deployments."""

    home: str = ".branchsearch"
    index: str = "default"
    config: str | None = None
    keys: str | None = None
    executor: str = "ray"
    replicas: int = 1  # ingress replicas
    searcher_replicas: int = 1  # > 1 only with server backends (Milvus/ES by URL)
    max_ongoing_requests: int = 64  # per ingress replica (HTTP connections being served)
    max_queued_requests: int = 256  # per ingress replica; past it Serve's proxy answers 503
    searcher_max_ongoing: int = 16  # searches at once per searcher replica
    searcher_max_queued: int = 32  # waiting searches, then 503 {error: overloaded} (JSON)
    autoscaling: dict | None = None  # Serve's autoscaling_config for the ingress
    # logical CPUs per replica: small, so the replicas never starve the branch and retriever
    # actors that `plan_actors` sizes from the cluster's CPUs (Serve's default is 1 each)
    ingress_cpus: float = 0.05
    searcher_cpus: float = 0.1
    limits: dict = field(default_factory=dict)  # Limits fields


def build_application(opts: ServeOptions):
    """The Serve application (Ingress → Searcher); `serve.run` or `serve deploy` it."""
    from ray import serve

    from branchsearch.orchestrator.searcher import AsyncSearcher, Searcher

    @serve.deployment(name="Searcher")
    class SearcherDeployment:
        def __init__(self, o: dict):
            from branchsearch.infra.settings import load_settings

            settings = load_settings(o["config"], {"home": o["home"], "index": o["index"]})
            self.inner = AsyncSearcher(Searcher(settings, executor=o["executor"],
                                                limits=Limits(**o["limits"])))
            self.inner.searcher.driver(settings.index)  # load models before taking traffic

        async def search(self, req, key):
            return await self.inner.search(req, key)

        async def stream(self, req, key):
            async for event in self.inner.stream(req, key):
                yield event

        async def upsert(self, index, body, key):
            return await self.inner.upsert(index, body, key)

        async def delete(self, index, doc_id, key):
            return await self.inner.delete(index, doc_id, key)

        async def ready(self):
            return await self.inner.ready()

        async def indexes(self):
            return await self.inner.indexes()

        async def guard_dropped(self):
            return await self.inner.guard_dropped()

        def check_health(self):  # Serve restarts a replica whose check raises
            pass

    @serve.deployment(name="Ingress")
    @serve.ingress()
    class Ingress:
        def __init__(self, searcher, o: dict):
            self.state = ServiceState(ServeBackend(searcher),
                                      KeyStore(o["keys"]) if o["keys"] else None,
                                      Limits(**o["limits"]))

        def __serve_build_asgi_app__(self):
            return create_app(self.state)

    o = asdict(opts)
    ingress_cfg = {"max_ongoing_requests": opts.max_ongoing_requests,
                   "max_queued_requests": opts.max_queued_requests,
                   "ray_actor_options": {"num_cpus": opts.ingress_cpus}}
    ingress_cfg |= ({"autoscaling_config": opts.autoscaling} if opts.autoscaling
                    else {"num_replicas": opts.replicas})
    searcher = SearcherDeployment.options(
        num_replicas=opts.searcher_replicas, max_ongoing_requests=opts.searcher_max_ongoing,
        max_queued_requests=opts.searcher_max_queued,
        ray_actor_options={"num_cpus": opts.searcher_cpus}).bind(o)
    return Ingress.options(**ingress_cfg).bind(searcher, o)


def run_serve(settings, opts: ServeOptions, host: str, port: int, *, block: bool = True):
    """Start Serve's HTTP proxy on host:port and deploy the application (blocks until ^C
    unless `block` is False). Uses the settings' Ray cluster, else a local one."""
    from ray import serve

    from branchsearch.orchestrator.cluster import connect

    connect(settings)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_application(opts), name="branchsearch", route_prefix="/")
    print(f"serving on http://{host}:{port} (docs at /docs; Ray Serve app 'branchsearch')",
          file=sys.stderr)
    if not block:
        return
    import signal

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)  # `kill PID` stops it as ^C does: drain, then exit
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopping: shutting the Serve application down", file=sys.stderr)
        serve.shutdown()


def app_builder(args: dict):
    """`serve run branchsearch.orchestrator.service:app_builder home=… keys=…` and the
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
