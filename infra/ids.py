"""Ids as people give and read them: which id names nothing one can see, and how an id is
written where a person reads it.

Ids compare exactly (as BEIR and every store compare them), so an id may hold a character
that does not show, and two ids that differ only by one are two ids. An id made only of such
characters (spaces, a zero-width space, a byte-order mark) shows as nothing: a reader cannot
tell it from an empty id, nor type it. It is refused where ids enter, as an empty one is:
a corpus's documents (ingest, the service's upload), a batch's questions, an eval's queries
and qrels (`id_problem`).
"""

from __future__ import annotations

import unicodedata

# letters and symbols that draw nothing: the Hangul fillers and the blank braille pattern
_BLANK = frozenset("\u115f\u1160\u3164\uffa0\u2800")


def shows(c: str) -> bool:
    """Whether character `c` draws something: not whitespace, a control or format character
    (zero-width space and joiners, byte-order mark, direction marks), a separator, a
    variation selector, the combining grapheme joiner or a blank filler."""
    if c.isspace() or c in _BLANK or c == "\u034f":
        return False
    if "\ufe00" <= c <= "\ufe0f" or "\U000e0100" <= c <= "\U000e01ef":
        return False
    return unicodedata.category(c) not in ("Cc", "Cf", "Zs", "Zl", "Zp")


def id_problem(value: str) -> str:
    """What makes `value` no id one can read, as the words after the id's field name ("is
    empty", "'\\u200b' has no character that shows"); "" when it has a character that shows."""
    if not value.strip():
        return "is empty"
    if not any(map(shows, value)):
        return f"{ascii(value)} has no character that shows"  # each escaped: none shows
    return ""


def shown_id(qid: str) -> str:
    """An id (a question's, a document's) for a line a person reads: as it is when every
    character shows, else quoted with Python's escapes (`'a\\nb'`, `'q1\\u200b'`), so that
    no control character reaches a terminal and two ids that differ only by one that does not
    show (a zero-width space, a byte-order mark, a newline) look different. Files keep ids
    exactly."""
    return qid if qid.isprintable() and qid == qid.strip() else repr(qid)
