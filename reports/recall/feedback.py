"""A feedback branch, measured offline (session 51; reports/recall/README.md): one search of the
question plus the words that its own branch's best documents share, fused so the question's
branch keeps its top 5 and the feedback list may only fill places 6-10.

    python reports/recall/branch_eval.py run DATASET INDEX ONE.json --home H --branches 1
    python reports/recall/feedback.py ONE.json FEEDBACK.json [--docs 3 --terms 10]
    python reports/recall/branch_eval.py pair ONE.json FEEDBACK.json --share 0

FEEDBACK.json is a dump of the same questions whose one branch is the feedback search (kind
`feedback`), so `branch_eval.py pair` fuses and scores it as it did session 10's second branches.
The rule (feedback documents, term count, idf weighting, fusion) was written down before the
first run; nothing here was tuned on a figure.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sqlite3
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from branch_eval import load_dump  # noqa: E402

from branchsearch.workers.text import STOPWORDS  # noqa: E402

_WORD = re.compile(r"[A-Za-z][A-Za-z'\-]*")


def words(text: str) -> list[str]:
    return [w for w in (m.group(0).lower().strip("'-") for m in _WORD.finditer(text))
            if len(w) >= 3 and w not in STOPWORDS]


def idf_table(docs_db: Path) -> tuple[dict[str, float], dict[str, str]]:
    db = sqlite3.connect(f"file:{docs_db}?mode=ro", uri=True)
    texts = dict(db.execute("select chunk_id, text from chunks"))
    db.close()
    df = Counter()
    for text in texts.values():
        df.update(set(words(text)))
    n = max(len(texts), 1)
    return {w: math.log(n / c) for w, c in df.items()}, texts


def expansion(question: str, feedback: list[str], idf: dict[str, float], n_terms: int) -> list[str]:
    """The `n_terms` words of the feedback chunks by tf x idf, none of them the question's."""
    asked = set(words(question))
    score = Counter()
    for text in feedback:
        for w, tf in Counter(words(text)).items():
            if w not in asked:
                score[w] += tf * idf.get(w, 0.0)
    return [w for w, _ in sorted(score.items(), key=lambda kv: (-kv[1], kv[0]))[:n_terms]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("one")
    ap.add_argument("out")
    ap.add_argument("--docs", type=int, default=3)
    ap.add_argument("--terms", type=int, default=10)
    ap.add_argument("--k", type=int, default=10)
    a = ap.parse_args()

    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.index.open import open_retriever

    dump = load_dump(a.one)
    settings = load_settings(None, {"home": dump["home"], "index": dump["index"]})
    idf, texts = idf_table(Path(dump["home"]) / "indexes" / dump["index"] / "docs.sqlite")
    retriever = open_retriever(settings)
    rows = []
    for row in dump["rows"]:
        anchor = row["branches"][0]
        top = anchor["ranked"][:a.docs]
        terms = expansion(row["question"], [texts.get(c, "") for c in top], idf, a.terms)
        query = row["question"] + " " + " ".join(terms)
        hits = retriever.search(query, settings.search_mode, a.k)
        ranked = [h.chunk_id for h in hits]
        branch = {"index": 1, "kind": "feedback", "weight": 0.5, "subquery": query,
                  "status": "ok", "termination": "finish", "ranked": ranked,
                  "retrieved": ranked, "pruned": [], "final_context": [],
                  "tokens_read": sum(len(texts.get(c, "").split()) for c in ranked),
                  "context_tokens_final": 0, "turns": 1, "latency_s": 0.0,
                  "searches": [["search_corpus", query]], "terms": terms}
        rows.append(dict(row, fused=ranked, branches=[branch]))
    Path(a.out).write_text(json.dumps(dict(dump, rows=rows, eval={"feedback": vars(a)})))
    print(f"{a.out}: {len(rows)} questions")


if __name__ == "__main__":
    main()
