"""Ray wiring for the branch agent — the only module in workers/ that imports Ray.

* `RetrieverActor` owns the embedder and the backend clients (one owner per embedded Milvus Lite
  file; a pool when backends are servers), so models load once per node.
* `BranchActor` runs episodes: each call builds fresh context stores, runs the policy against a
  `RemoteRetriever`, and returns the `EpisodeResult` as a dict. The driver's span context arrives
  as W3C headers and becomes the parent of the branch span, so a query is one trace across
  processes.
"""

from __future__ import annotations

import os
import time

import ray

from branchsearch.infra.settings import Settings


class RetrieverService:
    """The retriever's methods as an actor (thread-pooled: several branches search at once)."""

    def __init__(self, settings: Settings):
        from branchsearch.infra.errors import BranchsearchError
        from branchsearch.infra.retriever import open_retriever

        self.error = None
        try:
            self.retriever = open_retriever(settings, need_dense=settings.search_mode != "bm25")
        except BranchsearchError as exc:  # keep the actor: `ping` gives the caller this error
            self.error = exc

    def call_many(self, requests: list[tuple]):
        """([value or exception per request], seconds spent in the backend): one round trip
        per turn, and the caller learns the RPC overhead."""
        from branchsearch.workers.harness import run_requests

        for method, _, _ in requests:
            if method not in ("search", "grep", "get_chunks", "read_document"):
                raise ValueError(f"unknown retriever method {method!r}")
        started = time.perf_counter()
        values = run_requests(self.retriever, requests)
        return values, time.perf_counter() - started

    def ping(self) -> int:
        if self.error is not None:
            raise self.error
        return os.getpid()

    def close(self) -> None:
        """Release the stores (and the Milvus Lite file) before the actor is killed."""
        if self.error is None:
            self.retriever.close()


class RemoteRetriever:
    """Looks like `infra.retriever.Retriever` to the harness; calls a RetrieverActor."""

    def __init__(self, handle):
        self.handle = handle
        self.backend_s = 0.0  # time inside the retriever
        self.rpc_s = 0.0  # round trips, backend included

    def call_many(self, requests: list[tuple]) -> list:
        from branchsearch.infra.errors import BackendUnavailable

        started = time.perf_counter()
        try:
            values, backend = ray.get(self.handle.call_many.remote(requests))
        except ray.exceptions.RayError as exc:  # the retriever actor died or is unreachable
            error = BackendUnavailable(f"retriever actor: {type(exc).__name__}: {exc}"[:300])
            return [error] * len(requests)
        self.rpc_s += time.perf_counter() - started
        self.backend_s += backend
        return values

    def _call(self, method: str, *args, **kwargs):
        value = self.call_many([(method, args, kwargs)])[0]
        if isinstance(value, Exception):
            raise value
        return value

    def search(self, *args, **kwargs):
        return self._call("search", *args, **kwargs)

    def grep(self, *args, **kwargs):
        return self._call("grep", *args, **kwargs)

    def get_chunks(self, ids):
        return self._call("get_chunks", ids)

    def read_document(self, *args, **kwargs):
        return self._call("read_document", *args, **kwargs)


class BranchService:
    def __init__(self, settings: Settings, retriever_handle):
        from branchsearch.infra import telemetry

        self.settings = settings
        telemetry.configure_from(settings)
        self.handle = retriever_handle

    def run(self, index: int, subquery: str, carrier: dict | None = None,
            policy_factory=None, acl_groups: list[str] | None = None) -> dict:
        from branchsearch.infra import telemetry
        from branchsearch.workers.factory import make_policy
        from branchsearch.workers.harness import Episode

        token = telemetry.attach_carrier(carrier)
        try:
            with telemetry.tracer().start_as_current_span("branch") as span:
                span.set_attributes({"branch.index": index, "branch.subquery": subquery,
                                     "process.pid": os.getpid()})
                started = time.perf_counter()
                retriever = RemoteRetriever(self.handle)  # fresh counters per episode
                policy = (policy_factory(index, subquery) if policy_factory
                          else make_policy(self.settings))
                result = Episode(subquery, retriever, policy, self.settings,
                                 acl_groups=acl_groups).run()
                out = result.to_dict()
                out |= {"latency_s": time.perf_counter() - started, "pid": os.getpid(),
                        "backend_s": retriever.backend_s, "rpc_s": retriever.rpc_s}
                return out
        finally:
            telemetry.flush()
            telemetry.detach(token)

    def ping(self) -> int:
        return os.getpid()


RetrieverActor = ray.remote(RetrieverService)
BranchActor = ray.remote(BranchService)
