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

from infra.settings import Settings


class RetrieverService:
    """The retriever's methods as an actor (thread-pooled: several branches search at once)."""

    def __init__(self, settings: Settings):
        from infra.retriever import open_retriever

        self.retriever = open_retriever(settings)

    def search(self, *args, **kwargs):
        return self.retriever.search(*args, **kwargs)

    def grep(self, *args, **kwargs):
        return self.retriever.grep(*args, **kwargs)

    def get_chunks(self, ids):
        return self.retriever.get_chunks(ids)

    def read_document(self, *args, **kwargs):
        return self.retriever.read_document(*args, **kwargs)

    def ping(self) -> int:
        return os.getpid()


class RemoteRetriever:
    """Looks like `infra.retriever.Retriever` to the harness; calls a RetrieverActor."""

    def __init__(self, handle):
        self.handle = handle

    def search(self, *args, **kwargs):
        return ray.get(self.handle.search.remote(*args, **kwargs))

    def grep(self, *args, **kwargs):
        return ray.get(self.handle.grep.remote(*args, **kwargs))

    def get_chunks(self, ids):
        return ray.get(self.handle.get_chunks.remote(ids))

    def read_document(self, *args, **kwargs):
        return ray.get(self.handle.read_document.remote(*args, **kwargs))


class BranchService:
    def __init__(self, settings: Settings, retriever_handle):
        from infra import telemetry

        self.settings = settings
        telemetry.configure_from(settings)
        self.retriever = RemoteRetriever(retriever_handle)

    def run(self, index: int, subquery: str, carrier: dict | None = None,
            policy_factory=None, acl_groups: list[str] | None = None) -> dict:
        from infra import telemetry
        from workers.factory import make_policy
        from workers.harness import Episode

        token = telemetry.attach_carrier(carrier)
        try:
            with telemetry.tracer().start_as_current_span("branch") as span:
                span.set_attributes({"branch.index": index, "branch.subquery": subquery,
                                     "process.pid": os.getpid()})
                started = time.perf_counter()
                policy = (policy_factory(index, subquery) if policy_factory
                          else make_policy(self.settings))
                result = Episode(subquery, self.retriever, policy, self.settings,
                                 acl_groups=acl_groups).run()
                out = result.to_dict()
                out["latency_s"] = time.perf_counter() - started
                out["pid"] = os.getpid()
                return out
        finally:
            telemetry.flush()
            telemetry.detach(token)

    def ping(self) -> int:
        return os.getpid()


RetrieverActor = ray.remote(RetrieverService)
BranchActor = ray.remote(BranchService)
