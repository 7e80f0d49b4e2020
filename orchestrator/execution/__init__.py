"""What runs a question's branches: one interface, `question(...)` (a question's scope across its
waves), `run(tasks, ...) -> [BranchReport]` and `close()`, two executors behind it.

    local       `LocalExecutor`: the branches in this process, one after another, over one
                retriever (no Ray; the baseline and the laptop path)
    ray         `RayExecutor`: branches in branch actors, retrieval in retriever actors, the
                question's own branch hosted by its retriever replica
    pool        `BranchPool`, the branch actors shared by every question, and `wait_started`:
                every actor start awaited with a timeout, an actor that fails in its
                constructor raised as the user error it died of
    balancer    which retriever replica serves the next branch (`ReplicaBalancer`), and where a
                branch runs (`Placement`)
    actor_plan  every actor counted against what the cluster has before any starts (pure)

`pick_executor` is the one place that decides between them (one branch runs in-process),
`make_executor` the one place that builds them. A branch that raises or misses its deadline is
reported in its `BranchReport.status`; the others still count.

With `fetch_cache` (default), the branches of one question, in every wave, share a
`QuestionCache` (`infra.retrieval.fetch_cache`): locally one per `question`; on Ray it lives in
the retriever replica that serves all the question's branches. Same results, fewer backend
requests. A
question of one branch has one too: a branch repeats its own searches and reads the same rows
turn after turn (`reports/bridges.md`, "v12").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ContextManager, Protocol

from branchsearch.infra.config.choices import EXECUTORS, Executor as ExecutorName, one_of
from branchsearch.infra.errors import BranchsearchError
from branchsearch.infra.config.settings import Settings
from branchsearch.workers.branch import BranchReport, BranchTask

Events = Callable[[dict], None] | None
# (the question's own branch's report, another task) -> what covers that task, or None
Cover = Callable[[BranchReport, BranchTask], object] | None


class Executor(Protocol):
    engine_actors: bool  # the LLM runs in named engine actors this executor started

    def question(self, settings: Settings) -> ContextManager[object]:
        """One question's scope across its waves: the fetch cache its branches share (None
        when `fetch_cache` is off), dropped when the block ends."""

    def run(self, tasks: list[BranchTask], *, settings: Settings,
            policy_factory: Callable | None = None, on_event: Events = None,
            cover: Cover = None, question: object = None) -> list[BranchReport]:
        """Run every task (on `question`'s cache, when given); one report per task, in order,
        whatever happened to it — except the tasks that `cover` says the first task's report
        covers (`orchestrator.cover`): those have no report (run after the first task, they
        do not run; run beside it, their reports are dropped)."""

    def warm(self, settings: Settings) -> None:
        """Load the models the first question would load (a service, before traffic)."""

    def close(self) -> None: ...


def bounded(task: BranchTask, settings: Settings) -> BranchTask:
    """The task with its own deadline, `branch_timeout_s` from now (or the question's, if
    sooner): a branch that runs where it cannot be killed (in this process, or hosted by a
    retriever replica that serves other branches) ends itself at its next turn past it."""
    import time
    from dataclasses import replace

    own = time.time() + settings.branch_timeout_s
    return replace(task, deadline=own if task.deadline is None else min(task.deadline, own))


def pick_executor(settings: Settings, requested: str | None = None) -> ExecutorName:
    """The executor to use. Not asked for (None): in-process on one machine — the branches of
    the heuristic policy or of a model behind `llm_url` need no cluster, and starting one costs
    seconds for milliseconds of work — and Ray when a cluster is named (`ray_address` or
    RAY_ADDRESS) or the model runs in engine actors. Asked for: that one, except that one
    branch needs no cluster, so `ray` with `branches = 1` runs in-process unless a cluster was
    named."""
    import os

    cluster = bool(settings.ray_address or os.environ.get("RAY_ADDRESS"))
    if requested is None:
        engines = "llm" in (settings.policy, settings.planner) and not settings.llm_url
        return "ray" if cluster or engines else "local"
    if requested not in EXECUTORS:
        raise BranchsearchError(f"unknown executor {requested!r}; use {one_of(EXECUTORS)}")
    if requested == "ray" and settings.branches == 1 and not settings.ray_address:
        return "local"
    return requested


def make_executor(settings: Settings, mode: ExecutorName, *,
                  pool_size: int | None = None) -> Executor:
    if mode == "local":
        from branchsearch.orchestrator.execution.local import LocalExecutor

        return LocalExecutor(settings)
    if mode == "ray":
        from branchsearch.orchestrator.execution.ray import RayExecutor

        return RayExecutor(settings, pool_size or settings.branches
                           * max(settings.batch_concurrency, 1))
    raise BranchsearchError(f"unknown executor {mode!r}; use {one_of(EXECUTORS)}")


def emit(on_event: Events, event: dict) -> None:
    """Pass an event to the watcher, if any; a watcher that fails never breaks the search."""
    if on_event is not None:
        try:
            on_event(event)
        except Exception:  # noqa: BLE001 — a watcher never breaks the search
            pass


def not_started(task: BranchTask, why: str = "") -> BranchReport:
    """The report of a branch that never started: the deadline came first (`why`: what held
    it, e.g. no branch actor free)."""
    return BranchReport(task.index, task.subquery, task.weight, task.kind, "timeout",
                        "not started before the deadline" + (f": {why}" if why else ""),
                        parent=task.parent, reason=task.reason, seeds=list(task.seeds))


def done_event(report: BranchReport) -> dict:
    return {"type": "branch_done", "branch": report.index, "status": report.status,
            "error": report.error, "termination": report.termination, "turns": report.turns,
            "context_tokens_final": report.context_tokens_final,
            "tokens_read": report.tokens_read, "latency_s": round(report.latency_s, 4)}
