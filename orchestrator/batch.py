"""Batch: many questions through one driver, resumable, each result appended when done.

Input lines are `{"id"|"_id", "question"|"text"}` (a BEIR queries.jsonl works as is). Output
lines carry id, question, evidence, branches, metrics and trace_id. Re-running skips ids already
in the output; a torn last line (a crash mid-write) is cut off first, so nothing is lost or
duplicated. Malformed input lines are reported with their line numbers and skipped.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from branchsearch.infra.errors import CorpusError


@dataclass
class BatchInput:
    items: list[tuple[str, str]] = field(default_factory=list)  # (id, question)
    bad_lines: list[str] = field(default_factory=list)


def read_questions(path: str | Path) -> BatchInput:
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"batch input not found: {path}")
    from branchsearch.infra.textfile import utf8_lines

    out, seen = BatchInput(), set()
    with path.open("rb") as f:  # bytes that are not UTF-8 stop with file, line and offset
        for lineno, line in utf8_lines(f, path):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                qid = row.get("id", row.get("_id"))
                question = row.get("question", row.get("text"))
                if qid is None or not isinstance(question, str) or not question.strip():
                    raise ValueError("needs 'id' (or '_id') and 'question' (or 'text')")
            except (json.JSONDecodeError, ValueError, AttributeError) as exc:
                out.bad_lines.append(f"{path}:{lineno}: {exc}")
                continue
            if str(qid) in seen:
                out.bad_lines.append(f"{path}:{lineno}: duplicate id {qid!r}")
                continue
            seen.add(str(qid))
            out.items.append((str(qid), question))
    return out


def done_ids(path: str | Path) -> set[str]:
    """Ids already written to `path`; cuts off a torn last line so appends stay valid JSONL."""
    path = Path(path)
    if not path.exists():
        return set()
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        with path.open("r+b") as f:
            f.truncate(keep)
        data = data[:keep]
    ids = set()
    for line in data.splitlines():
        try:
            ids.add(str(json.loads(line)["id"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    return ids


def run_batch(items: list[tuple[str, str]], out_path: str | Path,
              search: Callable[[str], dict], *, concurrency: int = 2,
              on_done: Callable[[bool], None] | None = None) -> dict:
    """Run `search(question) -> result dict` for each item not yet in `out_path`."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    finished = done_ids(out_path)
    todo = [(qid, q) for qid, q in items if qid not in finished]
    lock = threading.Lock()
    counts = {"skipped": len(items) - len(todo), "done": 0, "failed": 0}

    def one(qid: str, question: str) -> bool:
        try:
            result = search(question)
            row = {"id": qid, "question": question, **result}
            ok = True
        except Exception as exc:  # a failed question is recorded, not fatal
            row = {"id": qid, "question": question, "error": f"{type(exc).__name__}: {exc}"}
            ok = False
        line = json.dumps(row, default=str) + "\n"
        with lock, out_path.open("a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        return ok

    with ThreadPoolExecutor(max_workers=max(concurrency, 1)) as pool:
        pending = set()
        queue = iter(todo)
        for qid, q in queue:
            pending.add(pool.submit(one, qid, q))
            if len(pending) >= concurrency:
                break
        while pending:
            finished_now, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished_now:
                ok = future.result()
                counts["done" if ok else "failed"] += 1
                if on_done:
                    on_done(ok)
                nxt = next(queue, None)
                if nxt is not None:
                    pending.add(pool.submit(one, *nxt))
    return counts
