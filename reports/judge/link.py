import json, re, sys
sys.path.insert(0, "/work/main/reports/judge")
from score import gold
def name(t):
    return re.sub(r"\s*\([^)]*\)\s*$", "", t).strip()
def links(docs, top=5):
    out = []
    for i, d in enumerate(docs):
        n = name(d["title"])
        if not n:
            out.append(0); continue
        pat = re.compile(r"(?<!\w)" + re.escape(n) + r"(?!\w)", re.I)
        out.append(sum(1 for j, e in enumerate(docs[:top]) if j != i and pat.search(e["title"] + " " + e["text"]) and name(e["title"]).lower() != n.lower()))
    return out
def k2(docs):
    L = links(docs)
    return [docs[i]["doc_id"] for i in sorted(range(len(docs)), key=lambda i: (-L[i], i))]
def k1(docs):
    L = links(docs)
    lo = sorted(range(len(docs)), key=lambda i: (-L[i], i))
    s = {i: 1 / (61 + i) for i in range(len(docs))}
    for r, i in enumerate(lo): s[i] += 1 / (61 + r)
    return [docs[i]["doc_id"] for i in sorted(s, key=lambda i: (-s[i], i))]
def ar(rows, g, k, order):
    hit = [g[r["id"]] <= set(order(r["docs"])[:k]) for r in rows]
    return sum(hit) / len(rows), hit
if __name__ == "__main__":
    g = gold(sys.argv[1]); base = [json.loads(l) for l in open(sys.argv[2])]; deep = [json.loads(l) for l in open(sys.argv[3])]
    fused = lambda docs: [d["doc_id"] for d in docs]
    for label, rows, order in [("default k10", base, fused), ("k30 fused", deep, fused), ("K1", deep, k1), ("K2", deep, k2)]:
        a5, h5 = ar(rows, g, 5, order); a10, h10 = ar(rows, g, 10, order)
        folds = " ".join("%.2f/%.2f" % (sum(h5[i::5]) / len(h5[i::5]), sum(h10[i::5]) / len(h10[i::5])) for i in range(5))
        print(f"{label:12s} AR@5 {a5:.3f} AR@10 {a10:.3f}  folds {folds}")
