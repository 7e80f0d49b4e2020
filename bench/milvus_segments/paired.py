"""Small and large collection searched in turn, so both see the same machine.

    python bench/milvus_segments/paired.py --uri URI --sizes 10000 1000000 [--queries 100]
        [--rounds 5] [--ef 64 128] [--json FILE]

`run.sh` measures each size in its own window minutes apart; on a shared 2-core machine the
10k median alone moved 2.4 -> 4.7 ms between runs of the same command, so one run's 1M / 10k
ratio says little. Here the collections `bench/milvus_scaling.py --keep` left on the server
(`scale_server_N`, complete and indexed) are searched alternately, query by query, as the
public caller (the agent's default: the `acl_key` filter and 20 excluded ids, 10 of the
caller's exact top 30 and 10 random, as in milvus_scaling.py). Each round gives a median per
size and their ratio; the figure is the median of the rounds' ratios (per `--ef`, the HNSW
search breadth). The collections are left as they were (run.sh removes the server's data).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from milvus_scaling import CONSISTENCY, vectors, visible  # noqa: E402

from branchsearch.infra.stores.milvus import IndexSpec, MilvusStore  # noqa: E402


def workload(n: int, dim: int, queries: int, seed: int):
    """(query vectors, excluded ids per query) for the public caller of collection n, made as
    milvus_scaling.py makes them."""
    data = vectors(n, dim)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, n, queries)
    qv = data[picks] + 0.3 / np.sqrt(dim) * rng.standard_normal((queries, dim)).astype(
        np.float32)
    qv /= np.linalg.norm(qv, axis=1, keepdims=True)
    seen = visible(n, None)
    excludes = []
    for j in range(queries):
        scores = np.where(seen, data @ qv[j], -np.inf)
        top30 = np.argpartition(-scores, 30)[:30]
        top30 = top30[np.argsort(-scores[top30])]
        ex = np.concatenate([top30[::3], rng.integers(0, n, 10)])
        excludes.append([f"d{i}#p0" for i in ex])
    return qv, excludes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--uri", required=True)
    ap.add_argument("--sizes", type=int, nargs=2, default=[10_000, 1_000_000])
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--ef", type=int, nargs="+", default=[64])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    small, large = args.sizes
    work = {n: workload(n, args.dim, args.queries, seed=1) for n in (small, large)}
    for ef in args.ef:
        paired(args, ef, work)


def paired(args, ef: int, work: dict) -> None:
    small, large = args.sizes
    stores = {}
    for n in (small, large):
        stores[n] = MilvusStore(args.uri, args.dim, collection=f"scale_server_{n}",
                                index=IndexSpec("HNSW", consistency=CONSISTENCY, ef=ef))
        stores[n].search(work[n][0][0], 10)  # loaded, warm
    rounds = []
    try:
        for r in range(args.rounds):
            lat = {small: [], large: []}
            for j in range(args.queries):
                for n in ((small, large) if j % 2 == 0 else (large, small)):
                    qv, ex = work[n]
                    t = time.perf_counter()
                    stores[n].search(qv[j], 10, exclude_ids=ex[j])
                    lat[n].append((time.perf_counter() - t) * 1000)
            row = {"ef": ef, "round": r + 1, "load": round(os.getloadavg()[0], 2),
                   f"ms_median_{small}": round(statistics.median(lat[small]), 2),
                   f"ms_median_{large}": round(statistics.median(lat[large]), 2)}
            row["ratio"] = round(row[f"ms_median_{large}"] / row[f"ms_median_{small}"], 3)
            rounds.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for store in stores.values():
            store.close()
    out = {"what": "paired", "ef": ef, "queries": args.queries, "rounds": rounds,
           "median_ratio": round(statistics.median(r["ratio"] for r in rounds), 3)}
    print(f"public caller, ef {ef}: {large:,} / {small:,} median latency ratio per round "
          f"{[r['ratio'] for r in rounds]}; median {out['median_ratio']}", flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
