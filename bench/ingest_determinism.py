#!/usr/bin/env python
"""Ingest one corpus several ways and count the top-10 lists that differ (reports/determinism.md).

The corpus: hotpot-mini, a 200-document `synth` corpus, and copies of every sixth document under
ids that sort before the original (a third of them with '(copy)' added to the title), written
after the originals, so that BM25 scores tie exactly and cosines tie up to float noise. Ways:

    one   one process, the corpus as written
    rev   one process, the documents in reverse order
    w2    `ingest --workers 2` (Ray Data, 16 documents a block)
    re    the corpus with every fifth document's text changed, then the corpus itself, into the
          same index (those documents are replaced)

Each way gets a home of its own (no embedding cache shared). For 41 queries (the fixtures'
questions, 15 copied titles, 4 short queries) and 8 grep patterns, compares the top 10 of
bm25, dense, hybrid and grep with `one`'s; also the largest score difference of one chunk.

    python bench/ingest_determinism.py /tmp/det [one,rev,w2,re]

An existing index in OUT is searched again without ingesting (so the same indexes can be read
by two versions of the code).
"""
import json
import sys
import time
from pathlib import Path

from branchsearch.infra.config.settings import load_settings
from branchsearch.infra.datasets.synth import synth
from branchsearch.infra.index.open import open_retriever
from branchsearch.infra.ingest.pipeline import ingest

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "synth" / "corpus.jsonl").exists():
        synth(out / "synth", docs=200, tasks=10)
    src = [json.loads(line) for line in open(FIXTURES / "hotpot-mini" / "corpus.jsonl")]
    src += [json.loads(line) for line in open(out / "synth" / "corpus.jsonl")]
    dups = []
    for i, d in enumerate(src[::6]):
        dups.append({**d, "_id": f"a{i:02d}-{d['_id']}"})
        if i % 3 == 0:
            dups.append({**d, "_id": f"z{i:02d}-{d['_id']}", "title": d["title"] + " (copy)"})
    docs = src + dups

    def write(name, rows):
        folder = out / name
        folder.mkdir(exist_ok=True)
        with open(folder / "corpus.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        return folder

    fwd, rev = write("fwd", docs), write("rev", docs[::-1])
    mod = write("mod", [({**d, "text": d["text"] + " Revised later."} if i % 5 == 0 else d)
                        for i, d in enumerate(docs)])
    queries = [json.loads(line)["text"]
               for line in open(FIXTURES / "hotpot-mini" / "queries.jsonl")]
    queries += [json.loads(line)["text"] for line in open(out / "synth" / "queries.jsonl")]
    queries += [d["title"] for d in dups[:15]] + ["minutes", "policy", "meeting minutes",
                                                  "Kiss and Tell 1945"]
    patterns = ["contract", "19[0-9]{2}", "c-[0-9]+", "project", "film", "vendor", "american",
                "review"]
    base = load_settings(overrides={"home": out / "h", "chunk_tokens": 64, "chunk_overlap": 8},
                         read_env=False, read_file=False)
    ways = {"one": (fwd, {}), "rev": (rev, {}), "w2": (fwd, {"workers": 2, "batch_docs": 16}),
            "re": (fwd, {"before": mod})}
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else list(ways)
    for name in only:
        path, kw = ways[name]
        settings = base.replace(index=name, home=out / f"h-{name}")
        if (settings.index_dir / "manifest.json").exists():
            continue
        start = time.time()
        if "before" in kw:
            ingest(kw.pop("before"), settings)
        ingest(path, settings, **kw)
        print(name, "ingested in", round(time.time() - start, 1), "s", flush=True)
    results = {}
    for name in ways:
        settings = base.replace(index=name, home=out / f"h-{name}")
        if not (settings.index_dir / "manifest.json").exists():
            continue
        retriever = open_retriever(settings)
        try:
            lists = {}
            for q in queries:
                for mode in ("bm25", "dense", "hybrid"):
                    lists[f"{mode}|{q}"] = [(h.chunk_id, h.score)
                                            for h in retriever.search(q, mode, 10)]
            for p in patterns:
                lists[f"grep|{p}"] = [(h.chunk_id, h.score) for h in retriever.grep(p, 10)]
        finally:
            retriever.close()
        results[name] = lists
    first = next(iter(results))
    for name in list(results)[1:]:
        differ: dict[str, int] = {}
        noise = {"bm25": 0.0, "dense": 0.0}
        for key, mine in results[first].items():
            mode = key.split("|")[0]
            theirs = results[name][key]
            differ[mode] = differ.get(mode, 0) + ([c for c, _ in mine] != [c for c, _ in theirs])
            if mode in noise:
                a, b = dict(mine), dict(theirs)
                noise[mode] = max([noise[mode]] + [abs(a[c] - b[c]) for c in set(a) & set(b)])
        print(json.dumps({"compared": f"{first} vs {name}", "lists_that_differ": differ,
                          "queries": len(queries), "patterns": len(patterns),
                          "max_score_diff_same_chunk": noise}), flush=True)


if __name__ == "__main__":
    main()
