"""Fusing chunk rankings by document. Pure; built on `fusion.anchored`.

Branches return chunks, but a document is the unit of evidence: two branches that return
different chunks of one document agree on that document. Fusing chunk ids would count them as
two items with no agreement (the question's 'Russian Civil War#p0' and an entity branch's '#p1'
once let the page fall out of the fused top 5). So each chunk ranking becomes a document
ranking — a document's place is that of its first chunk — and those are fused with
`anchored_rrf`. Each document keeps its chunks, the anchor's first, then by their best rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from branchsearch.fusion.anchored import DEFAULT_AGREEMENT, DEFAULT_SHARE, anchored_rrf
from branchsearch.fusion.rrf import FusedItem


def fuse_documents(
    rankings: Sequence[Sequence[str]],
    doc: Callable[[str], str],
    *,
    weights: Sequence[float] | None = None,
    anchor: int | None = 0,
    k: float = 5,
    share: float = DEFAULT_SHARE,
    agreement: float = DEFAULT_AGREEMENT,
    limit: int | None = None,
) -> tuple[list[FusedItem], dict[str, list[str]]]:
    """(the fused documents, best first — `FusedItem.ranks` are their places in each list —,
    each document's chunks: the anchor's first, then by the best rank any list gave them).
    `doc` maps a chunk id to its document id; the other arguments are `anchored_rrf`'s."""
    place: dict[str, tuple[bool, int]] = {}  # chunk -> its best (not the anchor's, rank)
    for li, ranking in enumerate(rankings):
        for rank, chunk in enumerate(ranking, start=1):
            best = (li != anchor, rank)
            place[chunk] = min(place.get(chunk, best), best)
    chunks: dict[str, list[str]] = {}
    for chunk in sorted(place, key=lambda c: (place[c], c)):
        chunks.setdefault(doc(chunk), []).append(chunk)
    documents = [list(dict.fromkeys(doc(c) for c in ranking)) for ranking in rankings]
    fused = anchored_rrf(documents, weights=weights, anchor=anchor, k=k, share=share,
                         agreement=agreement, limit=limit)
    return fused, chunks
