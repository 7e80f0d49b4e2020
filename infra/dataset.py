"""BEIR-format evaluation sets: `queries.jsonl` and `qrels/test.tsv` beside `corpus.jsonl`."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path

from branchsearch.infra.errors import CorpusError


@dataclass
class Query:
    id: str
    text: str
    gold: dict[str, int] = field(default_factory=dict)  # doc id -> relevance grade
    answer: str = ""
    meta: dict = field(default_factory=dict)


def read_queries(folder: str | Path, split: str = "test") -> list[Query]:
    """Queries that have at least one positive qrel, in file order."""
    folder = Path(folder)
    qfile, qrels_file = folder / "queries.jsonl", folder / "qrels" / f"{split}.tsv"
    for f in (qfile, qrels_file):
        if not f.exists():
            raise CorpusError(f"{folder}: not a BEIR folder (missing {f.relative_to(folder)})")
    gold: dict[str, dict[str, int]] = {}
    with qrels_file.open(encoding="utf-8") as f:
        for lineno, row in enumerate(csv.reader(f, delimiter="\t"), start=1):
            if lineno == 1 and row and not row[-1].lstrip("-").isdigit():
                continue  # header
            if len(row) < 3 or not row[2].lstrip("-").isdigit():
                raise CorpusError(f"{qrels_file}:{lineno}: expected query-id, corpus-id, score")
            if int(row[2]) > 0:
                gold.setdefault(row[0], {})[row[1]] = int(row[2])
    queries = []
    with qfile.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                qid, text = str(row.get("_id", row.get("id"))), row["text"]
            except (json.JSONDecodeError, KeyError, AttributeError):
                raise CorpusError(f"{qfile}:{lineno}: expected {{'_id', 'text'}}") from None
            if qid in gold:
                meta = row.get("metadata") or {}
                queries.append(Query(qid, text, gold[qid], str(meta.get("answer") or ""), meta))
    if not queries:
        raise CorpusError(f"{folder}: no query has a positive qrel in {qrels_file.name}")
    return queries
