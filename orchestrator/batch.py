"""Batch: many questions through one driver, resumable, nothing lost or faked.

Input lines are `{"id"|"_id", "question"|"text"}` (a BEIR queries.jsonl works as is). Output
lines carry id, question, status, evidence, branches, metrics and trace_id (or `error`).

* Each result is appended (and fsynced) as it finishes, so a crash at any point loses at most
  the questions in flight; a torn last line is cut off by the next run, before it appends (a
  whole row that lost its newline is kept); a run refused before it starts changes nothing.
* A re-run skips only ids whose latest line has `status` `ok` and searched whole; `partial`,
  `failed` and `error` rows are run again, and so are ok rows whose later waves the deadline
  left no time to start (`metrics.late_waves`: a `branch_timeout_s` since raised finds
  more). So are ok rows answered on another index, or made with other settings that change
  a result (`made_with`: the settings `CHANGES_RESULT` names, the caller's ACL
  groups), so that one output never mixes two configurations' evidence (the CLI refuses such a
  resume instead: a flag changed by mistake would replace finished work). So are ok rows
  answered before the index's documents changed (`index_version`, the manifest's `version`:
  an ingest that committed a document, a service upsert or delete; for an external index
  over Elasticsearch alone, its fingerprint, `infra.index.fingerprint`): their evidence
  quotes the old text.
* When a run ends the output is rewritten atomically (temp file, fsync, rename) to exactly one
  line per id: the latest attempt, copied as written. Reading an output (a resume, the rewrite)
  keeps where each id's latest row is, not the rows (`Latest`): an output of many questions
  is gigabytes.
* One batch at a time writes an output (`OutputLock`): a second one on the same file, whose rows
  the first's rewrite would drop, stops with one line naming the first's PID. The partial
  copy a rewrite killed midway left beside the output is removed by the next run.
* After `stop_after` failed questions in a row (a dead backend fails every question in
  milliseconds) no more are started: the rest stay unwritten, not marked failed by an outage,
  and the counts say how many were not run and why; re-running the command resumes.
* A search that raises `ClusterLost` (the Ray cluster is gone) writes no row: its question
  is not run, none is started after it, and the counts say why (`lost`).
* So does one that ends once the index is no longer the one the batch began with
  (`index_gone`: its folder removed, or made anew): the output holds only answers from the
  index as it began; the counts say why (`gone`).
Malformed input lines are reported with their line numbers and skipped. An id is a non-empty
string, written back as given, or a number, written back as text (`7` -> "7", `1.5` -> "1.5"); an
empty id, one of characters that do not show (`infra.ids`), true/false, an array or an object
is a malformed line.
"""

from __future__ import annotations

import glob
import json
import math
import os
import threading
import unicodedata
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

from branchsearch.infra.errors import BranchsearchError, ClusterLost, CorpusError
from branchsearch.infra.ids import hidden_character, id_problem
from branchsearch.workers.query import QUESTION_CUT, question_problem

STATUSES = ("ok", "partial", "failed")


def made_with(settings, acl_groups) -> dict:
    """The settings a batch row was made with that change its evidence: written in every row;
    a resume asks again an id whose ok row was made with others (`differing`). Which settings
    those are is said once, beside the settings (`CHANGES_RESULT` in infra.config.settings):
    the LLM's only when an LLM plans or searches, never a URL or key. `acl`: the caller's
    groups, sorted and once each (["*"] for an admin); None: public documents only."""
    from branchsearch.infra.config.settings import CHANGES_RESULT, CHANGES_RESULT_WITH_LLM

    llm = "llm" in (settings.policy, settings.planner)
    names = CHANGES_RESULT + (CHANGES_RESULT_WITH_LLM if llm else ())
    out = {name: getattr(settings, name) for name in names}
    out["acl"] = None if acl_groups is None else sorted(set(acl_groups))
    return json.loads(json.dumps(out, default=str))  # as a row read back holds it


def differing(then: dict, now: dict) -> list[str]:
    """The settings whose values differ between two `made_with`s. A setting only one of them
    names (added or dropped by another version of branchsearch) is not a difference."""
    return sorted(k for k in then.keys() & now.keys() if then[k] != now[k])


@dataclass
class BatchInput:
    items: list[tuple[str, str]] = field(default_factory=list)  # (id, question)
    bad_lines: list[str] = field(default_factory=list)


_JSON_KIND = {list: "an array", str: "a string", bool: "true or false", type(None): "null"}


def read_questions(path: str | Path) -> BatchInput:
    """The questions of a JSONL file, or of standard input for `-` (read whole: a resume reads
    the same input again, so a pipe's questions are as resumable as a file's)."""
    if str(path) == "-":
        import sys

        return _questions(sys.stdin.buffer, "<stdin>")
    path = Path(path)
    if path.is_dir():
        raise CorpusError(f"batch input {path} is a folder; give the questions file (JSONL, "
                          "one {\"id\", \"question\"} per line)")
    if not path.is_file():
        raise CorpusError(f"batch input not found: {path}")
    with path.open("rb") as f:
        return _questions(f, path)


def _questions(f, path: str | Path) -> BatchInput:
    """The questions of binary lines `f`; a malformed line is kept in `bad_lines` with its
    line number, and bytes that are not UTF-8 stop with the line and byte offset."""
    from branchsearch.infra.textfile import json_once, utf8_lines

    out, seen = BatchInput(), set()
    for lineno, line in utf8_lines(f, path):
        if not line.strip():
            continue
        try:
            row = json_once(line)  # a key given twice: a ValueError saying which
            if not isinstance(row, dict):
                raise ValueError(f"a line is one JSON object per question, not "
                                 f"{_JSON_KIND.get(type(row), 'a number')}")
            for one, other in (("id", "_id"), ("question", "text")):
                if one in row and other in row and row[one] != row[other]:
                    raise ValueError(f"gives both {one!r} and {other!r}, and they differ: "
                                     "keep one")
            qid = row.get("id", row.get("_id"))
            question = row.get("question", row.get("text"))
            if qid is None or question is None:
                raise ValueError("needs 'id' (or '_id') and 'question' (or 'text')")
            qid = question_id(qid)
            problem = question_problem(question)  # 5 or a list: "must be text, not …"
            if problem:
                raise ValueError(problem)
        except json.JSONDecodeError as exc:  # its position on this line, not in its parse
            out.bad_lines.append(f"{path}:{lineno}: not JSON ({exc.msg.removesuffix(' at')} "
                                 f"at character {exc.pos + 1} of the line)")
            continue
        except ValueError as exc:
            out.bad_lines.append(f"{path}:{lineno}: {exc}")
            continue
        if qid in seen:
            out.bad_lines.append(f"{path}:{lineno}: duplicate id {qid!r}")
            continue
        seen.add(qid)
        out.items.append((qid, question))
    return out


def question_id(value: object) -> str:
    """A question's id as the output writes it: a non-empty string in Unicode NFC (as document
    ids are: an id typed on macOS is NFD, and the two spellings are one id), a number as
    text (`7` -> "7", `1.5` -> "1.5"); ValueError for anything else (empty, nothing that
    shows, a character a document id may not hold — `ids.hidden_character` —, true/false,
    an array, an object, NaN)."""
    if isinstance(value, str):
        problem = id_problem(value)  # "" or spaces; or "\u200b", which shows as nothing
        if problem:
            fix = "a non-empty id" if not value.strip() else "an id one can read"
            raise ValueError(f"'id' {problem}: give each question {fix}")
        hidden = hidden_character(value)  # "q\u200b1", written as an id that reads "q1"
        if hidden:
            raise ValueError(f"'id' {value!r} {hidden}")
        return unicodedata.normalize("NFC", value)
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and math.isfinite(value):
        return repr(value)
    kind = ("NaN or infinity" if isinstance(value, float)
            else "an object" if isinstance(value, dict)
            else _JSON_KIND.get(type(value), type(value).__name__))
    raise ValueError(f"'id' must be a non-empty string or a number, not {kind}")


def _written_id(value: object) -> str:
    """The id of an output row, as `question_id` reads an input's (NFC: a row written before
    ids were), but an id that shows nothing is kept: an earlier version wrote such rows, and
    dropping them from the rewrite would lose finished work."""
    if isinstance(value, str) and value.strip():
        return unicodedata.normalize("NFC", value)
    return question_id(value)


def _why_failed(row: dict) -> str:
    """A failed row's reason: its error, else its first failed branch's."""
    if row.get("error"):
        return str(row["error"])
    for branch in row.get("branches") or []:
        if isinstance(branch, dict) and branch.get("error"):
            return str(branch["error"])
    return "no branch finished"


def row_status(row: dict) -> str:
    """ok | partial | failed; a row with an `error` or no status (an old format) is failed."""
    status = row.get("status")
    return status if status in STATUSES and "error" not in row else "failed"


def cut_short(row: dict) -> bool:
    """An ok row whose search the deadline cut short: a later wave (forks, chains, bridges)
    was due but not started for lack of time (`branch_timeout_s`). Not done: a resume asks
    it again."""
    metrics = row.get("metrics")
    return isinstance(metrics, dict) and bool(metrics.get("late_waves"))


def question_cut(row: dict) -> bool:
    """A row whose question was longer than `query_max_tokens`: searched by its first tokens
    (its `notes` say so); done, but a researcher should know how many."""
    notes = row.get("notes")
    return isinstance(notes, list) and any(str(n).startswith(QUESTION_CUT) for n in notes)


@dataclass(frozen=True)
class Latest:
    """An id's latest row in an output: where it is (`offset`, `length`, its newline included
    when it has one) and what a resume reads of it. Rows are not kept: an output of 100,000
    questions is gigabytes, its `Latest`s megabytes."""
    offset: int
    length: int
    status: str  # `row_status`
    index: str | None
    made_with: dict | None
    question: str | None
    late: bool = False  # waves not started for lack of time (`cut_short`): not done
    version: str | None = None  # the index's version that answered it (`index_version`)


def latest_rows(path: str | Path) -> dict[str, Latest]:
    """id -> its latest row, read line by line. Only reads: a last line without its newline
    counts when it is a whole row (its newline lost, not its text) and is skipped when torn (a
    crash mid-write); `mend_tail` repairs the file, and only a run about to append calls it."""
    path = Path(path)
    if not path.exists():
        return {}
    rows: dict[str, Latest] = {}
    with path.open("rb") as f:
        offset = 0
        for line in f:
            try:
                row = json.loads(line)
                qid = _written_id(row["id"])
                made = row.get("made_with")
                version = row.get("index_version")
                latest = Latest(offset, len(line), row_status(row), row.get("index"),
                                made if isinstance(made, dict) else None, row.get("question"),
                                cut_short(row), version if isinstance(version, str) else None)
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError,
                    AttributeError):
                latest = None
            offset += len(line)
            if latest is not None:
                rows.pop(qid, None)  # the latest attempt goes last
                rows[qid] = latest
    return rows


def _tail_start(f) -> int:
    """Where the last line of the open binary file `f` begins (after its last newline but the
    final byte), reading back from the end a block at a time."""
    end = f.seek(0, os.SEEK_END)
    at = end - 1  # (the final byte, a newline or not, ends the last line)
    while at > 0:
        start = max(at - (1 << 16), 0)
        f.seek(start)
        found = f.read(at - start).rfind(b"\n")
        if found >= 0:
            return start + found + 1
        at = start
    return 0


def mend_tail(path: str | Path) -> None:
    """Before appending to `path`: a last line without its newline gets one when it is a whole
    row, and is cut off when torn (a crash mid-write), so that appends stay valid JSONL. Reads
    the last line alone (an output can be large)."""
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
        keep = _tail_start(f)
        f.seek(keep)
        tail = f.read()
    try:
        row = json.loads(tail)
        whole = isinstance(row, dict) and "id" in row
    except (json.JSONDecodeError, UnicodeDecodeError):
        whole = False
    with path.open("r+b") as f:
        if whole:
            f.seek(0, os.SEEK_END)
            f.write(b"\n")
        else:
            f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())


def check_output(out_path: str | Path, input_path: str | Path) -> None:
    """Refuse an output that is not ours to rewrite (a run ends by rewriting it to one line per
    id): the input file itself, or a file holding lines that no batch wrote. Every line must be
    a JSON object with an `id` and a `status`, `error` or `evidence`; only a torn last line (a
    crash mid-write) may be cut."""
    out_path = Path(out_path)
    if not out_path.is_file():
        return
    if Path(input_path).is_file() and os.path.samefile(out_path, input_path):
        raise CorpusError(f"batch output {out_path} is the input file: give another file")
    with out_path.open("rb") as f:  # line by line: an output can be gigabytes
        for lineno, line in enumerate(f, start=1):
            if not line.endswith(b"\n"):
                break  # a torn last line: cut off by the run, as after a crash
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            if not (isinstance(row, dict) and "id" in row
                    and {"status", "error", "evidence"} & row.keys()):
                raise CorpusError(f"batch output {out_path}:{lineno} is not a batch result "
                                  "line; give a new file, or one a batch wrote (it is rewritten)")


def done_ids(path: str | Path, index: str | None = None, made: dict | None = None,
             version: str | None = None) -> dict[str, str | None]:
    """Ids whose latest row is ok and not `cut_short`, each with the question that row
    answered (None: a row written without it); with `index`, only rows answered on that index,
    with `version`, only rows answered on that version of it, and with `made`, only rows made
    with those settings (`made_with`) — or rows that do not say (written before rows named
    them)."""
    return resume_state(path, index, made, version).done


@dataclass
class ResumeState:
    """What a resume needs of an output's latest ok rows, read once."""
    done: dict[str, str | None]  # `done_ids`
    other_made: dict[str, dict]  # made with other settings, on this index: id -> `made_with`
    other_index: dict[str, str]  # answered on another index: id -> that index
    earlier: dict[str, str]  # answered on another version of this index: id -> that version
    # done, but written with no version while the index has one (before it was versioned):
    # kept, since nothing tells what it was answered on
    unversioned: set[str] = field(default_factory=set)


def resume_state(path: str | Path, index: str | None = None, made: dict | None = None,
                 version: str | None = None) -> ResumeState:
    """What a resume needs of `path`'s latest ok rows (`ResumeState`). A row answered on
    another index is not done; nor one answered on another `version` of this one (its
    documents changed since: its evidence quotes the old text); nor one made with
    other settings than `made`. Rows that do not say (written before rows named them) are."""
    state = ResumeState({}, {}, {}, {})
    for qid, row in latest_rows(path).items():
        if row.status != "ok" or row.late:
            continue
        if index is not None and row.index not in (None, index):
            state.other_index[qid] = row.index
        elif version and row.version and row.version != version:
            state.earlier[qid] = row.version
        elif made is not None and row.made_with is not None and differing(row.made_with, made):
            state.other_made[qid] = row.made_with
        else:
            state.done[qid] = row.question
            if version and not row.version:
                state.unversioned.add(qid)
    return state


def to_ask(items: list[tuple[str, str]], done: dict[str, str | None]
           ) -> tuple[list[tuple[str, str]], list[str]]:
    """(the questions to ask, the ids among them asked again because their question is not
    the one their ok row answered): a resume asks what is not done, and a question edited in
    the input under the same id is not done. Spacing is no edit (a search reads words, so
    'Q' and ' Q  ' get the same evidence)."""
    def same(asked: str | None, q: str) -> bool:
        return asked is None or asked.split() == q.split()

    todo = [(qid, q) for qid, q in items if qid not in done or not same(done[qid], q)]
    return todo, [qid for qid, _ in todo if qid in done]


def append_row(path: Path, row: dict) -> None:
    """Append `row` as one line and fsync it. A write that fails (a full disk, a file size
    limit) is undone before the error goes on: the file never ends in half a row (a crash
    mid-write still can: `mend_tail`)."""
    data = memoryview((json.dumps(row, default=str) + "\n").encode("utf-8"))
    with path.open("ab", buffering=0) as f:
        end = f.seek(0, os.SEEK_END)
        try:
            while data:  # a full disk can take part of a write, then refuse the rest
                data = data[f.write(data):]
            os.fsync(f.fileno())
        except OSError:
            f.truncate(end)
            raise


def compact(path: str | Path, order: list[str] | None = None) -> int:
    """Rewrite `path` atomically to one line per id (the latest, copied as written), ids of
    `order` first in that order; returns the number of lines. The old file stays intact until
    the rename. Holds where each row is, not the rows."""
    from branchsearch.infra.textfile import output_path

    path = output_path(path)
    rows = latest_rows(path)
    ids = [qid for qid in (order or []) if qid in rows]
    listed = set(ids)
    ids += [qid for qid in rows if qid not in listed]
    tmp = rewrite_copy(path, os.getpid())
    try:
        with path.open("rb") as old, tmp.open("wb") as f:
            for qid in ids:
                old.seek(rows[qid].offset)
                line = old.read(rows[qid].length)
                f.write(line if line.endswith(b"\n") else line + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, a second ^C: the output stays as it was, and no
        tmp.unlink(missing_ok=True)  # partial copy is left to fill the disk further
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a power cut
    finally:
        os.close(dir_fd)
    return len(ids)


def rewrite_copy(path: Path, pid: int) -> Path:
    """The temporary copy process `pid`'s `compact` writes beside `path` before renaming it."""
    return path.with_name(f".{path.name}.{pid}.tmp")


def drop_killed_rewrites(path: Path) -> None:
    """Remove the partial copies that rewrites of `path` killed midway (kill -9, a scheduler's
    grace period spent) left beside it, each as large as the output. Called under the output's
    `OutputLock`: no other process is rewriting it."""
    prefix, suffix = f".{path.name}.", ".tmp"
    for copy in path.parent.glob(glob.escape(prefix) + "*" + suffix):
        pid = copy.name[len(prefix):-len(suffix)]
        if pid.isdigit() and copy == rewrite_copy(path, int(pid)) and copy.is_file():
            copy.unlink(missing_ok=True)


class OutputLock:
    """The one batch writing an output file: an exclusive `flock` on a lock file beside it
    (`.NAME.lock`, holding the writer's PID), taken before the output is read and kept until
    its final rewrite; released (and the file removed) on `release`, or by the kernel when the
    process dies. The output's folders are made when missing, and removed on `release` when
    nothing was written into them (a run refused before it started)."""

    def __init__(self, output: str | Path):
        self.output = Path(output)
        self.path = self.output.with_name(f".{self.output.name}.lock")
        self.fd: int | None = None
        self.made: list[Path] = []  # the folders `acquire` made, deepest first

    def acquire(self) -> "OutputLock":
        import fcntl

        self.made = [f for f in self.path.parents if not f.exists()]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise BranchsearchError(
                    f"batch output {self.output} is being written by another batch (PID "
                    f"{holder}); wait for it to end, or give another -o") from None
            try:  # the file locked is still the one at the path (not removed by a holder
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino  # just leaving)
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = None
        for folder in self.made:  # left empty: a run refused before it wrote anything
            try:
                folder.rmdir()
            except OSError:
                break


STOP_AFTER = 20  # failed questions in a row that stop a batch (0: never stop)


def run_batch(items: list[tuple[str, str]], out_path: str | Path,
              search: Callable[[str], dict], *, concurrency: int = 2, index: str | None = None,
              on_done: Callable[[str], None] | None = None,
              stop_after: int = STOP_AFTER, stop: threading.Event | None = None,
              locked: bool = False, made: dict | None = None,
              version: str | None = None,
              index_gone: Callable[[], str] | None = None) -> dict:
    """Run `search(question) -> result dict` for each item whose latest row in `out_path` is
    not ok or answered another question (`to_ask`). Returns counts: ok, partial, failed (this
    run; `cut_short`: how many of its ok rows a resume asks again; `question_cut`: how many
    of its rows searched a question cut to `query_max_tokens`), skipped (already ok),
    changed (ids asked again: their question changed), not_run (left when `stop_after`
    failures in a row or a lost cluster stopped the run), `stopped` (why, or ""), `lost` (why
    the Ray cluster was lost, or "") and `failed_ids` (this run's failed question ids, in input
    order). `stop`, once set (a ^C):
    no question is started after it, the ones running finish and their rows are written, then
    KeyboardInterrupt is raised here. `locked`: the caller holds the output's `OutputLock`
    (else it is taken here, for the run). `index` and `made` (`made_with`): written in every
    row, and a row answered on another index or made with other settings is not done; so is
    one answered on another `version` of the index (the manifest's; written as
    `index_version`). `index_gone() -> why or ""`: asked as each question starts and before
    its row is written; once it says why, that row is not written and nothing more starts
    (`gone`)."""
    out_path = Path(out_path)
    held = None if locked else OutputLock(out_path).acquire()
    try:
        return _run_batch(items, out_path, search, concurrency, index, on_done, stop_after,
                          stop, made, version, index_gone or (lambda: ""))
    finally:
        if held is not None:
            held.release()


def _run_batch(items, out_path: Path, search, concurrency, index, on_done, stop_after,
               stop, made, version, index_gone) -> dict:
    drop_killed_rewrites(out_path)
    mend_tail(out_path)
    todo, changed = to_ask(items, done_ids(out_path, index, made, version))
    stamp = ({} if index is None else {"index": index}) | ({} if made is None else
                                                           {"made_with": made})
    stamp |= {} if not version else {"index_version": version}
    lock = threading.Lock()
    counts = {"skipped": len(items) - len(todo), "ok": 0, "partial": 0, "failed": 0,
              "cut_short": 0, "question_cut": 0, "not_run": 0, "stopped": "", "lost": "",
              "gone": "", "changed": changed}
    in_a_row, last_error, failed_ids, lost = 0, [""], set(), 0

    def gone() -> bool:  # the index is not the one the batch began with: nothing is written
        why = index_gone()
        if why:
            counts["gone"] = counts["gone"] or why
        return bool(why)

    def one(qid: str, question: str) -> str:
        if gone():
            return "lost"
        try:
            row = {"id": qid, "question": question, **stamp, **search(question)}
        except ClusterLost as exc:  # not this question's failure: nothing can run now
            counts["lost"] = counts["lost"] or str(exc)
            return "lost"
        except Exception as exc:  # a failed question is recorded, not fatal
            row = {"id": qid, "question": question, **stamp, "status": "failed",
                   "error": f"{type(exc).__name__}: {exc}"}
        with lock:
            if gone():  # its answer may have read the index as it is now: not written
                return "lost"
            if row_status(row) == "failed":
                last_error[0] = _why_failed(row)
                failed_ids.add(qid)
            append_row(out_path, row)
            if row_status(row) == "ok" and cut_short(row):
                counts["cut_short"] += 1
            counts["question_cut"] += question_cut(row)
        return row_status(row)

    def interrupted() -> bool:
        return stop is not None and stop.is_set()

    try:
        with ThreadPoolExecutor(max_workers=max(concurrency, 1)) as pool:
            queue = iter(todo)  # (a stop before the run, as workers started: none starts)
            pending = {pool.submit(one, *item) for item in
                       islice(queue, 0 if interrupted() else max(concurrency, 1))}
            while pending:
                finished_now, pending = wait(pending, timeout=None if stop is None else 0.2,
                                             return_when=FIRST_COMPLETED)
                for future in finished_now:
                    status = future.result()
                    if status == "lost":  # not run: it starts again on a resume
                        lost += 1
                        counts["stopped"] = counts["stopped"] or counts["lost"] or \
                            counts["gone"]
                        continue
                    counts[status] += 1
                    in_a_row = in_a_row + 1 if status == "failed" else 0
                    if on_done:
                        on_done(status)
                    if stop_after and in_a_row >= stop_after and not counts["stopped"]:
                        counts["stopped"] = (f"{in_a_row} questions failed in a row (the "
                                             f"last: {last_error[0][:300]})")
                    nxt = None if counts["stopped"] or interrupted() else next(queue, None)
                    if nxt is not None:
                        pending.add(pool.submit(one, *nxt))
            if interrupted():
                raise KeyboardInterrupt
            counts["not_run"] = lost + sum(1 for _ in queue)
    finally:
        if out_path.exists():
            compact(out_path, [qid for qid, _ in items])
    counts["failed_ids"] = [qid for qid, _ in todo if qid in failed_ids]
    return counts
