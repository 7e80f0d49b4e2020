"""The branch actors every question shares (`BranchPool`), and waiting for actors to start
(`wait_started`): a plan the cluster cannot place fails with one line, an actor that dies in its
constructor of a user error raises that error here, never as a Ray traceback."""

from __future__ import annotations

import logging
import threading
import time

from branchsearch.infra.errors import (BackendUnavailable, BranchsearchError, Overloaded,
                                       error_line, overload)
from branchsearch.infra.config.settings import Settings

log = logging.getLogger("branchsearch.executors")


def branch_settings(settings: Settings) -> Settings:
    """The settings a branch actor may hold: the backends' secrets stay with the retrievers."""
    return settings.replace(es_api_key="", milvus_token="")


class BranchPool:
    """Branch actors shared by every question (and, in the service, every index): a question
    takes all its actors at once and gives them back when its branches end. Each run carries its
    own settings and retriever, so one pool serves any index. With `start`, that many actors
    start now and the rest on demand up to `size`; without, all start now (the service: every
    actor is placed before a request waits on one). `acquire` waits at most `timeout` seconds, then raises `Overloaded`:
    nothing waits on an actor that cannot be placed."""

    def __init__(self, size: int, options: dict, settings: Settings, *, start: int | None = None):
        from branchsearch.workers.actor import BranchActor

        self.size, self.options = size, options
        warm = branch_settings(settings)  # each run brings its own index's settings
        # no restarts: a branch actor that dies is replaced by a fresh one (see `replace`);
        # a restartable actor holding a handle in its arguments also makes Ray's core print an
        # error-level notice on the user's terminal (ray-project/ray#53727)
        self._new = lambda: BranchActor.options(max_restarts=0, **options).remote(
            warm, None)
        self._idle = [self._new() for _ in range(size if start is None else min(start, size))]
        self._created = len(self._idle)
        self._cond = threading.Condition()

    @property
    def busy(self) -> int:
        """Actors running a branch now (taken and not given back)."""
        with self._cond:
            return self._created - len(self._idle)

    def ping_all(self) -> list:
        return [a.ping.remote() for a in self._idle]

    def acquire(self, n: int, timeout: float | None = None) -> list:
        """n actors at once (all or none, so concurrent questions cannot deadlock holding part
        of the pool each); new ones start while the pool may still grow."""
        if n > self.size:
            raise BranchsearchError(f"{n} branches need as many branch actors; the pool holds "
                                    f"{self.size} on this cluster")
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while len(self._idle) + self.size - self._created < n:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise Overloaded(f"no {n} branch actor(s) free within the deadline: the "
                                     f"pool of {self.size} is busy with other searches",
                                     overload("branch_actors", self._created - len(self._idle),
                                              branch_actors=self.size))
                self._cond.wait(left)
            while len(self._idle) < n:
                self._idle.append(self._new())
                self._created += 1
            taken, self._idle = self._idle[:n], self._idle[n:]
            return taken

    def release(self, actor) -> None:
        with self._cond:
            self._idle.append(actor)
            self._cond.notify_all()

    def replace(self, actor) -> None:
        """`actor` is dead or busy with work nobody will collect: kill it, add a fresh one."""
        import ray

        try:
            ray.kill(actor)
        except Exception:  # noqa: BLE001 — already gone
            pass
        self.release(self._new())

    def close(self) -> None:
        import ray

        with self._cond:
            idle, self._idle = self._idle, []
        for actor in idle:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 — already gone
                pass


def wait_started(refs: list, what: str, timeout: float, resources: dict, demand: dict) -> None:
    """Wait for actors to answer, at most `timeout`: a plan the cluster cannot place fails here
    with one line instead of hanging, an actor that died in its constructor of a user error
    (a backend down, an index missing) raises that error, and one killed while starting is
    BackendUnavailable."""
    import ray

    try:
        first = min(WAIT_NOTE_S, timeout)
        _, pending = ray.wait(list(refs), num_returns=len(refs), timeout=first)
        if pending:  # still not started: say so once, rather than minutes of silence
            free, unplaced = _free(), _unplaced_actors()
            if unplaced is None:  # no actor table: judge by the free resources alone
                unplaced = not (isinstance(free, dict)
                                and all(free.get(k, 0) >= v for k, v in demand.items()))
            if not unplaced:  # placed, its constructor running (free excludes what it holds)
                log.info("ray: %s still starting (loading; up to %g s)", what, timeout)
            else:  # the cluster lacks room for it (another index's actors, another job's)
                log.warning("ray: waiting for %s to start (up to %g s; this plan asks %s, the "
                            "cluster has %s free now)", what, timeout, demand, free)
        ray.get(refs, timeout=max(timeout - first, 0.001) if pending else None)
    except ray.exceptions.ActorDiedError as exc:
        cause = start_error(exc)
        if cause is not None:
            raise cause from None
        if getattr(exc, "actor_init_failed", False):
            raise  # a bug in a constructor: its traceback
        # killed while starting (its process, its node): what a caller may retry; Ray's
        # account of it (its worker, its exit type) goes to the log, not into the answer
        log.warning("ray: %s died while starting: %s", what, error_line(exc, 1000))
        raise BackendUnavailable(f"ray: {what} died while starting (its process was killed "
                                 "or its node lost); retry") from None
    except ray.exceptions.OutOfMemoryError as exc:  # the node ran low on memory: Ray killed it
        log.warning("ray: %s killed while starting: %s", what, error_line(exc, 1000))
        raise BackendUnavailable(f"ray: {what} killed while starting: the node ran low on "
                                 "memory (each open index's retriever holds its models); "
                                 "retry") from None
    except ray.exceptions.GetTimeoutError:
        have = {k: v for k, v in resources.items() if k in ("CPU", "GPU")}
        free = _free()  # what other actors (another index's, another job's) left free
        raise BackendUnavailable(
            f"ray: {what} did not start within {timeout:g} s (the cluster has {have}, "
            f"free now {free}, this plan asks {demand}: other actors hold the "
            "rest; see `ray status`, or raise actor_start_timeout_s)") from None


WAIT_NOTE_S = 10.0  # actors not started by then: one line says what the start waits for


def _unplaced_actors() -> bool | None:
    """Whether an actor of this job waits for room on the cluster: not started on any node yet
    (no process), where one placed and loading has its process. None when Ray's actor table
    cannot be read."""
    import ray

    try:
        from ray._private import state

        job = ray.get_runtime_context().get_job_id()
        return any(info.get("JobID") == job and info.get("State") == "PENDING_CREATION"
                   and not info.get("Pid") for info in state.actors().values())
    except Exception:  # noqa: BLE001 — a private table: its shape may change
        return None


def unplaced(actors: list) -> bool | None:
    """Whether each of `actors` waits for room on the cluster (created, on no node yet: no
    process), where one placed and loading has its process. None when Ray's actor table
    cannot be read."""
    try:
        from ray._private import state

        table = [state.actors(actor_id=a._actor_id.hex()) for a in actors]
        return all(info.get("State") == "PENDING_CREATION" and not info.get("Pid")
                   for info in table)
    except Exception:  # noqa: BLE001 — a private table: its shape may change
        return None


def _free():
    import ray

    try:
        return {k: round(v, 2) for k, v in ray.available_resources().items()
                if k in ("CPU", "GPU")}
    except Exception:  # noqa: BLE001
        return "unknown"


def start_error(exc: BaseException) -> BranchsearchError | None:
    """The user error an actor died of in its constructor, or None (a crash, not the user's).
    Ray's `ActorDiedError` carries the creation task's `RayTaskError` as its argument, and that
    holds the original exception as `cause`."""
    if not getattr(exc, "actor_init_failed", False):
        return None
    for arg in getattr(exc, "args", ()):
        cause = getattr(arg, "cause", None)
        if isinstance(cause, BranchsearchError):
            return cause
    return None
