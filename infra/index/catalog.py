"""What indexes a settings object can search: the ones our `ingest` built under the data home
(complete, incomplete or being ingested, from their manifests) and the external ones declared in
`[indexes.NAME]` (their backends asked for a document count, which is also the health check)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from branchsearch.infra.errors import BranchsearchError, redact
from branchsearch.infra.config.settings import Settings


@dataclass
class IndexInfo:
    name: str
    kind: str  # owned | external
    backends: str
    documents: int | None
    chunks: int | None
    health: str  # ok | incomplete | ingesting | the error line
    embedding: str = ""  # what embeds its chunks and its queries; "" when it has no vectors

    def to_dict(self) -> dict:
        return asdict(self)


def index_names(settings: Settings) -> list[str]:
    """Owned indexes under the data home, and the external ones declared in the settings."""
    from branchsearch.infra.index.manifest import manifest_path

    root = settings.home / "indexes"
    owned = [p.name for p in root.iterdir()
             if (p / "docs.sqlite").exists() or manifest_path(p).exists()] \
        if root.is_dir() else []
    return sorted(set(owned) | {spec.name for spec in settings.indexes})


def owned_indexes(settings: Settings, *, check: bool = True) -> list[IndexInfo]:
    """Each index under the data home; with `check`, the servers a complete one lives on
    (Elasticsearch, a Milvus server) are asked for a count, as for an external index."""
    from branchsearch.infra.index.manifest import read_manifest, running_ingest
    from branchsearch.infra.index.profile import files_health, home_flag

    root = Path(settings.home) / "indexes"
    out = []
    for folder in sorted(p for p in root.glob("*") if p.is_dir()) if root.exists() else []:
        manifest = read_manifest(folder)
        running = running_ingest(folder)
        if manifest is not None:
            backends = " + ".join(f"{role}: {where}" for role, where in
                                  sorted(backends_now(folder, manifest, settings).items()))
            backends = redact(backends)  # (credentials in es_url, milvus_uri or a manifest)
            health = "ingesting" if running else files_health(folder, manifest)
            if health == "ok":
                health = _servers_health(settings.replace(index=folder.name), check)
            documents, chunks = _stored_counts(folder) or (manifest.documents,
                                                           manifest.chunks.get("docstore"))
            out.append(IndexInfo(folder.name, "owned", backends, documents, chunks, health,
                                 embedding_of(folder, manifest.embedding, settings)))
        else:
            home = home_flag(settings)
            health = f"ingesting ({running.describe()})" if running else \
                (f"incomplete: run `branchsearch ingest PATH --index {folder.name}"
                 + (f" --home {home}" if home else "") + "` again")
            out.append(IndexInfo(folder.name, "owned", "", None, None, health))
    return out


def backends_now(folder: Path, manifest, settings: Settings) -> dict[str, str]:
    """The backends an index's manifest records, each named where a search reads it now: an
    Elasticsearch or Milvus server at the settings' `es_url` or `milvus_uri` (the one the
    health check asks; the manifest keeps the address its ingest wrote to, which the settings
    may since name otherwise, a moved cluster or another name for it; the manifest's when the
    setting is unset, which the health line says to set), and the Milvus Lite file in the
    index's own folder (`open.dense_uri`; the manifest keeps the path its ingest wrote to,
    which an index folder copied to another home, or a home moved, no longer uses)."""
    backends = dict(manifest.backends or {})
    kind, _, rest = str(backends.get("dense", "")).partition(" ")
    _, paren, spec = rest.rpartition(" (")  # "<kind> <where> (<vector index>)"; the path
    spec = f" ({spec}" if paren else ""  # may hold " ("
    if kind == "milvus-lite":
        backends["dense"] = f"milvus-lite {Path(folder) / 'dense.db'}{spec}"
    elif kind == "milvus" and settings.milvus_uri:
        backends["dense"] = f"milvus {settings.milvus_uri}{spec}"
    if str(backends.get("lexical", "")).startswith("elasticsearch") and settings.es_url:
        backends["lexical"] = f"elasticsearch {settings.es_url}"
    return backends


def embedding_of(folder: Path, embedding: dict | None, settings: Settings) -> str:
    """The model that embedded an index's chunks, and for a static model fitted to the index,
    what embeds its queries: MiniLM onto the fit's axes (`static_queries = "minilm"` and the
    fit's projection there) or the fitted model itself."""
    from branchsearch.infra.models.static_tune import PROJECTION

    if not embedding:
        return ""
    fitted = embedding.get("fitted")
    if not fitted:
        return embedding["model"]
    queries = ("MiniLM onto its axes" if settings.static_queries == "minilm"
               and (folder / fitted / PROJECTION).is_file() else "the fitted model")
    return f"{embedding['model']} fitted to the index; queries by {queries}"


def index_embedding(settings: Settings) -> str:
    """What embeds `settings.index` (as `indexes` shows it): an owned index's from its
    manifest, an external one's the configured model when it has a Milvus side."""
    from branchsearch.infra.index.manifest import read_manifest

    manifest = read_manifest(settings.index_dir)
    if manifest is not None:
        return embedding_of(settings.index_dir, manifest.embedding, settings)
    spec = settings.external
    return _external_embedding(spec, settings) if spec is not None else ""


def _external_embedding(spec, settings: Settings) -> str:
    return settings.embed_model if spec.dense == "milvus" else ""


def _stored_counts(folder: Path) -> tuple[int, int] | None:
    """(documents, chunks) the index's docstore holds now, read-only: the manifest's are the
    last ingest's, before the service's writes added or removed documents. None when it
    cannot be read."""
    import sqlite3
    from urllib.parse import quote

    path = folder / "docs.sqlite"
    if not path.is_file():
        return None
    try:
        db = sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode=ro", uri=True, timeout=5)
        try:
            return (db.execute("SELECT COUNT(*) FROM docs").fetchone()[0],
                    db.execute("SELECT COUNT(*) FROM chunks").fetchone()[0])
        finally:
            db.close()
    except sqlite3.Error:
        return None


def _servers_health(settings: Settings, check: bool) -> str:
    """"ok", or why a complete owned index cannot be searched with these settings: a backend
    they do not name (es_url unset for an index in Elasticsearch) or, with `check`, a server
    that does not answer or lost the index (its Elasticsearch index or collection gone)."""
    from branchsearch.infra.index.profile import index_profile

    profile = index_profile(settings)
    if profile.problem is not None:
        return redact(str(profile.problem))
    if not check:  # as an external index says
        return "not checked" if "elasticsearch" == profile.lexical or \
            "milvus" == profile.dense else "ok"
    stores = []
    try:
        if profile.lexical == "elasticsearch":
            from branchsearch.infra.stores.elastic import ElasticStore, es_index_for

            stores.append(ElasticStore(settings.es_url, es_index_for(settings.index),
                                       api_key=settings.es_api_key or None,
                                       timeout_s=settings.backend_timeout_s, create=False))
        if profile.dense == "milvus":
            from branchsearch.infra.index.open import dense_store

            stores.append(dense_store(settings, profile.manifest.embedding["dim"], create=False))
        for store in stores:
            store.count()
    except BranchsearchError as exc:
        return redact(str(exc))
    finally:
        for store in stores:
            store.close()
    return "ok"


def external_indexes(settings: Settings, *, check: bool = True) -> list[IndexInfo]:
    """Each declared external index; with `check`, its backends are opened and counted."""
    out = []
    for spec in settings.indexes:
        info = IndexInfo(spec.name, "external", spec.describe(), None, None, "not checked",
                         _external_embedding(spec, settings))
        if spec.problem:  # its table is wrong: listed with why, never opened
            info.health = redact(spec.problem)
        elif check:
            info.documents, info.health = _external_health(spec, settings)
            info.chunks = info.documents
        out.append(info)
    return out


def _external_health(spec, settings: Settings) -> tuple[int | None, str]:
    """(documents, health) of an external index, each of its sides opened and counted: a
    hybrid index searches both (a bm25 search reads its Milvus side's groups too), so "ok"
    only when both answer. A side that fails is named in the health line ("milvus side: …");
    the documents are the first side's count that answered."""
    counts, problems = [], []
    sides = [side for side, used in (("elasticsearch", spec.lexical == "elasticsearch"),
                                     ("milvus", spec.dense == "milvus")) if used]
    for side in sides:
        try:
            store = _open_external_side(side, spec, settings)
            try:
                counts.append(store.count())
            finally:
                store.close()
        except BranchsearchError as exc:
            line = redact(str(exc))
            problems.append(f"{side} side: {line}" if len(sides) > 1 else line)
    return (counts[0] if counts else None), "; ".join(problems) or "ok"


def _open_external_side(side: str, spec, settings: Settings):
    """The external index's store of `side` ("elasticsearch" or "milvus"), opened."""
    from branchsearch.infra.stores.external import ExternalElastic, ExternalMilvus

    if side == "elasticsearch":
        return ExternalElastic(spec, spec.es_url or settings.es_url,
                               api_key=settings.es_api_key or None,
                               timeout_s=settings.backend_timeout_s)
    from branchsearch.infra.models.embedder import Embedder
    from branchsearch.infra.stores.milvus import server_answers
    from branchsearch.infra.stores.milvus_lite import is_server, lite_log_dir

    uri = spec.milvus_uri or settings.milvus_uri
    if is_server(uri):  # a refused address fails before the model loads
        server_answers(uri, settings.backend_timeout_s)
    dim = Embedder(settings.embed_model, settings.embed_batch, settings.embed_device).dim
    return ExternalMilvus(spec, uri, dim, token=settings.milvus_token,
                          timeout_s=settings.backend_timeout_s, logs=lite_log_dir(settings.home))


def list_indexes(settings: Settings, *, check: bool = True) -> list[IndexInfo]:
    return owned_indexes(settings, check=check) + external_indexes(settings, check=check)
