"""The same BEIR set searched two ways: ingested by branchsearch, and loaded into
foreign-schema indexes (an Elasticsearch index and a Milvus collection under other field names,
one document per passage) that branchsearch searches in place through `[indexes.NAME]`.

    python bench/external_eval.py ../shared/data/hotpotqa-dev200 --home /tmp/ext-bench \
        [--es-url URL] [--limit 200] [--branches 1]

Without --es-url it starts the noida-db Elasticsearch emulator (tests/es_emulator.py). It prints
the eval figures of both and writes their reports beside the home. Both sides use the same
embedder (all-MiniLM-L6-v2) and the same heuristic agent; the owned index is chunked by
tokens, the external one holds whole passages (hotpot passages fit one chunk).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def load_foreign(dataset: Path, es_url: str, milvus_uri: str, es_index: str, home: Path) -> int:
    from elasticsearch import Elasticsearch, helpers
    from pymilvus import DataType, MilvusClient

    from branchsearch.infra.models.embedder import Embedder

    docs = [json.loads(line) for line in (dataset / "corpus.jsonl").open(encoding="utf-8")]
    es = Elasticsearch(es_url, request_timeout=120)
    es.indices.create(index=es_index, mappings={"properties": {
        "doc_key": {"type": "keyword"}, "headline": {"type": "text", "analyzer": "english"},
        "body": {"type": "text", "analyzer": "english"}}})
    helpers.bulk(es, ({"_index": es_index, "_id": d["_id"], "doc_key": d["_id"],
                       "headline": d.get("title", ""), "body": d["text"]} for d in docs),
                 chunk_size=500)
    es.indices.refresh(index=es_index)
    embedder = Embedder("all-MiniLM-L6-v2", 64, "cpu",
                        cache_path=home / "cache" / "embeddings.sqlite")
    vectors = embedder.embed([f"{d.get('title', '')}\n{d['text']}" if d.get("title")
                              else d["text"] for d in docs])
    client = MilvusClient(uri=milvus_uri)
    schema = client.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field("doc_key", DataType.VARCHAR, is_primary=True, max_length=512)
    schema.add_field("headline", DataType.VARCHAR, max_length=2048)
    schema.add_field("body", DataType.VARCHAR, max_length=65535)
    schema.add_field("embedding", DataType.FLOAT_VECTOR, dim=embedder.dim)
    index = client.prepare_index_params()
    index.add_index(field_name="embedding", index_type="FLAT", metric_type="IP")
    client.create_collection("foreign_vectors", schema=schema, index_params=index)
    rows = [{"doc_key": d["_id"], "headline": d.get("title", ""), "body": d["text"][:65000],
             "embedding": v.tolist()} for d, v in zip(docs, vectors)]
    for i in range(0, len(rows), 1000):
        client.insert("foreign_vectors", rows[i:i + 1000])
    client.close()
    from milvus_lite.server_manager import server_manager_instance

    server_manager_instance.release_server(milvus_uri)
    return len(docs)


def run_eval(dataset: Path, home: Path, index: str, report: Path, args, extra=()) -> dict:
    cmd = [sys.executable, "-m", "branchsearch.orchestrator.cli", "eval", str(dataset),
           "--home", str(home), "--index", index, "--policy", "heuristic", "--executor", "local",
           "--branches", str(args.branches), "--report", str(report), "--json", *extra]
    if args.limit:
        cmd += ["--limit", str(args.limit)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"eval failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(report.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dataset", type=Path)
    ap.add_argument("--home", type=Path, required=True)
    ap.add_argument("--es-url", default="")
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--branches", type=int, default=1)
    args = ap.parse_args()
    args.home.mkdir(parents=True, exist_ok=True)
    emulator = None
    es_url = args.es_url
    if not es_url:
        from es_emulator import start_es_emulator

        emulator = start_es_emulator(args.home / "es")
        es_url = emulator.url
    try:
        es_index = f"foreign-{uuid.uuid4().hex[:8]}"
        milvus_uri = str(args.home / "foreign.db")
        n = load_foreign(args.dataset, es_url, milvus_uri, es_index, args.home)
        (args.home / "branchsearch.toml").write_text(
            f'es_url = "{es_url}"\nmilvus_uri = "{milvus_uri}"\n'
            f'[indexes.foreign]\nlexical = "elasticsearch"\nes_index = "{es_index}"\n'
            'dense = "milvus"\nmilvus_collection = "foreign_vectors"\n'
            '[indexes.foreign.fields]\nid = "doc_key"\ntitle = "headline"\ntext = "body"\n'
            'acl = "groups"\nvector = "embedding"\n')
        reports = {}
        for name in ("owned", "foreign"):
            # the owned index uses the embedded stores: no es_url / milvus_uri for it
            home = args.home / "owned" if name == "owned" else args.home
            if name == "owned":
                home.mkdir(exist_ok=True)
                (home / "cache").mkdir(exist_ok=True)
                cache = args.home / "cache" / "embeddings.sqlite"
                if cache.exists() and not (home / "cache" / "embeddings.sqlite").exists():
                    (home / "cache" / "embeddings.sqlite").write_bytes(cache.read_bytes())
            reports[name] = run_eval(args.dataset, home, name,
                                     args.home / f"{name}-report.json", args)
        print(f"{args.dataset.name}: {n} passages, heuristic agent, {args.branches} branch(es)")
        keys = ("recall@5", "all_recall@5", "recall@10", "ndcg@10")
        print("| index | " + " | ".join(keys) + " |")
        print("|---|" + "---|" * len(keys))
        for name, rep in reports.items():
            agg = rep["metrics"]
            print(f"| {name} | " + " | ".join(f"{agg.get(k, float('nan')):.3f}" for k in keys)
                  + " |")
    finally:
        if emulator is not None:
            emulator.stop()


if __name__ == "__main__":
    main()
