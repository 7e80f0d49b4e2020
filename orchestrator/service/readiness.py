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

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
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


class Pending:
    """An answer not yet given: its probe has not ended within the check's wait and none
    before it ended (its backend has not answered since the service started asking), or its
    probe has run `IndexProbes.slow_s` already (its last answer is out of date)."""


class IndexProbes:
    """The probes of the indexes, shared by the readiness checks (of the indexes other than
    the default) and by the searches that failed or found nothing (`probing`).

    A service may serve hundreds of indexes, and a probe of one asks its backend over the
    network (or reads its profile from disk); one that does not answer takes the probe's
    timeout. A check must still end well within a balancer's probe timeout (Kubernetes: 1 s).
    So the probes run on a few threads of their own (`workers`: the number running at once,
    whatever the number of indexes), an index's answer is kept `fresh_s` and given again
    meanwhile with no probe started, and a check waits for the probes it starts at most until
    `until`: an index whose probe has not ended by then is given its last answer (that of the
    probe before, which ended), or `Pending` when none ended yet or its probe has run
    `slow_s` already (a backend that took connections and stopped answering: its last answer
    is out of date). One probe runs at a time an index; it goes on after the check, which
    the checks after do not wait for again, and its answer is the first check's after it
    ends.

    A search asks `probing`: the probe under way of its index, or one started at once on a
    thread of its own (not queued behind the checks' probes of frozen backends), whose end it
    waits for; the searches that fail at once on one outage share it. A check that comes while
    it runs waits for it as for one of its own, once.

    A probe is keyed by what it asks (an index, and the driver it probes or None: an index
    not open), so an index opened or closed meanwhile is asked anew, not answered for what it
    was."""

    def __init__(self, workers: int = 8, fresh_s: float = 2.0, slow_s: float = 3.0):
        self.workers, self.fresh_s, self.slow_s = workers, fresh_s, slow_s
        self._lock = threading.Lock()
        # key -> when its probe under way began to run (queued behind others: when queued)
        self._running: dict[object, float] = {}
        self._under_way: dict[object, Future] = {}  # key -> its probe under way (its outcome)
        self._waited: set = set()  # keys whose probe under way a check has waited for
        # key -> (the exception its last probe raised, or None: ready; when that probe ended)
        self._answers: dict[object, tuple[BaseException | None, float]] = {}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def start(self, probes: dict[object, Callable[[], object]]) -> dict[object, Future | None]:
        """Start the probe of each key in `probes` that has no fresh answer and none running;
        what each key's answer waits for: its new probe, or None (its last answer, given at
        once: fresh, or the probe under way was waited for by the check that started it).
        Keys no longer asked are forgotten."""
        now, waits = time.monotonic(), {}
        with self._lock:
            for key in set(self._answers) - set(probes):
                if key not in self._running:
                    del self._answers[key]
            for key, fn in probes.items():
                answer = self._answers.get(key)
                if answer is not None and now - answer[1] < self.fresh_s:
                    waits[key] = None
                    continue
                if key in self._running:  # one under way, waited for by one check: not again
                    waits[key] = None if key in self._waited else self._under_way[key]
                else:
                    waits[key] = self._submit(key, fn)
                    self._running[key] = now
                self._waited.add(key)
        return waits

    def probing(self, key, fn: Callable[[], object]) -> Future:
        """The probe of `key` under way, or `fn` started now on a thread of its own; its
        outcome: None (ready) or the exception `fn` raised. Its answer is kept as a check's."""
        with self._lock:
            future = self._under_way.get(key)
            if future is None:
                future = self._under_way[key] = Future()
                self._running[key] = time.monotonic()
                threading.Thread(target=self._run, args=(key, fn, future), name="index-probe",
                                 daemon=True).start()
            return future

    def answers(self, waits: dict[object, Future | None], until: float
                ) -> dict[object, BaseException | None | type[Pending]]:
        """Each key's answer (None: ready; the exception its probe raised; `Pending`), waiting
        for the probes under way at most until `until` (monotonic)."""
        futures = [f for f in waits.values() if f is not None and not f.done()]
        if futures:
            wait(futures, timeout=max(0.0, until - time.monotonic()))
        now = time.monotonic()
        with self._lock:
            return {key: (Pending if key not in self._answers
                          or now - self._running.get(key, now) >= self.slow_s
                          else self._answers[key][0]) for key in waits}

    def close(self) -> None:
        """Stop the workers once the probes under way end (they are daemon threads: a stopping
        process does not wait for them)."""
        for _ in self._threads:
            self._queue.put(None)

    def _submit(self, key, fn: Callable[[], object]) -> Future:
        """Queue `fn` for the workers (started as needed, up to `workers`). Holding the lock."""
        future = self._under_way[key] = Future()
        self._queue.put((key, fn, future))
        if len(self._threads) < self.workers:
            thread = threading.Thread(target=self._work, name="index-probe", daemon=True)
            self._threads.append(thread)
            thread.start()
        return future

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            self._run(*item)

    def _run(self, key, fn: Callable[[], object], future: Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        with self._lock:  # `slow_s` counts its run, not its wait behind frozen ones
            self._running[key] = time.monotonic()
        try:
            fn()
            outcome = None
        except BaseException as exc:  # noqa: BLE001 — the index's answer
            outcome = exc
        with self._lock:
            self._answers[key] = (outcome, time.monotonic())
            self._running.pop(key, None)
            self._under_way.pop(key, None)
            self._waited.discard(key)
        future.set_result(outcome)
