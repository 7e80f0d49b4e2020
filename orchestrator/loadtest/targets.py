"""What receives the load: the driver in this process (local or on Ray), or the HTTP service.

A target answers one question with the SearchResult as a JSON-able dict, or raises
`RequestFailed` with an outcome class (`http_503:backend_unavailable`, `error:Timeout`, …).
`classify` turns a result into the figures a sample keeps. A `deadline_s` given to `search`
bounds that one request (the shorter of it and the target's own). Both targets are thread-safe: the
generator calls `search` from many threads at once.
"""

from __future__ import annotations

import json
import math
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Protocol


DEADLINE_GRACE_S = 1.0  # a request with its own deadline: how long past it the client waits
MAX_BACK_OFF_S = 60.0  # the longest `Retry-After` a refused user waits (the locustfile's too)


def retry_after_s(value: str | None) -> float | None:
    """The seconds a `Retry-After` header asks a client to wait, from 0 to `MAX_BACK_OFF_S`;
    None without one, or when it is no number of seconds (an HTTP date, a word): the client
    then waits what it would without the header."""
    try:
        seconds = float(value or "")
    except ValueError:
        return None
    return min(max(seconds, 0.0), MAX_BACK_OFF_S) if math.isfinite(seconds) else None


class RequestFailed(Exception):
    """A request that got no result: its `outcome` class, `body`, the service's JSON error
    answer when there was one (a 429's `reason`, `limits`, … `service.admission`), and
    `retry_after_s`, the wait its `Retry-After` asked for (None without one)."""

    def __init__(self, outcome: str, detail: str = "", body: dict | None = None,
                 retry_after_s: float | None = None):
        super().__init__(detail or outcome)
        self.outcome, self.body, self.retry_after_s = outcome, body or {}, retry_after_s


def was_taken(outcome: str, body: dict | None = None) -> bool:
    """The service took the request on: it was answered, ran into its deadline or a backend
    down (504, 503 `backend_unavailable`/`search_failed`, 500), waited in its key's queue
    until its deadline (a 429 `deadline_in_queue`), or the client stopped waiting for it. A
    request refused at once (429, 503 `overloaded`), turned down (4xx) or that reached nothing
    was never under way at the service."""
    from branchsearch.orchestrator.loadtest.stats import BACKEND_CODES, error_code

    status = outcome.split(":", 1)[0]
    if status == "http_429":
        return (body or {}).get("reason") == "deadline_in_queue"
    if status == "http_503":
        return error_code(outcome) in BACKEND_CODES
    if status == "error":
        return outcome == "error:Timeout"
    return not status.startswith("http_4")


def most_at_once(spans: list[tuple[float, float]], before: float = float("inf")) -> int:
    """The most of `spans` (start, end) that overlap at any moment earlier than `before` (one
    ending as another starts does not overlap it)."""
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    most = now = 0
    for at, step in events:
        if at >= before:
            break
        now += step
        most = max(most, now)
    return most


FOLD_AT = 4096  # a key's spans kept before those that can overlap no later one are folded


class Target(Protocol):
    def search(self, question: str, *, deadline_s: float | None = None) -> dict: ...

    def describe(self) -> dict: ...

    def close(self) -> None: ...


def result_status(result: dict) -> str:
    """`status` of a result dict (ok | partial | failed): its own, else the one rule
    (`orchestrator.result.result_status`) over its branches."""
    from branchsearch.orchestrator.result import result_status as rule

    return str(result.get("status") or rule(b.get("status") for b in result.get("branches", [])))


def stage_times(result: dict) -> dict[str, float]:
    """Server-side seconds per stage, from what the result's metrics carry: queue, plan, the
    slowest branch, retrieval backend and policy (LLM engine) time of the slowest-on-that-stage
    branch, fusion, and the driver's total (`server`); without a plan time, `outside_branches`
    is the driver's total less the branches' wall time (plan, dispatch, fusion). Stages the
    result does not report are absent."""
    metrics, branches = result.get("metrics") or {}, result.get("branches") or []
    out: dict[str, float] = {}
    named = {"queue": "queue_s", "plan": "plan_s", "fusion": "fusion_s", "server": "latency_s"}
    for stage, key in named.items():
        if isinstance(metrics.get(key), (int, float)):
            out[stage] = float(metrics[key])
    if isinstance(metrics.get("branch_latency_s_max"), (int, float)):
        out["slowest_branch"] = float(metrics["branch_latency_s_max"])
    elif branches:
        out["slowest_branch"] = max(float(b.get("latency_s") or 0) for b in branches)
    for stage, key in (("backend", "backend_s"), ("policy", "policy_s"), ("rpc", "rpc_s")):
        values = [float(b[key]) for b in branches if isinstance(b.get(key), (int, float))]
        if values:
            out[stage] = max(values)
    if "server" in out and "slowest_branch" in out and "plan" not in out:
        # planning, dispatch and fusion together, when the driver does not time them apart;
        # branches ran one after another (the local executor) when their sum fits in the total
        total = metrics.get("branch_latency_s_sum")
        wall = total if isinstance(total, (int, float)) and total <= out["server"] \
            else out["slowest_branch"]
        out["outside_branches"] = max(out["server"] - wall, 0.0)
    for key, value in metrics.items():  # stages added later (e.g. engine_s) show up as they are
        if key.endswith("_s") and isinstance(value, (int, float)) and not key.startswith(
                ("latency", "branch_latency")) and key[:-2] not in out \
                and key not in named.values():
            out[key[:-2]] = float(value)
    return out


def classify(result: dict) -> dict:
    """The sample fields of one answered request."""
    statuses = Counter(b.get("status") for b in result.get("branches") or [])
    metrics = result.get("metrics") or {}
    return {"outcome": result_status(result), "stages": stage_times(result),
            "tokens_read": int(metrics.get("tokens_read") or 0),
            "branch_status": {f"branch_{s}": n for s, n in statuses.items() if s != "ok"}}


def failure_code(result: dict) -> str:
    """The code the service answers a failed result with (`service.searcher`), '' for one it
    answers: every branch failed, not every one for lack of time (that is a 504, a deadline
    missed, which load can cause) — `backend_unavailable` when each that erred ended on its
    backend (`backend_error`: it stayed down through the retries), else `search_failed`."""
    branches = result.get("branches") or []
    if result_status(result) != "failed" or all(b.get("status") == "timeout" for b in branches):
        return ""
    erred = [b for b in branches if b.get("status") == "error"]
    return ("backend_unavailable" if erred and all(b.get("termination") == "backend_error"
                                                   for b in erred) else "search_failed")


def shorter(own: float | None, given: float | None) -> float | None:
    """The shorter of two deadlines, either absent."""
    return min((d for d in (own, given) if d is not None), default=None)


class DriverTarget:
    """`Driver.search` called directly (the driver runs branches in-process or on Ray). A
    search the service would answer with a 503 saying it cannot search (every branch failed,
    a backend down) is `RequestFailed` with outcome `unavailable:<that code>`: the same
    `stats.is_unavailable` reads both targets, so neither reads a dead backend as saturation."""

    def __init__(self, driver, *, branches: int | None = None, deadline_s: float | None = None):
        self.driver, self.branches, self.deadline_s = driver, branches, deadline_s

    def search(self, question: str, *, deadline_s: float | None = None) -> dict:
        from branchsearch.infra.errors import BackendUnavailable
        from branchsearch.orchestrator.loadtest.stats import UNAVAILABLE

        try:
            result = self.driver.search(question, max_branches=self.branches,
                                        deadline_s=shorter(self.deadline_s, deadline_s)
                                        ).to_dict()
        except BackendUnavailable as exc:  # the service's 503 backend_unavailable (api_error)
            raise RequestFailed(f"{UNAVAILABLE}:backend_unavailable", str(exc)[:300]) from None
        except Exception as exc:  # the driver raised: the whole request failed
            raise RequestFailed(f"error:{type(exc).__name__}", str(exc)[:300]) from None
        code = failure_code(result)
        if code:
            why = "; ".join(sorted({b.get("error") or b.get("status", "")
                                    for b in result.get("branches") or []}))
            raise RequestFailed(f"{UNAVAILABLE}:{code}", why[:300])
        return result

    def describe(self) -> dict:
        out = {"kind": "driver", "executor": self.driver.mode, "index": self.driver.settings.index,
               "policy": self.driver.settings.policy, "planner": self.driver.settings.planner,
               "branches": self.branches or self.driver.settings.branches}
        return out

    def close(self) -> None:
        self.driver.close()


class HttpTarget:
    """POST {url}/v1/search with a bearer key (of several: the one with the fewest requests
    under way); one connection per request (urllib)."""

    def __init__(self, url: str, keys: str | Sequence[str] = (), *, index: str | None = None,
                 branches: int | None = None, k: int | None = None,
                 deadline_s: float | None = None, timeout_s: float = 120.0):
        self.url = url.rstrip("/")
        self.keys = tuple(k_ for k_ in ((keys,) if isinstance(keys, str) else keys) if k_)
        # when each request under way was sent, by key (a token each)
        self._in_flight: dict[str | None, dict[object, float]] = {
            k_: {} for k_ in self.keys or (None,)}
        self._lock = threading.Lock()
        # (sent, done) of each load request the service took on (`was_taken`), by key, and the
        # most of them at once before the spans `_fold` dropped (a long run keeps few spans)
        self._taken: dict[str | None, list[tuple[float, float]]] = {k_: [] for k_ in
                                                                     self._in_flight}
        self._folded = dict.fromkeys(self._in_flight, 0)
        self._fold_at = dict.fromkeys(self._in_flight, FOLD_AT)
        # a key's per_key_concurrency and per_key_queue, as a 429 said them (None: not said)
        self.key_slots: int | None = None
        self.key_queue: int | None = None
        self.key_refusals: Counter = Counter()  # the load's 429s by their `reason`
        # the load's 503 `overloaded` by their `reason` (a server limit: max_in_flight, …), and
        # for each reason the limits its answers gave, by setting name
        self.server_refusals: Counter = Counter()
        self.server_limits: dict[str, dict[str, int]] = {}
        self.timeout_s = timeout_s
        self.body = {k_: v for k_, v in {"index": index, "branches": branches, "k": k,
                                          "deadline_s": deadline_s}.items() if v is not None}

    @contextmanager
    def _key(self):
        """The key with the fewest requests under way (the first when tied), held for one
        request: a key's requests in flight stay within one of every other key's, as many
        callers would load the service, whatever the loop. Without keys, the requests are
        counted as one key's (a development server gives them all one)."""
        token = object()
        with self._lock:
            key = min(self._in_flight, key=lambda k_: len(self._in_flight[k_]))
            self._in_flight[key][token] = sent = time.monotonic()
        try:
            yield key, sent
        finally:
            with self._lock:
                del self._in_flight[key][token]

    @property
    def most_per_key(self) -> int:
        """The most of one key's load requests that the service had under way at once, as
        this client saw them (sent to answered, those it refused at once left out), and never
        more than a key's slots and queue (`key_slots` + `key_queue`, when a 429 said them):
        an answer still on its way back overlaps the next request sent."""
        with self._lock:
            most = max((max(self._folded[k_], most_at_once(spans))
                        for k_, spans in self._taken.items()), default=0)
        if self.key_slots is not None and self.key_queue is not None:
            most = min(most, self.key_slots + self.key_queue)
        return most

    def search(self, question: str, key: str | None = None, *,
               deadline_s: float | None = None) -> dict:
        """The answer to `question`, asked with the least busy key (or with `key`); with
        `deadline_s`, the service is asked to answer within it and the client waits
        `DEADLINE_GRACE_S` past it (a frozen service costs that, not `timeout_s`)."""
        if key is not None:
            return self._search(question, key, deadline_s)
        with self._key() as (least_busy, sent):
            try:
                result = self._search(question, least_busy, deadline_s)
            except RequestFailed as exc:
                self._count(least_busy, sent, exc.outcome, exc.body)
                raise
            self._count(least_busy, sent, "")
            return result

    def _count(self, key: str | None, sent: float, outcome: str, body: dict | None = None
               ) -> None:
        """Keep a load request's span when the service took it on, a 429's reason, and a 503
        `overloaded`'s reason and limits (its fields, `service.protocol.Overload`)."""
        with self._lock:
            if was_taken(outcome, body):
                self._taken[key].append((sent, time.monotonic()))
                if len(self._taken[key]) >= self._fold_at[key]:
                    self._fold(key)
            if outcome.startswith("http_429") and (body or {}).get("reason"):
                self.key_refusals[str(body["reason"])] += 1
            if outcome == "http_503:overloaded" and (body or {}).get("reason"):
                self.server_refusals[str(body["reason"])] += 1
                limits = body.get("limits")
                if isinstance(limits, dict):
                    self.server_limits[str(body["reason"])] = {
                        str(k): v for k, v in limits.items() if isinstance(v, int)}

    def _fold(self, key: str | None) -> None:
        """Fold `key`'s spans that can overlap no later one into its most at once: a request
        not yet counted was sent no earlier than the first one still under way, so a span
        that ended by then is counted now and dropped. Memory stays bounded on an hour's
        run; a request that never ends keeps the spans after it (folded again at twice as
        many)."""
        spans = self._taken[key]
        settled = min(self._in_flight[key].values(), default=time.monotonic())
        self._folded[key] = max(self._folded[key], most_at_once(spans, before=settled))
        spans[:] = [span for span in spans if span[1] > settled]
        self._fold_at[key] = max(FOLD_AT, 2 * len(spans))

    def _search(self, question: str, key: str | None, deadline_s: float | None = None) -> dict:
        body, timeout_s = {"question": question, **self.body}, self.timeout_s
        if deadline_s is not None:
            body["deadline_s"] = shorter(self.body.get("deadline_s"), deadline_s)
            timeout_s = min(timeout_s, body["deadline_s"] + DEADLINE_GRACE_S)
        request = urllib.request.Request(
            f"{self.url}/v1/search", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Accept": "application/json",
                     **({"Authorization": f"Bearer {key}"} if key else {})})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            try:
                body = json.loads(exc.read())
                code, detail = str(body.get("error", "")), str(body.get("detail", ""))
            except (ValueError, AttributeError, OSError):
                body, code, detail = {}, "", ""
            if exc.code == 429:
                self._read_key_limits(body)
            raise RequestFailed(f"http_{exc.code}" + (f":{code}" if code else ""),
                                detail[:300], body,
                                retry_after_s(exc.headers.get("Retry-After"))) from None
        except (TimeoutError, socket.timeout):
            raise RequestFailed("error:Timeout") from None
        except urllib.error.URLError as exc:
            reason = exc.reason
            name = "Timeout" if isinstance(reason, (TimeoutError, socket.timeout)) \
                else type(reason).__name__
            raise RequestFailed(f"error:{name}", str(reason)) from None
        except (ConnectionError, OSError) as exc:
            raise RequestFailed(f"error:{type(exc).__name__}", str(exc)) from None
        except ValueError:
            raise RequestFailed("error:BadResponse", "the answer is not JSON") from None

    def _read_key_limits(self, body: dict) -> None:
        """Keep the key limits a 429's body gives (`limits`: its per_key_concurrency and
        per_key_queue, as the service applies them); nothing from a service that gives none."""
        limits = body.get("limits")
        if not isinstance(limits, dict):
            return
        slots, queue = limits.get("per_key_concurrency"), limits.get("per_key_queue")
        with self._lock:
            if isinstance(slots, int) and isinstance(queue, int):
                self.key_slots, self.key_queue = slots, queue

    def get(self, path: str, timeout_s: float = 5.0) -> str | None:
        """GET a side endpoint (e.g. /metrics) as text; None if it does not answer."""
        request = urllib.request.Request(
            f"{self.url}{path}",
            headers={"Authorization": f"Bearer {self.keys[0]}"} if self.keys else {})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return response.read().decode("utf-8", "replace")
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def describe(self) -> dict:
        return {"kind": "service", "url": self.url, **self.body}

    def close(self) -> None:
        pass
