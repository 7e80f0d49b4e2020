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


def eval_agent(retriever: Retriever, queries: list[Query], settings,
               progress: Callable[[], None] | None = None) -> dict:
    """Run one branch agent per query (in-process) and score its final evidence."""
    from workers.factory import make_policy
    from workers.harness import Episode

    per_query, latencies = [], []
    for q in queries:
        t = time.perf_counter()
        result = Episode(q.text, retriever, make_policy(settings), settings).run()
        latencies.append(time.perf_counter() - t)
        ranking = doc_ranking(result.ranked_chunk_ids)
        metrics = single_shot_metrics(ranking, q.gold)
        metrics |= {"context_tokens_final": result.context_tokens_final,
                    "context_tokens_max": max(result.context_tokens_per_turn or [0]),
                    "tokens_read": result.tokens_read, "turns": result.turns,
                    "tool_calls": result.tool_calls}
        per_query.append({"id": q.id, "ranking": ranking[:10], "metrics": metrics,
                          "termination": result.termination})
        if progress:
            progress()
    names = per_query[0]["metrics"].keys() if per_query else []
    metrics = {name: round(mean([p["metrics"][name] for p in per_query]), 4) for name in names}
    metrics["latency_s_p50"] = round(percentile(latencies, 50), 3)
    return {"policy": settings.policy, "prune": settings.prune, "queries": len(queries),
            "metrics": metrics, "per_query": per_query}
