"""The same corpus ranks the same however it was ingested: one process, the documents in
reverse order, `ingest --workers 2` (Ray Data), and an ingest run again. Top-10 lists of bm25,
dense, hybrid (also `named`) and grep are compared for every query.

The corpus is hotpot-mini plus copies of its documents under other ids, written after the
originals, so ties are real: equal BM25 scores, and cosines that differ only by the float noise
of embedding the same text in another batch. An engine breaks such ties by where a chunk sits
in its index, which differs between these ingests; the stores break them by chunk id."""

from __future__ import annotations

import json

import pytest

from branchsearch.infra.config.settings import load_settings
from branchsearch.infra.index.open import open_retriever
from branchsearch.infra.ingest.pipeline import ingest

from conftest import HOTPOT

PATTERNS = ["film", "19[0-9]{2}", "american", "ed", "wood"]
EXTRA = ["Ed Wood", "film director", "American", "magazine", "Kiss and Tell 1945"]


def write_corpus(folder, docs) -> str:
    folder.mkdir(parents=True)
    with open(folder / "corpus.jsonl", "w") as f:
        for doc in docs:
            f.write(json.dumps(doc) + "\n")
    return str(folder)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(forward folder, reversed folder, queries). Every third document is copied once under
    an id that sorts before it; 'ed-wood' twelve times, a tie across the 10th place."""
    root = tmp_path_factory.mktemp("ties")
    docs = [json.loads(line) for line in open(HOTPOT / "corpus.jsonl")]
    copies = [{**d, "_id": f"copy-{d['_id']}"} for d in docs[::3]]
    wood = next(d for d in docs if d["_id"] == "ed-wood")
    copies += [{**wood, "_id": f"a{i:02d}-ed-wood"} for i in range(12)]
    every = docs + copies
    queries = [json.loads(line)["text"] for line in open(HOTPOT / "queries.jsonl")]
    queries += EXTRA + [d["title"] for d in docs[::6]]
    return (write_corpus(root / "forward", every), write_corpus(root / "reversed", every[::-1]),
            queries)


def settings_for(tmp_path_factory, name: str):
    """Each ingest in a home of its own: no embedding cache shared between them."""
    return load_settings(overrides={"home": tmp_path_factory.mktemp(name), "index": name},
                         read_env=False, read_file=False)


def top10(settings, queries) -> dict:
    retriever = open_retriever(settings)
    try:
        lists = {}
        for q in queries:
            for mode in ("bm25", "dense", "hybrid"):
                lists[mode, q] = [h.chunk_id for h in retriever.search(q, mode, 10)]
            lists["named", q] = [h.chunk_id for h in retriever.search(q, "hybrid", 10,
                                                                      named=True)]
        for p in PATTERNS:
            lists["grep", p] = [h.chunk_id for h in retriever.grep(p, 10)]
        return lists
    finally:
        retriever.close()


def assert_same(a: dict, b: dict) -> None:
    differ = [key for key in a if a[key] != b[key]]
    assert not differ, f"{len(differ)} of {len(a)} lists differ, e.g. {differ[:3]}: " \
                       f"{a[differ[0]]} vs {b[differ[0]]}"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, corpus):
    forward, _, queries = corpus
    settings = settings_for(tmp_path_factory, "one")
    ingest(forward, settings)
    return settings, top10(settings, queries)


def test_the_corpus_has_ties_across_the_tenth_place(one_process, corpus):
    """What the other tests rely on: a list whose 10th and 11th chunks score alike."""
    settings, lists = one_process
    retriever = open_retriever(settings)
    try:
        hits = retriever.search("Ed Wood", "bm25", 11)
    finally:
        retriever.close()
    assert hits[9].score == hits[10].score and hits[9].chunk_id < hits[10].chunk_id
    assert lists["bm25", "Ed Wood"][:10] == [h.chunk_id for h in hits[:10]]


def test_reversed_ingest_ranks_the_same(tmp_path_factory, corpus, one_process):
    _, backward, queries = corpus
    settings = settings_for(tmp_path_factory, "reversed")
    ingest(backward, settings)
    assert_same(one_process[1], top10(settings, queries))
    # an ingest run again over the same corpus (any order) keeps every list
    report = ingest(corpus[0], settings)
    assert report.resumed == report.documents
    assert_same(one_process[1], top10(settings, queries))


@pytest.mark.ray
def test_workers_ingest_ranks_the_same(tmp_path_factory, corpus, one_process):
    import ray

    forward, _, queries = corpus
    settings = settings_for(tmp_path_factory, "workers")
    started = not ray.is_initialized()
    try:
        report = ingest(forward, settings, workers=2, batch_docs=16)
    finally:
        if started:
            ray.shutdown()
    assert report.workers == 2
    assert_same(one_process[1], top10(settings, queries))
