"""One branch episode: observe → decide → validate/apply → record, until a termination reason.

The loop reads like this (`run` → `step` → `execute`), and leaves only through `EpisodeEnd`,
which carries the termination reason. Everything the policy proposes goes through the harness:
schemas, the budget rules and the three-layer prune (propose → validate/apply → record).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from html import escape

from opentelemetry import trace

from branchsearch.infra.errors import BackendUnavailable, BadQuery
from branchsearch.infra.settings import Settings
from branchsearch.infra.telemetry import tracer
from branchsearch.infra.tokenizer import TokenCounter
from branchsearch.workers.budget import Budget
from branchsearch.workers.evidence import build_evidence
from branchsearch.workers.policy import AgentView, Policy, ToolCall, ToolResult, VisibleChunk
from branchsearch.workers.context import ActiveContext, EpisodeTrace, Provenance, ProvenanceRecord, RetrievalCache
from branchsearch.workers.tools import TOOLS, Rejected, validate_args


def run_requests(retriever, requests: list[tuple]) -> list:
    """Run retriever requests `(method, args, kwargs)`; each result is a value or the exception
    it raised. A retriever with `call_many` (a remote one) gets them in one round trip; a local
    one runs them on threads."""
    if not requests:
        return []
    if hasattr(retriever, "call_many"):
        return retriever.call_many(requests)

    def one(request):
        method, args, kwargs = request
        try:
            return getattr(retriever, method)(*args, **kwargs)
        except Exception as exc:
            return exc

    if len(requests) == 1:
        return [one(requests[0])]
    with ThreadPoolExecutor(max_workers=min(8, len(requests))) as pool:
        return list(pool.map(one, requests))


class EpisodeEnd(Exception):
    """Leaving the loop: `reason` is one of finish, max_turns, max_tokens_read, no_progress,
    policy_error."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason, self.detail = reason, detail


class BackendFailed(EpisodeEnd):
    """A backend (retriever or LLM engine) still failing after bounded retries: the branch ends
    with termination `backend_error`, which the runner reports as status `error`."""

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
    subquery: str
    termination: str
    detail: str
    turns: int
    tool_calls: int
    evidence: list[dict]
    ranked_chunk_ids: list[str]
    context_tokens_final: int
    context_tokens_per_turn: list[int]
    tokens_read: int
    retrieved_ids: list[str]
    pruned_ids: list[str]
    final_context_ids: list[str]
    trace: list[dict] = field(repr=False, default_factory=list)
    provenance: list[dict] = field(repr=False, default_factory=list)
    trace_id: str = ""
    policy_s: float = 0.0  # time the policy spent deciding
    fetch_s: float = 0.0  # wall time of the (concurrent) retrieval phases

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class Episode:
    def __init__(self, subquery: str, retriever, policy: Policy, settings: Settings, *,
                 acl_groups: list[str] | None = None, counter: TokenCounter | None = None):
        self.subquery = subquery
        self.retriever = retriever
        self.policy = policy
        self.settings = settings
        self.acl_groups = acl_groups  # from the caller's identity, never from tool arguments
        self.counter = counter or TokenCounter(settings.encoding)
        self.budget = Budget(settings.budget_tokens, settings.soft_limit, settings.hard_limit)
        self.context, self.cache = ActiveContext(), RetrievalCache()
        self.provenance, self.trace = Provenance(), EpisodeTrace()
        self.turn = 0
        self.tool_calls = 0
        self.tokens_read = 0
        self.tokens_per_turn: list[int] = []
        self.pruned: list[str] = []
        self.finish_ids: list[str] | None = None
        self.last_results: list[ToolResult] = []
        self._stale_turns = 0
        self._progress = False
        self.policy_s = 0.0
        self.fetch_s = 0.0

    # --- the loop ----------------------------------------------------------------------------

    def run(self) -> EpisodeResult:
        with tracer().start_as_current_span("episode") as span:
            span.set_attribute("subquery", self.subquery)
            self.trace.record("start", subquery=self.subquery, budget=self.budget.tokens,
                              acl_groups=self.acl_groups)
            try:
                while True:
                    self.step()
            except EpisodeEnd as end:
                self.trace.record("end", reason=end.reason, detail=end.detail, turns=self.turn,
                                  tokens=self.context.tokens)
                span.set_attributes({"termination": end.reason, "turns": self.turn,
                                     "context_tokens_final": self.context.tokens,
                                     "tokens_read": self.tokens_read})
                result = self._result(end)
            result.trace_id = format(span.get_span_context().trace_id, "032x")
            return result

    def step(self) -> None:
        if self.turn >= self.settings.max_turns:
            raise EpisodeEnd("max_turns")
        self.turn += 1
        with tracer().start_as_current_span("turn") as span:
            before = self.context.tokens
            view = self.view()
            started = time.perf_counter()
            try:
                calls = list(self.policy.decide(view))
            except Exception as exc:
                if is_backend_error(exc):
                    raise BackendFailed(f"policy engine: {type(exc).__name__}: {exc}") from None
                raise EpisodeEnd("policy_error", f"{type(exc).__name__}: {exc}") from None
            finally:
                self.policy_s += time.perf_counter() - started
            self._progress = False
            self.last_results = self.execute(calls)
            after = self.context.tokens
            self.tokens_per_turn.append(after)
            span.set_attributes({"turn": self.turn, "calls": len(calls), "tokens_before": before,
                                 "tokens_after": after})
            self.trace.record("turn", turn=self.turn, calls=[c.name for c in calls],
                              tokens_before=before, tokens_after=after,
                              usage=self.budget.usage_line(after),
                              query_state=self.policy.query_state())
        self._check_termination(calls)

    def _check_termination(self, calls: list[ToolCall]) -> None:
        if self.finish_ids is not None:
            raise EpisodeEnd("finish")
        if self.tokens_read >= self.settings.max_tokens_read:
            raise EpisodeEnd("max_tokens_read", f"{self.tokens_read} tokens read")
        self._stale_turns = 0 if self._progress else self._stale_turns + 1
        if self._stale_turns >= self.settings.no_progress_turns:
            raise EpisodeEnd("no_progress", f"{self._stale_turns} turns without new chunks")

    def view(self) -> AgentView:
        used = self.context.tokens
        allowed = [name for name in TOOLS if self.budget.allows(name, used)]
        return AgentView(self.subquery, self.turn, self.context.chunks(),
                         self.budget.usage_line(used), used, self.budget.tokens, allowed,
                         self.last_results, self.budget.reminder(used),
                         [TOOLS[name].schema for name in allowed])

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
        requests = {i: TOOLS[c.name].fetch(self, c.args) for i, c in enumerate(calls)
                    if checked[i] is None and TOOLS[c.name].fetch is not None
                    and self.budget.allows(c.name, self.context.tokens)}
        started = time.perf_counter()
        try:
            values = self.fetch(list(requests.values()))
        except BackendFailed:
            for span in spans:
                span.end()
            raise
        self.fetch_s += time.perf_counter() - started
        fetched: dict[int, object] = {}
        for (i, call), value in zip(((i, calls[i]) for i in requests), values):
            if isinstance(value, Exception) and not isinstance(value, BadQuery):
                value = Rejected(f"{call.name} failed: {type(value).__name__}: {value}")
            fetched[i] = value  # a bad query is an observation, not a crash
        results = []
        for i, call in enumerate(calls):
            with trace.use_span(spans[i], end_on_exit=True):
                result = self._apply(call, checked[i], fetched.get(i))
                spans[i].set_attributes({"tool": call.name, "ok": result.ok,
                                         "args": json.dumps(call.args, default=str)[:2000],
                                         "ids": result.ids[:100]})
                if not result.ok:
                    spans[i].set_attribute("error", result.content)
            results.append(result)
        return results

    def fetch(self, requests: list[tuple]) -> list:
        """Run the turn's retriever requests. Those failing with a backend error are retried
        (`backend_retries` times, backoff doubling from `backend_backoff_s`); one that still
        fails ends the branch — a dead backend never looks like an empty corpus."""
        values = run_requests(self.retriever, requests)
        failing = [i for i, v in enumerate(values) if is_backend_error(v)]
        for attempt in range(self.settings.backend_retries):
            if not failing:
                break
            time.sleep(self.settings.backend_backoff_s * 2 ** attempt)
            for i, value in zip(failing, run_requests(self.retriever,
                                                      [requests[i] for i in failing])):
                values[i] = value
            failing = [i for i in failing if is_backend_error(values[i])]
        if failing:
            exc = values[failing[0]]
            raise BackendFailed(f"{requests[failing[0]][0]} failed after "
                                f"{self.settings.backend_retries} retries: "
                                f"{type(exc).__name__}: {exc}"[:500])
        return values

    def _apply(self, call: ToolCall, invalid: Exception | None, fetched) -> ToolResult:
        try:
            if invalid is not None:
                raise invalid
            if self.finish_ids is not None:
                raise Rejected("the episode already finished this turn")
            if not self.budget.allows(call.name, self.context.tokens):
                raise Rejected(f"{call.name} rejected: context is past the hard limit "
                               f"{self.budget.usage_line(self.context.tokens)}; "
                               "prune_chunks, recall_chunks or finish")
            if isinstance(fetched, Rejected):
                raise fetched
            result = TOOLS[call.name].apply(self, call.args, fetched)
        except Rejected as exc:
            result = ToolResult(call, False, f"Error: {exc}")
        self.trace.record("call", turn=self.turn, tool=call.name, args=call.args, ok=result.ok,
                          ids=result.ids, message=None if result.ok else result.content)
        return result

    # --- what tools do to the stores -----------------------------------------------------------

    def known_parents(self, ids: list[str]) -> tuple[str, ...]:
        return tuple(cid for cid in ids if cid in self.cache)

    def add_hits(self, hits, *, tool: str, query: str, parents: tuple[str, ...],
                 cap: int | None = None, allow_cached: bool = False) -> list[str]:
        """Cache, record provenance and show new hits, each cut to the cap and the room left.
        With `allow_cached` (reading), cached chunks come back and visible snippets are
        replaced by the longer text."""
        added: list[str] = []
        cap = cap or self.settings.result_token_cap
        visible = {c.id: c for c in self.context.chunks()}
        for hit in hits:  # (a longer view replaces a visible snippet in place)
            if hit.chunk_id in self.cache and not allow_cached:
                continue
            shown_before = visible.get(hit.chunk_id)
            if shown_before is not None and (shown_before.text == hit.text
                                             or self.counter.count(shown_before.text) >= cap):
                continue
            room = self.budget.room(self.context.tokens - (shown_before.tokens
                                                           if shown_before else 0))
            if room < 16:
                break  # over budget: unseen hits stay findable by later searches
            shown, shown_tokens, full_tokens = self.counter.cut(hit.text, min(cap, room - 8))
            if self.cache.add(hit.chunk_id, {"doc_id": hit.doc_id, "title": hit.title,
                                             "text": hit.text}):
                self.tokens_read += full_tokens
            self.provenance.add(ProvenanceRecord(hit.chunk_id, self.turn, tool, query, hit.rank,
                                                 round(hit.score, 6), parents))
            tokens = shown_tokens + self.counter.count(f"{hit.chunk_id} {hit.title} ")
            self.context.add(VisibleChunk(hit.chunk_id, hit.doc_id, hit.title, shown, tokens))
            added.append(hit.chunk_id)
        if added:
            self._progress = True
        return added

    def render_chunks(self, ids: list[str]) -> str:
        """Retrieved text is data: delimited, escaped, never interpreted."""
        by_id = {c.id: c for c in self.context.chunks()}
        return "\n".join(
            f'<chunk id="{escape(cid)}" title="{escape(by_id[cid].title)}">'
            f"{escape(by_id[cid].text, quote=False)}</chunk>" for cid in ids if cid in by_id)

    def prune(self, ids: list[str], reason: str) -> ToolResult:
        """Three layers: the policy proposed `ids`; validate and apply here; record it all."""
        before = self.context.tokens
        applied, rejected = [], {}
        for cid in dict.fromkeys(ids):
            if cid not in self.cache:
                rejected[cid] = "unknown chunk id"
            elif cid not in self.context:
                rejected[cid] = "not visible (already pruned)"
            else:
                applied.append(cid)
        if applied and len(applied) == len(self.context):
            rejected[applied.pop()] = "last evidence in context"
        self.context.remove(applied)
        self.pruned += applied
        if applied:
            self._progress = True
        after = self.context.tokens
        state = self.policy.query_state()
        self.trace.record("prune", turn=self.turn, proposed=list(ids), applied=applied,
                          rejected=rejected, reason=reason, tokens_before=before,
                          tokens_after=after, query_state=state)
        with tracer().start_as_current_span("prune") as span:
            span.set_attributes({
                "prune.proposed_ids": list(ids), "prune.applied_ids": applied,
                "prune.rejected_ids": list(rejected),
                "prune.rejected_reasons": json.dumps(rejected), "prune.reason": reason,
                "prune.tokens_before": before, "prune.tokens_after": after,
                "prune.query_state": json.dumps(state, default=str)[:4000]})
        lines = [f"Pruned {len(applied)} chunk(s)."]
        lines += [f"Not pruned {cid}: {why}" for cid, why in rejected.items()]
        ok = bool(applied) or not rejected
        return ToolResult(ToolCall("prune_chunks", {"ids": ids, "reason": reason}), ok,
                          ("" if ok else "Error: ") + " ".join(lines), applied)

    def recall(self, ids: list[str]) -> ToolResult:
        restored, problems = [], []
        for cid in dict.fromkeys(ids):
            cached = self.cache.get(cid)
            if cached is None:
                problems.append(f"{cid}: unknown chunk id")
                continue
            if cid in self.context:
                problems.append(f"{cid}: already visible")
                continue
            shown, shown_tokens, _ = self.counter.cut(cached["text"],
                                                      self.settings.result_token_cap)
            tokens = shown_tokens + self.counter.count(f"{cid} {cached['title']} ")
            if tokens > self.budget.room(self.context.tokens):
                problems.append(f"{cid}: does not fit the budget "
                                f"{self.budget.usage_line(self.context.tokens)}")
                continue
            self.context.add(VisibleChunk(cid, cached["doc_id"], cached["title"], shown, tokens))
            self.provenance.add(ProvenanceRecord(cid, self.turn, "recall_chunks", "", 0, 0.0))
            restored.append(cid)
        if restored:
            self._progress = True
        self.trace.record("recall", turn=self.turn, proposed=list(ids), applied=restored,
                          rejected=problems)
        if not restored:
            raise Rejected("nothing recalled: " + "; ".join(problems))
        text = self.render_chunks(restored)
        if problems:
            text += "\nNot recalled: " + "; ".join(problems)
        return ToolResult(ToolCall("recall_chunks", {"ids": ids}), True, text, restored)

    def finish(self, ids: list[str], reason: str) -> ToolResult:
        known = [cid for cid in dict.fromkeys(ids) if cid in self.cache]
        unknown = [cid for cid in ids if cid not in self.cache]
        self.finish_ids = known
        self.trace.record("finish", turn=self.turn, ids=known, unknown=unknown, reason=reason)
        note = f" Ignored unknown ids: {', '.join(unknown)}." if unknown else ""
        return ToolResult(ToolCall("finish", {"ids": ids, "reason": reason}), True,
                          f"Finished with {len(known)} chunk(s).{note}", known)

    # --- the result ----------------------------------------------------------------------------

    def _result(self, end: EpisodeEnd) -> EpisodeResult:
        ranked = self.finish_ids if self.finish_ids is not None else self.context.ids()
        ranked = ranked[: self.settings.final_k]
        evidence = build_evidence(ranked, self.cache, self.provenance)
        return EpisodeResult(
            subquery=self.subquery, termination=end.reason, detail=end.detail, turns=self.turn,
            tool_calls=self.tool_calls, evidence=evidence, ranked_chunk_ids=ranked,
            context_tokens_final=self.context.tokens, context_tokens_per_turn=self.tokens_per_turn,
            tokens_read=self.tokens_read, retrieved_ids=self.cache.ids(),
            pruned_ids=list(self.pruned), final_context_ids=self.context.ids(), trace=self.trace.records(), policy_s=self.policy_s,
            fetch_s=self.fetch_s,
            provenance=self.provenance.records())
