"""What an index is, worked out once: `index_profile(settings)`.

Owned (built by our `ingest` under the data home) or external (declared in `[indexes.NAME]`),
its sides (where BM25 and vectors live), the Milvus Lite file one process must own (so one
retriever replica), whether one side is missing (a hybrid search is then that side), and — for
an owned index — whether it can be searched now: complete, no ingest writing it, its store files
in place, its backends reachable by these settings. The CLI, the driver's executors, the
catalog (`branchsearch indexes`) and the service all ask this one function, so they cannot
disagree about an index.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

from branchsearch.infra.errors import BranchsearchError, IndexIncomplete, SettingsError
from branchsearch.infra.config.settings import Settings
from branchsearch.infra.models.static_tune import PROJECTION


@dataclass(frozen=True)
class IndexProfile:
    name: str
    kind: str  # owned | external
    folder: Path | None  # an owned index's folder under home/indexes
    lexical: str  # "tantivy", "elasticsearch", or "" (no BM25 side)
    dense: str  # "milvus-lite", "milvus", or "" (no dense side)
    lite_file: str  # the Milvus Lite file a retriever opens ("": none, or a server)
    one_side: str  # "bm25" | "dense" for an index with one side only, else ""
    problem: BranchsearchError | None = None  # why it cannot be searched now (None: it can)
    manifest: object = None  # an owned index's manifest, when complete

    @property
    def health(self) -> str:
        return "ok" if self.problem is None else str(self.problem)

    def require_searchable(self) -> None:
        """Raise the one-line error that says why it cannot be searched (and what to run)."""
        if self.problem is not None:
            raise self.problem

    def replicas(self, asked: int) -> tuple[int, str]:
        """(retriever actors to start, a note when fewer than asked): a Milvus Lite file has
        one owning process; servers and the read-only local files take any number."""
        if asked > 1 and self.lite_file:
            return 1, (f"retriever_replicas = {asked}: using 1, because the dense index is a "
                       f"Milvus Lite file ({self.lite_file}) and a Lite file has one owning "
                       "process; replicas need a Milvus server (milvus_uri)")
        return asked, ""


def index_profile(settings: Settings) -> IndexProfile:
    """The profile of `settings.index` (nothing is opened; files and manifests are read)."""
    from branchsearch.infra.stores.milvus_lite import is_server

    ext = settings.external
    if ext is not None and ext.problem:  # its table is wrong: it cannot open
        return IndexProfile(ext.name, "external", None, "", "", "", "", SettingsError(ext.problem))
    if ext is not None:
        uri = (ext.milvus_uri or settings.milvus_uri) if ext.dense == "milvus" else ""
        # a bm25 search opens the collection too: for a dense-only index (its docs), or a
        # hybrid one's groups (`stricter`)
        lite = "" if not uri or is_server(uri) else str(uri)
        lexical = "elasticsearch" if ext.lexical == "elasticsearch" else ""
        dense = ("milvus" if is_server(uri) else "milvus-lite") if uri else ""
        side = "" if lexical and dense else ("bm25" if lexical else "dense")
        return IndexProfile(ext.name, "external", None, lexical, dense, lite, side)
    return _owned(settings)


def _owned(settings: Settings) -> IndexProfile:
    from branchsearch.infra.stores.milvus_lite import is_server
    from branchsearch.infra.index.manifest import require_complete
    from branchsearch.infra.index.open import dense_uri

    folder = settings.index_dir
    try:
        manifest = require_complete(folder, settings.index, home_flag(settings))
    except BranchsearchError as exc:  # not found, incomplete, being ingested, copied: taken
        uri = dense_uri(settings)
        lite = "" if settings.search_mode == "bm25" or is_server(uri) else uri  # as on Lite
        return IndexProfile(settings.index, "owned", folder, "", "", lite, "", exc)
    backends = manifest.backends or {}
    uri = dense_uri(settings, backends)
    lexical = str(backends.get("lexical", ""))
    dense = str(backends.get("dense", "")) if manifest.embedding is not None else ""
    problem: BranchsearchError | None = None
    if lexical.startswith("elasticsearch") and not settings.es_url:  # not "damaged"
        problem = SettingsError(f"index {settings.index!r} keeps its BM25 side in {lexical}; "
                                "set es_url (BRANCHSEARCH_ES_URL) to search it")
    else:
        health = files_health(folder, manifest, dense=settings.search_mode != "bm25")
        if health != "ok":
            problem = IndexIncomplete(f"index {settings.index!r} is {health}")
    lite = "" if not dense or settings.search_mode == "bm25" or is_server(uri) else uri
    return IndexProfile(settings.index, "owned", folder,
                        "elasticsearch" if lexical.startswith("elasticsearch") else "tantivy",
                        ("milvus-lite" if dense.startswith("milvus-lite") else "milvus")
                        if dense else "", lite, "" if dense else "bm25", problem, manifest)


def files_health(folder: Path, manifest, *, dense: bool = True) -> str:
    """"ok", or what a complete index's folder lacks (its store files deleted since, or the
    folder copied from another index's); `dense=False`: a BM25 search, which needs no vectors.
    Backends on servers are not asked here."""
    from branchsearch.infra.index.manifest import ingested_as

    old = ingested_as(folder, manifest)
    if old is not None:
        return f"copied or renamed from {old!r}: rename the folder back, or ingest it anew"
    backends = manifest.backends or {}
    need = ["docs.sqlite"]
    if backends.get("lexical") == "tantivy":
        need.append("tantivy/meta.json")
    if dense and str(backends.get("dense", "")).startswith("milvus-lite "):
        need.append("dense.db")
    fitted = (manifest.embedding or {}).get("fitted")
    if dense and fitted:  # the static model fitted to the index embeds its chunks
        need.append(f"{fitted}/model.safetensors")
    missing = [name for name in need if not (folder / name).exists()]
    if missing:
        return f"damaged: {', '.join(missing)} missing; remove the folder and ingest it again"
    with open(folder / "docs.sqlite", "rb") as f:  # overwritten: not a database any more (as
        head = f.read(16)  # SQLite says: an empty file is an empty database)
        if head and head != b"SQLite format 3\x00":
            return "damaged: docs.sqlite is not a database; remove the folder and ingest it again"
    if dense and fitted and not whole_safetensors(folder / fitted / "model.safetensors"):
        return (f"damaged: {fitted}/model.safetensors is cut short; remove the folder and "
                "ingest it again")
    projection = folder / fitted / PROJECTION if dense and fitted else None
    if projection is not None and projection.exists() and not whole_zip(
            projection, ("mean.npy", "axes.npy")):
        return (f"damaged: {fitted}/{PROJECTION} is not whole; remove the folder and ingest "
                "it again")
    return "ok"


def whole_zip(path: Path, members: tuple[str, ...] = ()) -> bool:
    """Whether a zip (an .npz) is whole: its directory readable, `members` in it, and every
    member's CRC right, so a changed byte is found here and not at the first search (the
    projection is 0.4 MB). Whatever the zip module raises on a damaged file (a version or
    encryption flag flipped is NotImplementedError or RuntimeError) is "not whole"."""
    try:
        with zipfile.ZipFile(path) as z:
            return set(members) <= set(z.namelist()) and z.testzip() is None
    except Exception:  # noqa: BLE001 — any failure to read it back is damage
        return False


def whole_safetensors(path: Path) -> bool:
    """Whether a safetensors file is as long as its header says (8 bytes of header length,
    the JSON header, then the tensors up to the last `data_offsets` end): a file cut short by a
    full disk or a partial copy fails here, before any model load."""
    import json
    import struct

    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"),
                  default=0)
        return path.stat().st_size >= 8 + length + end
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error):
        return False


def home_flag(settings: Settings) -> str:
    """`--home` for the hints in error messages, when it is not the default."""
    import os

    return "" if str(settings.home) == ".branchsearch" or os.environ.get(
        "BRANCHSEARCH_HOME") == str(settings.home) else str(settings.home)
