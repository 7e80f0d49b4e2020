"""Ids as people give and read them: which id names nothing one can see, and how an id is
written where a person reads it.

Ids compare exactly (as BEIR and every store compare them), so an id may hold a character
that does not show, and two ids that differ only by one are two ids. An id made only of such
characters (spaces, a zero-width space, a byte-order mark) shows as nothing: a reader cannot
tell it from an empty id, nor type it. It is refused where ids enter, as an empty one is:
a corpus's documents (ingest, the service's upload), a batch's questions, an eval's queries
and qrels (`id_problem`).

Every id a person gives is held to more (`hidden_character`): a document id at ingest and at
the service's upload, a batch's question id, an eval's query id and both ids of a qrels row.
No character that output does not show or that draws as another id's character, so two ids a
reader sees alike are one id, and a qrels row names only a document an ingest could hold.
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


# the joiners: invisible, yet part of how an emoji sequence (👩‍💻) or a word of a joining
# script (Persian, Devanagari) is written
_JOINERS = frozenset("\u200c\u200d")
_EMOJI_STYLE = "\ufe0f"  # the presentation selector: the emoji before it drawn as an emoji
# an emoji tag sequence: a base emoji, tag characters, the cancel tag (🏴 g b e n g, cancel: the
# flag of England); the tags draw nothing alone, yet together with their base draw one flag
_TAGS = frozenset(map(chr, range(0xE0020, 0xE0080)))
_CANCEL_TAG = "\U000e007f"


def hidden_character(doc_id: str) -> str:
    """What makes `doc_id` (or any id a person gives: a question's, a qrels row's) look like another
    id, as the words after "document id 'x'"; "" when nothing does. One rule by Unicode category: a
    control character (Cc) or a format character (Cf: zero-width space, byte-order mark, word
    joiner, soft hyphen, direction marks and overrides) is refused, since output shows it as nothing
    or reorders the id around it; a joiner (U+200C, U+200D) only between two non-ASCII characters,
    where it shapes an emoji or a joining script (an emoji's presentation selector, U+FE0F, may
    stand before it: 🏳️‍🌈), and a tag character (U+E0020…U+E007F) only within an emoji tag sequence,
    which spells a flag (England's). And a full-width ASCII letter or digit (U+FF10…, U+FF21…,
    U+FF41…) in an id that is otherwise ASCII or full-width is refused: it draws as its ASCII
    letter, so `ＭＥＭＯ` reads as the id `MEMO`. Beside CJK, where Japanese input writes them (`第１章`,
    `ＮＴＴドコモ`), they are kept: no ASCII id reads so."""
    for i, c in enumerate(doc_id):
        kind = unicodedata.category(c)
        if kind == "Cc":
            return (f"holds the control character U+{ord(c):04X}, which output would not "
                    "show")
        if kind == "Cf" and not (c in _JOINERS and _joins(doc_id, i)
                                 or c in _TAGS and _in_tag_sequence(doc_id, i)):
            return (f"holds the format character U+{ord(c):04X} "
                    f"({unicodedata.name(c, 'unnamed')}), which output would not show")
        if "\uff01" <= c <= "\uff5e" and c.isalnum() and _reads_as_ascii(doc_id):
            ascii_c = chr(ord(c) - 0xFEE0)
            return (f"holds the full-width {ascii_c!r} (U+{ord(c):04X}), which reads as the "
                    f"ASCII {ascii_c!r}; write {ascii_c!r}")
    return ""


def _reads_as_ascii(text: str) -> bool:
    """Whether every character of `text` is ASCII or a full-width form of ASCII (U+FF01…
    U+FF5E): the id reads as an ASCII id."""
    return all(c.isascii() or "\uff01" <= c <= "\uff5e" for c in text)


def _joins(text: str, i: int) -> bool:
    """Whether the joiner at `i` stands between two non-ASCII characters that show, the one
    before it maybe followed by its emoji presentation selector (U+FE0F: ❤️‍🔥)."""
    before = text[:i].removesuffix(_EMOJI_STYLE)
    return (bool(before) and i < len(text) - 1
            and all(not c.isascii() and shows(c) for c in (before[-1], text[i + 1])))


def _in_tag_sequence(text: str, i: int) -> bool:
    """Whether the tag character at `i` is one of a run of tags that follows a non-ASCII
    character that shows and ends with the cancel tag."""
    start = i
    while start > 0 and text[start - 1] in _TAGS and text[start - 1] != _CANCEL_TAG:
        start -= 1
    end = i
    while end < len(text) - 1 and text[end + 1] in _TAGS and text[end] != _CANCEL_TAG:
        end += 1
    return (start > 0 and not text[start - 1].isascii() and shows(text[start - 1])
            and text[end] == _CANCEL_TAG and end > start)


def shown_id(qid: str) -> str:
    """An id (a question's, a document's) for a line a person reads: as it is when every
    character shows, else quoted with Python's escapes (`'a\\nb'`, `'q1\\u200b'`), so that
    no control character reaches a terminal and two ids that differ only by one that does not
    show (a zero-width space, a byte-order mark, a newline) look different. Files keep ids
    exactly."""
    return qid if qid.isprintable() and qid == qid.strip() else repr(qid)
