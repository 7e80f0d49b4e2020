"""What the load test asks: questions from a file, or generated multi-hop questions.

A workload is a fixed list of questions and a seeded order: request i asks `question(i)`, the
same sequence on every run with the same seed, whatever the load.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from branchsearch.infra.errors import CorpusError
from branchsearch.infra.textfile import KeyTwice, json_once, utf8_lines
from branchsearch.workers.query import question_problem


@dataclass
class Workload:
    questions: list[str]
    seed: int = 0
    source: str = ""
    corpus: Path | None = None  # the corpus the questions are about, when generated
    _order: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self):
        if not self.questions:
            raise CorpusError(f"workload {self.source or ''}: no questions")
        self._order = list(range(len(self.questions)))
        random.Random(self.seed).shuffle(self._order)

    def question(self, i: int) -> str:
        return self.questions[self._order[i % len(self._order)]]

    def describe(self) -> dict:
        return {"source": self.source, "questions": len(self.questions), "seed": self.seed}


def read_questions(path: str | Path) -> list[str]:
    """Questions from a JSONL file (`question`, `text` or `query` per line; a BEIR
    queries.jsonl works as is) or a BEIR folder (its queries.jsonl)."""
    path = Path(path)
    if path.is_dir():
        path = path / "queries.jsonl"
    if not path.is_file():
        raise CorpusError(f"queries not found: {path}")
    questions = []
    with path.open("rb") as f:
        for lineno, line in utf8_lines(f, path):  # not UTF-8: one line; a BOM is dropped
            if not line.strip():
                continue
            try:
                row = json_once(line)
                text = next(row[k] for k in ("question", "text", "query") if k in row)
            except KeyTwice as exc:
                raise CorpusError(f"{path}:{lineno}: {exc}") from None
            except (json.JSONDecodeError, StopIteration, ValueError, TypeError):
                raise CorpusError(f"{path}:{lineno}: expected a JSON object with 'question', "
                                  "'text' or 'query'") from None
            # the check the driver and the service make: a question they refuse would be
            # measured as a fast error, and read as saturation
            problem = question_problem(text)
            if problem:
                raise CorpusError(f"{path}:{lineno}: {problem}")
            questions.append(text)
    if not questions:
        raise CorpusError(f"{path}: no questions")
    return questions


def from_file(path: str | Path, seed: int = 0) -> Workload:
    return Workload(read_questions(path), seed, str(path))


def synth_corpus(out_dir: str | Path, tasks: int, seed: int = 7) -> Path:
    """Write (once) the synthetic corpus whose multi-hop questions `from_synth` asks; the same
    folder as `branchsearch synth DIR --tasks N --docs 8N --seed S` would write."""
    from branchsearch.infra.datasets.synth import synth

    out = Path(out_dir)
    if not (out / "corpus.jsonl").exists():
        synth(out, docs=max(8 * tasks, 8), tasks=tasks, seed=seed)
    return out


def from_synth(out_dir: str | Path, tasks: int, seed: int = 7) -> Workload:
    folder = synth_corpus(out_dir, tasks, seed)
    return Workload(read_questions(folder), seed, f"synth: {tasks} tasks, seed {seed}", folder)
