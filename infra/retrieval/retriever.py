"""The retrieval API the agent and the evaluation use.

    search(query, mode=bm25|dense|hybrid, k, exclude_ids, acl_groups, named=False) -> list[Hit]
    grep(pattern, k, exclude_ids, acl_groups)                          -> list[Hit]
    get_chunks(ids)                                                    -> dict[id, chunk]
    read_document(doc_id, start, end, acl_groups)                      -> dict
    call_many([(method, args, kwargs), ...], cache=None)
                                                 -> [value or the exception it raised, ...]

With `named`, the document titled `query` (case and accents aside; else one titled `query
(qualifier)`, the search's best) comes first: a search for a name opens that name's page, as an encyclopedia's search box does,
where longer pages that mention the name outscore it (BM25 ranks 'Kansas (song)' and six Kansas
City and Kansas district pages above the 'Kansas' article in the pooled benchmark corpus).
Hybrid takes `hybrid_candidates` from BM25 and from dense and fuses them with `fusion.rrf`.
Hits are hydrated from the docstore; an id the docstore does not know, or whose row the
caller's groups may not see (a write in progress: the docstore is written last), is dropped.
Readers open only a complete index: `open_stores` refuses one without a manifest (a killed or
running ingest, see `infra.index.manifest`) with one line that says what to run.

With a question's `cache` (`infra.retrieval.fetch_cache.QuestionCache`, via `call_many(..., cache=)` or
`QuestionRetriever`), the branches of one question share what the backends answered: each
backend list is cached before exclusion and fusion, so every result equals the uncached one.
`backend_requests` counts the requests that reached the backends (bm25, dense, grep, doc: a
document with its chunks).
"""

from __future__ import annotations

import copy
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from branchsearch.fusion import rrf
from branchsearch.infra.stores.docstore import NO_COUNTS, DocStore
from branchsearch.infra.stores.protocols import MAX_K, check_k
from branchsearch.infra.stores.acl import acl_terms, acl_visible
from branchsearch.infra.config.choices import MODES, Mode
from branchsearch.infra.errors import BadQuery
from branchsearch.infra.nfc import nfc
from branchsearch.infra.retrieval.fetch_cache import QuestionCache, copy_hit
from branchsearch.infra.index.manifest import read_manifest
from branchsearch.infra.stores.hits import Hit
from branchsearch.infra.config.settings import Settings


NAMED_FIRST = 1  # pages a `named` search puts first: the name's own page
NAMED_CANDIDATES = 20  # namesakes the caller may see, read per `named` search


@dataclass
class Retriever:
    docstore: DocStore
    lexical: object  # infra.backends.LexicalStore
    dense: object | None  # infra.dense.MilvusStore
    embedder: object | None  # infra.embedder.Embedder
    rrf_k: int = 60
    hybrid_candidates: int = 50
    one_sided: str = ""  # "bm25" | "dense": an index with only that backend (hybrid = that side)
    counts_tokens: bool = False  # the docstore's token counts are in the agent's encoding
    backend_requests: Counter = field(default_factory=Counter, init=False, repr=False)
    _count_lock: threading.Lock = field(default_factory=threading.Lock, init=False,
                                        repr=False)
    _pool: object | None = field(default=None, init=False, repr=False)  # call_many's threads
    _closed: bool = field(default=False, init=False, repr=False)

    def search(self, query: str, mode: Mode = "hybrid", k: int = 10,
               exclude_ids: Sequence[str] = (), acl_groups: Sequence[str] | None = None,
               *, named: bool = False, cache: QuestionCache | None = None) -> list[Hit]:
        if mode not in MODES:
            raise BadQuery(f"unknown search mode {mode!r}; use one of {', '.join(MODES)}")
        check_k(k)
        if k <= 0 or not query.strip():
            return []
        query = nfc(query)  # the form the documents are indexed in (`infra.nfc`)
        exclude = list(dict.fromkeys(exclude_ids))
        if mode == "hybrid" and self.one_sided:
            mode = self.one_sided  # an index with one backend: hybrid is that side
        if mode == "bm25":
            hits = self._list("bm25", query, k, exclude, acl_groups, cache)
        elif mode == "dense":
            hits = self._list("dense", query, k, exclude, acl_groups, cache)
        else:
            n = max(k, self.hybrid_candidates)
            lists = [self._list("bm25", query, n, exclude, acl_groups, cache),
                     self._list("dense", query, n, exclude, acl_groups, cache)]
            hits = self._fuse(lists, k)
        hits = self._hydrate(hits, acl_groups, cache)
        return self._named_first(query, hits, k, exclude, acl_groups, cache) if named else hits

    def _named_first(self, query: str, hits: list[Hit], k: int, exclude: list[str],
                     acl_groups, cache: QuestionCache | None = None) -> list[Hit]:
        """`hits` with the pages titled `query` first (exact titles, then qualified ones, each
        in the search's own order), at most `NAMED_FIRST`, still k in all. The pages are
        filtered like the search (`exclude`, the caller's groups)."""
        pages = [p for p in self.docstore.named(query, NAMED_CANDIDATES, exclude,
                                                acl_terms(acl_groups))
                 if acl_visible(p["acl"], acl_groups)]  # (the docstore filtered them already)
        if not pages:
            return hits
        place = {h.chunk_id: i for i, h in enumerate(hits)}
        pages.sort(key=lambda p: (not p["exact"], place.get(p["chunk_id"], len(hits))))
        # (stable: then the docstore's order, shortest title first)
        found = {h.chunk_id: h for h in hits}
        found |= {h.chunk_id: h for h in self._hydrate([  # the pages the search did not bring
            Hit(p["chunk_id"], p["doc_id"], 0.0, 0, "title")
            for p in pages[:NAMED_FIRST] if p["chunk_id"] not in found], acl_groups, cache)}
        front = [found[p["chunk_id"]] for p in pages[:NAMED_FIRST] if p["chunk_id"] in found]
        ids = {h.chunk_id for h in front}
        out = (front + [h for h in hits if h.chunk_id not in ids])[:k]
        for rank, h in enumerate(out, start=1):
            h.rank = rank
        return out

    def _list(self, kind: str, query: str, k: int, exclude: list[str], acl_groups,
              cache: QuestionCache | None) -> list[Hit]:
        """One backend's top `k` for `query` without `exclude` (`kind`: bm25 | dense | grep).
        With a question's cache: a prefix-exact backend's list is cached unexcluded and
        filtered here (see `infra.retrieval.fetch_cache`); another backend's by its whole request."""
        def fetch(depth: int, without: Sequence[str]) -> list[Hit]:
            if kind == "bm25":
                hits = self.lexical.search(query, depth, without, acl_groups)
            elif kind == "grep":
                hits = self.lexical.grep(query, depth, without, acl_groups)
            else:
                hits = self._dense(query, depth, without, acl_groups)
            self._count(kind)
            return hits

        if cache is None:
            return fetch(k, exclude)
        terms = acl_terms(acl_groups)  # the groups as the backends filter on them
        groups = None if terms is None else tuple(sorted(terms))
        if self._prefix_exact(kind):
            hits = cache.ranked((kind, query, groups), k, exclude,
                                lambda depth: fetch(depth, []), MAX_K)
            return hits if hits is not None else fetch(k, exclude)
        hits = cache.once((kind, query, groups, k, frozenset(exclude)),
                          lambda: fetch(k, exclude), size=k)
        return [copy_hit(h, h.rank) for h in hits]

    def _prefix_exact(self, kind: str) -> bool:
        """Whether the backend's top k without some ids is always its top (k + more) with those
        ids dropped: one total order whatever the depth, exclusion a pure filter. tantivy and
        Milvus on a FLAT index (Milvus Lite's; exact search, exclusion dropped locally, ties at
        the cut settled by chunk id: `infra.stores.protocols.settle`). Not an approximate index
        (HNSW, IVF: the list depends on the limit), nor a backend not checked (Elasticsearch,
        external indexes): those are cached by their whole request instead."""
        if kind in ("bm25", "grep"):
            from branchsearch.infra.stores.tantivy import TantivyStore

            return type(self.lexical) is TantivyStore
        from branchsearch.infra.stores.milvus import MilvusStore

        return type(self.dense) is MilvusStore and self.dense.index_kind == "FLAT"

    def _count(self, kind: str) -> None:
        with self._count_lock:
            self.backend_requests[kind] += 1

    def _dense(self, query: str, k: int, exclude: list[str], acl_groups) -> list[Hit]:
        if self.dense is None or self.embedder is None:
            raise BadQuery("dense search needs the dense store and embedder (ingest with them)")
        vector = self.embedder.embed_queries([query])[0]
        return self.dense.search(vector, k, exclude, acl_groups)

    def _fuse(self, lists: list[list[Hit]], k: int) -> list[Hit]:
        by_id = {h.chunk_id: h for hits in reversed(lists) for h in hits}
        names = [hits[0].source if hits else "" for hits in lists]
        fused = rrf([[h.chunk_id for h in hits] for hits in lists], k=self.rrf_k, limit=k)
        return [Hit(f.id, by_id[f.id].doc_id, f.score, rank, "hybrid",
                    ranks={names[li]: r for li, r in f.ranks.items()})
                for rank, f in enumerate(fused, start=1)]

    def _hydrate(self, hits: list[Hit], acl_groups,
                 cache: QuestionCache | None = None) -> list[Hit]:
        """`hits` with their text and title from the docstore, each only from a row its caller
        may see: a write changes the stores one after the other (the docstore last), and a
        hit a search store already holds for the caller's groups may meet the document's old
        row, another group's text."""
        # (hits of an external index arrive with their text: there is no docstore to ask)
        ids = [h.chunk_id for h in hits if not h.text]
        rows = self.docstore.get_chunks(ids) if cache is None else \
            cache.rows(ids, self.docstore.get_chunks)
        out = []
        for h in hits:
            row = rows.get(h.chunk_id)
            if h.text:
                out.append(h)
            elif row is not None and acl_visible(row["acl"], acl_groups):
                h.text, h.title = row["text"], row["title"]
                if self.counts_tokens:
                    h.text_tokens, h.label_tokens, h.head = (
                        row["text_tokens"], row["label_tokens"], row["head"])
                out.append(h)
        for rank, h in enumerate(out, start=1):
            h.rank = rank
        return out

    def grep(self, pattern: str, k: int = 10, exclude_ids: Sequence[str] = (),
             acl_groups: Sequence[str] | None = None, *,
             cache: QuestionCache | None = None) -> list[Hit]:
        check_k(k)
        if isinstance(pattern, str):  # a term typed decomposed matches the indexed NFC one
            pattern = nfc(pattern)
        return self._hydrate(self._list("grep", pattern, k, list(exclude_ids), acl_groups,
                                        cache), acl_groups, cache)

    def get_chunks(self, ids: Sequence[str]) -> dict[str, dict]:
        return self.docstore.get_chunks(ids)

    def read_document(self, doc_id: str, start: int = 0, end: int | None = None,
                      acl_groups: Sequence[str] | None = None, *,
                      cache: QuestionCache | None = None) -> dict:
        """Chunks `start`..`end` (exclusive) of a document, with its metadata. A document the
        caller's `acl_groups` may not see is unknown to it. The document and its chunks are
        one read (`DocStore.read_document`), so a write meanwhile never pairs the groups it
        replaced with the text it wrote, or the other way round. With a question's cache they
        are read once per question."""
        from branchsearch.infra.stores.acl import acl_visible

        def read():
            found = self.docstore.read_document(doc_id)
            self._count("doc")
            return found

        found = read() if cache is None else cache.once(
            ("doc", doc_id), read, size=lambda found: 1 + len(found[1]) if found else 1)
        if found is None or not acl_visible(found[0]["acl"], acl_groups):
            raise BadQuery(f"unknown document id {doc_id!r}")
        doc, chunks = found
        end = len(chunks) if end is None else max(start, min(end, len(chunks)))
        if cache is not None:  # the caller's own copy (the cached rows stay as read)
            doc, chunks = copy.deepcopy(doc), [dict(c) for c in chunks]
        if not self.counts_tokens:
            chunks = [c | NO_COUNTS for c in chunks]
        doc["chunks"] = chunks[max(start, 0):end]
        return doc

    def titles(self) -> dict[str, str]:
        return self.docstore.titles()

    def load_models(self) -> None:
        """Load the query embedder now, not inside the first question's search."""
        if self.embedder is not None:
            self.embedder.embed_queries([])  # loads every model a query needs, embeds nothing

    CALLABLE = ("search", "grep", "get_chunks", "read_document")
    CACHED = ("search", "grep", "read_document")

    def call_many(self, requests: list[tuple], cache: QuestionCache | None = None) -> list:
        """Run requests `(method, args, kwargs)` concurrently (threads); each result is the
        value or the exception it raised. A branch agent sends one turn's requests together —
        to a retriever actor, in one round trip. `cache`: the question's, shared by its
        branches (same results, fewer backend requests); its branches' queries, when it
        expects them, are embedded together first (one model call, not one a branch)."""
        if cache is not None and self.embedder is not None:
            queries = cache.take_queries()
            if len(queries) > 1:
                self.embedder.embed_ahead(queries)

        def one(request):
            method, args, kwargs = request
            try:
                if method not in self.CALLABLE:
                    raise ValueError(f"unknown retriever method {method!r}")
                if cache is not None and method in self.CACHED:
                    kwargs = {**kwargs, "cache": cache}
                return getattr(self, method)(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 — returned to the caller, who decides
                return exc

        pool = self._threads() if len(requests) > 1 else None
        if pool is None:  # one request, or a closed retriever (each request says so)
            return [one(r) for r in requests]
        return list(pool.map(one, requests))

    def _threads(self):
        """One thread pool for the retriever's life: a pool per turn spent about 1 ms per
        thread started, a tenth of a branch's turn. (`one` never submits to it: no deadlock.)"""
        from concurrent.futures import ThreadPoolExecutor

        with self._count_lock:
            if self._pool is None and not self._closed:
                self._pool = ThreadPoolExecutor(max_workers=16,
                                                thread_name_prefix="retriever")
            return self._pool

    def close(self) -> None:
        with self._count_lock:
            pool, self._pool, self._closed = self._pool, None, True
        if pool is not None:  # requests in flight fail on the closed stores, not hang close()
            pool.shutdown(wait=False, cancel_futures=True)
        for part in (self.lexical, self.dense, self.docstore):
            if part is not None:
                part.close()


class QuestionRetriever:
    """A retriever as one question's branches see it: `call_many` shares the question's cache;
    everything else is the retriever's."""

    def __init__(self, retriever: Retriever, cache: QuestionCache | None):
        self.retriever, self.cache = retriever, cache

    def call_many(self, requests: list[tuple]) -> list:
        return self.retriever.call_many(requests, cache=self.cache)

    def __getattr__(self, name: str):
        return getattr(self.retriever, name)




def one_side(settings: Settings) -> str:
    """"bm25" or "dense" for an index with only that backend (an owned one ingested --no-dense,
    an external one with a side "none"), where a hybrid search is that side; "" otherwise."""
    ext = settings.external
    if ext is None:
        manifest = read_manifest(settings.index_dir)
        return "bm25" if manifest is not None and manifest.embedding is None else ""
    return "" if "none" not in (ext.lexical, ext.dense) else (
        "bm25" if ext.dense == "none" else "dense")


def searched_mode(settings: Settings) -> str:
    """The mode a search with `settings.search_mode` runs on the index (hybrid on a one-sided
    index is that side). Read where the index is; a process that cannot see an owned index's
    folder takes the setting as it is."""
    return (one_side(settings) or "hybrid") if settings.search_mode == "hybrid" else \
        settings.search_mode
