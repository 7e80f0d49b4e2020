"""Document writes for the service: parse a body of documents, upsert them by id, delete one.

The writes run on the stores of an open `Retriever` (the process that owns them: the driver in
local mode, the retriever actor in Ray mode; Milvus Lite allows one process per file). They keep
the order `infra.ingest.pipeline` uses: dense and lexical first, the docstore — what readers see — last for
an upsert and first for a delete, so a search never returns a half-written document.

A write reaches every store the index has, whatever the service searches: a service started
with `search_mode = bm25` has not opened the dense store, so a write opens it (and the
embedder, kept) and closes it after, so the service holds no Milvus Lite file between writes.
Writing only the stores a search uses would leave the others behind, and the next ingest would
find the stores disagree.
"""

from __future__ import annotations

import json
from contextlib import contextmanager

from branchsearch.infra.errors import CorpusError


def parse_documents(body: bytes) -> list:
    """Documents from a JSON array or JSONL body, validated as `read_corpus` validates a file
    (id, text, acl as a list of groups, no duplicate ids). CorpusError names the bad line."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise CorpusError("body is not UTF-8") from None
    text = text.removeprefix("\ufeff")  # a BOM, as a corpus file may start with
    stripped, elements = text.lstrip(), None
    if stripped.startswith("["):
        from branchsearch.infra.ingest.corpus import json_problem
        from branchsearch.infra.textfile import KeyTwice, json_once, key_twice_element

        try:
            rows = json_once(stripped)
        except KeyTwice as exc:
            at = key_twice_element(stripped)
            where = f"body element {at} of {len(json.loads(stripped))}" if at else "body"
            raise CorpusError(f"{where}: {exc}") from None
        except (ValueError, RecursionError) as exc:
            raise CorpusError(f"body is not a valid JSON array ({json_problem(exc)})") from None
        # one element a line, each error named by its element (counting from 1)
        text, elements = "".join(json.dumps(r) + "\n" for r in rows), len(rows)
    elif stripped.startswith("{"):
        _refuse_wrapper(stripped)
    if not text.strip():
        raise CorpusError("no documents in the body")
    from branchsearch.infra.ingest.corpus import parse_jsonl

    return parse_jsonl(text, "body", elements=elements)


def _refuse_wrapper(text: str) -> None:
    """A body that is one JSON object holding the documents in a list (`{"documents": [...]}`)
    would otherwise read as one document without an id: say what the body must be."""
    try:
        whole = json.loads(text)
    except (ValueError, RecursionError):
        return  # JSONL (or a bad line, which read_corpus names)
    if isinstance(whole, dict) and not ({"id", "_id"} & whole.keys()):
        field = next((k for k, v in whole.items() if isinstance(v, list) and v
                      and all(isinstance(d, dict) for d in v)), None)
        if field is not None:
            raise CorpusError(f"body is one JSON object holding {field!r}: send the documents "
                              "themselves, as a JSON array or as JSONL (one a line)")


def upsert(retriever, settings, docs: list) -> dict:
    """Replace (or add) `docs` and all their chunks, chunked as the index's ingest chunked
    (its manifest's encoding and windows, whatever this process's settings say: the docstore's
    token counts are read in that encoding). A document the index holds under its id in
    another Unicode form (written by an earlier version) is replaced too. Returns {documents,
    chunks}."""
    from branchsearch.infra.index.manifest import read_manifest
    from branchsearch.infra.stores.protocols import IndexedChunk
    from branchsearch.infra.ingest.chunking import chunk_text, head_tokens
    from branchsearch.infra.models.tokenizer import TokenCounter

    recorded = read_manifest(settings.index_dir) or settings
    counter = TokenCounter(recorded.encoding)
    chunks = [c for d in docs for c in chunk_text(
        d.id, d.text, counter, recorded.chunk_tokens, recorded.chunk_overlap, title=d.title,
        head_tokens=head_tokens(settings))]
    by_id = {d.id: d for d in docs}
    indexed = [IndexedChunk(c.id, c.doc_id, by_id[c.doc_id].title, c.text, by_id[c.doc_id].acl)
               for c in chunks]
    others = retriever.docstore.other_forms([d.id for d in docs])
    ids = [d.id for d in docs] + others
    with every_store(retriever, settings) as dense:
        _reachable(retriever.lexical, dense)
        if dense is not None:
            dense.write(indexed, retriever.embedder.embed([c.body for c in indexed]), ids)
        retriever.lexical.write(indexed, ids)
        retriever.docstore.replace_documents(docs, chunks, replaced=others)
    return {"documents": len(docs), "chunks": len(chunks)}


def delete(retriever, settings, doc_id: str) -> bool:
    """Remove a document from every store, under its id in any Unicode form the index holds
    (`DocStore.stored_ids`); False when the docstore did not have it."""
    from branchsearch.infra.ingest.corpus import id_forms

    store = retriever.docstore
    with every_store(retriever, settings) as dense:
        _reachable(retriever.lexical, dense)
        found = store.stored_ids(doc_id)
        # none in the docstore: a repeat clears what a failed delete left in the other stores
        ids = found or list(id_forms(doc_id))
        store.delete_documents(ids)  # what searches see goes first
        retriever.lexical.write([], ids)
        if dense is not None:
            dense.write([], [], ids)
    return bool(found)


def _reachable(*stores) -> None:
    """Ask each server store for its count before a write touches any: a backend already down
    (BackendUnavailable) fails the write with nothing changed, rather than half-way (a delete
    that removed the document from the docstore, so its repeat answered 404, and left its
    chunks in the store that was down)."""
    for store in stores:
        if store is not None:
            store.count()


@contextmanager
def every_store(retriever, settings):
    """The dense store a write must reach: the retriever's, or, when it was opened without one
    (a BM25 search mode) and the owned index has one, that store opened for this write and
    closed after it (the embedder stays loaded on the retriever). None: the index has none."""
    from branchsearch.infra.index.manifest import read_manifest
    from branchsearch.infra.index.open import open_dense

    if retriever.dense is not None or settings.external is not None:
        yield retriever.dense
        return
    manifest = read_manifest(settings.index_dir)
    if manifest is None or manifest.embedding is None:
        yield None
        return
    dense, retriever.embedder = open_dense(settings, manifest, retriever.embedder)
    try:
        yield dense
    finally:
        dense.close()


def probe(retriever) -> dict:
    """Touch every backend once (counts); BackendUnavailable names the one that is down."""
    from branchsearch.infra.errors import BackendUnavailable

    counts = {}
    for name, store in (("lexical", retriever.lexical), ("dense", retriever.dense)):
        if store is None:
            continue
        try:
            counts[name] = store.count()
        except BackendUnavailable:
            raise
        except Exception as exc:  # noqa: BLE001 — name the backend and the cause, one line
            where = getattr(store, "url", None) or getattr(store, "uri", None) or ""
            raise BackendUnavailable(
                f"{name} store {_backend_name(store)}{' at ' + where if where else ''} is not "
                f"answering ({type(exc).__name__}: {str(exc)[:200]})") from None
    return counts


def _backend_name(store) -> str:
    return {"ElasticStore": "elasticsearch", "TantivyStore": "tantivy",
            "MilvusStore": "milvus"}.get(type(store).__name__, type(store).__name__)


# Run inside the Ray retriever actor (`actor.__ray_call__`): the actor owns the stores.
def upsert_in_actor(service, settings, docs):
    return upsert(service.retriever, settings, docs)


def delete_in_actor(service, settings, doc_id):
    return delete(service.retriever, settings, doc_id)


def probe_in_actor(service):
    return probe(service.retriever)
