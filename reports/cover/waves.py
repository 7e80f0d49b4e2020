"""Where a 3-branch question's time goes through Ray, by the shape of its waves, against the
same question in-process (reports/cover.md, "Ray by wave shape").

    python reports/cover/waves.py ray   --home /tmp/bs-home --index hotpot-hd --queries DATA
    python reports/cover/waves.py local --home /tmp/bs-home --index hotpot-hd --queries DATA
    python reports/cover/waves.py compare

Each run asks the dev questions 20.. (the first 20 warm the driver) with `max_branches=3`,
the home's embedding cache warm; a Ray run records each `RayExecutor._run` call (a wave: its
branches, wall ms, the branches' own latencies). `compare` pairs the two runs per question.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict


def record(mode: str, home: str, index: str, queries: str, out: str) -> None:
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.datasets.beir import read_queries
    from branchsearch.orchestrator.driver import Driver
    from branchsearch.orchestrator.execution import ray as rx

    waves: list = []
    plain = rx.RayExecutor._run

    def timed(self, tasks, settings, policy_factory, on_event, share=None):
        started = time.perf_counter()
        reports = plain(self, tasks, settings, policy_factory, on_event, share)
        waves.append((len(tasks), (time.perf_counter() - started) * 1000,
                      [r.latency_s * 1000 for r in reports]))
        return reports

    rx.RayExecutor._run = timed
    settings = load_settings(overrides={"home": home, "index": index})
    questions = [q.text for q in read_queries(queries)]
    driver = Driver(settings, mode=mode, pool_size=3) if mode == "ray" else Driver(settings,
                                                                                   mode=mode)
    for q in questions[:20]:
        driver.search(q, max_branches=3)
    rows = []
    for q in questions[20:]:
        waves.clear()
        started = time.perf_counter()
        driver.search(q, max_branches=3)
        rows.append({"wall_ms": (time.perf_counter() - started) * 1000, "waves": list(waves)})
    driver.close()
    json.dump(rows, open(out, "w"))


def compare(ray_rows: list, local_rows: list) -> None:
    by_shape = defaultdict(list)
    for r, local in zip(ray_rows, local_rows):
        by_shape[tuple(w[0] for w in r["waves"])].append((r, local))
    print("| waves (branches each) | questions | Ray ms | in-process ms | Ray wave ms | "
          "branches' own ms |")
    print("|---|---|---|---|---|---|")
    for shape, pairs in sorted(by_shape.items(), key=lambda kv: -len(kv[1])):
        med = lambda xs: round(statistics.median(xs), 1)  # noqa: E731
        waves = [med(r["waves"][i][1] for r, _ in pairs) for i in range(len(shape))]
        own = [med(sum(r["waves"][i][2]) for r, _ in pairs) for i in range(len(shape))]
        print(f"| {shape} | {len(pairs)} | {med(r['wall_ms'] for r, _ in pairs)} | "
              f"{med(x['wall_ms'] for _, x in pairs)} | {waves} | {own} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["ray", "local", "compare"])
    ap.add_argument("--home", default="/tmp/bs-home")
    ap.add_argument("--index", default="hotpot-hd")
    ap.add_argument("--queries", default="../shared/data/hotpotqa-dev200")
    ap.add_argument("--out", default="/tmp/waves")
    args = ap.parse_args()
    if args.mode == "compare":
        compare(json.load(open(f"{args.out}-ray.json")), json.load(open(f"{args.out}-local.json")))
    else:
        record(args.mode, args.home, args.index, args.queries, f"{args.out}-{args.mode}.json")


if __name__ == "__main__":
    main()
