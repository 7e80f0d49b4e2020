"""Text for a terminal: the one rule of how a control character in stored text, a title, an id
or a file's name is shown on a line a person reads.

What a document says may not drive the terminal. Titles and texts come from whatever was
ingested, file names from whatever folder was given; printed as they are, an ANSI/OSC escape
in them can clear the screen, recolour it, set the window title, write the clipboard or hide
a line. Such characters are kept in the index (form feeds and the like come from PDF
extraction) and shown, not dropped: each as its Python escape (`\\x1b`, `\\x07`, `\\u202e`),
so the reader sees that the text holds one and where, and what follows it reads as the plain
text it then is (`\\x1b[2J`). JSON output keeps the text as it is (JSON escapes control
characters itself).
"""

from __future__ import annotations

import re

# C0, DEL, C1, and the bidi overrides and isolates, which reorder what is shown around them
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
# the controls that lay text out (tab, line feed, carriage return, vertical tab, form feed):
# within one line, a break like a space's
LAYOUT = "\t\n\r\x0b\x0c"


def visible(text: object, keep: str = "\t\n") -> str:
    """`str(text)` with every control character but those in `keep` (tab and newline: a text
    keeps its lines) written as its escape: safe to print on a terminal."""
    return _CONTROLS.sub(lambda m: m[0] if m[0] in keep else ascii(m[0])[1:-1], str(text))


def one_line(text: object, width: int | None = None) -> str:
    """`text` on one line: the layout controls and every run of whitespace a single space, the
    other controls shown as their escapes (`visible`), cut to `width` characters."""
    line = " ".join(visible(text, keep=LAYOUT).split())
    return line if width is None else line[:width]
