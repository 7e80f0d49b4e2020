"""The one check of a question a user gives — the CLI, the driver, batch and the service ask it:
something to search for (a letter or a digit, in any script) that can be written as UTF-8 and
holds no control character but tab, newline and carriage return."""

from __future__ import annotations

import re

from branchsearch.infra.errors import BadQuery
from branchsearch.infra.nfc import nfc


def has_words(text: str) -> bool:
    """Whether `text` has anything to search for: a letter or a digit (any script). "?!?" has
    none: BM25 finds nothing in it and a dense search would answer with arbitrary neighbours."""
    return any(c.isalnum() for c in text)


def question_problem(text: object, what: str = "question") -> str:
    """Why `text` cannot be searched ("" when it can)."""
    if text is not None and not isinstance(text, str):  # 123 or a list from a JSON body
        kind = {bool: "true or false", int: "a number", float: "a number", list: "an array",
                dict: "an object"}.get(type(text), type(text).__name__)
        return f"{what} must be text, not {kind}"
    if not isinstance(text, str) or not text.strip():
        return f"empty {what}: give the words to search for"
    if not has_words(text):
        return f"{what} has no words to search for (only punctuation or symbols)"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # JSON's "\ud800" gives a string no store can hold
        return f"{what} is not valid Unicode text (it holds a lone surrogate such as \\ud800)"
    control = _CONTROL.search(text)
    if control:  # U+0000, a terminal's 8-bit ESC[ (U+009B) …: no text anyone means to search
        return (f"{what} holds the control character U+{ord(control.group()):04X}; send text "
                "(tab, newline and carriage return are fine)")
    return ""


# how a result's note begins when its question was longer than `query_max_tokens` and was
# searched by its first tokens (`Driver.search`; `batch` counts such rows)
QUESTION_CUT = "question cut from"
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")  # C0 but tab, LF, CR; DEL; C1


def check_question(text: object, what: str = "question") -> str:
    """`text` in Unicode NFC (`infra.nfc`: as the documents are stored and indexed, so
    `Zürich` typed decomposed finds them), or BadQuery saying why it cannot be searched."""
    problem = question_problem(text, what)
    if problem:
        raise BadQuery(problem)
    return nfc(text)  # type: ignore[arg-type]
