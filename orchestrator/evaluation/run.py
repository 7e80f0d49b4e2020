"""Evaluation over a BEIR folder: single-shot retrieval, the branch agent, paired comparisons,
and `run_evaluation`, the whole of `branchsearch eval` (the CLI only parses and prints)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from branchsearch.infra.config.choices import BASELINES, MODES, Baseline, Executor, Mode, Policy, Split
from branchsearch.infra.datasets.beir import Query
from branchsearch.infra.errors import BranchsearchError, CorpusError
from branchsearch.infra.index.catalog import index_embedding
from branchsearch.infra.retrieval.retriever import Retriever
from branchsearch.infra.stores.protocols import MAX_K
from branchsearch.infra.config.settings import Settings
from branchsearch.orchestrator.evaluation.measures import (doc_ranking, mean, percentile,
                                                           single_shot_metrics)

# Chunks first fetched per query; fetched deeper (x4, up to MAX_K) while their documents are
# fewer than DOC_DEPTH and the index has more: a long document's chunks can fill the list.
CHUNK_DEPTH = 50
DOC_DEPTH = 10  # documents a ranking is scored on (the metrics go to @10)


def _ranked_docs(retriever: Retriever, text: str, mode: str,
                 acl_groups: list[str] | None) -> list[str]:
    """The query's document ranking, DOC_DEPTH documents deep when the index has that many."""
    k = CHUNK_DEPTH
    while True:
        hits = retriever.search(text, mode=mode, k=k, acl_groups=acl_groups)
        ranking = doc_ranking([h.chunk_id for h in hits])
        if len(ranking) >= DOC_DEPTH or len(hits) < k or k == MAX_K:
            return ranking
        k = min(k * 4, MAX_K)


def eval_single_shot(retriever: Retriever, queries: list[Query], mode: str,
                     progress: Callable[[], None] | None = None,
                     acl_groups: list[str] | None = None) -> dict:
    per_query, latencies = [], []
    for q in queries:
        t = time.perf_counter()
        ranking = _ranked_docs(retriever, q.text, mode, acl_groups)
        latencies.append((time.perf_counter() - t) * 1000)
        per_query.append({"id": q.id, "ranking": ranking[:DOC_DEPTH],
                          "metrics": single_shot_metrics(ranking, q.gold)})
        if progress:
            progress()
    names = per_query[0]["metrics"].keys() if per_query else []
    metrics = {name: round(mean([p["metrics"][name] for p in per_query]), 4) for name in names}
    metrics["latency_ms_p50"] = round(percentile(latencies, 50), 2)
    metrics["latency_ms_p90"] = round(percentile(latencies, 90), 2)
    return {"config": f"{mode} single-shot", "mode": mode, "queries": len(queries),
            "metrics": metrics, "per_query": per_query}


def eval_agent(driver, queries: list[Query], max_branches: int | None = None,
               progress: Callable[[], None] | None = None, docstore=None, k: int = 5,
               acl_groups: list[str] | None = None) -> dict:
    """Run the driver (one or more branch agents) per query, score the fused evidence and
    attribute each failure from what the branches did (see `evaluation.attribution`). A branch
    in error (a backend down: its retries spent) stops the run with a `BranchsearchError`."""
    from collections import Counter

    from branchsearch.orchestrator.evaluation.attribution import (CLASSES, Trajectory,
                                                                  agent_measures, attribute)

    titles = docstore.titles() if docstore is not None else {}
    gold = sorted({doc for q in queries for doc in q.gold})  # the corpus lacks `absent`:
    absent = set(gold) - docstore.present(gold) if docstore is not None else set()  # its miss
    per_query, latencies, classes = [], [], Counter()
    for q in queries:
        result = driver.search(q.text, max_branches=max_branches, acl_groups=acl_groups)
        failed = next((b for b in result.branches if b.status == "error"), None)
        if failed is not None:  # a backend down, not the agent's miss: no figures made of it
            raise BranchsearchError(f"question {q.id!r}: a branch failed ({failed.error}); the "
                                    "evaluation stopped rather than score that as the agent's "
                                    "miss: fix the cause and run it again")
        latencies.append(result.metrics["latency_s"])
        ok = [b for b in result.branches if b.status == "ok"]
        ranking = doc_ranking(result.ranked_chunk_ids)
        trajectory = Trajectory(
            result.ranked_chunk_ids,
            list(dict.fromkeys(c for b in ok for c in b.retrieved_ids)),
            list(dict.fromkeys(c for b in ok for c in b.pruned_ids)),
            list(dict.fromkeys(c for b in ok for c in b.final_context_ids)),
            " ".join(c["text"] for d in result.evidence for c in d["chunks"]))
        metrics = single_shot_metrics(ranking, q.gold)
        metrics |= agent_measures(trajectory, q.gold, k, q.answer, absent)
        turns = sum(b.turns for b in ok)
        calls = sum(b.tool_calls for b in ok)
        metrics |= {
            "context_tokens_final": mean([b.context_tokens_final for b in ok]),
            "tokens_read": sum(b.tokens_read for b in ok), "turns": turns,
            "tool_calls": calls, "tool_calls_per_turn": calls / turns if turns else 0.0,
            "branches": len(result.branches), "branches_failed": len(result.branches) - len(ok),
            "forks": sum(b.kind == "fork" for b in result.branches),
            "chains": sum(b.kind == "chain" for b in result.branches),
            "bridges": sum(b.kind == "bridge" for b in result.branches),
            "covered": result.metrics.get("covered", 0)}
        text = ""
        if docstore is not None:
            text = " ".join(c["text"] for c in docstore.get_chunks(trajectory.retrieved).values())
        label, culprits = attribute(trajectory, q.gold, titles, text, k, absent)
        classes[label] += 1
        per_query.append({
            "id": q.id, "question": q.text, "gold": list(q.gold), "ranking": ranking[:10],
            "metrics": metrics, "attribution": label, "culprits": culprits,
            "terminations": [b.termination for b in ok],
            "context_tokens_per_turn": [b.context_tokens_per_turn for b in ok]})
        if progress:
            progress()
    metrics = _means(per_query)
    metrics["latency_ms_p50"] = round(percentile(latencies, 50) * 1000, 2)  # as single-shot's
    metrics["latency_ms_p90"] = round(percentile(latencies, 90) * 1000, 2)
    return {"config": f"{driver.settings.policy}{'' if driver.settings.prune else ' no-prune'}"
                      f" x{max_branches or driver.settings.branches}",
            "policy": driver.settings.policy, "prune": driver.settings.prune,
            "branches": max_branches or driver.settings.branches, "queries": len(queries),
            "metrics": metrics, "attribution": {c: classes.get(c, 0) for c in CLASSES},
            "per_query": per_query}


def _means(per_query: list[dict]) -> dict:
    names = dict.fromkeys(n for p in per_query for n in p["metrics"])
    return {n: round(mean([p["metrics"][n] for p in per_query if n in p["metrics"]]), 4)
            for n in names}


# two agent runs' latencies are not a fair ratio: the second reads what the first cached
SECOND_RUN_WARM = ("latency: the baseline ran second in this process and found the chunks' "
                   "token counts and words cached; bench/multi_branch_cost.py measures the "
                   "ratio in fresh processes")


def compare(agent: dict, baseline: dict, measure: str = "all_recall@5") -> dict:
    """Paired comparison on the same queries: differences per measure, wins and losses."""
    shared = [m for m in agent["metrics"] if m in baseline["metrics"]]
    diff = {m: round(agent["metrics"][m] - baseline["metrics"][m], 4) for m in shared}
    base = {p["id"]: p for p in baseline["per_query"]}
    table, wins, losses = [], 0, 0
    for p in agent["per_query"]:
        b = base.get(p["id"])
        if b is None:
            continue
        a_val, b_val = p["metrics"][measure], b["metrics"][measure]
        outcome = "win" if a_val > b_val else "loss" if a_val < b_val else "tie"
        wins += outcome == "win"
        losses += outcome == "loss"
        table.append({"id": p["id"], "agent": a_val, "baseline": b_val, "outcome": outcome})
    return {"measure": measure, "difference": diff, "wins": wins, "losses": losses,
            "ties": len(table) - wins - losses, "per_query": table}


# ---- orchestration: what `branchsearch eval` runs ----

# progress(total or None, unit, description) -> a bar with update(n) and close(done): done
# False when the work was stopped or failed (`cli.options.progress_bar`)
Progress = Callable[[int | None, str, str], object]


@dataclass(frozen=True)
class EvalOptions:
    """What one `eval` runs: the agent (`policy`) or single-shot `mode`, and an optional
    `baseline` beside it (`compare` alone means the hybrid baseline). Checked when made."""

    dataset: Path
    mode: Mode = "hybrid"
    policy: Policy | None = None
    baseline: Baseline | None = None
    compare: bool = False
    executor: Executor | None = None  # None: `execution.pick_executor` chooses
    limit: int | None = None
    split: Split = "test"
    ingest_first: bool = True  # ingest (or resume) the dataset when its index is not complete
    report: Path | None = None  # JSON report, and Markdown beside it
    plots: Path | None = None  # PNG plots into this folder

    def __post_init__(self):
        if self.mode not in MODES:
            raise BranchsearchError(f"unknown mode {self.mode!r}; use one of {', '.join(MODES)}")
        if self.compare and not self.policy:
            raise BranchsearchError("--compare needs --policy (the agent to compare)")
        baseline = self.baseline or ("hybrid" if self.compare else None)
        if baseline and baseline not in BASELINES:
            raise BranchsearchError(f"unknown baseline {baseline!r}: {', '.join(BASELINES)}")
        if baseline in ("no-prune", "heuristic", "one-branch") and not self.policy:
            raise BranchsearchError(f"--baseline {baseline} needs --policy")
        object.__setattr__(self, "baseline", baseline)


def dataset_index(dataset: Path) -> str:
    """The index `eval` uses for a dataset when none is named: its folder name, as a slug."""
    return "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in dataset.resolve().name)


def index_complete(settings: Settings) -> bool:
    """Whether the settings' index can be searched as it is (an external index always can)."""
    from branchsearch.infra.index.manifest import is_complete

    return getattr(settings, "external", None) is not None or is_complete(settings.index_dir)


def run_evaluation(settings: Settings, options: EvalOptions, *, acl_groups: list[str] | None = None,
                   progress: Progress | None = None,
                   say: Callable[[str], None] = lambda line: None) -> dict:
    """Ingest first if needed, run the evaluation and its baseline, compare them, write the
    report and plots; returns the report (`runs[0]` is the evaluated configuration)."""
    from branchsearch.infra.datasets.beir import read_queries
    from branchsearch.orchestrator.evaluation import report as rep

    if options.baseline == "one-branch" and settings.branches == 1:
        raise BranchsearchError("--baseline one-branch: the agent runs one branch already; "
                                "give it --branches 2 or more")
    notes: list[str] = []  # what the figures leave out, said and kept in the report
    queries = read_queries(options.dataset, options.split, notes)[:options.limit]
    check_questions(queries, options.dataset)
    if options.ingest_first and not index_complete(settings):  # missing or stopped: resume
        from branchsearch.infra.ingest.pipeline import ingest

        say(f"index {settings.index!r} missing or incomplete: ingesting {options.dataset}")
        with _bar(progress, None, "doc", "ingest") as tick:
            ingest(options.dataset, settings, progress=lambda docs, chunks: tick(docs))
    # (an index being ingested, or stopped midway, is the agent's open to refuse, by name)
    missing = missing_gold(settings, queries) if index_complete(settings) else ""
    if missing:
        notes.append(f"warning: {missing} of the gold documents are not in index "
                     f"{settings.index!r}; recall, all-recall and nDCG count them as misses "
                     "(as BEIR's evaluate counts them)" + (
                         "; the agent's diagnostics (trajectory_recall, precision, f1, "
                         "bridge_preserved) leave them out, and a query that missed only those "
                         "is attributed not_in_corpus" if options.policy else ""))
    for line in notes:
        say(line)
    runs = [_agent_run(s, queries, options.executor, acl_groups, progress) if mode is None
            else _single_shot_run(s, queries, mode, acl_groups, progress)
            for s, mode in _configurations(settings, options)]
    result = {"dataset": str(options.dataset), "split": options.split,
              "index": settings.index, "embedding": index_embedding(settings),
              "metrics": runs[0]["metrics"], "notes": notes, "runs": runs}
    if "attribution" in runs[0]:
        result["attribution"] = runs[0]["attribution"]
    if options.baseline:
        result["comparisons"] = [{"agent": runs[0]["config"], "baseline": runs[1]["config"],
                                  **compare(runs[0], runs[1])}]
        if "attribution" in runs[1]:  # two agent runs, one after the other in this process
            executors = runs[0].get("executor"), runs[1].get("executor")
            result["comparisons"][0]["note"] = SECOND_RUN_WARM + (
                "" if executors[0] == executors[1] else
                f"; and the agent ran on the {executors[0]} executor, the baseline on the "
                f"{executors[1]} one (one branch needs no cluster)")
    if options.plots:
        result["plots"] = rep.plots(result, {q.id: q.gold for q in queries}, options.plots)
    if options.report:
        rep.write_json(options.report, result)
        rep.write_report(options.report.with_suffix(".md"), rep.markdown(result))
    return result


def check_questions(queries: list[Query], dataset: Path) -> None:
    """Every question can be searched, whatever the mode: one that cannot (no words, only
    "???") is the dataset's error, named by its line, not a 0 in the means or a stop midway."""
    from branchsearch.workers.query import question_problem

    for q in queries:
        problem = question_problem(q.text, "the question")
        if problem:
            raise CorpusError(f"{Path(dataset) / 'queries.jsonl'}:{q.line}: query {q.id!r}: "
                              f"{problem}")


def missing_gold(settings: Settings, queries: list[Query]) -> str:
    """"3 of 250" when gold documents of `queries` are not in the owned index (a qrels line
    naming a document the corpus lacks, or another corpus's index): they can only be misses.
    None of them there is an error: the figures would be zeros that look like results. ""
    when all are there, or for an external index (no docstore to ask)."""
    from branchsearch.infra.stores.docstore import DocStore

    path = settings.index_dir / "docs.sqlite"
    if getattr(settings, "external", None) is not None or not path.exists():
        return ""
    gold = sorted({doc for q in queries for doc in q.gold})
    docstore = DocStore(path)
    try:
        found = docstore.present(gold)
    finally:
        docstore.close()
    if not gold or len(found) == len(gold):
        return ""
    if not found:
        raise CorpusError(f"none of the {len(gold):,} gold documents is in index "
                          f"{settings.index!r}: it holds another corpus (name the dataset's "
                          "index with --index, or a new name to ingest it)")
    return f"{len(gold) - len(found):,} of {len(gold):,}"


def _configurations(settings: Settings, options: EvalOptions
                    ) -> list[tuple[Settings, Mode | None]]:
    """(settings, single-shot mode or None for the agent) of the evaluated run and its baseline."""
    runs = [(settings, None if options.policy else options.mode)]
    if options.baseline == "no-prune":
        runs.append((settings.replace(prune=False), None))
    elif options.baseline == "heuristic":
        runs.append((settings.replace(policy="heuristic"), None))
    elif options.baseline == "one-branch":  # the single-context search: no second wave
        runs.append((settings.replace(branches=1), None))
    elif options.baseline:
        runs.append((settings, options.baseline))
    return runs


def _single_shot_run(settings: Settings, queries: list[Query], mode: Mode,
                     acl_groups: list[str] | None, progress: Progress | None) -> dict:
    from branchsearch.infra.index.open import open_retriever

    retriever = open_retriever(settings, need_dense=mode != "bm25")
    try:
        with _bar(progress, len(queries), "q", f"eval {mode}") as tick:
            return eval_single_shot(retriever, queries, mode, progress=tick,
                                    acl_groups=acl_groups)
    finally:
        retriever.close()


def _agent_run(settings: Settings, queries: list[Query], executor: Executor | None,
               acl_groups: list[str] | None, progress: Progress | None) -> dict:
    from branchsearch.infra.stores.docstore import DocStore
    from branchsearch.orchestrator.driver import open_driver
    from branchsearch.orchestrator.execution import pick_executor

    mode = pick_executor(settings, executor)
    driver = open_driver(settings, mode)
    # (an external index has no docstore: titles for attribution are not listed there)
    external = getattr(settings, "external", None)
    docstore = None if external else DocStore(settings.index_dir / "docs.sqlite")
    try:
        with _bar(progress, len(queries), "q", f"eval {settings.policy}") as tick:
            return eval_agent(driver, queries, docstore=docstore, progress=tick,
                              acl_groups=acl_groups) | {"executor": mode}
    finally:
        if docstore is not None:
            docstore.close()
        driver.close()


@contextmanager
def _bar(progress: Progress | None, total: int | None, unit: str,
         desc: str) -> Iterator[Callable[..., None]]:
    """`tick(n=1)` that advances a progress bar (none when `progress` is None), closed after:
    done when the work ended, not when it was stopped (^C) or failed."""
    bar = progress(total, unit, desc) if progress is not None else None
    done = False
    try:  # (not `if bar`: a tqdm bar of unknown total refuses bool())
        yield (lambda n=1: bar.update(n)) if bar is not None else (lambda n=1: None)
        done = True
    finally:
        if bar is not None:
            bar.close(done=done)
