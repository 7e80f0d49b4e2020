"""`synth --hard` (infra/datasets/synth.py `synth_hard`): deterministic by seed, and every gold
chain is consistent — each hop's document names the next hop's title, the answer is in the last
one, the question names only the first, and the decoy bridges are look-alikes outside the gold."""

from __future__ import annotations

import json

import pytest

from branchsearch.infra.datasets.synth import SynthError, synth_hard


def _read(folder):
    corpus = {d["_id"]: d for d in map(json.loads, (folder / "corpus.jsonl").open())}
    queries = [json.loads(line) for line in (folder / "queries.jsonl").open()]
    qrels = {}
    for line in (folder / "qrels" / "test.tsv").read_text().splitlines()[1:]:
        q, d, _ = line.split("\t")
        qrels.setdefault(q, []).append(d)
    return corpus, queries, qrels


def test_the_same_seed_writes_the_same_bytes_and_another_seed_does_not(tmp_path):
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        synth_hard(tmp_path / name, docs=120, tasks=12, seed=seed)
    files = ("corpus.jsonl", "queries.jsonl", "qrels/test.tsv")
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
               for f in files)
    assert (tmp_path / "a" / "queries.jsonl").read_bytes() != \
        (tmp_path / "c" / "queries.jsonl").read_bytes()


def test_the_gold_chains_are_consistent(tmp_path):
    synth_hard(tmp_path, docs=200, tasks=20, seed=7)
    corpus, queries, qrels = _read(tmp_path)
    assert len(corpus) == 200 and len(queries) == 20
    assert {q["metadata"]["hops"] for q in queries} == {3, 4}
    for q in queries:
        chain, meta = q["metadata"]["chain"], q["metadata"]
        assert qrels[q["_id"]] == chain and len(chain) == meta["hops"]
        docs = [corpus[d] for d in chain]
        for here, nxt in zip(docs, docs[1:]):  # each hop names the next hop's document
            assert nxt["title"] in here["text"]
        assert meta["answer"] in docs[-1]["text"]
        album = docs[0]["title"].removesuffix(" (album)")
        assert album in q["text"]
        assert not any(d["title"] in q["text"] for d in docs[1:])  # bridges are not named
        # the decoy bridge: a band whose name extends the gold band's, formed elsewhere, and
        # an album whose title extends the gold album's; none of it is gold
        t = q["_id"].removeprefix("hard-")
        band, decoy = corpus[f"h{t}-band"], corpus[f"h{t}-decoy-band"]
        assert decoy["title"].startswith(band["title"] + " ")
        assert corpus[f"h{t}-decoy-album"]["title"].startswith(album + " ")
        assert corpus[f"h{t}-decoy-city"]["title"] in decoy["text"]
        assert corpus[f"h{t}-decoy-city"]["title"] not in band["text"]
        assert not any("decoy" in d for d in qrels[q["_id"]])


def test_too_many_tasks_is_one_clear_error(tmp_path):
    with pytest.raises(SynthError, match="at most 200 tasks"):
        synth_hard(tmp_path, docs=4000, tasks=201)
