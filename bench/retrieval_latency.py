"""Retrieval latency at ~50k chunks and ingest throughput without embedding.

    python bench/retrieval_latency.py [--chunks 50000] [--queries 200] [--data ../shared/data]

The corpus pools the passages of every set under --data and adds variants of them (sentences
rotated, ids suffixed) until it holds --chunks chunks, so BM25 statistics stay realistic.
Embedding 50k chunks would take about an hour on 2 CPU cores (SciFact's 8,528 chunks took
741 s), so the dense side uses a hashing embedder
(deterministic unit vectors): Milvus FLAT search cost depends on N and dim, not on the vectors.
The real model's query embedding time is measured separately on the same queries and reported
beside it. One run, medians and p90 per mode; the rival (milvus-lite 3.x) is in
bench/milvus_lite_versions.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from branchsearch.infra.ingest.pipeline import ingest  # noqa: E402
from branchsearch.infra.index.open import open_retriever  # noqa: E402
from branchsearch.infra.config.settings import load_settings  # noqa: E402


class HashEmbedder:
    dim = 384

    def embed(self, texts, progress=False):
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        for i, t in enumerate(texts):
            seed = int.from_bytes(hashlib.sha1(t.encode()).digest()[:8], "little")
            v = np.random.default_rng(seed).standard_normal(self.dim).astype(np.float32)
            out[i] = v / np.linalg.norm(v)
        return out

    embed_queries = embed


def build_corpus(data: Path, target_docs: int, out: Path) -> tuple[int, list[str]]:
    base, queries = [], []
    for folder in sorted(p for p in data.iterdir() if (p / "corpus.jsonl").exists()):
        for line in open(folder / "corpus.jsonl"):
            doc = json.loads(line)
            base.append({**doc, "_id": f"{folder.name}-{doc['_id']}"})
        queries += [json.loads(line)["text"] for line in open(folder / "queries.jsonl")]
    n = 0
    with out.open("w") as f:
        variant = 0
        while n < target_docs:
            for doc in base:
                if n >= target_docs:
                    break
                text = doc["text"]
                if variant:
                    parts = text.split(". ")
                    k = variant % max(len(parts), 1)
                    text = ". ".join(parts[k:] + parts[:k])
                f.write(json.dumps({"id": f"{doc['_id']}-v{variant}", "title": doc["title"],
                                    "text": text}) + "\n")
                n += 1
            variant += 1
    return n, queries


def stats(values_ms):
    values_ms = sorted(values_ms)
    return statistics.median(values_ms), values_ms[int(0.9 * (len(values_ms) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=50_000)
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data")
    args = ap.parse_args()

    home = Path(tempfile.mkdtemp(prefix="bs-bench-"))
    settings = load_settings(overrides={"home": home, "index": "bench"}, read_env=False,
                             read_file=False)
    corpus = home / "corpus.jsonl"
    # ~1.18 chunks per passage over the three sets at 256-token chunks
    docs, queries = build_corpus(args.data, int(args.chunks / 1.18), corpus)
    queries = queries[: args.queries]
    report = ingest(corpus, settings, embedder=HashEmbedder())
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}")
    print(f"corpus: {docs} passages -> {report.chunks} chunks ({args.data})")
    print(f"ingest without embedding: {report.chunks_per_s_without_embedding:,.0f} chunks/s "
          f"(stages s: {report.to_dict()['seconds']})")

    retriever = open_retriever(settings, embedder=HashEmbedder())
    rows = []
    for mode in ("bm25", "dense", "hybrid"):
        retriever.search(queries[0], mode=mode, k=10)  # warm-up
        times = []
        for q in queries:
            t = time.perf_counter()
            retriever.search(q, mode=mode, k=10)
            times.append((time.perf_counter() - t) * 1000)
        rows.append((mode, *stats(times)))
    from branchsearch.infra.models.embedder import Embedder

    real = Embedder()
    real.embed(["warm up"])
    times = []
    for q in queries:
        t = time.perf_counter()
        real.embed([q])
        times.append((time.perf_counter() - t) * 1000)
    rows.append(("query embedding (MiniLM, CPU)", *stats(times)))
    print(f"\n{len(queries)} queries, k=10, hybrid = RRF over 50 BM25 + 50 dense candidates")
    print(f"| {'operation':<32} | median ms | p90 ms |\n|{'-' * 34}|-----------|--------|")
    for name, med, p90 in rows:
        print(f"| {name:<32} | {med:9.2f} | {p90:6.2f} |")
    retriever.close()


if __name__ == "__main__":
    main()
