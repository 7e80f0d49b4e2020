"""A larger pooled corpus for the recall sets: the issue-14 "held-back" conditions, built here.

The held-back sets the issues were measured on pool their questions' paragraphs with many more
(HotpotQA: 100 questions over 9,077 passages). On such a pool the agent lost 5–8 points of AR@5
against the dev sets. This builds the same kind of pool from what the repository has: every
passage of hotpotqa-dev200, musique-train100, scifact and a synthetic set, in one corpus
(12,054 passages with `branchsearch synth DIR --docs 2000 --tasks 100 --seed 7`), and a BEIR
folder per multi-hop set with that corpus and the set's own questions and qrels. A passage two
sets both hold (same id, same text) is kept once; where the same id has different text in two
sets (4 Wikipedia titles), the later set's copy gets the suffix `--SET`, and its qrels follow it.

    python reports/recall/pool.py OUT --data ../shared/data --synth /tmp/rc-synth
    branchsearch ingest OUT/corpus.jsonl --home H --index pool
    branchsearch eval OUT/hotpot --home H --index pool --no-ingest --policy heuristic

The questions are the dev sets' own, so this checks a corpus the agent was not tuned on, not
questions it was not tuned on: every parameter of the agent stays fit on the dev corpora.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

SETS = {"hotpot": "hotpotqa-dev200", "musique": "musique-train100", "scifact": "scifact"}
QUESTION_SETS = ("hotpot", "musique")


def build(out: Path, data: Path, synth: Path | None) -> int:
    folders = {name: data / folder for name, folder in SETS.items()}
    if synth is not None:
        folders["synth"] = synth
    out.mkdir(parents=True, exist_ok=True)
    texts: dict[str, str] = {}  # id -> text of the passage kept under it
    renamed: dict[tuple[str, str], str] = {}
    tmp = out / "corpus.jsonl.tmp"
    with tmp.open("w") as f:
        for name, folder in folders.items():
            for line in (folder / "corpus.jsonl").read_text().splitlines():
                if not line.strip():
                    continue
                doc = json.loads(line)
                if texts.get(doc["_id"]) == doc["text"]:
                    continue  # the same passage in two sets: one copy, both sets' gold
                if doc["_id"] in texts:
                    renamed[(name, doc["_id"])] = doc["_id"] = f"{doc['_id']}--{name}"
                texts[doc["_id"]] = doc["text"]
                f.write(json.dumps(doc) + "\n")
    tmp.replace(out / "corpus.jsonl")
    for name in QUESTION_SETS:
        target = out / name
        (target / "qrels").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(folders[name] / "queries.jsonl", target / "queries.jsonl")  # not its mode
        lines = (folders[name] / "qrels" / "test.tsv").read_text().splitlines()
        rows = [lines[0]]
        for line in lines[1:]:
            query, doc, score = line.split("\t")
            rows.append(f"{query}\t{renamed.get((name, doc), doc)}\t{score}")
        (target / "qrels" / "test.tsv").write_text("\n".join(rows) + "\n")
        link = target / "corpus.jsonl"
        link.unlink(missing_ok=True)
        link.symlink_to(Path("..") / "corpus.jsonl")  # relative: the folder may move
    return len(texts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--data", type=Path, default=Path("../shared/data"))
    ap.add_argument("--synth", type=Path, default=None,
                    help="a `branchsearch synth` folder to pool too")
    args = ap.parse_args()
    n = build(args.out.resolve(), args.data, args.synth)
    print(f"{n} passages in {args.out / 'corpus.jsonl'}; questions in "
          + ", ".join(str(args.out / s) for s in QUESTION_SETS))


if __name__ == "__main__":
    main()
