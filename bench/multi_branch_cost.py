"""What a question costs with the default branches against the same question with 1 branch, and
where the difference goes: the question's own branch vs the other branches (the planner's, and
the later waves': forks, chains, bridges), wall time and tool calls each.

    python bench/multi_branch_cost.py --home /tmp/bs --index hotpotqa-dev200 \\
        --queries ../shared/data/hotpotqa-dev200 [--n 200] [--executor ray] [--branches 3]

Each side runs in a fresh process of its own (for `--executor ray`, with its own local Ray
cluster), the questions in the same order: 1 branch, then `--branches` (default: the settings'
branches). So each reads every chunk for the first time as a new deployment would; a side that
ran after the other in one process would find the chunks' token counts and rows already cached.
Then each side searches every question once more (its chunks seen before). The sides alternate
for `--rounds` rounds (1, default, 1, default, ...), each in a fresh process, and each question
keeps its fastest round per side: a machine's drift between processes cancels. Only the questions
the default gives 2+ branches are reported ("forked questions"); medians over those of the
per-question ratios; one run. Second waves follow the settings (`BRANCHSEARCH_BRIDGES=0` turns
bridges off).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def side(args) -> None:
    """One side: every question with `--side` branches, twice; a JSON line per question."""
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.datasets.beir import read_queries
    from branchsearch.orchestrator.driver import Driver

    settings = load_settings(overrides={"home": args.home, "index": args.index})
    questions = [q.text for q in read_queries(args.queries)][: args.n]
    driver = Driver(settings, mode=args.executor)
    try:
        driver.search("Where is the warm-up question's answer?", max_branches=1)
        firsts = [driver.search(q, max_branches=args.side) for q in questions]
        for q, first in zip(questions, firsts):
            again = driver.search(q, max_branches=args.side)
            b = first.branches
            print(json.dumps({
                "first": first.metrics["latency_s"], "again": again.metrics["latency_s"],
                "own_ms": 1000 * b[0].latency_s if b else 0.0,
                "others_ms": 1000 * sum(x.latency_s for x in b[1:]),
                "own_calls": b[0].tool_calls if b else 0,
                "others_calls": sum(x.tool_calls for x in b[1:]),
                "kinds": [x.kind for x in b]}), flush=True)
    finally:
        driver.close()


def run_side(args, branches: int) -> list[dict]:
    cmd = [sys.executable, __file__, "--home", args.home, "--index", args.index, "--queries",
           str(args.queries), "--n", str(args.n), "--executor", args.executor,
           "--side", str(branches)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"bench: the {branches}-branch side failed:\n{out.stderr[-2000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def fastest(runs: list[list[dict]]) -> list[dict]:
    """Per question, its fastest round's figures (by first-time latency), with the fastest
    second-time latency."""
    out = []
    for rows in zip(*runs):
        best = dict(min(rows, key=lambda r: r["first"]))
        best["again"] = min(r["again"] for r in rows)
        out.append(best)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--home", default=".branchsearch")
    ap.add_argument("--index", default="hotpotqa-dev200")
    ap.add_argument("--queries", type=Path, required=True)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--executor", choices=("local", "ray"), default="local")
    ap.add_argument("--branches", type=int, default=0, help="the default side (0: settings)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--side", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        side(args)
        return
    if not args.branches:
        from branchsearch.infra.config.settings import load_settings

        args.branches = load_settings(overrides={"home": args.home}).branches
    rounds = [(run_side(args, 1), run_side(args, args.branches)) for _ in range(args.rounds)]
    one, many = (fastest([r[i] for r in rounds]) for i in (0, 1))
    rows = [(o, m) for o, m in zip(one, many) if len(m["kinds"]) >= 2]
    if not rows:
        print("no question was given 2+ branches")
        return

    def med(values) -> float:
        return statistics.median(values)

    kinds = Counter(k for _, m in rows for k in m["kinds"])
    print(f"{len(rows)} of {len(many)} questions given 2+ branches "
          f"({', '.join(f'{n} {k}' for k, n in kinds.most_common())}); {args.queries.name}, "
          f"{args.executor} executor, each side in its own process, the fastest of "
          f"{args.rounds} rounds")
    print("| | median |\n|---|---|")
    print(f"| {args.branches} branches / 1 branch, same question, chunks new to each | "
          f"{med(m['first'] / o['first'] for o, m in rows):.2f}x |")
    print(f"| {args.branches} branches / 1 branch, same question, chunks seen before | "
          f"{med(m['again'] / o['again'] for o, m in rows):.2f}x |")
    print(f"| the question's own branch, ms (tool calls) | {med(m['own_ms'] for _, m in rows):.1f}"
          f" ({med(m['own_calls'] for _, m in rows):.0f}) |")
    print(f"| the other branches together, ms (tool calls) | "
          f"{med(m['others_ms'] for _, m in rows):.1f} "
          f"({med(m['others_calls'] for _, m in rows):.0f}) |")
    print(f"| the same question, 1 branch, ms (tool calls) | {med(o['own_ms'] for o, _ in rows):.1f}"
          f" ({med(o['own_calls'] for o, _ in rows):.0f}) |")
    print(f"| question latency, ms: 1 branch / {args.branches} branches | "
          f"{1000 * med(o['first'] for o, _ in rows):.1f} / "
          f"{1000 * med(m['first'] for _, m in rows):.1f} |")


if __name__ == "__main__":
    main()
