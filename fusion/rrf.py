"""Reciprocal rank fusion (Cormack, Clarke & Büttcher, SIGIR 2009), weighted.

    score(d) = sum_i  w_i / (k + rank_i(d))        rank_i starts at 1

Tie-breaking is documented and stable: equal scores are ordered by the best (lowest) rank the
item reached in any list, then by the index of the first list in which it reached that rank,
then by the item id. The result therefore never depends on dict or set iteration order.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

DEFAULT_K = 60


@dataclass(frozen=True)
class FusedItem:
    """One fused item: its id, fused score, and its 1-based rank in each list that held it."""

    id: Hashable
    score: float
    ranks: dict[int, int] = field(default_factory=dict)  # list index -> rank (1-based)


def rrf(
    rankings: Sequence[Sequence[Hashable]],
    *,
    weights: Sequence[float] | None = None,
    k: float = DEFAULT_K,
    limit: int | None = None,
) -> list[FusedItem]:
    """Fuse ranked lists of ids by weighted reciprocal rank fusion.

    A list may not repeat an id (the first occurrence counts, later ones are ignored).
    `weights` defaults to 1 per list; weights must be >= 0 and `k` must be > 0.
    """
    if k <= 0:
        raise ValueError(f"rrf: k must be > 0, got {k}")
    if weights is None:
        weights = [1.0] * len(rankings)
    if len(weights) != len(rankings):
        raise ValueError(f"rrf: {len(weights)} weights for {len(rankings)} rankings")
    if any(w < 0 for w in weights):
        raise ValueError("rrf: weights must be >= 0")

    scores: dict[Hashable, float] = {}
    ranks: dict[Hashable, dict[int, int]] = {}
    for li, (ranking, weight) in enumerate(zip(rankings, weights)):
        for position, item in enumerate(ranking, start=1):
            seen = ranks.setdefault(item, {})
            if li in seen:
                continue
            seen[li] = position
            scores[item] = scores.get(item, 0.0) + weight / (k + position)

    def order(item: Hashable) -> tuple:
        best_rank = min(ranks[item].values())
        first_list = min(li for li, r in ranks[item].items() if r == best_rank)
        return (-scores[item], best_rank, first_list, str(item))

    fused = [FusedItem(item, scores[item], ranks[item]) for item in sorted(scores, key=order)]
    return fused[:limit] if limit is not None else fused
