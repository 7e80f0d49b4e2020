"""A large BEIR-style corpus from small ones, for ingest at scale (reports/embedding.md).

    python bench/big_corpus.py ../shared/data 750000 /tmp/big/corpus   # ~1M chunks

Every document of every `*/corpus.jsonl` under the first folder, repeated until the count is
reached: each copy has its sentences rotated and its title numbered, so every chunk text is
distinct (a fit's sample, an embedding cache or a dedup sees as many texts as in a real corpus
of that size). Writes OUT/corpus.jsonl.
"""
import json
import sys
from pathlib import Path


def main() -> None:
    data, target, out = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    base = []
    for folder in sorted(p for p in data.iterdir() if (p / "corpus.jsonl").exists()):
        for line in open(folder / "corpus.jsonl"):
            doc = json.loads(line)
            base.append({**doc, "_id": f"{folder.name}-{doc['_id']}"})
    out.mkdir(parents=True, exist_ok=True)
    n, copy = 0, 0
    with open(out / "corpus.jsonl", "w") as f:
        while n < target:
            for doc in base:
                if n >= target:
                    break
                parts = doc["text"].split(". ")
                k = copy % max(len(parts), 1)
                title = f"{doc.get('title', '')} ({copy})" if copy else doc.get("title", "")
                f.write(json.dumps({"_id": f"{doc['_id']}-v{copy}", "title": title,
                                    "text": ". ".join(parts[k:] + parts[:k])},
                                   ensure_ascii=False) + "\n")
                n += 1
            copy += 1
    print(f"{n} documents in {out / 'corpus.jsonl'}")


if __name__ == "__main__":
    main()
