"""The HTTP face of the service: a FastAPI app (`create_app`) in front of one `Searcher`.

    HTTP ─ app (auth, admission, body limits, SSE, metrics) ─ Searcher (service.searcher)

The app reaches the searcher through `SearcherClient`: the object itself in one process
(standalone), or a Ray Serve handle to the `Searcher` deployment (`service.deploy`). Every error
is one JSON shape, `{error, detail}` (`service.errors`); a client that disconnects frees its
slot at once and is counted as status 499.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Request  # module level: FastAPI resolves the string annotations here

from branchsearch.infra.errors import BranchsearchError
from branchsearch.orchestrator.service.admission import Limits, check_body_size
from branchsearch.orchestrator.service.auth import ApiKey, AuthError, KeyStore, bearer
from branchsearch.orchestrator.service.errors import ApiError, api_error
from branchsearch.orchestrator.service.events import sse
from branchsearch.orchestrator.service.metrics import ServiceMetrics
from branchsearch.orchestrator.service.protocol import parse_search

log = logging.getLogger("branchsearch.service")
WEB = Path(__file__).parent / "web"
DEV_KEY = ApiKey("dev", ("*",), (), admin=True)  # development mode (loopback, no keys file)
CLIENT_CLOSED = 499  # nginx's code for "the client went away before the answer"


class SearcherClient:
    """How the app calls the one `Searcher`: directly in this process, or through a Serve
    deployment handle (whose errors are unwrapped to the `ApiError` the replica raised)."""

    def __init__(self, target):
        from branchsearch.orchestrator.service.searcher import Searcher

        self.target = target
        self.local = isinstance(target, Searcher)

    async def call(self, method: str, *args):
        if self.local:
            return await getattr(self.target, method)(*args)
        try:
            return await getattr(self.target, method).remote(*args)
        except Exception as exc:  # noqa: BLE001
            raise _unwrap(exc) from None

    async def stream(self, req, key):
        if self.local:
            async for event in self.target.stream(req, key):
                yield event
            return
        try:
            async for event in self.target.options(stream=True).stream.remote(req, key):
                yield event
        except Exception as exc:  # noqa: BLE001
            raise _unwrap(exc) from None


def _unwrap(exc: BaseException) -> ApiError:
    """An ApiError raised in the Searcher replica, Serve's back-pressure, or a dead replica."""
    cause = getattr(exc, "cause", None)
    if isinstance(exc, ApiError) or isinstance(cause, ApiError):
        return exc if isinstance(exc, ApiError) else cause
    if isinstance(cause, BranchsearchError):  # raised by the replica's own code: its status
        return api_error(cause)
    name = type(exc).__name__
    if "BackPressure" in name:
        return ApiError(503, "overloaded", "the searcher's queue is full; retry later",
                        {"Retry-After": "1"})
    if "ActorDied" in name or "Unavailable" in name:
        return ApiError(503, "searcher_unavailable", "the searcher replica is restarting; "
                        "retry", {"Retry-After": "1"})
    return api_error(cause if isinstance(cause, BaseException) else exc)


@dataclass
class ServiceState:
    searcher: SearcherClient
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


class Observe:
    """ASGI middleware: the body limit, in-flight gauge and request metrics (a stream until its
    last event; a disconnect as 499). Plain ASGI, so streaming and disconnects pass through."""

    def __init__(self, app, state: ServiceState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        metrics, started, box = self.state.metrics, time.perf_counter(), {"status": 500}

        async def sending(message):
            if message["type"] == "http.response.start":
                box["status"], box["started"] = message["status"], True
            await send(message)

        metrics.in_flight.inc()
        try:
            headers = dict(scope.get("headers") or [])
            length = headers.get(b"content-length")
            try:
                check_body_size(int(length) if length is not None else None, self.state.limits)
            except ValueError:
                pass
            except ApiError as err:
                return await _send_error(sending, err, metrics)
            await self.app(scope, receive, sending)
        except asyncio.CancelledError:
            box["status"] = CLIENT_CLOSED
            raise
        except Exception as exc:  # noqa: BLE001 — domain errors and crashes: JSON, no traceback
            err = api_error(exc)
            if err.status == 500:
                log.error("unhandled error on %s %s", scope.get("method"), scope.get("path"),
                          exc_info=exc)
            if "started" in box:  # a stream already under way: nothing more can be said
                raise
            await _send_error(sending, err, metrics)
        finally:
            metrics.in_flight.dec()
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or "unmatched"
            metrics.observe_request(endpoint, scope.get("method", ""), box.get("status", 500),
                                    time.perf_counter() - started)


async def _send_error(send, err: ApiError, metrics: ServiceMetrics) -> None:
    metrics.observe_error(err.status, err.error)
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), str(v).encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (its body already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_gone(request: Request, work):
    """`work` (a coroutine), cancelled the moment the client disconnects: then the searcher
    gives its slot back at once, and the request is counted as 499."""
    from fastapi.responses import Response

    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        gone.cancel()
    if task.cancelled():
        return Response(status_code=CLIENT_CLOSED)
    return task.result()


# --- the FastAPI app ----------------------------------------------------------------------------

def create_app(state: ServiceState):
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title="branchsearch", version="1",
                  description="Parallel-branch evidence search. Send `Authorization: Bearer KEY`"
                              "; ACL groups come from the key.")
    app.state.service = state
    metrics, limits, searcher = state.metrics, state.limits, state.searcher

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
        return error_response(ApiError(exc.status_code, code, str(exc.detail),
                                       dict(exc.headers or {})))  # 405 keeps its Allow

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
        """Ready when the default index is open and every open index's backends answer; 503
        naming the index that is not (the reason is in the server log)."""
        return await searcher.call("ready")

    @app.get("/metrics", tags=["health"])
    async def prometheus():
        """Prometheus text exposition (names prefixed `branchsearch_`)."""
        try:
            metrics.acl_guard_dropped.set(await searcher.call("guard_dropped"))
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
        """The indexes this key may search (owned and declared external)."""
        key = state.principal(request.headers.get("authorization"))
        return {"indexes": [i for i in await searcher.call("indexes") if key.may_use(i)]}

    @app.post("/v1/search", tags=["search"], openapi_extra=_SEARCH_OPENAPI)
    async def search(request: Request):
        """Parallel-branch search. JSON result, or with `Accept: text/event-stream` the events
        plan, branch_started, search, prune, branch_done and result as they happen."""
        key = state.principal(request.headers.get("authorization"))
        body = await read_body(request)
        try:
            data = json.loads(body or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            raise ApiError(422, "bad_request", f"body is not JSON ({reason})") from None
        req = parse_search(data, limits)
        if "text/event-stream" in request.headers.get("accept", ""):
            events = searcher.stream(req, key)
            first = await events.__anext__()  # a refusal still gets its HTTP status
            return StreamingResponse(_frames(first, events, metrics),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"})
        result = await _unless_gone(request, searcher.call("search", req, key))
        if isinstance(result, dict):
            metrics.observe_result(result)
        return result

    @app.put("/v1/indexes/{index}/documents", tags=["documents"],
             openapi_extra=_DOCS_OPENAPI)
    async def put_documents(index: str, request: Request):
        """Upsert documents by id (JSON array or JSONL of {id, title?, text, acl?}): admin
        keys, for documents of their groups; a search after the answer sees them."""
        key = state.principal(request.headers.get("authorization"))
        body = await read_body(request)
        return await searcher.call("upsert", index, body, key)

    @app.delete("/v1/indexes/{index}/documents/{doc_id:path}", tags=["documents"])  # ids
    # may hold '/' (a URL as the id), which a PUT accepts
    async def delete_document(index: str, doc_id: str, request: Request):
        """Delete a document and its chunks: admin keys, for documents of their groups."""
        key = state.principal(request.headers.get("authorization"))
        return await searcher.call("delete", index, doc_id, key)

    app.add_middleware(Observe, state=state)
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
    finally:
        await events.aclose()  # a client gone mid-stream ends the search's generator now


_SEARCH_OPENAPI = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["question"], "properties": {
        "question": {"type": "string"}, "index": {"type": "string"},
        "branches": {"type": "integer", "minimum": 1}, "k": {"type": "integer", "minimum": 1},
        "deadline_s": {"type": "number", "exclusiveMinimum": 0}}}}}}}
_DOCS_OPENAPI = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": {"type": "array", "items": {"type": "object"}}},
    "application/x-ndjson": {"schema": {"type": "string"}}}}}
