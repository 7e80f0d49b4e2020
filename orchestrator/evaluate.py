"""Single-shot retrieval evaluation over a BEIR folder (agent evaluation builds on this)."""

from __future__ import annotations

import time
from collections.abc import Callable

from infra.dataset import Query
from infra.retriever import Retriever
from orchestrator.metrics import doc_ranking, mean, percentile, single_shot_metrics

# Chunks fetched per query so that at least 10 distinct documents survive collapsing.
CHUNK_DEPTH = 50


def eval_single_shot(retriever: Retriever, queries: list[Query], mode: str,
                     progress: Callable[[], None] | None = None) -> dict:
    per_query, latencies = [], []
    for q in queries:
        t = time.perf_counter()
        hits = retriever.search(q.text, mode=mode, k=CHUNK_DEPTH)
        latencies.append((time.perf_counter() - t) * 1000)
        ranking = doc_ranking([h.chunk_id for h in hits])
        per_query.append({"id": q.id, "ranking": ranking[:10],
                          "metrics": single_shot_metrics(ranking, q.gold)})
        if progress:
            progress()
    names = per_query[0]["metrics"].keys() if per_query else []
    metrics = {name: round(mean([p["metrics"][name] for p in per_query]), 4) for name in names}
    metrics["latency_ms_p50"] = round(percentile(latencies, 50), 2)
    metrics["latency_ms_p90"] = round(percentile(latencies, 90), 2)
    return {"mode": mode, "queries": len(queries), "metrics": metrics, "per_query": per_query}


def eval_agent(driver, queries: list[Query], max_branches: int | None = None,
               progress: Callable[[], None] | None = None) -> dict:
    """Run the driver (one or more branch agents) per query and score the fused evidence."""
    per_query, latencies = [], []
    for q in queries:
        result = driver.search(q.text, max_branches=max_branches)
        latencies.append(result.metrics["latency_s"])
        ok = [b for b in result.branches if b.status == "ok"]
        ranking = doc_ranking(result.ranked_chunk_ids)
        metrics = single_shot_metrics(ranking, q.gold)
        metrics |= {
            "context_tokens_final": mean([b.context_tokens_final for b in ok]),
            "context_tokens_max": mean([max(b.context_tokens_per_turn or [0]) for b in ok]),
            "tokens_read": sum(b.tokens_read for b in ok),
            "turns": sum(b.turns for b in ok), "tool_calls": sum(b.tool_calls for b in ok),
            "branches": len(result.branches), "branches_failed": len(result.branches) - len(ok)}
        per_query.append({"id": q.id, "ranking": ranking[:10], "metrics": metrics,
                          "terminations": [b.termination for b in ok]})
        if progress:
            progress()
    names = per_query[0]["metrics"].keys() if per_query else []
    metrics = {name: round(mean([p["metrics"][name] for p in per_query]), 4) for name in names}
    metrics["latency_s_p50"] = round(percentile(latencies, 50), 3)
    return {"policy": driver.settings.policy, "prune": driver.settings.prune,
            "branches": max_branches or driver.settings.branches, "queries": len(queries),
            "metrics": metrics, "per_query": per_query}
