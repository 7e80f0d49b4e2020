"""How often a BM25 search for a page's title finds that page: the entity searches of the
heuristic policy are such searches ('Kansas', 'Johann Strauss II').

    python reports/recall/title_search.py HOME INDEX BEIR_DIR [BEIR_DIR ...]

For every gold document of each BEIR folder's qrels, searches the index (BM25) for the
document's bare title (`workers.text.bare_title`: no parenthetical or comma qualifier) and
prints the share of them found at rank 1, in the top 3 (the policy's entity_k) and in the top 10.
Run it on an index ingested before and after a change to the lexical store.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

from branchsearch.infra.index.open import open_retriever
from branchsearch.infra.config.settings import load_settings
from branchsearch.workers.text import bare_title


def main(home: str, index: str, folders: list[str]) -> None:
    settings = load_settings(overrides={"home": home, "index": index, "search_mode": "bm25"},
                             read_env=False, read_file=False)
    retriever = open_retriever(settings, need_dense=False)
    try:
        for folder in map(Path, folders):
            gold = sorted({row[1] for qrels in (folder / "qrels").glob("*.tsv")
                           for row in csv.reader(qrels.open(), delimiter="\t")
                           if row and row[0] != "query-id"})
            titles = _titles(folder, set(gold))
            found = {1: 0, 3: 0, 10: 0}
            for doc_id in gold:
                ranked = [h.doc_id for h in retriever.search(bare_title(titles[doc_id]),
                                                             mode="bm25", k=10)]
                for k in found:
                    found[k] += doc_id in ranked[:k]
            n = max(len(gold), 1)
            print(f"{folder.name}: {len(gold)} gold documents; title search finds the page at "
                  f"rank 1 {found[1] / n:.3f}, top 3 {found[3] / n:.3f}, top 10 "
                  f"{found[10] / n:.3f}")
    finally:
        retriever.close()


def _titles(folder: Path, wanted: set[str]) -> dict[str, str]:
    corpus = folder / "corpus.jsonl"
    if not corpus.exists():  # a pooled set's folder shares the pool's corpus
        corpus = folder.parent / "corpus.jsonl"
    out = {}
    with corpus.open() as f:
        for line in f:
            doc = json.loads(line)
            if doc["_id"] in wanted:
                out[doc["_id"]] = doc.get("title", "")
    return out


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
