"""The scaling table and the capacity model of reports/scaling.md, computed from measured rows.

    python bench/scaling_model.py --rows /tmp/scale/rows.jsonl \\
        [--searches 18.5 --turns 3.5]   # per question, 1 branch (bench/scaling_batch.py --calls)

Reads the JSON lines of bench/milvus_scaling.py (--json) and prints: the measured table; the
per-agent-question dense-search time at each size, COMPUTED from the measured per-search
medians (searches run in turns of concurrent calls, so a question costs between
turns x median (every turn's searches in parallel) and searches x median (one after another));
PROJECTED figures (log fit for HNSW, linear for FLAT) for sizes not measured; and the
projections to 1 B chunks whose inputs are printed beside them. Nothing here is timed.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np


def load(path: Path) -> list[dict]:
    rows = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        rows[(r["backend"], r["n"])] = r  # the last run of a size wins
    return sorted(rows.values(), key=lambda r: (r["backend"], r["n"]))


def fit(rows: list[dict], backend: str, key: str, log: bool):
    pts = [(r["n"], r[key]) for r in rows if r["backend"] == backend and r.get(key) is not None]
    if len(pts) < 2:
        return None
    x = np.array([math.log(n) if log else n for n, _ in pts], float)
    b, a = np.polyfit(x, np.array([v for _, v in pts], float), 1)
    return lambda n: a + b * (math.log(n) if log else n)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=Path, required=True)
    ap.add_argument("--searches", type=float, default=18.5, help="searches per question")
    ap.add_argument("--turns", type=float, default=3.5, help="retriever round trips per question")
    ap.add_argument("--project", type=int, nargs="*", default=[1_000_000])
    args = ap.parse_args()
    rows = load(args.rows)

    print("MEASURED (bench/milvus_scaling.py; synthetic clustered 384-d unit vectors)\n")
    print("| backend | index | N | insert s (rows/s) | index build s | search ms median | p95 | "
          "recall@10 vs exact | Milvus CPU ms/search | RSS MB | load (1 min) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {'Milvus Lite' if r['backend'] == 'lite' else 'Milvus 2.3.5 server'} | "
              f"{r['index']} | {r['n']:,} | {r['insert_s']} ({r.get('insert_rows_s', '')}) | "
              f"{r['index_build_s'] if r['backend'] == 'server' else '–'} | "
              f"{r['search_ms_median']} | {r.get('search_ms_p95', '')} | {r['recall_at_10']} | "
              f"{r.get('server_cpu_ms_per_search', '')} | {r['server_rss_mb']} | "
              f"{r['load'][0] if r.get('load') else ''} |")

    print(f"\nCOMPUTED per agent question (1 branch: {args.searches} searches in {args.turns} "
          "turns), dense-search time only, from the medians above:\n")
    print("| backend | N | per question, turns in parallel (s) | per question, serial (s) |")
    print("|---|---|---|---|")
    for r in rows:
        m = r["search_ms_median"] / 1000
        print(f"| {r['backend']} | {r['n']:,} | {args.turns * m:.2f} | "
              f"{args.searches * m:.2f} |")

    print("\nPROJECTED (fits through the measured sizes; not measured):\n")
    print("| backend | N | search ms median | per question serial s | RSS MB | insert s |")
    print("|---|---|---|---|---|---|")
    for backend, log in (("lite", False), ("server", True), ("server", False)):
        lat = fit(rows, backend, "search_ms_median", log)
        rss = fit(rows, backend, "server_rss_mb", False)
        ins = fit(rows, backend, "insert_s", False)
        have = {r["n"] for r in rows if r["backend"] == backend}
        for n in args.project:
            if n in have or lat is None:
                continue
            print(f"| {backend} ({'linear' if not log else 'a + b ln N'} fit) | {n:,} | "
                  f"{lat(n):,.0f} | {args.searches * lat(n) / 1000:,.1f} | "
                  f"{rss(n):,.0f} | {ins(n):,.0f} |")

    server = [r for r in rows if r["backend"] == "server" and r.get("server_rss_mb")]
    if len(server) >= 2:
        lo, hi = server[0], server[-1]
        per_vec = (hi["server_rss_mb"] - lo["server_rss_mb"]) * 2**20 / (hi["n"] - lo["n"])
        print(f"\nMEASURED slope: milvus RSS grows {per_vec:.0f} B per vector between "
              f"{lo['n']:,} and {hi['n']:,} (raw float32 384-d: 1,536 B)")


if __name__ == "__main__":
    main()
