"""One branch episode: observe → decide → validate/apply → record, until a termination reason.

The loop is only the loop — `run` → `step` → `execute` — and leaves through `EpisodeEnd`, which
carries the termination reason. What the tools do to the stores lives in `workers.tools`
(functions over a `Workspace`); everything the policy proposes goes through `execute`: schemas,
the budget rules and the three-layer prune (propose → validate/apply → record).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field

from opentelemetry import trace

from branchsearch.infra.errors import BackendUnavailable, BadQuery
from branchsearch.infra.config.settings import Settings
from branchsearch.infra.telemetry import tracer
from branchsearch.infra.models.tokenizer import TokenCounter, agent_counter
from branchsearch.workers.budget import Budget
from branchsearch.workers.evidence import build_evidence
from branchsearch.workers.policy import AgentView, InvalidAction, Policy, ToolCall, ToolResult
from branchsearch.workers.tools import TOOLS, Rejected, validate_args
from branchsearch.workers.workspace import Workspace

MAX_INVALID_IN_A_ROW = 3  # invalid actions in a row before the episode ends (policy_error)
# Whether the search a branch serves was called off (the service's caller went away): set by
# what runs the search (the service's search thread; in a Ray actor, `ray.cancel` of the
# branch's task: `workers.actor.run_here`). A branch then ends at its next turn, as at its
# deadline, and no later wave starts (`orchestrator.driver`)
CALLED_OFF: ContextVar[Callable[[], bool] | None] = ContextVar("called_off", default=None)


def called_off() -> bool:
    """Whether the search running in this context was called off (`CALLED_OFF`)."""
    check = CALLED_OFF.get()
    return check is not None and check()


class EpisodeEnd(Exception):
    """Leaving the loop: `reason` is one of finish, max_turns, max_tokens_read, no_progress,
    deadline, policy_error, backend_error."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason, self.detail = reason, detail


class BackendFailed(EpisodeEnd):
    """A backend (retriever or LLM engine) still failing after bounded retries: the branch ends
    with termination `backend_error`, which `run_branch` reports as status `error`."""

    def __init__(self, detail: str):
        super().__init__("backend_error", detail)


_BACKEND_MODULES = ("pymilvus", "grpc", "elastic_transport", "elasticsearch", "urllib3",
                    "ray.exceptions")


def is_backend_error(value) -> bool:
    """A server down, timed out or failing (5xx) — not a bad query, not a bug in a tool."""
    if isinstance(value, BadQuery) or not isinstance(value, Exception):
        return False
    return (isinstance(value, (BackendUnavailable, ConnectionError, TimeoutError))
            or type(value).__module__.startswith(_BACKEND_MODULES))


@dataclass
class EpisodeResult:
    """What one episode produced; shipped whole from a branch actor to the driver."""

    subquery: str
    termination: str
    detail: str = ""
    turns: int = 0
    tool_calls: int = 0
    invalid_actions: int = 0
    evidence: list[dict] = field(default_factory=list)  # ranked chunks (workers.evidence)
    ranked_chunk_ids: list[str] = field(default_factory=list)
    context_tokens_final: int = 0
    context_tokens_per_turn: list[int] = field(default_factory=list)
    tokens_read: int = 0
    retrieved_ids: list[str] = field(default_factory=list)
    pruned_ids: list[str] = field(default_factory=list)
    final_context_ids: list[str] = field(default_factory=list)
    trace: list[dict] = field(repr=False, default_factory=list)
    fork_candidates: list[dict] = field(default_factory=list)  # pruned hypotheses it could not
    # rule out (a policy's `fork_candidates()`; orchestrator/forks.py)
    policy_s: float = 0.0  # time the policy spent deciding
    fetch_s: float = 0.0  # wall time of the (concurrent) retrieval phases

    def summary(self) -> dict:
        """The fields a result line carries (no trace, evidence or per-turn lists)."""
        return {k: v for k, v in self.__dict__.items()
                if k not in ("trace", "evidence", "retrieved_ids", "context_tokens_per_turn")}


class Episode:
    def __init__(self, subquery: str, retriever, policy: Policy, settings: Settings, *,
                 acl_groups: list[str] | None = None, counter: TokenCounter | None = None,
                 on_event: Callable[[dict], None] | None = None,
                 deadline: float | None = None, fork_cap: int = 0, is_fork: bool = False):
        """`fork_cap`: the candidates the `fork` tool may record (0: the tool is not offered;
        `tools.fork_cap`); `is_fork`: this branch is a fork (it may not fork)."""
        self.subquery, self.retriever, self.policy = subquery, retriever, policy
        self.settings, self.acl_groups, self.deadline = settings, acl_groups, deadline
        self.budget = Budget(settings.budget_tokens, settings.soft_limit, settings.hard_limit)
        self.ws = Workspace(settings, counter or agent_counter(settings.encoding), self.budget,
                            acl_groups, policy.query_state, on_event,
                            fork_cap=fork_cap, is_fork=is_fork)
        self.trace = self.ws.trace
        self.tool_calls = self.invalid_actions = self._invalid_in_a_row = self._stale_turns = 0
        self.tokens_per_turn: list[int] = []
        self.last_results: list[ToolResult] = []
        self.last_error = ""
        self.policy_s = self.fetch_s = 0.0
        self.fetched_ok, self.fetch_failures = 0, []  # non-empty answers / failures (not BadQuery)

    # --- the loop ----------------------------------------------------------------------------

    def run(self) -> EpisodeResult:
        """Run turns until a termination reason; never raises for what the policy or a backend
        does (a dead backend ends it with `backend_error`). The result carries the ranked
        evidence, the counters and the episode trace."""
        with tracer().start_as_current_span("episode") as span:
            span.set_attribute("subquery", self.subquery)
            self.trace.record("start", subquery=self.subquery, budget=self.budget.tokens,
                              acl_groups=self.acl_groups)
            try:
                while True:
                    self.step()
            except EpisodeEnd as end:
                end = self._no_retrieval_worked(end)
                self.trace.record("end", reason=end.reason, detail=end.detail,
                                  turns=self.ws.turn, tokens=self.ws.used)
                span.set_attributes({"termination": end.reason, "turns": self.ws.turn,
                                     "context_tokens_final": self.ws.used,
                                     "tokens_read": self.ws.tokens_read})
                return self.result(end)

    def _no_retrieval_worked(self, end: EpisodeEnd) -> EpisodeEnd:
        """An episode whose every retrieval failed (an error that is neither the backend being
        down nor a bad query: a missing dense index, a broken store) ends `backend_error`: no
        evidence because nothing could be searched must not look like an `ok` with none."""
        if self.fetched_ok or not self.fetch_failures or end.reason == "backend_error":
            return end
        return BackendFailed(f"every retrieval failed ({len(self.fetch_failures)}); the first: "
                             f"{self.fetch_failures[0]}"[:500])

    def step(self) -> None:
        """One turn: show the policy its view, execute what it decides, record the turn."""
        if self.ws.turn >= self.settings.max_turns:
            raise EpisodeEnd("max_turns")
        turns = f"{self.ws.turn} turn{'' if self.ws.turn == 1 else 's'}"
        if self.deadline is not None and time.time() >= self.deadline:
            raise EpisodeEnd("deadline", f"stopped at the deadline after {turns}")
        if called_off():  # ends as at the deadline: no one waits for more
            raise EpisodeEnd("deadline", f"stopped after {turns}: its search was called off")
        self.ws.turn += 1
        with tracer().start_as_current_span("turn") as span:
            before = self.ws.used
            calls = self.decide(self.view())
            self.ws.progress = False
            self.last_results = self.execute(calls)
            after = self.ws.used
            self.tokens_per_turn.append(after)
            span.set_attributes({"turn": self.ws.turn, "calls": len(calls),
                                 "tokens_before": before, "tokens_after": after})
            self.trace.record("turn", turn=self.ws.turn, calls=[c.name for c in calls],
                              tokens_before=before, tokens_after=after,
                              usage=self.budget.usage_line(after),
                              query_state=self.policy.query_state())
        self.check_termination()

    def decide(self, view: AgentView) -> list[ToolCall]:
        """The policy's calls; an invalid action is counted and shown next turn."""
        started = time.perf_counter()
        try:
            calls = list(self.policy.decide(view))
            self._invalid_in_a_row, self.last_error = 0, ""
            return calls
        except InvalidAction as exc:
            self.invalid_actions += 1
            self._invalid_in_a_row += 1
            self.last_error = str(exc)
            self.trace.record("invalid_action", turn=self.ws.turn, message=self.last_error)
            if self._invalid_in_a_row >= MAX_INVALID_IN_A_ROW:
                raise EpisodeEnd("policy_error", f"{self._invalid_in_a_row} invalid actions "
                                                 f"in a row: {exc}") from None
            return []
        except Exception as exc:
            cause = getattr(exc, "cause", None) or exc  # a remote engine's own error, in one
            lines = str(cause).strip().splitlines()  # line (Ray's text carries a traceback)
            why = f"{type(cause).__name__}: {lines[-1] if lines else ''}"[:500]
            if is_backend_error(exc):
                raise BackendFailed(f"policy engine: {why}") from None
            raise EpisodeEnd("policy_error", why) from None
        finally:
            self.policy_s += time.perf_counter() - started

    def check_termination(self) -> None:
        if self.ws.finish_ids is not None:
            raise EpisodeEnd("finish")
        if self.ws.tokens_read >= self.settings.max_tokens_read:
            raise EpisodeEnd("max_tokens_read", f"{self.ws.tokens_read} tokens read")
        self._stale_turns = 0 if self.ws.progress else self._stale_turns + 1
        if self._stale_turns >= self.settings.no_progress_turns:
            raise EpisodeEnd("no_progress", f"{self._stale_turns} turns without new chunks")

    def view(self) -> AgentView:
        used = self.ws.used
        allowed = [name for name in TOOLS if self.budget.allows(name, used)
                   and (name != "fork" or self.ws.can_fork)]
        return AgentView(self.subquery, self.ws.turn, self.ws.context.chunks(),
                         self.budget.usage_line(used), used, self.budget.tokens, allowed,
                         self.last_results, self.budget.reminder(used),
                         [TOOLS[name].schema for name in allowed], self.last_error)

    # --- executing calls: fetch concurrently, apply in order -----------------------------------

    def execute(self, calls: list[ToolCall]) -> list[ToolResult]:
        self.tool_calls += len(calls)
        turn_ctx = trace.set_span_in_context(trace.get_current_span())
        spans = [tracer().start_span(f"tool {c.name}", context=turn_ctx) for c in calls]
        checked: list[Exception | None] = []
        for call in calls:
            try:
                validate_args(call)
                checked.append(None)
            except Rejected as exc:
                checked.append(exc)
        requests = {i: TOOLS[c.name].fetch(self.ws, c.args) for i, c in enumerate(calls)
                    if checked[i] is None and TOOLS[c.name].fetch is not None
                    and self.budget.allows(c.name, self.ws.used)}
        try:
            fetched = dict(zip(requests, self.fetch(list(requests.values()))))
        except BackendFailed:
            for span in spans:
                span.end()
            raise
        results = []
        for i, call in enumerate(calls):
            with trace.use_span(spans[i], end_on_exit=True):
                result = self.apply(call, checked[i], fetched.get(i))
                if spans[i].is_recording():  # no exporter: nothing to build
                    spans[i].set_attributes({"tool": call.name, "ok": result.ok,
                                             "args": json.dumps(call.args, default=str)[:2000],
                                             "ids": result.ids[:100]})
                    if not result.ok:
                        spans[i].set_attribute("error", result.content)
            results.append(result)
        return results

    def fetch(self, requests: list[tuple]) -> list:
        """Run the turn's retriever requests (`Retriever.call_many`: values or exceptions).
        Those failing with a backend error are retried (`backend_retries` times, backoff
        doubling from `backend_backoff_s`); one that still fails ends the branch — a dead
        backend never looks like an empty corpus. A bad query stays an observation."""
        if not requests:
            return []
        started = time.perf_counter()
        values = self.retriever.call_many(requests)
        failing = [i for i, v in enumerate(values) if is_backend_error(v)]
        for attempt in range(self.settings.backend_retries):
            if not failing:
                break
            time.sleep(self.settings.backend_backoff_s * 2 ** attempt)
            again = self.retriever.call_many([requests[i] for i in failing])
            for i, value in zip(failing, again):
                values[i] = value
            failing = [i for i in failing if is_backend_error(values[i])]
        self.fetch_s += time.perf_counter() - started
        if failing:
            exc = values[failing[0]]
            raise BackendFailed(f"{requests[failing[0]][0]} failed after "
                                f"{self.settings.backend_retries} retries: "
                                f"{type(exc).__name__}: {exc}"[:500])
        return values

    def apply(self, call: ToolCall, invalid: Exception | None, fetched) -> ToolResult:
        try:
            if invalid is not None:
                raise invalid
            if self.ws.finish_ids is not None:
                raise Rejected("the episode already finished this turn")
            if not self.budget.allows(call.name, self.ws.used):
                raise Rejected(f"{call.name} rejected: context is past the hard limit "
                               f"{self.budget.usage_line(self.ws.used)}; "
                               "prune_chunks, recall_chunks or finish")
            if isinstance(fetched, Exception) and not isinstance(fetched, BadQuery):
                self.fetch_failures.append(f"{call.name}: {type(fetched).__name__}: {fetched}")
                raise Rejected(f"{call.name} failed: {type(fetched).__name__}: {fetched}")
            if fetched and not isinstance(fetched, Exception):
                self.fetched_ok += 1  # an answer with something in it (an empty one may
                # never have reached the broken part: no hits, nothing to hydrate)
            result = TOOLS[call.name].apply(self.ws, call.args, fetched)
        except Rejected as exc:
            result = ToolResult(call, False, f"Error: {exc}")
        self.trace.record("call", turn=self.ws.turn, tool=call.name, args=call.args,
                          ok=result.ok, ids=result.ids,
                          message=None if result.ok else result.content)
        return result

    # --- the result ----------------------------------------------------------------------------

    def _ranking_at_stop(self) -> list[str]:
        """Stopped without `finish` (a limit, the deadline): the policy's own ranking of what it
        found when it has one (`rank`), else the context in arrival order."""
        rank = getattr(self.policy, "rank", None)
        if rank is not None:
            try:
                known = [cid for cid in rank(self.view()) if cid in self.ws.cache]
                if known:
                    return known
            except Exception as exc:  # noqa: BLE001 — a ranking must not lose the evidence
                self.trace.record("invalid_action", turn=self.ws.turn,
                                  message=f"rank at stop: {type(exc).__name__}: {exc}"[:300])
        return self.ws.context.ids()

    def result(self, end: EpisodeEnd) -> EpisodeResult:
        ws = self.ws
        ranked = ws.finish_ids if ws.finish_ids is not None else self._ranking_at_stop()
        ranked = ranked[: self.settings.final_k]
        return EpisodeResult(
            subquery=self.subquery, termination=end.reason, detail=end.detail,
            turns=ws.turn, tool_calls=self.tool_calls, invalid_actions=self.invalid_actions,
            evidence=build_evidence(ranked, ws.cache, ws.provenance), ranked_chunk_ids=ranked,
            context_tokens_final=ws.used, context_tokens_per_turn=self.tokens_per_turn,
            tokens_read=ws.tokens_read, retrieved_ids=ws.cache.ids(),
            pruned_ids=list(ws.pruned), final_context_ids=ws.context.ids(),
            trace=self.trace.records(), policy_s=self.policy_s, fetch_s=self.fetch_s,
            fork_candidates=self._fork_candidates())

    def _fork_candidates(self) -> list[dict]:
        """The `fork` tool's candidates, then the policy's own (`fork_candidates()`)."""
        candidates = getattr(self.policy, "fork_candidates", None)
        if candidates is None:
            return list(self.ws.forks)
        try:
            return list(self.ws.forks) + [c for c in candidates()
                                          if c.get("chunk_id") in self.ws.cache]
        except Exception as exc:  # noqa: BLE001 — a fork is optional; the evidence is not
            self.trace.record("invalid_action", turn=self.ws.turn,
                              message=f"fork candidates: {type(exc).__name__}: {exc}"[:300])
            return list(self.ws.forks)
