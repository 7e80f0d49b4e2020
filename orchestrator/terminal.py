"""Text for a terminal: what a document says may not drive the terminal.

Titles and texts come from whatever was ingested; printed as they are, an ANSI/OSC escape in them
can clear the screen, set the window title, write the clipboard or hide a line. `clean` removes
escape sequences, other control characters and bidirectional overrides; `--json` output keeps
the text as it is (JSON escapes control characters itself).
"""

from __future__ import annotations

import re

_ESCAPES = re.compile(
    r"\x1b\][^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"  # OSC ... BEL/ST (title, clipboard, links)
    r"|\x9d[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"  # 8-bit OSC
    r"|\x1b[P^_X][^\x1b\x9c]*(?:\x1b\\|\x9c)?"  # DCS / PM / APC / SOS strings
    r"|\x1b\[[0-?]*[ -/]*[@-~]?"  # CSI (colours, cursor moves, clear screen)
    r"|\x9b[0-?]*[ -/]*[@-~]?"  # 8-bit CSI
    r"|\x1b[ -/]*[0-~]?"  # other escapes (charset switches, RIS)
)
# C0 (but tab and newline), DEL, C1, and the bidi overrides/isolates that reorder what is shown
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def clean(text: object) -> str:
    """`text` as a string safe to print on a terminal (tabs and newlines kept)."""
    return _CONTROLS.sub("", _ESCAPES.sub("", str(text)))


def one_line(text: object, width: int | None = None) -> str:
    """`clean(text)` with whitespace runs collapsed to single spaces, cut to `width`."""
    line = " ".join(clean(text).split())
    return line if width is None else line[:width]
