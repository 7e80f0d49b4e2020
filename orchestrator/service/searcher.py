"""What the service does for a caller, as one plain async class: no HTTP.

`Searcher` holds one `Driver` per open index (owned under the data home or declared external;
when one starts and goes is `service.drivers`), the executor the CLI uses, and — with the Ray
executor — one branch pool shared by every index, with CPU room for each index's retrievers. It
admits a request (the key's indexes, its per-key concurrency), runs the search within the
request's deadline, streams the driver's events, guards every id it returns against the caller's
groups, and writes documents through the stores' owner.

Standalone (`serve --standalone`) runs it in the uvicorn process; Ray Serve deploys this same
class as the `Searcher` deployment (`service.deploy`). Its async methods are the whole interface;
blocking work runs in threads, and a caller that goes away (a cancelled coroutine) calls its
search off: its branches end at their next turn, and its concurrency slot is free once they
have, or at its deadline at the latest (`admission.Slot`).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from branchsearch.infra.stores.acl import ACL_ALL, acl_visible, group_name
from branchsearch.infra.errors import (BranchsearchError, IndexIncomplete,
                                       IndexNotFound, error_line, public_line)
from branchsearch.infra.config.settings import Settings, index_name_problem
from branchsearch.infra.index.catalog import index_names
from branchsearch.orchestrator.service import documents
from branchsearch.orchestrator.service import events
from branchsearch.orchestrator.service.admission import Concurrency, Limits
from branchsearch.orchestrator.service.auth import ApiKey
from branchsearch.orchestrator.service.drivers import Drivers
from branchsearch.orchestrator.service.errors import (ApiError, Refused, api_error,
                                                      error_code)
from branchsearch.orchestrator.service.protocol import SearchRequest
from branchsearch.orchestrator.service.reachable import Servers, check_unopened
from branchsearch.orchestrator.service.readiness import (IndexProbes, Pending, SharedCheck,
                                                         Unanswered)

log = logging.getLogger("branchsearch.service")

_DONE = object()
# how long a readiness check waits for the probes of the indexes other than the default, from
# its start: well within a balancer's probe timeout (Kubernetes: 1 s), whatever their number
OTHERS_WAIT_S = 0.5
# how long the probe of an index not open gives its server backends to answer; an index whose
# probe has run that long is counted not ready, whatever its probe of before answered
PROBE_TIMEOUT_S = 3.0
# how long an index's probe answer is given again with no new probe (`readiness.IndexProbes`)
PROBE_FRESH_S = 2.0
# how long past its deadline a search may take to hand back what its branches found (the driver
# ends late branches as timeouts at the deadline; a driver blocked on a frozen backend is not
# waited for: the caller gets its 504 within this of the deadline it asked for)
JOIN_GRACE_S = 2.0


class Searcher:
    def __init__(self, settings: Settings, *, executor: str = "ray", limits: Limits = Limits(),
                 driver_factory: Callable | None = None, warm: bool = False,
                 default_index: bool = True):
        """`driver_factory(settings, executor)`: how a driver is made (tests); `warm`: open the
        default index now (a Serve replica loads its models before taking traffic);
        `default_index`: `settings.index` is the default index, the one a search that names
        none searches; False: there is none (a home of several indexes, none named), and such
        a search is a 422."""
        self.settings, self.executor, self.limits = settings, executor, limits
        self.default = settings.index if default_index else None
        self.driver_factory = driver_factory or self._make_driver
        self.concurrency = Concurrency(limits)
        # a thread for every request the server admits (and a few for readiness and writes), so
        # no admitted request waits for a thread while its deadline runs (asyncio's default
        # pool has min(32, CPUs + 4))
        self._threads = ThreadPoolExecutor(max_workers=limits.max_in_flight + 8,
                                           thread_name_prefix="searcher")
        self._pool_lock = threading.Lock()
        self.pool = None  # the branch pool every index shares (Ray executor), made once
        self._retriever_options: dict = {}
        # CPU reserved for retrievers: the pool was planned with room for this many indexes'
        # retrievers (those found at its start, and one more); `_cpu_holders` hold it now
        self._retriever_room = 0
        self._cpu_holders: set = set()
        self.acl_guard_dropped = 0  # ids a layer below returned to a caller who may not see them
        self.drivers = Drivers(settings, make=lambda s: self.driver_factory(s, self.executor),
                               close=self._close, default=self.default,
                               idle_close_s=limits.index_idle_close_s,
                               max_open=limits.max_open_indexes,
                               retry_after_s=limits.retry_after_s)
        self._readiness = SharedCheck(self._ready)  # one at a time, on its own thread
        # the indexes' probes: the other indexes' of a check (`_ready`), and those of a search
        # that failed or found nothing, one running at a time an index (`_probe_until`)
        self._index_probes = IndexProbes(fresh_s=PROBE_FRESH_S, slow_s=PROBE_TIMEOUT_S)
        # the server backends those probes ask, each once for the indexes that live on it
        self._servers = Servers(fresh_s=OTHERS_WAIT_S)
        # each index's settings for those probes, made once: `Settings.replace` reads every
        # declared index anew, so made at each probe its cost grew with the square of their
        # number
        self._settings_of = functools.lru_cache(maxsize=4096)(
            lambda index: settings.replace(index=index))
        if warm:
            self.open_default()

    # --- the interface (standalone calls it, Serve deploys it) ----------------------------------

    async def search(self, req: SearchRequest, key: ApiKey) -> dict:
        """The result dict (`search --json` shape plus `status`, `index`). ApiError for every
        refusal."""
        arrived = self._arrived(req)  # the deadline counts from here
        self._check_searched(req, key)
        return await self._searching(await self._admit(req, key, arrived), req, key, None,
                                     arrived)

    async def stream(self, req: SearchRequest, key: ApiKey) -> AsyncIterator[dict]:
        """Events as they happen, ending with `result` (or `error`). A refusal before the search
        starts (403, 429, 404) is raised, so the HTTP status can still say so."""
        arrived = self._arrived(req)
        self._check_searched(req, key)
        slot = await self._admit(req, key, arrived)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        put = lambda e: loop.call_soon_threadsafe(queue.put_nowait, e)  # noqa: E731
        work = asyncio.ensure_future(self._searching(slot, req, key, put, arrived))
        work.add_done_callback(lambda _: queue.put_nowait(_DONE))
        first = True
        try:
            while (item := await queue.get()) is not _DONE:
                first = False
                yield item
            if work.exception() is not None:
                err = api_error(work.exception())
                if first:
                    raise err
                yield {"type": "error", "status": err.status, **err.body()}
        finally:
            if not work.done():
                work.cancel()

    async def _admit(self, req: SearchRequest, key: ApiKey, arrived: float):
        """One of the key's slots (`admission.Concurrency.admit`), waited for in the key's
        queue at most until the request's deadline: the wait counts against it."""
        deadline = req.deadline_s or self.limits.default_deadline_s
        return await self.concurrency.admit(key.name, arrived + deadline)

    def _arrived(self, req: SearchRequest) -> float:
        """When (monotonic) the request reached the service: its HTTP arrival at the ingress
        (`received_at`, wall clock: Serve's queue to this replica counts), else now. A request
        whose deadline passed while it waited is answered 504 at once, not searched, nor
        refused for a reason (429) that no longer holds."""
        now = time.monotonic()
        if req.received_at is None:
            return now
        waited = min(max(time.time() - req.received_at, 0.0), self.limits.max_deadline_s)
        deadline = req.deadline_s or self.limits.default_deadline_s
        if waited >= deadline:
            raise ApiError(504, "deadline_exceeded", f"the request waited {waited:.1f} s in "
                           f"the service's queues, past its deadline of {deadline:g} s")
        return now - waited

    async def _searching(self, slot, req: SearchRequest, key: ApiKey,
                         on_event: Callable[[dict], None] | None, arrived: float) -> dict:
        """`_search` on the searcher's threads, holding the key's `slot` (`admission.Slot`)
        until its work has ended or its deadline (and `JOIN_GRACE_S`) has passed: a caller
        that goes away (this coroutine cancelled) calls the search off, its branches end at
        their next turn, and the slot is free once they have. So a key's limit bounds the
        searches running for it, not only those awaited, each for its deadline at most."""
        call = functools.partial(contextvars.copy_context().run, self._search, req, key,
                                 on_event, arrived, slot)
        try:
            future = self._threads.submit(call)
        except BaseException:
            slot.let_go()
            raise
        future.add_done_callback(lambda _: slot.let_go())  # (also if cancelled unstarted)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            slot.stop.set()
            raise

    async def upsert(self, index: str, body: bytes, key: ApiKey,
                     received_at: float | None = None) -> dict:
        return await self._writing(received_at, self._upsert, index, body, key)

    async def delete(self, index: str, doc_id: str, key: ApiKey,
                     received_at: float | None = None) -> dict:
        return await self._writing(received_at, self._delete, index, doc_id, key)

    async def ready(self) -> dict:
        return await self._in_thread(self._ready_now)

    async def indexes(self) -> list[str]:
        return self.index_names()

    async def gauges(self) -> dict[str, int]:
        return self.gauges_now()

    def gauges_now(self) -> dict[str, int]:
        """The searcher's figures in `/metrics`: the ids its ACL guard removed, and the
        searches past their deadline (answered 504) whose thread still waits on a backend,
        holding places of `max_in_flight` (`Concurrency.past_deadline`)."""
        return {"guard_dropped": self.acl_guard_dropped,
                "past_deadline": self.concurrency.past_deadline}

    # --- across a Ray Serve handle (`app.SearcherClient`) --------------------------------------

    async def answer(self, method: str, *args):
        """`method(*args)`, a refusal returned as `Refused` (see there), not raised."""
        try:
            return await getattr(self, method)(*args)
        except (ApiError, BranchsearchError) as exc:
            return Refused(api_error(exc))

    async def answer_stream(self, req: SearchRequest, key: ApiKey) -> AsyncIterator:
        """`stream`, a refusal before the first event yielded as `Refused`."""
        try:
            async for event in self.stream(req, key):
                yield event
        except (ApiError, BranchsearchError) as exc:
            yield Refused(api_error(exc))

    async def _writing(self, received_at: float | None, fn: Callable, *args) -> dict:
        """A document write `fn(end, *args)` answered within the service's deadline (counted
        from `received_at`, the request's arrival, wall clock) and `JOIN_GRACE_S`. A write not
        begun by the deadline (waiting for the index, or for another write to it) never
        begins: 504, nothing written. One begun runs on to its end on its thread, holding the
        index's write lock, so it lands before any later write; its caller gets a 504 saying
        so, and repeating the same write is safe (a PUT replaces by id, a DELETE then says 404)."""
        deadline = self.limits.default_deadline_s
        end = (time.time() if received_at is None else received_at) + deadline
        work = asyncio.ensure_future(self._in_thread(fn, end, *args))
        await asyncio.wait({work}, timeout=max(end + JOIN_GRACE_S - time.time(), 0.0))
        if work.done():
            return work.result()
        work.add_done_callback(_log_late_write)
        raise ApiError(504, "deadline_exceeded", f"the write did not finish within the "
                       f"deadline of {deadline:g} s (a store is slow or not answering); it "
                       "goes on, and lands whole or not at all: repeat it to be sure it did (a "
                       "PUT replaces by id; a DELETE that answers 404 then is done)")

    async def _in_thread(self, fn: Callable, *args):
        """`fn(*args)` on the searcher's threads, in the caller's context (its trace span), as
        `asyncio.to_thread` would run it on asyncio's smaller default pool."""
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self._threads, call)

    def check_health(self) -> None:  # Serve restarts a replica whose check raises
        pass

    # --- indexes, and what their drivers run on --------------------------------------------------

    def index_names(self) -> list[str]:
        return index_names(self.settings)

    def open_default(self):
        """The default index's driver, opened before the service takes traffic (its models
        loaded); a default index that is not there names the ones that are. None without a
        default index."""
        if self.default is None:
            return None
        try:
            return self.drivers.open(self.default)
        except IndexNotFound as exc:
            raise not_found(exc, self.settings) from None

    def _index(self, req: SearchRequest) -> str:
        if req.index is None and self.default is None:
            raise ApiError(422, "bad_request", "this server has no default index: name the "
                           "index to search as `index` (GET /v1/indexes lists those your key "
                           "may use)")
        return req.index or self.default

    def _make_driver(self, settings: Settings, executor: str):
        from branchsearch.orchestrator.driver import Driver

        if executor != "ray":
            driver = Driver(settings, mode=executor)
        else:
            from branchsearch.orchestrator.execution.ray import RayExecutor

            pool = self._branch_pool()
            options = self._retriever_share(settings.index)
            try:
                driver = Driver(settings, mode="ray", executor=RayExecutor(
                    settings, pool.size, pool=pool, retriever_options=options))
            except BaseException:
                if options.get("num_cpus"):
                    self._room_back()
                raise
            if options.get("num_cpus"):  # until `_close`
                with self._pool_lock:
                    self._cpu_holders.add(driver)
        try:
            driver.warm()  # the first request after a start or a reopen waits for no model
        except BaseException:
            self._close(driver, None)
            raise
        return driver

    def _retriever_share(self, index: str) -> dict:
        """The Ray options of an index's retriever actors: the planned CPU share while the
        pool left room for it; past that (indexes made after the service started), none. An
        actor asking for CPUs the pool holds would wait for them until its start timed out,
        and the index would answer 503 until the service restarted; one that reserves none is
        placed at once and shares the CPUs with the rest, as every process on a machine does."""
        import ray

        options = dict(self._retriever_options)
        need = options.get("num_cpus", 0) * max(self.settings.retriever_replicas, 1)
        with self._pool_lock:  # the room planned, and still free (not taken by others since)
            if (self._retriever_room > 0 and need
                    and ray.available_resources().get("CPU", 0) >= need):
                self._retriever_room -= 1
                return options
        if options.get("num_cpus"):
            log.warning("index %r: no CPU room is left for its retriever actors (the branch "
                        "pool left room for the indexes there were when it started, and one "
                        "more); they reserve none and share the CPUs (restarting the service "
                        "plans for every index)", index)
        return {**options, "num_cpus": 0}

    def _room_back(self, driver=None) -> None:
        """The CPU room a retriever start took is free again: the start failed (no `driver`),
        or `driver`, which held it, is closed."""
        with self._pool_lock:
            if driver is None or driver in self._cpu_holders:
                self._cpu_holders.discard(driver)
                self._retriever_room += 1

    def _close(self, driver, docstore) -> None:
        """Close a driver (and its docstore); the CPU its retrievers reserved is free again."""
        try:
            _close(driver, docstore)
        finally:
            self._room_back(driver)

    def _branch_pool(self):
        """The one branch pool of the service, planned against what the cluster has free now
        (Serve's replicas, proxy and controller placed), with room for every index's retriever;
        every actor placed before any search waits on one."""
        with self._pool_lock:
            if self.pool is None:
                import ray

                from branchsearch.infra.raycluster import connect
                from branchsearch.orchestrator.execution.actor_plan import plan_service
                from branchsearch.orchestrator.execution.pool import BranchPool, wait_started

                resources = connect(self.settings)
                free, replicas = ray.available_resources(), _serve_replicas()
                if replicas > 1:  # each searcher replica plans its own pool: its share of it
                    free = {k: v / replicas if k in ("CPU", "GPU") else v
                            for k, v in free.items()}
                plan = plan_service(self.settings, free, len(self.index_names()),
                                    self.settings.branches * max(self.settings.batch_concurrency, 1))
                pool = BranchPool(plan.branch_actors, plan.branch, self.settings)
                try:
                    wait_started(pool.ping_all(), f"{plan.branch_actors} branch actor(s)",
                                 self.settings.actor_start_timeout_s, resources,
                                 {"CPU": plan.branch["num_cpus"] * plan.branch_actors})
                except BaseException:
                    pool.close()
                    raise
                log.info("branch pool: %d actors of %g CPU; retrievers %g CPU each%s",
                         plan.branch_actors, plan.branch["num_cpus"], plan.retriever["num_cpus"],
                         f" (1/{replicas} of the free CPUs: one of {replicas} searcher "
                         "replicas)" if replicas > 1 else "")
                self.pool, self._retriever_options = pool, plan.retriever
                self._retriever_room = plan.retriever_room
            return self.pool

    def close(self) -> None:
        self._readiness.close()
        self._index_probes.close()
        self._threads.shutdown(wait=False)
        self.drivers.close()
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def _in_retriever(self, index: str, driver, local_fn, actor_fn, *args,
                      timeout: float | None = 120, start_s: float = PROBE_TIMEOUT_S):
        """Run on the stores' owner: in this process (local) or in the retriever actor (Ray),
        waiting at most `timeout` s for the actor (None: until it is done). A retriever actor
        dead for good (killed past its restarts, its node gone) takes its driver out of
        service, so the next request starts the index afresh: a 503 to retry. One started
        afresh and still starting (placed on no node: a cluster without room) is waited for
        at most `start_s` before anything is sent to it, then a 503 to retry
        (`RayExecutor.owner_started`)."""
        from branchsearch.orchestrator.execution.ray import RayExecutor

        if not isinstance(driver.executor, RayExecutor):
            return local_fn(driver.executor.retriever, *args)
        import ray

        driver.executor.owner_started(start_s)
        try:
            # __ray_call__ runs a function on the actor, its instance as first argument
            return ray.get(driver.executor.retriever.__ray_call__.remote(actor_fn, *args),
                           timeout=timeout)
        except ray.exceptions.ActorDiedError as exc:
            self.drivers.retire_dead(index, driver, exc)
            raise ApiError(503, "backend_unavailable", f"the retriever process of index "
                           f"{index!r} died; the next request starts it again: retry",
                           {"Retry-After": "5"}) from None
        except (ray.exceptions.ActorUnavailableError,  # lost mid-call, restarting
                ray.exceptions.OutOfMemoryError) as exc:  # killed by Ray's memory monitor (if
            # not restarted, the next call finds it dead for good: ActorDiedError above)
            log.warning("index %r: its retriever actor was lost during a call: %s", index,
                        error_line(exc, 500))
            raise ApiError(503, "backend_unavailable", f"the retriever process of index "
                           f"{index!r} was lost during the call and is starting again; retry "
                           "(a document write may or may not have been applied: repeating it "
                           "is safe)", {"Retry-After": "5"}) from None

    # --- search ---------------------------------------------------------------------------------

    @staticmethod
    def groups(key: ApiKey) -> list[str]:
        """The ACL groups a search runs with: the key's, never None (None would be public-only
        by contract; a list is unambiguous)."""
        return [ACL_ALL] if ACL_ALL in key.groups else list(key.groups)

    @staticmethod
    def check_index(index: str, key: ApiKey) -> None:
        """422 for a bad index name, 403 for an index the key may not use: the key alone
        decides, so the ingress refuses before the searcher's queue too (`app`)."""
        problem = index_name_problem(index)
        if problem:
            raise ApiError(422, "bad_request", problem)
        if not key.may_use(index):
            raise ApiError(403, "forbidden", f"key {key.name!r} may not use index {index!r}")

    def _check_searched(self, req: SearchRequest, key: ApiKey) -> None:
        """`check_index` for the index a search runs on. The default, when the request names
        none, is not named to a key that may not use it: index names are for the keys that
        may use them (GET /v1/indexes, /readyz)."""
        index = self._index(req)  # (a 422 where there is no default)
        if req.index is None and not key.may_use(index):
            raise ApiError(403, "forbidden", f"key {key.name!r} may not use the server's "
                           "default index: name one of its indexes as `index` (GET "
                           "/v1/indexes lists them)")
        self.check_index(index, key)

    def _search(self, req: SearchRequest, key: ApiKey,
                on_event: Callable[[dict], None] | None, arrived: float, slot) -> dict:
        """The search itself (a worker thread): events go to `on_event`, ending with
        `result`. The deadline counts from `arrived`, the request's arrival; `slot`: the
        caller's (`_searching`)."""
        index = self._index(req)
        deadline = req.deadline_s or self.limits.default_deadline_s
        started = arrived
        groups = self.groups(key)
        with self.drivers.using(index, wait=max(deadline - (time.monotonic() - started), 0.001)
                         ) as (driver, store):
            hidden = self._hidden(store, groups)
            emit = self._guarded(hidden, on_event) if on_event is not None else None
            left = max(deadline - (time.monotonic() - started), 0.001)
            result = self._run(driver, req, groups, left, emit, slot)
            out = events.result_dict(result, req.k)
            out["index"] = index
            self._check_failure(driver, out, deadline - (time.monotonic() - started))
            # (within `using`: the guard reads the docstore, which a close of the index, once
            # its last request has left, would shut under it — a crash in sqlite)
            event, _ = events.guard({"type": "result", "result": out}, hidden)
        event = events.public(event)
        if on_event:
            on_event(event)
        return event["result"]

    def _run(self, driver, req: SearchRequest, groups, deadline: float, emit, slot):
        """Driver.search within the deadline (the driver reports late branches as timeouts;
        the join is the backstop). The search's thread counts as a user of the driver until it
        ends, so a search that outlives its request is never left running on closed stores;
        it is called off (its branches end at their next turn) when `slot.stop` is set. It
        holds the caller's `slot` until it ends or the join gives up on it (the 504), whichever
        comes first: a thread stuck past the deadline (a backend call within its
        `backend_timeout_s`, a retriever actor that Ray restarts and cannot place) would
        otherwise hold its key's slot as long, and the key's next searches would be refused
        429 long after this one's caller had its 504. Such a thread keeps its place in the
        server's count (`max_in_flight`) until it ends (`Slot.outlive`)."""
        from branchsearch.workers.harness import CALLED_OFF

        box: dict = {}
        self.drivers.also(driver)
        release = slot.hold()
        past = threading.Lock()  # the thread's end and the 504's `outlive`, one after the other
        state: dict = {"ended": False, "end": None}

        def work():
            CALLED_OFF.set(slot.stop.is_set)  # (this thread's own context)
            try:
                box["result"] = driver.search(
                    req.question, max_branches=req.branches, acl_groups=groups,
                    deadline_s=deadline,  # no watcher (JSON): no events to make
                    on_event=None if emit is None else
                    (lambda e: emit(e) if e.get("type") != "result" else None))
            except BaseException as exc:  # noqa: BLE001 — carried to the caller's thread
                box["error"] = exc
            finally:
                self.drivers.let_go(driver, None)
                with past:
                    state["ended"] = True
                release()
                if state["end"] is not None:  # (set before `ended`, or never)
                    state["end"]()

        worker = threading.Thread(target=work, name="search", daemon=True)
        try:
            worker.start()
        except BaseException:
            self.drivers.let_go(driver, None)
            release()
            raise
        worker.join(deadline + JOIN_GRACE_S)
        if worker.is_alive():  # no one will read what it finds
            slot.stop.set()
            with past:
                if not state["ended"]:
                    state["end"] = slot.outlive(release)
            log.warning("a search still runs %g s past its deadline: called off, its slot "
                        "freed (it ends at its next turn, or when what it waits on "
                        "answers)", JOIN_GRACE_S)
            raise ApiError(504, "deadline_exceeded",
                           f"no result within the deadline of {deadline:g} s")
        if "error" in box:
            raise box["error"]
        return box["result"]

    def _check_failure(self, driver, out: dict, left: float) -> None:
        """A failed search answers 503/504 with the reason, never an empty 200; an empty result
        is checked against the backends, so a backend that is down never looks like no hits.
        The check is the index's one running probe (`IndexProbes.probing`: the searches that
        fail at once on a backend share it), waited for until the deadline (`left` s from now), or
        `JOIN_GRACE_S` for a search that ran to it: a backend that takes connections and does
        not answer (frozen, or a server still starting) would hold the answer for its whole
        `backend_timeout_s` past the deadline."""
        if out["status"] == "failed":
            if all(b["status"] == "timeout" for b in out["branches"]):
                raise ApiError(504, "deadline_exceeded", "no branch finished within the "
                               "deadline")
            self._probe_until(out["index"], driver, left)
            log.error("every branch failed: %s",
                      "; ".join(sorted({b.get("error", "") for b in out["branches"]})))
            raise ApiError(503, "search_failed", "every branch failed (the server log says "
                           "why); retry later", {"Retry-After": "5"})
        if not out["evidence"]:
            self._probe_until(out["index"], driver, left)

    def _probe_until(self, index: str, driver, left: float) -> None:
        probe = self._index_probes.probing((index, driver),
                                           functools.partial(self._probe_held, index, driver))
        try:
            outcome = probe.result(timeout=max(left, JOIN_GRACE_S))
        except FutureTimeout:
            raise ApiError(503, "backend_unavailable", "the index's backends did not answer "
                           "within the search's deadline; retry later",
                           {"Retry-After": "5"}) from None
        if outcome is not None:
            raise outcome

    def _probe(self, index: str, driver) -> dict:
        try:
            return self._in_retriever(index, driver, documents.probe, documents.probe_in_actor)
        except ApiError:
            raise
        except Exception as exc:  # noqa: BLE001 — any backend failure is a 503 with its reason
            cause = getattr(exc, "cause", None) or exc
            log.error("backend unavailable: %s", error_line(cause, 1000))
            raise ApiError(503, "backend_unavailable", public_line(cause),
                           {"Retry-After": "5"}) from None

    # --- the ACL guard ---------------------------------------------------------------------------

    def _hidden(self, store, groups: list[str]) -> Callable[[list[str]], set[str]]:
        def hidden(ids: list[str]) -> set[str]:
            if store is None:  # an external index: the backends' filter is all
                return set()
            # read now: a chunk whose document an admin narrowed or deleted, or cut to fewer
            # chunks, since a branch read it is no longer the caller's
            rows = store.get_chunks(ids)
            bad = {cid for cid in ids
                   if cid not in rows or not acl_visible(rows[cid]["acl"], groups)}
            if bad:
                self.acl_guard_dropped += len(bad)
                log.error("ACL guard dropped %d chunk ids a branch returned to groups %s",
                          len(bad), groups)
            return bad
        return hidden

    def _guarded(self, hidden: Callable[[list[str]], set[str]], on_event):
        def emit(event: dict) -> None:
            if event.get("type") == "plan":  # the web page draws token bars against it
                event = {**event, "budget_tokens": self.settings.budget_tokens}
            on_event(events.public(events.guard(event, hidden)[0]))
        return emit

    # --- documents -------------------------------------------------------------------------------

    def _upsert(self, end: float, index: str, body: bytes, key: ApiKey) -> dict:
        self.check_writer(key, index)
        docs = documents.parse_documents(body)
        with self._writable(index, end) as (driver, store):
            with self._write_turn(index, driver, end):
                # (checked under the lock: what the check reads is what the write replaces)
                for doc in docs:  # a scoped admin writes its groups' documents, and only those
                    why = self._not_its(key, doc, _held(store, doc.id))
                    if why:
                        raise ApiError(403, "forbidden", f"key {key.name!r} may write only "
                                       f"documents whose acl is within its groups "
                                       f"({', '.join(key.groups)}); {why}")
                self._check_files(driver)
                self._owner_started(driver, end)
                self._renew_version(driver, before=True)  # a write failing midway changes it
                counts = self._write(index, driver, end, documents.upsert,
                                     documents.upsert_in_actor, driver.settings, docs)
                self._renew_version(driver)
        return {"index": index, "upserted": [d.id for d in docs], **counts}

    def _delete(self, end: float, index: str, doc_id: str, key: ApiKey) -> dict:
        self.check_writer(key, index)
        missing = ApiError(404, "document_not_found", f"no document {doc_id!r} in {index!r}")
        with self._writable(index, end) as (driver, store):
            with self._write_turn(index, driver, end):
                # (checked under the lock, as an upsert's: a write that held the turn meanwhile
                # may have put another group's document under this id)
                olds = _held(store, doc_id)  # `pub-ü` typed on macOS arrives NFD
                if not all(acl_visible(old["acl"], self.groups(key)) for old in olds):
                    raise missing  # an id the key may not see answers as a missing one
                if not all(self._owns(key, old["acl"]) for old in olds):
                    held = ("public: only a global admin key deletes public documents"
                            if not any(old["acl"] for old in olds) else "not")
                    raise ApiError(403, "forbidden", f"key {key.name!r} may delete only "
                                   f"documents whose acl is within its groups; document "
                                   f"{doc_id!r} is {held}")
                doc_id = olds[0]["doc_id"] if olds else doc_id  # as the index holds it
                self._check_files(driver)
                self._owner_started(driver, end)
                if olds:  # (none: a repeat clearing what a failed delete left, renewed then)
                    self._renew_version(driver, before=True)  # one failing midway changes it
                found = self._write(index, driver, end, documents.delete,
                                    documents.delete_in_actor, driver.settings, doc_id)
                if found:
                    self._renew_version(driver)
        if not found:
            raise missing
        return {"index": index, "deleted": doc_id}

    @staticmethod
    def _owner_started(driver, end: float) -> None:
        """A write's wait, until `end`, for its index's retriever started afresh (Ray), before
        the index's version changes: a write refused for it (503) changed nothing."""
        from branchsearch.orchestrator.execution.ray import RayExecutor

        if isinstance(driver.executor, RayExecutor):
            driver.executor.owner_started(end - time.time())

    def _writable(self, index: str, end: float):
        """`drivers.using` for a document write until `end` (its deadline, wall clock), which
        an external index refuses."""
        if self.settings.replace(index=index).external is not None:
            raise ApiError(409, "read_only_index", f"index {index!r} is an external index "
                           "(declared in the settings): branchsearch searches it in place and "
                           "never writes to it")
        return self.drivers.using(index, wait=max(end - time.time(), 0.001))

    @contextmanager
    def _write_turn(self, index: str, driver, end: float):
        """The index's write lock (the service's writes one at a time) and its ingest lock, the
        first waited for until `end`: a write not begun by its deadline never begins (504)."""
        lock, left = self.drivers.write_lock(index), end - time.time()
        if left <= 0 or not lock.acquire(timeout=left):
            raise ApiError(504, "deadline_exceeded", f"the write could not begin within its "
                           f"deadline (index {index!r} was starting, or another write to it "
                           "ran); nothing was written: retry it")
        try:
            with self._ingest_lock(driver):
                yield
        finally:
            lock.release()

    @staticmethod
    def _owns(key: ApiKey, acl) -> bool:
        """A global admin writes any document; a scoped one only documents whose groups are
        all its own (a public document, seen by everyone, is a global admin's)."""
        return ACL_ALL in key.groups or (bool(acl) and {group_name(g) for g in acl}
                                         <= set(key.groups))

    @classmethod
    def _not_its(cls, key: ApiKey, doc, held: list[dict]) -> str:
        """Why `key` may not write `doc` over the documents `held` under its id ("" when it
        may), in words that name the fix: a document sent without an acl is public, which
        only a global admin writes; groups it names beyond the key's are named (the caller
        sent them); a held document is said public, or another group's without naming it."""
        if not cls._owns(key, doc.acl):
            if not doc.acl:
                return (f"document {doc.id!r} is sent without an acl, which makes it public: "
                        "only a global admin key writes public documents")
            beyond = sorted({group_name(g) for g in doc.acl} - set(key.groups))
            return f"document {doc.id!r} names groups beyond them: {', '.join(beyond)}"
        for old in held:
            if not cls._owns(key, old["acl"]):
                return (f"document {doc.id!r} is held in this index as a public document: "
                        "only a global admin key replaces it" if not old["acl"] else
                        f"document {doc.id!r} is held in this index by another group")
        return ""

    def _write(self, index: str, driver, end: float, local_fn, actor_fn, *args):
        """A document write on the stores' owner. An owner started afresh and not started by
        `end` (the write's deadline: a cluster with no room for it) is sent nothing, a 503 to
        retry; the write never lands later. A store that fails under it (a file gone, a
        server down) is a 503 saying what searches see now, not a 500. Domain errors and
        timeouts keep their status (api_error); a bug stays a 500."""
        try:  # waited for whole, as in this process: a write cut off by a timeout would go
            # on in the actor after its answer (a 504) and after the index's write lock
            done = self._in_retriever(index, driver, local_fn, actor_fn, *args, timeout=None,
                                      start_s=end - time.time())
        except Exception as exc:  # noqa: BLE001
            self._not_moved(index)
            cause = getattr(exc, "cause", None) or exc
            if isinstance(cause, (BranchsearchError, ApiError, TimeoutError, TypeError,
                                  AttributeError, NameError, AssertionError)):
                raise cause from None
            log.error("write to index %r failed: %s", index, error_line(cause, 1000))
            # upsert writes the docstore (what searches see) last, delete first
            now = ("searches still see the documents as they were; retry it"
                   if local_fn is documents.upsert else "repeat the delete to finish it (a 404 "
                   "then means searches no longer saw it, and the repeat cleared the rest)")
            raise ApiError(503, "write_failed", f"the write to index {index!r} did not complete "
                           f"({public_line(cause, 300)}); {now}") from None
        self._not_moved(index)
        return done

    def _not_moved(self, index: str) -> None:
        """A 503 `index_changed` when the index's folder was removed (or made anew) while a
        write ran: the write went to the removed files, whatever their stores answered."""
        if self.drivers.moved(index):
            raise ApiError(503, "index_changed", f"index {index!r} was removed or made anew "
                           "on disk during this write, which went to the removed files and "
                           "is lost with them; retry it (a 404 then means the index is gone)")

    @staticmethod
    def _check_files(driver) -> None:
        """A write to an index whose store files were deleted since its driver opened them
        would go to the open, deleted file and be lost: refused (503), as the CLI refuses to
        open such an index. Searches go on from what the stores hold open."""
        from branchsearch.infra.index.manifest import read_manifest
        from branchsearch.infra.index.profile import files_health

        folder = driver.settings.index_dir  # (the profile would see this write's own lock)
        manifest = read_manifest(folder)
        health = "no manifest" if manifest is None else files_health(folder, manifest)
        if health != "ok":
            raise IndexIncomplete(f"index {driver.settings.index!r} cannot take writes: "
                                  f"{health}")

    @staticmethod
    def _renew_version(driver, before: bool = False) -> None:
        """The index's documents may have changed: a new manifest `version`, so a `batch`
        resumed on it asks again what it answered before. Called in the write turn (the ingest
        lock held) before a write touches a store and again after it lands: a write that fails
        midway (one store written, the next one down; or answered 504 and failing later), or
        whose process dies, leaves the version of its start, not the one its rows were
        answered on; a batch that read the first version during the write is asked again after
        it. A write that fails before any store changed renews it too (asked again, never
        kept stale). A manifest that cannot be rewritten (it is replaced atomically, so it
        stays as it was; a disk full) refuses the write `before` it, 503 `write_failed` with
        nothing written, since a write failing midway would then leave the old version; after
        a write has landed it is the server log's, not the caller's."""
        from branchsearch.infra.index.manifest import renew_version

        try:
            renew_version(driver.settings.index_dir)
        except OSError as exc:
            log.error("index %r: its manifest's version could not be renewed %s a write "
                      "(%s): %s", driver.settings.index, "before" if before else "after",
                      "the write is refused" if before else
                      "a batch resumed on it keeps its earlier answers", error_line(exc, 300))
            if before:
                raise ApiError(503, "write_failed", f"index {driver.settings.index!r} cannot "
                               "record a change now (its manifest could not be rewritten: the "
                               "server log says why); nothing was written; retry it later",
                               {"Retry-After": "5"}) from None

    @staticmethod
    def _ingest_lock(driver):
        """The index's ingest lock (`infra.index.manifest`): a CLI ingest and a service write never
        run at once; IndexBusy (409; the server log names the ingest that holds it)."""
        from branchsearch.infra.index.manifest import SERVICE_WRITE, IngestLock

        return IngestLock(driver.settings.index_dir, driver.settings.index, corpus=SERVICE_WRITE)

    @classmethod
    def check_writer(cls, key: ApiKey, index: str) -> None:
        """`check_index`, and 403 for a key that is not an admin key."""
        cls.check_index(index, key)
        if not key.admin:
            raise ApiError(403, "forbidden", f"key {key.name!r} is not an admin key; document "
                                             "writes need one (`keys add --admin`)")
        if not key.may_use(index):
            raise ApiError(403, "forbidden", f"key {key.name!r} may not use index {index!r}")

    # --- health ------------------------------------------------------------------------------------

    def _ready_now(self) -> dict:
        """`_ready`'s answer within `readiness.SharedCheck.wait_s`, whatever the backends do."""
        try:
            return self._readiness()
        except Unanswered as exc:
            log.warning("not ready: %s", exc)
            raise ApiError(503, "not_ready", f"{exc} (the server log says which index, once "
                           "it ends)", {"Retry-After": "5"}) from None

    def _ready(self) -> dict:
        """Ready when the default index is open and its backends answer (without a default
        index, when the server is up); ApiError 503 otherwise. Every other index of the
        service is counted (`indexes`), and one that
        cannot serve is counted in `indexes_not_ready` and listed in `not_ready` (its name and
        the code its searches would meet), not made the server's state: an open one whose
        backends do not answer its probe, one a request asked for whose last start failed
        (`Drivers.failed`) — a start that failed on a backend not answering is asked again
        as an index not open, so it counts ready once its backend is back, with no search
        sent —, and one not open that could not open now (`reachable.check_unopened`: its
        profile, and its server backends asked, without starting it). Indexes usually live
        on clusters every replica shares, so a balancer that pulled each replica for one
        index's outage would take every other index down with it (that index's searches
        answer 503 meanwhile). Their probes (`readiness.IndexProbes`) run beside the
        default's on a few threads, each answer kept `PROBE_FRESH_S`; a check waits for them
        at most `OTHERS_WAIT_S` from its start, and an index whose probe has not ended by then
        is given its last probe's answer (not ready when none ended yet, or when its probe has
        run `PROBE_TIMEOUT_S` already: a frozen backend). So a check ends
        within that, whatever the number of indexes and however long a frozen backend holds
        its probe. The ingress shows `not_ready` only to a caller whose key may use those
        indexes (a load balancer has no key); the server log says why in full."""
        began = time.monotonic()
        default = self.default  # (None: no default index; every index is one of the others)
        try:
            if default is not None:
                self.drivers.open(default, wait=self.limits.default_deadline_s)
        except Exception as exc:  # noqa: BLE001
            log.warning("not ready: index %r: %s", default, error_line(exc, 1000))
            raise ApiError(503, "not_ready", "the default index is not ready (the server log "
                           "says why)", {"Retry-After": "5"}) from None
        opened = self.drivers.opened()
        probes = {(index, driver): functools.partial(self._probe_held, index, driver)
                  for index, driver in opened if index != default}
        probed = {index for index, _ in probes}
        names = self.index_names()
        # (one removed since its start failed is no index to count)
        failed = {i: why for i, why in self.drivers.failed().items()
                  if i != default and i in names and i not in probed}
        # an index not open is asked whether it could open: never started, or its last start
        # failed on a backend not answering (which may be back)
        failed_for_good = {i for i, (_, code) in failed.items() if code != "backend_unavailable"}
        ask = [index for index in names if index not in probed
               and index != default and index not in failed_for_good]
        probes.update(((index, None), functools.partial(self._probe_unopened, index))
                      for index in ask)
        waits = self._index_probes.start(probes)
        index = default
        driver = next((d for i, d in opened if i == index), None) if index is not None else None
        if driver is not None and self.drivers.hold(index, driver, probe=True) is not None:
            try:
                self._probe(index, driver)
            except ApiError as exc:
                log.warning("not ready: the default index %r: %s", index, exc.detail)
                raise ApiError(503, "not_ready", "the default index is not ready (the server "
                               "log says why)", {"Retry-After": "5"}) from None
            finally:
                self.drivers.let_go(driver, None, probe=True)
        not_ready: dict[str, str] = {}  # index -> the code its searches would meet
        counted = (default is not None) + len({i for i, _ in probes} | set(failed))  # the
        # default, and the others
        answers = self._index_probes.answers(waits, began + OTHERS_WAIT_S)
        for (index, _), answer in answers.items():
            if answer is None:
                continue
            if answer is Pending:
                log.warning("index %r not ready (the server still is): its backends have not "
                            "answered within %g s", index, OTHERS_WAIT_S)
                not_ready[index] = "backend_unavailable"
            elif isinstance(answer, IndexNotFound):  # removed since it was listed: no index
                counted -= 1
            else:  # an ApiError, or whatever a probe raised
                log.warning("index %r not ready (the server still is): %s", index,
                            getattr(answer, "detail", None) or error_line(answer, 1000))
                not_ready[index] = error_code(answer)
        for index, (why, code) in failed.items():
            if (index, None) not in answers:  # (one asked again is answered above)
                log.warning("index %r not ready (the server still is): its last start "
                            "failed: %s", index, why)
                not_ready[index] = code
        return {"status": "ready", "indexes": counted, "indexes_not_ready": len(not_ready),
                "not_ready": [{"index": i, "error": code}
                              for i, code in sorted(not_ready.items())]}

    def _probe_unopened(self, index: str) -> None:
        from branchsearch.infra.index.profile import index_profile

        settings = self._settings_of(index)
        check_unopened(settings, index_profile(settings), PROBE_TIMEOUT_S, self._servers)

    def _probe_held(self, index: str, driver) -> None:
        if self.drivers.hold(index, driver, probe=True) is None:  # closed meanwhile (idle,
            return  # changed on disk)
        try:
            self._probe(index, driver)
        finally:
            self.drivers.let_go(driver, None, probe=True)


def _log_late_write(work: asyncio.Future) -> None:
    """How a write whose caller got its 504 ended (the server log)."""
    exc = None if work.cancelled() else work.exception()
    log.warning("a document write answered 504 (past its deadline) has ended: %s",
                "it landed" if exc is None else f"it failed ({error_line(exc, 300)})")


def _held(store, doc_id: str) -> list[dict]:
    """The documents `store` holds under `doc_id` in any Unicode form (`DocStore.stored_ids`):
    what a write or delete of `doc_id` replaces; one as a rule."""
    return [doc for i in store.stored_ids(doc_id) if (doc := store.get_document(i)) is not None]


def _serve_replicas() -> int:
    """How many replicas of this searcher's Serve deployment share the cluster (1 outside
    Serve). They plan their branch pools at once, each from what is free: each plans for its
    share, or the first would take every CPU and the others' actors wait for them."""
    try:
        from ray import serve

        return max(int(serve.get_replica_context().world_size or 1), 1)
    except Exception:  # noqa: BLE001 — not a Serve replica (standalone), or an older Ray
        return 1


def _close(driver, docstore) -> None:
    driver.close()
    if docstore is not None:
        docstore.close()


def not_found(exc: IndexNotFound, settings) -> IndexNotFound:
    """The default index's not-found error, naming the indexes the data home has."""
    names = index_names(settings)
    if not names:
        return exc
    return IndexNotFound(f"{exc}; this data home has {', '.join(map(repr, names))}: serve one "
                         "with --index NAME")


def check_default(settings) -> None:
    """The default index's one-line error, if it cannot be served, without opening it: `serve`
    says it here rather than as the traceback of a replica that failed to start."""
    from branchsearch.infra.index.open import check_readable

    try:
        check_readable(settings)
    except IndexNotFound as exc:
        raise not_found(exc, settings) from None
