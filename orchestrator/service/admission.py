"""Admission: the limits that protect the cluster (body size, per-key and total concurrency)
and the refusals they answer with. Plain classes, no FastAPI, no Serve."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass

from branchsearch.orchestrator.service.errors import ApiError


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
    # an index other than the default unused this long is closed (its retriever process and
    # models freed) and opened again by its next request; 0: kept open until the server stops
    index_idle_close_s: float = 900.0


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
