"""Can fusion alone lift AR@10? The shipped `fuse_branches`, rerun offline over the branches'
own rankings in `branch_eval.py run` dumps, across a grid of its parameters (issue 34).

    python reports/chains/fusion_grid.py [--out GRID.json] musique=DUMP.json hotpot=DUMP.json [...]
    python reports/chains/fusion_grid.py --cv GRID.json musique,hotpot,hard [--report SET,...]

For each dump it first checks that the shipped parameters rebuild the run's own fused ranking
for every question, then prints, per set: the ceilings (every gold document of a question in
the union of its branches' top 10 / in anything they retrieved), and AR@5 / AR@10 for each
point of the grid: the RRF k, the share of the non-anchor branches, the anchored head, the
bridges' weight, how many of the anchor's documents admission reads for names, and admission
on or off. `--out` keeps each question's outcome (AR@5, AR@10, nDCG@10) at every point.

`--cv` chooses on those outcomes, as v15 in reports/bridges.md states: by the mean over sets of
AR@5, then of AR@10 (each set weighing alike; the shipped point wins a tie, then grid order);
5 folds (question i mod 5) within each fit set, and leave one fit set out; then the point chosen
on all the fit sets, with its figures on every set beside the shipped point's.
"""

from __future__ import annotations

import itertools
import json
import sqlite3
import sys
from pathlib import Path
from types import SimpleNamespace

import branchsearch.fusion.documents as documents
import branchsearch.orchestrator.result as result
from branchsearch.fusion.anchored import anchored_rrf
from branchsearch.infra.config.settings import Settings
from branchsearch.orchestrator.evaluation.measures import doc_ranking, single_shot_metrics
from branchsearch.workers.rank import doc_of

SHIPPED = dict(k=Settings().branch_rrf_k, share=0.2, head=5, bridge_weight=0.5,
               link_head=result.LINK_HEAD, admission=True)
GRID = dict(k=[1, 2, 5, 10, 30], share=[0.1, 0.2, 0.5, 1.0], head=[3, 5, None],
            bridge_weight=[0.5, 1.0], link_head=[3, 5], admission=[True, False])
_admit = result.admit


def load(path: str) -> list[tuple[dict, list]]:
    """The dump's questions, each with its branches as `fuse_branches` reads them."""
    dump = json.loads(Path(path).read_text())
    store = Path(dump["home"]) / "indexes" / dump["index"] / "docs.sqlite"
    db = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
    chunks = {c: (d, title, text) for c, d, title, text in db.execute(
        "select c.chunk_id, c.doc_id, d.title, c.text from chunks c join docs d using (doc_id)")}
    out = []
    for row in dump["rows"]:
        branches = [SimpleNamespace(
            index=b["index"], kind=b["kind"], weight=b["weight"], parent=b["parent"],
            status=b["status"], subquery="", ranked_chunk_ids=b["ranked"],
            evidence=[{"chunk_id": c, "doc_id": chunks[c][0], "title": chunks[c][1],
                       "text": chunks[c][2]} for c in b["ranked"] if c in chunks])
            for b in row["branches"]]
        out.append((row, branches))
    return out


def fuse(branches: list, k, share, head, bridge_weight, link_head, admission) -> list[str]:
    documents.anchored_rrf = (
        lambda rankings, weights=None, anchor=0, k=5, share_=None, agreement=0.0, limit=None,
        **_: anchored_rrf(rankings, weights=weights, anchor=anchor, k=k, share=share,
                          agreement=agreement, head=head, limit=limit))
    result.LINK_HEAD = link_head
    result.admit = _admit if admission else (lambda fused, *a, **kw: list(fused))
    branches = [SimpleNamespace(**{**b.__dict__, "weight": bridge_weight})
                if b.kind == "bridge" else b for b in branches]
    return result.fuse_branches(branches, k=k)[0]


def outcome(gold: list[str], ranked: list[str]) -> tuple[int, int, float]:
    docs = doc_ranking(ranked)
    ndcg = single_shot_metrics(docs, dict.fromkeys(gold, 1))["ndcg@10"]
    return int(set(gold) <= set(docs[:5])), int(set(gold) <= set(docs[:10])), round(ndcg, 6)


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["--cv"]:
        return cross_validate(json.loads(Path(args[1]).read_text()), args[2].split(","),
                              args[4].split(",") if args[3:4] == ["--report"] else [])
    out = args[1] if args[:1] == ["--out"] else None
    sets = {name: load(path) for name, path in (a.split("=", 1) for a in args[2 if out else 0:])}
    for name, rows in sets.items():
        for row, branches in rows:
            if fuse(branches, **SHIPPED) != row["fused"]:
                raise SystemExit(f"{name}: {row['id']}: the shipped fusion does not rebuild "
                                 "the run")
        n = len(rows)
        union10 = sum(set(r["gold"]) <= {d for b in r["branches"]
                                          for d in doc_ranking(b["ranked"])[:10]}
                      for r, _ in rows) / n
        fetched = sum(set(r["gold"]) <= {doc_of(c) for b in r["branches"] for c in b["retrieved"]}
                      for r, _ in rows) / n
        print(f"{name}: {n} questions, the run rebuilt exactly; ceilings: every gold document in "
              f"the branches' top 10s {union10:.3f}, retrieved by some branch {fetched:.3f}")
    print("k share head bridge_weight link_head admission | " + " | ".join(sets))
    outcomes: dict[str, dict[str, list]] = {name: {} for name in sets}
    for point in itertools.product(*GRID.values()):
        key = " ".join(str(v) for v in point)
        cells = []
        for name, rows in sets.items():
            got = [outcome(r["gold"], fuse(b, **dict(zip(GRID, point)))) for r, b in rows]
            outcomes[name][key] = got
            cells.append(f"{mean(g[0] for g in got):.3f} / {mean(g[1] for g in got):.3f}")
        print(key, "|", " | ".join(cells), flush=True)
    if out:
        Path(out).write_text(json.dumps(outcomes))


def mean(values) -> float:
    values = list(values)
    return sum(values) / max(len(values), 1)


def choose(outcomes: dict, sets: list[str], keep=lambda i: True) -> str:
    """The point with the best mean over `sets` of AR@5, then AR@10, on the questions `keep`
    lets through (by their place i); the shipped point wins a tie, then grid order."""
    shipped = " ".join(str(v) for v in SHIPPED.values())

    def score(point: str) -> tuple:
        per_set = [[o for i, o in enumerate(outcomes[s][point]) if keep(i)] for s in sets]
        return (round(mean(mean(o[0] for o in q) for q in per_set), 9),
                round(mean(mean(o[1] for o in q) for q in per_set), 9), point == shipped)
    points = list(outcomes[sets[0]])
    return max(points, key=lambda p: (score(p), -points.index(p)))


def figures(rows: list) -> str:
    return (f"{mean(o[0] for o in rows):.3f} / {mean(o[1] for o in rows):.3f} "
            f"nDCG {mean(o[2] for o in rows):.4f}")


def cross_validate(outcomes: dict, fit: list[str], report: list[str]) -> None:
    shipped = " ".join(str(v) for v in SHIPPED.values())
    print(f"shipped point: {shipped}")
    for s in fit:
        print(f"{s}, 5 folds (chosen on the other four | held-out fold: chosen / shipped):")
        for f in range(5):
            point = choose(outcomes, [s], lambda i, f=f: i % 5 != f)
            held = lambda p: [o for i, o in enumerate(outcomes[s][p]) if i % 5 == f]  # noqa: E731
            print(f"  fold {f}: {point} | {figures(held(point))} | {figures(held(shipped))}")
    print("leave one set out (chosen on the others | the left-out set: chosen / shipped):")
    for s in fit:
        point = choose(outcomes, [x for x in fit if x != s])
        print(f"  {s}: {point} | {figures(outcomes[s][point])} | {figures(outcomes[s][shipped])}")
    point = choose(outcomes, fit)
    print(f"chosen on {', '.join(fit)}: {point}")
    for s in fit + report:
        print(f"  {s}: {figures(outcomes[s][point])} | shipped {figures(outcomes[s][shipped])}")


if __name__ == "__main__":
    main()
