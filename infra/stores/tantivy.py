"""Embedded lexical store on tantivy: BM25 over title + text, term regex.

BM25 terms are lower-cased, accent-folded and English-stemmed (`en_stem_fold`): 'Aschenbrodel'
finds 'Aschenbrödel'. An index written before folding keeps its own analyzer (`en_stem`, no
folding), also when documents are ingested into it again: only a new index (remove the index
folder, ingest again) folds. `folds` tells them apart.

Chinese and Japanese write no spaces between words: tantivy's tokenizer would make a sentence
one token, and drop it as too long. Text and queries alike pass `cjk_terms` first, which adds
each run of Han / kana characters' overlapping bigrams (the CJK analyzers of Lucene and
Elasticsearch do the same), so '東京' and '333メートル' find the sentence that holds them."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from branchsearch.infra.errors import BadQuery
from branchsearch.infra.stores.hits import Hit
from branchsearch.infra.stores.protocols import (IndexedChunk, check_pattern, query_words,
                                                 settled)
from branchsearch.infra.stores.acl import acl_terms


FOLDING = "en_stem_fold"
# Han (with extensions and compatibility ideographs), hiragana, katakana (and half-width)
_CJK_RUN = re.compile("[\u3040-\u30ff\u31f0-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
                      "\uff66-\uff9f]+")


def cjk_terms(text: str) -> str:
    """`text` with each run of Han / kana characters set apart and followed by its overlapping
    bigrams ("iPhone用のケース" -> "iPhone 用のケース 用の のケ ケー ース "; "2024年3月" -> "2024
    年 3 月 "); the run itself stays (a short run is still a term of its own, as it was in an
    index written before bigrams). Other text is left as it is."""
    def spaced(match: re.Match) -> str:
        run = match.group(0)
        return f" {run} {' '.join(run[i:i + 2] for i in range(len(run) - 1))} "

    return _CJK_RUN.sub(spaced, text)


def has_cjk(text: str) -> bool:
    """Whether `text` holds a run `cjk_terms` changes."""
    return _CJK_RUN.search(text) is not None


def folds(path: str | Path) -> bool:
    """Whether the tantivy index at `path` folds accents (True where there is no index yet:
    one made now does)."""
    meta = Path(path) / "meta.json"
    try:
        fields = json.loads(meta.read_text())["schema"]
    except FileNotFoundError:
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False  # unreadable: the store's own open reports it
    return any(f.get("name") == "body" and f.get("options", {}).get("indexing", {}).get(
        "tokenizer") == FOLDING for f in fields)


def _folding_analyzer(tantivy):
    """tantivy's `en_stem` (simple tokenizer, long tokens dropped, lower case, English stemmer)
    with accents folded before stemming."""
    return (tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.simple())
            .filter(tantivy.Filter.remove_long(40)).filter(tantivy.Filter.lowercase())
            .filter(tantivy.Filter.ascii_fold()).filter(tantivy.Filter.stemmer("english"))
            .build())


class TantivyStore:
    def __init__(self, path: str | Path, *, max_pattern: int = 200):
        import tantivy

        self._t = tantivy
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.max_pattern = max_pattern
        if (self.path / "meta.json").exists():  # an index keeps the schema it was made with
            self._index = tantivy.Index.open(str(self.path))
        else:
            sb = tantivy.SchemaBuilder()
            sb.add_text_field("chunk_id", stored=True, tokenizer_name="raw")
            sb.add_text_field("doc_id", stored=True, tokenizer_name="raw")
            sb.add_text_field("body", stored=False, tokenizer_name=FOLDING)
            sb.add_text_field("terms", stored=False, tokenizer_name="default",
                              index_option="basic")
            sb.add_text_field("acl", stored=False, tokenizer_name="raw", index_option="basic")
            self._index = tantivy.Index(sb.build(), path=str(self.path))
        self._index.register_tokenizer(FOLDING, _folding_analyzer(tantivy))
        self._schema = self._index.schema
        self._writer = None

    def write(self, chunks: Sequence[IndexedChunk], delete_doc_ids: Sequence[str]) -> None:
        if self._writer is None:
            self._writer = self._index.writer(heap_size=128_000_000, num_threads=1)
        w = self._writer
        try:
            for doc_id in delete_doc_ids:
                w.delete_documents_by_term("doc_id", doc_id)
            for c in chunks:
                doc = self._t.Document()
                doc.add_text("chunk_id", c.chunk_id)
                doc.add_text("doc_id", c.doc_id)
                doc.add_text("body", cjk_terms(c.body))
                doc.add_text("terms", c.body)
                for g in c.acl_terms:
                    doc.add_text("acl", g)
                w.add_document(doc)
            w.commit()
        except Exception:
            w.rollback()
            raise
        w.wait_merging_threads()
        self._writer = None
        self._index.reload()

    def _filtered(self, query, exclude_ids: Sequence[str], acl_groups: Sequence[str] | None):
        Q, Occur = self._t.Query, self._t.Occur
        clauses = [(Occur.Must, query)]
        groups = acl_terms(acl_groups)
        if groups is not None:
            clauses.append((Occur.Must, Q.term_set_query(self._schema, "acl", groups)))
        if exclude_ids:
            clauses.append((Occur.MustNot,
                            Q.term_set_query(self._schema, "chunk_id", list(exclude_ids))))
        return Q.boolean_query(clauses) if len(clauses) > 1 else query

    def _run(self, query, k: int, source: str) -> list[Hit]:
        searcher = self._index.searcher()
        hits = []
        for rank, (score, address) in enumerate(searcher.search(query, k, count=False).hits, 1):
            doc = searcher.doc(address)
            hits.append(Hit(doc["chunk_id"][0], doc["doc_id"][0], float(score), rank, source))
        return hits

    @settled
    def search(self, query: str, k: int, exclude_ids: Sequence[str] = (),
               acl_groups: Sequence[str] | None = None) -> list[Hit]:
        words = query_words(query)
        if not words or k <= 0:
            return []
        parsed, _errors = self._index.parse_query_lenient(cjk_terms(" ".join(words)),
                                                          ["body"])
        return self._run(self._filtered(parsed, exclude_ids, acl_groups), k, "bm25")

    @settled
    def grep(self, pattern: str, k: int, exclude_ids: Sequence[str] = (),
             acl_groups: Sequence[str] | None = None) -> list[Hit]:
        pattern = check_pattern(pattern, self.max_pattern)
        try:
            query = self._t.Query.regex_query(self._schema, "terms", pattern)
        except ValueError as exc:
            raise BadQuery(f"grep: pattern {pattern!r} rejected by the index: {exc}") from None
        return self._run(self._filtered(query, exclude_ids, acl_groups), k, "grep")

    def count(self) -> int:
        return self._index.searcher().num_docs

    def close(self) -> None:
        self._writer = None
