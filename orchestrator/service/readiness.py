"""Readiness that answers within a probe's timeout, whatever the backends do. Plain threads.

A readiness check probes every open index's backends, and a backend that stops answering (a
frozen Elasticsearch node, a Milvus server under a GC pause) holds a probe until its
`backend_timeout_s` (30 s), far past a load balancer's probe timeout, each probe holding one of
the searcher's threads meanwhile. So one check runs at a time, on a thread of its own, and
every probe that arrives while it runs shares it; a probe waits at most `wait_s` and is told
"not ready" past that (a backend that takes longer to answer a probe is in no state to serve).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Generic, TypeVar

T = TypeVar("T")


class Unanswered(Exception):
    """The shared check has run for longer than a probe waits."""


class SharedCheck(Generic[T]):
    def __init__(self, check: Callable[[], T], wait_s: float = 5.0):
        self.check, self.wait_s = check, wait_s
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="readiness")
        self._lock = threading.RLock()  # (a done callback may run in the submitting thread)
        self._running: Future | None = None

    def __call__(self) -> T:
        """The answer of the check running now, or of a new one (its value, or its exception
        raised); `Unanswered` when it has not ended within `wait_s`."""
        with self._lock:
            check = self._running
            if check is None:
                check = self._running = self._pool.submit(self.check)
                check.add_done_callback(self._ended)
        try:
            return check.result(timeout=self.wait_s)
        except FutureTimeout:
            raise Unanswered(f"the readiness check has not ended within {self.wait_s:g} s "
                             "(an index still starting, or a backend not answering)") from None

    def _ended(self, check: Future) -> None:
        with self._lock:
            if self._running is check:
                self._running = None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
