"""The user's text files: read line by line, with a clear error for bytes that are not UTF-8,
their JSON read with no key given twice; written (results, reports) where the path the user
named leads."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from branchsearch.infra.errors import BranchsearchError, CorpusError


def output_path(path: str | Path) -> Path:
    """The file to write for a path the user named as an output, which is replaced atomically
    (a temporary file renamed over it): through a symlink, its target (the link stays a link);
    never something that is not a regular file. A rename over `/dev/null` would put a plain
    file in its place for every program on the machine."""
    target = Path(os.path.realpath(path))
    if target.exists() and not target.is_file():
        kind = "a folder" if target.is_dir() else "not a regular file (a device or a pipe)"
        raise BranchsearchError(f"output {path} is {kind}: give the path of a file")
    return target


def utf8_lines(raw_lines: Iterable[bytes], name: str | Path) -> Iterator[tuple[int, str]]:
    """(line number, line) for each line of a file opened in binary mode (`path.open("rb")`).
    Bytes that are not UTF-8 raise CorpusError naming the file, the line and the byte offset; a
    UTF-8 byte-order mark at the start is dropped."""
    offset = 0
    for lineno, raw in enumerate(raw_lines, start=1):
        try:
            line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            bad = raw[exc.start:exc.start + 1]
            raise CorpusError(
                f"{name}:{lineno}: not UTF-8 text (byte {bad!r} at offset {offset + exc.start}); "
                f"convert the file to UTF-8, e.g. with {convert_command(raw)}") from None
        offset += len(raw)
        yield lineno, line


def convert_command(head: bytes) -> str:
    """The command that converts a file starting with `head` to UTF-8: from UTF-16 when it
    starts with that byte-order mark (Windows PowerShell's `>` writes it), else from latin-1
    (which would turn UTF-16 into text with a NUL between letters: found by no search)."""
    source = "utf-16" if head.startswith((b"\xff\xfe", b"\xfe\xff")) else "latin1"
    return f"`iconv -f {source} -t utf-8`"


class KeyTwice(ValueError):
    """A JSON object that names one key twice (`{"_id": "a", "_id": "b"}`): which value counts
    would be the parser's choice (Python's keeps the last), so the input is refused."""

    @property
    def key(self) -> str:
        return self.args[0]

    def __str__(self) -> str:
        return f"the key {repr(self.key)[:80]} is given twice in one object: give it once"


def json_once(text: str | bytes):
    """`json.loads(text)` for JSON a user wrote (a corpus or questions line, a request body):
    an object that names a key twice, at any depth, raises KeyTwice (a ValueError). A line's
    end is not parsed: a line cut inside a string is an unterminated string, not one holding
    a control character (the newline)."""
    if isinstance(text, bytes):  # a body: in whichever encoding JSON allows (UTF-16 too)
        text = text.decode(json.detect_encoding(text), "surrogatepass")
    return json.loads(text.rstrip("\r\n"), object_pairs_hook=_once_each)


def key_twice_element(text: str) -> int | None:
    """Which element of the JSON array `text` (counting from 1) names a key twice, at any
    depth: `json_once` refuses the whole array without saying. None when none does, or
    `text` is not an array."""
    decoder, space = json.JSONDecoder(object_pairs_hook=_once_each), json.decoder.WHITESPACE
    text = text.lstrip()
    if not text.startswith("["):
        return None
    at, n = space.match(text, 1).end(), 0
    while at < len(text) and text[at] != "]":
        n += 1
        try:
            _, at = decoder.raw_decode(text, at)
        except KeyTwice:
            return n
        except (ValueError, RecursionError):
            return None
        at = space.match(text, at).end()
        if text.startswith(",", at):
            at = space.match(text, at + 1).end()
    return None


def _once_each(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise KeyTwice(key)
        out[key] = value
    return out
