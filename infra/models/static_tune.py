"""Fit the static embedder to an index's own corpus (`static_tune_chunks`, on by default).

The distilled `static-minilm` averages context-free word-piece vectors, and loses a third to
a half of MiniLM's dense recall (reports/embedding.md). Before its first batch, an ingest with
it trains those vectors against MiniLM on a sample of the corpus (model2vec's "tokenlearn"
idea, done here in a few lines of torch):

* the sample: documents in an order fixed by a hash of their ids, chunked as the ingest chunks
  them, until `static_tune_chunks` chunks; plus `WINDOWS` short word windows of each (6-20 words:
  queries are short, chunks are not);
* the teacher: MiniLM's vector of each text, reduced by PCA to the static model's dimension;
* the student: the static matrix, first rotated onto the teacher's axes (orthogonal Procrustes),
  then trained so the mean of a text's rows points where its teacher vector points (cosine
  loss, Adam), stopping when a held-out twentieth of the texts stops improving.

No query or judgment is read: only the corpus being indexed, which every vector of the index
comes from anyway. Its cost is MiniLM on the sample, once per index (reports/embedding.md);
the result (a 30 MB model folder) lives in the index folder and embeds every later chunk of
that index. The folder keeps the PCA too (`PROJECTION`), so that MiniLM can embed the index's
queries onto the same axes (`Embedder.embed_queries`, setting `static_queries`). Everything is seeded: the same corpus gives
the same model, whatever the ingest's worker count.
"""

from __future__ import annotations

import hashlib
import random
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

FITTED_DIR = "static-embedder"  # in the index folder
WINDOWS = 2  # short windows per sampled chunk
WINDOW_WORDS = (6, 20)
LEARNING_RATE = 0.05  # relative to the mean absolute weight of the rotated matrix
BATCH = 128
MAX_EPOCHS = 8
HELD_OUT = 20  # one text in this many judges when to stop
MAX_TOKENS = 512  # model2vec's own truncation
SEED = 0
MIN_CHUNKS = 32  # a smaller corpus keeps the distilled model
PROJECTION = "teacher_projection.npz"  # MiniLM's vectors onto the fitted model's axes


def fitted_folder(index_dir: Path) -> Path | None:
    """The index's fitted static model, or None (never fitted: the distilled one embeds it)."""
    folder = Path(index_dir) / FITTED_DIR
    return folder if (folder / "model.safetensors").is_file() else None


def sample_order(doc_ids: Sequence[str]) -> list[int]:
    """Positions of the documents in the order the sample takes them: by a hash of the id, so
    the sample does not depend on the corpus's order."""
    return sorted(range(len(doc_ids)),
                  key=lambda i: hashlib.sha1(doc_ids[i].encode()).hexdigest())


def windows(texts: Sequence[str], per: int = WINDOWS, seed: int = SEED) -> list[str]:
    """`per` random word windows of each text (the whole text when it is shorter)."""
    rng = random.Random(seed)
    out = []
    for text in texts:
        words = text.split()
        for _ in range(per):
            n = rng.randint(*WINDOW_WORDS)
            start = rng.randint(0, max(len(words) - n, 0))
            out.append(" ".join(words[start:start + n]))
    return [s for s in out if s]


def fit(base_folder: Path, texts: Sequence[str], teacher, out: Path, note=None) -> dict:
    """Train the static model in `base_folder` towards `teacher(texts)` (a float32 array of
    L2-normalised vectors) and write it to `out` atomically. Returns what was done; `note(line)`
    hears how the teacher's pass goes (a quarter at a time) and when training starts."""
    import numpy as np
    import torch
    from model2vec import StaticModel

    model = StaticModel.from_pretrained(str(base_folder), normalize=True)
    texts = list(dict.fromkeys(texts))  # a short chunk is its own window: once is enough
    ids = [row[:MAX_TOKENS] for row in model.tokenize(texts)]
    keep = [i for i, row in enumerate(ids) if row]
    ids, texts = [ids[i] for i in keep], [texts[i] for i in keep]
    base = np.asarray(model.embedding, dtype=np.float32)
    dim = base.shape[1]
    target, projection = _reduced(_taught(teacher, texts, note), dim)
    if note:
        note(f"training on {len(texts):,} texts")
    order = np.random.default_rng(SEED).permutation(len(ids))
    held, train = order[:max(len(ids) // HELD_OUT, 1)].tolist(), order[len(ids) // HELD_OUT:]
    # onto the teacher's axes: the orthogonal map that best carries the training texts' mean
    # rows to their targets (a rotation keeps every cosine: as good as the distilled model)
    start = np.stack([base[ids[i]].mean(axis=0) for i in train])
    u, _, vt = np.linalg.svd(start.T @ target[train])
    weights = torch.tensor(base @ (u @ vt), requires_grad=True)
    step = LEARNING_RATE * float(weights.detach().abs().mean())
    rows = [torch.tensor(row, dtype=torch.long) for row in ids]
    goal = torch.tensor(target)

    def loss(batch) -> torch.Tensor:
        pieces = [rows[i] for i in batch]
        offsets = torch.tensor([0] + [len(p) for p in pieces[:-1]]).cumsum(0)
        out_ = torch.nn.functional.embedding_bag(torch.cat(pieces), weights, offsets,
                                                 mode="mean")
        return (1 - torch.nn.functional.cosine_similarity(out_, goal[batch])).mean()

    torch.manual_seed(SEED)
    optimiser = torch.optim.Adam([weights], lr=step)
    with torch.no_grad():
        best = before = float(loss(held))
    best_weights, epochs = weights.detach().clone(), 0
    shuffle = np.random.default_rng(SEED + 1)
    for epoch in range(MAX_EPOCHS):
        train = shuffle.permutation(train)
        for k in range(0, len(train), BATCH):
            optimiser.zero_grad()
            loss(train[k:k + BATCH].tolist()).backward()
            optimiser.step()
        with torch.no_grad():
            now = float(loss(held))
        if now >= best:
            break
        best, best_weights, epochs = now, weights.detach().clone(), epoch + 1
    fitted = StaticModel(vectors=best_weights.numpy().astype(np.float32),
                        tokenizer=model.tokenizer, config=model.config, normalize=True,
                        base_model_name=model.base_model_name, language=model.language)
    out = Path(out)
    for stale in out.parent.glob(f".{out.name}-*"):  # a fit killed while writing (the ingest
        shutil.rmtree(stale, ignore_errors=True)  # lock: no other fit is writing here)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        fitted.save_pretrained(str(tmp))
        np.savez(tmp / PROJECTION, **projection)
        for path in tmp.iterdir():  # readable by a service run as another user, as the index
            path.chmod(0o644)
        tmp.chmod(0o755)
        if out.exists():  # a folder without its model (not `fitted_folder`): nothing to keep
            shutil.rmtree(out)
        tmp.replace(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"texts": len(ids), "epochs": epochs,
            "held_out_cosine": [round(1 - before, 4), round(1 - best, 4)]}


def _taught(teacher, texts: list[str], note=None):
    """The teacher's vectors of `texts`, a quarter at a time when someone listens."""
    import time

    import numpy as np

    if not note:
        return np.asarray(teacher(texts), dtype=np.float32)
    parts, started, step = [], time.perf_counter(), -(-len(texts) // 4)
    for start in range(0, len(texts), step):
        parts.append(np.asarray(teacher(texts[start:start + step]), dtype=np.float32))
        done = min(start + step, len(texts))
        note(f"MiniLM read {done:,} of {len(texts):,} texts "
             f"({time.perf_counter() - started:.0f} s)")
    return np.concatenate(parts)


def _reduced(vectors, dim: int):
    """The teacher's vectors on their first `dim` principal axes, L2-normalised, and the map
    that put them there (`mean`, `axes`: any MiniLM vector `v` lands at `(v - mean) @ axes.T`)."""
    import numpy as np

    mean = np.zeros(vectors.shape[1], dtype=np.float32)
    axes = np.eye(dim, vectors.shape[1], dtype=np.float32)
    if vectors.shape[1] > dim:
        mean = vectors.mean(axis=0)
        _, _, axes = np.linalg.svd(vectors - mean, full_matrices=False)
        axes = np.pad(axes[:dim], ((0, dim - min(dim, len(axes))), (0, 0)))  # fewer texts
        vectors = (vectors - mean) @ axes.T  # than `dim`: fewer axes, zeros after
    vectors = vectors / (np.linalg.norm(vectors, axis=1, keepdims=True) + 1e-12)
    return vectors.astype(np.float32), {"mean": mean.astype(np.float32),
                                        "axes": axes.astype(np.float32)}


def say(line: str) -> None:
    """A line on stderr that a progress bar drawn there (the CLI's) does not run into."""
    from tqdm import tqdm

    tqdm.write(line, file=sys.stderr)
    sys.stderr.flush()
