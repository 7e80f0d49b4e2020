"""Two executors behind one interface: `run(tasks, ...) -> [BranchReport]`, `close()`.

* `LocalExecutor` — `run_branch` in this process, one branch after another, over one
  `Retriever` (no Ray; the baseline and the laptop path).
* `RayExecutor` — `run_branch` inside `BranchActor`s from a pool, retrieval in
  `retriever_replicas` `RetrieverActor`s (one when the index is a Milvus Lite file: see
  `IndexProfile.replicas`), each question sent to the least-loaded one (`ReplicaBalancer`), LLM engines
  in named engine actors; every actor counted by `orchestrator.cluster.plan_actors` before any
  starts, every start awaited with a timeout. The question's own branch is *hosted* by its
  retriever replica — run in that actor, beside the stores, with no round trip per turn —
  when the replica hosts no other branch just then and the policy needs no model (the LLM
  policy's branches stay in branch actors, which hold its keys and GPUs). It is the branch
  every question has and the longest (it follows the most hops): on 2 cores hosting took
  3-branch questions from 110 to 97 ms and 1-branch ones from 87 to 69 ms (session 13).

With `fetch_cache` (default), the branches of one question share a `QuestionCache`
(`infra.fetch_cache`): locally one per `run`; on Ray it lives in the retriever replica that
serves all the question's branches (the question's requests carry its id; `end_question` drops
it). Same results, fewer backend requests. Off, each branch of a question may take its own
replica, as before.

`pick_executor` is the one place that decides between them (one branch runs in-process),
`make_executor` the one place that builds them. A branch that raises or misses its
deadline is reported in its `BranchReport.status`; the others still count.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from branchsearch.infra import telemetry
from branchsearch.infra.choices import EXECUTORS, Executor as ExecutorName, one_of
from branchsearch.infra.errors import BackendUnavailable, BranchsearchError, Overloaded
from branchsearch.infra.settings import Settings
from branchsearch.workers.branch import BranchReport, BranchTask, run_branch

log = logging.getLogger("branchsearch.executors")
Events = Callable[[dict], None] | None


class Executor(Protocol):
    def run(self, tasks: list[BranchTask], *, settings: Settings,
            policy_factory: Callable | None = None, on_event: Events = None
            ) -> list[BranchReport]:
        """Run every task; one report per task, in order, whatever happened to it."""

    def close(self) -> None: ...


def pick_executor(settings: Settings, requested: str = "ray") -> ExecutorName:
    """The executor to use: the one requested, except that one branch needs no cluster, so
    `ray` with `branches = 1` runs in-process, unless a cluster was named (`ray_address`)."""
    if requested not in EXECUTORS:
        raise BranchsearchError(f"unknown executor {requested!r}; use {one_of(EXECUTORS)}")
    if requested == "ray" and settings.branches == 1 and not settings.ray_address:
        return "local"
    return requested


def make_executor(settings: Settings, mode: ExecutorName, *,
                  pool_size: int | None = None) -> Executor:
    if mode == "local":
        return LocalExecutor(settings)
    if mode == "ray":
        return RayExecutor(settings, pool_size or settings.branches
                           * max(settings.batch_concurrency, 1))
    raise BranchsearchError(f"unknown executor {mode!r}; use {one_of(EXECUTORS)}")


class ReplicaBalancer:
    """Which retriever replica serves the next branch (or question: `take(branches)`): the one
    with the fewest branches in flight, ties broken round-robin (so a quiet pool still
    spreads). A branch keeps its replica for all its tool calls; `done(i, branches)` when it
    ends. Thread-safe (concurrent questions)."""

    def __init__(self, replicas: int):
        if replicas < 1:
            raise ValueError("at least one replica")
        self.load = [0] * replicas  # branches in flight per replica
        self.served = [0] * replicas  # branches sent to each replica, ever
        self.hosting = [False] * replicas  # whether the replica runs a hosted branch now
        self._next = 0
        self._lock = threading.Lock()

    def take(self, branches: int = 1) -> int:
        with self._lock:
            n = len(self.load)
            order = [(self._next + j) % n for j in range(n)]
            pick = min(order, key=lambda r: self.load[r])  # first least-loaded in rotation
            self.load[pick] += branches
            self.served[pick] += branches
            self._next = (pick + 1) % n
            return pick

    def done(self, replica: int, branches: int = 1) -> None:
        with self._lock:
            self.load[replica] = max(self.load[replica] - branches, 0)

    def host(self, replica: int) -> bool:
        """Claim the replica's one hosted-branch slot; False when another branch holds it."""
        with self._lock:
            if self.hosting[replica]:
                return False
            self.hosting[replica] = True
            return True

    def unhost(self, replica: int) -> None:
        with self._lock:
            self.hosting[replica] = False


def wait_started(refs: list, what: str, timeout: float, resources: dict, demand: dict) -> None:
    """Wait for actors to answer, at most `timeout`: a plan the cluster cannot place fails here
    with one line instead of hanging."""
    import ray

    try:
        ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        have = {k: v for k, v in resources.items() if k in ("CPU", "GPU")}
        try:  # what other actors (another index's, another job's) left free
            free = {k: round(v, 2) for k, v in ray.available_resources().items()
                    if k in ("CPU", "GPU")}
        except Exception:  # noqa: BLE001
            free = "unknown"
        raise BackendUnavailable(
            f"ray: {what} did not start within {timeout:g} s (the cluster has {have}, "
            f"free now {free}, this plan asks {demand}: other actors hold the "
            "rest; see `ray status`, or raise actor_start_timeout_s)") from None


@dataclass
class Placement:
    """Where one branch runs: a pool actor, or hosted by retriever replica `replica` (`actor`
    None; its events under `events`)."""

    ref: object
    replica: int
    actor: object = None
    events: str | None = None


def emit(on_event: Events, event: dict) -> None:
    """Pass an event to the watcher, if any; a watcher that fails never breaks the search."""
    if on_event is not None:
        try:
            on_event(event)
        except Exception:  # noqa: BLE001 — a watcher never breaks the search
            pass


def _done_event(report: BranchReport) -> dict:
    return {"type": "branch_done", "branch": report.index, "status": report.status,
            "error": report.error, "termination": report.termination, "turns": report.turns,
            "context_tokens_final": report.context_tokens_final,
            "tokens_read": report.tokens_read, "latency_s": round(report.latency_s, 4)}


def shares_cache(settings: Settings, tasks: list[BranchTask]) -> bool:
    """Whether a question's branches share a fetch cache: with `fetch_cache`, when there are
    two or more (a lone branch has no one to share with and would only over-fetch)."""
    return settings.fetch_cache and len(tasks) > 1


class LocalExecutor:
    def __init__(self, settings: Settings):
        from branchsearch.infra.retriever import open_retriever

        self.retriever = open_retriever(settings, need_dense=settings.search_mode != "bm25")
        self.last_cache_stats: dict = {}  # the last question's fetch cache counters

    def run(self, tasks: list[BranchTask], *, settings: Settings,
            policy_factory: Callable | None = None, on_event: Events = None
            ) -> list[BranchReport]:
        from branchsearch.infra.fetch_cache import QuestionCache
        from branchsearch.infra.retriever import QuestionRetriever

        cache = QuestionCache() if shares_cache(settings, tasks) else None
        retriever = self.retriever if cache is None else QuestionRetriever(self.retriever, cache)
        try:
            return self._run(tasks, retriever, settings, policy_factory, on_event)
        finally:  # the cache dies with the question
            self.last_cache_stats = dict(cache.stats) if cache is not None else {}

    def _run(self, tasks: list[BranchTask], retriever, settings: Settings,
             policy_factory: Callable | None, on_event: Events) -> list[BranchReport]:
        reports = []
        for task in tasks:
            if task.deadline is not None and time.time() >= task.deadline:
                report = BranchReport(task.index, task.subquery, task.weight, task.kind,
                                      "timeout", "not started before the deadline")
            else:
                emit(on_event, {"type": "branch_started", "branch": task.index,
                                 "subquery": task.subquery})
                report = run_branch(task, retriever, settings,
                                    policy_factory=policy_factory, on_event=on_event)
            emit(on_event, _done_event(report))
            reports.append(report)
        return reports

    def close(self) -> None:
        self.retriever.close()


class BranchPool:
    """Branch actors shared by every question (and, in the service, every index): a question
    takes all its actors at once and gives them back when its branches end. Each run carries its
    own settings and retriever, so one pool serves any index. With `grow`, actors start on
    demand up to `size`; without, all start now (the service: every actor is placed before a
    request waits on one). `acquire` waits at most `timeout` seconds, then raises `Overloaded`:
    nothing waits on an actor that cannot be placed."""

    def __init__(self, size: int, options: dict, settings: Settings, *, start: int | None = None):
        from branchsearch.workers.actor import BranchActor

        self.size = size
        # secrets stay with the retrievers and engines; each run brings its own settings
        branch_settings = settings.replace(es_api_key="", milvus_token="")
        # no restarts: a branch actor that dies is replaced by a fresh one (see `replace`);
        # a restartable actor holding a handle in its arguments also makes Ray's core print an
        # error-level notice on the user's terminal (ray-project/ray#53727)
        self._new = lambda: BranchActor.options(max_restarts=0, **options).remote(
            branch_settings, None)
        self._idle = [self._new() for _ in range(size if start is None else min(start, size))]
        self._created = len(self._idle)
        self._cond = threading.Condition()

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
                                     f"pool of {self.size} is busy with other searches")
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


class RayExecutor:
    POLL_S = 0.2  # how often branch events are collected while branches run

    def __init__(self, settings: Settings, pool_size: int, *, pool: BranchPool | None = None,
                 retriever_cpus: float | None = None):
        """`pool`: a shared branch pool (the service's, for every index; not closed here);
        then only the retriever actors are planned, each with `retriever_cpus`."""
        from branchsearch.orchestrator.cluster import connect, plan_actors
        from branchsearch.workers.actor import RetrieverActor

        self.settings = settings
        self.resources = connect(settings)
        engines = (max(settings.llm_engines, 1) if "llm" in (settings.policy, settings.planner)
                   and not settings.llm_url else 0)
        from branchsearch.infra.profile import index_profile

        replicas, note = index_profile(settings).replicas(settings.retriever_replicas)
        if note:
            log.warning("%s", note)
        self.replica_note = note
        plan = self.plan = plan_actors(settings, self.resources, pool_size, engines=engines,
                                       retrievers=replicas)
        if pool is not None and retriever_cpus is not None:
            self.plan = plan = replace(plan, retriever={"num_cpus": retriever_cpus},
                                       branch_actors=pool.size, shrunk_from=0)
        elif plan.shrunk_from:
            log.warning("branch pool: %d actors instead of %d, to fit the cluster (%s)",
                        plan.branch_actors, plan.shrunk_from, self.resources.get("CPU"))
        self.engines: list = []
        if engines:
            from branchsearch.workers.engine_actor import start_engines

            self.engines = start_engines(settings, self.resources, list(plan.engines))
        # each actor gets the secrets it needs, no others
        retriever_settings = settings.replace(llm_api_key="")
        self.retrievers = [RetrieverActor.options(
            max_concurrency=16, max_restarts=settings.branch_retries,
            **plan.retriever).remote(retriever_settings) for _ in range(replicas)]
        self.retriever = self.retrievers[0]  # the stores' owner for writes (documents, probe)
        self.balancer = ReplicaBalancer(replicas)
        self.hosts = settings.policy != "llm"  # a model's branch needs a branch actor
        self.branch_settings = settings.replace(es_api_key="", milvus_token="")
        self.shared_pool = pool is not None
        # the pool grows on demand up to the plan's size; one question's worth starts now
        self.pool = pool or BranchPool(plan.branch_actors, plan.branch, settings,
                                       start=settings.branches)
        # every actor starts at once (engines load while the rest start); then each is awaited
        try:
            if self.engines:
                self._wait_started([e.stats.remote() for e in self.engines],
                                   f"{engines} LLM engine actor(s)")
            self._wait_started([r.ping.remote() for r in self.retrievers],
                               f"{replicas} retriever actor(s)")
            if not self.shared_pool:
                self._wait_started(self.pool.ping_all(), f"{settings.branches} branch actor(s)")
        except BaseException:
            self._kill_all()  # a failed start must not hold CPUs or the index's files
            raise

    def _wait_started(self, refs: list, what: str) -> None:
        wait_started(refs, what, self.settings.actor_start_timeout_s, self.resources,
                     self.plan.demand())

    # --- running -------------------------------------------------------------------------------

    def run(self, tasks: list[BranchTask], *, settings: Settings,
            policy_factory: Callable | None = None, on_event: Events = None
            ) -> list[BranchReport]:
        carrier = telemetry.current_carrier()
        stream = on_event is not None
        # a question sharing a fetch cache runs on one replica, which holds the cache
        question = uuid.uuid4().hex if shares_cache(settings, tasks) else None
        if question is not None:
            replicas = [self.balancer.take(len(tasks))] * len(tasks)
        else:
            replicas = [self.balancer.take() for _ in tasks]
        hosted = self.hosts and self.balancer.host(replicas[0])

        def on_pool(actor, task: BranchTask, replica: int) -> Placement:
            return Placement(actor.run.remote(task, carrier, policy_factory, stream,
                                              self.retrievers[replica], question,
                                              self.branch_settings), replica, actor)

        def rescue(task: BranchTask) -> Placement:  # the hosting replica went away
            return on_pool(self.pool.acquire(1, _left(tasks))[0], task, replicas[0])

        try:
            actors = self.pool.acquire(len(tasks) - hosted, _left(tasks))
            places = []
            try:
                if hosted:  # the question's own branch, beside the stores
                    key = uuid.uuid4().hex if stream else None
                    ref = self.retrievers[replicas[0]].run.remote(
                        self._bounded(tasks[0], settings), carrier, policy_factory, key,
                        question)
                    places.append(Placement(ref, replicas[0], events=key))
                for actor, task, r in zip(actors, tasks[hosted:], replicas[hosted:]):
                    places.append(on_pool(actor, task, r))
            except BaseException:  # a task that cannot be sent: the pool gets its actors back
                self._give_back(actors, [p.actor for p in places if p.actor is not None])
                raise
            return self._gather(tasks, places, settings, on_event, rescue)
        finally:
            if hosted:
                self.balancer.unhost(replicas[0])
            if question is not None:
                self.balancer.done(replicas[0], len(tasks))
                self._end_question(replicas[0], question)
            else:
                for r in replicas:
                    self.balancer.done(r)

    def _give_back(self, actors: list, busy: list) -> None:
        """Return `actors` to the pool; those in `busy` (running a task nobody will collect)
        are replaced by fresh ones."""
        for actor in actors:
            if any(actor is b for b in busy):
                self.pool.replace(actor)
            else:
                self.pool.release(actor)

    @staticmethod
    def _bounded(task: BranchTask, settings: Settings) -> BranchTask:
        """A hosted branch ends itself by `branch_timeout_s` (a late one cannot be killed, as a
        pool actor is: its replica serves the other branches)."""
        own = time.time() + settings.branch_timeout_s
        return replace(task, deadline=own if task.deadline is None else min(task.deadline, own))

    def _end_question(self, replica: int, question: str) -> None:
        """Drop the question's cache in its replica (not awaited: it answers only counters)."""
        try:
            self.retrievers[replica].end_question.remote(question)
        except Exception:  # noqa: BLE001 — a dead replica holds no cache
            pass

    def _gather(self, tasks: list[BranchTask], places: list[Placement], settings: Settings,
                on_event: Events, rescue: Callable[[BranchTask], Placement]
                ) -> list[BranchReport]:
        for t in tasks:
            emit(on_event, {"type": "branch_started", "branch": t.index,
                             "subquery": t.subquery})
        timeout = settings.branch_timeout_s
        deadline = min([t.deadline for t in tasks if t.deadline is not None], default=None)
        if deadline is not None:
            timeout = max(min(timeout, deadline - time.time()), 0.0)
        end = time.monotonic() + timeout
        done = self._wait(places, timeout, on_event)
        reports = [self._report(task, place, done, timeout)
                   for place, task in zip(places, tasks)]
        for i, report in enumerate(reports):
            if report is None:  # hosted, and its replica died or is restarting: once the
                task = tasks[i]  # question's pool actors are back, one of them runs it
                left = end - time.monotonic()
                if left > 0:
                    place = rescue(task)
                    report = self._report(task, place, self._wait([place], left, on_event),
                                          timeout)
                reports[i] = report or BranchReport(
                    task.index, task.subquery, task.weight, task.kind, "error",
                    "its retriever actor died, and no time was left to run it elsewhere")
        for report in reports:
            emit(on_event, _done_event(report))
        return reports

    def _report(self, task: BranchTask, place: Placement, done: set, timeout: float
                ) -> BranchReport | None:
        """The branch's report: its own, or a timeout; None for a hosted branch whose replica
        died (it can run again elsewhere)."""
        import ray

        if place.ref in done:
            return self._collect(task, place)
        if place.actor is not None:
            self.pool.replace(place.actor)  # it is still busy
        elif place.events:  # hosted: it ends by its deadline; its events are not kept
            self.retrievers[place.replica].branch_events.remote(place.events, True)
        return BranchReport(task.index, task.subquery, task.weight, task.kind, "timeout",
                            f"no result within {timeout:.3g} s")

    def _wait(self, places: list[Placement], timeout: float, on_event: Events) -> set:
        """The refs that finished within `timeout`; meanwhile, with a watcher, the branches'
        events are drained every POLL_S and passed on."""
        import ray

        refs = [p.ref for p in places]
        if on_event is None:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
            return set(ready)
        end, done = time.monotonic() + timeout, set()
        while True:
            left = end - time.monotonic()
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=max(min(self.POLL_S,
                                                                              left), 0))
            done = set(ready)
            calls = [p.actor.events.remote() if p.actor is not None else
                     self.retrievers[p.replica].branch_events.remote(p.events, p.ref in done)
                     for p in places]
            for call in calls:  # one by one: a dead actor's events are lost, no one else's
                try:
                    for event in ray.get(call, timeout=10):
                        emit(on_event, event)
                except ray.exceptions.RayError:
                    pass  # its report says what happened
            if len(done) == len(refs) or left <= 0:
                return done

    def _collect(self, task: BranchTask, place: Placement) -> BranchReport | None:
        import ray

        from branchsearch.infra.errors import error_line

        try:
            report = ray.get(place.ref)
            if place.actor is not None:
                self.pool.release(place.actor)
            return report
        except ray.exceptions.RayActorError as exc:  # ActorUnavailableError too (restarting)
            if place.actor is None:
                return None
            error = f"actor died: {error_line(exc, 480)}"
            self.pool.replace(place.actor)
        except ray.exceptions.RayTaskError as exc:
            error = error_line(exc, 500)
            if place.actor is not None:
                self.pool.release(place.actor)
        return BranchReport(task.index, task.subquery, task.weight, task.kind, "error", error)

    def close(self) -> None:
        import ray

        try:
            ray.get([r.close.remote() for r in self.retrievers], timeout=30)
        except Exception:  # noqa: BLE001 — already dead: nothing to release
            pass
        self._kill_all()

    def _kill_all(self) -> None:
        import ray

        if not self.shared_pool and hasattr(self, "pool"):
            self.pool.close()
        keep = self.engines if self.settings.llm_detached else []
        for actor in self.retrievers + [e for e in self.engines if e not in keep]:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 — already gone
                pass


def _left(tasks: list[BranchTask]) -> float | None:
    """Seconds until the question's deadline (None: no deadline)."""
    deadline = min([t.deadline for t in tasks if t.deadline is not None], default=None)
    return None if deadline is None else max(deadline - time.time(), 0.0)
