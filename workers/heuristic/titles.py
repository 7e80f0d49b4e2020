"""Names and titles: whether a document title names an entity or a query, and a title's parts.

Pure functions, cached where the policy calls them for every chunk against every link. The
policy's scoring and the learned ranker's features share them.
"""

from __future__ import annotations

import re
from functools import lru_cache

from branchsearch.workers.text import (bare_title, fold, folded, has_phrase, norm_title,
                                       too_short)

# a title of at most this many words is a name (encyclopedia pages: 3 words at the median of
# hotpot's and musique's corpora, 5 at the 90th percentile), longer is a sentence (a paper's
# title: 12 at SciFact's median, 7 at its 10th percentile)
NAME_WORDS = 8

# a title that opens with a year or a season names one of a series: '1974 Texas Tech Red
# Raiders football team', '1995–96 Manchester United F.C. season'
LEADING_YEAR = re.compile(r"((?:1[0-9]|20)\d\d(?:[–-]\d{2,4})?)\s+\S")

NAMES_EXACTLY = 1.0  # `names`: the title is the entity
NAMES_NEARLY = 0.85  # `names`: one word more in the title, or a prefix more in the entity


@lru_cache(maxsize=65536)
def names(title: str, entity: str) -> float:
    """How well a document title names this entity: 1.0 exactly (after dropping a parenthetical
    qualifier and a leading article), 0.85 when the title adds one word ('Manchester United
    F.C.') or the entity adds a prefix ('Governor Nelson Rockefeller'), else 0."""
    t, e = strip_article(norm_title(title)), strip_article(folded(entity))
    if not t or too_short(e, 3):  # (東京 is a name: `too_short`)
        return 0.0
    if t == e:
        return NAMES_EXACTLY
    t_words, e_words = len(t.split()), len(e.split())
    if e_words >= 2 and t.startswith(e + " ") and t_words - e_words <= 1:
        return NAMES_NEARLY
    # 'Governor Nelson Rockefeller' names 'Nelson Rockefeller'; 'Esma Sultan Mansion' does not
    # name 'Esma Sultan'
    return NAMES_NEARLY if t_words >= 2 and e.endswith(" " + t) else 0.0


@lru_cache(maxsize=16384)
def words(text: str) -> frozenset[str]:
    return frozenset(re.findall(r"\w+", text))


@lru_cache(maxsize=16384)
def title_words(title: str) -> frozenset[str]:
    return frozenset(norm_title(title).split())


@lru_cache(maxsize=65536)
def word_overlap(title: str, entity: str) -> float:
    """Jaccard overlap of the words of a title and an entity ('International Boxing Council'
    vs 'International Boxing Federation': 0.5)."""
    t, e = title_words(title), set(folded(entity).split())
    return len(t & e) / len(t | e) if t and e and len(t) > 1 else 0.0


def title_qualifier(title: str) -> str:
    """The qualifier of a title: 'Kiss and Tell (1945 film)' -> '1945 film', 'Brown County,
    Kansas' -> 'Kansas', 'Ed Wood' -> ''."""
    m = re.search(r"\(([^)]*)\)\s*$", title)
    if m:
        return m.group(1)
    head, comma, tail = title.partition(",")
    if comma:
        return tail.strip()
    m = LEADING_YEAR.match(title)
    return m.group(1) if m else ""


def dashless(words) -> set[str]:
    """Words with those joined by a dash also split ('1992-93' -> '1992', '93')."""
    out = set(words)
    for w in words:
        if "-" in w:
            out.update(p for p in w.split("-") if p)
    return out


def series_core(title: str) -> str:
    """`norm_title` without a leading year: what the titles of one series share."""
    core = norm_title(title)
    m = LEADING_YEAR.match(core)
    return core[m.end(1):].strip() if m else core


def names_page(title: str, query: str) -> bool:
    """Whether the query names a page of a longer title (all its words are in the query). A
    proper name ('Siege of Cassel', two or more capitalised words) is named by its words,
    however the query writes them. A title with one capital ('Body water', 'Political party',
    a concept; 'Gila monster', 'Argand lamp', '2018 Kansas gubernatorial election', built on a
    name) is named when the query writes that word as a name too — capitalised, and not as its
    first word — or writes the whole title as the title does."""
    bare, query = fold(bare_title(title)), fold(query)
    capitals = [w for w in bare.split() if w[:1].isupper()]
    if len(capitals) >= 2:
        return True
    parts = query.split(None, 1)
    rest = parts[1] if len(parts) == 2 else ""  # the query past its first word
    return any(has_phrase(rest, w) for w in capitals) or has_phrase(query, bare)


def named_in(title: str, query: str) -> bool:
    """Whether the query writes a one-word title's word as the title does (capitalised)."""
    word = fold(bare_title(title))
    return bool(word) and has_phrase(fold(query), word)


def strip_article(text: str) -> str:
    return text[4:] if text.startswith("the ") else text


def in_query(entity: str, query: str) -> bool:
    return folded(entity) in folded(query)
