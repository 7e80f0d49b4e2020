"""Each chunk's own token count, kept by ingest and carried on its hits: the agent's context
shows a chunk that fits without encoding it again, and nothing it shows or counts changes.
Real stores (docstore, tantivy, Milvus Lite) and the real heuristic episode."""

from __future__ import annotations

import json
import sqlite3

from branchsearch.infra.config.settings import load_settings
from branchsearch.infra.ingest.chunking import Chunk, chunk_text
from branchsearch.infra.ingest.corpus import Document
from branchsearch.infra.ingest.pipeline import ingest
from branchsearch.infra.index.open import open_retriever
from branchsearch.infra.models.tokenizer import TokenCounter
from branchsearch.infra.stores.docstore import DocStore
from branchsearch.infra.stores.hits import label
from branchsearch.workers.factory import make_policy
from branchsearch.workers.harness import Episode

from conftest import HOTPOT

# long enough for several overlapping windows; accents, CJK and runs of spaces that a decoded,
# stripped window re-encodes differently from the window itself
LONG = " ".join(f"Zürich café №{i}   naïve 東京 façade —  line{i}\n" for i in range(120))


def _settings(home, **extra):
    return load_settings(overrides={"home": home, "search_mode": "bm25", **extra},
                         read_env=False, read_file=False)


def _corpus(path):
    rows = [{"id": "long-é", "title": "Long", "text": LONG},
            {"id": "short", "title": "Short", "text": "  A short page, with spaces around.  "}]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def test_every_chunk_keeps_its_own_texts_token_count(tmp_path):
    settings = _settings(tmp_path / "h")
    ingest(_corpus(tmp_path / "c.jsonl"), settings, dense=False)
    counter = TokenCounter(settings.encoding)
    retriever = open_retriever(settings, need_dense=False)
    try:
        assert retriever.counts_tokens
        ids = [r["chunk_id"] for r in retriever.docstore.document_chunks("long-é")]
        assert len(ids) > 2  # several windows
        rows = retriever.get_chunks(ids + ["short#p0"])
        assert {cid: r["text_tokens"] for cid, r in rows.items()} == {
            cid: counter.count(r["text"]) for cid, r in rows.items()}
        titles = {cid: r["title"] for cid, r in rows.items()}
        assert {cid: r["label_tokens"] for cid, r in rows.items()} == {
            cid: counter.count(label(cid, titles[cid])) for cid in rows}
        n = settings.result_token_cap - 1  # where the agent cuts a long result
        assert rows["short#p0"]["head"] is None  # it fits: never cut
        longer = [cid for cid in ids if rows[cid]["text_tokens"] > n]
        assert len(longer) > 2
        for cid in longer:  # each cut where its first n tokens end
            text, (head_tokens, chars) = rows[cid]["text"], rows[cid]["head"]
            assert head_tokens == n
            assert text[:chars] == counter.decode(counter.encode(text)[:n])
        hits = retriever.search("Zürich café naïve", k=5, mode="bm25")
        assert hits and all(h.text_tokens == counter.count(h.text) for h in hits)
        assert all((h.label_tokens, h.head) == (rows[h.chunk_id]["label_tokens"],
                                                rows[h.chunk_id]["head"]) for h in hits)
        doc = retriever.read_document("long-é", 0, 3)
        assert [(c["text_tokens"], c["label_tokens"], c["head"]) for c in doc["chunks"]] == [
            (counter.count(c["text"]), rows[c["chunk_id"]]["label_tokens"],
             rows[c["chunk_id"]]["head"]) for c in doc["chunks"]]
    finally:
        retriever.close()


def test_counts_in_another_encoding_are_not_handed_on(tmp_path):
    home = tmp_path / "h"
    ingest(_corpus(tmp_path / "c.jsonl"), _settings(home, encoding="cl100k_base"), dense=False)
    retriever = open_retriever(_settings(home), need_dense=False)  # the agent counts o200k
    try:
        assert not retriever.counts_tokens
        hits = retriever.search("Zürich café", k=3, mode="bm25")
        assert hits and all((h.text_tokens, h.label_tokens, h.head) == (None, None, None)
                            for h in hits)
        assert all((c["text_tokens"], c["label_tokens"], c["head"]) == (None, None, None)
                   for c in retriever.read_document("long-é", 0, 2)["chunks"])
    finally:
        retriever.close()


def test_a_docstore_written_before_counts_reads_none_and_gains_them_for_new_rows(tmp_path):
    path = tmp_path / "docs.sqlite"
    db = sqlite3.connect(path)  # the schema before `text_tokens`
    db.executescript("""
        CREATE TABLE docs (doc_id TEXT PRIMARY KEY, title TEXT, source TEXT, date TEXT, acl TEXT,
            meta TEXT, n_chunks INTEGER, fingerprint TEXT, title_key TEXT);
        CREATE TABLE chunks (chunk_id TEXT PRIMARY KEY, doc_id TEXT NOT NULL, n INTEGER NOT NULL,
            text TEXT NOT NULL, start_token INTEGER, n_tokens INTEGER);
        INSERT INTO docs VALUES ('old', 'Old', '', '', '[]', '{}', 1, 'x', 'old');
        INSERT INTO chunks VALUES ('old#p0', 'old', 0, 'An old page.', 0, 99);""")
    db.commit()
    db.close()
    store = DocStore(path)
    try:
        counts = ("text_tokens", "label_tokens", "head")
        assert [store.get_chunks(["old#p0"])["old#p0"][k] for k in counts] == [None] * 3
        store.replace_documents([Document("new", "New", "A new page.")],
                                [Chunk("new#p0", "new", 0, "A new page.", 0, 4, 4, 5, (2, 5))])
        rows = store.get_chunks(["old#p0", "new#p0"])
        # never guessed from the window's count
        assert [rows["old#p0"][k] for k in counts] == [None] * 3
        assert [rows["new#p0"][k] for k in counts] == [4, 5, (2, 5)]
        assert [[c[k] for k in counts] for c in store.document_chunks("new")] == [[4, 5, (2, 5)]]
    finally:
        store.close()


class CountingCounter(TokenCounter):
    """A counter with no cache that counts how often it encodes."""

    encodes = 0

    def _tokens(self, text):
        self.encodes += 1
        return super()._tokens(text)


def test_an_episode_shows_and_counts_the_same_with_the_indexs_counts(hotpot_settings,
                                                                     hotpot_retriever):
    questions = [json.loads(line)["text"] for line in
                 (HOTPOT / "queries.jsonl").read_text().splitlines()][:6]
    assert hotpot_retriever.counts_tokens

    def run(counts: bool):
        hotpot_retriever.counts_tokens = counts
        counter = CountingCounter(hotpot_settings.encoding)
        try:
            results = [Episode(q, hotpot_retriever, make_policy(hotpot_settings),
                               hotpot_settings, counter=counter).run() for q in questions]
        finally:
            hotpot_retriever.counts_tokens = True
        return counter.encodes, [
            (r.ranked_chunk_ids, r.context_tokens_per_turn, r.tokens_read, r.final_context_ids,
             r.termination) for r in results]

    encodes_with, with_counts = run(True)
    encodes_without, without = run(False)
    assert with_counts == without
    assert encodes_with < encodes_without


def test_a_cut_from_the_texts_head_equals_the_cut_from_all_of_it():
    """With the count known, a text that does not fit is cut from an encoded prefix; over
    real pages and generated text (spaces, tabs, newlines, contractions, digits, CJK,
    combining marks) in both shipped encodings, that cut is the one the whole text gives."""
    import random

    rng = random.Random(7)
    pieces = list("aZé東 \n\t'.,-/0123456789sS") + ["'s", "  ", "\r\n", "—", "ß", "ǅ", "١",
                                                    "e\u0301", "'RE"]
    texts = [json.loads(line)["text"] for line in
             (HOTPOT / "corpus.jsonl").read_text().splitlines()] + [LONG]
    texts += ["".join(rng.choice(pieces) for _ in range(rng.randint(20, 600)))
              for _ in range(300)]
    cases = heads = 0
    for encoding in ("o200k_base", "cl100k_base"):
        counter = TokenCounter(encoding)
        for text in texts:
            full = counter.count(text)
            for max_tokens in (1, 2, 7, 40, 119):
                if full > max_tokens:
                    cases += 1
                    whole = counter.cut(text, max_tokens)
                    assert counter.cut(text, max_tokens, full) == whole, \
                        (encoding, max_tokens, text[:200])
                    # and from where ingest says the head ends, when the text's chunk has one
                    chunk, = chunk_text("d", text, counter, size=full, head_tokens=max_tokens - 1)
                    if chunk.head:
                        heads += 1
                        assert counter.cut(text, max_tokens, full, chunk.head) == whole, \
                            (encoding, max_tokens, text[:200])
    assert cases > 1000 and heads > 900


def test_a_head_that_ends_inside_a_character_is_not_kept():
    counter = TokenCounter("o200k_base")
    text = "🧑‍🔬" * 40  # each a run of byte-level tokens
    tokens = counter.encode(text)
    inside = next(n for n in range(1, len(tokens))
                  if not text.startswith(counter.decode(tokens[:n])))
    chunk, = chunk_text("d", text, counter, size=len(tokens), head_tokens=inside)
    assert chunk.head is None
    assert counter.cut(text, inside + 1, len(tokens)) == counter.cut(text, inside + 1)


def test_a_writer_opened_before_another_added_the_column_still_writes(tmp_path):
    path = tmp_path / "docs.sqlite"
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE chunks (chunk_id TEXT PRIMARY KEY, doc_id TEXT NOT NULL, n INTEGER NOT NULL,
            text TEXT NOT NULL, start_token INTEGER, n_tokens INTEGER);""")
    db.commit()
    db.close()
    early, late = DocStore(path), DocStore(path)  # both see the schema without the column
    try:
        late.replace_documents([Document("a", "A", "First.")],
                               [Chunk("a#p0", "a", 0, "First.", 0, 2, 2)])
        early.replace_documents([Document("b", "B", "Second.")],
                                [Chunk("b#p0", "b", 0, "Second.", 0, 2, 2)])
        assert {c: r["text_tokens"] for c, r in early.get_chunks(["a#p0", "b#p0"]).items()} \
            == {"a#p0": 2, "b#p0": 2}
    finally:
        early.close()
        late.close()


def test_a_document_upserted_by_a_process_of_another_encoding_is_chunked_as_the_index(tmp_path):
    from branchsearch.orchestrator.service.documents import upsert

    home = tmp_path / "h"
    recorded = _settings(home, encoding="cl100k_base", chunk_tokens=64, chunk_overlap=8)
    ingest(_corpus(tmp_path / "c.jsonl"), recorded, dense=False)
    service = _settings(home)  # o200k_base and the default windows
    retriever = open_retriever(service, need_dense=False)
    try:
        upsert(retriever, service, [Document("up-1", "Up", LONG)])
        stored = retriever.docstore.document_chunks("up-1")
    finally:
        retriever.close()
    cl100k = TokenCounter("cl100k_base")
    expected = chunk_text("up-1", LONG, cl100k, 64, 8)
    assert [(c["text"], c["text_tokens"]) for c in stored] == [
        (c.text, cl100k.count(c.text)) for c in expected]


def test_a_re_ingest_counts_the_chunks_an_earlier_version_committed_without_counts(tmp_path):
    """An index ingested before the counts were kept (columns missing, `text_tokens` NULL) gains
    them on its next ingest, even when no document changed, equal to a fresh ingest's."""
    corpus = _corpus(tmp_path / "c.jsonl")
    fresh = _settings(tmp_path / "fresh")
    ingest(corpus, fresh, dense=False)
    old = _settings(tmp_path / "old")
    ingest(corpus, old, dense=False)
    db = sqlite3.connect(old.index_dir / "docs.sqlite")
    for column in ("label_tokens", "head_tokens", "head_chars"):
        db.execute(f"ALTER TABLE chunks DROP COLUMN {column}")
    db.execute("UPDATE chunks SET text_tokens = NULL")
    db.commit()
    db.close()
    report = ingest(corpus, old, dense=False)
    assert report.resumed == 2 and report.recounted == report.chunks > 2
    assert ingest(corpus, old, dense=False).recounted == 0  # once

    def rows(settings):
        store = DocStore(settings.index_dir / "docs.sqlite")
        try:
            ids = [cid for d in ("long-é", "short") for cid in store.existing_chunk_ids([d])]
            return {cid: {k: r[k] for k in ("text_tokens", "label_tokens", "head")}
                    for cid, r in store.get_chunks(ids).items()}
        finally:
            store.close()
    assert rows(old) == rows(fresh)
    assert any(r["head"] for r in rows(old).values())


def test_another_encoding_or_cap_and_a_read_only_docstore(tmp_path):
    """A re-ingest in another encoding is refused (the documents it does not hold would keep
    chunks counted in the old one); one with another `result_token_cap` re-counts the heads; a
    docstore that cannot be written keeps its chunks uncounted and the ingest finishes."""
    from branchsearch.infra.errors import BranchsearchError
    from branchsearch.infra.ingest.pipeline import _count_earlier_chunks
    import pytest

    corpus = _corpus(tmp_path / "c.jsonl")
    settings = _settings(tmp_path / "h", encoding="cl100k_base")
    ingest(corpus, settings, dense=False)
    path = settings.index_dir / "docs.sqlite"
    before = path.read_bytes()
    with pytest.raises(BranchsearchError, match="chunked in encoding 'cl100k_base', not "
                                                "'o200k_base'.*the index is unchanged"):
        ingest(corpus, settings.replace(encoding="o200k_base"), dense=False)
    assert path.read_bytes() == before and (settings.index_dir / "manifest.json").exists()

    report = ingest(corpus, settings.replace(result_token_cap=40), dense=False)
    assert report.resumed == 2 and report.recounted > 2  # the long chunks' heads
    store = DocStore(path)
    try:
        heads = [r["head"] for r in store.get_chunks(
            store.existing_chunk_ids(["long-é"])).values()]
        assert heads and all(h is None or h[0] == 39 for h in heads) and any(heads)
        store._db.execute("UPDATE chunks SET label_tokens = NULL")
        store._db.commit()
        store._db.execute("PRAGMA query_only = ON")  # writes fail: "readonly database"
        assert _count_earlier_chunks(store, settings) == (0, "the docstore is read-only")
    finally:
        store.close()
