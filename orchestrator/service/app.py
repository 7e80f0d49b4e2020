"""The HTTP face of the service: a FastAPI app (`create_app`) in front of one `Searcher`.

    HTTP ─ app (auth, admission, body limits, SSE, metrics) ─ Searcher (service.searcher)

The app reaches the searcher through `SearcherClient`: the object itself in one process
(standalone), or a Ray Serve handle to the `Searcher` deployment (`service.deploy`). Every error
is one JSON shape, `{error, detail}` (`service.errors`); a client that disconnects calls its
search off (its slot is free once the search has stopped) and is counted as status 499.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import logging
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Union
from urllib.parse import quote

from fastapi import Request  # module level: FastAPI resolves the string annotations here
from starlette.requests import ClientDisconnect

from branchsearch.infra.config.settings import index_name
from branchsearch.infra.errors import (BranchsearchError, KeysFileError, error_line, overload,
                                       redact)
from branchsearch.infra.textfile import KeyTwice, json_once
from branchsearch.orchestrator.service.admission import (Limits, check_body_headers,
                                                          check_body_size, check_declared_size)
from branchsearch.orchestrator.service.auth import ApiKey, AuthError, KeyStore, bearer
from branchsearch.orchestrator.service.board import gauges
from branchsearch.orchestrator.service.errors import ApiError, Refused, api_error, shutting_down
from branchsearch.orchestrator.service.events import sse
from branchsearch.orchestrator.service.metrics import ServiceMetrics
from branchsearch.orchestrator.service.protocol import (DOCUMENTS_BODY, INDEX_NAME_SCHEMA,
                                                        SSE_EVENT_SCHEMA, Deleted, ErrorBody,
                                                        Health, IndexList, KeyInfo,
                                                        KeyRefusal, Overload, Ready,
                                                        SearchResponse, Upserted, check_no_query,
                                                        parse_search, search_body_schema)

log = logging.getLogger("branchsearch.service")
WEB = Path(__file__).parent / "web"
DEV_KEY = ApiKey("dev", ("*",), (), admin=True)  # development mode (loopback, no keys file)
CLIENT_CLOSED = 499  # nginx's code for "the client went away before the answer"


class SearcherClient:
    """How the app calls the one `Searcher`: directly in this process, or through a Serve
    deployment handle (whose errors are unwrapped to the `ApiError` the replica raised).

    Through Serve a call may wait in Serve's queue for a searcher replica (each takes
    `searcher_max_ongoing` at once), where the searcher's own deadline cannot reach it: a
    search waits at most `within` s (`time_left`), then 504 `deadline_exceeded` (`_bounded`).
    Readiness and the index list never wait there: they are read from the readiness board the
    searcher replicas publish (`service.board`)."""

    def __init__(self, target, max_queued: int | None = None, board=None):
        """`board`: through Serve, the application's readiness board (`board.BoardReader`)."""
        from branchsearch.orchestrator.service.searcher import Searcher

        self.target = target
        self.local = isinstance(target, Searcher)
        self.max_queued = max_queued  # Serve's queue for the searcher (`searcher_max_queued`)
        self.board = board

    async def call(self, method: str, *args, within: float | None = None):
        if self.local:
            return await getattr(self.target, method)(*args)
        response = self.target.answer.remote(method, *args)
        try:
            async with _bounded(response, _when(within)):
                out = await response
        except Exception as exc:  # noqa: BLE001
            raise _unwrap(exc, self.max_queued) from None
        if isinstance(out, Refused):  # a refusal, carried as a value (`Refused`)
            raise out.error
        return out

    async def ready(self) -> dict:
        """The searcher's readiness (the `/readyz` body, before it is cut to a caller's view):
        asked in this process, or through Serve read from its board (`service.board`), never
        through its queue, which a burst of searches fills."""
        if self.board is None:
            return await self.call("ready")
        return _given((await self.board.current()).ready)

    async def indexes(self) -> list[str]:
        """Every index the service serves, as `ready` learns it."""
        if self.board is None:
            return await self.call("indexes")
        return _given((await self.board.current()).indexes)

    async def gauges(self) -> dict | None:
        """The searcher's figures in `/metrics` (`Searcher.gauges_now`): asked in this
        process, or through Serve read from its board, summed over its replicas, never
        through its queue (a scrape while searches fill it would wait behind them); None
        when the board has no fresh post."""
        if self.board is None:
            return await self.call("gauges")
        return gauges(await self.board.posts())

    async def stream(self, req, key, within: float | None = None):
        """The search's events; through Serve, those not come by `within` s from now end it
        with 504 `deadline_exceeded` (raised: before the first event, the HTTP status)."""
        if self.local:
            async for event in self.target.stream(req, key):
                yield event
            return
        events, when = self.target.options(stream=True).answer_stream.remote(req, key), \
            _when(within)
        try:
            while True:
                async with _bounded(events, when):
                    try:
                        event = await events.__anext__()
                    except StopAsyncIteration:
                        return
                if isinstance(event, Refused):
                    raise event.error
                yield event
        except Exception as exc:  # noqa: BLE001
            raise _unwrap(exc, self.max_queued) from None


def _given(answer):
    """A board's answer: its value, or its error raised."""
    if isinstance(answer, ApiError):
        raise answer
    return answer


def time_left(req, limits: Limits) -> float:
    """How long the app waits on a Serve searcher for search `req` (`SearcherClient`): until
    its deadline, counted from its arrival, and the `JOIN_GRACE_S` past it in which the
    searcher hands back what its branches found (the bound `serve --standalone` keeps)."""
    from branchsearch.orchestrator.service.searcher import JOIN_GRACE_S

    deadline = req.deadline_s or limits.default_deadline_s
    return max(req.received_at + deadline + JOIN_GRACE_S - time.time(), 0.0)


def write_time_left(received: float, limits: Limits) -> float:
    """How long the app waits on a Serve searcher for a document write that arrived at
    `received`: a little past the bound the searcher answers it within (`Searcher._writing`),
    so the searcher's answer, which says whether the write may still land, comes first."""
    from branchsearch.orchestrator.service.searcher import JOIN_GRACE_S

    return max(received + limits.default_deadline_s + JOIN_GRACE_S + 1.0 - time.time(), 0.0)


def _when(within: float | None) -> float | None:
    return None if within is None else asyncio.get_running_loop().time() + within


@contextlib.asynccontextmanager
async def _bounded(response, when: float | None):
    """Around awaiting a Serve call's `response` (or its next event) until `when` (the event
    loop's clock; None: no bound); past it, 504 `deadline_exceeded`. A wait that ends with no
    answer, so, or by the caller going away (the awaiting task cancelled), cancels the call
    (`DeploymentResponse.cancel`): one still in Serve's queue leaves it and never runs, one
    running in the replica is cancelled there and calls its search off."""
    bound = asyncio.timeout_at(when)
    try:
        async with bound:
            yield
    except asyncio.CancelledError:
        response.cancel()
        raise
    except TimeoutError:
        if not bound.expired():  # (the replica's own error)
            raise
        response.cancel()
        raise ApiError(504, "deadline_exceeded", "no result within the request's deadline: "
                       "the searcher is busy (the request waited for it)") from None


def _unwrap(exc: BaseException, max_queued: int | None = None) -> ApiError:
    """An ApiError raised in the Searcher replica, Serve's back-pressure (its queue of
    `max_queued` searches full: how many wait, Serve does not say), or a dead replica."""
    cause = getattr(exc, "cause", None)
    if isinstance(exc, ApiError) or isinstance(cause, ApiError):
        return exc if isinstance(exc, ApiError) else cause
    if isinstance(cause, BranchsearchError):  # raised by the replica's own code: its status
        return api_error(cause)
    name = type(exc).__name__
    if "BackPressure" in name:
        limits = {} if max_queued is None else {"searcher_max_queued": max_queued}
        return ApiError(503, "overloaded", "the searcher's queue is full; retry later",
                        {"Retry-After": "1"}, overload("searcher_queue", None, **limits))
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
    peers: object | None = None  # Serve: the other ingress replicas' metrics (SharedMetrics)
    draining: bool = False  # the server is stopping (`deploy.standalone_server`, `run_serve`)
    # its grace for requests in flight has run out, and it cancels those still running
    # (`deploy.standalone_server`; Serve kills the replica instead)
    cut_off: bool = False

    def principal(self, authorization: str | None) -> ApiKey:
        if self.keys is None:
            return DEV_KEY
        try:
            return self.keys.authenticate(bearer(authorization))
        except AuthError as exc:
            raise ApiError(401, "unauthorized", str(exc),
                           {"WWW-Authenticate": 'Bearer realm="branchsearch"'}) from None


class Observe:
    """ASGI middleware: the in-flight gauge and request metrics (a stream until its last
    event; a disconnect as 499), and a stopping server's 503. Plain ASGI, so streaming and
    disconnects pass through.

    A client that leaves is counted 499 however the server learns it: its body cut short
    (`ClientDisconnect`), a stream Starlette ends quietly, the request cancelled (Serve's proxy
    cancels the request of a client gone, draining or not), or a `receive` that fails (Serve's
    call back to its proxy for the body, cancelled with the request: taken as the disconnect
    it is). The one cancellation that is the server's is a stopping server's grace running out
    (`ServiceState.cut_off`): that request is answered 503 `shutting_down`."""

    def __init__(self, app, state: ServiceState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        metrics, started, box = self.state.metrics, time.perf_counter(), {"status": 500}

        async def sending(message):
            if message["type"] == "http.response.start":
                box["status"], box["started"] = message["status"], True
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                box["complete"] = True
            await send(message)

        async def receiving():
            try:
                return await receive()
            except Exception as exc:  # noqa: BLE001 — the client's side is gone
                log.debug("%s %s: receive failed: %s", scope.get("method"), scope.get("path"),
                          error_line(exc, 300))
                return {"type": "http.disconnect"}

        metrics.in_flight.inc()
        try:
            if self.state.draining and _route_path(scope) not in ("/healthz", "/metrics"):
                # /readyz too: balancers move on
                return await _send_error(sending, shutting_down(), metrics)
            await self.app(scope, receiving, sending)
        except asyncio.CancelledError:
            if "started" in box or not self.state.cut_off:  # a stream cut short, a client
                box["status"] = CLIENT_CLOSED  # gone
                raise
            # nothing sent yet, and the server's grace for requests in flight has run out.
            # Say so in JSON, not a plain 500
            try:
                await _send_error(sending, shutting_down(
                    "the service stopped before this request finished; retry on another "
                    "instance or once it is back"), metrics)
            except Exception:  # noqa: BLE001 — the client is gone too
                box["status"] = CLIENT_CLOSED
        except Exception as exc:  # noqa: BLE001 — domain errors and crashes: JSON, no traceback
            if isinstance(exc, ClientDisconnect) and "started" not in box:  # it left while
                box["status"] = CLIENT_CLOSED  # its body was read: no one to answer, and no
                return  # failure of the server's
            if "started" in box and _client_gone(exc):  # it left mid-stream, and the server
                # said so by failing a send (ASGI 2.4: an OSError, ClientDisconnect from
                # Starlette): one line, not a traceback here and another from the server
                log.debug("%s %s: the client left mid-stream (%s)", scope.get("method"),
                          scope.get("path"), type(exc).__name__)
                return  # counted 499 below (a stream not complete, not failed)
            err = api_error(exc)
            if err.status == 500:
                log.error("unhandled error on %s %s", scope.get("method"), scope.get("path"),
                          exc_info=exc)
            if "started" in box:  # a stream already under way: nothing more can be said
                box["failed"] = not _client_gone(exc)
                raise
            await _send_error(sending, err, metrics)
        finally:
            metrics.in_flight.dec()
            status = scope.get(STREAM_STATUS) or box.get("status", 500)  # (a stream: how it
            if "started" in box and not box.get("complete"):  # ended) a stream cut short: the
                # server failed under it, or the client left (Starlette ends it quietly)
                status = 500 if box.get("failed") else CLIENT_CLOSED
            metrics.observe_request(_endpoint(scope), scope.get("method", ""), status,
                                    time.perf_counter() - started)


def _route_path(scope) -> str:
    """The request's path within the app: without the prefix it is mounted under (Serve's
    `route_prefix`, ASGI's `root_path`), which the ASGI `path` holds."""
    path, root = str(scope.get("path", "")), str(scope.get("root_path", "")).rstrip("/")
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root):] or "/"
    return path


def _page_base(scope) -> str:
    """The web page's base URL: the prefix the app is mounted under (ASGI `root_path`, Serve's
    `route_prefix`), ending in "/", so the page's relative paths (`web/app.js`, `v1/search`)
    resolve under it however the page was asked for (`/x`, `/x/`). Percent-encoded and
    HTML-escaped, and always one leading "/": never a link to another host ("//host")."""
    root = str(scope.get("root_path", "")).strip("/")
    return html.escape(quote("/" + root + "/" if root else "/", safe="/"), quote=True)


def _client_gone(exc: BaseException) -> bool:
    """Whether `exc` says the client went away (not that the server failed)."""
    return isinstance(exc, (ClientDisconnect, BrokenPipeError, ConnectionResetError))


def _endpoint(scope) -> str:
    """The route's path template (bounded labels), also for a request refused before routing
    (a stopping server's 503): the route it was sent to. "unmatched" when no route takes the
    path."""
    from starlette.routing import Match

    route = scope.get("route")
    if route is None:
        router = getattr(scope.get("app"), "router", None)
        route = next((r for r in getattr(router, "routes", ())
                      if r.matches(scope)[0] == Match.FULL), None)
    path = getattr(route, "path", None)  # {doc_id:path} -> {doc_id}: no routing syntax
    return re.sub(r"\{(\w+):\w+\}", r"{\1}", path) if path else "unmatched"


async def _send_error(send, err: ApiError, metrics: ServiceMetrics) -> None:
    metrics.observe_error(err.status, err.error)
    from fastapi.responses import JSONResponse

    body = JSONResponse(err.body()).body  # the same bytes as the app's own error answers
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
    calls the search off (its slot is back once its branches have stopped), and the request
    is counted as 499."""
    from fastapi.responses import Response

    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # the search is called off when this returns
    if task.cancelled():
        return Response(status_code=CLIENT_CLOSED)
    return task.result()


# --- the FastAPI app ----------------------------------------------------------------------------

def create_app(state: ServiceState):
    from fastapi import Depends, FastAPI, Path as PathParam
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import (FileResponse, HTMLResponse, JSONResponse,
                                   PlainTextResponse, Response, StreamingResponse)
    from fastapi.security import HTTPBearer
    from starlette.exceptions import HTTPException
    from starlette.routing import Match

    from branchsearch.orchestrator.service.searcher import Searcher

    app = FastAPI(title="branchsearch", version="1", description=_DESCRIPTION)
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
        error = ApiError(exc.status_code, code, str(exc.detail),
                         dict(exc.headers or {}))  # 405 keeps its Allow
        if exc.status_code == 405:  # every method the path takes (GET and HEAD are two routes)
            error.headers["Allow"] = ", ".join(sorted({
                m for r in request.app.router.routes if getattr(r, "methods", None)
                and r.matches(request.scope)[0] != Match.NONE for m in r.methods}))
        if exc.status_code == 404 and exc.detail == "Not Found":  # no route: say which path,
            path = " ".join(redact(request.url.path).split())  # the caller's own, as sent
            root = str(request.scope.get("root_path", "")).strip("/")  # the API browser,
            docs = quote(f"/{root}/docs" if root else "/docs", safe="/")  # under the prefix
            error.detail = f"no such path: {request.method} {path[:200]} (see {docs})"
        return error_response(error)

    def caller(request: Request, writes: str | None = None) -> ApiKey:
        """The key of a `/v1` request (401 without a good one; 403 when it may not write to
        index `writes`), then 422 for a query string: judged once its path and method are
        known good (404, 405 first), as any request's."""
        key = state.principal(request.headers.get("authorization"))
        if writes is not None:
            Searcher.check_writer(key, writes)
        check_no_query(request.scope.get("query_string") or b"")
        return key

    async def read_body(request: Request) -> bytes:
        """The body, refused with 413 when its Content-Length is over the limit, and with 415
        when its headers declare one this API cannot read (`check_body_headers`), before a
        byte of it is read, and with 413 as soon as it passes the limit (chunked bodies too).
        A route reads it once its path, method and key are known good, so a body too large or
        not JSON to a path no route takes is a 404, and one without a key a 401, as any
        request's would be."""
        headers = dict(request.scope.get("headers") or [])
        check_declared_size(headers, limits)
        check_body_headers(request.method, headers)
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            check_body_size(size, limits)
            parts.append(part)
        return b"".join(parts)

    # The key is checked by `state.principal` (its 401 is ours); this dependency only declares
    # the scheme, so the schema and /docs ("Authorize") show how to send it.
    keyed = [Depends(HTTPBearer(auto_error=False, scheme_name="bearer", description=(
        "An API key (`branchsearch keys add`), sent as `Authorization: Bearer KEY`; the ACL "
        "groups of every search come from it. A server started without a keys file (loopback "
        "development mode) takes any request as an admin.")))]
    index_param = PathParam(description=INDEX_NAME_SCHEMA["description"],
                            json_schema_extra={k: v for k, v in INDEX_NAME_SCHEMA.items()
                                               if k != "description"})

    # --- public ---------------------------------------------------------------------------

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def index_page(request: Request):
        # the page asks for a key unless this is a development server (no keys file)
        page = (WEB / "index.html").read_text(encoding="utf-8")
        if state.keys is None:
            page = page.replace('<meta name="bs-auth" content="keys">',
                                '<meta name="bs-auth" content="dev">')
        # its script and API paths are relative, against the prefix the app is mounted under
        page = page.replace('<base href="/">', f'<base href="{_page_base(request.scope)}">')
        return HTMLResponse(page)

    @app.api_route("/web/{name}", methods=["GET", "HEAD"], include_in_schema=False)
    async def web_file(name: str):
        path = WEB / name
        if name not in {p.name for p in WEB.iterdir()} or not path.is_file():
            raise ApiError(404, "not_found", f"no file {name!r}")
        return FileResponse(path)

    # HEAD (load balancers' health checks) answers as GET, outside the schema: one operation
    # a path, so the operationIds clients generate code from stay unique
    @app.head("/healthz", include_in_schema=False)
    @app.get("/healthz", tags=["health"], responses=_answers(Health))
    async def healthz():
        """The process is up (it answers)."""
        return {"status": "up"}

    @app.head("/readyz", include_in_schema=False)
    @app.get("/readyz", tags=["health"], responses=_answers(Ready, 503))
    async def readyz(request: Request):
        """Ready when the default index (where the server has one) is open and its backends
        answer, and the API keys file can be read; else 503, within a few seconds whatever the
        backends do. `indexes`: how many the service serves; `indexes_not_ready`: how many of
        those cannot serve now, a backend that does not answer, a start that failed, or an index
        not open that could not open (their searches answer 503). `not_ready` names them, with
        the code their searches meet, to a caller whose key may use them (everyone on a
        development server): anyone may ask, and index names are for keys (GET /v1/indexes). Why
        in full: the server log."""
        if state.keys is not None:
            try:
                state.keys.check()
            except KeysFileError as exc:
                log.warning("not ready: %s", exc)
                raise ApiError(503, "not_ready", "the server cannot read its API keys file "
                               "(the server log says why)", {"Retry-After": "5"}) from None
        return shown_to(await searcher.ready(), request)

    def shown_to(ready: dict, request: Request) -> dict:
        """`ready` as this caller may see it: `not_ready` only with a key (any index it may
        use), never to a caller without one, nor with a key that is not one (no 401 here: a
        probe is answered whatever it sends)."""
        ready = dict(ready)
        not_ready = ready.pop("not_ready", [])
        header = request.headers.get("authorization")
        if state.keys is not None and not header:
            return ready
        try:
            key = state.principal(header)
        except (ApiError, KeysFileError):
            return ready
        return {**ready, "not_ready": [n for n in not_ready if key.may_use(n["index"])]}

    @app.get("/metrics", tags=["health"], response_class=PlainTextResponse)
    async def prometheus():
        """Prometheus text exposition (names prefixed `branchsearch_`)."""
        try:
            figures = await searcher.gauges()
        except Exception:  # noqa: BLE001 — metrics must answer even when the searcher cannot
            figures = None
        if figures is not None:
            metrics.acl_guard_dropped.set(figures.get("guard_dropped", 0))
            metrics.searches_past_deadline.set(figures.get("past_deadline", 0))
        others = await state.peers.others() if state.peers is not None else None
        return Response(metrics.render(others), media_type="text/plain; version=0.0.4")

    # --- with a key -----------------------------------------------------------------------

    @app.get("/v1/whoami", tags=["keys"], dependencies=keyed,
             responses=_answers(KeyInfo, 401, 503))
    async def whoami(request: Request):
        """The calling key: name, groups, indexes, admin."""
        return caller(request).public()

    @app.get("/v1/indexes", tags=["indexes"], dependencies=keyed,
             responses=_answers(IndexList, 401, 503))
    async def indexes(request: Request):
        """The indexes this key may search (owned and declared external)."""
        key = caller(request)
        return {"indexes": [i for i in await searcher.indexes() if key.may_use(i)]}

    @app.post("/v1/search", tags=["search"], dependencies=keyed,
              responses=_answers(SearchResponse, 400, 401, 403, 404, 413, 415, 422, 429, 503,
                                 504, alt={"text/event-stream": {"schema": SSE_EVENT_SCHEMA}}),
              openapi_extra={"requestBody": {"required": True, "content": {
                  "application/json": {"schema": search_body_schema(limits)}}}})
    async def search(request: Request):
        """Parallel-branch search. JSON result, or with `Accept: text/event-stream` the events
        plan, branch_started, search, prune, branch_done and result as they happen."""
        received = time.time()  # the deadline counts from here (SearchRequest.received_at)
        key = caller(request)
        body = await read_body(request)
        try:
            data = json_once(body or b"null")
        except KeyTwice as exc:
            raise ApiError(422, "bad_request", f"body gives {repr(exc.key)[:80]} twice: give "
                           "it once") from None
        except (ValueError, RecursionError) as exc:  # (JSONDecodeError, UnicodeDecodeError,
            # a 5,000-digit number: all ValueErrors)
            from branchsearch.infra.ingest.corpus import json_problem

            raise ApiError(422, "bad_request", f"body is not JSON ({json_problem(exc)})") \
                from None
        req = replace(parse_search(data, limits), received_at=received)
        if req.index is not None:  # what the key alone decides (403) is said here, not after a
            Searcher.check_index(req.index, key)  # wait in the searcher's (full) queue
        if "text/event-stream" in request.headers.get("accept", ""):
            events = searcher.stream(req, key, time_left(req, limits))
            first = await events.__anext__()  # a refusal still gets its HTTP status
            return StreamingResponse(_frames(first, events, metrics, request.scope),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"})
        result = await _unless_gone(request, searcher.call("search", req, key,
                                                           within=time_left(req, limits)))
        if isinstance(result, dict):
            metrics.observe_result(result)
        return result

    @app.put("/v1/indexes/{index}/documents", tags=["documents"], dependencies=keyed,
             responses=_answers(Upserted, 400, 401, 403, 404, 409, 413, 415, 422, 503, 504),
             openapi_extra={"requestBody": DOCUMENTS_BODY})
    async def put_documents(request: Request, index: str = index_param):
        """Upsert documents by id (JSON array or JSONL of {id, title?, text, acl?}): admin
        keys, for documents of their groups; a search after the answer sees them."""
        received = time.time()  # the deadline counts from here (`Searcher._writing`)
        key = caller(request, writes=index_name(index))  # (as a search's index)
        body = await read_body(request)
        return await searcher.call("upsert", index_name(index), body, key, received,
                                   within=write_time_left(received, limits))

    @app.delete("/v1/indexes/{index}/documents/{doc_id:path}", tags=["documents"],  # ids
                dependencies=keyed,  # may hold '/' (a URL as the id), which a PUT accepts
                responses=_answers(Deleted, 400, 401, 403, 404, 409, 422, 503, 504))
    async def delete_document(request: Request, index: str = index_param,
                              doc_id: str = PathParam(description="the document's id (it may "
                                                      "hold '/')",
                                                      json_schema_extra={"minLength": 1})):
        """Delete a document and its chunks: admin keys, for documents of their groups."""
        received = time.time()
        doc_id = sent_path_end(request.scope["path"], doc_id)
        key = caller(request, writes=index_name(index))  # (as a search's index)
        return await searcher.call("delete", index_name(index), doc_id, key, received,
                                   within=write_time_left(received, limits))

    app.add_middleware(Observe, state=state)
    return app


def sent_path_end(path: str, matched: str) -> str:
    """A path parameter that ends the path, as sent. The route's pattern ends in `$`, which
    also matches before a final newline, so `…/documents/memo%0A` arrives as `memo`: a DELETE
    of an id no document can hold would delete `memo`."""
    return matched + "\n" if path.endswith(matched + "\n") else matched


async def _frames(first: dict, events, metrics: ServiceMetrics, scope: dict | None = None):
    """The SSE frames of a search. A stream that ends with an `error` event (the search
    failed after the 200 went out) is counted under that event's status (`Observe`)."""
    event = first
    try:
        while True:
            if event.get("type") == "result":
                metrics.observe_result(event["result"])
            elif event.get("type") == "error":
                metrics.observe_error(event.get("status", 500), event.get("error", ""))
                if scope is not None:
                    scope[STREAM_STATUS] = event.get("status", 500)
            yield sse(event)
            event = await events.__anext__()
    except StopAsyncIteration:
        return
    except Exception as exc:  # noqa: BLE001 — the searcher failed under a stream under way (its
        err = exc if isinstance(exc, ApiError) else api_error(exc)  # replica's node died):
        metrics.observe_error(err.status, err.error)  # the stream's last event says so
        if scope is not None:
            scope[STREAM_STATUS] = err.status
        yield sse({"type": "error", "status": err.status, **err.body()})
    finally:
        await events.aclose()  # a client gone mid-stream ends the search's generator now


STREAM_STATUS = "branchsearch.stream_status"  # in the ASGI scope: how a stream ended


_DESCRIPTION = (
    "Parallel-branch evidence search. Send `Authorization: Bearer KEY` to the `/v1` routes; ACL "
    "groups come from the key. Every answer that is not a 200 is JSON `{error, detail}` "
    "(`ErrorBody`; a 429 adds why and the key's counts and limits, `KeyRefusal`, and a 503 "
    "`overloaded` the limit met, `Overload`): 401 "
    "carries `WWW-Authenticate`, 429 and most 503s `Retry-After`, 405 `Allow`. "
    "A client that disconnects before its answer calls its search off, and its slot is free "
    "once the search has stopped (a turn or so later); the server counts the request as 499 "
    "in `/metrics` (no client receives that status).")

_ERRORS = {
    400: "bad_request: the request cannot be served as given",
    401: "unauthorized: a missing, unknown or revoked API key",
    403: "forbidden: the key may not use this index, or may not write this document (document "
         "writes need an admin key holding the document's groups)",
    404: "index_not_found, or document_not_found (also for an id the key may not see)",
    409: "index_busy (an ingest or another write holds the index; retry when it is done), or "
         "read_only_index (a declared external index takes no writes)",
    413: "body_too_large: the body is over the service's max_body_bytes",
    415: "unsupported_encoding: the body has a Content-Encoding (gzip, …), send it uncompressed; "
         "or unsupported_media_type: its Content-Type is not JSON in UTF-8 (text/plain, a "
         "form), send Content-Type: application/json (or none)",
    422: "bad_request or question_too_long: a field is missing, malformed or outside its limits "
         "(the detail names it)",
    429: "too_many_requests: this key already has its limit of requests in flight, and its "
         "queue is full, or it has none, or this request waited in it until its deadline "
         "(`KeyRefusal`: the reason, the key's requests running and waiting, its limits)",
    503: "overloaded (`Overload`: the limit met, how many were in use, the limit), "
         "index_starting, backend_unavailable, search_failed, index_incomplete, "
         "write_failed, index_changed, index_misconfigured, keys_unavailable, not_ready or "
         "shutting_down: the service cannot answer now",
    504: "deadline_exceeded: no branch finished within the request's deadline",
}
_HEADERS = {
    401: {"WWW-Authenticate": {"description": "`Bearer realm=\"branchsearch\"`",
                               "schema": {"type": "string"}}},
    429: {"Retry-After": {"description": "seconds to wait before retrying",
                          "schema": {"type": "integer"}}},
    503: {"Retry-After": {"description": "seconds to wait before retrying (when retrying can "
                                         "help)", "schema": {"type": "integer"}}},
}


def _answers(ok, *errors: int, alt: dict | None = None) -> dict:
    """The `responses` of a route: its 200 model (and other content types), and the error
    statuses it can answer, each with the one error body. Declaring 422 here also replaces
    FastAPI's default validation-error body, which this server never sends."""
    out: dict = {200: {"model": ok, **({"content": alt} if alt else {})}}
    for status in errors:
        model = {429: KeyRefusal, 503: Union[Overload, ErrorBody]}.get(status, ErrorBody)
        out[status] = {"model": model,
                       "description": _ERRORS[status]}
        if status in _HEADERS:
            out[status]["headers"] = _HEADERS[status]
    return out
