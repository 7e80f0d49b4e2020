"""The seams between the retriever and its backends: small protocols, no inheritance.

Both lexical backends (tantivy embedded, Elasticsearch by URL) satisfy `LexicalStore`; both dense
backends (Milvus Lite file, Milvus server) are one class, `infra.stores.milvus.MilvusStore`.

Every store returns its lists in one order (`settled`): by score compared at `SCORE_DIGITS`
significant digits, then by chunk id. The engines break ties by where a chunk sits in the index
(tantivy and Elasticsearch by document address, Milvus by segment and insertion order), which
changes with ingest order, `--workers` and re-ingest; the chunk id does not.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from branchsearch.infra.errors import BadQuery
from branchsearch.infra.stores.acl import PUBLIC
from branchsearch.infra.stores.hits import Hit


@dataclass(frozen=True)
class IndexedChunk:
    """What a store indexes for one chunk."""

    chunk_id: str
    doc_id: str
    title: str
    text: str
    acl: tuple[str, ...]

    @property
    def acl_terms(self) -> list[str]:
        return list(self.acl) or [PUBLIC]

    @property
    def body(self) -> str:
        return f"{self.title}\n{self.text}" if self.title else self.text


class LexicalStore(Protocol):
    def write(self, chunks: Sequence[IndexedChunk], delete_doc_ids: Sequence[str]) -> None:
        """Delete every chunk of `delete_doc_ids`, then index `chunks`; visible when it returns."""

    def search(self, query: str, k: int, exclude_ids: Sequence[str] = (),
               acl_groups: Sequence[str] | None = None) -> list[Hit]:
        """BM25 over title + text."""

    def grep(self, pattern: str, k: int, exclude_ids: Sequence[str] = (),
             acl_groups: Sequence[str] | None = None) -> list[Hit]:
        """Chunks with a term matching the regex `pattern` (see `check_pattern`)."""

    def count(self) -> int: ...

    def close(self) -> None: ...


_WORD = re.compile(r"\w+", re.UNICODE)


def query_words(query: str) -> list[str]:
    """The words of a free-text query; query-language syntax is never interpreted."""
    return _WORD.findall(query)


MAX_K = 1000  # the most hits one search may return (Milvus rejects > 16384; tantivy aborts at 1e11)


def check_k(k: int) -> int:
    """`k` within 0..MAX_K (0: nothing asked, an empty answer), else BadQuery."""
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_K:
        raise BadQuery(f"k must be an integer in 1..{MAX_K}, got {k!r}")
    return k


SCORE_DIGITS = 5  # digits at which two scores of one list are a tie (see `tie_score`)


def tie_score(score: float) -> float:
    """`score` as a list's order reads it before the chunk id: to `SCORE_DIGITS` significant
    digits, and to `SCORE_DIGITS` decimals below 1 (a cosine near 0 carries the same absolute
    noise as one near 1). Equal texts score equal, but not always bit for bit: a vector
    embedded in another batch (ingest order, `--workers`) differs by float noise (up to 1.8e-7
    in cosine, measured in reports/determinism.md), and exact comparison would let that noise
    order them. A grid cannot absorb every such pair (two values a hair either side of a
    rounding boundary still differ); at 1e-5 a pair 1e-7 apart straddles one about once in a
    hundred."""
    if score != score:  # NaN: after everything
        return float("-inf")
    if abs(score) < 1:
        return float(f"{score:.{SCORE_DIGITS}f}")
    return float(f"{score:.{SCORE_DIGITS}g}")


def ordered(hits: Sequence[Hit]) -> list[Hit]:
    """`hits` by `tie_score` (highest first), then chunk id; ranks renumbered 1..n."""
    out = sorted(hits, key=lambda h: (-tie_score(h.score), h.chunk_id))
    for rank, hit in enumerate(out, start=1):
        hit.rank = rank
    return out


def tie_margin(k: int) -> int:
    """How many hits beyond `k` a store asks for, so that a tie across the k-th place is seen
    whole in one request (see `settle`)."""
    return max(5, k // 5)


def settle(fetch: Callable[[int], list[Hit]], k: int, cap: int = MAX_K) -> list[Hit]:
    """The top `k` of a backend's list in `ordered` order, the same set whatever order the
    backend breaks ties in. `fetch(depth)` is the backend's own top `depth`.

    Asks for `k + tie_margin(k)`; when the k-th place ties (`tie_score`) with the last hit
    fetched, chunks the backend left out may belong to that tie, so it asks again deeper
    (twice as deep; straight to `cap` when the whole list is one tie, as a grep's constant
    scores are) until the tie ends inside the list, the backend has no more, or `cap` is
    reached (past `cap` hits in one tie, which of them are kept is the backend's choice). On an
    approximate index (HNSW, IVF) the backend's own list is already one of many possible."""
    depth = k + tie_margin(k)
    cap = max(cap, depth)
    while True:
        hits = fetch(depth)
        if len(hits) < depth or depth >= cap:
            break
        keys = sorted((tie_score(h.score) for h in hits), reverse=True)
        if keys[k - 1] > keys[-1]:
            break
        depth = cap if keys[0] == keys[-1] else min(cap, 2 * depth)
    return ordered(hits)[:k]


def settled(search):
    """A store's `search` / `grep(self, query, k, ...)` made to return `settle`'s list: the
    method is called with the depths `settle` asks for."""
    @functools.wraps(search)
    def wrapper(self, query, k: int, *args, **kwargs) -> list[Hit]:
        if not isinstance(k, int) or k <= 0:
            return search(self, query, k, *args, **kwargs)
        return settle(lambda depth: search(self, query, depth, *args, **kwargs), k)
    return wrapper


def check_pattern(pattern: str, max_len: int = 200) -> str:
    """Validate a grep pattern and return it lower-cased.

    Patterns match whole *terms* (lower-cased words), as Elasticsearch's `regexp` query does on a
    text field: `acme.*`, `19[0-9]{2}`, `colou?r`, `[^a]pple`. Both engines run regexes as finite
    automata, so no pattern can backtrack catastrophically; length is bounded and a few
    constructs that the engines do not share (anchors, lookaround, backreferences, classes like
    \\d) are rejected with a message that says what to use instead. `^` inside a bracket
    (`[^a]`, a negated class) and `$` inside a bracket are ordinary and allowed.
    """
    if not pattern or not pattern.strip():
        raise BadQuery("grep: empty pattern")
    if len(pattern) > max_len:
        raise BadQuery(f"grep: pattern longer than {max_len} characters")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise BadQuery(f"grep: invalid regex {pattern!r}: {exc}") from None
    problem = _unsupported(pattern)
    if problem:
        raise BadQuery(f"grep: {problem} not supported in {pattern!r}")
    return pattern.lower()


_ESCAPE_HINTS = {
    "d": "\\d (use [0-9])", "D": "\\D (use [^0-9])", "w": "\\w (use [a-z0-9_])",
    "W": "\\W (terms hold only word characters)", "s": "\\s (terms hold no spaces)",
    "S": "\\S (use .)", "b": "\\b (patterns match whole terms)",
    "B": "\\B (patterns match whole terms)", "A": "\\A (patterns match whole terms)",
    "Z": "\\Z (patterns match whole terms)", "z": "\\z (patterns match whole terms)",
}


def _unsupported(pattern: str) -> str | None:
    """The first construct the engines do not share, read as the regex parser reads it: an escape
    covers the next character, and inside a bracket `^` and `$` are not anchors."""
    i, in_class, class_start = 0, False, False
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            if nxt in _ESCAPE_HINTS:
                return _ESCAPE_HINTS[nxt]
            if nxt.isdigit() and nxt != "0" and not in_class:
                return "backreferences"
            i += 2
            continue
        if in_class:
            if ch == "]" and not class_start:
                in_class = False
            class_start = class_start and ch == "^" and pattern[i - 1] == "["
        elif ch == "[":
            in_class, class_start = True, True
        elif ch in "^$":
            return "anchors (patterns match whole terms)"
        elif ch == "(" and pattern[i + 1:i + 2] == "?":
            return "lookaround/flags"
        i += 1
    return None
