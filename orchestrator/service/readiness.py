"""Readiness that answers within a probe's timeout, whatever the backends do. Plain threads,
which a stopping process does not wait for.

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
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Generic, TypeVar

T = TypeVar("T")


class Unanswered(Exception):
    """The check a probe waits for has not ended within the probe's wait."""


def in_thread(fn: Callable[..., T], *args, after: Future | None = None,
              name: str = "probe") -> Future:
    """`fn(*args)` on a daemon thread of its own, started once `after` (if any) has ended.
    The process's exit does not wait for it, as it would for an executor's threads: a probe
    blocked on a frozen backend would hold a stopping server until the backend's timeout."""
    future: Future = Future()

    def run() -> None:
        if future.set_running_or_notify_cancel():  # (False: cancelled before it began)
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 — the caller's to see
                future.set_exception(exc)

    def start(_=None) -> None:
        threading.Thread(target=run, name=name, daemon=True).start()

    if after is None:
        start()
    else:
        after.add_done_callback(start)
    return future


class SharedCheck(Generic[T]):
    def __init__(self, check: Callable[[], T], wait_s: float = 5.0):
        self.check, self.wait_s = check, wait_s
        self._lock = threading.Lock()
        self._next: Future | None = None  # the check the probes arriving now share

    def __call__(self) -> T:
        """The answer of a check that begins after this call (its value, or its exception
        raised): the one not yet begun, or a new one, begun once the running one ends;
        `Unanswered` when it has not ended within `wait_s`."""
        with self._lock:
            check = self._next
            if check is None or check.running() or check.done():  # begun before this probe
                check = self._next = in_thread(self.check, after=check, name="readiness")
        try:
            return check.result(timeout=self.wait_s)
        except FutureTimeout:
            raise Unanswered(f"the readiness check has not ended within {self.wait_s:g} s "
                             "(an index still starting, or a backend not answering)") from None

    def close(self) -> None:
        with self._lock:
            if self._next is not None:
                self._next.cancel()  # (one not begun)
