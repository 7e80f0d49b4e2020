"""Admission: the limits that protect the cluster (body size, per-key and total concurrency)
and the refusals they answer with. Plain classes, no FastAPI, no Serve."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace

from branchsearch.infra.config.settings import Settings
from branchsearch.infra.errors import SettingsError, overload
from branchsearch.orchestrator.service.errors import ApiError

_DEFAULTS = Settings()
# why a key's request was refused 429 (its body's `reason`): its queue held `per_key_queue`
# requests already, the key has no queue (`per_key_queue` 0), it waited in the queue until its
# deadline, or its caller does not wait (`Concurrency.take`; no HTTP request is refused so)
QUEUE_FULL, NO_QUEUE, DEADLINE_IN_QUEUE, NO_WAIT = ("queue_full", "no_queue",
                                                    "deadline_in_queue", "no_wait")


@dataclass(frozen=True)
class Limits:
    """The service's limits, as the settings give them (`[service]` in a settings file,
    BRANCHSEARCH_PER_KEY_CONCURRENCY, …; defaults and meanings: `infra.config.settings`)."""
    max_body_bytes: int = _DEFAULTS.max_body_bytes
    max_question_chars: int = _DEFAULTS.max_question_chars
    max_branches: int = _DEFAULTS.max_branches
    max_k: int = min(_DEFAULTS.max_k, _DEFAULTS.final_k)
    default_deadline_s: float = _DEFAULTS.default_deadline_s
    max_deadline_s: float = _DEFAULTS.max_deadline_s
    per_key_concurrency: int = _DEFAULTS.per_key_concurrency
    per_key_queue: int = _DEFAULTS.per_key_queue
    max_in_flight: int = _DEFAULTS.max_in_flight
    retry_after_s: int = _DEFAULTS.retry_after_s
    index_idle_close_s: float = _DEFAULTS.index_idle_close_s
    max_open_indexes: int = _DEFAULTS.max_open_indexes

    @classmethod
    def of(cls, settings: Settings, **changes) -> "Limits":
        """The limits `settings` give, with `changes` (a Ray Serve config's `limits`) over
        them, checked as any setting is (`SettingsError`: a name that is no limit, a value out
        of range). `max_k` is at most `final_k`: a search returns no more chunks than that, so
        a larger `k` would be accepted and not honoured."""
        unknown = sorted(set(changes) - {f.name for f in fields(cls)})
        if unknown:
            raise SettingsError(f"limits: {', '.join(map(repr, unknown))} is not a limit (the "
                                f"limits: {', '.join(f.name for f in fields(cls))})")
        limits = settings.replace(**changes).section("service")
        return cls(**{**limits, "max_k": min(limits["max_k"], settings.final_k)})


def for_replica(limits: Limits, max_ongoing: int) -> Limits:
    """`limits` as a Ray Serve searcher replica applies them: there a request waiting for its
    key's slot holds one of the replica's `max_ongoing` requests (`searcher_max_ongoing`), so
    a key's queue is cut to keep its running and waiting requests to half of them at most
    (none past its slots when its slots alone take that): one caller's burst cannot fill a
    replica that every caller shares."""
    room = max(max_ongoing // 2 - limits.per_key_concurrency, 0)
    return replace(limits, per_key_queue=min(limits.per_key_queue, room))


# the media types a body may be declared as: JSON (`application/*+json` too), and JSONL, which a
# document upload may be (`application/x-ndjson`, as docs/service.md sends it, or another of the
# names JSON Lines tools send: `application/jsonlines` is SageMaker's)
_JSON_TYPES = frozenset({"application/json", "application/x-ndjson", "application/jsonl",
                         "application/x-jsonlines", "application/jsonlines"})
_BODY_METHODS = ("POST", "PUT", "PATCH")


def check_body_headers(method: str, headers: dict[bytes, bytes]) -> None:
    """A body this API can read, as its headers declare it (a request with a body: POST, PUT,
    PATCH): uncompressed (`check_body_encoding`) and JSON (`check_body_type`); ApiError 415
    otherwise, before the body is read."""
    if method not in _BODY_METHODS:
        return
    encoding = headers.get(b"content-encoding")
    if encoding is not None:
        check_body_encoding(encoding.decode("latin-1"))
    declared = headers.get(b"content-type")
    if declared is not None:
        check_body_type(declared.decode("latin-1"))


def check_body_type(content_type: str) -> None:
    """A body declared as JSON in UTF-8, or not declared (the body is read as JSON). One
    declared as something else (`text/plain`, or `application/x-www-form-urlencoded`, which
    `curl -d` sends without `-H`) would be read as JSON all the same, so a client that sends
    form fields or another charset learns it only from a 422 about the text, or not at all:
    415 naming the header to send."""
    media, *params = content_type.split(";")
    media = media.strip().lower()
    if not media:
        return
    charset = next((v.strip().strip('"').lower() for k, _, v in (p.partition("=") for p in params)
                    if k.strip().lower() == "charset"), "utf-8")
    json_like = media in _JSON_TYPES or (media.startswith("application/")
                                         and media.endswith("+json"))
    if not json_like or charset not in ("utf-8", "utf8", "us-ascii", "ascii"):  # ASCII is UTF-8
        shown = " ".join(content_type.split())[:80]
        raise ApiError(415, "unsupported_media_type", f"the body is sent as Content-Type "
                       f"{shown}; this API reads JSON in UTF-8: send Content-Type: "
                       "application/json")


def check_body_encoding(encoding: str) -> None:
    """A body this API can read: uncompressed. A compressed one (`Content-Encoding: gzip`)
    would otherwise be read as its compressed bytes and refused as text that is not UTF-8, and
    one labelled compressed but sent plain is not what its sender says it is: 415 for either."""
    if encoding.strip().lower() not in ("", "identity"):
        shown = " ".join(encoding.split())[:40]
        raise ApiError(415, "unsupported_encoding", f"the body is sent with Content-Encoding "
                       f"{shown}; this API takes bodies uncompressed (no Content-Encoding, or "
                       "identity)")


def check_declared_size(headers: dict[bytes, bytes], limits: Limits) -> None:
    """A body whose Content-Length is over `max_body_bytes`: 413 before a byte of it is read.
    One sent without it (chunked), or with one that is not a number, is measured as it is
    read (`check_body_size`)."""
    try:
        length = int(headers.get(b"content-length", b""))
    except ValueError:
        return
    check_body_size(length, limits)


def check_body_size(length: int | None, limits: Limits) -> None:
    if length is not None and length > limits.max_body_bytes:
        raise ApiError(413, "body_too_large", f"request body of {length} bytes; the limit is "
                                              f"{limits.max_body_bytes}")


class Slot:
    """One admitted request's place in its key's count (and the server's), held while any of
    its work runs: the request, and a search's own thread that outlives it (`hold`, `let_go`:
    freed when the last lets go). `stop` is set when its caller went away: the search's
    branches end at their next step, and the slot is free once they have. A search's thread
    still running at its request's deadline gives its key's place back then (`outlive`):
    whatever it waits on, the deadline bounds how long a key's slot is held; the server's
    count (`max_in_flight`) keeps it until it ends, so threads stuck on a backend stay
    bounded, and counted apart (`Concurrency.past_deadline`)."""

    def __init__(self, free, keep):
        self._free, self._keep, self._users, self._lock = free, keep, 1, threading.Lock()
        self.stop = threading.Event()

    def hold(self) -> Callable[[], None]:
        """One more user; returns its let-go, which counts once however often it is called
        (the user's end, or its deadline, whichever comes first)."""
        with self._lock:
            self._users += 1
        gone = []

        def let_go() -> None:
            with self._lock:
                if gone:
                    return
                gone.append(True)
            self.let_go()
        return let_go

    def outlive(self, let_go: Callable[[], None]) -> Callable[[], None]:
        """A user (`hold`'s `let_go`) that runs on past its request's deadline: its place in
        the key's count is given back now, and it keeps a count of its own in the server's
        until it calls what this returns (once; its end)."""
        end = self._keep()
        let_go()
        return end

    def let_go(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users:
                return
        self._free()


class _Waiter:
    """A request waiting for one of its key's slots: woken on its own event loop when a slot
    is handed to it (`granted`, set under the `Concurrency` lock)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.future, self.granted = loop, loop.create_future(), False

    def wake(self) -> bool:
        """Hand it the slot; False when its loop has closed (a stopped server): no one to run."""
        try:
            self.loop.call_soon_threadsafe(
                lambda: self.future.done() or self.future.set_result(None))
        except RuntimeError:
            return False
        self.granted = True
        return True


class Concurrency:
    """In-flight requests per key and in total; refusals are 429 (per key) or 503 (total).

    A burst from one caller (a web app behind one key) is not refused past the key's
    `per_key_concurrency` at once: up to `per_key_queue` more of its requests wait, first come
    first served, for one of its slots (`admit`), each at most until its deadline; a slot a
    request frees goes to its key's first waiter. Waiting requests run nothing and hold none of
    the server's `max_in_flight`, and a key never has more than `per_key_concurrency` running:
    other keys' requests are admitted by their own counts, whatever one key sends."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self._lock = threading.Lock()
        self._per_key: dict[str, int] = {}
        self._waiting: dict[str, deque[_Waiter]] = {}
        self.total = 0
        # of `total`, the searches whose caller had its 504 while their thread still waits on
        # a backend (`Slot.outlive`): they hold the server's places until they end
        self.past_deadline = 0

    def take(self, key_name: str) -> Slot:
        """A slot of `key_name`'s, held until its last user lets go (`Slot`); ApiError 503
        when the server has `max_in_flight`, 429 when the key has its limit (this caller does
        not wait: reason `no_wait` when the key's queue has room)."""
        with self._lock:
            if (busy := self._server_refusal()) is not None:
                raise busy
            if self._key_full(key_name):
                raise self._key_refusal(key_name, self._refused_at_once(key_name))
            return self._grant(key_name)

    async def admit(self, key_name: str, until: float) -> Slot:
        """A slot of `key_name`'s (`take`), waited for when the key has its limit and fewer
        than `per_key_queue` of its requests wait already, at most until `until` (monotonic:
        the request's deadline); 429 past either (reason `queue_full`, `no_queue` when
        `per_key_queue` is 0, `deadline_in_queue`), 503 when the server has `max_in_flight`."""
        with self._lock:
            if (busy := self._server_refusal()) is not None:
                raise busy
            if not self._key_full(key_name):
                return self._grant(key_name)
            if len(self._waiting.get(key_name, ())) >= self.limits.per_key_queue:
                raise self._key_refusal(key_name, self._refused_at_once(key_name))
            waiter = _Waiter(asyncio.get_running_loop())
            self._waiting.setdefault(key_name, deque()).append(waiter)
        began = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future),
                                   max(until - time.monotonic(), 0.0))
        except BaseException as exc:  # timed out, or its caller went away
            with self._lock:
                granted = waiter.granted
                if not granted:
                    self._waiting[key_name].remove(waiter)
                    if not self._waiting[key_name]:
                        del self._waiting[key_name]
            if granted:  # handed a slot as it gave up: the next waiter's
                self._free(key_name)
            if isinstance(exc, asyncio.TimeoutError):
                with self._lock:
                    late = self._key_refusal(key_name, DEADLINE_IN_QUEUE, began)
                raise late from None
            raise
        return Slot(lambda: self._free(key_name), self._keep)

    def waiting(self, key_name: str) -> int:
        """How many of `key_name`'s requests wait for one of its slots now."""
        with self._lock:
            return len(self._waiting.get(key_name, ()))

    def _grant(self, key_name: str) -> Slot:
        """A slot of `key_name`'s, counted for the key and the server. Holding the lock."""
        self._per_key[key_name] = self._per_key.get(key_name, 0) + 1
        self.total += 1
        return Slot(lambda: self._free(key_name), self._keep)

    def _keep(self) -> Callable[[], None]:
        """One more in the server's count, for a search's thread that runs on past its
        request (`Slot.outlive`); returns its end, which counts once."""
        with self._lock:
            self.total += 1
            self.past_deadline += 1
        ended = []

        def end() -> None:
            with self._lock:
                if not ended:
                    ended.append(True)
                    self.total -= 1
                    self.past_deadline -= 1
        return end

    def _server_refusal(self) -> ApiError | None:
        """The 503 when the server runs `max_in_flight` requests: a line for people, and as
        fields (`Overload` in the OpenAPI schema) the limit met, the requests in flight, the
        limit, and how many of those requests are past their deadline (`past_deadline`: their
        callers had their 504, their searches still wait on a backend; the line says so when
        any are, since more load is then not the cause). Holding the lock."""
        if self.total >= self.limits.max_in_flight:
            stuck = self.past_deadline
            detail = f"{_requests(self.total)} in flight"
            if stuck:
                detail += (f" ({stuck} of them past the deadline, answered 504 and still "
                           "waiting on a backend)")
            return ApiError(503, "overloaded", f"{detail}; the server takes "
                            f"{self.limits.max_in_flight}",
                            {"Retry-After": str(self.limits.retry_after_s)},
                            overload("max_in_flight", self.total,
                                     max_in_flight=self.limits.max_in_flight)
                            | {"past_deadline": stuck})
        return None

    def _key_full(self, key_name: str) -> bool:
        """A request of `key_name`'s may not start now: its slots are taken, or others of its
        requests wait for them first. Holding the lock."""
        return (self._per_key.get(key_name, 0) >= self.limits.per_key_concurrency
                or bool(self._waiting.get(key_name)))

    def _refused_at_once(self, key_name: str) -> str:
        """Why a request of `key_name`'s that may not start waits for nothing: the key has no
        queue, its queue is full, or (`take`) its caller does not wait. Holding the lock."""
        if not self.limits.per_key_queue:
            return NO_QUEUE
        if len(self._waiting.get(key_name, ())) >= self.limits.per_key_queue:
            return QUEUE_FULL
        return NO_WAIT

    def _key_refusal(self, key_name: str, reason: str, began: float | None = None) -> ApiError:
        """The 429 of a request of `key_name`'s: a line for people, and as fields (`KeyRefusal`
        in the OpenAPI schema) `reason`, how many of the key's requests run and wait now, and
        the key's `limits` as this server applies them (a Ray Serve replica's `per_key_queue`
        is cut: `for_replica`). `began`: when it began to wait. Holding the lock."""
        running, waiting = self._per_key.get(key_name, 0), len(self._waiting.get(key_name, ()))
        slots, queue = self.limits.per_key_concurrency, self.limits.per_key_queue
        if reason == DEADLINE_IN_QUEUE:
            detail = (f"key {key_name!r} had its {_requests(slots)} in flight for the "
                      f"{time.monotonic() - began:.1f} s this one could wait (its deadline)")
        elif reason == QUEUE_FULL:
            detail = (f"key {key_name!r} has {_requests(running)} in flight and {waiting} "
                      f"waiting; the limits are {slots} and {queue} (per_key_queue)")
        elif reason == NO_QUEUE:
            detail = (f"key {key_name!r} has {_requests(running)} in flight; the limit is {slots} "
                      "and no request waits for a slot (per_key_queue 0)")
        else:
            detail = f"key {key_name!r} has {_requests(running)} in flight; the limit is {slots}"
        return ApiError(429, "too_many_requests", detail,
                        {"Retry-After": str(self.limits.retry_after_s)},
                        {"reason": reason, "running": running, "waiting": waiting,
                         "limits": {"per_key_concurrency": slots, "per_key_queue": queue}})

    @contextmanager
    def slot(self, key_name: str):
        """A slot (`take`) for the `with` block."""
        slot = self.take(key_name)
        try:
            yield slot
        finally:
            slot.let_go()

    def _free(self, key_name: str) -> None:
        """The slot back: to the key's first waiter (it keeps the counts), else counted free."""
        with self._lock:
            while waiting := self._waiting.get(key_name):
                waiter = waiting.popleft()
                if not waiting:
                    del self._waiting[key_name]
                if waiter.wake():
                    return
            self.total -= 1
            left = self._per_key[key_name] - 1
            if left:
                self._per_key[key_name] = left
            else:
                del self._per_key[key_name]


def _requests(n: int) -> str:
    return f"{n} request" if n == 1 else f"{n} requests"
