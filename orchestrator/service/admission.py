"""Admission: the limits that protect the cluster (body size, per-key and total concurrency)
and the refusals they answer with. Plain classes, no FastAPI, no Serve."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, fields

from branchsearch.infra.config.settings import Settings
from branchsearch.infra.errors import SettingsError
from branchsearch.orchestrator.service.errors import ApiError

_DEFAULTS = Settings()


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


def check_body_size(length: int | None, limits: Limits) -> None:
    if length is not None and length > limits.max_body_bytes:
        raise ApiError(413, "body_too_large", f"request body of {length} bytes; the limit is "
                                              f"{limits.max_body_bytes}")


class Slot:
    """One admitted request's place in its key's count (and the server's), held while any of
    its work runs: the request, and a search's own thread that outlives it (`hold`, `let_go`:
    freed when the last lets go). `stop` is set when its caller went away: the search's
    branches end at their next step, and the slot is free once they have."""

    def __init__(self, free):
        self._free, self._users, self._lock = free, 1, threading.Lock()
        self.stop = threading.Event()

    def hold(self) -> None:
        with self._lock:
            self._users += 1

    def let_go(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users:
                return
        self._free()


class Concurrency:
    """In-flight requests per key and in total; refusals are 429 (per key) or 503 (total)."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self._lock = threading.Lock()
        self._per_key: dict[str, int] = {}
        self.total = 0

    def take(self, key_name: str) -> Slot:
        """A slot of `key_name`'s, held until its last user lets go (`Slot`); ApiError 503
        when the server has `max_in_flight`, 429 when the key has its limit."""
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
        return Slot(lambda: self._free(key_name))

    @contextmanager
    def slot(self, key_name: str):
        """A slot (`take`) for the `with` block."""
        slot = self.take(key_name)
        try:
            yield slot
        finally:
            slot.let_go()

    def _free(self, key_name: str) -> None:
        with self._lock:
            self.total -= 1
            left = self._per_key[key_name] - 1
            if left:
                self._per_key[key_name] = left
            else:
                del self._per_key[key_name]
