"""Covered branches: a planned branch whose entities the question's own branch already ranks.

The planner splits a question before anything is searched: a comparison into one branch per
compared entity, a compound question into one per clause. The question's own branch searches
every entity the question names, and it often ranks each entity's document among its first
few documents. A branch about those entities then has nothing to add at the head of the fused
list (`fusion.anchored` keeps the head in the anchor's order unless another list agrees, and
an entity branch agrees with the anchor on that very document): it is *covered*, and the
driver does not fuse it — and, where branches run one after another, does not run it.

    covered(names, anchor) = names is not empty, and each name is the title core of one of the
                             anchor's first `head` documents

A title's core is its words before a parenthesised qualifier, casefolded, accents and a leading
article dropped ("Kiss and Tell (1945 film)" -> kiss and tell; "the Laleli Mosque" -> laleli
mosque; "İstanbul" -> istanbul); a name matches a core with exactly its words. A qualified
title covers the bare name ("Ed Wood (film)" covers Ed Wood): on the sets measured that never
cost recall, since the anchor's head holds the person's page too when the question needs it. A sub-query that names
nothing (a clause of common words) is never covered: the rule decides only what it can see.
Pure: the driver and the offline evaluation (reports/cover/) call the same function.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Sequence

from branchsearch.fusion.anchored import DEFAULT_HEAD

_WORD = re.compile(r"\w+")
_ARTICLES = ("the", "a", "an")


def core(title: str) -> tuple[str, ...]:
    """The words of a title before its parenthesised qualifier, casefolded and without accents
    (however the text was composed: "Café", "Cafe\u0301" and "CAFE" are one word), without a
    leading article."""
    bare = "".join(ch for ch in unicodedata.normalize("NFKD", title.split(" (", 1)[0])
                   if not unicodedata.combining(ch))
    words = tuple(_WORD.findall(bare.casefold()))
    return words[1:] if len(words) > 1 and words[0] in _ARTICLES else words


def head_titles(ranked: Iterable[tuple[str, str]], head: int = DEFAULT_HEAD) -> list[str]:
    """The titles of the first `head` distinct documents of a ranking of (doc_id, title)."""
    seen: dict[str, str] = {}
    for doc_id, title in ranked:
        if doc_id not in seen:
            seen[doc_id] = title
            if len(seen) == head:
                break
    return list(seen.values())


def covered_by(anchor, names: Sequence[str], head: int = DEFAULT_HEAD
               ) -> list[tuple[str, str]] | None:
    """The documents of the question's branch (`anchor`, a `BranchReport`) that cover `names`,
    each as (title, the chunk id it ranked first); None when they are not covered or the
    anchor is not the question's branch or failed."""
    if anchor.kind != "original" or anchor.status != "ok":
        return None
    first: dict[str, str] = {}  # title -> the first chunk the anchor ranked of that title
    for c in anchor.evidence:
        first.setdefault(c["title"], c["chunk_id"])
    titles = covering(names, head_titles(((c["doc_id"], c["title"]) for c in anchor.evidence),
                                         head))
    return None if titles is None else [(t, first[t]) for t in titles]


def covering(names: Sequence[str], titles: Sequence[str]) -> list[str] | None:
    """The titles that cover `names`, one per name in order; None when a name has none (or
    there are no names)."""
    if not names:
        return None
    cores = {core(t): t for t in reversed(titles)}  # the first title of a core wins
    found = [cores.get(core(name)) for name in names]
    return None if any(t is None for t in found) else found  # type: ignore[return-value]
