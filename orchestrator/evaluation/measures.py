"""Retrieval metrics over document rankings. Pure functions, hand-checked in tests.

Qrels label documents, so a ranking of chunks is first collapsed to documents: a document ranks
at the position of its best chunk (`doc_ranking`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from branchsearch.infra.ingest.chunking import split_chunk_id


def doc_ranking(chunk_ids: Sequence[str]) -> list[str]:
    """Distinct document ids in order of their first (best) chunk."""
    return list(dict.fromkeys(split_chunk_id(c)[0] for c in chunk_ids))


def recall_at(ranking: Sequence[str], gold: Mapping[str, int], k: int) -> float:
    """Share of gold documents in the top k."""
    if not gold:
        return 0.0
    top = set(ranking[:k])
    return sum(1 for g in gold if g in top) / len(gold)


def all_recall_at(ranking: Sequence[str], gold: Mapping[str, int], k: int) -> float:
    """1.0 when every gold document is in the top k, else 0.0."""
    return float(bool(gold) and set(gold) <= set(ranking[:k]))


def ndcg_at(ranking: Sequence[str], gold: Mapping[str, int], k: int = 10) -> float:
    """nDCG@k with graded gains (the BEIR / trec_eval convention: gain = grade, log2(i+1))."""
    dcg = sum(gold.get(d, 0) / math.log2(i + 2) for i, d in enumerate(ranking[:k]))
    ideal = sorted(gold.values(), reverse=True)[:k]
    idcg = sum(g / math.log2(i + 2) for i, g in enumerate(ideal))
    return dcg / idcg if idcg else 0.0


def single_shot_metrics(ranking: Sequence[str], gold: Mapping[str, int]) -> dict[str, float]:
    out = {f"recall@{k}": recall_at(ranking, gold, k) for k in (2, 5, 10)}
    out |= {f"all_recall@{k}": all_recall_at(ranking, gold, k) for k in (2, 5, 10)}
    out["ndcg@10"] = ndcg_at(ranking, gold, 10)
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]; 0.0 for no values."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0
