"""Single-shot retrieval evaluation over a BEIR folder (agent evaluation builds on this)."""

from __future__ import annotations

import time
from collections.abc import Callable

from branchsearch.infra.dataset import Query
from branchsearch.infra.retriever import Retriever
from branchsearch.orchestrator.metrics import doc_ranking, mean, percentile, single_shot_metrics

# Chunks fetched per query so that at least 10 distinct documents survive collapsing.
CHUNK_DEPTH = 50


def eval_single_shot(retriever: Retriever, queries: list[Query], mode: str,
                     progress: Callable[[], None] | None = None,
                     acl_groups: list[str] | None = None) -> dict:
    per_query, latencies = [], []
    for q in queries:
        t = time.perf_counter()
        hits = retriever.search(q.text, mode=mode, k=CHUNK_DEPTH, acl_groups=acl_groups)
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
    return {"config": f"{mode} single-shot", "mode": mode, "queries": len(queries),
            "metrics": metrics, "per_query": per_query}


def eval_agent(driver, queries: list[Query], max_branches: int | None = None,
               progress: Callable[[], None] | None = None, docstore=None, k: int = 5,
               acl_groups: list[str] | None = None) -> dict:
    """Run the driver (one or more branch agents) per query, score the fused evidence and
    attribute each failure from what the branches did (see `orchestrator.attribution`)."""
    from collections import Counter

    from branchsearch.orchestrator.attribution import Trajectory, agent_measures, attribute

    titles = docstore.titles() if docstore is not None else {}
    per_query, latencies, classes = [], [], Counter()
    for q in queries:
        result = driver.search(q.text, max_branches=max_branches, acl_groups=acl_groups)
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
        metrics |= agent_measures(trajectory, q.gold, k, q.answer)
        turns = sum(b.turns for b in ok)
        calls = sum(b.tool_calls for b in ok)
        metrics |= {
            "context_tokens_final": mean([b.context_tokens_final for b in ok]),
            "tokens_read": sum(b.tokens_read for b in ok), "turns": turns,
            "tool_calls": calls, "tool_calls_per_turn": calls / turns if turns else 0.0,
            "branches": len(result.branches), "branches_failed": len(result.branches) - len(ok)}
        text = ""
        if docstore is not None:
            text = " ".join(c["text"] for c in docstore.get_chunks(trajectory.retrieved).values())
        label, culprits = attribute(trajectory, q.gold, titles, text, k)
        classes[label] += 1
        per_query.append({
            "id": q.id, "question": q.text, "gold": list(q.gold), "ranking": ranking[:10],
            "metrics": metrics, "attribution": label, "culprits": culprits,
            "terminations": [b.termination for b in ok],
            "context_tokens_per_turn": [b.context_tokens_per_turn for b in ok]})
        if progress:
            progress()
    metrics = _means(per_query)
    metrics["latency_s_p50"] = round(percentile(latencies, 50), 3)
    return {"config": f"{driver.settings.policy}{'' if driver.settings.prune else ' no-prune'}"
                      f" x{max_branches or driver.settings.branches}",
            "policy": driver.settings.policy, "prune": driver.settings.prune,
            "branches": max_branches or driver.settings.branches, "queries": len(queries),
            "metrics": metrics, "attribution": {c: classes.get(c, 0) for c in
                                                ("ok", "retrieval_miss", "premature_prune",
                                                 "early_stop", "overload")},
            "per_query": per_query}


def _means(per_query: list[dict]) -> dict:
    names = dict.fromkeys(n for p in per_query for n in p["metrics"])
    return {n: round(mean([p["metrics"][n] for p in per_query if n in p["metrics"]]), 4)
            for n in names}


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
