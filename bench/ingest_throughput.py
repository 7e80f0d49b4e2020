"""Ingest throughput per embedder against MiniLM's roofline on this machine, where the time goes,
and the query embedding time per search (reports/embedding.md).

    .venv/bin/python bench/ingest_throughput.py ../shared/data/scifact --docs 2000 \\
        --models all-MiniLM-L6-v2,static-minilm [--roofline] [--queries 200] [--out rows.jsonl]

* `--roofline`: the first `--roofline-chunks` chunks of the corpus (as ingest makes them) are
  tokenized with MiniLM's tokenizer (truncated at its 256 word pieces); their forward cost is
  counted exactly (per layer 2·L·(4d² + 2·d·ff) for the projections and FFN, 4·L²·d for
  attention, on real tokens, padding not counted); a dense fp32 matmul of the model's FFN
  shape is timed (torch, all this process's threads). roofline chunks/s = matmul GFLOP/s ÷
  GFLOP per chunk, both per wall second and per CPU-second (CPU time of this process's
  threads: what the other jobs on a shared machine leave does not change it). MiniLM's own
  forward at batch 64 on the same chunks is timed too (the model alone, no ingest). A MiniLM
  ingest then reports its share of the roofline, with the FLOPs of its own chunks.
* Each model: the first `--docs` documents are ingested into a fresh home (`--home-root`,
  default a temporary folder; no embedding cache hits), one process. Printed: wall chunks/s
  end to end (read → manifest, stores opened and closed included) and without the fixed
  start (`open`: Milvus Lite start, model load), the stage seconds (`wait` is the writer idle,
  waiting for the embedding thread), and CPU-seconds of this process plus its children (the
  Milvus Lite server), so chunks per CPU-second. `--batch-docs 256,1024` compares documents
  per committed batch.
* `--queries N`: the first N test queries are embedded one at a time (as a search does), after
  one warm-up, by the ingested index's own query embedder (for a fitted static-minilm index,
  MiniLM onto its axes and, second, the fitted model itself): median and p95 ms per query, and
  median CPU-ms (all threads), no embedding cache.

One JSON line per measurement (with the load average before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from embed_backends import corpus_chunks  # noqa: E402


def cpu_s() -> float:
    """CPU-seconds of this process (all threads) and of its children: reaped ones, and the
    live ones (the Milvus Lite server outlives the store that started it)."""
    import psutil

    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    live = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
            live += times.user + times.system
        except psutil.Error:
            pass
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime + live


def subset(data: Path, docs: int, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    with open(data / "corpus.jsonl") as src, open(out / "corpus.jsonl", "w") as dst:
        for i, line in enumerate(src):
            if i >= docs:
                break
            dst.write(line)
    return out


def minilm_flops(texts: list[str]) -> tuple[float, float]:
    """(GFLOP per chunk, word pieces per chunk) of MiniLM's forward on these texts."""
    import json as _json

    from transformers import AutoTokenizer

    from branchsearch.infra.models.embedder import DEFAULT_MODEL, resolve_model_path

    path = resolve_model_path(DEFAULT_MODEL)
    config = _json.loads((path / "config.json").read_text())
    d, ff, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    max_len = _json.loads((path / "sentence_bert_config.json").read_text())["max_seq_length"]
    tok = AutoTokenizer.from_pretrained(str(path))
    lengths = [len(ids) for ids in tok(texts, truncation=True, max_length=max_len)["input_ids"]]
    flops = sum(layers * (2 * n * (4 * d * d + 2 * d * ff) + 4 * n * n * d) for n in lengths)
    return flops / len(texts) / 1e9, sum(lengths) / len(lengths)


def matmul_gflops(seconds: float = 3.0) -> tuple[float, float]:
    """(GFLOP per wall second, GFLOP per CPU-second) of fp32 (8192 x 384) @ (384 x 1536)."""
    import torch

    a, b = torch.randn(8192, 384), torch.randn(384, 1536)
    for _ in range(3):
        a @ b
    n, t, c = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - t < seconds:
        a @ b
        n += 1
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    flop = n * 2 * 8192 * 384 * 1536 / 1e9
    return flop / wall, flop / cpu


def roofline(corpus: str, n: int) -> dict:
    from branchsearch.infra.models.embedder import Embedder

    texts = corpus_chunks(corpus, n)
    gflop_chunk, pieces = minilm_flops(texts)
    wall_gf, cpu_gf = matmul_gflops()
    PEAK.update(wall=wall_gf, cpu=cpu_gf)
    embedder = Embedder(batch_size=64)
    embedder.embed(texts[:64])
    t, c = time.perf_counter(), time.process_time()
    embedder.embed(texts)
    model_wall, model_cpu = time.perf_counter() - t, time.process_time() - c
    return {"what": "roofline", "corpus": corpus, "chunks": len(texts),
            "pieces_per_chunk": round(pieces, 1), "gflop_per_chunk": round(gflop_chunk, 3),
            "matmul_gflop_per_s": round(wall_gf, 1), "matmul_gflop_per_cpu_s": round(cpu_gf, 1),
            "roofline_chunks_per_s": round(wall_gf / gflop_chunk, 1),
            "roofline_chunks_per_cpu_s": round(cpu_gf / gflop_chunk, 2),
            "minilm_forward_chunks_per_s": round(len(texts) / model_wall, 1),
            "minilm_forward_chunks_per_cpu_s": round(len(texts) / model_cpu, 2),
            "minilm_forward_gflop_per_cpu_s": round(len(texts) * gflop_chunk / model_cpu, 1)}


PEAK: dict[str, float] = {}  # the matmul's GFLOP/s (wall, cpu) once --roofline measured it


def ingest_once(corpus: Path, model: str, home: Path, batch_docs: int | None,
                tune_chunks: int | None = None) -> dict:
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.ingest.pipeline import ingest

    overrides = {"home": str(home), "index": "bench", "embed_model": model}
    if tune_chunks is not None:
        overrides["static_tune_chunks"] = tune_chunks
    settings = load_settings(overrides=overrides, read_env=False, read_file=False)
    c = cpu_s()
    report = ingest(corpus, settings, **({"batch_docs": batch_docs} if batch_docs else {}))
    cpu = cpu_s() - c
    s = report.seconds
    steady = s["total"] - s.get("open", 0.0)
    extra = {}
    if model == "all-MiniLM-L6-v2" and PEAK:  # this ingest's own chunks' MiniLM FLOPs
        gflop_chunk, _ = minilm_flops(corpus_chunks(str(corpus), report.chunks))
        extra = {"gflop_per_chunk": round(gflop_chunk, 3),
                 "roofline_chunks_per_s": round(PEAK["wall"] / gflop_chunk, 2),
                 "roofline_chunks_per_cpu_s": round(PEAK["cpu"] / gflop_chunk, 2),
                 "share_of_roofline_wall": round(report.chunks_per_s * gflop_chunk
                                                 / PEAK["wall"], 3),
                 "share_of_roofline_cpu": round(report.chunks / cpu * gflop_chunk
                                                / PEAK["cpu"], 3) if cpu else 0.0}
    return {**extra, "what": "ingest", "model": model, "batch_docs": batch_docs or "default",
            "documents": report.documents,
            "chunks": report.chunks, "chunks_per_s": round(report.chunks_per_s, 1),
            "chunks_per_s_after_open": round(report.chunks / steady, 1) if steady else 0.0,
            # static-minilm: the fit to the corpus (MiniLM on a sample) is a fixed cost
            "fit_s": round(s.get("fit", 0.0), 2), "fitted": report.fitted,
            "chunks_per_s_after_open_and_fit": round(
                report.chunks / (steady - s.get("fit", 0.0)), 1) if steady else 0.0,
            "chunks_per_cpu_s": round(report.chunks / cpu, 1) if cpu else 0.0,
            "cpu_s": round(cpu, 2), "seconds": {k: round(v, 3) for k, v in s.items()}}


def query_times(corpus: str, home: Path, n: int, static_queries: str | None = None) -> dict:
    """Embedding the first `n` test queries one at a time with the index's own query embedder
    (a fitted static index: by MiniLM onto its axes, or with `static_queries = "static"`)."""
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.datasets.beir import read_queries
    from branchsearch.infra.index.manifest import read_manifest
    from branchsearch.infra.index.open import index_embedder

    overrides = {"home": str(home), "index": "bench"}
    if static_queries:
        overrides["static_queries"] = static_queries
    settings = load_settings(overrides=overrides, read_env=False, read_file=False)
    model = read_manifest(settings.index_dir).embedding["model"]
    embedder = index_embedder(settings.replace(embed_model=model))
    embedder.cache_at(None)  # every query new, as a question's are
    queries = [q.text for q in read_queries(corpus, "test")][:n]
    embedder.embed_queries(["warm up"])
    times, cpu = [], []
    for q in queries:
        t, c = time.perf_counter(), time.process_time()
        embedder.embed_queries([q])
        times.append((time.perf_counter() - t) * 1000)
        cpu.append((time.process_time() - c) * 1000)
    times.sort()
    return {"what": "query", "model": model, "queries_by": embedder.queries_by,
            "queries": len(times), "median_ms": round(statistics.median(times), 2),
            "p95_ms": round(times[int(0.95 * (len(times) - 1))], 2),
            "median_cpu_ms": round(statistics.median(cpu), 2)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("corpus")
    parser.add_argument("--docs", type=int, default=2000)
    parser.add_argument("--models", default="all-MiniLM-L6-v2,static-minilm")
    parser.add_argument("--roofline", action="store_true")
    parser.add_argument("--roofline-chunks", type=int, default=256)
    parser.add_argument("--queries", type=int, default=0)
    parser.add_argument("--batch-docs", default="", help="comma-separated documents per "
                        "committed batch to compare (default: ingest's own)")
    parser.add_argument("--static-tune-chunks", type=int, default=None,
                        help="static-minilm: chunks its fit reads (0: none; default: the "
                             "setting's)")
    parser.add_argument("--home-root", default="")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)

    rows = []

    def emit(row: dict) -> None:
        row = {**row, "load_before": load, "load_after": round(os.getloadavg()[0], 2),
               "threads": len(os.sched_getaffinity(0))}
        print(json.dumps(row), flush=True)
        rows.append(row)

    load = round(os.getloadavg()[0], 2)
    if args.roofline:
        emit(roofline(args.corpus, args.roofline_chunks))
    root = Path(args.home_root or tempfile.mkdtemp(prefix="ingest-bench-"))
    corpus = subset(Path(args.corpus), args.docs, root / "corpus")
    for model in [m for m in args.models.split(",") if m]:
        load = round(os.getloadavg()[0], 2)
        for batch_docs in [int(b) for b in args.batch_docs.split(",") if b] or [None]:
            load = round(os.getloadavg()[0], 2)
            home = root / f"home-{model}-{batch_docs}"
            shutil.rmtree(home, ignore_errors=True)
            emit(ingest_once(corpus, model, home, batch_docs, args.static_tune_chunks))
        for static_queries in ([None, "static"] if model == "static-minilm" else [None]):
            if args.queries:  # the index the last ingest made
                load = round(os.getloadavg()[0], 2)
                emit(query_times(args.corpus, home, args.queries, static_queries))
    if args.out:
        with open(args.out, "a") as fh:
            for row in rows:
                fh.write(json.dumps({**row, "corpus": args.corpus}) + "\n")
    if not args.home_root:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
