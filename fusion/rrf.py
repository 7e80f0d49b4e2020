"""Reciprocal rank fusion (Cormack, Clarke & Büttcher, SIGIR 2009), weighted.

    score(d) = sum_i  w_i / (k + rank_i(d))        rank_i starts at 1

Ties are decided in exact rational arithmetic (`fractions.Fraction`): two items whose scores are
equal as numbers tie even when their float sums differ in the last bit (with k = 5, ranks 5 and
10 give 1/10 + 1/15 = 1/6, the score of rank 1 alone, and the tie-break below decides). Weights
and k are read as the decimals they print as (a weight of 0.1 is exactly 1/10). For speed, items
are first ordered by float scores; only runs of items whose float scores lie within a relative
1e-9 of each other (`NEAR`, far above float rounding error) are re-ordered by their exact
scores, which gives the same order as sorting every item exactly. Their `FusedItem.score` is the
exact score rounded once, so reported scores never increase down the list.

Tie-breaking is documented and stable: equal scores are ordered by the best (lowest) rank the
item reached in any list, then by the index of the first list in which it reached that rank,
then by the item id (as a string). The result therefore never depends on dict or set iteration
order or on the order of floating-point additions.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

DEFAULT_K = 60
NEAR = 1e-9  # relative gap under which two float scores are compared exactly (float error ~1e-16)


@dataclass(frozen=True)
class FusedItem:
    """One fused item: its id, fused score, and its 1-based rank in each list that held it."""

    id: Hashable
    score: float
    ranks: dict[int, int] = field(default_factory=dict)  # list index -> rank (1-based)


def exact(number: float | int | Fraction) -> Fraction:
    """`number` as an exact fraction of the decimal it prints as (0.1 -> 1/10)."""
    if isinstance(number, (int, Fraction)):
        return Fraction(number)
    return Fraction(repr(float(number)))


@functools.lru_cache(maxsize=65536)
def _exact_sum(k: float, terms: tuple[tuple[float, int], ...]) -> Fraction:
    """sum of weight / (k + rank) over `terms` (weight, rank), exactly. (Cached: fused lists
    meet the same few ranks and weights again and again.)"""
    k_exact = exact(k)
    return sum((exact(w) / (k_exact + r) for w, r in terms), Fraction(0))


def rrf(
    rankings: Sequence[Sequence[Hashable]],
    *,
    weights: Sequence[float] | None = None,
    k: float = DEFAULT_K,
    limit: int | None = None,
) -> list[FusedItem]:
    """Fuse ranked lists of ids by weighted reciprocal rank fusion.

    A list may not repeat an id (the first occurrence counts, later ones are ignored).
    `weights` defaults to 1 per list; weights must be finite and >= 0, `k` finite and > 0.
    """
    if not 0 < k < float("inf"):
        raise ValueError(f"rrf: k must be finite and > 0, got {k}")
    if weights is None:
        weights = [1] * len(rankings)
    if len(weights) != len(rankings):
        raise ValueError(f"rrf: {len(weights)} weights for {len(rankings)} rankings")
    if not all(0 <= w < float("inf") for w in weights):
        raise ValueError("rrf: weights must be finite and >= 0")

    scores: dict[Hashable, float] = {}
    ranks: dict[Hashable, dict[int, int]] = {}
    for li, (ranking, weight) in enumerate(zip(rankings, weights)):
        for position, item in enumerate(ranking, start=1):
            seen = ranks.setdefault(item, {})
            if li in seen:
                continue
            seen[li] = position
            scores[item] = scores.get(item, 0.0) + weight / (k + position)

    # Floats order every pair whose scores differ by more than their rounding error; items within
    # NEAR of each other are ordered by their exact scores (equal ones by the tie-break).
    def exact_score(item: Hashable) -> Fraction:
        return _exact_sum(k, tuple(sorted((weights[li], r) for li, r in ranks[item].items())))

    def tie_break(item: Hashable) -> tuple:
        best_rank = min(ranks[item].values())
        first_list = min(li for li, r in ranks[item].items() if r == best_rank)
        return (best_rank, first_list, str(item))

    approx = sorted(scores, key=lambda item: -scores[item])
    fused: list[FusedItem] = []
    i = 0
    while i < len(approx) and (limit is None or len(fused) < limit):  # past it: lower scores
        j = i + 1
        while j < len(approx) and scores[approx[j - 1]] - scores[approx[j]] <= NEAR * scores[
                approx[j - 1]]:
            j += 1
        group = approx[i:j]
        if len(group) == 1:
            fused.append(FusedItem(group[0], scores[group[0]], ranks[group[0]]))
        else:
            exacts = {item: exact_score(item) for item in group}
            group.sort(key=lambda item: (-exacts[item], *tie_break(item)))
            fused.extend(FusedItem(item, float(exacts[item]), ranks[item]) for item in group)
        i = j
    return fused[:limit] if limit is not None else fused
