"""Anchored branch fusion: the question's own branch anchors the list; the other branches add
what they agree on and fill the tail. Pure; built on `fusion.rrf`.

Branches are not peers. The branch that searched the whole question ranked its chunks against
the whole question; an entity branch ranked its chunks against one entity and some of the
question's words, so its first chunks are about that entity whether or not the question needs
them. Plain RRF treats every branch's rank 1 alike, and on unseen questions the entity
branches' first chunks pushed gold evidence out of the fused top 5 ("overload").

    score(c) = w_a / (k + r_a(c))                   the anchor (the question's own branch)
             + share * sum_b w_b / (k + r_b(c))     the other branches, scaled by `share`
             + agreement * (n(c) - 1) / (k + 1)     n(c): lists that hold c, anchor included

`r_x(c)` is the 1-based rank of chunk c in list x (no term when absent). With a small `share`
an entity branch's chunk enters the top only when it ranks high there *and* the anchor or
another branch holds it too, or to fill places the anchor left empty; with `share = 1,
agreement = 0` this is the planner-weighted RRF the driver used before.

`head`: only the first `head` places are taken in that order; the places after them follow
plain weighted RRF (share 1) over what is left, so the other branches' finds fill the tail
(recall at 10) without reaching the head (all-recall at 5). `head=None`: one order throughout.

The driver fuses the branches' *document* rankings with it (`fusion.documents`); it takes any
hashable ids.

Tie-breaking (as in `fusion.rrf`, and stable): equal scores order by the best rank reached in
any list, then by the first list reaching it, then by id.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from branchsearch.fusion.rrf import FusedItem, rrf

# Fit on hotpotqa-dev200 (one run, 3 branches, heuristic policy, BM25 search), reported on
# musique-train100 and synth: reports/recall/README.md has the fit and how to redo it.
DEFAULT_SHARE = 0.2
DEFAULT_AGREEMENT = 0.0
DEFAULT_HEAD = 5


def anchored_rrf(
    rankings: Sequence[Sequence[Hashable]],
    *,
    weights: Sequence[float] | None = None,
    anchor: int | None = 0,
    k: float = 5,
    share: float = DEFAULT_SHARE,
    agreement: float = DEFAULT_AGREEMENT,
    head: int | None = DEFAULT_HEAD,
    limit: int | None = None,
) -> list[FusedItem]:
    """Fuse branch rankings with list `anchor` as the anchor (see the module docstring).

    `weights` are the planner's per-branch weights (default 1 each); `share` in [0, 1] scales
    every non-anchor list; `agreement` >= 0. Without an anchor (`None`, or an index outside the
    lists: the question's branch failed or was not planned) no list is scaled: plain weighted
    RRF plus the agreement term.
    """
    if not 0 <= share <= 1:
        raise ValueError(f"anchored_rrf: share must be in [0, 1], got {share}")
    if agreement < 0:
        raise ValueError(f"anchored_rrf: agreement must be >= 0, got {agreement}")
    weights = list(weights) if weights is not None else [1.0] * len(rankings)
    if len(weights) != len(rankings):
        raise ValueError(f"anchored_rrf: {len(weights)} weights for {len(rankings)} rankings")
    if anchor is None or not 0 <= anchor < len(rankings):
        share = 1.0
    scaled = [w if i == anchor else w * share for i, w in enumerate(weights)]
    fused = rrf(rankings, weights=scaled, k=k)
    if agreement:
        bonus = agreement / (k + 1)
        fused = sorted((FusedItem(f.id, f.score + bonus * (len(f.ranks) - 1), f.ranks)
                        for f in fused), key=_order)
    if head is not None and share < 1:
        top = fused[:head]
        taken = {f.id for f in top}
        rest = anchored_rrf(rankings, weights=weights, anchor=anchor, k=k, share=1.0,
                            agreement=agreement, head=None)
        fused = top + [f for f in rest if f.id not in taken]
    return fused[:limit] if limit is not None else fused


def _order(item: FusedItem) -> tuple:
    best = min(item.ranks.values())
    first = min(li for li, r in item.ranks.items() if r == best)
    return (-item.score, best, first, str(item.id))
