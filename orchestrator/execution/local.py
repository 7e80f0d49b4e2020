"""`LocalExecutor`: `run_branch` in this process, one branch after another, over one
`Retriever` (no Ray; the baseline and the laptop path). With `fetch_cache`, the branches of one
question share one `QuestionCache` across its waves (`question`), which dies with the question.
The question's own branch runs first, so a branch it covers (`cover`) is never run."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from branchsearch.infra.config.settings import Settings
from branchsearch.orchestrator.execution import (Cover, Events, bounded, done_event, emit,
                                                  not_started)
from branchsearch.workers.branch import BranchReport, BranchTask, run_branch


class LocalExecutor:
    engine_actors = False  # an LLM runs in this process (or behind llm_url)

    def __init__(self, settings: Settings):
        from branchsearch.infra.index.open import open_retriever

        self.retriever = open_retriever(settings, need_dense=settings.search_mode != "bm25")
        self.last_cache_stats: dict = {}  # the last question's fetch cache counters

    @contextmanager
    def question(self, settings: Settings) -> Iterator[object]:
        """One question's fetch cache, shared by all its waves: a `QuestionCache`, or None
        when `fetch_cache` is off."""
        from branchsearch.infra.retrieval.fetch_cache import QuestionCache

        cache = QuestionCache() if settings.fetch_cache else None
        try:
            yield cache
        finally:  # the cache dies with the question
            self.last_cache_stats = dict(cache.stats) if cache is not None else {}

    def run(self, tasks: list[BranchTask], *, settings: Settings,
            policy_factory: Callable | None = None, on_event: Events = None,
            cover: Cover = None, question: object = None) -> list[BranchReport]:
        from branchsearch.infra.retrieval.retriever import QuestionRetriever

        if question is None and settings.fetch_cache:
            with self.question(settings) as cache:
                return self.run(tasks, settings=settings, policy_factory=policy_factory,
                                on_event=on_event, cover=cover, question=cache)
        if question is not None:
            question.expect([t.subquery for t in tasks])
        retriever = self.retriever if question is None else QuestionRetriever(self.retriever,
                                                                              question)
        return self._run(tasks, retriever, settings, policy_factory, on_event, cover)

    def _run(self, tasks: list[BranchTask], retriever, settings: Settings,
             policy_factory: Callable | None, on_event: Events, cover: Cover
             ) -> list[BranchReport]:
        reports: list[BranchReport] = []
        for task in tasks:
            if cover is not None and reports and cover(reports[0], task):
                continue
            if task.deadline is not None and time.time() >= task.deadline:
                report = not_started(task)
            else:
                emit(on_event, {"type": "branch_started", "branch": task.index,
                                 "subquery": task.subquery})
                report = run_branch(bounded(task, settings), retriever, settings,
                                    policy_factory=policy_factory, on_event=on_event)
            emit(on_event, done_event(report))
            reports.append(report)
        return reports

    def warm(self, settings: Settings) -> None:
        """Load the models and the encoding now (a service, before it takes traffic)."""
        from branchsearch.workers.branch import warm_up

        self.retriever.load_models()
        warm_up(settings)

    def close(self) -> None:
        self.retriever.close()
