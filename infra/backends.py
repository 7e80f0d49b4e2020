"""The seams between the retriever and its backends: small protocols, no inheritance.

Both lexical backends (tantivy embedded, Elasticsearch by URL) satisfy `LexicalStore`; both dense
backends (Milvus Lite file, Milvus server) are one class, `infra.dense.MilvusStore`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from branchsearch.infra.errors import BadQuery
from branchsearch.infra.hits import Hit

PUBLIC = "__public__"  # the ACL group of documents without an ACL


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


def acl_terms(groups: Sequence[str] | None) -> list[str] | None:
    """Groups a caller may see (public included); None means no ACL filter (trusted caller)."""
    return None if groups is None else [PUBLIC, *groups]


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


def check_pattern(pattern: str, max_len: int = 200) -> str:
    """Validate a grep pattern and return it lower-cased.

    Patterns match whole *terms* (lower-cased words), as Elasticsearch's `regexp` query does on a
    text field: `acme.*`, `19[0-9]{2}`, `colou?r`. Both engines run regexes as finite automata, so
    no pattern can backtrack catastrophically; length is bounded and a few constructs that the
    engines do not share (anchors, lookaround, backreferences, classes like \\d) are rejected
    with a message that says what to use instead.
    """
    if not pattern or not pattern.strip():
        raise BadQuery("grep: empty pattern")
    if len(pattern) > max_len:
        raise BadQuery(f"grep: pattern longer than {max_len} characters")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise BadQuery(f"grep: invalid regex {pattern!r}: {exc}") from None
    for bad, hint in (("(?", "lookaround/flags"), ("^", "anchors (patterns match whole terms)"),
                      ("$", "anchors (patterns match whole terms)"), ("\\d", "\\d (use [0-9])"),
                      ("\\w", "\\w (use [a-z0-9_])"), ("\\s", "\\s (terms hold no spaces)"),
                      ("\\b", "\\b (patterns match whole terms)")):
        if bad in pattern:
            raise BadQuery(f"grep: {hint} not supported in {pattern!r}")
    if re.search(r"\\[1-9]", pattern):
        raise BadQuery(f"grep: backreferences not supported in {pattern!r}")
    return pattern.lower()
