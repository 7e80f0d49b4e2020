"""Tables and cross-validation of a second-wave rule (chains, bridges: issue 34) from
`branchsearch eval` reports.

    python reports/chains/chain_cv.py [--grid b3,br1,br2,br3] NAME=DIR/PREFIX [...]
        each PREFIX has PREFIX-b1.json (1 branch), PREFIX-b3.json (3 branches, chains = 0) and
        PREFIX-c{1,2,3}.json (3 branches, BRANCHSEARCH_CHAINS=1|2|3), all one run each of
        `branchsearch eval ... --report`. Prints per set: every configuration on the whole set
        (for reading), then 5-fold CV inside the set (folds = question i mod 5; the chains value
        — or none — chosen on four folds by AR@5, then AR@10, then fewer tokens read; the
        fifth reported) and leave one set out (chosen on the other sets' questions pooled).
        `--grid`: other configurations than the chains' (b3 always the "none" among them),
        e.g. PREFIX-br{1,2,3}.json for BRANCHSEARCH_BRIDGES=1|2|3 (reports/bridges.md).
"""

from __future__ import annotations

import json
import sys

GRID = ("b3", "c1", "c2", "c3")  # b3 = no chains


def load(path: str) -> list[dict]:
    return json.load(open(path))["runs"][0]["per_query"]


def score(rows: list[dict]) -> tuple:
    n = max(len(rows), 1)
    ar5 = sum(r["metrics"]["all_recall@5"] for r in rows) / n
    ar10 = sum(r["metrics"]["all_recall@10"] for r in rows) / n
    tok = sum(r["metrics"]["tokens_read"] for r in rows) / n
    return ar5, ar10, -tok


def summary(rows: list[dict]) -> str:
    n = len(rows)
    m = lambda k: sum(r["metrics"].get(k, 0) for r in rows) / n  # noqa: E731
    att = [sum(r["attribution"] == a for r in rows) for a in
           ("ok", "retrieval_miss", "premature_prune", "early_stop", "overload")]
    return (f"{m('all_recall@5'):.3f} | {m('all_recall@10'):.3f} | {m('recall@5'):.3f} | "
            f"{m('branches'):.2f} | {m('chains') + m('bridges'):.2f} | {m('tokens_read'):,.0f} | "
            f"{'/'.join(map(str, att))}")


def main(args: list[str]) -> None:
    global GRID
    if args[:1] == ["--grid"]:
        GRID, args = tuple(args[1].split(",")), args[2:]
    sets = {}
    for a in args:
        name, prefix = a.split("=", 1)
        sets[name] = {c: load(f"{prefix}-{c}.json") for c in ("b1",) + GRID}
    for name, runs in sets.items():
        print(f"\n## {name}\n\n| config | AR@5 | AR@10 | R@5 | branches/q | next hops/q | tokens "
              "read | attribution |\n|---|---|---|---|---|---|---|---|")
        for c in ("b1",) + GRID:
            print(f"| {c} | {summary(runs[c])} |")
        picks, held = [], {c: [] for c in ("b1", "b3", "pick")}
        for f in range(5):
            train = {c: [r for i, r in enumerate(runs[c]) if i % 5 != f] for c in GRID}
            pick = max(GRID, key=lambda c: (score(train[c]), c == "b3"))
            picks.append(pick)
            for c in ("b1", "b3"):
                held[c] += [r for i, r in enumerate(runs[c]) if i % 5 == f]
            held["pick"] += [r for i, r in enumerate(runs[pick]) if i % 5 == f]
        print(f"\n5-fold picks: {picks}")
        for c in ("b1", "b3", "pick"):
            print(f"  held out {c}: {summary(held[c])}")
        fold_ok = []
        for f in range(5):
            test = lambda c: [r for i, r in enumerate(runs[c]) if i % 5 == f]  # noqa: E731
            b, p = score(test("b3")), score(test(picks[f]))
            fold_ok.append(p[0] >= b[0] and p[1] >= b[1])
        print(f"  folds where the pick's AR@5 and AR@10 >= no chains: {fold_ok}")
    if len(sets) > 1:
        print("\n## leave one set out\n")
        for out in sets:
            pooled = {c: [r for n, runs in sets.items() if n != out for r in runs[c]]
                      for c in GRID}
            pick = max(GRID, key=lambda c: (score(pooled[c]), c == "b3"))
            print(f"- {out}: chosen on the others = {pick}; b3 {summary(sets[out]['b3'])}; "
                  f"pick {summary(sets[out][pick])}")


if __name__ == "__main__":
    main(sys.argv[1:])
