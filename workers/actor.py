"""Ray wiring for the branch agent: the retriever and branch actors.

* `RetrieverActor` owns the embedder and the backend clients (one owner per embedded Milvus Lite
  file; a pool when backends are servers), so models load once per node. It runs
  `Retriever.call_many`: one round trip per turn. It also holds the fetch caches of the
  questions it serves (`infra.retrieval.fetch_cache.FetchCaches`, by question id): the executor sends all
  the branches of a question to one replica, so they share what the backends answered.
  It can *host* a branch too (`run`): the question's own branch, beside the stores, calls them
  in-process — no round trip per turn (the executor hosts at most one at a time per replica).
* `BranchActor` runs `workers.branch.run_branch` against a `RemoteRetriever` and returns the
  `BranchReport` (the episode result inside it whole).

Either way the driver's span context arrives as W3C headers and becomes the parent of the
branch span, so a query is one trace across processes, and events (search, prune) wait in a
buffer (`Events`) that the driver drains while the branch runs.
"""

from __future__ import annotations

import os
import threading
import time

import ray

from branchsearch.infra.retrieval.retriever import QuestionRetriever
from branchsearch.infra.config.settings import Settings
from branchsearch.workers.branch import warm_up


class Events:
    """Buffers of branch events by key, drained by the driver (`take`) while branches run."""

    def __init__(self):
        self._buffers: dict[str, list[dict]] = {}
        self._lock = threading.Lock()

    def sink(self, key: str):
        with self._lock:
            self._buffers[key] = []

        def put(event: dict) -> None:
            with self._lock:
                buffer = self._buffers.get(key)
                if buffer is not None:  # none once taken for the last time: not kept
                    buffer.append(event)
        return put

    def take(self, key: str, last: bool = False) -> list[dict]:
        with self._lock:
            if key not in self._buffers:
                return []
            out = self._buffers.pop(key)
            if not last:
                self._buffers[key] = []
            return out


def run_here(task, retriever, settings: Settings, carrier: dict | None, policy_factory,
             on_event):
    """`run_branch` in this actor, its span a child of the driver's (`carrier`). A branch whose
    task the driver cancels (`ray.cancel`: its search was called off) ends at its next turn."""
    from branchsearch.infra import telemetry
    from branchsearch.workers.branch import run_branch
    from branchsearch.workers.harness import CALLED_OFF

    token = telemetry.attach_carrier(carrier)
    called_off = CALLED_OFF.set(ray.get_runtime_context().is_canceled)
    try:
        if policy_factory is None and settings.policy == "llm" and not settings.llm_url:
            policy_factory = _on_engine_actor(settings, task.kind)
        return run_branch(task, retriever, settings, policy_factory=policy_factory,
                          on_event=on_event)
    finally:
        CALLED_OFF.reset(called_off)
        telemetry.flush()
        telemetry.detach(token)


def _on_engine_actor(settings: Settings, kind: str):
    """An LLM policy factory on the executor's engine actor, where there is one (the Ray
    executor starts them); else None, and the policy loads vLLM in this actor."""
    from branchsearch.workers.engine_actor import RemoteEngine, engine_name
    from branchsearch.workers.factory import make_policy

    try:
        engine = RemoteEngine(engine_name(0))
    except ValueError:  # no engine actor by that name (a service without engine actors)
        return None
    return lambda index, subquery: make_policy(settings, engine=engine, kind=kind)


class RetrieverService:
    """The retriever as an actor (thread-pooled: several branches search at once)."""

    def __init__(self, settings: Settings):
        from branchsearch.infra.index.open import open_retriever

        from branchsearch.infra.retrieval.fetch_cache import FetchCaches

        self.settings = settings
        self.retriever = open_retriever(settings, need_dense=settings.search_mode != "bm25")
        self.caches = FetchCaches()
        self.calls = 0
        self.events = Events()
        self.retriever.load_models()
        warm_up(settings)

    def call_many(self, requests: list[tuple], question: str | None = None):
        """([value or exception per request], seconds spent in the backend): the caller
        learns the RPC overhead. `question`: the id whose fetch cache the requests share."""
        started = time.perf_counter()
        self.calls += 1
        values = self.retriever.call_many(requests, cache=self.caches.get(question))
        return values, time.perf_counter() - started

    def run(self, task, carrier: dict | None = None, policy_factory=None,
            events: str | None = None, question: str | None = None):
        """Host a branch: `run_branch` here, against the stores themselves (and the question's
        fetch cache), so its turns make no round trip. `events`: the key under which its
        events wait for `branch_events` (None: not streamed)."""
        return run_here(task, HostedRetriever(self, self.caches.get(question)), self.settings,
                        carrier, policy_factory, self.events.sink(events) if events else None)

    def branch_events(self, key: str, last: bool = False) -> list[dict]:
        """A hosted branch's events since the last call; `last`: and forget the key."""
        return self.events.take(key, last)

    def expect(self, question: str, queries: list[str]) -> None:
        """The question's branch queries (`QuestionCache.expect`): embedded together at its
        first request here, or its next one if this arrives later."""
        cache = self.caches.get(question)
        if cache is not None:
            cache.expect(queries)

    def end_question(self, question: str) -> dict:
        """Drop the question's fetch cache; its counters."""
        return self.caches.end(question)

    def fetch_stats(self) -> dict:
        """Backend requests served, the ended questions' cache counters, live caches."""
        return {"backend_requests": dict(self.retriever.backend_requests),
                "cache": dict(self.caches.stats), "live_questions": len(self.caches)}

    def ping(self) -> int:
        return os.getpid()

    def served(self) -> int:
        """Tool-call rounds served (one per branch turn), to pool actors and hosted branches."""
        return self.calls

    def close(self) -> None:
        """Release the stores (and the Milvus Lite file) before the actor is killed."""
        self.retriever.close()


class HostedRetriever(QuestionRetriever):
    """The replica's own retriever as a branch it hosts sees it: the question's fetch cache
    (None: unshared), and its calls counted as the replica's served calls."""

    def __init__(self, service: RetrieverService, cache):
        super().__init__(service.retriever, cache)
        self.service = service

    def call_many(self, requests: list[tuple]) -> list:
        self.service.calls += 1
        return super().call_many(requests)


class RemoteRetriever:
    """`call_many` of a RetrieverActor, with the time spent in the backend and in round trips.
    A dead or unreachable actor is a backend failure of every request."""

    def __init__(self, handle, question: str | None = None):
        self.handle, self.question = handle, question
        self.backend_s = 0.0  # time inside the retriever
        self.rpc_s = 0.0  # round trips, backend included

    def call_many(self, requests: list[tuple]) -> list:
        from branchsearch.infra.errors import BackendUnavailable, error_line

        started = time.perf_counter()
        try:
            values, backend = ray.get(self.handle.call_many.remote(requests, self.question))
        except ray.exceptions.RayError as exc:
            error = BackendUnavailable(f"retriever actor: {error_line(exc)}")
            return [error] * len(requests)
        self.rpc_s += time.perf_counter() - started
        self.backend_s += backend
        return values


class BranchService:
    def __init__(self, settings: Settings, retriever_handle):
        self.settings = settings
        self.handle = retriever_handle
        self._events = Events()
        warm_up(settings)

    def run(self, task, carrier: dict | None = None, policy_factory=None,
            stream: bool = False, retriever=None, question: str | None = None,
            settings: Settings | None = None):
        """`run_branch` here, against `retriever` (the replica the executor chose) or the
        actor's own; with `stream`, events wait in a buffer for `events()`. `question`: the id
        under which the replica shares fetches among the question's branches. `settings`: the
        index's (a shared pool serves every index), else the actor's."""
        sink = self._events.sink("run") if stream else None
        return run_here(task, RemoteRetriever(retriever or self.handle, question),
                        settings or self.settings, carrier, policy_factory, sink)

    def events(self) -> list[dict]:
        """The events since the last call (runs beside `run`: the actor has two threads)."""
        return self._events.take("run")

    def ping(self) -> int:
        return os.getpid()


RetrieverActor = ray.remote(RetrieverService)
BranchActor = ray.remote(max_concurrency=2)(BranchService)
