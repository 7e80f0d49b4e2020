"""(question, passage, label) pairs of a depth-30 dump: every fused document, label 1 when gold."""
import json
from score import gold


def passage(doc):
    return doc["title"] + ": " + doc["text"]


def pairs(data, dump, negatives=None):
    """negatives: keep only the first N non-gold documents of each question (all gold kept)."""
    g = gold(data)
    out = []
    for l in open(dump):
        r = json.loads(l)
        neg = 0
        for d in r["docs"]:
            y = float(d["doc_id"] in g[r["id"]])
            neg += y == 0
            if y or negatives is None or neg <= negatives:
                out.append((r["question"], passage(d), y))
    return out
