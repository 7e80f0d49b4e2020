"""Tables and the AR part of v21's gate (reports/bridges.md, "v21: a hop beyond the bridges")
from `branchsearch eval` reports.

    python reports/chains/depth_gate.py DIR SET [SET ...]
        reads DIR/SET-B1.json (--branches 1), DIR/SET-A.json (the defaults), DIR/SET-C.json
        (--branches 4, bridge_depth 2) and DIR/SET-D.json (--branches 4, bridge_depth 3), one
        run each of `branchsearch eval ... --report`; a missing one is left out. Prints per set
        every variant on the whole set (AR@5 | AR@10 | R@5 | nDCG@10 | branches | bridges per
        question | tokens read | attribution ok/miss/premature prune/early stop/overload), AR@5 /
        AR@10 on each fold (question i mod 5), tokens read over one branch on the questions each
        variant bridged, the questions on which D and A (or C) differ, and whether AR@5 and
        AR@10 of D are >= A's on the set and on every fold.
"""

from __future__ import annotations

import json
import os
import sys

VARIANTS = ("B1", "A", "C", "D")
ATTRIBUTION = ("ok", "retrieval_miss", "premature_prune", "early_stop", "overload")
EPS = 1e-9


def load(folder: str, name: str, variant: str) -> list[dict] | None:
    path = os.path.join(folder, f"{name}-{variant}.json")
    return json.load(open(path))["runs"][0]["per_query"] if os.path.exists(path) else None


def mean(rows: list[dict], key: str) -> float:
    return sum(r["metrics"].get(key, 0) for r in rows) / max(len(rows), 1)


def folds(rows: list[dict]) -> list[list[dict]]:
    return [[r for i, r in enumerate(rows) if i % 5 == f] for f in range(5)]


def not_below(d: list[dict], a: list[dict]) -> bool:
    """AR@5 and AR@10 of `d` at least `a`'s, on the whole set and on every fold."""
    pairs = [(d, a)] + list(zip(folds(d), folds(a)))
    return all(mean(x, k) >= mean(y, k) - EPS for x, y in pairs
               for k in ("all_recall@5", "all_recall@10"))


def moved(d: list[dict], other: list[dict], key: str) -> tuple[list[str], list[str]]:
    up = [x["id"] for x, y in zip(d, other) if x["metrics"][key] > y["metrics"][key] + EPS]
    down = [x["id"] for x, y in zip(d, other) if x["metrics"][key] < y["metrics"][key] - EPS]
    return up, down


def report(folder: str, name: str) -> None:
    runs = {v: rows for v in VARIANTS if (rows := load(folder, name, v))}
    if not runs:
        return
    print(f"## {name}\n\n| variant | AR@5 | AR@10 | R@5 | nDCG@10 | branches | bridges | tokens "
          "| attribution |\n|---|---|---|---|---|---|---|---|---|")
    for v, rows in runs.items():
        att = "/".join(str(sum(r["attribution"] == a for r in rows)) for a in ATTRIBUTION)
        print(f"| {v} | {mean(rows, 'all_recall@5'):.3f} | {mean(rows, 'all_recall@10'):.3f} | "
              f"{mean(rows, 'recall@5'):.3f} | {mean(rows, 'ndcg@10'):.4f} | "
              f"{mean(rows, 'branches'):.2f} | {mean(rows, 'bridges'):.2f} | "
              f"{mean(rows, 'tokens_read'):,.0f} | {att} |")
    print("\n| variant | fold 0 | fold 1 | fold 2 | fold 3 | fold 4 |\n|---|---|---|---|---|---|")
    for v, rows in runs.items():
        cells = [f"{mean(f, 'all_recall@5'):.3f} / {mean(f, 'all_recall@10'):.3f}"
                 for f in folds(rows)]
        print(f"| {v} | " + " | ".join(cells) + " |")
    one = runs.get("B1")
    for v in ("A", "C", "D"):
        rows = runs.get(v)
        if rows and one:
            assert [r["id"] for r in rows] == [r["id"] for r in one], "question order differs"
            bridged = [i for i, r in enumerate(rows) if r["metrics"].get("bridges", 0) > 0]
            ratio = (sum(rows[i]["metrics"]["tokens_read"] for i in bridged)
                     / max(sum(one[i]["metrics"]["tokens_read"] for i in bridged), 1))
            print(f"\ntokens read, {v} / one branch, on the {len(bridged)} questions {v} "
                  f"bridged: {ratio:.2f}x", end="")
    print()
    d = runs.get("D")
    for v in ("A", "C"):
        other = runs.get(v)
        if d and other:
            for key in ("all_recall@5", "all_recall@10", "recall@10", "ndcg@10"):
                up, down = moved(d, other, key)
                print(f"D against {v}, {key}: up {len(up)} {up}, down {len(down)} {down}")
            same = sum(x["ranking"] == y["ranking"] for x, y in zip(d, other))
            print(f"D against {v}: the same top 10 on {same} of {len(d)} questions")
    if d and runs.get("A"):
        print(f"AR@5 and AR@10 of D >= A on the set and every fold: {not_below(d, runs['A'])}")
    print()


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    for name in sys.argv[2:]:
        report(sys.argv[1], name)
