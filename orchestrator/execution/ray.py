"""`RayExecutor`: `run_branch` inside `BranchActor`s from a `BranchPool`, retrieval in
`retriever_replicas` `RetrieverActor`s (one when the index is a Milvus Lite file: see
`IndexProfile.replicas`), each question sent to the least-loaded one (`ReplicaBalancer`), LLM
engines in named engine actors; every actor counted by `actor_plan.plan_actors` before any
starts, every start awaited with a timeout (`pool.wait_started`).

The question's own branch is *hosted* by its retriever replica — run in that actor, beside the
stores, with no round trip per turn — when the replica hosts no other branch just then and the
policy needs no model (the LLM policy's branches stay in branch actors, which hold its keys and
GPUs). It is the branch every question has and the longest (it follows the most hops).

A question's branches start together when the cluster has a CPU for each (`at_once`); where
they would share CPUs, the question's branch runs first and the branches it covers
(`orchestrator.cover`) never start, as in-process.

With `fetch_cache`, a question's branches share one replica, which holds the question's cache
for all its waves (`question`: the question's requests carry its id; `end_question` drops it).
Off, each branch of a question may take its own replica.

Ray restarts a retriever replica that dies (`branch_retries` times); one dead for good is
started afresh by the question that meets it (`revive`). A branch actor of the pool that dies
(its node gone) is replaced. Either way the question that met the death runs once more.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

from branchsearch.infra import telemetry
from branchsearch.infra.config.settings import Settings
from branchsearch.infra.errors import (BackendUnavailable, BranchsearchError, ClusterLost,
                                       Overloaded)
from branchsearch.orchestrator.execution import (Cover, Events, bounded, done_event, emit,
                                                  not_started)
from branchsearch.orchestrator.execution.balancer import Placement, ReplicaBalancer
from branchsearch.orchestrator.execution.pool import (BranchPool, branch_settings, unplaced,
                                                      wait_started)
from branchsearch.workers.branch import BranchReport, BranchTask
from branchsearch.workers.harness import called_off

log = logging.getLogger("branchsearch.executors")
ACTOR_DIED = "actor died: "  # a branch report's error when its pool actor was lost


class RayExecutor:
    POLL_S = 0.2  # how often branch events are collected while branches run

    def __init__(self, settings: Settings, pool_size: int, *, pool: BranchPool | None = None,
                 retriever_options: dict | None = None):
        """`pool`: a shared branch pool (the service's, for every index; not closed here);
        then only the retriever actors are planned, each with `retriever_options`."""
        import ray

        from branchsearch.infra.raycluster import connect

        self.settings = settings
        self.resources = connect(settings)
        engines = (max(settings.llm_engines, 1) if "llm" in (settings.policy, settings.planner)
                   and not settings.llm_url else 0)
        from branchsearch.infra.index.profile import index_profile

        replicas, note = index_profile(settings).replicas(settings.retriever_replicas)
        if note:
            log.warning("%s", note)
        self.replica_note = note
        plan = self.plan = self._plan(pool is None, pool_size, engines, replicas)
        if pool is not None and retriever_options is not None:  # the shared pool's plan
            self.plan = plan = replace(plan, retriever=dict(retriever_options),
                                       branch=pool.options, branch_actors=pool.size,
                                       shrunk_from=0)
        elif plan.shrunk_from:  # sized to the cluster's CPUs: not the user's concern
            log.info("branch pool: %d actors instead of %d, for the cluster's %s CPUs",
                     plan.branch_actors, plan.shrunk_from, self.resources.get("CPU"))
        self.engines: list = []
        if engines:
            from branchsearch.workers.engine_actor import start_engines

            self.engines = start_engines(settings, self.resources, list(plan.engines))
        self.retrievers = [self._start_retriever() for _ in range(replicas)]
        self.retriever = self.retrievers[0]  # the stores' owner for writes (documents, probe)
        self._reviving = threading.Lock()
        self._starting: dict[int, object] = {}  # replica → the ping of its fresh start, pending
        self.lost = ""  # why the cluster is gone, once `_watch` or `revive` found it so
        self._closed = threading.Event()
        self.revived = 0  # replicas back after a death: restarted by Ray or here (`revive`)
        self.balancer = ReplicaBalancer(replicas)
        self.hosts = settings.policy != "llm"  # a model's branch needs a branch actor
        self.cpus = self.resources.get("CPU", 0)  # the cluster's (free ones), for `at_once`
        self.branch_settings = branch_settings(settings)
        self.shared_pool = pool is not None
        # the pool grows on demand up to the plan's size; one question's worth starts now
        self.pool = pool or BranchPool(plan.branch_actors, plan.branch, settings,
                                       start=settings.branches)
        # every actor starts at once (engines load while the rest start); then each is awaited
        try:
            if self.engines:
                self._wait_started([e.stats.remote() for e in self.engines],
                                   f"{engines} LLM engine actor(s)")
            pings = [r.ping.remote() for r in self.retrievers]
            self._wait_started(pings, f"{replicas} retriever actor(s)")
            self._pids = ray.get(pings)  # each replica's process (`revive`)
            if not self.shared_pool:
                self._wait_started(self.pool.ping_all(), f"{settings.branches} branch actor(s)")
        except BaseException:
            self._kill_all()  # a failed start must not hold CPUs or the index's files
            raise
        threading.Thread(target=self._watch, name="ray-cluster-watch", daemon=True).start()

    WATCH_S = 2.0  # how often the cluster's head node is asked whether it is there

    def _watch(self) -> None:
        """Until `close`: whether the cluster's head node is still there (`cluster_lost`), so
        that a head node gone while every branch still runs (its GCS alone died) stops new
        questions before Ray's core ends this process (`lost`)."""
        from branchsearch.infra.raycluster import cluster_lost

        while not self.lost and not self._closed.wait(self.WATCH_S):
            try:
                self.lost = self.lost or cluster_lost() or ""
            except Exception:  # noqa: BLE001 — Ray shut down meanwhile: nothing to watch
                return

    def _plan(self, own_pool: bool, pool_size: int, engines: int, replicas: int):
        """The actor plan. On a cluster this process joined (`ray_address`, RAY_ADDRESS),
        others' actors (a service, another batch) may hold CPUs: the plan is made on the free
        ones when one question's worth fits there (`self.resources` becomes that share), else
        on the whole cluster as before (the actors wait for CPUs, an autoscaler's cue, and the
        wait says what holds them). The service plans its shared pool itself."""
        import ray

        from branchsearch.orchestrator.execution.actor_plan import free_share, plan_actors

        joined = bool(self.settings.ray_address or os.environ.get("RAY_ADDRESS"))
        if own_pool and joined:
            share = free_share(self.resources, ray.available_resources())
            try:
                plan = plan_actors(self.settings, share, pool_size, engines=engines,
                                   retrievers=replicas)
            except BranchsearchError:
                pass  # not one question's worth free now: plan on the whole cluster
            else:
                if share["CPU"] < self.resources.get("CPU", 0):
                    log.info("planned on the cluster's %g free CPUs of %g (other jobs hold "
                             "the rest)", share["CPU"], self.resources.get("CPU", 0))
                self.resources = share
                return plan
        return plan_actors(self.settings, self.resources, pool_size, engines=engines,
                           retrievers=replicas)

    def _start_retriever(self):
        """A retriever actor (each actor gets the secrets it needs, no others)."""
        from branchsearch.workers.actor import RetrieverActor

        return RetrieverActor.options(
            max_concurrency=16, max_restarts=self.settings.branch_retries,
            **self.plan.retriever).remote(self.settings.replace(llm_api_key=""))

    def revive(self, wait_s: float | None = None) -> bool:
        """After a branch failed: wait for each retriever replica to answer, and start afresh
        every one dead for good (killed past its restarts, its node gone). Whether any had
        died since it was last seen (restarted by Ray: another process now; or started here),
        so that the question that met the death can run again. One busy past the ping's
        timeout, or still restarting, is left as it is. `wait_s`: the most seconds to wait for
        the replicas' answers and for another question's revive (the question's deadline): a
        replica that Ray restarts and cannot place (no node with room) would hold the question
        a minute a replica, and every question that met it in turn, however short their
        deadlines. A cluster whose head node is gone (`cluster_lost`) raises `ClusterLost`, now
        and for every question after: nothing can run on it any more. A replica started
        afresh is waited for until the deadline too (`_start_again`)."""
        from branchsearch.infra.raycluster import cluster_lost

        end = None if wait_s is None else time.monotonic() + wait_s
        # concurrent questions that met the same death: one start
        if not self._reviving.acquire(timeout=-1 if end is None else max(wait_s, 0.0)):
            return False
        try:
            self.lost = self.lost or cluster_lost() or ""
            self._not_lost()
            dead, back = [], 0
            for i, replica in enumerate(self.retrievers):
                pid = _answer(replica, ANSWER_WAIT_S if end is None
                              else min(ANSWER_WAIT_S, max(end - time.monotonic(), 0.0)))
                if pid is _DEAD:
                    dead.append(i)
                elif pid is not None and pid != self._pids[i]:
                    self._pids[i], back = pid, back + 1
            if dead:
                self._start_again(dead, end)
            self.revived += len(dead) + back
            return bool(dead or back)
        finally:
            self._reviving.release()

    def _start_again(self, dead: list[int], end: float | None) -> None:
        """Start afresh the replicas numbered `dead` (dead for good) and wait for them: until
        `end` (the question's deadline), else `actor_start_timeout_s` as every start (a batch).
        Each takes its place at once, so a question after this one finds it starting, not
        dead to start once more. One not started by `end` (no node with room for it, or still
        loading) raises `BackendUnavailable`: a 503 to retry, at the question's deadline, where
        the start's whole timeout would have held the question, and the service's thread."""
        import ray

        log.warning("%d retriever actor(s) died for good; starting them again", len(dead))
        fresh = [self._start_retriever() for _ in dead]
        pings = [f.ping.remote() for f in fresh]
        for i, actor, ping in zip(dead, fresh, pings):
            self.retrievers[i], self._pids[i] = actor, None  # (its pid once it answers)
            self._starting[i] = ping
        self.retriever = self.retrievers[0]
        what = f"{len(dead)} retriever actor(s)"
        if end is not None:
            _, pending = ray.wait(pings, num_returns=len(pings),
                                  timeout=max(end - time.monotonic(), 0.0))
            if pending:
                raise BackendUnavailable(
                    f"ray: {what} of index {self.settings.index!r} died and started again, "
                    "not started by the question's deadline (placed on no node yet, or still "
                    "loading); retry")
        self._wait_started(pings, what)  # (an error of their constructor is raised here)
        for i, pid in zip(dead, ray.get(pings)):
            self._pids[i] = pid
            self._starting.pop(i, None)

    def _not_placed(self) -> None:
        """Raise `BackendUnavailable` at once while every retriever replica is one started
        afresh (`_start_again`) that waits for room on the cluster (`pool.unplaced`): the
        question would wait on it until its deadline and end as a timeout (a 504), however
        long the cluster stays without room; a replica placed and loading is waited for."""
        import ray

        starting = dict(self._starting)
        if not starting:
            return
        ready, _ = ray.wait(list(starting.values()), num_returns=len(starting), timeout=0)
        for i, ping in starting.items():  # started (or died starting: the question meets it,
            if ping in ready and self._starting.get(i) is ping:  # and `revive`)
                self._starting.pop(i, None)  # (another question may have taken it off first)
        if (len(starting) - len(ready) == len(self.retrievers)
                and unplaced([self.retrievers[i] for i in starting])):
            raise BackendUnavailable(
                f"ray: the retriever actor(s) of index {self.settings.index!r} are starting "
                "again and are not placed on a node yet; retry")

    def owner_started(self, wait_s: float) -> None:
        """Wait at most `wait_s` for the stores' owner (`retriever`) when it is a replica
        started afresh (`_start_again`) and still starting; `BackendUnavailable` when it has not
        started by then. A call sent to it meanwhile would wait for its placement, however
        long the cluster stays without room, and run whenever that comes: a document write
        long after its caller's answer, a probe past any probe's timeout."""
        import ray

        ping = self._starting.get(0)
        if ping is None:
            return
        ready, _ = ray.wait([ping], timeout=max(wait_s, 0.0))
        if not ready:
            raise BackendUnavailable(
                f"ray: the retriever actor of index {self.settings.index!r} is starting again "
                f"and has not started within {wait_s:.3g} s (placed on no node yet, or still "
                "loading); nothing was sent to it: retry")
        if self._starting.get(0) is ping:
            self._starting.pop(0, None)

    def _not_lost(self) -> None:
        """Raise `ClusterLost` once the cluster is known to be gone (`_watch`, `revive`)."""
        if self.lost:
            raise ClusterLost(f"the Ray cluster is lost: {self.lost}")

    def _wait_started(self, refs: list, what: str) -> None:
        wait_started(refs, what, self.settings.actor_start_timeout_s, self.resources,
                     self.plan.demand(pool=not self.shared_pool))

    # --- running -------------------------------------------------------------------------------

    @property
    def engine_actors(self) -> bool:
        """Whether this executor started named LLM engine actors (a planner uses them too)."""
        return bool(self.engines)

    @contextmanager
    def question(self, settings: Settings) -> Iterator[object]:
        """One question's fetch cache, shared by all its waves: (question id, replica) — the
        replica that serves every branch of the question and holds its cache until the
        question ends — or None when `fetch_cache` is off."""
        if not settings.fetch_cache:
            yield None
            return
        share = (uuid.uuid4().hex, self.balancer.take(0))  # charged per wave, as it runs
        try:
            yield share
        finally:
            self._end_question(share[1], share[0])

    def run(self, tasks: list[BranchTask], *, settings: Settings,
            policy_factory: Callable | None = None, on_event: Events = None,
            cover: Cover = None, question: object = None) -> list[BranchReport]:
        """The question's branches (`_run_question`), on `question`'s replica and cache when
        given (`question()`). A branch that failed may have met a
        retriever replica's death: Ray restarts it (`branch_retries` times), one dead for good
        is started again (`revive`), and the question runs once more. A streamed question
        first gets a `rerun` event: the branch events after it replace those before."""
        if question is None and settings.fetch_cache:
            with self.question(settings) as share:
                return self.run(tasks, settings=settings, policy_factory=policy_factory,
                                on_event=on_event, cover=cover, question=share)
        self._not_lost()
        if _left(tasks) is not None:  # a question with a deadline; a batch's waits (`revive`)
            self._not_placed()
        revived = self.revived
        reports = self._run_question(tasks, settings, policy_factory, on_event, cover, question)
        if any(r.status == "error" for r in reports):
            self.revive(_left(tasks))  # (or another question met the death first and did)
            replaced = any(r.status == "error" and r.error.startswith(ACTOR_DIED)
                           for r in reports)  # a branch actor lost (its node): replaced
            if self.revived != revived or replaced:
                what = "a retriever" if self.revived != revived else "a branch"
                emit(on_event, {"type": "rerun", "reason": f"{what} process died and was "
                                "started again; the branches run again from the start"})
                reports = self._run_question(tasks, settings, policy_factory, on_event, cover,
                                             question)
        return reports

    def _run_question(self, tasks: list[BranchTask], settings: Settings,
                      policy_factory: Callable | None, on_event: Events, cover: Cover,
                      share: tuple[str, int] | None) -> list[BranchReport]:
        """Every branch at once where each has a CPU of its own (`at_once`): the covered ones
        run too, and their reports are dropped (waiting for the question's branch would only
        add its latency). Where they would share CPUs, the question's branch runs first and
        only the branches it does not cover follow, as in-process: a covered branch would
        slow the others down for nothing. The second wave ends by one branch timeout from
        the question's start, as the first would have. `share`: (question, replica), the
        question's cache, which every branch of this run uses; the run's branches are charged
        to that replica while they run."""
        together = cover is None or len(tasks) < 2 or self.at_once(len(tasks))
        if share is not None:
            self.balancer.charge(share[1], len(tasks))
            self.retrievers[share[1]].expect.remote(share[0], [t.subquery for t in tasks])
        try:
            if together:
                reports = self._run(tasks, settings, policy_factory, on_event, share)
                if cover is None or not reports:
                    return reports
                return reports[:1] + [r for r, t in zip(reports[1:], tasks[1:])
                                      if not cover(reports[0], t)]
            return self._in_turn(tasks, settings, policy_factory, on_event, cover, share)
        finally:
            if share is not None:
                self.balancer.done(share[1], len(tasks))

    def _in_turn(self, tasks: list[BranchTask], settings: Settings,
                 policy_factory: Callable | None, on_event: Events, cover: Cover,
                 share: tuple[str, int] | None) -> list[BranchReport]:
        """The question's branch, then the branches it does not cover (on the question's
        replica and cache, `share`, when there is one). A second wave with no time left, or
        no branch actor free before the deadline, is reported as timed out: the question's
        branch's evidence stands."""
        own = time.time() + settings.branch_timeout_s
        first = self._run(tasks[:1], settings, policy_factory, on_event, share)
        rest = [replace(t, deadline=own if t.deadline is None else min(t.deadline, own))
                for t in tasks[1:] if not cover(first[0], t)]
        if not rest:
            return first
        if time.time() < own and not called_off():
            try:
                return first + self._run(rest, settings, policy_factory, on_event, share)
            except Overloaded:
                pass
        late = [not_started(t) for t in rest]
        for report in late:
            emit(on_event, done_event(report))
        return first + late

    def at_once(self, branches: int) -> bool:
        """Whether a question's `branches` start together: always for the LLM policy (its
        branches wait on engines that batch their calls), else when the cluster has a CPU for
        each of them beside the branches already in flight (this executor's, or the shared
        pool's busy actors, whichever is more: the service's indexes share one pool)."""
        if not self.hosts:
            return True
        return max(sum(self.balancer.load), self.pool.busy) + branches <= self.cpus

    def _run(self, tasks: list[BranchTask], settings: Settings,
             policy_factory: Callable | None, on_event: Events,
             share: tuple[str, int] | None = None) -> list[BranchReport]:
        """`tasks` at once. `share`: (question, replica) when the question's branches share
        that replica's cache (the caller charged and releases it); else each branch takes the
        least-loaded replica."""
        carrier = telemetry.current_carrier()
        stream = on_event is not None
        question = share[0] if share is not None else None
        replicas = ([share[1]] * len(tasks) if share is not None
                    else [self.balancer.take() for _ in tasks])
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
                        bounded(tasks[0], settings), carrier, policy_factory, key,
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
            if share is None:
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
            emit(on_event, done_event(report))
        return reports

    def _report(self, task: BranchTask, place: Placement, done: set, timeout: float
                ) -> BranchReport | None:
        """The branch's report: its own, or a timeout; None for a hosted branch whose replica
        died (it can run again elsewhere)."""
        if place.ref in done:
            return self._collect(task, place)
        if place.actor is not None:
            self.pool.replace(place.actor)  # it is still busy
        elif place.events:  # hosted: it ends by its deadline; its events are not kept
            self.retrievers[place.replica].branch_events.remote(place.events, True)
        return BranchReport(task.index, task.subquery, task.weight, task.kind, "timeout",
                            f"no result within {within(timeout)}")

    def _wait(self, places: list[Placement], timeout: float, on_event: Events) -> set:
        """The refs that finished within `timeout`; meanwhile, with a watcher, the branches'
        events are drained every POLL_S and passed on. A search called off meanwhile
        (`called_off`) cancels its branches' tasks: each ends at its next turn, and is
        waited for as before (its actor is free once it has)."""
        import ray

        refs = [p.ref for p in places]
        end, done, cancelled = time.monotonic() + timeout, set(), False
        while True:
            self._not_lost()  # a branch whose calls wait on the gone head would wait its timeout
            left = end - time.monotonic()
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=max(min(self.POLL_S,
                                                                              left), 0))
            done = set(ready)
            if not cancelled and called_off():
                cancelled = True
                for ref in refs:
                    if ref not in done:
                        ray.cancel(ref, recursive=False)  # (its retrieval call ends as is)
            if on_event is None:
                if len(done) == len(refs) or left <= 0:
                    return done
                continue
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
        except ray.exceptions.TaskCancelledError:  # its search was called off (`_wait`): the
            if place.actor is not None:  # branch ended at its next turn
                self.pool.release(place.actor)
            return BranchReport(task.index, task.subquery, task.weight, task.kind, "timeout",
                                "its search was called off")
        except (ray.exceptions.RayActorError,  # ActorUnavailableError too (restarting)
                ray.exceptions.OutOfMemoryError) as exc:  # killed by Ray's memory monitor
            if place.actor is None:
                return None
            error = f"{ACTOR_DIED}{error_line(exc, 480)}"
            self.pool.replace(place.actor)
        except ray.exceptions.RayTaskError as exc:
            error = error_line(exc, 500)
            if place.actor is not None:
                self.pool.release(place.actor)
        return BranchReport(task.index, task.subquery, task.weight, task.kind, "error", error)

    def warm(self, settings: Settings) -> None:
        """Nothing to do: every actor loaded its models as it started."""

    def close(self) -> None:
        from branchsearch.infra.raycluster import local_cluster_lost, stop_lost_cluster

        self._closed.set()
        # a local cluster stopped since the last look (a SIGTERM to the batch's process group)
        self.lost = self.lost or local_cluster_lost() or ""
        if self.lost:  # nothing of it is left to release, and each call would wait for it
            stop_lost_cluster()
            return
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


_DEAD = object()
ANSWER_WAIT_S = 60.0  # the most a revive waits for a replica's answer, with no deadline


def _answer(replica, wait_s: float = ANSWER_WAIT_S):
    """The replica's pid once it answers: waiting while Ray restarts it (its calls fail fast
    meanwhile); `_DEAD` when it is dead for good; None when it does not answer in time."""
    import ray

    end = time.monotonic() + wait_s
    while True:
        try:
            return ray.get(replica.ping.remote(), timeout=max(end - time.monotonic(), 0.1))
        except ray.exceptions.ActorDiedError:
            return _DEAD
        except ray.exceptions.ActorUnavailableError:  # restarting: ask again shortly
            if time.monotonic() >= end:
                return None
            time.sleep(0.2)
        except Exception:  # noqa: BLE001 — busy past the wait, or another failure
            return None


def _left(tasks: list[BranchTask]) -> float | None:
    """Seconds until the question's deadline (None: no deadline)."""
    deadline = min([t.deadline for t in tasks if t.deadline is not None], default=None)
    return None if deadline is None else max(deadline - time.time(), 0.0)


def within(timeout: float) -> str:
    """A branch's wait said for its timeout report: "8 s", "3.98 ms", and for a wait with no
    time left (the deadline had passed) "0 s (the deadline had passed)", not "0 s" alone or
    "0.00398 s"."""
    if timeout <= 0:
        return "0 s (the deadline had passed)"
    if timeout < 1:
        return f"{timeout * 1000:.3g} ms"
    return f"{timeout:.3g} s"
