"""The driver: plan → fan out one branch per sub-query → gather with timeouts → fuse → result.

Two executors share everything else: `local` runs branches one after another in this process
(no Ray; the baseline and the laptop path) and `ray` runs each branch in a `BranchActor` from a
pool, with retrieval in one `RetrieverActor` that owns the embedder and the embedded stores.
A branch that raises or misses its deadline is reported in `branches[i].status`; the others
still count.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

from branchsearch.infra import telemetry
from branchsearch.infra.settings import Settings
from branchsearch.orchestrator.plan import HeuristicPlanner, SubQuery
from branchsearch.orchestrator.result import BranchReport, SearchResult, fuse_branches


class Driver:
    def __init__(self, settings: Settings, *, mode: str = "ray", planner=None,
                 policy_factory: Callable | None = None, pool_size: int | None = None):
        self.settings = settings
        self.mode = mode
        self.policy_factory = policy_factory  # (index, subquery) -> Policy; tests
        telemetry.configure_from(settings)
        if mode == "local":
            from branchsearch.infra.retriever import open_retriever

            self.retriever = open_retriever(settings, need_dense=settings.search_mode != "bm25")
        elif mode == "ray":
            self._start_ray(pool_size or settings.branches * max(settings.batch_concurrency, 1))
        else:
            raise ValueError(f"unknown executor {mode!r}")
        self.planner = planner or self._make_planner()

    def _make_planner(self):
        if self.settings.planner != "llm":
            return HeuristicPlanner()
        from branchsearch.orchestrator.plan import LLMPlanner
        from branchsearch.workers.factory import make_engine

        return LLMPlanner(make_engine(self.settings))

    # --- Ray plumbing ------------------------------------------------------------------------

    def _start_ray(self, pool_size: int) -> None:
        import ray

        from branchsearch.orchestrator.cluster import connect, plan_actors
        from branchsearch.workers.actor import BranchActor, RetrieverActor

        resources = connect(self.settings)
        self.actor_plan = plan_actors(self.settings, resources, pool_size)
        self._engines = []
        if "llm" in (self.settings.policy, self.settings.planner) and not self.settings.llm_url:
            from branchsearch.workers.engine_actor import start_engines

            self._engines = start_engines(self.settings, resources)
            ray.get([e.stats.remote() for e in self._engines])  # loaded, or fail clearly
        self._retriever = RetrieverActor.options(
            max_concurrency=16, max_restarts=self.settings.branch_retries,
            **self.actor_plan.retriever).remote(self.settings)
        ray.get(self._retriever.ping.remote())  # fail here, clearly, if it cannot start
        self._make_branch = lambda: BranchActor.options(
            max_restarts=self.settings.branch_retries, **self.actor_plan.branch
        ).remote(self.settings, self._retriever)
        self._idle = [self._make_branch() for _ in range(pool_size)]
        self._cond = threading.Condition()
        ray.get([a.ping.remote() for a in self._idle])

    def _acquire(self):
        with self._cond:
            while not self._idle:
                self._cond.wait()
            return self._idle.pop()

    def _release(self, actor) -> None:
        with self._cond:
            self._idle.append(actor)
            self._cond.notify()

    def close(self) -> None:
        if self.mode == "local":
            self.retriever.close()
            return
        import ray

        try:
            ray.get(self._retriever.close.remote(), timeout=30)
        except Exception:  # already dead: nothing to release
            pass
        keep = self._engines if self.settings.llm_detached else []
        for actor in self._idle + [self._retriever] + [e for e in self._engines
                                                        if e not in keep]:
            ray.kill(actor)
        self._idle = []

    # --- one question ------------------------------------------------------------------------

    def search(self, question: str, *, max_branches: int | None = None,
               acl_groups: list[str] | None = None) -> SearchResult:
        started = time.perf_counter()
        with telemetry.tracer().start_as_current_span("query") as span:
            span.set_attribute("question", question)
            with telemetry.tracer().start_as_current_span("plan") as plan_span:
                subs = self.planner.plan(question, max_branches or self.settings.branches)
                plan_span.set_attribute("subqueries", [s.text for s in subs])
                fallback = getattr(self.planner, "last_fallback", "")
                if fallback:
                    plan_span.set_attribute("planner.fallback", fallback)
            run = self._run_local if self.mode == "local" else self._run_ray
            reports = run(subs, acl_groups)
            chunks = {c["chunk_id"]: {**c, "doc_id": d["doc_id"], "title": d["title"]}
                      for r in reports for d in r.pop("_evidence", []) for c in d["chunks"]}
            branches = [r["report"] for r in reports]
            ranked, evidence = fuse_branches(branches, chunks, k=self.settings.branch_rrf_k,
                                             limit=self.settings.final_k)
            trace_id = format(span.get_span_context().trace_id, "032x")
            span.set_attributes({"branches": len(branches),
                                 "branches_failed": sum(b.status != "ok" for b in branches)})
        telemetry.flush()
        wall = time.perf_counter() - started
        ok = [b for b in branches if b.status == "ok"]
        metrics = {
            "latency_s": round(wall, 4),
            "planner": type(self.planner).__name__,
            "planner_fallback": getattr(self.planner, "last_fallback", ""),
            "branches": len(branches), "branches_ok": len(ok),
            "branch_latency_s_sum": round(sum(b.latency_s for b in branches), 4),
            "branch_latency_s_max": round(max((b.latency_s for b in branches), default=0), 4),
            "context_tokens_final_mean": round(
                sum(b.context_tokens_final for b in ok) / max(len(ok), 1), 1),
            "tokens_read": sum(b.tokens_read for b in ok),
            "turns": sum(b.turns for b in ok), "tool_calls": sum(b.tool_calls for b in ok),
        }
        return SearchResult(question, evidence, ranked, branches, metrics,
                            trace_id if trace_id.strip("0") else uuid.uuid4().hex)

    def _report(self, index: int, sub: SubQuery, status: str, out: dict | None = None,
                error: str = "") -> dict:
        if out is not None and out.get("termination") == "backend_error":
            status, error = "error", out.get("detail", "")  # never an empty "ok"
        report = BranchReport(index, sub.text, sub.weight, sub.kind, status, error)
        evidence = []
        if out is not None:
            for name in ("termination", "turns", "tool_calls", "context_tokens_final",
                         "tokens_read", "latency_s", "ranked_chunk_ids", "retrieved_ids",
                         "final_context_ids",
                         "pruned_ids", "context_tokens_per_turn", "trace", "pid", "policy_s", "fetch_s",
                         "backend_s", "rpc_s"):
                if name in out:
                    setattr(report, name, out[name])
            evidence = out.get("evidence", [])
        return {"report": report, "_evidence": evidence}

    def _run_local(self, subs: list[SubQuery], acl_groups) -> list[dict]:
        import os

        from branchsearch.workers.factory import make_policy
        from branchsearch.workers.harness import Episode

        reports = []
        for i, sub in enumerate(subs):
            started = time.perf_counter()
            try:
                with telemetry.tracer().start_as_current_span("branch") as span:
                    span.set_attributes({"branch.index": i, "branch.subquery": sub.text})
                    policy = (self.policy_factory(i, sub.text) if self.policy_factory
                              else make_policy(self.settings))
                    out = Episode(sub.text, self.retriever, policy, self.settings,
                                  acl_groups=acl_groups).run().to_dict()
                # in-process there is no RPC: the retrieval phases' wall time is backend time
                out |= {"latency_s": time.perf_counter() - started, "pid": os.getpid(),
                        "backend_s": out["fetch_s"]}
                reports.append(self._report(i, sub, "ok", out))
            except Exception as exc:
                reports.append(self._report(i, sub, "error", error=f"{type(exc).__name__}: "
                                                                   f"{exc}"))
        return reports

    def _run_ray(self, subs: list[SubQuery], acl_groups) -> list[dict]:
        import ray

        carrier = telemetry.current_carrier()
        actors = [self._acquire() for _ in subs]
        refs = [a.run.remote(i, s.text, carrier, self.policy_factory, acl_groups)
                for i, (a, s) in enumerate(zip(actors, subs))]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.settings.branch_timeout_s)
        done = set(ready)
        reports = []
        for i, (actor, sub, ref) in enumerate(zip(actors, subs, refs)):
            if ref not in done:
                reports.append(self._report(i, sub, "timeout", error=(
                    f"no result within {self.settings.branch_timeout_s:g} s")))
                ray.kill(actor)  # it is still busy: replace it
                self._release(self._make_branch())
                continue
            try:
                reports.append(self._report(i, sub, "ok", ray.get(ref)))
                self._release(actor)
            except ray.exceptions.RayActorError as exc:
                reports.append(self._report(i, sub, "error", error=f"actor died: {exc}"[:500]))
                self._release(self._make_branch())
            except ray.exceptions.RayTaskError as exc:
                cause = exc.cause if getattr(exc, "cause", None) is not None else exc
                reports.append(self._report(i, sub, "error",
                                            error=f"{type(cause).__name__}: {cause}"[:500]))
                self._release(actor)
        return reports


