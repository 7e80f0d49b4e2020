"""What a question planned to 2+ branches costs against the same question with 1 branch, in one
process (the CLI's default path), and where the difference goes: the question's own branch vs
the planner's other branches (wall time and tool calls each).

    python bench/multi_branch_cost.py --home /tmp/bs --index hotpotqa-dev200 \\
        --queries ../shared/data/hotpotqa-dev200 [--n 200] [--executor ray]

Every question is searched with 3 branches first (its chunks counted for the first time, as a
new question's are), then with 1 branch, then with 3 again; only the questions the planner
gives 2+ branches are reported. Medians over those questions; one run. Second waves (forks,
chains, bridges) count as the planner's other branches: turn them on with the settings
(`BRANCHSEARCH_BRIDGES=2`). `--executor ray`: the branches as Ray actors, in parallel.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from branchsearch.infra.config.settings import load_settings  # noqa: E402
from branchsearch.infra.datasets.beir import read_queries  # noqa: E402
from branchsearch.orchestrator.driver import Driver  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--home", default=".branchsearch")
    ap.add_argument("--index", default="hotpotqa-dev200")
    ap.add_argument("--queries", type=Path, required=True)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--executor", choices=("local", "ray"), default="local")
    args = ap.parse_args()
    settings = load_settings(overrides={"home": args.home, "index": args.index})
    questions = [q.text for q in read_queries(args.queries)][: args.n]
    driver = Driver(settings, mode=args.executor)
    driver.search(questions[0], max_branches=1)  # warm-up
    rows = []
    for q in questions:
        first = driver.search(q, max_branches=3)
        if len(first.branches) < 2:
            continue
        one = driver.search(q, max_branches=1)
        again = driver.search(q, max_branches=3)
        rows.append({"one": one.metrics["latency_s"], "first": first.metrics["latency_s"],
                     "again": again.metrics["latency_s"],
                     "own_ms": 1000 * first.branches[0].latency_s,
                     "others_ms": 1000 * sum(b.latency_s for b in first.branches[1:]),
                     "one_ms": 1000 * one.branches[0].latency_s,
                     "own_calls": first.branches[0].tool_calls,
                     "others_calls": sum(b.tool_calls for b in first.branches[1:]),
                     "one_calls": one.branches[0].tool_calls,
                     "kinds": [b.kind for b in first.branches]})
    driver.close()
    if not rows:
        print("no question was planned to 2+ branches")
        return

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    kinds = Counter(k for r in rows for k in r["kinds"])
    print(f"{len(rows)} of {len(questions)} questions planned to 2+ branches "
          f"({', '.join(f'{n} {k}' for k, n in kinds.most_common())}); {args.queries.name}, "
          f"{args.executor} executor")
    print("| | median |\n|---|---|")
    print(f"| 3 branches (first time) / 1 branch, same question | "
          f"{statistics.median(r['first'] / r['one'] for r in rows):.2f}x |")
    print(f"| 3 branches (chunks counted before) / 1 branch | "
          f"{statistics.median(r['again'] / r['one'] for r in rows):.2f}x |")
    print(f"| the question's own branch, ms (tool calls) | {med('own_ms'):.1f} "
          f"({med('own_calls'):.0f}) |")
    print(f"| the other branches together, ms (tool calls) | {med('others_ms'):.1f} "
          f"({med('others_calls'):.0f}) |")
    print(f"| the same question, 1 branch, ms (tool calls) | {med('one_ms'):.1f} "
          f"({med('one_calls'):.0f}) |")


if __name__ == "__main__":
    main()
