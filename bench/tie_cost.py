#!/usr/bin/env python
"""What breaking ties by chunk id costs a store's search (`infra.stores.protocols.settle`).

For every query of a BEIR folder, times each store's list with the tie-break (`store.search`)
and without it (the engine's own list: `type(store).search.__wrapped__`), alternating the two,
and counts the requests `settle` made (one, unless a tie crossed the k-th place). Copies the
index's tantivy folder and Milvus Lite file first: the index itself is only read.

    python bench/tie_cost.py /work/shared/data/hotpotqa-dev200 \\
        --index-dir /tmp/bs-home/indexes/hotpotqa-dev200 --k 10 50

Prints one JSON line per (store, k): medians in ms, extra requests, lists whose set changed.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def timed(call) -> tuple[float, object]:
    start = time.perf_counter()
    out = call()
    return (time.perf_counter() - start) * 1000, out


def engine(store, method: str, query, k: int):
    """The engine's own list: the store's method without the tie-break."""
    return getattr(type(store), method).__wrapped__(store, query, k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", type=Path, help="BEIR folder (its queries.jsonl)")
    parser.add_argument("--index-dir", type=Path, required=True)
    parser.add_argument("--tantivy", type=Path, help="another tantivy folder to use")
    parser.add_argument("--k", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--patterns", nargs="+",
                        default=["film", "19[0-9]{2}", "american", "born", "[a-z]+ville", "album",
                                 "river", "war", "singer", "football", "kiss", "wood"])
    args = parser.parse_args()

    from branchsearch.infra.models.embedder import Embedder
    from branchsearch.infra.models.static_tune import fitted_folder
    from branchsearch.infra.stores import protocols
    from branchsearch.infra.stores.milvus import MilvusStore, collection_for
    from branchsearch.infra.stores.tantivy import TantivyStore

    queries = [json.loads(line)["text"] for line in open(args.data / "queries.jsonl")]
    queries = queries[:args.queries]
    work = Path(tempfile.mkdtemp(prefix="tie-cost-"))
    shutil.copytree(args.tantivy or args.index_dir / "tantivy", work / "tantivy")
    shutil.copy(args.index_dir / "dense.db", work / "dense.db")
    manifest = json.loads((args.index_dir / "manifest.json").read_text())
    lexical = TantivyStore(work / "tantivy")
    dense = MilvusStore(work / "dense.db", manifest["embedding"]["dim"], create=False,
                        collection=collection_for(args.index_dir.name))
    vectors = Embedder(manifest["embedding"]["model"], teacher_queries=True,  # as a search
                       static_folder=fitted_folder(args.index_dir)).embed_queries(queries)

    depths: list[int] = []
    settle = protocols.settle

    def counting(fetch, k, cap=protocols.MAX_K):
        def counted(depth):
            depths.append(depth)
            return fetch(depth)
        return settle(counted, k, cap)

    protocols.settle = counting  # the decorator looks `settle` up when it runs
    jobs = [("tantivy bm25", lexical, "search", queries),
            ("tantivy grep", lexical, "grep", args.patterns),
            ("milvus-lite dense", dense, "search", list(vectors))]
    try:
        for name, store, method, inputs in jobs:
            for k in args.k:
                settled_ms, raw_ms, requests, changed = [], [], [], 0
                for _ in range(2):  # the first pass warms caches; the second is measured
                    settled_ms.clear(), raw_ms.clear(), requests.clear()
                    changed = 0
                    for query in inputs:
                        depths.clear()
                        ms, mine = timed(lambda: getattr(store, method)(query, k))
                        settled_ms.append(ms)
                        requests.append(len(depths))
                        ms, raw = timed(lambda: engine(store, method, query, k))
                        raw_ms.append(ms)
                        changed += {h.chunk_id for h in mine} != {h.chunk_id for h in raw}
                print(json.dumps({
                    "store": name, "k": k, "calls": len(inputs),
                    "engine_ms_p50": round(statistics.median(raw_ms), 3),
                    "settled_ms_p50": round(statistics.median(settled_ms), 3),
                    "ratio_p50": round(statistics.median(settled_ms) / statistics.median(raw_ms),
                                       3),
                    "engine_ms_mean": round(statistics.mean(raw_ms), 3),
                    "settled_ms_mean": round(statistics.mean(settled_ms), 3),
                    "calls_with_extra_requests": sum(r > 1 for r in requests),
                    "requests_max": max(requests),
                    "lists_whose_set_changed": changed}), flush=True)
    finally:
        protocols.settle = settle
        dense.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
