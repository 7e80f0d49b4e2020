"""Score a depth-30 dump with a trained judge and print the v25 table rows for one set.

python apply.py MODEL DATA K10.jsonl K30.jsonl
Rows: the default (final_k 10), final_k 30 cut at 10, JR = RRF(k=60) of the fused order and the
judge's, JA = the judge's order alone; ties keep the fused order. Judge scores are cached in
MODEL/scores-K30.jsonl (beside the weights, never beside the dump).
"""
import json, os, sys
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from pairs import passage
from score import gold


def judge(model_dir, rows):
    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    items = [(r["question"], passage(d)) for r in rows for d in r["docs"]]
    by_len = sorted(range(len(items)), key=lambda i: len(items[i][1]))
    scores = [0.0] * len(items)
    with torch.no_grad():
        for s in range(0, len(by_len), 64):
            idx = by_len[s:s + 64]
            x = tok([items[i][0] for i in idx], [items[i][1] for i in idx], truncation=True,
                    max_length=256, padding=True, return_tensors="pt")
            for i, v in zip(idx, model(**x).logits.squeeze(-1).tolist()):
                scores[i] = v
    out, n = [], 0
    for r in rows:
        out.append(scores[n:n + len(r["docs"])]); n += len(r["docs"])
    return out


def ja(docs, s):
    return [docs[i]["doc_id"] for i in sorted(range(len(docs)), key=lambda i: (-s[i], i))]


def jr(docs, s):
    rrf = {i: 1 / (61 + i) for i in range(len(docs))}
    for r, i in enumerate(sorted(range(len(docs)), key=lambda i: (-s[i], i))):
        rrf[i] += 1 / (61 + r)
    return [docs[i]["doc_id"] for i in sorted(rrf, key=lambda i: (-rrf[i], i))]


def row(label, orders, g, ids):
    h5 = [g[q] <= set(o[:5]) for q, o in zip(ids, orders)]
    h10 = [g[q] <= set(o[:10]) for q, o in zip(ids, orders)]
    r5 = sum(len(g[q] & set(o[:5])) / len(g[q]) for q, o in zip(ids, orders)) / len(ids)
    folds = " ".join("%.2f/%.2f" % (sum(h5[i::5]) / len(h5[i::5]), sum(h10[i::5]) / len(h10[i::5]))
                     for i in range(5))
    n = len(ids)
    print(f"| {label} | {sum(h5) / n:.3f} | {sum(h10) / n:.3f} | {r5:.3f} | {folds} |")


def main(model_dir, data, k10, k30):
    g = gold(data)
    base = [json.loads(l) for l in open(k10)]
    deep = [json.loads(l) for l in open(k30)]
    assert [r["id"] for r in base] == [r["id"] for r in deep]
    cache = os.path.join(model_dir, f"scores-{os.path.basename(k30)}")
    if os.path.exists(cache):
        scores = json.load(open(cache))
    else:
        scores = judge(model_dir, deep)
        json.dump(scores, open(cache, "w"))
    ids = [r["id"] for r in deep]
    fused = lambda r: [d["doc_id"] for d in r["docs"]]
    print("| order | AR@5 | AR@10 | R@5 | folds (AR@5/AR@10, question i mod 5) |")
    print("|---|---|---|---|---|")
    row("default (`final_k` 10), as shipped", [fused(r) for r in base], g, ids)
    row("`final_k` 30, cut at 10", [fused(r) for r in deep], g, ids)
    row("JR: RRF(fused, judge)", [jr(r["docs"], s) for r, s in zip(deep, scores)], g, ids)
    row("JA: judge alone", [ja(r["docs"], s) for r, s in zip(deep, scores)], g, ids)


if __name__ == "__main__":
    main(*sys.argv[1:5])
