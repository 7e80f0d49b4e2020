"""What the service does for a caller, as a plain class: no HTTP, no Serve.

`Searcher` owns one `Driver` per index (the same executor the CLI uses), applies the key's ACL
groups, the per-key concurrency limit and the deadline, streams the driver's events, guards every
id it returns against the caller's groups, and writes documents through the stores' owner.
`AsyncSearcher` is the same thing for an event loop (threads underneath); the Serve deployment and
the uvicorn app both use it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable

from branchsearch.infra.backends import ACL_ALL
from branchsearch.infra.errors import (BackendUnavailable, BranchsearchError, IndexIncomplete,
                                       IndexNotFound, error_line)
from branchsearch.infra.settings import Settings
from branchsearch.orchestrator import documents, stream
from branchsearch.orchestrator.keys import ApiKey
from branchsearch.orchestrator.limits import ApiError, Concurrency, Limits, SearchRequest, api_error

log = logging.getLogger("branchsearch.service")

_DONE = object()


class Searcher:
    def __init__(self, settings: Settings, *, executor: str = "ray", limits: Limits = Limits(),
                 driver_factory: Callable | None = None):
        self.settings, self.executor, self.limits = settings, executor, limits
        self.driver_factory = driver_factory or _make_driver
        self.concurrency = Concurrency(limits)
        self._drivers: dict[str, object] = {}
        self._docstores: dict[str, object] = {}
        self._lock = threading.Lock()
        self._background: dict[str, dict] = {}  # index -> its one start, while it runs
        self._write_locks: dict[str, threading.Lock] = {}
        self.acl_guard_dropped = 0  # ids a layer below returned to a caller who may not see them

    # --- indexes and drivers ------------------------------------------------------------------

    def indexes(self) -> list[str]:
        root = self.settings.home / "indexes"
        return sorted(p.name for p in root.iterdir() if (p / "docs.sqlite").exists()) \
            if root.is_dir() else []

    def driver(self, index: str, wait: float | None = None):
        """The index's driver, started on first use. The start (its actors may take a while,
        or fail on a full cluster) runs in the background, one per index whatever the number
        of callers waiting on it, so searches of other indexes (and unknown-index answers) go
        on meanwhile. `wait`: the most seconds to wait for it (a request's deadline); past it,
        a 503 index_starting while the start goes on, instead of a request hanging past its
        deadline while another index's actors hold the cluster (up to
        `actor_start_timeout_s`). A failed start is tried again by the next caller."""
        with self._lock:
            if index in self._drivers:
                return self._drivers[index]
            start = self._background.get(index)
            if start is None:
                start = self._background[index] = {"done": threading.Event()}
                threading.Thread(target=self._start, args=(index, start), daemon=True,
                                 name=f"start-{index}").start()
        if not start["done"].wait(wait):
            raise ApiError(503, "index_starting", f"index {index!r} is still starting: its "
                           "searcher's actors are waiting for room on the cluster (other "
                           "indexes' searchers may hold it); retry later",
                           {"Retry-After": "5"})
        if "error" in start:
            raise start["error"]
        return start["driver"]

    def _start(self, index: str, start: dict) -> None:
        try:
            start["driver"] = self._open(index)
        except BaseException as exc:  # noqa: BLE001 — re-raised in the waiting callers
            start["error"] = exc
        finally:
            with self._lock:
                self._background.pop(index, None)
            start["done"].set()

    def _open(self, index: str):
        """Start the index's driver (`driver` makes sure only one start runs per index)."""
        settings = self.settings.replace(index=index)
        missing = IndexNotFound(f"index {index!r} not found (make it with `branchsearch "
                                f"ingest PATH --index {index}`)")
        if not settings.index_dir.is_dir():  # before any actor starts for it
            raise missing
        from branchsearch.infra.manifest import require_complete

        # incomplete, being ingested, or a copied folder: its 503 now, not the death of a
        # retriever actor whose constructor found it (ActorDiedError, a 500, under Ray)
        try:
            require_complete(settings.index_dir, index)
        except IndexNotFound:  # a folder without a docstore (its message names the home)
            raise missing from None
        from branchsearch.infra.docstore import DocStore

        driver = self.driver_factory(settings, self.executor)
        docs = settings.index_dir / "docs.sqlite"
        with self._lock:
            self._drivers[index] = driver
            self._docstores[index] = DocStore(docs) if docs.exists() else None
            self._write_locks[index] = threading.Lock()
        return driver

    def close(self) -> None:
        with self._lock:
            for d in self._drivers.values():
                d.close()
            for s in self._docstores.values():
                if s is not None:
                    s.close()
            self._drivers.clear()
            self._docstores.clear()

    def _in_retriever(self, driver, local_fn, actor_fn, *args):
        """Run on the stores' owner: in this process (local) or in the retriever actor (Ray)."""
        owner = driver.retriever  # a Retriever (local) or the retriever actor's handle (ray)
        if not hasattr(owner, "__ray_call__"):
            return local_fn(owner, *args)
        import ray

        # __ray_call__ runs a function on the actor, with the actor's instance as first argument
        return ray.get(owner.__ray_call__.remote(actor_fn, *args), timeout=120)

    # --- search ---------------------------------------------------------------------------------

    def groups(self, key: ApiKey) -> list[str]:
        """The ACL groups a search runs with: the key's, never None (None would be public-only
        by contract, but was "no filter" before it; a list is unambiguous)."""
        return [ACL_ALL] if ACL_ALL in key.groups else list(key.groups)

    def search(self, req: SearchRequest, key: ApiKey,
               on_event: Callable[[dict], None] | None = None) -> dict:
        """The result dict (`search --json` shape plus `status`); events go to `on_event`,
        ending with `result`. ApiError for every refusal."""
        index = req.index or self.settings.index
        if not key.may_use(index):
            raise ApiError(403, "forbidden", f"key {key.name!r} may not use index {index!r}")
        with self.concurrency.slot(key.name):
            deadline = req.deadline_s or self.limits.default_deadline_s
            started = time.monotonic()
            driver = self.driver(index, wait=deadline)
            groups = self.groups(key)
            emit = self._guarded(index, groups, on_event)
            deadline = max(deadline - (time.monotonic() - started), 0.001)  # what is left
            result, live = self._run(driver, req, groups, deadline, emit)
            if not live:
                for event in stream.replay_events(result):
                    emit(event)
            out = stream.result_dict(result, req.k)
            out["index"] = index
            self._check_failure(driver, out)
            event, _ = stream.guard({"type": "result", "result": out}, self._hidden(index, groups))
            if on_event:
                on_event(event)
            return event["result"]

    def _run(self, driver, req: SearchRequest, groups, deadline: float, emit):
        """Driver.search with a deadline. Returns (result, whether events were live)."""
        params = inspect.signature(driver.search).parameters
        kwargs = {"max_branches": req.branches, "acl_groups": groups}
        live = "on_event" in params
        if live:
            kwargs["on_event"] = lambda e: emit(e) if e.get("type") != "result" else None
        if "deadline_s" in params:
            kwargs["deadline_s"] = deadline
        box: dict = {}

        def work():
            try:
                box["result"] = driver.search(req.question, **kwargs)
            except BaseException as exc:  # noqa: BLE001 — carried to the caller's thread
                box["error"] = exc

        worker = threading.Thread(target=work, name="search", daemon=True)
        worker.start()
        # the driver enforces the deadline when it can (partial results); this is the backstop
        worker.join(deadline + (10 if "deadline_s" in params else 0))
        if worker.is_alive():
            raise ApiError(504, "deadline_exceeded",
                           f"no result within the deadline of {deadline:g} s")
        if "error" in box:
            raise box["error"]
        return box["result"], live

    def _check_failure(self, driver, out: dict) -> None:
        """A failed search answers 503/504 with the reason, never an empty 200; an empty result
        is checked against the backends, so a backend that is down never looks like no hits."""
        if out["status"] == "failed":
            if all(b["status"] == "timeout" for b in out["branches"]):
                raise ApiError(504, "deadline_exceeded", "no branch finished within the "
                               "deadline: " + out["branches"][0].get("error", ""))
            self._probe(driver)
            errors = "; ".join(sorted({b.get("error", "") for b in out["branches"]}))
            raise ApiError(503, "search_failed", f"every branch failed: {errors}"[:1000])
        if not out["evidence"]:
            self._probe(driver)

    def _probe(self, driver) -> dict:
        try:
            return self._in_retriever(driver, documents.probe, documents.probe_in_actor)
        except ApiError:
            raise
        except Exception as exc:  # noqa: BLE001 — any backend failure is a 503 with its reason
            cause = getattr(exc, "cause", None) or exc
            reason = str(cause) if isinstance(cause, BackendUnavailable) else \
                f"{type(cause).__name__}: {cause}"
            raise ApiError(503, "backend_unavailable", reason[:1000]) from None

    # --- the ACL guard ---------------------------------------------------------------------------

    def _hidden(self, index: str, groups: list[str]) -> Callable[[list[str]], set[str]]:
        store = self._docstores[index]

        def hidden(ids: list[str]) -> set[str]:
            if store is None:  # an index without a docstore: the backends' filter is all
                return set()
            rows = store.get_chunks(ids)
            bad = {cid for cid, row in rows.items()
                   if not stream.visible(row["acl"], groups, ACL_ALL)}
            if bad:
                self.acl_guard_dropped += len(bad)
                log.error("ACL guard dropped %d chunk ids a branch returned to groups %s",
                          len(bad), groups)
            return bad
        return hidden

    def _guarded(self, index: str, groups: list[str], on_event):
        hidden = self._hidden(index, groups)

        def emit(event: dict) -> None:
            if event.get("type") == "plan":  # the web page draws token bars against it
                event = {**event, "budget_tokens": self.settings.budget_tokens}
            if on_event is not None:
                on_event(stream.guard(event, hidden)[0])
        return emit

    # --- documents -------------------------------------------------------------------------------

    def upsert(self, index: str, body: bytes, key: ApiKey) -> dict:
        self._admin(key, index)
        docs = documents.parse_documents(body)
        driver = self.driver(index)
        with self._write_locks[index], self._ingest_lock(driver):
            self._check_files(driver)
            counts = self._write(index, driver, documents.upsert, documents.upsert_in_actor,
                                 driver.settings, docs)
        return {"index": index, "upserted": [d.id for d in docs], **counts}

    def delete(self, index: str, doc_id: str, key: ApiKey) -> dict:
        self._admin(key, index)
        driver = self.driver(index)
        with self._write_locks[index], self._ingest_lock(driver):
            self._check_files(driver)
            found = self._write(index, driver, documents.delete, documents.delete_in_actor,
                                driver.settings, doc_id)
        if not found:
            raise ApiError(404, "document_not_found", f"no document {doc_id!r} in {index!r}")
        return {"index": index, "deleted": doc_id}

    def _write(self, index: str, driver, local_fn, actor_fn, *args):
        """A document write on the stores' owner. A store that fails under it (a file gone, a
        server down) is a 503 that names the store's error and what searches see now, not a
        500. Domain errors and timeouts keep their status (api_error); a bug stays a 500."""
        try:
            return self._in_retriever(driver, local_fn, actor_fn, *args)
        except Exception as exc:  # noqa: BLE001
            cause = getattr(exc, "cause", None) or exc
            if isinstance(cause, (BranchsearchError, ApiError, TimeoutError, TypeError,
                                  AttributeError, NameError, AssertionError)):
                raise cause from None
            # upsert writes the docstore (what searches see) last, delete first
            now = ("searches still see the documents as they were; retry it"
                   if local_fn is documents.upsert else "repeat the delete to finish it (a 404 "
                   "then means searches no longer saw it, and the repeat cleared the rest)")
            raise ApiError(503, "write_failed", f"the write to index {index!r} did not complete "
                           f"({error_line(cause, 300)}); {now}") from None

    @staticmethod
    def _check_files(driver) -> None:
        """A write to an index whose store files were deleted since its driver opened them
        would go to the open, deleted file and be lost: refused (503), as the CLI refuses to
        open such an index. Searches go on from what the stores hold open."""
        from branchsearch.infra.catalog import files_health
        from branchsearch.infra.manifest import read_manifest

        folder = driver.settings.index_dir
        manifest = read_manifest(folder)
        health = "no manifest" if manifest is None else files_health(folder, manifest)
        if health != "ok":
            raise IndexIncomplete(f"index {driver.settings.index!r} cannot take writes: "
                                  f"{health}")

    @staticmethod
    def _ingest_lock(driver):
        """The index's ingest lock (`infra.manifest`): a CLI ingest and a service write never
        run at once; IndexBusy (409; the server log names the ingest that holds it)."""
        from branchsearch.infra.manifest import IngestLock

        return IngestLock(driver.settings.index_dir, driver.settings.index, corpus="service write")

    @staticmethod
    def _admin(key: ApiKey, index: str) -> None:
        if not key.admin:
            raise ApiError(403, "forbidden", f"key {key.name!r} is not an admin key; document "
                                             "writes need one (`keys add --admin`)")
        if not key.may_use(index):
            raise ApiError(403, "forbidden", f"key {key.name!r} may not use index {index!r}")

    # --- health ------------------------------------------------------------------------------------

    def ready(self) -> dict:
        """Every open index's backends answer (and the default index is open); ApiError 503
        with the reason otherwise."""
        try:
            self.driver(self.settings.index)
        except IndexNotFound:
            raise ApiError(503, "not_ready", f"default index {self.settings.index!r} not found "
                           f"under {self.settings.home}") from None
        except Exception as exc:  # noqa: BLE001
            raise ApiError(503, "not_ready", f"{type(exc).__name__}: {exc}"[:1000]) from None
        counts = {}
        for index, driver in list(self._drivers.items()):
            try:
                counts[index] = self._probe(driver)
            except ApiError as exc:
                raise ApiError(503, "not_ready", f"index {index!r}: {exc.detail}") from None
        return {"status": "ready", "executor": self.executor, "indexes": counts}


def _make_driver(settings: Settings, executor: str):
    from branchsearch.orchestrator.driver import Driver

    return Driver(settings, mode=executor)


class AsyncSearcher:
    """`Searcher` for an event loop: blocking work in threads, events through a queue."""

    def __init__(self, searcher: Searcher):
        self.searcher = searcher

    async def search(self, req: SearchRequest, key: ApiKey) -> dict:
        return await asyncio.to_thread(self.searcher.search, req, key)

    async def stream(self, req: SearchRequest, key: ApiKey) -> AsyncIterator[dict]:
        """Events as they happen, ending with `result` (or `error`). A refusal before the search
        starts (403, 429, 404) is raised, so the HTTP status can still say so."""
        events: queue.Queue = queue.Queue()

        def work():
            try:
                self.searcher.search(req, key, on_event=events.put)
            except BaseException as exc:  # noqa: BLE001
                events.put(exc)
            finally:
                events.put(_DONE)

        threading.Thread(target=work, name="search-stream", daemon=True).start()
        first = True
        while True:
            item = await asyncio.to_thread(events.get)
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                err = api_error(item)
                if first:
                    raise err
                yield {"type": "error", "status": err.status, **err.body()}
                continue
            first = False
            yield item

    async def upsert(self, index: str, body: bytes, key: ApiKey) -> dict:
        return await asyncio.to_thread(self.searcher.upsert, index, body, key)

    async def delete(self, index: str, doc_id: str, key: ApiKey) -> dict:
        return await asyncio.to_thread(self.searcher.delete, index, doc_id, key)

    async def ready(self) -> dict:
        return await asyncio.to_thread(self.searcher.ready)

    async def indexes(self) -> list[str]:
        return self.searcher.indexes()

    async def guard_dropped(self) -> int:
        return self.searcher.acl_guard_dropped
