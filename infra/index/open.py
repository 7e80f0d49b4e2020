"""Opening an index: its stores (docstore, lexical, dense) and the embedder, for a reader or a writer.

`open_retriever` is the reader's door: it refuses an index that is incomplete, being ingested or
damaged with the one line `index.profile` words (`check_readable` says it without opening anything).
"""

from __future__ import annotations

from pathlib import Path

from branchsearch.infra.stores.docstore import DocStore
from branchsearch.infra.errors import BadQuery, IndexIncomplete, SettingsError
from branchsearch.infra.config.settings import Settings
from branchsearch.infra.retrieval.retriever import Retriever, one_side


_FOLDING: set[tuple[str, str]] = set()  # Elasticsearch indexes seen folding (they stay so)


def refuse_external(settings: Settings) -> None:
    """One line, before anything is written (a folder included), when the index is external."""
    if settings.external is not None:
        raise BadQuery(f"index {settings.index!r} is external ({settings.external.describe()}"
                       "): branchsearch never writes to it; ingest into another index name")


def open_stores(settings: Settings, *, create: bool = False, need_dense: bool = True,
                embedder=None):
    """(docstore, lexical, dense, embedder) for the settings' index; dense may be None.
    `embedder` replaces the configured one (anything with `embed(texts)`, `embed_queries(texts)`
    and `dim`)."""
    if settings.external is not None:  # an index the enterprise already has: read in place
        from branchsearch.infra.stores.external import open_external

        if create:
            refuse_external(settings)
        return open_external(settings.external, settings, need_dense=need_dense,
                             embedder=embedder)
    root = settings.index_dir
    manifest = None
    if not create:  # readers: only a complete index that no ingest is writing
        from branchsearch.infra.index.profile import index_profile

        profile = index_profile(settings)
        profile.require_searchable()
        manifest = profile.manifest
        if manifest.embedding is None:
            need_dense = False  # a BM25-only index (ingest --no-dense): dense search says so
    docstore = _open_docstore(root / "docs.sqlite", settings.index)
    lexical = lexical_store(settings)
    dense = None
    if not need_dense:
        embedder = None
    else:
        try:
            # a writer whose index holds nothing yet: a collection that records no index and
            # holds rows is another index's (`MilvusStore`)
            fresh = create and not docstore.chunk_count() and not docstore.pending()
            dense, embedder = open_dense(settings, manifest, embedder, fresh=fresh)
        except BaseException:
            for store in (lexical, docstore):
                store.close()
            raise
    return docstore, lexical, dense, embedder


def query_model(settings: Settings, model, embedder=None) -> Settings:
    """The settings a reader embeds queries with: the index's own model. A bundled model
    (MiniLM, static-minilm) is always at hand, so the index's choice wins over embed_model;
    another model (a local folder) must be the one configured, and an embedder handed in
    must be the one the index was embedded with: a query is never embedded by another model."""
    from branchsearch.infra.ingest.batches import embedder_name
    from branchsearch.infra.models.embedder import BUNDLED_MODELS

    if embedder is not None:
        if embedder_name(embedder) != model:
            raise SettingsError(f"index {settings.index!r} was embedded with {model!r}, not "
                                f"{embedder_name(embedder)!r}; queries must use the same model")
        return settings
    if model == settings.embed_model:
        return settings
    if model in BUNDLED_MODELS:
        return settings.replace(embed_model=model)
    raise SettingsError(f"index {settings.index!r} was embedded with {model!r} but embed_model "
                        f"is {settings.embed_model!r}; use that model or re-ingest")


def index_embedder(settings: Settings, reader: bool = True):
    """The embedder of the owned index `settings.index` names, as `settings` configure it: with
    static-minilm, the model fitted to the index when it has one, else the distilled one; for
    a `reader`, a fitted one's queries by MiniLM unless `static_queries` is "static" (a writer
    embeds no query)."""
    from branchsearch.infra.models.embedder import Embedder
    from branchsearch.infra.models.static import STATIC_MODEL
    from branchsearch.infra.models.static_tune import fitted_folder

    static_folder = fitted_folder(settings.index_dir) if settings.embed_model == STATIC_MODEL \
        else None
    return Embedder(settings.embed_model, settings.embed_batch, settings.embed_device,
                    cache_path=Path(settings.home) / "cache" / "embeddings.sqlite",
                    backend=settings.embed_backend, static_folder=static_folder,
                    teacher_queries=reader and settings.static_queries == "minilm")


def open_dense(settings: Settings, manifest=None, embedder=None, *, fresh: bool = False):
    """(dense store, embedder) of the owned index: the manifest's dimension, else the one an
    ingest in progress recorded (`dense.dim`), else the embedder's. A reader's embedder is the
    index's own model (`query_model`)."""
    if manifest is not None and manifest.embedding is not None:
        settings = query_model(settings, manifest.embedding.get("model"), embedder)
    from branchsearch.infra.stores.milvus_lite import is_server

    uri = dense_uri(settings)
    if is_server(uri):  # a refused server is said before the embedding model loads (seconds)
        from branchsearch.infra.stores.milvus import refused_server

        refused_server(uri, settings.backend_timeout_s, server_hint(settings))
    embedder = embedder or index_embedder(settings, reader=manifest is not None)
    if manifest is None:  # a writer (ingest): the collection is created when missing
        return dense_store(settings, _dense_dim(settings.index_dir, embedder),
                           fresh=fresh), embedder
    ingested_into = str(manifest.backends.get("dense", ""))
    if not is_server(uri) and " " in ingested_into and is_server(ingested_into.split()[1]):
        raise SettingsError(  # the vectors are on a server this process was not told about
            f"index {settings.index!r} keeps its vectors in {ingested_into}; set milvus_uri "
            "(BRANCHSEARCH_MILVUS_URI) to that server")
    # an ingest skips documents it already holds, so it cannot refill a lost dense store
    again = f"remove {settings.index_dir} and ingest it again"
    if not is_server(uri) and not Path(uri).exists():  # Milvus Lite would create it empty
        raise IndexIncomplete(f"index {settings.index!r} is damaged: {uri} missing; {again}")
    try:
        return dense_store(settings, manifest.embedding["dim"], create=False), embedder
    except IndexIncomplete as exc:  # a complete index whose collection is gone is damaged
        raise IndexIncomplete(f"index {settings.index!r} is damaged: {exc}; {again}") from None


def _open_docstore(path: Path, index: str) -> DocStore:
    import sqlite3

    try:
        return DocStore(path)
    except sqlite3.DatabaseError as exc:
        raise IndexIncomplete(f"index {index!r} is damaged: {path}: {exc}; re-ingest it"
                              ) from None


def lexical_folds(settings: Settings) -> bool:
    """Whether the index's BM25 folds accents: an owned index made before folding does not
    (tantivy: `infra.stores.tantivy.folds`; Elasticsearch: `ElasticStore.folds`, its mapping);
    external stores, whose analyzers are their owners', are taken to."""
    if settings.external is not None:
        return True
    if settings.es_url and on_elastic(settings):
        from branchsearch.infra.stores.elastic import es_index_for

        return _elastic_folds(settings.es_url, es_index_for(settings.index),
                              settings.es_api_key or None, settings.backend_timeout_s)
    from branchsearch.infra.stores.tantivy import folds

    return folds(settings.index_dir / "tantivy")


def _elastic_folds(url: str, index: str, api_key: str | None, timeout_s: float) -> bool:
    """Only a folding mapping is remembered: an index made before folding is asked again at
    every policy, so one dropped and ingested anew (the README's fix) folds from the next
    question on, in a service that keeps running."""
    if (url, index) in _FOLDING:
        return True
    from branchsearch.infra.stores.elastic import ElasticStore

    store = ElasticStore(url, index=index, api_key=api_key, timeout_s=timeout_s, create=False)
    try:
        folding = store.folds()
    finally:
        store.close()
    if folding:
        _FOLDING.add((url, index))
    return folding is not False  # no index yet: the one an ingest creates folds


def lexical_store(settings: Settings):
    """The owned index's lexical store: Elasticsearch at `es_url`, else tantivy in the index."""
    if settings.es_url and on_elastic(settings):
        from branchsearch.infra.stores.elastic import ElasticStore, es_index_for

        return ElasticStore(settings.es_url, index=es_index_for(settings.index),
                            api_key=settings.es_api_key or None,
                            max_pattern=settings.grep_max_pattern,
                            timeout_s=settings.backend_timeout_s)
    from branchsearch.infra.stores.tantivy import TantivyStore

    path = settings.index_dir / "tantivy"
    try:
        return TantivyStore(path, max_pattern=settings.grep_max_pattern)
    except ValueError as exc:  # a segment file truncated or gone: tantivy cannot open the index
        why = " ".join(str(exc).split())[:200]
        raise IndexIncomplete(f"index {settings.index!r} is damaged: {path}: {why}; remove "
                              f"{settings.index_dir} and ingest it again") from None


def dense_uri(settings: Settings, backends: dict | None = None) -> str:
    """Where the owned index's vectors live: Milvus at `milvus_uri`, else the index's Lite
    file. A complete index ingested into its Lite file stays there when `milvus_uri` is set
    (for another index, or in the environment): its manifest says where its vectors are
    (`backends`, its record, when the caller has read it; else read here)."""
    backends = recorded_backends(settings) if backends is None else backends
    recorded = str(backends.get("dense", ""))
    if settings.milvus_uri and not recorded.startswith("milvus-lite "):
        return str(settings.milvus_uri)
    return str(settings.index_dir / "dense.db")


def recorded_backends(settings: Settings) -> dict:
    """The backends a complete owned index's ingest recorded in its manifest ({} for an
    external index, or one with no manifest: being ingested, or not there)."""
    if settings.external is not None:
        return {}
    from branchsearch.infra.index.manifest import read_manifest

    manifest = read_manifest(settings.index_dir)
    return dict(manifest.backends or {}) if manifest is not None else {}


def as_recorded(settings: Settings, manifest) -> Settings:
    """`settings` for writing an owned index where its last complete ingest put it (`manifest`;
    None: as the settings say): no `es_url` when its BM25 side is tantivy, no `milvus_uri` when
    its vectors are in its Lite file. An ingest takes these before it removes the manifest, so
    every store it opens, its workers and the manifest it writes agree with the readers."""
    backends = (manifest.backends or {}) if manifest is not None else {}
    changes = {}
    if settings.es_url and str(backends.get("lexical", "")) == "tantivy":
        changes["es_url"] = ""
    if settings.milvus_uri and str(backends.get("dense", "")).startswith("milvus-lite "):
        changes["milvus_uri"] = ""
    return settings.replace(**changes) if changes else settings


def on_elastic(settings: Settings) -> bool:
    """Whether the owned index's BM25 side is in Elasticsearch: where its ingest put it once it
    is complete (an index ingested into tantivy is searched there when `es_url` is set for
    another index; searching Elasticsearch instead would find nothing and create an empty
    index there), else whether `es_url` is set."""
    recorded = str(recorded_backends(settings).get("lexical", ""))
    return recorded.startswith("elasticsearch") if recorded else bool(settings.es_url)


def dense_store(settings: Settings, dim: int, *, create: bool = True, fresh: bool = False):
    """The owned index's dense store (`dense_uri`), in a collection that holds this index and
    no other (`MilvusStore`'s `owner`; `fresh`: a writer whose index holds no chunks yet).
    `create=False` (a reader): a missing collection is `IndexIncomplete`."""
    from branchsearch.infra.stores.milvus import MilvusStore, collection_for
    from branchsearch.infra.stores.milvus_lite import lite_log_dir

    return MilvusStore(dense_uri(settings), dim,
                       token=settings.milvus_token,
                       collection=collection_for(settings.index),
                       index=index_spec(settings), create=create,
                       timeout_s=settings.backend_timeout_s, owner=settings.index, fresh=fresh,
                       hint=server_hint(settings), logs=lite_log_dir(settings.home))


def server_hint(settings: Settings) -> str:
    """The fix a refused Milvus server's line ends with, as fits the owned index: one its
    manifest says was ingested into a Milvus server keeps its vectors only there (unsetting
    `milvus_uri` would point it at an embedded file that does not hold them); a new one can
    take either."""
    from branchsearch.infra.errors import redact
    from branchsearch.infra.stores.milvus import SERVER_HINT

    recorded = str(recorded_backends(settings).get("dense", ""))
    if not recorded.startswith("milvus "):
        return SERVER_HINT
    at = recorded[len("milvus "):].rpartition(" (")[0]  # "milvus <uri> (<vector index>)"
    if at and at != redact(settings.milvus_uri or ""):  # (recorded without credentials)
        return (f"index {settings.index!r} was ingested into the Milvus server at {at} and "
                "keeps its vectors only there: set milvus_uri to that server, or start it")
    return (f"start Milvus there: index {settings.index!r} was ingested into a Milvus "
            "server and keeps its vectors only there (keep milvus_uri set to it)")


def index_spec(settings: Settings):
    from branchsearch.infra.stores.milvus import IndexSpec

    return IndexSpec(settings.milvus_index, m=settings.milvus_hnsw_m,
                     ef_construction=settings.milvus_hnsw_ef_construction,
                     ef=settings.milvus_search_ef, consistency=settings.milvus_consistency)


def _dense_dim(root, embedder) -> int:
    """The dimension a writer creates the collection with, recorded (with the model's name, in
    `dense.model`) before the first vector is written: an ingest stopped before its manifest
    is resumed with the same model (`infra.ingest.agreement.same_unfinished_model`)."""
    from branchsearch.infra.ingest.batches import embedder_name

    marker = root / "dense.dim"
    if marker.exists():
        return int(marker.read_text())
    dim = embedder.dim
    root.mkdir(parents=True, exist_ok=True)
    (root / "dense.model").write_text(embedder_name(embedder))
    marker.write_text(str(dim))
    return dim


def open_retriever(settings: Settings, need_dense: bool = True, embedder=None) -> Retriever:
    docstore, lexical, dense, embedder = open_stores(settings, need_dense=need_dense,
                                                     embedder=embedder)
    from branchsearch.infra.index.manifest import read_manifest

    recorded = read_manifest(settings.index_dir)  # the counts in the docstore are in its encoding
    return Retriever(docstore, lexical, dense, embedder, settings.rrf_k,
                     settings.hybrid_candidates, one_side(settings),
                     counts_tokens=recorded is not None and recorded.encoding == settings.encoding)


def check_readable(settings: Settings) -> None:
    """Raise the one-line error `open_retriever` would (incomplete, being ingested, damaged,
    its backend not configured), without opening anything: callers that open the retriever
    elsewhere (a Ray actor) check here first, so the user sees the line rather than an actor's
    death."""
    from branchsearch.infra.index.profile import index_profile

    index_profile(settings).require_searchable()
