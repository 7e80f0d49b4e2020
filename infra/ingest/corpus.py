"""Reading a corpus: a BEIR folder, a JSONL file, or a folder of .txt/.md files.

Every input is fully validated before anything is written, so a malformed line stops an ingest
with its file and line number and the index stays as it was.
"""

from __future__ import annotations

import json
import os
import re
import sys
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from branchsearch.infra.stores.acl import (ACL_ALL, MAX_DOC_GROUPS, PUBLIC, group_name,
                                           group_problem)
from branchsearch.infra.errors import CorpusError
from branchsearch.infra.ids import hidden_character, id_problem
from branchsearch.infra.nfc import nfc
from branchsearch.infra.terminal import visible
from branchsearch.infra.textfile import KeyTwice, convert_command, json_once, utf8_lines

_ID_OK = re.compile(r"[^\s#]+")  # fullmatch: "a\n" is refused (`$` would match before the \n)
# other spellings of the ACL field ("ACL", "acl-groups"): refused when they hold group names,
# not kept as metadata. Other fields ("groups", "acl_id" of the ACL Anthology) are metadata.
_ACL_SPELLINGS = {"acl", "acls", "acl_groups", "acl-groups", "aclgroups", "acl_group",
                  "acl-group"}
TEXT_SUFFIXES = (".txt", ".md", ".markdown")  # of a folder's files, in any case (".TXT")
# a document id's longest in UTF-8: its chunk ids ("{id}#p{n}") stay within Elasticsearch's
# 512-byte `_id` (a Milvus server's `chunk_id` holds 1,024); tantivy and Milvus Lite hold any
MAX_ID_BYTES = 500


@dataclass(frozen=True)
class Document:
    id: str
    title: str
    text: str
    source: str = ""
    date: str = ""
    acl: tuple[str, ...] = ()  # empty: visible to everyone
    meta: dict = field(default_factory=dict, compare=False)


def read_corpus(path: str | Path) -> list[Document]:
    """All documents of `path`, validated; raises CorpusError naming the first bad input."""
    path = Path(path)
    if not path.exists():
        raise CorpusError(f"corpus not found: {path}")
    try:
        if path.is_dir() and (path / "corpus.jsonl").exists():
            docs = list(_read_jsonl(path / "corpus.jsonl"))
        elif path.is_dir():
            docs = list(_read_text_folder(path))
        elif path.suffix.lower() in (".jsonl", ".json"):  # ".JSONL" as a folder's ".TXT"
            docs = list(_read_jsonl(path))
        else:
            raise CorpusError(f"{path}: expected a BEIR folder, a .jsonl file or a folder of "
                              ".txt/.md")
    except OSError as exc:  # a folder named corpus.jsonl, a file this user may not read
        raise CorpusError(f"cannot read {exc.filename or path}: {exc.strerror or exc}") from None
    return _unique(docs, str(path))


def parse_jsonl(text: str, name: str = "body", *, elements: int | None = None
                ) -> list[Document]:
    """The documents of JSONL `text` held in memory (an upload), validated as a corpus file is;
    CorpusError names `name:line`. `elements`: `text` holds the elements of a JSON array, one
    a line, that many; an error then names `name element N of M` (N counting from 1), since
    the caller's body has no such lines."""
    docs = list(_documents(enumerate(text.split("\n"), 1), name, "body.jsonl", elements))
    return _unique(docs, name)


def _unique(docs: list[Document], name: str) -> list[Document]:
    if not docs:
        raise CorpusError(f"{name}: no documents found")
    seen: dict[str, Document] = {}
    for doc in docs:
        first = seen.setdefault(doc.id, doc)
        if first is not doc:  # two files of a folder can make one id ("a b.txt", "a_b.txt")
            both = f" ({first.source} and {doc.source})" if first.source != doc.source else ""
            raise CorpusError(f"{name}: duplicate document id {doc.id!r}{both}"
                              f"{_forms(first.source, doc.source)}")
    return docs


def _read_jsonl(path: Path) -> Iterator[Document]:
    with path.open("rb") as f:  # bytes that are not UTF-8 stop with file, line and offset
        yield from _documents(utf8_lines(f, path), str(path), None)


def _documents(lines, name: str, source: str | None,
               elements: int | None = None) -> Iterator[Document]:
    """Documents from (line number, line) pairs; `source`: the default source field (None:
    the file's name); `elements`: the lines are a JSON array's elements, that many (errors
    name the element)."""
    seen: dict[str, tuple[int, str]] = {}  # id -> its first line, and the id as written
    for lineno, line in lines:
        if not line.strip():
            continue
        where = f"{name}:{lineno}" if elements is None else \
            f"{name} element {lineno} of {elements}"
        if elements is None and not seen and line.lstrip().startswith("["):
            raise CorpusError(f"{where}: a JSON array; write one JSON object a line (JSONL), "
                              "e.g. with `jq -c '.[]'`")
        try:
            row = json_once(line)
        except KeyTwice as exc:  # {"_id": "a", "_id": "b"}: which one is the id?
            raise CorpusError(f"{where}: {exc}") from None
        except (ValueError, RecursionError) as exc:  # a 5,000-digit number is a ValueError
            raise CorpusError(f"{where}: not valid JSON ({json_problem(exc)})") from None
        if not isinstance(row, dict):
            raise CorpusError(f"{where}: expected a JSON object")
        doc_id = _first(row, "_id", "id")
        if doc_id is None or str(doc_id).strip() == "":
            raise CorpusError(f"{where}: missing document id ('_id' or 'id')")
        if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)):
            # true would be "True", 1.0 "1.0", NaN "nan": not the id a qrels line names
            raise CorpusError(f"{where}: document id must be a string or a whole number, not "
                              f"{json.dumps(doc_id)[:40]}")
        if row.get("text") is None:  # a title alone is a document (its text empty)
            row = {**row, "text": ""}
        if isinstance(row.get("date"), int) and not isinstance(row["date"], bool):
            row = {**row, "date": str(row["date"])}  # a year, as exports write it
        for field_name in ("text", "title", "date", "source"):
            if row.get(field_name) is not None and not isinstance(row[field_name], str):
                raise CorpusError(f"{where}: {field_name!r} must be a string, not "
                                  f"{json.dumps(row[field_name], default=str)[:40]}")
        doc = _document(str(doc_id), row, where, source=str(row.get(
            "source") or source or Path(name).name))
        first = seen.setdefault(doc.id, (lineno, str(doc_id)))
        if first[0] != lineno:
            raise CorpusError(f"{where}: duplicate document id {doc.id!r} (first "
                              f"{'on line' if elements is None else 'as element'} {first[0]})"
                              f"{_forms(first[1], str(doc_id))}")
        yield doc


def _document(doc_id: str, row: dict, where: str, source: str) -> Document:
    doc_id = document_id(doc_id)
    problem = id_problem(doc_id)  # (an empty one, or all spaces, is a missing id: said before)
    if problem:  # "\u200b": a document every listing shows as nothing
        raise CorpusError(f"{where}: document id {problem}")
    if not _ID_OK.fullmatch(doc_id):
        raise CorpusError(f"{where}: document id {doc_id!r} may not contain whitespace or '#'")
    size = len(doc_id.encode("utf-8", "surrogatepass"))
    if size > MAX_ID_BYTES:  # a server would refuse it mid-ingest, the index left incomplete
        raise CorpusError(f"{where}: document id {doc_id[:40]!r}… is {size:,} bytes long in "
                          f"UTF-8; ids are at most {MAX_ID_BYTES} (Elasticsearch keeps no "
                          "longer)")
    if doc_id in (".", ".."):  # a URL path drops it: the service could never delete it
        raise CorpusError(f"{where}: document id {doc_id!r} is a path step, not a name")
    hidden = hidden_character(doc_id)
    if hidden:  # shown as nothing ("nul\0x" prints as "nulx"), reordered, or as another id
        raise CorpusError(f"{where}: document id {doc_id!r} {hidden}")
    _one_of(row, ("_id", "id"), where)
    _one_of(row, ("acl", "acl_groups"), where)
    lookalike = next((k for k, v in row.items() if k not in ("acl", "acl_groups")
                      and k.casefold() in _ACL_SPELLINGS and _names(v)), None)
    if lookalike is not None:  # kept as metadata, it would publish a document meant for a group
        raise CorpusError(f"{where}: field {lookalike!r} is not read as the document's groups; "
                          "write \"acl\": [\"group\", ...]")
    acl = _first(row, "acl", "acl_groups") or ()  # null: as when absent
    if isinstance(acl, str):  # one group; "finance,hr" would be one group nobody can hold
        if "," in acl:
            fix = json.dumps([g.strip() for g in acl.split(",") if g.strip()], ensure_ascii=False)
            raise CorpusError(f"{where}: 'acl' is the string {json.dumps(acl, ensure_ascii=False)}"
                              f"; give the groups as a list: \"acl\": {fix}")
        acl = (acl,)
    if not isinstance(acl, (list, tuple)) or not all(isinstance(g, str) for g in acl):
        raise CorpusError(f"{where}: 'acl' must be a list of group names")
    if len(acl) > MAX_DOC_GROUPS:  # a Milvus server refuses the row mid-ingest
        raise CorpusError(f"{where}: 'acl' names {len(acl)} groups; a document names at most "
                          f"{MAX_DOC_GROUPS}")
    if any(not g.strip() for g in acl):  # "" would match no caller's group: admins only
        raise CorpusError(f"{where}: 'acl' group names may not be empty")
    comma = next((g for g in acl if "," in g), None)
    if comma is not None:  # a caller's `--acl` and a key's groups read "a,b" as two groups
        fix = json.dumps([g.strip() for g in comma.split(",") if g.strip()], ensure_ascii=False)
        raise CorpusError(f"{where}: 'acl' group {json.dumps(comma, ensure_ascii=False)} holds "
                          f"a comma: give each group as its own list item, e.g. \"acl\": {fix}")
    acl = tuple(group_name(g) for g in acl)  # as a caller's: " hr" is "hr", NFD café is NFC
    problem = next(filter(None, map(group_problem, acl)), "")
    if problem:
        raise CorpusError(f"{where}: {problem}")
    if ACL_ALL in acl:  # it would read as "everyone" but mean "admins only"
        raise CorpusError(f"{where}: 'acl' may not name {ACL_ALL!r} (reserved: {ACL_ALL!r} in a "
                          "caller's groups sees every document); leave 'acl' empty for a "
                          "document everyone may see")
    if PUBLIC in acl:
        raise CorpusError(f"{where}: 'acl' may not name {PUBLIC!r} (reserved: the group of the "
                          "documents without an ACL); leave 'acl' empty for a document everyone "
                          "may see")
    for name, value in (("id", doc_id), ("title", row.get("title")), ("text", row["text"]),
                        *(("acl", g) for g in acl)):
        if isinstance(value, str) and not _utf8(value):  # JSON's "\ud800": no store holds it
            raise CorpusError(f"{where}: {name!r} holds a lone surrogate (an escape such as "
                              "\\ud800 that is no character); fix the text")
    for name in ("title", "text"):
        at = str(row.get(name) or "").find("\x00")
        if at >= 0:  # stored, it would end the text early in a C reader, or print as nothing
            raise CorpusError(f"{where}: document {doc_id!r}: {name!r} holds a NUL character "
                              f"(U+0000) at character {at + 1}; remove it")
    if not str(row.get("title") or "").strip() and not row["text"].strip():
        # nothing a search could match: an empty chunk, whose vector is noise in dense results
        raise CorpusError(f"{where}: document {doc_id!r} has no text and no title; give it a "
                          "text or leave it out")
    known = {"_id", "id", "title", "text", "source", "date", "acl", "acl_groups"}
    return Document(  # title and text in NFC, as the id: what the stores index and queries
        id=doc_id,    # (also NFC, `infra.nfc`) look for; the docstore keeps the same form
        title=nfc(str(row.get("title") or "")),
        text=nfc(row["text"]),
        source=source,
        date=str(row.get("date") or ""),
        acl=tuple(acl),
        meta={k: v for k, v in row.items() if k not in known},
    )


def document_id(doc_id: str) -> str:
    """A document's id as an index holds it: Unicode NFC. Ids that differ only in Unicode form
    (`café` typed on macOS is NFD: `e` and a combining accent) are one id, shown alike: one
    document, whichever form a corpus, an upload or a caller writes it in. Every id enters an
    index through here (`_document`); an index an earlier version wrote may hold an id as it
    was typed (`DocStore.stored_ids` finds it, and a write replaces it)."""
    return nfc(doc_id)


def id_forms(doc_id: str) -> tuple[str, ...]:
    """`doc_id` as given, its NFC form (how ingest writes ids) and its NFD form (how an
    earlier version kept an id typed decomposed), each once: what a delete clears from the
    search stores when the docstore holds none of them
    (`orchestrator.service.documents.delete`)."""
    return tuple(dict.fromkeys((doc_id, document_id(doc_id),
                                unicodedata.normalize("NFD", doc_id))))


def _forms(first: str, other: str) -> str:
    """The note for two spellings of one id (or of the file names that made it) that differ
    only in Unicode form."""
    same = first != other and document_id(first) == document_id(other)
    return " (the same id in another Unicode form: one NFC spelling)" if same else ""


def _first(row: dict, *names: str):
    """The first of `names` that `row` gives a value (null is no value)."""
    return next((row[n] for n in names if row.get(n) is not None), None)


def _names(value) -> bool:
    """Whether `value` reads as group names: a string, or a non-empty list of strings."""
    return isinstance(value, str) or (isinstance(value, list) and bool(value)
                                      and all(isinstance(v, str) for v in value))


def _same(a, b) -> bool:
    """Equal as a document's id or groups: 7 and "7", "hr" and ["hr"]."""
    def norm(v):
        return [str(x) for x in v] if isinstance(v, list) else [str(v)]
    return norm(a) == norm(b)


def _one_of(row: dict, names: tuple[str, str], where: str) -> None:
    """Two spellings of one field given with different values: which one counts would be a
    silent choice (an ACL dropped, another document's id)."""
    given = [n for n in names if row.get(n) is not None]
    if len(given) == 2 and not _same(row[names[0]], row[names[1]]):
        raise CorpusError(f"{where}: both {names[0]!r} and {names[1]!r} are given, with "
                          "different values; give one")


def _read_text_folder(root: Path) -> Iterator[Document]:
    """Each .txt / .md file under `root` a document, hidden files and folders (".git",
    ".notes.txt") left out, and files with no letter or digit skipped with a line on stderr;
    the id is the path without its suffix, the title the first "# " heading or the file's
    name. Links to files and to folders are followed (a folder reached twice, a link back to
    `root`, is read once; a link to a folder holding `root`, and a link to nothing, are
    skipped with a line)."""
    files = sorted(p for p in _walk(root) if p.suffix.lower() in TEXT_SUFFIXES)
    texts, bad, first = {}, [], b""  # first: the first such file's bytes
    for file in files:  # every file that is not UTF-8 is named at once, not one per run
        if not _utf8(str(file.relative_to(root))):  # a name written in latin-1: no id holds it
            raise CorpusError(f"{file}: the file's name is not UTF-8 (each \\udcXX is a byte "
                              "that is not); rename it, e.g. with `convmv -f latin1 -t utf-8`")
        if file.is_symlink() and not file.exists():  # its target gone: no document to read
            _skipped(file, f"a link to nothing ({os.readlink(file)})")
            continue
        data = file.read_bytes()
        try:
            texts[file] = data.decode("utf-8-sig")  # a BOM is no part of the text
        except UnicodeDecodeError as exc:
            line = data.count(b"\n", 0, exc.start) + 1
            first = first if bad else data
            bad.append(f"{file}:{line} (byte {data[exc.start:exc.start + 1]!r} at offset "
                       f"{exc.start})")
    if bad:
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise CorpusError(f"not UTF-8 text: {'; '.join(bad[:5])}{more}; convert the files to "
                          f"UTF-8, e.g. with {convert_command(first)}")
    for file, text in texts.items():
        if not any(c.isalnum() for c in text):  # blank, "# ", zero-width spaces, NULs: a
            # title made of the file's name and nothing to search is no document
            _skipped(file, "nothing to search (no letter or digit)")
            continue
        rel = file.relative_to(root).as_posix()
        title = file.stem
        for line in text.splitlines():
            if line.startswith("# ") and line[2:].strip():
                title = line[2:].strip()
                break
        doc_id = re.sub(r"[\s#]+", "_", rel.rsplit(".", 1)[0])
        yield _document(doc_id, {"title": title, "text": text}, str(file), source=rel)


def _skipped(path, why: str) -> None:
    """A line on stderr: `path` left out of the corpus, and why; a control character in the
    file's name (which the folder's owner chose) shown as its escape."""
    sys.stderr.write(visible(f"skipped {path}: {why}", keep="") + "\n")


def _walk(root: Path) -> Iterator[Path]:
    """The files under `root` (not hidden, in no hidden folder), through links to folders,
    and links to nothing; each real folder once, and none that holds `root` (a link up to
    its parent would read the parent's other files, a link to `/` the whole disk)."""
    top = os.path.realpath(root)
    seen: set[str] = set()
    for folder, subfolders, names in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        above = real != top and os.path.commonpath([real, top]) == real
        if above:
            _skipped(folder, f"a link to a folder that holds the corpus ({real})")
        if real in seen or above:
            subfolders[:] = []
            continue
        seen.add(real)
        subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))
        for name in names:
            path = Path(folder) / name
            if not name.startswith(".") and (path.is_file() or not path.exists()):
                yield path


def json_problem(exc: BaseException) -> str:
    """What `json.loads` found wrong, in a few words."""
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    if isinstance(exc, json.JSONDecodeError):  # ("Invalid control character at": where)
        return f"{exc.msg.removesuffix(' at')} at character {exc.pos + 1}"
    if "int" in str(exc) and "digits" in str(exc):  # CPython's int limit, and its hint
        return "a number has more than 4,300 digits"
    return " ".join(str(exc).split())[:120]


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
