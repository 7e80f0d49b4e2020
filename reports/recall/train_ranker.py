"""Train, cross-evaluate and ship the heuristic policy's learned final ranker (workers/ranker.py).

1. Dump trajectories with every scored chunk's features (learned ranking off, so the dump is the
   heuristic's own episodes; the ranker only reorders the finish, so the trajectories are the
   same with it on):

       BRANCHSEARCH_SEARCH_MODE=bm25 python reports/recall/branch_eval.py run \\
           ../shared/data/hotpotqa-dev200 hotpotqa-dev200 FEAT-hotpot.json --home H --features

2. Fit on one dump, report on every dump (leave one data set out), and optionally ship:

       python reports/recall/train_ranker.py FEAT-hotpot.json FEAT-musique.json FEAT-synth.json \\
           --on hotpotqa-dev200 [--write workers/ranker_weights.json]

   Model: linear over `workers.ranker.FEATURES`, the heuristic's own score at weight 1 and the
   other weights chosen by coordinate ascent on the measure itself (AR@5 + 0.3 AR@10 of the
   question's own branch on the fit set; see `fit`). A pairwise logistic (RankNet) fit was
   tried first: it gained on its fit set and lost on the others (reports/recall/README.md).
   Labels: a document is positive when it is in the question's qrels. Nothing in the model or
   the features reads a data set's ids or strings; only the fit set's labels.
   Reported: AR@5 / AR@10 / R@5 of the question's own branch (= 1 branch) and of the fused
   branches (anchored RRF over each branch's learned ranking, every branch the planner ran), against
   the heuristic's own score (the same dump: the ranking it returned).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from branch_eval import fused, plan_rule, score  # noqa: E402

from branchsearch.workers.rank import doc_of, final_ranking  # noqa: E402
from branchsearch.workers.ranker import FEATURES, LinearRanker  # noqa: E402


def load(paths: list[str]) -> dict[str, list[dict]]:
    return {json.loads(Path(p).read_text())["index"]: json.loads(Path(p).read_text())["rows"]
            for p in paths}


def episodes(rows: list[dict], kind: str = "original") -> list[tuple]:
    """Per question, the question's own branch: (features [n x d], document index of each
    chunk, number of documents, which documents are gold, how many gold documents)."""
    out = []
    for row in rows:
        gold = set(row["gold"])
        b = next((b for b in row["branches"] if b["kind"] == kind and b.get("features")), None)
        if b is None:
            continue
        ids = list(b["features"])
        docs = sorted({doc_of(c) for c in ids})
        where = {d: i for i, d in enumerate(docs)}
        out.append((np.asarray([b["features"][c] for c in ids], dtype=float),
                    np.asarray([where[doc_of(c)] for c in ids]), len(docs),
                    np.asarray([d in gold for d in docs]), len(gold)))
    return out


def all_recall(eps: list[tuple], w: np.ndarray) -> tuple[float, float]:
    """AR@5 and AR@10 of documents ordered by their best chunk's score (the document order of
    `final_ranking`; ties by document id)."""
    at5 = at10 = 0
    for X, doc, n, gold, n_gold in eps:
        s = X @ w
        best = np.full(n, -np.inf)
        np.maximum.at(best, doc, s)
        hit = gold[np.argsort(-best, kind="stable")]
        at5 += hit[:5].sum() == n_gold
        at10 += hit[:10].sum() == n_gold
    return at5 / max(len(eps), 1), at10 / max(len(eps), 1)


def grid(limit: float) -> np.ndarray:
    return np.round(np.arange(-limit, limit + 1e-9, 0.05), 2)


def fit(sets: list[list[dict]], rounds: int = 3, limit: float = 0.6) -> LinearRanker:
    """Coordinate ascent on the measure itself: the weight of the heuristic's score is fixed at
    1 (the model is a correction to it); every other weight in turn takes the value of `GRID`
    that maximises AR@5 + 0.3 AR@10 on the fit sets (each set counts equally), ties going to
    the smaller |weight|; until a round changes nothing. Deterministic."""
    eps = [episodes(rows) for rows in sets]
    w = np.zeros(len(FEATURES))
    w[FEATURES.index("score")] = 1.0

    def objective(w):
        return sum(a5 + 0.3 * a10 for a5, a10 in (all_recall(e, w) for e in eps)) / len(eps)

    best = objective(w)
    for _ in range(rounds):
        changed = False
        for j, name in enumerate(FEATURES):
            if name == "score":
                continue
            for value in grid(limit):
                trial = w.copy()
                trial[j] = value
                o = objective(trial)
                if o > best + 1e-9 or (abs(o - best) <= 1e-9 and abs(value) < abs(w[j])):
                    changed |= o > best + 1e-9
                    best, w = o, trial
        if not changed:
            break
    n = len(FEATURES)
    return LinearRanker(FEATURES, tuple(float(x) for x in w), (0.0,) * n, (1.0,) * n,
                        {"objective": "AR@5 + 0.3 AR@10 (coordinate ascent, score weight 1)",
                         "grid": [-limit, limit, 0.05],
                         "fit_objective": round(float(best), 4)})


def rerank(row: dict, ranker: LinearRanker | None, branch: dict, k: int = 10) -> list[str]:
    if ranker is None or not branch.get("features"):
        return branch["ranked"]
    return final_ranking(ranker.scores(branch["features"]), k)


def evaluate(rows: list[dict], ranker: LinearRanker | None, plan: str = "all",
             titles=None, texts=None) -> dict:
    keep = plan_rule(plan)

    def one(r):
        return rerank(r, ranker, r["branches"][0])

    def many(r):
        rr = dict(r, branches=[dict(b, ranked=rerank(r, ranker, b)) for b in r["branches"]])
        return fused(rr, keep, 0.2, 5, 0.0)

    out = {}
    for name, ranking, branches in (("1br", one, lambda r: r["branches"][:1]),
                                    ("3br", many, lambda r: keep(r["branches"]))):
        m = score(rows, ranking, branches, titles, texts)
        out[name] = {k: m[k] for k in ("all_recall@5", "all_recall@10", "recall@5")}
        if "attribution" in m:
            out[name]["attribution"] = m["attribution"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dumps", nargs="+")
    ap.add_argument("--on", action="append", default=[],
                    help="fit on this index (repeat for several); default: each in turn")
    ap.add_argument("--limit", type=float, default=0.6, help="weights in [-limit, limit]")
    ap.add_argument("--held-out", action="store_true",
                    help="also fit on every pair of dumps and report on the third")
    ap.add_argument("--write", default="")
    a = ap.parse_args()
    dumps = load(a.dumps)
    fits = [a.on] if a.on else [[name] for name in dumps]
    report = {"heuristic": {n: evaluate(rows, None) for n, rows in dumps.items()}}
    if a.held_out and not a.on:
        fits += [[n for n in dumps if n != held] for held in dumps]
    for on in fits:
        ranker = fit([dumps[n] for n in on], limit=a.limit)
        ranker.meta["fit_on"] = on
        report["+".join(on)] = {n: evaluate(rows, ranker) for n, rows in dumps.items()}
        report["+".join(on) + " weights"] = {f: w for f, w in zip(FEATURES, ranker.weights) if w}
        if a.write:
            Path(a.write).write_text(json.dumps(ranker.to_json(), indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
