"""Runs of `branch_eval.py run` side by side, per set and per fold (i mod 5): AR@5, AR@10, R@5,
nDCG@10 of the fused documents, and for the first run named also of its question's branch alone
(the 1-branch ranking: `b1`).

    python reports/chains/compare.py DIR BASE [NAME ...]

DIR holds the dumps as SET-NAME.json (SET: musique, hotpot, hard, hard57, hard59, scifact; a
set without a dump is left out); BASE is the run the others are read against.
"""
import json, sys, math
SETS = ["musique", "hotpot", "hard", "hard57", "hard59", "scifact"]
def docs(chunks):
    out = []
    for c in chunks:
        d = c.rsplit("#p", 1)[0]
        if d not in out: out.append(d)
    return out
def ar(rank, gold, k): return float(all(g in rank[:k] for g in gold))
def rk(rank, gold, k): return sum(g in rank[:k] for g in gold) / len(gold)
def ndcg(rank, gold, k=10):
    dcg = sum(1 / math.log2(i + 2) for i, d in enumerate(rank[:k]) if d in gold)
    idcg = sum(1 / math.log2(i + 2) for i in range(min(len(gold), k)))
    return dcg / idcg
def rows(name, s):
    """The dump's rows, or None when there is none."""
    try: d = json.load(open(f"{DIR}/{s}-{name}.json"))
    except FileNotFoundError: return None
    return d["rows"]
def metrics(rs, which):
    out = []
    for r in rs:
        gold = r["gold"]; gold = list(gold) if not isinstance(gold, dict) else [g for g, v in gold.items() if v > 0]
        if which == "b1":
            anc = next((b for b in r["branches"] if b["kind"] == "original"), r["branches"][0])
            rank = docs(anc["ranked"])
        else:
            rank = docs(r["fused"])
        out.append((ar(rank, gold, 5), ar(rank, gold, 10), rk(rank, gold, 5), ndcg(rank, gold)))
    return out
def mean(xs, i): return sum(x[i] for x in xs) / max(len(xs), 1)
DIR, base = sys.argv[1], sys.argv[2]
for s in SETS:
    for name in sys.argv[2:]:
        rs = rows(name, s)
        if rs is None: continue
        for which in (["b1", name] if name == base else [name]):
            m = metrics(rs, which)
            folds = [[x for i, x in enumerate(m) if i % 5 == f] for f in range(5)]
            print(f"{s:8} {which:6} n={len(m):3} AR5 {mean(m,0):.3f} AR10 {mean(m,1):.3f} R5 {mean(m,2):.3f} nDCG10 {mean(m,3):.4f} | folds AR5 {[round(mean(f,0),2) for f in folds]} AR10 {[round(mean(f,1),2) for f in folds]}")
