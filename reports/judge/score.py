import json, sys
def gold(data):
    g = {}
    for l in open(f"{data}/qrels/test.tsv").read().splitlines()[1:]:
        q, d, s = l.split("\t")[:3]
        if int(s) > 0: g.setdefault(q, set()).add(d)
    return g
def ar(rows, g, k, order=lambda r: [d["doc_id"] for d in r["docs"]]):
    return sum(g[r["id"]] <= set(order(r)[:k]) for r in rows) / len(rows)
if __name__ == "__main__":
    g = gold(sys.argv[1])
    for f in sys.argv[2:]:
        rows = [json.loads(l) for l in open(f)]
        print(f, "AR@5 %.3f AR@10 %.3f AR@30 %.3f" % (ar(rows, g, 5), ar(rows, g, 10), ar(rows, g, 30)))
