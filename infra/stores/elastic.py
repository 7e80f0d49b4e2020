"""Lexical store on Elasticsearch through the official client: BM25, regexp, ids, ACL filter.

Mapping: `body` (title + text, `english_folded`: Elasticsearch's `english` analyzer rebuilt
with `asciifolding`, so 'Aschenbrodel' finds 'Aschenbrödel') for BM25, `terms` (same text,
`standard` analyzer) for term regexes, keyword `chunk_id`, `doc_id`, `acl`. The document `_id` is the chunk
id, so re-indexing a chunk replaces it. Works against a real cluster (8.x/9.x; use the client
major that matches the server) and against the `noida-db` emulator used in tests.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from branchsearch.infra.errors import BackendUnavailable, BadQuery, redact
from branchsearch.infra.stores.hits import Hit
from branchsearch.infra.stores.protocols import (IndexedChunk, check_pattern, query_words,
                                                 settled)
from branchsearch.infra.stores.acl import acl_terms

MAPPINGS = {
    "properties": {
        "chunk_id": {"type": "keyword"},
        "doc_id": {"type": "keyword"},
        "acl": {"type": "keyword"},
        "body": {"type": "text", "analyzer": "english_folded"},
        "terms": {"type": "text", "analyzer": "standard"},
    }
}

# the `english` analyzer as Elasticsearch documents its rebuild, with `asciifolding` before the
# stop words and the stemmer (an index created before this keeps its own mapping)
SETTINGS = {"analysis": {
    "filter": {"english_stop": {"type": "stop", "stopwords": "_english_"},
               "english_stemmer": {"type": "stemmer", "language": "english"},
               "english_possessive_stemmer": {"type": "stemmer",
                                              "language": "possessive_english"}},
    "analyzer": {"english_folded": {"tokenizer": "standard", "filter": [
        "english_possessive_stemmer", "lowercase", "asciifolding", "english_stop",
        "english_stemmer"]}}}}


INDEX_PREFIX = "branchsearch-"
_MAX_BYTES = 255  # Elasticsearch's limit on an index name, in UTF-8 bytes


def es_index_for(index: str) -> str:
    """The Elasticsearch index of an owned index; the one place that names it. Elasticsearch
    wants a lowercase name (`\\ / * ? " < > | , # :` and space are refused too, but an index
    name holds only letters, digits, '-' and '_'). A lowercase name, in any script, keeps
    `branchsearch-<index>`. Any other (`Foo`, `Отдел-1`) is `branchsearch-<its lowercase>.<12
    hex of its SHA-256>`, cut to 255 bytes: no lowercase name maps there (an index name holds no
    '.'), and the hash keeps `Foo` apart from `foo` and from `FOO`."""
    if index == index.lower():
        return INDEX_PREFIX + index
    digest = hashlib.sha256(index.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    room = _MAX_BYTES - len(INDEX_PREFIX) - 1 - len(digest)
    lowered = index.lower().encode("utf-8", "surrogatepass")[:room].decode("utf-8", "ignore")
    return f"{INDEX_PREFIX}{lowered}.{digest}"


class ElasticStore:
    def __init__(self, url: str, index: str, *, api_key: str | None = None,
                 max_pattern: int = 200, timeout_s: float = 30, create: bool = True):
        from elasticsearch import Elasticsearch

        self.url, self.index, self.max_pattern = url, index, max_pattern
        self.timeout_s = timeout_s
        self._es = Elasticsearch(url, api_key=api_key, request_timeout=timeout_s)
        try:
            if create and not self._es.indices.exists(index=index):
                self._es.indices.create(index=index, settings=SETTINGS, mappings=MAPPINGS)
        except Exception as exc:
            raise _unavailable(url, exc, timeout_s) from None

    def folds(self) -> bool | None:
        """Whether this index's BM25 folds accents: its `body` is analysed by `english_folded`.
        An index created before folding keeps the plain `english` analyzer (ingesting again
        writes into the same mapping), and the policy must not assume it folds. None where
        there is no index yet (the one an ingest creates will fold)."""
        from elasticsearch import NotFoundError

        try:
            mapping = self._es.indices.get_mapping(index=self.index)
        except NotFoundError:
            return None
        except Exception as exc:
            raise _unavailable(self.url, exc, self.timeout_s) from None
        fields = [m.get("mappings", {}).get("properties", {}).get("body", {})
                  for m in dict(mapping).values()]
        return bool(fields) and all(f.get("analyzer") == "english_folded" for f in fields)

    def write(self, chunks: Sequence[IndexedChunk], delete_doc_ids: Sequence[str]) -> None:
        try:
            for i in range(0, len(delete_doc_ids), 1000):
                self._es.delete_by_query(
                    index=self.index, refresh=True, conflicts="proceed",
                    query={"terms": {"doc_id": list(delete_doc_ids[i:i + 1000])}})
            for i in range(0, len(chunks), 500):
                ops: list[dict] = []
                for c in chunks[i:i + 500]:
                    ops.append({"index": {"_index": self.index, "_id": c.chunk_id}})
                    ops.append({"chunk_id": c.chunk_id, "doc_id": c.doc_id, "acl": c.acl_terms,
                                "body": c.body, "terms": c.body})
                result = self._es.bulk(operations=ops)
                if result.get("errors"):
                    first = next(item for item in result["items"]
                                 if next(iter(item.values())).get("error"))
                    raise BackendUnavailable(f"elasticsearch bulk failed: {first}")
            self._es.indices.refresh(index=self.index)
        except BackendUnavailable:
            raise
        except Exception as exc:
            raise _unavailable(self.url, exc, self.timeout_s) from None

    def _query(self, must: dict, exclude_ids: Sequence[str], acl_groups) -> dict:
        query: dict = {"bool": {"must": [must]}}
        groups = acl_terms(acl_groups)
        if groups is not None:
            query["bool"]["filter"] = [{"terms": {"acl": groups}}]
        if exclude_ids:
            query["bool"]["must_not"] = [{"ids": {"values": list(exclude_ids)}}]
        return query

    def _run(self, query: dict, k: int, source: str) -> list[Hit]:
        try:
            result = self._es.search(index=self.index, query=query, size=k,
                                     source_includes=["doc_id"])
        except Exception as exc:
            if getattr(getattr(exc, "meta", None), "status", None) == 400:
                raise BadQuery(f"elasticsearch rejected the {source} query: {exc}") from None
            raise _unavailable(self.url, exc, self.timeout_s) from None
        return [Hit(h["_id"], h["_source"]["doc_id"], float(h["_score"] or 0.0), rank, source)
                for rank, h in enumerate(result["hits"]["hits"], start=1)]

    @settled
    def search(self, query: str, k: int, exclude_ids: Sequence[str] = (),
               acl_groups: Sequence[str] | None = None) -> list[Hit]:
        words = query_words(query)
        if not words or k <= 0:
            return []
        return self._run(self._query({"match": {"body": " ".join(words)}}, exclude_ids,
                                     acl_groups), k, "bm25")

    @settled
    def grep(self, pattern: str, k: int, exclude_ids: Sequence[str] = (),
             acl_groups: Sequence[str] | None = None) -> list[Hit]:
        pattern = check_pattern(pattern, self.max_pattern)
        # flags NONE: Lucene's optional operators (@ & ~ < >) stay literal, as in Python's re
        must = {"regexp": {"terms": {"value": pattern, "flags": "NONE",
                                     "max_determinized_states": 10000}}}
        return self._run(self._query(must, exclude_ids, acl_groups), k, "grep")

    def count(self) -> int:
        try:
            return int(self._es.count(index=self.index)["count"])
        except Exception as exc:
            raise _unavailable(self.url, exc, self.timeout_s) from None

    def drop(self) -> None:
        self._es.indices.delete(index=self.index, ignore_unavailable=True)

    def close(self) -> None:
        self._es.close()


def _unavailable(url: str, exc: Exception, timeout_s: float) -> BackendUnavailable:
    """The one line for a request that failed: the server's own answer, a request that got
    none within `timeout_s` (a server up but overloaded or paused answers so too: starting it
    is not the fix), or no connection at all."""
    from elasticsearch import ApiError, ConnectionTimeout

    url = redact(url)  # an error line is shown and logged: no credentials in it
    if isinstance(exc, ApiError):
        return BackendUnavailable(f"elasticsearch at {url}: {exc.meta.status} {exc.message}")
    if isinstance(exc, ConnectionTimeout):
        return BackendUnavailable(
            f"elasticsearch at {url} did not answer within backend_timeout_s = {timeout_s:g} s "
            "(ConnectionTimeout): it is overloaded or stalled, or drops connections; retry, "
            "raise backend_timeout_s, or check the server and es_url")
    return BackendUnavailable(
        f"elasticsearch at {url} is not reachable ({type(exc).__name__}); start it or fix es_url")
