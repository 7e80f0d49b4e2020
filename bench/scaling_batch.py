"""Batch throughput vs branch actors through Ray, and the agent's backend calls per question.

    python bench/scaling_batch.py --home /tmp/scale/home --index hotpot-bm25 \\
        --queries /work/shared/data/hotpotqa-dev200 [--n 40] [--actors 1 2 4] [--branches 1]
        [--replicas 1]

Throughput: `run_batch` (what `branchsearch batch` runs) over the same --n questions, once per
--actors value: a Ray executor whose branch pool holds that many actors and a batch concurrency
of actors / branches questions at once, each question planned into at most --branches
branches; wall time from the first question to the last row written (the pool and retriever
actors start before the clock starts). One warm-up question per configuration is not counted.

Calls: the same questions in-process (local executor, one branch) with the retriever's
`call_many` and the stores' searches counted: tool calls per question, and searches that reach
the dense store (what grows with the corpus; see bench/milvus_scaling.py). Counting needs no
lock; timing runs should run under `flock /tmp/team/bench.lock`.

Use a BM25-only index (`ingest --no-dense`, `search_mode = bm25`) to measure the orchestration
without query embedding; the calls count needs a dense index (or reports 0 dense searches).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from branchsearch.infra.datasets.beir import read_queries  # noqa: E402
from branchsearch.infra.config.settings import load_settings  # noqa: E402
from branchsearch.orchestrator.batch import run_batch  # noqa: E402
from branchsearch.orchestrator.driver import Driver  # noqa: E402


def throughput(settings, questions: list[str], actors: int, branches: int) -> dict:
    concurrency = max(actors // branches, 1)
    s = settings.replace(branches=branches, batch_concurrency=concurrency)
    driver = Driver(s, mode="ray", pool_size=actors)
    try:
        driver.search(questions[0], max_branches=branches)  # warm-up (not counted)
        out = Path(tempfile.mkdtemp(prefix="bench-batch-")) / "rows.jsonl"
        items = [(str(i), q) for i, q in enumerate(questions)]
        load_before = os.getloadavg()[0]
        started = time.perf_counter()
        counts = run_batch(items, out, lambda q: driver.search(q, max_branches=branches)
                           .to_dict(), concurrency=concurrency)
        wall = time.perf_counter() - started
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        lat = sorted(r["metrics"]["latency_s"] for r in rows if "metrics" in r)
        return {"actors": actors, "branches_per_question": branches,
                "concurrency": concurrency, "replicas": len(driver.executor.retrievers),
                "questions": len(questions), "ok": counts["ok"], "wall_s": round(wall, 2),
                "questions_per_s": round(len(questions) / wall, 2),
                "latency_p50_s": round(statistics.median(lat), 3) if lat else None,
                "load_before": round(load_before, 2),
                "load_after": round(os.getloadavg()[0], 2)}
    finally:
        driver.close()


def calls_per_question(settings, questions: list[str]) -> dict:
    """Tool calls and dense searches per question, in-process, one branch."""
    driver = Driver(settings.replace(branches=1), mode="local")
    retriever = driver.executor.retriever
    counts = {"call_many": 0, "requests": 0, "dense": 0, "lexical": 0}
    call_many = retriever.call_many

    def counted_call_many(requests):
        counts["call_many"] += 1
        counts["requests"] += len(requests)
        return call_many(requests)

    retriever.call_many = counted_call_many
    for name, store in (("dense", retriever.dense), ("lexical", retriever.lexical)):
        if store is not None:
            original = store.search

            def counted(*a, _orig=original, _name=name, **k):
                counts[_name] += 1
                return _orig(*a, **k)

            store.search = counted
    per_q = []
    try:
        for q in questions:
            before = dict(counts)
            driver.search(q, max_branches=1)
            per_q.append({k: counts[k] - before[k] for k in counts})
    finally:
        driver.close()
    return {k: round(statistics.mean(p[k] for p in per_q), 2) for k in counts} | {
        "questions": len(per_q),
        "requests_max": max(p["requests"] for p in per_q)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--home", required=True)
    ap.add_argument("--index", required=True)
    ap.add_argument("--queries", type=Path, required=True)
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--actors", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--branches", type=int, default=1)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--calls", action="store_true", help="count calls instead of timing")
    args = ap.parse_args()
    settings = load_settings(overrides={"home": args.home, "index": args.index,
                                        "retriever_replicas": args.replicas})
    questions = [q.text for q in read_queries(args.queries)][: args.n]
    print(f"host: {platform.node()}, {os.cpu_count()} cores; index {args.index}, "
          f"{len(questions)} questions, search_mode {settings.search_mode}, policy "
          f"{settings.policy}; load {os.getloadavg()}", flush=True)
    if args.calls:
        print(json.dumps(calls_per_question(settings, questions)), flush=True)
        return
    rows = []
    for actors in args.actors:
        rows.append(throughput(settings, questions, actors, args.branches))
        print(json.dumps(rows[-1]), flush=True)
    print("\n| branch actors | questions at once | replicas | questions/s | vs 1 | p50 s | "
          "load before/after |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['actors']} | {r['concurrency']} | {r['replicas']} | "
              f"{r['questions_per_s']} | {r['questions_per_s'] / rows[0]['questions_per_s']:.2f}x"
              f" | {r['latency_p50_s']} | {r['load_before']}/{r['load_after']} |")


if __name__ == "__main__":
    main()
