"""Ingest throughput: one process vs a Ray Data embedding pool of N workers, and the embedding
batch size that the pool uses.

    python bench/ingest_workers.py [--data ../shared/data/scifact] [--docs 800] [--workers 1 2]
                                   [--batches 8 16 32 64 128 256]

Each run ingests the same first --docs documents of the corpus into a fresh home (a cold
embedding cache: everything is embedded), with the real model (all-MiniLM-L6-v2, CPU). Runs:
`local` (this process: chunk + embed + write, torch on all cores), then `ray` with each
--workers value (actors chunk + embed, one torch thread per actor on a CPU machine; this process
writes). Wall time covers read → manifest; chunks/s = chunks / wall. The batch-size table embeds
the same 512 chunk texts at each model batch size in this process. It prints the host, the load
average before and after (the machine may be shared), and one JSON line per run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from branchsearch.infra.ingest.corpus import read_corpus  # noqa: E402
from branchsearch.infra.ingest.batches import chunk_documents, indexed  # noqa: E402
from branchsearch.infra.ingest.pipeline import ingest  # noqa: E402
from branchsearch.infra.index.manifest import read_manifest  # noqa: E402
from branchsearch.infra.config.settings import load_settings  # noqa: E402


def subset(data: Path, docs: int, out: Path) -> Path:
    lines = []
    with open(data / "corpus.jsonl") as f:
        for line in f:
            lines.append(line)
            if len(lines) >= docs:
                break
    out.write_text("".join(lines))
    return out


def run_ingest(corpus: Path, workers: int, embed_batch: int | None) -> dict:
    home = Path(tempfile.mkdtemp(prefix="bench-ingest-"))
    settings = load_settings(overrides={"home": home, "index": "b"}, read_env=False,
                             read_file=False)
    t = time.perf_counter()
    report = ingest(corpus, settings, workers=workers, embed_batch=embed_batch)
    wall = time.perf_counter() - t
    manifest = read_manifest(settings.index_dir)
    return {"mode": "local" if workers == 1 else "ray", "workers": workers,
            "embed_batch": embed_batch or settings.embed_batch, "chunks": report.chunks,
            "wall_s": round(wall, 1), "chunks_per_s": round(report.chunks / wall, 1),
            "seconds": {k: round(v, 1) for k, v in report.seconds.items()},
            "counts": manifest.chunks}


def batch_sizes(corpus: Path, sizes: list[int]) -> list[dict]:
    from branchsearch.infra.models.embedder import Embedder

    settings = load_settings(read_env=False, read_file=False)
    docs = read_corpus(corpus)
    texts = [c.body for c in indexed(docs, chunk_documents(docs, settings))][:512]
    model = Embedder(settings.embed_model)
    model.embed(texts[:32])  # load and warm up
    rows = []
    for size in sizes:
        model.batch_size = size
        t = time.perf_counter()
        model.embed(texts)
        s = time.perf_counter() - t
        rows.append({"batch": size, "texts": len(texts), "s": round(s, 2),
                     "texts_per_s": round(len(texts) / s, 1)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, default=Path("../shared/data/scifact"))
    ap.add_argument("--docs", type=int, default=800)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--embed-batch", type=int, default=None)
    ap.add_argument("--batches", type=int, nargs="*", default=[8, 16, 32, 64, 128, 256])
    ap.add_argument("--skip-ingest", action="store_true")
    args = ap.parse_args()
    print(f"host: {platform.node()} {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores; load average {os.getloadavg()}", flush=True)
    corpus = subset(args.data, args.docs, Path(tempfile.mkdtemp()) / "corpus.jsonl")
    if args.batches:
        batch_sizes(corpus, args.batches)
    if not args.skip_ingest:
        for w in args.workers:
            row = run_ingest(corpus, w, args.embed_batch)
            print(json.dumps(row | {"load_after": os.getloadavg()}), flush=True)
            if w > 1:
                import ray

                ray.shutdown()  # a fresh pool (and cluster) per run
    print(f"load average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
