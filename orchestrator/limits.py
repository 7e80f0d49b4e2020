"""Limits that protect the cluster, and the HTTP errors they answer with.

Plain functions and classes (no FastAPI, no Serve): the request's body is checked here, the
per-key concurrency is counted here, and every refusal is an `ApiError` carrying its HTTP status,
a short error code and one line of detail — what the caller sees as `{error, detail}`.
"""

from __future__ import annotations

import logging
import math
import threading
from contextlib import contextmanager
from dataclasses import dataclass

from branchsearch.infra.errors import (BackendUnavailable, BadQuery, BranchsearchError,
                                       CorpusError, IndexBusy, IndexIncomplete, IndexNotFound,
                                       KeysFileError)
from branchsearch.workers.tools import has_words

log = logging.getLogger("branchsearch.service")


class ApiError(Exception):
    """An answer other than 200: `status`, `error` (a code), `detail` (one line), headers."""

    def __init__(self, status: int, error: str, detail: str, headers: dict | None = None):
        super().__init__(detail)
        self.status, self.error, self.detail = status, error, detail
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": self.error, "detail": self.detail}

    def __reduce__(self):  # crosses Ray Serve handles intact
        return (ApiError, (self.status, self.error, self.detail, self.headers))


def api_error(exc: BaseException) -> ApiError:
    """Map any exception to what a caller may see; unknown exceptions say only their type."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, BackendUnavailable):
        return ApiError(503, "backend_unavailable", str(exc))
    if isinstance(exc, IndexBusy):  # an ingest holds the index (infra.manifest); which one
        log.warning("index busy: %s", exc)  # (its PID and corpus path) is the server's
        return ApiError(409, "index_busy", "an ingest or another write is updating the index "
                        "right now; retry when it has finished")
    if isinstance(exc, IndexIncomplete):  # an ingest to finish, or store files gone: the server's
        log.warning("index unavailable: %s", exc)  # the operator's fix names server paths
        return ApiError(503, "index_incomplete", "the index is incomplete or damaged on the "
                        "server; its operator must finish or repair it (the server log says how)")
    if isinstance(exc, KeysFileError):  # names the server's file: logged, not sent
        log.error("%s", exc)
        return ApiError(503, "keys_unavailable", "the server cannot read its API keys file; "
                        "its operator must fix it (the server log says how)")
    if isinstance(exc, IndexNotFound):
        return ApiError(404, "index_not_found", str(exc))
    if isinstance(exc, (BadQuery, CorpusError)):
        return ApiError(422, "bad_request", str(exc))
    if isinstance(exc, BranchsearchError):
        return ApiError(400, "bad_request", str(exc))
    if isinstance(exc, TimeoutError):
        return ApiError(504, "deadline_exceeded", str(exc) or "the search did not finish in time")
    return ApiError(500, "internal_error", f"{type(exc).__name__} (details in the server log)")


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 1 << 20  # request bodies (documents PUT included)
    max_question_chars: int = 1000
    max_branches: int = 8
    max_k: int = 50
    default_deadline_s: float = 60.0
    max_deadline_s: float = 300.0
    per_key_concurrency: int = 4
    max_in_flight: int = 64  # whole server (uvicorn mode; Serve uses max_queued_requests)
    retry_after_s: int = 1


@dataclass(frozen=True)
class SearchRequest:
    question: str
    index: str | None = None
    branches: int | None = None
    k: int | None = None
    deadline_s: float | None = None


_FIELDS = {"question", "index", "branches", "k", "deadline_s"}


def parse_search(body: object, limits: Limits) -> SearchRequest:
    """Validate a /v1/search body; ApiError 422 names the first bad field."""
    if not isinstance(body, dict):
        raise ApiError(422, "bad_request", "body must be a JSON object {question, index?, "
                                           "branches?, k?, deadline_s?}")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        hint = " (ACL groups come from the API key)" if any("acl" in u or "group" in u
                                                            for u in unknown) else ""
        raise ApiError(422, "bad_request", f"unknown field(s): {', '.join(unknown)}{hint}")
    question = body.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ApiError(422, "bad_request", "'question' must be a non-empty string")
    if not has_words(question):
        raise ApiError(422, "bad_request", "'question' has no words to search for (only "
                                           "punctuation or symbols)")
    if len(question) > limits.max_question_chars:
        raise ApiError(422, "question_too_long", f"question has {len(question)} characters; "
                                                 f"the limit is {limits.max_question_chars}")
    index = body.get("index")
    if index is not None and (not isinstance(index, str) or not index
                              or not index.replace("-", "").replace("_", "").isalnum()):
        raise ApiError(422, "bad_request", "'index' must be a name of [A-Za-z0-9_-]")
    branches = _int(body, "branches", 1, limits.max_branches)
    k = _int(body, "k", 1, limits.max_k)
    deadline = body.get("deadline_s")
    if deadline is not None:
        if (isinstance(deadline, bool) or not isinstance(deadline, (int, float))
                or not math.isfinite(deadline) or not 0 < deadline <= limits.max_deadline_s):
            raise ApiError(422, "bad_request", f"'deadline_s' must be a number in "
                                               f"(0, {limits.max_deadline_s:g}]")
        deadline = float(deadline)
    return SearchRequest(question.strip(), index, branches, k, deadline)


def _int(body: dict, name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ApiError(422, "bad_request", f"'{name}' must be an integer in [{low}, {high}]")
    return value


def check_body_size(length: int | None, limits: Limits) -> None:
    if length is not None and length > limits.max_body_bytes:
        raise ApiError(413, "body_too_large", f"request body of {length} bytes; the limit is "
                                              f"{limits.max_body_bytes}")


class Concurrency:
    """In-flight requests per key and in total; refusals are 429 (per key) or 503 (total)."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self._lock = threading.Lock()
        self._per_key: dict[str, int] = {}
        self.total = 0

    @contextmanager
    def slot(self, key_name: str):
        with self._lock:
            if self.total >= self.limits.max_in_flight:
                raise ApiError(503, "overloaded", f"{self.total} requests in flight; the server "
                               f"takes {self.limits.max_in_flight}",
                               {"Retry-After": str(self.limits.retry_after_s)})
            used = self._per_key.get(key_name, 0)
            if used >= self.limits.per_key_concurrency:
                raise ApiError(429, "too_many_requests", f"key {key_name!r} has {used} requests "
                               f"in flight; the limit is {self.limits.per_key_concurrency}",
                               {"Retry-After": str(self.limits.retry_after_s)})
            self._per_key[key_name] = used + 1
            self.total += 1
        try:
            yield
        finally:
            with self._lock:
                self.total -= 1
                left = self._per_key[key_name] - 1
                if left:
                    self._per_key[key_name] = left
                else:
                    del self._per_key[key_name]
