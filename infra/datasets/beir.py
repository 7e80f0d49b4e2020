"""BEIR-format evaluation sets: `queries.jsonl` and `qrels/{split}.tsv` beside `corpus.jsonl`
(split: test, dev or train)."""

from __future__ import annotations

import csv
import json
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

from branchsearch.infra.config.choices import SPLITS, Split
from branchsearch.infra.errors import CorpusError
from branchsearch.infra.ids import hidden_character, id_problem, shows
from branchsearch.infra.ingest.corpus import document_id
from branchsearch.infra.textfile import KeyTwice, json_once, utf8_lines


@dataclass
class Query:
    id: str
    text: str
    gold: dict[str, int] = field(default_factory=dict)  # doc id -> relevance grade
    answer: str = ""
    meta: dict = field(default_factory=dict)
    line: int = 0  # its line in queries.jsonl (for error messages)


def _nfc(text: str) -> str:
    return unicodedata.normalize("NFC", text)


def read_queries(folder: str | Path, split: Split = "test",
                 notes: list[str] | None = None) -> list[Query]:
    """Queries that have at least one positive qrel in `qrels/{split}.tsv`, in file order.
    `notes`, when given, gets a line ("warning: …" or "note: …") for each kind of query the
    files name and the scores leave out."""
    if split not in SPLITS:
        raise CorpusError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    folder = Path(folder)
    qfile, qrels_file = folder / "queries.jsonl", folder / "qrels" / f"{split}.tsv"
    if not folder.exists():
        raise CorpusError(f"dataset not found: {folder}")
    if folder.is_file():  # its queries.jsonl or corpus.jsonl, say
        raise CorpusError(f"{folder} is a file; give the BEIR folder that holds it "
                          f"({folder.parent})")
    if not qfile.exists():
        raise CorpusError(f"{folder}: not a BEIR folder (missing queries.jsonl)")
    if not qrels_file.exists():
        have = [s for s in SPLITS if (folder / "qrels" / f"{s}.tsv").exists()]
        hint = (f"; it has {', '.join(have)}: use --split {have[0]}" if have
                else " (not a BEIR folder?)")
        raise CorpusError(f"{folder}: no qrels/{split}.tsv{hint}")
    gold: dict[str, dict[str, int]] = {}
    graded: dict[tuple[str, str], tuple[int, int]] = {}  # (query, document) -> (score, line)
    with qrels_file.open("rb") as f:
        lines = [(n, line) for n, line in text_lines(utf8_lines(f, qrels_file))
                 if line.strip()]
        for lineno, line in lines:
            row = qrels_fields(line)
            if lineno == lines[0][0] and len(row) == 3 and not _number(row[-1]):
                continue  # a header: BEIR's column names (TREC's qrels have none)
            if len(row) == 4:  # TREC's "query-id 0 corpus-id score" (its 0 unused)
                row = [row[0], row[2], row[3]]
            row[-1] = row[-1].strip()  # a score padded with spaces: BEIR's int() reads it
            if len(row) != 3:
                raise CorpusError(f"{qrels_file}:{lineno}: expected query-id, corpus-id, score "
                                  "(or TREC's query-id, 0, corpus-id, score), separated by "
                                  f"tabs or spaces; found {len(row)} field(s)")
            if not row[2].lstrip("-").isdigit():
                raise CorpusError(f"{qrels_file}:{lineno}: score {row[2][:20]!r} is not a whole "
                                  "number (a relevance grade: 0, 1, 2, …)")
            for name, value in (("query-id", row[0]), ("corpus-id", row[1])):
                problem = id_problem(value)  # gold no query or document could be
                hidden = not problem and hidden_character(value)  # one ingest would refuse
                if problem or hidden:
                    raise CorpusError(f"{qrels_file}:{lineno}: {name} "
                                      + (problem or f"{value!r} {hidden}"))
            # the ids as the index holds them (NFC)
            qid, doc, score = _nfc(row[0]), document_id(row[1]), int(row[2])
            first = graded.setdefault((qid, doc), (score, lineno))
            if first[0] != score:  # which grade counts would be the file order's choice
                raise CorpusError(f"{qrels_file}:{lineno}: query {qid!r}, document {doc!r} is "
                                  f"scored {score} here and {first[0]} on line {first[1]}: "
                                  "give the pair one score")
            if score > 0:  # the same score twice is the same gold: kept once, silently
                gold.setdefault(qid, {})[doc] = score
    queries, seen = [], {}  # seen: query ids in file order
    with qfile.open("rb") as f:
        for lineno, line in utf8_lines(f, qfile):
            if not line.strip():
                continue
            try:
                row = json_once(line)
                qid, text = row.get("_id", row.get("id")), row["text"]
            except KeyTwice as exc:  # {"_id": "q1", "_id": "q2"}: which query is it?
                raise CorpusError(f"{qfile}:{lineno}: {exc}") from None
            except (ValueError, RecursionError, KeyError, AttributeError, TypeError):
                raise CorpusError(f"{qfile}:{lineno}: expected {{'_id', 'text'}}") from None
            if isinstance(qid, bool) or not isinstance(qid, (str, int)) or not str(qid).strip():
                raise CorpusError(f"{qfile}:{lineno}: '_id' must be a non-empty string or a "
                                  f"whole number, not {json.dumps(qid)}")
            problem = id_problem(str(qid))  # "\u200b": as empty to a reader of the report
            if problem:
                raise CorpusError(f"{qfile}:{lineno}: '_id' {problem}: give each query an id "
                                  "one can read")
            hidden = hidden_character(str(qid))  # "q\u200b1" reads as "q1" in the report
            if hidden:
                raise CorpusError(f"{qfile}:{lineno}: '_id' {qid!r} {hidden}")
            if not isinstance(text, str):
                raise CorpusError(f"{qfile}:{lineno}: 'text' must be a string, not "
                                  f"{json.dumps(text)[:40]}")
            qid = _nfc(str(qid))  # as the qrels' (a query id typed on macOS is NFD)
            if qid in seen:  # scored twice, it would weigh twice in every mean
                raise CorpusError(f"{qfile}:{lineno}: duplicate query id {qid!r}")
            seen[qid] = None
            if qid in gold:
                meta = row.get("metadata") or {}
                if not isinstance(meta, dict):
                    raise CorpusError(f"{qfile}:{lineno}: 'metadata' must be an object")
                queries.append(Query(qid, text, gold[qid], str(meta.get("answer") or ""), meta,
                                     lineno))
    if not queries:
        raise CorpusError(f"{folder}: no query has a positive qrel in {qrels_file.name}")
    if notes is not None:
        judged, qrels = {qid for qid, _ in graded}, f"qrels/{split}.tsv"
        notes += filter(None, (
            _left_out("warning", [q for q in gold if q not in seen],
                      f"of {qrels} missing from queries.jsonl"),
            _left_out("warning", [q for q in seen if q in judged and q not in gold],
                      f"of queries.jsonl judged in {qrels} with no relevant document (score > 0)",
                      " (BEIR's evaluate would score each 0)"),
            _left_out("note", [q for q in seen if q not in judged],
                      f"of queries.jsonl without qrels in {qrels}"),
            _look_alike([q for q in seen if q not in judged],
                        [q for q in judged if q not in seen], qrels)))
    return queries


def _shown(qid: str) -> str:
    """An id without the characters that do not show (`ids.shows`: zero-width, byte-order
    mark, controls), its inner spaces kept."""
    return "".join(c for c in qid if c == " " or shows(c)).strip()


def text_lines(lines):
    """(line number, line) of a file's `utf8_lines` with a lone carriage return also ending a
    line, numbered as an editor numbers them: BEIR's loader opens qrels in text mode, where
    "\r" ends a line, so a file saved with classic Mac line ends is its lines, not one."""
    n = 0
    for _, line in lines:
        for part in re.split(r"\r(?!\n)", line):
            n += 1
            if part:
                yield n, part


def qrels_fields(line: str) -> list[str]:
    """A qrels line's fields: split at tabs (BEIR's TSV, read as its loader reads it, so an id
    may hold a space), or at runs of spaces when the line has no tab (TREC's qrels, as
    trec_eval reads them, and BEIR columns typed with spaces)."""
    if "\t" in line:
        return next(csv.reader([line.rstrip("\r\n")], delimiter="\t"), [""])
    return line.split() or [""]


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _look_alike(unjudged: list[str], unasked: list[str], qrels: str) -> str:
    """A note naming the ids of queries.jsonl that differ from an id of the qrels only by
    characters that do not show: they are other ids (compared exactly, as BEIR compares
    them), which a reader of the other notes could not tell apart. "" for none."""
    by_look: dict[str, str] = {}
    for qid in unasked:
        by_look.setdefault(_shown(qid), qid)
    pairs = [(q, by_look[_shown(q)]) for q in unjudged if _shown(q) in by_look]
    if not pairs:
        return ""
    one = len(pairs) == 1
    named = ", ".join(f"{q!r} ({qrels}: {j!r})" for q, j in pairs[:5])
    more = f" and {len(pairs) - 5:,} more" if len(pairs) > 5 else ""
    return (f"warning: {len(pairs):,} quer{'y' if one else 'ies'} of queries.jsonl "
            f"differ{'s' if one else ''} from {'an id' if one else 'ids'} of {qrels} only by "
            f"characters that do not show (ids compare exactly), not scored: {named}{more}")


def _left_out(kind: str, ids: list[str], what: str, after: str = "") -> str:
    """"warning: 2 queries {what}, not scored: 'a', 'b'" (five ids named), "" for none."""
    if not ids:
        return ""
    more = f" and {len(ids) - 5:,} more" if len(ids) > 5 else ""
    return (f"{kind}: {len(ids):,} quer{'y' if len(ids) == 1 else 'ies'} {what}, not scored: "
            f"{', '.join(map(repr, ids[:5]))}{more}{after}")
