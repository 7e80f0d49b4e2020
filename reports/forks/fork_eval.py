"""Forks (issue 34), measured offline from one run's per-branch dump.

    python reports/forks/fork_eval.py run DATASET INDEX OUT.json --home HOME
        [--forks 4 --gap 0.3 --branches 3]
        runs the driver in-process (the local executor) on every question with forks on, the
        widest bounds of the grid, and keeps every branch: kind, parent, reason, handed-over
        chunks, ranking, retrieved / pruned / kept ids, tokens read, latency. Branches are
        independent and deterministic, and the forks a smaller budget or gap launches are a
        prefix of these (smallest gap first), so `table` and `cv` simulate any (forks <= 4,
        gap <= 0.3, fork weight) exactly, with the driver's own fusion (`fuse_branches`).
    python reports/forks/fork_eval.py table OUT.json [...] [--forks B --gap G --weight W]
        1 branch (the question's branch alone = a `--branches 1` run), the planner's branches
        without forks, and with forks: AR@5 / AR@10 / R@5, forks a question, tokens read,
        attribution.
    python reports/forks/fork_eval.py latency DATASET INDEX --home HOME [--n 60]
        [--executor ray|local] [--forks 2 --gap 0.15]
        per-question latency of 1 branch, 3 branches, and 3 branches with forks (one driver
        each, 3 warm-up questions), the median over all and over the forked questions.
    python reports/forks/fork_eval.py cv OUT.json [...] [--folds 5]
        k-fold inside each dump (choose (forks, gap, weight) on k-1 folds by AR@5, then AR@10,
        then fewer tokens; report the held-out fold) and leave-one-dump-out (choose on the
        others, report on the one left out); every grid point on every dump is printed too.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recall"))

from branch_eval import docstore_text, load_dump  # noqa: E402

from branchsearch.orchestrator.evaluation.attribution import (Trajectory, agent_measures,  # noqa: E402
                                                              attribute)
from branchsearch.orchestrator.evaluation.measures import doc_ranking, single_shot_metrics  # noqa: E402
from branchsearch.orchestrator.result import fuse_branches  # noqa: E402
from branchsearch.workers.branch import BranchReport  # noqa: E402
from branchsearch.workers.harness import EpisodeResult  # noqa: E402

GRID = {"forks": (1, 2, 4), "gap": (0.05, 0.15, 0.3), "weight": (0.25, 0.5, 1.0)}
PRE_REGISTERED = (2, 0.15, 0.5)


def run(dataset: str, index: str, out: str, home: str, forks: int, gap: float,
        branches: int) -> None:
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.datasets.beir import read_queries
    from branchsearch.orchestrator.driver import Driver

    settings = load_settings(None, {"home": home, "index": index, "branches": branches,
                                    "forks": forks, "fork_gap": gap})
    driver = Driver(settings, mode="local")
    rows, started = [], time.time()
    try:
        for q in read_queries(dataset):
            result = driver.search(q.text, max_branches=branches)
            rows.append({"id": q.id, "question": q.text, "gold": q.gold,
                         "fused": result.ranked_chunk_ids,
                         "latency_s": result.metrics["latency_s"], "branches": [{
                             "index": b.index, "kind": b.kind, "weight": b.weight,
                             "subquery": b.subquery, "status": b.status,
                             "parent": b.parent, "reason": b.reason, "seeds": b.seeds,
                             "candidates": b.fork_candidates,
                             "termination": b.termination, "ranked": b.ranked_chunk_ids,
                             "docs": {c["chunk_id"]: c["doc_id"] for c in b.evidence},
                             "retrieved": b.retrieved_ids, "pruned": b.pruned_ids,
                             "final_context": b.final_context_ids,
                             "tokens_read": b.tokens_read, "turns": b.turns,
                             "latency_s": b.latency_s} for b in result.branches]})
    finally:
        driver.close()
    Path(out).write_text(json.dumps({"dataset": dataset, "index": index, "home": home,
                                     "forks": forks, "gap": gap, "branches": branches,
                                     "seconds": round(time.time() - started), "rows": rows}))


def _gap(reason: str) -> float:
    return float(reason.rsplit("gap ", 1)[1].rstrip(")"))


def chosen(row: dict, forks: int, gap: float, planner: bool = True) -> list[dict]:
    """The branches a run with these bounds has: the first wave (or the question's branch
    alone), then the forks whose gap is within `gap`, the first `forks` of them (the driver
    picks smallest gap first, so these are the same forks it would run)."""
    first = [b for b in row["branches"] if b["kind"] != "fork"]
    if not planner:
        return first[:1]
    fk = [b for b in row["branches"] if b["kind"] == "fork" and _gap(b["reason"]) <= gap + 1e-9]
    return first + fk[:forks]


VOTE_SEEDS = True  # False (`--found-only`): a fork's list is fused without its seeds


HEAD_KEPT = 0  # `--keep-head 5` (variant C): the first wave's fused top 5 stay as they are


def fused(branches: list[dict], weight: float) -> list[str]:
    ranked = _fused(branches, weight)
    first = [b for b in branches if b["kind"] != "fork"]
    if not HEAD_KEPT or len(first) == len(branches):
        return ranked
    doc = lambda c: c.rsplit("#p", 1)[0]  # noqa: E731
    head = list(dict.fromkeys(doc(c) for c in _fused(first, weight)))[:HEAD_KEPT]
    rest = [c for c in ranked if doc(c) not in head]
    return [f"{d}#p0" for d in head] + rest


def _fused(branches: list[dict], weight: float) -> list[str]:
    if len(branches) == 1:
        return branches[0]["ranked"]
    reports = []
    for b in branches:
        ranked = b["ranked"]
        if b["kind"] == "fork" and not VOTE_SEEDS:
            seeds = {s.rsplit("#p", 1)[0] for s in b["seeds"]}
            ranked = [c for c in ranked if b["docs"].get(c, c.rsplit("#p", 1)[0]) not in seeds]
        ep = EpisodeResult(b["subquery"], b["termination"], ranked_chunk_ids=ranked,
                           evidence=[{"chunk_id": c, "doc_id": d} for c, d in b["docs"].items()])
        w = b["weight"] if b["kind"] != "fork" else round(weight * 2 * b["weight"], 4)
        # (a dump's fork weight is 0.5 x its parent's: 2 x it is the parent's weight)
        reports.append(BranchReport(b["index"], b["subquery"], w, b["kind"], b["status"],
                                    episode=ep))
    return fuse_branches(reports, k=5, limit=10)[0]


def score(rows: list[dict], forks: int, gap: float, weight: float, planner: bool,
          titles, texts) -> dict:
    out, classes = Counter(), Counter()
    per = {}
    for row in rows:
        used = chosen(row, forks, gap, planner)
        ranked = fused(used, weight) if len(used) > 1 else used[0]["ranked"]
        gold = dict.fromkeys(row["gold"], 1) if isinstance(row["gold"], list) else row["gold"]
        ok = [b for b in used if b["status"] == "ok"]
        m = single_shot_metrics(doc_ranking(ranked), gold)
        t = Trajectory(ranked, list(dict.fromkeys(c for b in ok for c in b["retrieved"])),
                       list(dict.fromkeys(c for b in ok for c in b["pruned"])),
                       list(dict.fromkeys(c for b in ok for c in b["final_context"])))
        m |= agent_measures(t, gold, 5)
        m["forks"] = sum(b["kind"] == "fork" for b in used)
        m["tokens_read"] = sum(b["tokens_read"] for b in ok)
        m["latency_s"] = sum(b["latency_s"] for b in used)
        for name in ("all_recall@5", "all_recall@10", "recall@5", "forks", "tokens_read",
                     "trajectory_recall", "prune_accuracy", "latency_s"):
            out[name] += m[name]
        label = attribute(t, gold, titles, " ".join(texts.get(c, "") for c in t.retrieved), 5)[0]
        classes[label] += 1
        per[row["id"]] = {"ar5": m["all_recall@5"], "ar10": m["all_recall@10"],
                          "forks": m["forks"], "tokens": m["tokens_read"], "class": label}
    n = max(len(rows), 1)
    res = {name: round(v / n, 4) for name, v in out.items()}
    res["attribution"] = "/".join(str(classes.get(c, 0)) for c in (
        "ok", "retrieval_miss", "premature_prune", "early_stop", "overload"))
    res["per"] = per
    return res


def _load(paths):
    out = []
    for path in paths:
        dump = load_dump(path)
        titles, texts = docstore_text(dump)
        out.append((path, dump, titles, texts))
    return out


def table(paths, forks, gap, weight) -> None:
    for path, dump, titles, texts in _load(paths):
        rows = dump["rows"]
        one = score(rows, 0, 0, weight, False, titles, texts)
        plan = score(rows, 0, 0, weight, True, titles, texts)
        fk = score(rows, forks, gap, weight, True, titles, texts)
        forked = [r["id"] for r in rows if fk["per"][r["id"]]["forks"]]
        tok1 = sum(one["per"][i]["tokens"] for i in forked)
        tokf = sum(fk["per"][i]["tokens"] for i in forked)
        print(f"{dump['index']} ({len(rows)} q), forks={forks} gap={gap} weight={weight}")
        for name, r in (("1 branch", one), ("planner, no forks", plan), ("with forks", fk)):
            print(f"  {name:18} AR@5 {r['all_recall@5']:.3f} AR@10 {r['all_recall@10']:.3f} "
                  f"R@5 {r['recall@5']:.3f} forks {r['forks']:.2f} tokens "
                  f"{r['tokens_read']:.0f} attribution {r['attribution']}")
        print(f"  forked questions {len(forked)}: tokens {tokf / max(tok1, 1):.2f}x one branch")


def cv(paths, folds: int) -> None:
    loaded = _load(paths)
    grid = [(0, 0.0, 0.0)] + list(itertools.product(*GRID.values()))  # (0, ..): no forks
    scores = {}  # (path, point) -> per-question
    for path, dump, titles, texts in loaded:
        rows = dump["rows"]
        scores[path, None] = score(rows, 0, 0, 1, True, titles, texts)["per"]
        scores[path, "one"] = score(rows, 0, 0, 1, False, titles, texts)["per"]
        for point in grid:
            scores[path, point] = score(rows, *point, True, titles, texts)["per"]

    def mean(path, point, ids, key):
        per = scores[path, point]
        return sum(per[i][key] for i in ids) / max(len(ids), 1)

    def pick(parts):  # parts: [(path, ids)]; the best point by AR@5, AR@10, fewer tokens
        def key(point):
            n = sum(len(ids) for _, ids in parts)
            tot = lambda k: sum(mean(p, point, ids, k) * len(ids) for p, ids in parts) / n  # noqa: E731
            return (round(tot("ar5"), 6), round(tot("ar10"), 6), -tot("tokens"))
        return max(grid, key=key)

    print("grid (forks, gap, weight): AR@5 / AR@10 / forks a question, each dump")
    for point in [None] + grid:
        line = []
        for path, dump, _, _ in loaded:
            ids = [r["id"] for r in dump["rows"]]
            line.append(f"{dump['index']} {mean(path, point, ids, 'ar5'):.3f}/"
                        f"{mean(path, point, ids, 'ar10'):.3f}/{mean(path, point, ids, 'forks'):.2f}")
        print(f"  {str(point or 'no forks'):18} " + "  ".join(line))
    print(f"\n{folds}-fold inside each dump (chosen on the other folds; held-out fold reported)")
    for path, dump, _, _ in loaded:
        ids = [r["id"] for r in dump["rows"]]
        parts = [ids[f::folds] for f in range(folds)]
        acc = Counter()
        picks = []
        for f in range(folds):
            train = [i for g, p in enumerate(parts) if g != f for i in p]
            point = pick([(path, train)])
            picks.append(point)
            for name, pt in (("one", "one"), ("plan", None), ("forks", point)):
                acc[name, "ar5"] += mean(path, pt, parts[f], "ar5") * len(parts[f])
                acc[name, "ar10"] += mean(path, pt, parts[f], "ar10") * len(parts[f])
                acc[name, "forks"] += mean(path, pt, parts[f], "forks") * len(parts[f])
        n = len(ids)
        print(f"  {dump['index']}: picks {picks}")
        for name in ("one", "plan", "forks"):
            print(f"    {name:6} AR@5 {acc[name, 'ar5'] / n:.3f} AR@10 {acc[name, 'ar10'] / n:.3f}"
                  f" forks {acc[name, 'forks'] / n:.2f}")
    if len(loaded) > 1:
        print("\nleave one dump out (chosen on the others)")
        for path, dump, _, _ in loaded:
            others = [(p, [r["id"] for r in d["rows"]]) for p, d, _, _ in loaded if p != path]
            point = pick(others)
            ids = [r["id"] for r in dump["rows"]]
            print(f"  {dump['index']}: pick {point}: one {mean(path, 'one', ids, 'ar5'):.3f}/"
                  f"{mean(path, 'one', ids, 'ar10'):.3f}, plan {mean(path, None, ids, 'ar5'):.3f}/"
                  f"{mean(path, None, ids, 'ar10'):.3f}, forks {mean(path, point, ids, 'ar5'):.3f}/"
                  f"{mean(path, point, ids, 'ar10'):.3f} ({mean(path, point, ids, 'forks'):.2f} a q)")


def latency(dataset: str, index: str, home: str, n: int, executor: str, forks: int,
            gap: float) -> None:
    """Per-question latency of 1 branch, the planner's 3 branches, and 3 branches with forks,
    on `executor`: one driver, the three interleaved question by question (their order
    rotating), so that a loaded machine weighs on each alike; the first 3 questions warm up.
    The medians over the questions the forks run report the forks' cost."""
    import statistics

    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.datasets.beir import read_queries
    from branchsearch.orchestrator.driver import Driver

    questions = [q.text for q in read_queries(dataset)][:n + 3]
    with_forks = load_settings(None, {"home": home, "index": index, "branches": 3,
                                      "forks": forks, "fork_gap": gap})
    configs = {"1 branch": (with_forks, 1), "3 branches": (with_forks.replace(forks=0), 3),
               "3 branches + forks": (with_forks, 3)}
    names = list(configs)
    times: dict[str, list[float]] = {name: [] for name in names}
    forked = []
    driver = Driver(with_forks, mode=executor)
    try:
        for i, q in enumerate(questions):
            for name in names[i % 3:] + names[:i % 3]:
                driver.settings, branches = configs[name]
                result = driver.search(q, max_branches=branches)
                if i >= 3:
                    times[name].append(result.metrics["latency_s"])
                    if name == "3 branches + forks" and result.metrics.get("forks"):
                        forked.append(i - 3)
    finally:
        driver.close()
    one = times["1 branch"]
    print(f"{executor}, {len(questions) - 3} questions of {index}, forks={forks} gap={gap}; "
          f"forked: {len(forked)}")
    for name, ts in times.items():
        on = [ts[i] for i in forked]
        print(f"  {name:20} p50 all {statistics.median(ts) * 1000:.0f} ms "
              f"({statistics.median(ts) / statistics.median(one):.2f}x one branch); forked "
              f"questions {statistics.median(on) * 1000 if on else 0:.0f} ms "
              f"({statistics.median(on) / statistics.median([one[i] for i in forked]) if on else 0:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=("run", "table", "cv", "latency"))
    ap.add_argument("--n", type=int, default=60)
    ap.add_argument("--executor", default="ray")
    ap.add_argument("args", nargs="+")
    ap.add_argument("--home", default=".branchsearch")
    ap.add_argument("--forks", type=int, default=None)
    ap.add_argument("--gap", type=float, default=None)
    ap.add_argument("--weight", type=float, default=PRE_REGISTERED[2])
    ap.add_argument("--branches", type=int, default=3)
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--found-only", action="store_true",
                    help="fuse a fork's list without the chunks it was handed (variant B)")
    ap.add_argument("--keep-head", type=int, default=0,
                    help="the first wave's fused top N stay; forks fill the places after (C)")
    a = ap.parse_args()
    global VOTE_SEEDS, HEAD_KEPT
    VOTE_SEEDS, HEAD_KEPT = not a.found_only, a.keep_head
    if a.cmd == "run":
        run(*a.args, home=a.home, forks=a.forks or 4, gap=a.gap or 0.3, branches=a.branches)
    elif a.cmd == "latency":
        latency(*a.args, home=a.home, n=a.n, executor=a.executor,
                forks=a.forks or PRE_REGISTERED[0], gap=a.gap or PRE_REGISTERED[1])
    elif a.cmd == "table":
        table(a.args, a.forks or PRE_REGISTERED[0], a.gap or PRE_REGISTERED[1], a.weight)
    else:
        cv(a.args, a.folds)


if __name__ == "__main__":
    main()
