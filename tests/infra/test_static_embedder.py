"""The static embedder (`embed_model = "static-minilm"`, infra/models/static.py): distilled from
the bundled MiniLM with the network unreachable, deterministic, recorded in the index it made,
and the model that index's queries are embedded with.

Real distillation (model2vec on the local model, about a CPU-minute, once per module into a
temporary model cache), real stores, the hotpot-mini fixture.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from branchsearch.infra.config.settings import load_settings
from branchsearch.infra.errors import BranchsearchError, SettingsError
from branchsearch.infra.index.manifest import read_manifest
from branchsearch.infra.index.open import open_retriever
from branchsearch.infra.ingest.pipeline import ingest
from branchsearch.infra.models.embedder import DEFAULT_MODEL, Embedder, resolve_model_path
from branchsearch.infra.models.static import PCA_DIMS, STATIC_MODEL, ensure_static, static_dir
from branchsearch.infra.models.static_tune import FITTED_DIR, PROJECTION, fitted_folder

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
HOTPOT = FIXTURES / "hotpot-mini"
CLI = [sys.executable, "-m", "branchsearch.orchestrator.cli"]

@pytest.fixture(scope="module")
def model_cache(tmp_path_factory):
    """A model cache holding static-minilm, distilled here with every connection refused."""
    root = tmp_path_factory.mktemp("models")
    connect = socket.socket.connect

    def refuse(self, address):
        raise AssertionError(f"distillation tried to connect to {address}")

    socket.socket.connect = refuse
    try:
        folder = ensure_static(root, resolve_model_path(DEFAULT_MODEL), quiet=True)
    finally:
        socket.socket.connect = connect
    return root, folder


@pytest.fixture
def cached(model_cache, monkeypatch):
    """Point every embedder made from settings at the module's model cache."""
    monkeypatch.setenv("BRANCHSEARCH_MODEL_CACHE", str(model_cache[0]))
    return model_cache[0]


def _settings(home: Path, **extra):
    return load_settings(overrides={"home": home, **extra}, read_env=False, read_file=False)


def _texts() -> list[str]:
    rows = [json.loads(line) for line in (HOTPOT / "corpus.jsonl").read_text().splitlines()
            if line.strip()]
    return [f"{r.get('title', '')}\n{r['text']}" for r in rows]


def test_distilled_offline_from_the_bundled_model_once(model_cache):
    root, folder = model_cache
    assert folder == static_dir(root, resolve_model_path(DEFAULT_MODEL))
    config = json.loads((folder / "config.json").read_text())
    assert config["hidden_dim"] == PCA_DIMS and config["normalize"] is True
    # the vocabulary is MiniLM's own word pieces (nothing fetched from elsewhere)
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    minilm = (resolve_model_path(DEFAULT_MODEL) / "vocab.txt").read_text().split("\n")
    assert set(vocab) <= set(minilm) and len(vocab) > 20_000
    weights = folder / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert ensure_static(root, resolve_model_path(DEFAULT_MODEL)) == folder  # not distilled again
    assert weights.stat().st_mtime_ns == stamp


def test_missing_package_is_one_line_naming_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "model2vec", None)  # as if not installed
    with pytest.raises(BranchsearchError, match="static-minilm.*needs model2vec"):
        ensure_static(tmp_path, resolve_model_path(DEFAULT_MODEL))
    assert not any(tmp_path.iterdir())


def test_distilling_on_a_pipe_prints_no_progress_bar(tmp_path, monkeypatch, capfd):
    """model2vec's 'Encoding tokens' tqdm bar went to a pipe or a log as ~120 carriage-returned
    updates (hostile pass: `ingest --embed-model static-minilm 2>log`); a terminal keeps it."""
    import model2vec.distill
    from model2vec.distill import inference

    from branchsearch.infra.models.static import distill_into

    def distill(path, **kwargs):  # model2vec's, as far as its bar
        for _ in inference.tqdm(range(3), desc="Encoding tokens"):
            pass
        raise RuntimeError("stop here")

    monkeypatch.setattr(model2vec.distill, "distill", distill)
    bar = inference.tqdm
    with pytest.raises(RuntimeError, match="stop here"):
        distill_into(resolve_model_path(DEFAULT_MODEL), tmp_path)
    assert "Encoding tokens" not in capfd.readouterr().err
    assert inference.tqdm is bar  # put back


def test_vectors_are_deterministic_normalised_and_independent_of_the_batch(model_cache):
    texts = _texts()
    one = Embedder(STATIC_MODEL, export_root=model_cache[0], batch_size=64)
    other = Embedder(STATIC_MODEL, export_root=model_cache[0], batch_size=1)
    together = one.embed(texts)
    assert together.shape == (len(texts), PCA_DIMS) and together.dtype == np.float32
    assert np.allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-5)
    alone = np.stack([other.embed([t])[0] for t in texts[:12]])
    assert np.array_equal(together[:12], alone)  # a query embedded alone = the same text ingested
    assert np.array_equal(one.embed(texts), together)
    assert one.backend == "static" and one.dim == PCA_DIMS
    # not a constant or random map: a text is nearer itself with words dropped than to others
    probe = one.embed([" ".join(t.split()[:-3]) for t in texts[:12]])
    assert all(int(np.argmax(together @ probe[i])) == i for i in range(12))


def test_index_records_the_static_model_and_its_queries_use_it(tmp_path, cached):
    home = tmp_path / "home"
    report = ingest(HOTPOT, _settings(home, index="mini", embed_model=STATIC_MODEL))
    assert report.counts["dense"] == report.chunks > 0
    manifest = read_manifest(_settings(home, index="mini").index_dir)
    assert manifest.embedding == {"model": STATIC_MODEL, "dim": PCA_DIMS,
                                  "fitted": FITTED_DIR}
    # a reader configured with the default model still embeds queries with the index's
    retriever = open_retriever(_settings(home, index="mini"))
    try:
        assert retriever.embedder.model_name == STATIC_MODEL
        queries = [json.loads(line) for line in (HOTPOT / "queries.jsonl").read_text()
                   .splitlines() if line.strip()]
        gold: dict[str, set[str]] = {}
        for line in (HOTPOT / "qrels" / "test.tsv").read_text().splitlines()[1:]:
            qid, doc, *_ = line.split("\t")
            gold.setdefault(qid, set()).add(doc)
        found = 0
        for q in queries:
            hits = retriever.search(q["text"], mode="dense", k=10)
            assert hits and all(h.source for h in hits)
            found += bool(gold.get(q["_id"], set()) & {h.doc_id for h in hits})
        assert found >= len(queries) // 2, found  # dense search with the static model works
    finally:
        retriever.close()


def test_another_model_never_embeds_its_queries_nor_adds_to_it(tmp_path, cached):
    home = tmp_path / "home"
    ingest(HOTPOT, _settings(home, index="mini", embed_model=STATIC_MODEL))
    minilm = Embedder(DEFAULT_MODEL)
    with pytest.raises(SettingsError, match="embedded with 'static-minilm', not "
                                            "'all-MiniLM-L6-v2'"):
        open_retriever(_settings(home, index="mini"), embedder=minilm)
    settings = _settings(home, index="mini")
    before = (settings.index_dir / "manifest.json").read_text()
    with pytest.raises(BranchsearchError, match="was embedded with 'static-minilm', not "
                                                "'all-MiniLM-L6-v2'.*unchanged"):
        ingest(HOTPOT, settings)  # the default model: refused before anything is touched
    assert (settings.index_dir / "manifest.json").read_text() == before


def test_cli_ingest_with_embed_model_then_dense_eval(tmp_path, cached):
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if k.startswith("BRANCHSEARCH_MODEL_CACHE")
           or not k.startswith("BRANCHSEARCH_")}
    run = subprocess.run(CLI + ["ingest", str(HOTPOT), "--home", str(home), "--index", "mini",
                                "--embed-model", STATIC_MODEL, "--json"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.splitlines()[-1])["counts"]["dense"] > 0
    run = subprocess.run(CLI + ["eval", str(HOTPOT), "--home", str(home), "--index", "mini",
                                "--no-ingest", "--mode", "dense", "--json"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout)["metrics"]["recall@10"] > 0.5


def _neighbours(vectors, k: int = 5) -> list[set[int]]:
    sims = vectors @ vectors.T
    np.fill_diagonal(sims, -np.inf)
    return [set(np.argsort(-row)[:k].tolist()) for row in sims]


def test_a_new_index_fits_the_static_model_to_its_corpus(tmp_path, cached):
    """The first ingest fits static-minilm to the corpus with MiniLM as teacher; the index
    keeps that model for its later chunks, and it ranks the corpus more like
    MiniLM than the distilled model does."""
    home = tmp_path / "home"
    settings = _settings(home, index="mini", embed_model=STATIC_MODEL)
    report = ingest(HOTPOT, settings)
    folder = fitted_folder(settings.index_dir)
    assert folder is not None and report.fitted["texts"] > report.chunks
    assert report.fitted["held_out_cosine"][1] > report.fitted["held_out_cosine"][0]
    retriever = open_retriever(_settings(home, index="mini"))  # a reader with the defaults
    try:
        assert retriever.embedder.static_folder == folder
    finally:
        retriever.close()
    texts = _texts()
    teacher = _neighbours(Embedder(DEFAULT_MODEL).embed(texts))
    agree = {}
    for name, embedder in (("distilled", Embedder(STATIC_MODEL, export_root=cached)),
                           ("fitted", Embedder(STATIC_MODEL, static_folder=folder))):
        mine = _neighbours(embedder.embed(texts))
        agree[name] = np.mean([len(a & b) / 5 for a, b in zip(mine, teacher)])
    assert agree["fitted"] > agree["distilled"] + 0.05, agree

    # a later ingest of the index embeds with the same model and does not fit again
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    changed = tmp_path / "changed"
    changed.mkdir()
    rows = (HOTPOT / "corpus.jsonl").read_text().splitlines()
    (changed / "corpus.jsonl").write_text("\n".join(rows[:40]) + "\n")
    again = ingest(changed, _settings(home, index="mini", embed_model=STATIC_MODEL))
    assert again.fitted == {} and "fit" not in again.seconds
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_fitted_index_embeds_its_queries_with_minilm_onto_its_axes(tmp_path, cached, capfd):
    """By default (`static_queries = "minilm"`) a fitted index's queries are MiniLM's vectors
    put on the fitted model's axes by the fit's own projection, while its documents stay the
    static model's; such queries rank the corpus more like MiniLM does. "static" embeds queries
    with the fitted model, and so does an index whose fit kept no projection."""
    home = tmp_path / "home"
    ingest(HOTPOT, _settings(home, index="mini", embed_model=STATIC_MODEL))
    folder = fitted_folder(_settings(home, index="mini").index_dir)
    with np.load(folder / PROJECTION) as saved:
        mean, axes = saved["mean"], saved["axes"]
    assert mean.shape == (384,) and axes.shape == (PCA_DIMS, 384)
    questions = [json.loads(line)["text"] for line in
                 (HOTPOT / "queries.jsonl").read_text().splitlines() if line.strip()]
    texts = _texts()
    minilm = Embedder(DEFAULT_MODEL)
    expected = (minilm.embed(questions) - mean) @ axes.T
    expected /= np.linalg.norm(expected, axis=1, keepdims=True)
    fitted = Embedder(STATIC_MODEL, static_folder=folder)

    retriever = open_retriever(_settings(home, index="mini"))  # a reader with the defaults
    try:
        embedder = retriever.embedder
        assert embedder.queries_by.startswith(DEFAULT_MODEL)
        assert np.allclose(embedder.embed_queries(questions), expected, atol=1e-5)
        assert np.array_equal(embedder.embed(texts[:8]), fitted.embed(texts[:8]))
        assert retriever.search(questions[0], mode="dense", k=5)
    finally:
        retriever.close()

    def agreement(query_vectors) -> float:  # top-5 chunks shared with MiniLM's, per question
        teacher = np.argsort(-(minilm.embed(questions) @ minilm.embed(texts).T), axis=1)[:, :5]
        mine = np.argsort(-(query_vectors @ fitted.embed(texts).T), axis=1)[:, :5]
        return float(np.mean([len(set(a) & set(b)) / 5 for a, b in zip(mine, teacher)]))

    assert agreement(expected) > agreement(fitted.embed(questions))

    from branchsearch.infra.errors import IndexIncomplete

    from branchsearch.infra.index.catalog import owned_indexes

    listed = {i.name: i for i in owned_indexes(_settings(home), check=False)}["mini"]
    assert (listed.health, listed.embedding) == (
        "ok", f"{STATIC_MODEL} fitted to the index; queries by MiniLM onto its axes")
    whole = (folder / PROJECTION).read_bytes()
    middle = len(whole) // 2  # same size, a member's bytes changed: its CRC says so
    for damaged in (whole[:1000],  # cut short
                    whole[:middle] + bytes(b ^ 0xFF for b in whole[middle:middle + 64]) +
                    whole[middle + 64:]):
        (folder / PROJECTION).write_bytes(damaged)
        with pytest.raises(IndexIncomplete, match=f"'mini' is damaged: static-embedder/"
                                                  f"{PROJECTION} is not whole"):
            open_retriever(_settings(home, index="mini"))
        listed = {i.name: i for i in owned_indexes(_settings(home), check=False)}["mini"]
        assert listed.health.startswith(f"damaged: static-embedder/{PROJECTION} is not whole")
    for bad in (whole[:-100] + bytes(b ^ 0xFF for b in whole[-100:]),  # same size, bytes changed
                None):  # a whole file of the wrong shapes
        if bad is None:
            np.savez(folder / PROJECTION, mean=mean, axes=axes[:, :10])
        else:
            (folder / PROJECTION).write_bytes(bad)
        with pytest.raises(BranchsearchError, match=f"cannot read mini/static-embedder/"
                                                    f"{PROJECTION} .*re-ingest its index"):
            Embedder(STATIC_MODEL, static_folder=folder, teacher_queries=True).embed_queries(
                ["Scott Derrickson"])
    (folder / PROJECTION).write_bytes(whole)

    capfd.readouterr()
    for settings in (_settings(home, index="mini", static_queries="static"), None):
        if settings is None:  # an index fitted before the projection was kept
            (folder / PROJECTION).unlink()
            settings = _settings(home, index="mini")
        retriever = open_retriever(settings)
        try:
            assert retriever.embedder.queries_by == STATIC_MODEL
            assert np.array_equal(retriever.embedder.embed_queries(questions),
                                  fitted.embed(questions))
        finally:
            retriever.close()
    err = capfd.readouterr().err  # only the older index is told about, once
    assert err.count(f"'mini' has no {PROJECTION}") == 1, err


def test_the_fit_is_deterministic_and_the_ingest_workers_embed_with_it(tmp_path, cached):
    from branchsearch.infra.ingest.distributed import ChunkEmbedder, _packed

    folders = []
    for name in ("a", "b"):
        settings = _settings(tmp_path / name, index="mini", embed_model=STATIC_MODEL)
        killed = settings.index_dir / f".{FITTED_DIR}-x1"  # a fit killed while writing it
        killed.mkdir(parents=True)
        (killed / "model.safetensors").write_bytes(b"half")
        ingest(HOTPOT, settings)
        assert not killed.exists()
        folders.append(fitted_folder(settings.index_dir))
    one, two = (f / "model.safetensors" for f in folders)
    assert one.read_bytes() == two.read_bytes()  # the same corpus, the same model
    # a Ray Data worker (`ingest --workers N`), maybe on another node, gets the model's files
    worker = ChunkEmbedder({"encoding": "o200k_base", "chunk_tokens": 256, "chunk_overlap": 32,
                            "head_tokens": 0}, STATIC_MODEL, static_model=_packed(folders[0]))
    assert worker.embedder.static_folder != folders[0]
    text = _texts()[0]
    title, body = text.split("\n", 1)
    out = worker({"id": ["d"], "title": [title], "text": [body]})
    expected = Embedder(STATIC_MODEL, static_folder=folders[0]).embed([text])
    assert np.array_equal(out["vector"][:1], expected)


def test_static_tune_chunks_0_keeps_the_distilled_model_for_good(tmp_path, cached):
    home = tmp_path / "home"
    ingest(HOTPOT, _settings(home, index="mini", embed_model=STATIC_MODEL, static_tune_chunks=0))
    settings = _settings(home, index="mini", embed_model=STATIC_MODEL)
    assert fitted_folder(settings.index_dir) is None
    # an index with chunks embedded by the distilled model is never fitted afterwards
    report = ingest(HOTPOT, settings)
    assert report.fitted == {} and fitted_folder(settings.index_dir) is None
    assert read_manifest(settings.index_dir).embedding == {"model": STATIC_MODEL,
                                                           "dim": PCA_DIMS}


def test_an_index_whose_fitted_model_is_lost_or_broken_says_so(tmp_path, cached):
    """Never the distilled model in place of the fitted one: its vectors would rank wrongly
    and look fine."""
    from branchsearch.infra.errors import IndexIncomplete

    home = tmp_path / "home"
    settings = _settings(home, index="mini", embed_model=STATIC_MODEL)
    ingest(HOTPOT, settings)
    weights = fitted_folder(settings.index_dir) / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:1000])  # truncated
    from branchsearch.infra.models import embedder as loaded
    from branchsearch.infra.index.catalog import list_indexes

    loaded._MODELS.clear()  # as a new process would: the ingest's copy is in memory
    with pytest.raises(IndexIncomplete, match="'mini' is damaged: "
                                              "static-embedder/model.safetensors is cut short"):
        open_retriever(_settings(home, index="mini"))
    [info] = list_indexes(_settings(home))
    assert info.health.startswith("damaged: static-embedder/model.safetensors is cut short")
    with pytest.raises(BranchsearchError, match="cannot read the static model "
                                                "mini/static-embedder"):  # loaded anyway
        Embedder(STATIC_MODEL, static_folder=weights.parent).embed(["Scott Derrickson"])
    before = (settings.index_dir / "manifest.json").read_text()
    with pytest.raises(IndexIncomplete, match="fitted static model.*is cut short"):
        ingest(HOTPOT, settings)  # every document committed: it would only rewrite the manifest
    assert (settings.index_dir / "manifest.json").read_text() == before
    weights.unlink()
    with pytest.raises(IndexIncomplete, match="'mini' is damaged: "
                                              "static-embedder/model.safetensors missing"):
        open_retriever(_settings(home, index="mini"))
    [info] = list_indexes(_settings(home))
    assert info.health.startswith("damaged: static-embedder/model.safetensors missing")
    before = (settings.index_dir / "manifest.json").read_text()
    with pytest.raises(IndexIncomplete, match="fitted static model"):
        ingest(HOTPOT, settings)
    assert (settings.index_dir / "manifest.json").read_text() == before


def test_an_index_removed_and_ingested_anew_is_searched_with_its_new_model(tmp_path, cached):
    """A running process (a service) that reopens a rebuilt index embeds with the new model,
    not the one it loaded from the same folder before."""
    from branchsearch.infra.models.static import StaticEncoder

    home = tmp_path / "home"
    settings = _settings(home, index="mini", embed_model=STATIC_MODEL)
    ingest(HOTPOT, settings)
    query = "Which magazine was started first?"
    first = open_retriever(_settings(home, index="mini"))
    try:
        before = first.embedder.embed([query])
    finally:
        first.close()
    import shutil

    shutil.rmtree(settings.index_dir)
    other = tmp_path / "other"
    other.mkdir()
    rows = (HOTPOT / "corpus.jsonl").read_text().splitlines()
    (other / "corpus.jsonl").write_text("\n".join(rows[20:]) + "\n")  # another corpus
    ingest(other, settings)
    again = open_retriever(_settings(home, index="mini"))
    try:
        now = again.embedder.embed([query])
    finally:
        again.close()
    expected = StaticEncoder(fitted_folder(settings.index_dir)).encode([query])
    assert np.array_equal(now, expected) and not np.allclose(now, before)


def test_a_stopped_ingest_resumes_only_with_the_model_it_began_with(tmp_path, cached):
    from branchsearch.infra.index.manifest import remove_manifest

    home = tmp_path / "home"
    settings = _settings(home, index="mini", embed_model=STATIC_MODEL)
    ingest(HOTPOT, settings)
    remove_manifest(settings.index_dir)  # what an ingest stopped before its end leaves
    with pytest.raises(BranchsearchError, match="'mini' stopped unfinished while embedding with "
                                                "'static-minilm' \\(256 dimensions\\), not "
                                                "'all-MiniLM-L6-v2'.*--embed-model static-minilm"):
        ingest(HOTPOT, _settings(home, index="mini"))  # the default model
    report = ingest(HOTPOT, settings)  # the same command again: resumed, not fitted again
    assert report.resumed == report.documents and report.fitted == {}
    assert read_manifest(settings.index_dir).embedding["fitted"] == FITTED_DIR


def test_small_corpora_and_small_samples(tmp_path, cached, capfd):
    small = tmp_path / "small"
    small.mkdir()
    rows = (HOTPOT / "corpus.jsonl").read_text().splitlines()
    (small / "corpus.jsonl").write_text("\n".join(rows[:20]) + "\n")
    settings = _settings(tmp_path / "home", index="mini", embed_model=STATIC_MODEL)
    report = ingest(small, settings)
    assert report.fitted == {} and fitted_folder(settings.index_dir) is None
    assert "fewer than 32: static-minilm is not fitted to it" in capfd.readouterr().err
    with pytest.raises(SettingsError, match="static_tune_chunks must be 0 .* or at least 32"):
        _settings(tmp_path / "home", static_tune_chunks=7)
    with pytest.raises(SettingsError, match="static_queries must be minilm or static"):
        _settings(tmp_path / "home", static_queries="MiniLM")
    # a folder left without its model (a fit stopped, the file removed) is fitted anew
    again = _settings(tmp_path / "again", index="mini", embed_model=STATIC_MODEL)
    (again.index_dir / FITTED_DIR).mkdir(parents=True)
    ingest(HOTPOT, again)
    assert fitted_folder(again.index_dir) is not None
    assert oct((fitted_folder(again.index_dir) / "model.safetensors").stat().st_mode)[-3:] == "644"
