"""One branch, start to report: `run_branch` is the only branch runner. The driver's executors
call it in-process (`LocalExecutor`) or inside a `BranchActor` (`RayExecutor`); both get the
same `BranchReport`, with the `EpisodeResult` inside it whole.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from branchsearch.infra import telemetry
from branchsearch.infra.errors import error_line
from branchsearch.infra.config.settings import Settings
from branchsearch.workers.harness import Episode, EpisodeResult

_NO_EPISODE = EpisodeResult(subquery="", termination="")


@dataclass(frozen=True)
class BranchTask:
    """What a branch is asked to do (JSON-able; crosses process boundaries)."""

    index: int
    subquery: str
    weight: float = 1.0
    kind: str = "original"  # original | comparison | clause | entity | llm
    acl_groups: tuple[str, ...] | None = None  # the caller's, never from the model
    deadline: float | None = None  # wall clock (time.time()) by which the branch must end
    # a fork (kind "fork"; orchestrator/forks.py): the branch it forks from, why, the chunks it
    # is handed (it starts from them, in its own context) and the hops it may follow from them
    parent: int | None = None
    reason: str = ""
    seeds: tuple[str, ...] = ()
    hop_room: int = 1
    hops: int = 0  # the hops a heuristic branch follows; 0: its kind's (`make_policy`)
    may_fork: bool = False  # a first-wave branch of a question that forks (the driver's
    # rule: `forks` > 0 and more than one branch): its policy is offered the `fork` tool
    # the span this branch's span nests under when not the current one (a fork's or a chain
    # hop's span: `telemetry.current_carrier` items), so a trace shows a fork under its reason
    trace_parent: tuple[tuple[str, str], ...] = ()


@dataclass
class BranchReport:
    """A branch as the result shows it: `status` ok | error | timeout, the `error` reason, where
    and how long it ran, and its `episode` (None when it never produced one). The episode's
    fields read through: `report.turns` is `report.episode.turns` (0, "" or [] without one)."""

    index: int
    subquery: str
    weight: float = 1.0
    kind: str = "original"
    status: str = "ok"
    error: str = ""
    latency_s: float = 0.0
    pid: int = 0
    backend_s: float = 0.0  # time inside the retriever
    rpc_s: float = 0.0  # round trips to a retriever actor, backend included
    episode: EpisodeResult | None = field(default=None, repr=False)
    parent: int | None = None  # a fork's: the branch it forks from, why, what it was handed
    reason: str = ""
    seeds: list[str] = field(default_factory=list)

    def __getattr__(self, name: str):
        if name.startswith("__") or name not in EpisodeResult.__dataclass_fields__:
            raise AttributeError(name)
        return getattr(self.__dict__.get("episode") or _NO_EPISODE, name)

    def summary(self) -> dict:
        """The branch on a result line: its own fields and the episode's summary."""
        own = {k: v for k, v in self.__dict__.items() if k != "episode"}
        return own | (self.episode or _NO_EPISODE).summary()

    def to_dict(self, full: bool = False) -> dict:
        if not full:
            return self.summary()
        episode = (self.episode or _NO_EPISODE).__dict__
        return self.summary() | {k: episode[k] for k in ("trace", "retrieved_ids",
                                                          "context_tokens_per_turn")}


def run_branch(task: BranchTask, retriever, settings: Settings, *,
               policy_factory: Callable | None = None,
               on_event: Callable[[dict], None] | None = None) -> BranchReport:
    """Build the policy, run one episode against `retriever` (a `Retriever`, or a
    `RemoteRetriever` inside an actor) and report it. Never raises: a policy that cannot be
    built is status `error`, a backend that stays down ends the episode `backend_error`, which
    is status `error` too — never an empty `ok`."""
    started = time.perf_counter()
    report = BranchReport(task.index, task.subquery, task.weight, task.kind, pid=os.getpid(),
                          parent=task.parent, reason=task.reason, seeds=list(task.seeds))
    emit = (lambda e: on_event({**e, "branch": task.index})) if on_event else None
    token = telemetry.attach_carrier(dict(task.trace_parent)) if task.trace_parent else None
    try:
        return _run_branch(task, retriever, settings, report, started, emit, policy_factory)
    finally:
        if token is not None:
            telemetry.detach(token)


def _run_branch(task: BranchTask, retriever, settings: Settings, report: BranchReport,
                started: float, emit, policy_factory) -> BranchReport:
    from branchsearch.workers.factory import make_policy
    from branchsearch.workers.tools import fork_cap

    with telemetry.tracer().start_as_current_span("branch") as span:
        span.set_attributes({"branch.index": task.index, "branch.subquery": task.subquery,
                             "branch.kind": task.kind, "process.pid": os.getpid()})
        if task.parent is not None:
            span.set_attributes({"branch.parent": task.parent, "branch.seeds": list(task.seeds)})
        try:
            policy = (policy_factory(task.index, task.subquery) if policy_factory
                      else make_policy(settings, kind=task.kind, max_hops=task.hops))
            if task.seeds:
                start_from = getattr(policy, "start_from", None)
                if start_from is None:
                    raise ValueError(f"policy {type(policy).__name__} cannot fork (no "
                                     "start_from)")
                start_from(list(task.seeds), task.hop_room)
            groups = list(task.acl_groups) if task.acl_groups is not None else None
            report.episode = Episode(task.subquery, retriever, policy, settings,
                                     acl_groups=groups, on_event=emit,
                                     deadline=task.deadline,
                                     fork_cap=fork_cap(settings) if task.may_fork else 0,
                                     is_fork=task.kind == "fork").run()
        except Exception as exc:  # noqa: BLE001 — reported, the other branches still count
            report.status, report.error = "error", error_line(exc, 500)
        episode = report.episode
        if episode is not None and episode.termination == "backend_error":
            report.status, report.error = "error", episode.detail
        elif episode is not None and episode.termination == "deadline":
            report.status, report.error = "timeout", episode.detail
        span.set_attribute("branch.status", report.status)
    report.latency_s = time.perf_counter() - started
    if hasattr(retriever, "rpc_s"):  # a remote retriever measures both
        report.backend_s, report.rpc_s = retriever.backend_s, retriever.rpc_s
    elif episode is not None:  # in-process, the retrieval phases' wall time is backend time
        report.backend_s = episode.fetch_s
    return report


def warm_up(settings: Settings) -> None:
    """Load the token encoding (and with it this module's imports) now, while a driver or an
    actor starts, not inside the first question's branch timeout."""
    from branchsearch.infra.models.tokenizer import agent_counter

    telemetry.configure_from(settings)
    agent_counter(settings.encoding).count("warm up")
