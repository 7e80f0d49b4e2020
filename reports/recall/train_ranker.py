"""Train, cross-evaluate and ship the heuristic policy's learned final ranker (workers/ranker.py).

1. Dump trajectories with every scored chunk's features (learned ranking off, so the dump is the
   heuristic's own episodes; the ranker only reorders the finish, so the trajectories are the
   same with it on):

       BRANCHSEARCH_SEARCH_MODE=bm25 python reports/recall/branch_eval.py run \\
           ../shared/data/hotpotqa-dev200 hotpotqa-dev200 FEAT-hotpot.json --home H --features

2. Fit on one dump, report on every dump (leave one data set out), and optionally ship:

       python reports/recall/train_ranker.py FEAT-hotpot.json FEAT-musique.json FEAT-synth.json \\
           --on hotpotqa-dev200 --on synth [--write workers/ranker_weights.json]

   One ranker per search mode (`workers.ranker.weights_for`): BM25 dumps (as above) ship as
   `ranker_weights.json`, dumps of a hybrid index with `BRANCHSEARCH_SEARCH_MODE` unset as
   `ranker_weights_hybrid.json`. The shipped ones: both fit on hotpot + synth, one fit each.

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
import sqlite3
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from branch_eval import docstore_text, fused, load_dump, plan_rule, score  # noqa: E402

from branchsearch.workers.heuristic import HeuristicConfig  # noqa: E402
from branchsearch.workers.rank import crowd, doc_of, final_ranking, hold_back  # noqa: E402
from branchsearch.workers.heuristic.ranker import FEATURES, LinearRanker, load_ranker  # noqa: E402
from branchsearch.workers.text import norm_title  # noqa: E402


SEARCH_K = HeuristicConfig.search_k  # the places a question tail's hits never take
PER_TITLE = HeuristicConfig.per_title


def load(paths: list[str]) -> dict[str, list[dict]]:
    """Each dump's rows, each row with `titles` (document id -> title, from the index's
    docstore) for the policy's title crowding (`rerank`)."""
    out = {}
    for path in paths:
        d = load_dump(path)
        try:
            titles, _ = docstore_text(d)
        except sqlite3.Error:  # the index is gone: rank without crowding, as the fit does
            titles = {}
        # two dumps of one index (the pooled corpus's hotpot and musique questions) are two
        # sets: the second is named INDEX:FILE (it replaced the first before)
        name = d["index"] if d["index"] not in out else f"{d['index']}:{Path(path).stem}"
        out[name] = [dict(row, titles=titles) for row in d["rows"]]
    return out


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


def all_recall(eps, w: np.ndarray) -> tuple[float, float]:
    """AR@5 and AR@10 of documents ordered by their best chunk's score (the document order of
    `final_ranking`; ties by document id). `eps`: `episodes(...)` or its `stack`."""
    if not isinstance(eps, Stack):
        eps = stack(eps)
    if not eps.n:
        return 0.0, 0.0
    best = np.full(eps.docs, -np.inf)
    np.maximum.at(best, eps.doc, eps.X @ w)
    order = np.lexsort((-best, eps.episode))  # by episode, then best first (stable: doc id)
    place = np.empty(eps.docs, dtype=int)
    place[order] = np.arange(eps.docs) - eps.start[eps.episode[order]]
    found5 = np.bincount(eps.episode[eps.gold & (place < 5)], minlength=eps.n)
    found10 = np.bincount(eps.episode[eps.gold & (place < 10)], minlength=eps.n)
    return float(np.mean(found5 == eps.n_gold)), float(np.mean(found10 == eps.n_gold))


def recall5(eps: Stack, w: np.ndarray) -> float:
    """R@5 (the share of a question's gold documents in its top 5), for the `smooth` objective."""
    best = np.full(eps.docs, -np.inf)
    np.maximum.at(best, eps.doc, eps.X @ w)
    order = np.lexsort((-best, eps.episode))
    place = np.empty(eps.docs, dtype=int)
    place[order] = np.arange(eps.docs) - eps.start[eps.episode[order]]
    found5 = np.bincount(eps.episode[eps.gold & (place < 5)], minlength=eps.n)
    return float(np.mean(found5 / np.maximum(eps.n_gold, 1)))


@dataclass
class Stack:
    """Every episode's chunks in one matrix (documents numbered across episodes), so a weight
    vector is scored on a whole set with a few array operations."""
    X: np.ndarray
    doc: np.ndarray
    episode: np.ndarray  # per document
    start: np.ndarray  # per episode: its first document's number
    gold: np.ndarray  # per document
    n_gold: np.ndarray  # per episode
    n: int
    docs: int


def stack(eps: list[tuple]) -> Stack:
    X, doc, episode, start, gold, n_gold, offset = [], [], [], [], [], [], 0
    for i, (Xq, d, n, g, ng) in enumerate(eps):
        X.append(Xq)
        doc.append(d + offset)
        episode.append(np.full(n, i))
        start.append(offset)
        gold.append(g)
        n_gold.append(ng)
        offset += n
    if not eps:
        return Stack(np.zeros((0, len(FEATURES))), *(np.zeros(0, int),) * 3, np.zeros(0, bool),
                     np.zeros(0, int), 0, 0)
    return Stack(np.vstack(X), np.concatenate(doc), np.concatenate(episode), np.asarray(start),
                 np.concatenate(gold), np.asarray(n_gold), len(eps), offset)


def grid(limit: float) -> np.ndarray:
    return np.round(np.arange(-limit, limit + 1e-9, 0.05), 2)


def fit(sets: list[list[dict]], rounds: int = 3, limit: float = 0.6, objective: str = "mean",
        only: tuple[str, ...] | None = None, l1: float = 0.0, pareto: bool = False,
        start: LinearRanker | None = None) -> LinearRanker:
    """Coordinate ascent on the measure itself: the weight of the heuristic's score is fixed at
    1 (the model is a correction to it); every other weight in turn (of the features in `only`,
    default all) takes the value of `grid` that maximises the objective on the fit sets, ties
    going to the smaller |weight|; until a round changes nothing. Deterministic.

    objective `mean`: AR@5 + 0.3 AR@10, each set counting equally; `min`: the smallest gain of
    any fit set over the starting weights (the weights must help every set they see, not the
    average: a minimax fit); `smooth` / `smooth-min`: the same plus R@5 (a question whose gold
    moves into the top 5 one document at a time counts before the last one arrives).
    `pareto`: no step may lower any fit set's measure. `start`: begin from these weights (e.g.
    the shipped ones) instead of the score alone; ties then keep the current weight. `l1`:
    minus l1 * sum |w| (fewer, smaller corrections)."""
    eps = [stack(episodes(rows)) for rows in sets]
    w = np.zeros(len(FEATURES))
    w[FEATURES.index("score")] = 1.0
    if start is not None:  # from these weights: the fit keeps what it cannot improve on
        w = np.asarray(start.weights, dtype=float).copy()

    def measure(e, w):
        a5, a10 = all_recall(e, w)
        return a5 + 0.3 * a10 + (recall5(e, w) if objective.startswith("smooth") else 0.0)

    base = [measure(e, w) for e in eps]

    def gains(w):
        return [measure(e, w) - b for e, b in zip(eps, base)]

    def value(per, w):
        o = min(per) if objective.endswith("min") else sum(per) / len(per)
        return o - l1 * (np.abs(w).sum() - 1.0)

    free = [j for j, name in enumerate(FEATURES)
            if name != "score" and (only is None or name in only)]
    now = gains(w)
    best = value(now, w)
    for _ in range(rounds):
        changed = False
        for j in free:
            for v in grid(limit):
                trial = w.copy()
                trial[j] = v
                per = gains(trial)
                if pareto and any(a < b - 1e-9 for a, b in zip(per, now)):
                    continue  # a step may not cost any fit set
                o = value(per, trial)
                if o > best + 1e-9 or (start is None and abs(o - best) <= 1e-9
                                       and abs(v) < abs(w[j])):
                    changed |= o > best + 1e-9
                    best, w, now = o, trial, per
        if not changed:
            break
    n = len(FEATURES)
    return LinearRanker(FEATURES, tuple(float(x) for x in w), (0.0,) * n, (1.0,) * n,
                        {"objective": f"{objective} over fit sets of the gain in AR@5 + 0.3 "
                                      f"AR@10 (coordinate ascent, score weight 1, l1 {l1}, "
                                      f"pareto {pareto})",
                         "grid": [-limit, limit, 0.05], "features_free": len(free),
                         "fit_gain": round(float(best), 4)})


def bagged(sets: list[list[dict]], bags: int, **kw) -> LinearRanker:
    """The mean of `bags` fits, each on a bootstrap resample of every fit set's questions
    (seeded 0..bags-1: deterministic). One coordinate-ascent fit on 100-200 questions moves
    with a handful of them (held-out musique 0.35-0.42 over resamples of hotpot); the mean of
    the resampled fits keeps what most of them agree on."""
    import random

    fits = []
    for seed in range(bags):
        rnd = random.Random(seed)
        fits.append(fit([[rnd.choice(rows) for _ in rows] for rows in sets], **kw))
    w = np.mean([f.weights for f in fits], axis=0).round(4)
    n = len(FEATURES)
    meta = dict(fits[0].meta, bags=bags)
    meta.pop("fit_gain", None)
    return LinearRanker(FEATURES, tuple(float(x) for x in w), (0.0,) * n, (1.0,) * n, meta)


def rerank(row: dict, ranker: LinearRanker | None, branch: dict, k: int = 10) -> list[str]:
    if ranker is None or not branch.get("features"):
        return branch["ranked"]
    ranked = final_ranking(ranker.scores(branch["features"]), len(branch["features"]))
    ranked = hold_back(ranked, set(branch.get("tail", ())), SEARCH_K)  # as the policy does
    titles = row.get("titles") or {}
    if titles and PER_TITLE:  # ... and its title crowding (the fit itself ignores it)
        ranked = crowd(ranked, lambda c: norm_title(titles.get(doc_of(c), "")), PER_TITLE)
    return ranked[:k]


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
        out[name] = {k: m[k] for k in ("all_recall@5", "all_recall@10", "recall@5", "ndcg@10")}
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
    ap.add_argument("--objective", choices=("mean", "min", "smooth", "smooth-min"), default="mean")
    ap.add_argument("--l1", type=float, default=0.0)
    ap.add_argument("--pareto", action="store_true", help="no step may lower any fit set")
    ap.add_argument("--start", default="", help="begin the fit from this weights file")
    ap.add_argument("--bags", type=int, default=0,
                    help="the mean of this many fits on bootstrap resamples (0: one fit)")
    ap.add_argument("--only", default="", help="comma-separated features the fit may weigh")
    ap.add_argument("--table", action="store_true", help="print a compact AR@5/AR@10 matrix")
    ap.add_argument("--write", default="")
    a = ap.parse_args()
    only = tuple(a.only.split(",")) if a.only else None
    dumps = load(a.dumps)
    fits = [a.on] if a.on else [[name] for name in dumps]
    report = {"heuristic": {n: evaluate(rows, None) for n, rows in dumps.items()}}
    if a.start:  # the weights the fit starts from (the shipped ones), as they are
        report[f"{Path(a.start).name} (start)"] = {
            n: evaluate(rows, load_ranker(a.start)) for n, rows in dumps.items()}
    if a.held_out and not a.on:
        fits += [[n for n in dumps if n != held] for held in dumps]
    for on in fits:
        kw = dict(limit=a.limit, objective=a.objective, only=only, l1=a.l1, pareto=a.pareto,
                  start=load_ranker(a.start) if a.start else None)
        sets = [dumps[n] for n in on]
        ranker = bagged(sets, a.bags, **kw) if a.bags else fit(sets, **kw)
        ranker.meta["fit_on"] = on
        report["+".join(on)] = {n: evaluate(rows, ranker) for n, rows in dumps.items()}
        report["+".join(on) + " weights"] = {f: w for f, w in zip(FEATURES, ranker.weights) if w}
        if a.write:
            Path(a.write).write_text(json.dumps(ranker.to_json(), indent=1) + "\n")
    if a.table:
        print(matrix(report, list(dumps)))
    else:
        print(json.dumps(report, indent=1))


def matrix(report: dict, names: list[str]) -> str:
    """Rows: the fit; columns: each set's 1-branch AR@5 / AR@10 (* = in the fit)."""
    lines = ["| fit on | " + " | ".join(names) + " | weights |", "|---" * (len(names) + 2) + "|"]
    for fit_name, res in report.items():
        if fit_name.endswith(" weights"):
            continue
        cells = []
        for n in names:
            m = res[n]["1br"]
            star = "*" if n in fit_name.split("+") else ""
            cells.append(f"{star}{m['all_recall@5']:.3f} / {m['all_recall@10']:.3f}")
        w = report.get(fit_name + " weights", {})
        lines.append(f"| {fit_name} | " + " | ".join(cells) + " | " + ", ".join(
            f"{k} {v:+.2f}" for k, v in w.items() if k != "score") + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
