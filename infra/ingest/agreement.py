"""What a re-ingest must agree with: an index keeps what it was made with.

Vectors or none, the token encoding its chunks were counted in, the embedding model (also the
one a stopped ingest began with) and a fitted static model: documents added another way would
rank on a different index from the one beside them. Each check refuses with one line naming the
way out, before anything is written (the index is unchanged).
"""

from __future__ import annotations

from pathlib import Path

from branchsearch.infra.config.settings import Settings
from branchsearch.infra.errors import BranchsearchError, IndexIncomplete
from branchsearch.infra.index.manifest import Manifest
from branchsearch.infra.ingest.batches import embedder_name


def dense_as_made(settings: Settings, root: Path, previous: Manifest | None,
                   dense: bool | None) -> bool:
    """Whether this ingest embeds: as asked, else as the index was made (vectors for a new one).
    An index keeps it, complete or left incomplete by a stopped ingest (no manifest then: the
    `dense.dim` a dense ingest writes as it opens its store says it had vectors, a docstore
    without it that it had none). With vectors for some documents and none for others (those
    this ingest adds, or those a service writes to it afterwards), its dense side would be a
    different corpus from its BM25 side, and a later ingest would stop on "stores disagree"."""
    if previous is not None:
        made = previous.embedding is not None
    elif (root / "dense.dim").exists():
        made = True
    else:
        made = False if (root / "docs.sqlite").exists() else None
    if dense is None:
        return True if made is None else made
    if made is None or dense == made:
        return dense
    if made:
        model = previous.embedding.get("model") if previous is not None else "its first ingest's"
        raise BranchsearchError(
            f"ingest: index {settings.index!r} has vectors ({model}); "
            f"--no-dense would add documents without them: ingest it with vectors (no "
            f"--no-dense), or into another index name, or remove {settings.index_dir} first "
            f"(the index is unchanged)")
    raise BranchsearchError(
        f"ingest: index {settings.index!r} was made without vectors (--no-dense); vectors for "
        f"this corpus alone would leave its other documents without: ingest it with "
        f"--no-dense, or into another index name, or remove {settings.index_dir} first (the "
        f"index is unchanged)")


def same_encoding(settings: Settings, previous: Manifest | None) -> None:
    """Refuse to chunk documents in another encoding than the index's: the documents this
    corpus does not hold would keep the old chunks, whose token counts the index then reads in
    the new encoding."""
    if previous is not None and previous.encoding != settings.encoding:
        raise BranchsearchError(
            f"ingest: index {settings.index!r} was chunked in encoding {previous.encoding!r}, "
            f"not {settings.encoding!r}; its chunks cannot be mixed: set encoding = "
            f"{previous.encoding!r}, ingest into another index name, or remove "
            f"{settings.index_dir} first (the index is unchanged)")


def same_model(settings: Settings, previous: Manifest | None, embedder) -> None:
    """Refuse to add vectors of one model to an index embedded with another."""
    if previous is None or previous.embedding is None or embedder is None:
        return
    before, now = previous.embedding.get("model"), embedder_name(embedder)
    if before != now:
        raise BranchsearchError(
            f"ingest: index {settings.index!r} was embedded with {before!r}, not {now!r}; its "
            f"vectors cannot be mixed: ingest into another index name, or remove "
            f"{settings.index_dir} first (the index is unchanged)")


def unfinished_embedding(root: Path) -> tuple[int, str | None] | None:
    """(dimension, model) an ingest that stopped before its manifest had begun embedding this
    index with (`infra.index.open._dense_dim`); the model is None for an ingest of an older
    version."""
    try:
        dim = int((root / "dense.dim").read_text())
    except (OSError, ValueError):
        return None
    model = root / "dense.model"
    return dim, model.read_text().strip() if model.exists() else None


def same_unfinished_model(settings: Settings, unfinished, embedder) -> None:
    """Refuse to resume a stopped ingest with another model than the one it began with: its
    vectors would be mixed, or not fit its collection at all."""
    if unfinished is None or embedder is None:
        return
    dim, model = unfinished
    now = embedder_name(embedder)
    if (model is not None and model != now) or embedder.dim != dim:
        began = f"{model!r} ({dim} dimensions)" if model else f"a {dim}-dimension model"
        flag = f" (--embed-model {model})" if model else ""
        raise BranchsearchError(
            f"ingest: index {settings.index!r} stopped unfinished while embedding with "
            f"{began}, not {now!r}: run it again with that model{flag}, or remove "
            f"{settings.index_dir} first (the index is unchanged)")


def same_fitted(settings: Settings, previous: Manifest | None, embedder) -> None:
    """Refuse to add to an index fitted a static model (`static_tune`) without that model:
    the distilled model's vectors would sit beside the fitted one's, and rank wrongly."""
    from branchsearch.infra.index.profile import whole_safetensors

    fitted = (previous.embedding or {}).get("fitted") if previous is not None else None
    if embedder is None or not fitted:
        return
    folder = getattr(embedder, "static_folder", None)
    state = ("missing" if folder is None else "cut short"
             if not whole_safetensors(Path(folder) / "model.safetensors") else "")
    if state:
        raise IndexIncomplete(
            f"index {settings.index!r} is damaged: its fitted static model ({fitted}/ in the "
            f"index folder) is {state}; remove {settings.index_dir} and ingest it again (the "
            f"index is unchanged)")
