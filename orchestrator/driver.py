"""The driver: plan → fan out one branch per sub-query → gather with timeouts → fuse → result.

The executor (`orchestrator.execution`: in-process or Ray actors) runs the branches; everything
else — question checks, planning, fusion, metrics, events — is here, the same for both.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

from branchsearch.infra import telemetry
from branchsearch.infra.config.settings import Settings
from branchsearch.infra.errors import BackendUnavailable, ClusterLost, Overloaded
from branchsearch.infra.models.tokenizer import TokenCounter
from branchsearch.infra.retrieval.retriever import searched_mode
from branchsearch.orchestrator.execution import done_event, emit, make_executor, not_started
from branchsearch.orchestrator.plan import HeuristicPlanner
from branchsearch.orchestrator.result import (MEANING_ONLY, NOTHING_VISIBLE, SearchResult,
                                             evidence_texts, fuse_branches, meaning_only)
from branchsearch.workers.branch import BranchTask
from branchsearch.workers.harness import called_off
from branchsearch.workers.query import QUESTION_CUT, check_question
from branchsearch.workers.tools import fit_query


class Driver:
    def __init__(self, settings: Settings, *, mode: str = "ray", planner=None,
                 policy_factory: Callable | None = None, pool_size: int | None = None,
                 executor=None):
        """`executor`: one already made (the service's, on its shared branch pool); else one
        for `mode`."""
        self.settings = settings
        self.mode = mode
        self.policy_factory = policy_factory  # (index, subquery) -> Policy; tests
        telemetry.configure_from(settings)
        if settings.llm_url and "llm" in (settings.policy, settings.planner):
            from branchsearch.infra.models.llm import check_endpoint

            check_endpoint(settings)  # wrong URL or model: one clear error, before any branch
        self.executor = executor or make_executor(settings, mode, pool_size=pool_size)
        self.planner = planner or self._make_planner()
        self.counter = TokenCounter(settings.encoding)
        # a lexical search finds only what shares a word: no result of it is meaning only
        self.by_meaning = searched_mode(settings) != "bm25"

    def _make_planner(self):
        if self.settings.planner != "llm":
            return HeuristicPlanner()
        from branchsearch.orchestrator.plan import LLMPlanner
        from branchsearch.workers.factory import make_engine

        return LLMPlanner(make_engine(self.settings, actors=self.executor.engine_actors))

    @property
    def retriever(self):
        """The stores' owner: a `Retriever` (local) or the retriever actor's handle (ray)."""
        return self.executor.retriever

    def warm(self) -> None:
        """Load the models the first question would load: a service, before it takes traffic
        (the CLI loads them only when its questions need them)."""
        self.executor.warm(self.settings)

    def close(self) -> None:
        self.executor.close()

    def search(self, question: str, *, max_branches: int | None = None,
               acl_groups: list[str] | None = None, deadline_s: float | None = None,
               on_event: Callable[[dict], None] | None = None) -> SearchResult:
        """Search for the evidence of one question.

        The question is cut to `query_max_tokens` when longer (the result's `notes` say so) and
        planned into at most `max_branches` sub-queries (default `settings.branches`); each runs
        as a branch agent that sees only what `acl_groups` may see (None: public documents
        only). Branches still running at `deadline_s` seconds (or `branch_timeout_s`) are
        reported as `timeout`; a branch whose backend stays down as `error`. The branches that
        finished are fused with RRF. `on_event`, when given, is called in this thread with
        JSON-able dicts: plan, branch_started, search, prune, branch_done, covered, fork, chain,
        result. A planned branch that the question's own branch covers (`orchestrator.cover`,
        `settings.skip_covered`) is not fused (in-process, not run): a `covered` event says
        which titles cover it, and the result's `covered` lists the same.
        With `settings.forks`, `settings.chains` or `settings.bridges` and more than one
        branch, a second wave of forks (`orchestrator.forks`) or next hops
        (`orchestrator.chains`: chains and bridges) follows the first;
        `max_branches` 1 never has one.

        Raises BranchsearchError for an empty question or one without a letter or digit;
        never for a failing branch — the result's `status` (ok | partial | failed) and its
        branches say what happened.
        """
        question = check_question(question)  # NFC: the documents' form (`infra.nfc`)
        started = time.perf_counter()
        started_wall = time.time()
        deadline = started_wall + deadline_s if deadline_s is not None else None
        cap = self.settings.query_max_tokens
        text, tokens = fit_query(question, self.counter, cap)
        notes = [f"{QUESTION_CUT} {tokens:,} to {cap} tokens (the search cap) before "
                 "searching"] if tokens > cap or len(text) < len(" ".join(question.split())) \
            else []
        with telemetry.tracer().start_as_current_span("query") as span:
            span.set_attribute("question", text)
            with telemetry.tracer().start_as_current_span("plan") as plan_span:
                budget = max_branches or self.settings.branches
                subs = self.planner.plan(text, budget)
                chain = self._chain(text, subs, budget)
                if chain is not None:  # the inner hop runs in the first wave
                    from branchsearch.orchestrator.chains import HOP_WEIGHT
                    from branchsearch.orchestrator.plan import SubQuery

                    subs = subs + [SubQuery(chain.inner, HOP_WEIGHT, "hop")]
                    plan_span.set_attributes({"plan.hops.outer": chain.outer,
                                              "plan.hops.slot": chain.slot,
                                              "plan.hops.inner": chain.inner})
                plan_span.set_attribute("subqueries", [s.text for s in subs])
                fallback = getattr(self.planner, "last_fallback", "")
                if fallback:
                    plan_span.set_attribute("planner.fallback", fallback)
            emit(on_event, {"type": "plan", "subqueries": [s.text for s in subs]}
                 | ({"hops": chain.to_dict()} if chain is not None else {}))
            groups = tuple(acl_groups) if acl_groups is not None else None
            forking = (max_branches or self.settings.branches) > 1 and self.settings.forks > 0
            tasks = [BranchTask(i, fit_query(s.text, self.counter, cap)[0], s.weight, s.kind,
                                groups, deadline, may_fork=forking)
                     for i, s in enumerate(subs)]
            # the later waves end by the question's deadline, and never past one branch timeout
            # from its start: a second wave does not double the wait
            own = started_wall + self.settings.branch_timeout_s
            ends = own if deadline is None else min(deadline, own)
            late: list[str] = []  # the waves the deadline left no time to start
            # one fetch cache for all the question's waves: a later wave reads what an
            # earlier one fetched (the same results, fewer backend requests)
            with self.executor.question(self.settings) as shared:
                branches, covered = self._waves(tasks, subs, text, chain, budget, groups, ends,
                                                forking, on_event, shared, late)
            ranked, evidence = fuse_branches(branches, k=self.settings.branch_rrf_k,
                                             limit=self.settings.final_k)
            trace_id = format(span.get_span_context().trace_id, "032x")
            span.set_attributes({"branches": len(branches),
                                 "branches_failed": sum(b.status != "ok" for b in branches)})
        telemetry.flush()
        ok = [b for b in branches if b.status == "ok"]
        metrics = {
            "latency_s": round(time.perf_counter() - started, 4),
            "planner": type(self.planner).__name__,
            "planner_fallback": getattr(self.planner, "last_fallback", ""),
            "branches": len(branches), "branches_ok": len(ok), "covered": len(covered),
            "branch_latency_s_sum": round(sum(b.latency_s for b in branches), 4),
            "branch_latency_s_max": round(max((b.latency_s for b in branches), default=0), 4),
            "context_tokens_final_mean": round(
                sum(b.context_tokens_final for b in ok) / max(len(ok), 1), 1),
            "forks": sum(b.kind == "fork" for b in branches),
            "chains": sum(b.kind == "chain" for b in branches),
            "bridges": sum(b.kind == "bridge" for b in branches),
            "tokens_read": sum(b.tokens_read for b in ok),
            "turns": sum(b.turns for b in ok), "tool_calls": sum(b.tool_calls for b in ok),
            "late_waves": len(late),  # waves not started for lack of time (`notes` says which)
        }
        if metrics["forks"]:
            forks = [b for b in branches if b.kind == "fork"]
            metrics["fork_latency_s_max"] = round(max(b.latency_s for b in forks), 4)
        if late:  # not a full result, though every branch that ran may be ok
            notes = notes + [f"not searched for lack of time: {', '.join(late)} (the "
                             "question's deadline, or one branch timeout from its start, "
                             f"was less than {MIN_WAVE_S:g} s away when their wave was to "
                             "start)"]
        if not evidence and any(b.status == "ok" for b in branches):  # empty, but not failed
            notes = notes + [f"no evidence: {NOTHING_VISIBLE} the question"]
        elif self.by_meaning and meaning_only(question, evidence_texts(evidence)):
            notes = notes + [MEANING_ONLY]
        result = SearchResult(question, evidence, ranked, branches, metrics,
                              trace_id if trace_id.strip("0") else uuid.uuid4().hex, notes,
                              covered)
        emit(on_event, {"type": "result", "result": result.to_dict()})
        return result

    def _waves(self, tasks: list, subs: list, text: str, chain, budget: int, groups, ends,
               forking: bool, on_event, shared, late: list[str]) -> tuple[list, list[dict]]:
        """The first wave (`tasks`), then the forks, chains and bridges that follow from it
        (each later wave ending by `ends`), all on the question's cache `shared`. Returns every
        branch's report and the covered branches (`_covered`); `late` gets the waves not
        started for lack of time."""
        cover = self._cover(subs)
        branches = self.executor.run(tasks, settings=self.settings,
                                     policy_factory=self.policy_factory, on_event=on_event,
                                     cover=cover, question=shared)
        covered = self._covered(tasks, branches, cover, on_event)
        if forking:
            branches += self._forks(branches, groups, ends, on_event, len(tasks), late, shared)
        # later waves count against the budget; a covered branch, never run, leaves its room
        room = budget - len(tasks) + len(covered)
        bridges = max(min(self.settings.bridges, room), 0) if budget > 1 else 0
        if chain is not None and room > 0 or bridges:
            number = max([len(tasks) - 1] + [b.index for b in branches]) + 1
            second = self._next_hops(branches, text, chain, bridges, room, groups, ends,
                                     on_event, number, late, shared)
            branches += second
            room -= len(second)
            wave = second
            for _ in range(self.settings.bridge_depth - 1):  # a bridge of each bridge, again
                if not wave:
                    break
                wave = self._deeper(branches, text, room, groups, ends, on_event, late, shared,
                                    of=tuple(b.index for b in wave if b.kind == "bridge"))
                branches += wave
                room -= len(wave)
        return branches, covered

    def _cover(self, subs: list):
        """The rule that leaves out a planned branch the question's own branch covers
        (`orchestrator.cover`), or None: off, or nothing to cover."""
        if not self.settings.skip_covered or len(subs) < 2 or subs[0].kind != "original":
            return None
        from branchsearch.orchestrator.cover import covered_by

        names = [s.names for s in subs]
        return lambda anchor, task: (covered_by(anchor, names[task.index])
                                     if 0 < task.index < len(names) else None)

    def _covered(self, tasks: list, branches: list, cover, on_event) -> list[dict]:
        """Record each task the executor left out as covered: a `covered` span and event
        (the branch, its sub-query, the titles of the question's branch that cover it and
        the chunk ids it ranked first of each, which the service's ACL guard checks).
        Returns the events, without their type (the result's `covered`)."""
        ran = {b.index for b in branches}
        left, out = [t for t in tasks if t.index not in ran], []
        for task in left:
            by = cover(branches[0], task) or []
            titles, ids = [t for t, _ in by], [c for _, c in by]
            with telemetry.tracer().start_as_current_span("covered") as span:
                span.set_attributes({"covered.branch": task.index,
                                     "covered.subquery": task.subquery, "covered.by": titles,
                                     "covered.ids": ids})
            out.append({"branch": task.index, "subquery": task.subquery, "by": titles,
                        "ids": ids})
            emit(on_event, {"type": "covered", **out[-1]})
        return out

    def _forks(self, first: list, groups, deadline, on_event, number: int,
               late: list[str], shared=None) -> list:
        """The second wave (`orchestrator.forks`): at most `settings.forks` forks of what the
        first wave pruned near its keep line, each recorded as a `fork` span and event, run on
        the executor in parallel, ending by `deadline`, numbered from `number` (after every
        planned branch, covered ones included); [] when no branch left a candidate or no time
        is left (then `late` says what was not searched)."""
        from branchsearch.orchestrator.forks import fork_tasks

        tasks = fork_tasks(first, self.settings.forks, deadline=deadline, acl_groups=groups,
                           first=number)
        if _too_late(tasks, deadline, late):  # not forks reported as timeouts
            return []
        for i, task in enumerate(tasks):
            tasks[i] = task = _under_span("fork", task, {
                "fork.branch": task.index, "fork.parent": task.parent,
                "fork.reason": task.reason, "fork.handed": list(task.seeds),
                "fork.hop_room": task.hop_room, "fork.subquery": task.subquery})
            emit(on_event, {"type": "fork", "branch": task.index, "parent": task.parent,
                            "reason": task.reason, "handed": list(task.seeds),
                            "subquery": task.subquery})
        if not tasks:
            return []
        return self._later_wave(tasks, on_event, shared)

    def _chain(self, text: str, subs: list, budget: int):
        """The question's hops (`orchestrator.chains.hops`) when chains are on, the question
        runs with more than one branch and the plan left room for the inner hop's branch;
        else None."""
        if not self.settings.chains or budget <= 1 or len(subs) >= budget:
            return None
        from branchsearch.orchestrator.chains import hops

        chain = hops(text)
        if chain is None or any(s.text.lower() == chain.inner.lower() for s in subs):
            return None
        return chain

    def _next_hops(self, first: list, text: str, chain, bridges: int, room: int, groups,
                   deadline, on_event, number: int, late: list[str], shared=None) -> list:
        """The second wave of next hops (`orchestrator.chains`): a branch per candidate answer
        of the chain's inner hop, and per entity the question's branch's top chunk names
        (`bridges` of them), at most `room` in all (what the question's branch budget left),
        each recorded as a `chain` span and event, run on the executor in parallel, ending by
        `deadline`; [] when there is none or no time is left (then `late` says what was not
        searched)."""
        from branchsearch.orchestrator.chains import bridge_tasks, chain_tasks

        tasks = [] if chain is None else chain_tasks(
            first, chain, min(self.settings.chains, room), deadline=deadline,
            acl_groups=groups, first=number)
        tasks += bridge_tasks(first, text, min(bridges, room - len(tasks)), deadline=deadline,
                              acl_groups=groups, first=number + len(tasks))
        if _too_late(tasks, deadline, late):
            return []
        return self._run_hops(tasks, on_event, shared)

    def _run_hops(self, tasks: list, on_event, shared=None) -> list:
        """Next-hop tasks, each recorded as a `chain` span and event, run on the executor in
        parallel (on the question's cache `shared`)."""
        for i, task in enumerate(tasks):
            tasks[i] = task = _under_span("chain", task, {
                "chain.branch": task.index, "chain.parent": task.parent,
                "chain.answer": task.reason, "chain.subquery": task.subquery})
            emit(on_event, {"type": "chain", "branch": task.index, "parent": task.parent,
                            "reason": task.reason, "subquery": task.subquery})
        if not tasks:
            return []
        return self._later_wave(tasks, on_event, shared)

    def _later_wave(self, tasks: list, on_event, shared=None) -> list:
        """A second or third wave run on the executor (on the question's cache `shared`).
        One that finds no branch actor free before its deadline (`Overloaded`: the pool is busy
        with other searches), or no retriever to search (`BackendUnavailable`: one started
        afresh and not placed by then), is reported as not started, branch by branch, as the
        executor reports a first-wave branch that could not start: the earlier waves' evidence
        stands, and the question is not refused for a wave it could do without."""
        try:
            return self.executor.run(tasks, settings=self.settings,
                                     policy_factory=self.policy_factory, on_event=on_event,
                                     question=shared)
        except ClusterLost:  # (a BackendUnavailable) nothing runs on it: the question is
            raise  # not answered, and a batch asks it again on its resume
        except (Overloaded, BackendUnavailable) as exc:
            reports = [not_started(t, str(exc)) for t in tasks]
            for report in reports:
                emit(on_event, done_event(report))
            return reports

    def _deeper(self, done: list, text: str, room: int, groups, deadline, on_event,
                late: list[str], shared=None, of: tuple[int, ...] = ()) -> list:
        """A third or later wave (`orchestrator.chains.deeper_bridge_tasks`): a bridge of each
        bridge of the wave before (the branches numbered `of`), at most `room`, recorded and
        run as the second wave's are."""
        from branchsearch.orchestrator.chains import deeper_bridge_tasks

        if room <= 0 or not of:
            return []
        tasks = deeper_bridge_tasks(done, text, deadline=deadline, acl_groups=groups,
                                    first=max(b.index for b in done) + 1, room=room, wave=of)
        if _too_late(tasks, deadline, late, deeper=True):
            return []
        return self._run_hops(tasks, on_event, shared)


# The least time a second or third wave must have before `deadline` to start: a branch
# retrieves, reranks and reads chunks, so a wave started with a few ms left could only time
# out; it is skipped and said in the notes instead, as a wave whose deadline has passed is.
MIN_WAVE_S = 0.25


def _too_late(tasks: list, deadline: float, late: list[str], deeper: bool = False) -> bool:
    """Whether a wave of `tasks` may not start: less than `MIN_WAVE_S` is left before
    `deadline` (or it has passed). A wave that had tasks is then said in `late` ("2 forks",
    "1 chain, 2 bridges"), so a result without it is not taken for a full one; a wave with
    none had nothing to search."""
    if time.time() < deadline - MIN_WAVE_S:
        return called_off()  # (the search's caller left: nothing more to search)
    for kind, n in Counter(task.kind for task in tasks).items():
        of = (" of a bridge" if n == 1 else " of bridges") if deeper else ""
        late.append(f"{n} {kind}{'' if n == 1 else 's'}{of}")
    return True


def _under_span(name: str, task: BranchTask, attributes: dict) -> BranchTask:
    """A second-wave task recorded as a span of its own (`fork`, `chain`), returned carrying
    that span's context: its branch span nests under it wherever the branch runs."""
    with telemetry.tracer().start_as_current_span(name) as span:
        span.set_attributes(attributes)
        return replace(task, trace_parent=tuple(telemetry.current_carrier().items()))


def open_driver(settings: Settings, executor: str = "ray") -> Driver:
    """A driver on `executor` (see `executors.pick_executor` for the one-branch rule), made
    once the index is readable: an incomplete or busy index is one line, before any actor."""
    from branchsearch.infra.index.open import check_readable

    check_readable(settings)
    return Driver(settings, mode=executor)
