"""The experiments of reports/embedding.md, "Fitting the static model to the index's corpus".

    python reports/static_fit/fit_eval.py feat DATA OUT.npz [--cache FILE]   # MiniLM teacher
    python reports/static_fit/fit_eval.py drop-gold DATA IN.npz OUT.npz       # the stand-in
    python reports/static_fit/fit_eval.py fit IN.npz MODEL_DIR                # the shipped fit
    python reports/static_fit/fit_eval.py eval DATA [MODEL_DIR]               # dense AR@5 ...

`feat`: the set's chunks (as ingest makes them) and two word windows of each, with MiniLM's
vectors. `drop-gold`: the same texts without the chunks (and windows) of any document the
set's judgments name: a fit that never read a relevant passage. `fit`: `static_tune.fit` on
those texts (teacher vectors from the file). `eval`: exact dense search over every chunk,
documents ranked by their best chunk in the top 100, as `branchsearch eval --mode dense`
(the distilled model gives hotpot 0.275 / 0.455 / 0.542 either way). MODEL_DIR defaults to
the distilled model. To measure hybrid and the agent with a model made here, point an export
root at it (ROOT/<model key>/static-256-v1 -> MODEL_DIR), then ingest with
BRANCHSEARCH_MODEL_CACHE=ROOT BRANCHSEARCH_STATIC_TUNE_CHUNKS=0 and `branchsearch eval`.
"""
import argparse
import csv
import json
import random
from pathlib import Path

import numpy as np


def chunks_of(data: str) -> list[tuple[str, str]]:
    from branchsearch.infra.config.settings import Settings
    from branchsearch.infra.ingest.corpus import read_corpus
    from branchsearch.infra.ingest.batches import chunk_documents, indexed

    docs = read_corpus(data)
    return [(c.doc_id, c.body) for c in indexed(docs, chunk_documents(docs, Settings()))]


def windows(texts, per=2, seed=0):
    rng, out = random.Random(seed), []
    for text in texts:
        words = text.split()
        for _ in range(per):
            n = rng.randint(6, 20)
            if len(words) <= n:
                out.append(" ".join(words))
                continue
            i = rng.randint(0, len(words) - n)
            out.append(" ".join(words[i:i + n]))
    return out


def gold_of(data: str) -> dict[str, set[str]]:
    gold: dict[str, set[str]] = {}
    with open(f"{data}/qrels/test.tsv") as f:
        next(f)
        for row in csv.reader(f, delimiter="\t"):
            if int(row[2]) > 0:
                gold.setdefault(row[0], set()).add(row[1])
    return gold


def distilled() -> Path:
    from branchsearch.infra.models.embed_export import default_export_root
    from branchsearch.infra.models.embedder import DEFAULT_MODEL, resolve_model_path
    from branchsearch.infra.models.static import ensure_static

    return ensure_static(default_export_root(), resolve_model_path(DEFAULT_MODEL))


def feat(args):
    from branchsearch.infra.models.embedder import Embedder

    texts = [b for _, b in chunks_of(args.data)]
    spans = windows(texts)
    embedder = Embedder()
    embedder.cache_at(args.cache)
    vecs = np.vstack([embedder.embed(texts), embedder.embed(spans)]).astype(np.float32)
    np.savez(args.out, texts=np.array(texts + spans, dtype=object), vecs=vecs,
             docs=np.array([d for d, _ in chunks_of(args.data)], dtype=object))


def drop_gold(args):
    d = np.load(args.inp, allow_pickle=True)
    docs, n = list(d["docs"]), len(d["docs"])
    gold = set().union(*gold_of(args.data).values())
    keep = [i for i in range(n) if docs[i] not in gold]
    rows = keep + [n + 2 * i for i in keep] + [n + 2 * i + 1 for i in keep]
    np.savez(args.out, texts=d["texts"][rows], vecs=d["vecs"][rows],
             docs=np.array([docs[i] for i in keep], dtype=object))


def fit(args):
    from branchsearch.infra.models import static_tune

    d = np.load(args.inp, allow_pickle=True)
    table = dict(zip(d["texts"], d["vecs"]))
    print(static_tune.fit(distilled(), list(d["texts"]),
                          lambda texts: np.stack([table[t] for t in texts]), Path(args.out)))


def evaluate(args):
    from model2vec import StaticModel

    model = StaticModel.from_pretrained(str(args.model or distilled()), normalize=True)
    chunks = chunks_of(args.data)
    corpus = model.encode([b for _, b in chunks], show_progress_bar=False)
    gold = gold_of(args.data)
    queries = [q for q in map(json.loads, open(f"{args.data}/queries.jsonl")) if q["_id"] in gold]
    texts = [q["text"] for q in queries]
    if args.query == "minilm":  # MiniLM's query vectors, on the fitted model's axes
        from branchsearch.infra.models.embedder import Embedder
        from branchsearch.infra.models.static import STATIC_MODEL

        asked = Embedder(STATIC_MODEL, static_folder=args.model,
                         teacher_queries=True).embed_queries(texts)
    else:
        asked = model.encode(texts, show_progress_bar=False)
    sims = asked @ corpus.T
    ar5 = ar10 = r5 = 0.0
    for i, q in enumerate(queries):
        ranked: list[str] = []
        for j in np.argsort(-sims[i])[:100]:
            if chunks[j][0] not in ranked:
                ranked.append(chunks[j][0])
        g = gold[q["_id"]]
        ar5 += g <= set(ranked[:5])
        ar10 += g <= set(ranked[:10])
        r5 += len(g & set(ranked[:5])) / len(g)
    n = len(queries)
    print(json.dumps({"data": args.data, "model": str(args.model or "distilled"),
                      "query": args.query,
                      "AR@5": round(ar5 / n, 3), "AR@10": round(ar10 / n, 3),
                      "R@5": round(r5 / n, 3)}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("feat")
    p.add_argument("data"), p.add_argument("out"), p.add_argument("--cache", default=None)
    p = sub.add_parser("drop-gold")
    p.add_argument("data"), p.add_argument("inp"), p.add_argument("out")
    p = sub.add_parser("fit")
    p.add_argument("inp"), p.add_argument("out")
    p = sub.add_parser("eval")
    p.add_argument("data"), p.add_argument("model", nargs="?")
    p.add_argument("--query", choices=["static", "minilm"], default="static",
                   help="minilm: queries by MiniLM, projected onto the fitted model's axes")
    args = parser.parse_args()
    {"feat": feat, "drop-gold": drop_gold, "fit": fit, "eval": evaluate}[args.cmd](args)


if __name__ == "__main__":
    main()
