"""Admission to the fused top: a document that only the other branches found takes one of the
first places only when the question's own branch points to it. Pure; ids of any kind.

Anchored fusion (`fusion.anchored`) keeps the head for what the question's own branch (the
anchor) ranks or agrees on, but in the places after the head a second-wave branch's first
document at half weight ties the anchor's seventh, so two bridge branches take three or four of
places 6-10 — and on multi-hop questions the anchor's own gold stood in some of them. Which of
the two deserves the place is not visible to a rank rule; the text is. A later hop's page is
usually *named* in an earlier hop's page, while a look-alike the other branches drifted to is
not. So a **fresh** document (not among the anchor's own first `window`) keeps its place in the
first `window` only when `admitted(id)` — the driver's test: its title is written in the text
of the anchor's first documents (`orchestrator.result`). The others move below the `window`-th
place, their order kept; everything else keeps its order.

The driver holds only the second wave (bridges, chains, forks) to it: a first-wave branch
searched something the question itself names. Measured in reports/bridges.md ("v5 and v6").
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Sequence
from typing import TypeVar

T = TypeVar("T")


def admit(fused: Sequence[T], own: Collection[Hashable], admitted: Callable[[Hashable], bool],
          *, window: int = 10, key: Callable[[T], Hashable] = lambda item: item.id) -> list[T]:
    """`fused` with each fresh item (its `key` not in `own`) that is not `admitted` moved below
    the first `window` places."""
    kept: list[T] = []
    moved: list[T] = []
    for item in fused:
        if len(kept) >= window:
            break
        ident = key(item)
        (kept if ident in own or admitted(ident) else moved).append(item)
    return kept + moved + list(fused[len(kept) + len(moved):])
