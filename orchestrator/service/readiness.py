"""Readiness that answers within a probe's timeout, whatever the backends do. Plain threads.

A readiness check probes every open index's backends, and a backend that stops answering (a
frozen Elasticsearch node, a Milvus server under a GC pause) holds a probe until its
`backend_timeout_s` (30 s), far past a load balancer's probe timeout, each probe holding one of
the searcher's threads meanwhile. So one check runs at a time, on a thread of its own, and
probes share checks; a probe waits at most `wait_s` and is told "not ready" past that (a
backend that takes longer to answer a probe is in no state to serve).

A probe is answered by a check that began after it arrived: the check running when it arrives
looked at the backends earlier, and would miss one that recovered, or died, since. So a probe
that arrives while a check runs waits for the next one, which begins as soon as the running one
ends and answers every probe that arrived meanwhile: one check running and at most one waiting,
whatever the number of probes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Generic, TypeVar

T = TypeVar("T")


class Unanswered(Exception):
    """The check a probe waits for has not ended within the probe's wait."""


class SharedCheck(Generic[T]):
    def __init__(self, check: Callable[[], T], wait_s: float = 5.0):
        self.check, self.wait_s = check, wait_s
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="readiness")
        self._lock = threading.Lock()
        self._next: Future | None = None  # the check the probes arriving now share

    def __call__(self) -> T:
        """The answer of a check that begins after this call (its value, or its exception
        raised): the one not yet begun, or a new one, begun once the running one ends;
        `Unanswered` when it has not ended within `wait_s`."""
        with self._lock:
            check = self._next
            if check is None or check.running() or check.done():  # begun before this probe
                check = self._next = self._pool.submit(self.check)
        try:
            return check.result(timeout=self.wait_s)
        except FutureTimeout:
            raise Unanswered(f"the readiness check has not ended within {self.wait_s:g} s "
                             "(an index still starting, or a backend not answering)") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
