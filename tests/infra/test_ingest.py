"""Index completeness on real stores (docstore, tantivy, Milvus Lite) and real processes: a
killed ingest is refused by readers and resumed by `eval`; the stores end with equal chunk counts
(no orphan vectors); a second ingest, or a reader, during an ingest gets one line naming it."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from branchsearch.infra.errors import IndexBusy, IndexIncomplete, IndexNotFound
from branchsearch.infra.ingest.pipeline import ingest
from branchsearch.infra.index.manifest import (IngestLock, read_manifest, require_complete,
                                         running_ingest)
from branchsearch.infra.index.open import open_retriever, open_stores
from branchsearch.infra.config.settings import load_settings

from conftest import prepared, read_only_folder

CLI = [sys.executable, "-m", "branchsearch.orchestrator.cli"]


def _settings(home: Path, **extra):
    return load_settings(overrides={"home": home, **extra}, read_env=False, read_file=False)


def _corpus(path: Path, n: int, prefix: str = "d") -> Path:
    path.write_text("".join(json.dumps({"id": f"{prefix}{i}", "title": f"Doc {i}",
                                        "text": f"Document {i} is about topic{i % 7} and "
                                                f"keyword{i}."}) + "\n" for i in range(n)))
    return path


def _store_counts(settings) -> dict[str, int]:
    docstore, lexical, dense, _ = open_stores(settings, create=True)
    try:
        return {"docstore": docstore.chunk_count(), "lexical": lexical.count(),
                "dense": dense.count(), "pending": len(docstore.pending())}
    finally:
        for store in (lexical, dense, docstore):
            store.close()


def _env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BRANCHSEARCH_")}
    return env | {"BRANCHSEARCH_HOME": str(home), "PYTHONUNBUFFERED": "1"}


def _one_error_line(proc) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-2000:]
    return errors[0]


# ---- in process -------------------------------------------------------------------------------

def test_manifest_written_last_with_counts(tmp_path):
    settings = _settings(tmp_path / "h")
    report = ingest(_corpus(tmp_path / "c.jsonl", 5), settings)
    manifest = read_manifest(settings.index_dir)
    assert manifest is not None and manifest.documents == 5
    assert manifest.chunks == {"docstore": 5, "lexical": 5, "dense": 5} == report.counts
    assert manifest.embedding == {"model": "all-MiniLM-L6-v2", "dim": 384}
    assert manifest.encoding == "o200k_base" and manifest.finished_at
    assert not (settings.index_dir / "ingest.lock").exists()
    again = ingest(tmp_path / "c.jsonl", settings)  # nothing changed: nothing redone
    assert again.resumed == 5 and again.chunks == 5 and again.seconds.get("embed", 0) == 0


def test_an_index_keeps_its_vectors_or_their_absence(tmp_path):
    """`--no-dense` over a hybrid index wrote documents without vectors beside a dense side
    left as it was; the next hybrid ingest stopped on "stores disagree" and left the index
    incomplete, or passed with the dense side a different corpus. Now an
    ingest without the flag does as the index was made, and asking the other is refused with
    nothing touched; the CLI says it in one line."""
    from branchsearch.infra.errors import BranchsearchError

    corpus, more = _corpus(tmp_path / "c.jsonl", 3), _corpus(tmp_path / "m.jsonl", 4)
    for dense, other in ((True, False), (False, True)):
        settings = _settings(tmp_path / "h", index=f"made-{dense}")
        ingest(corpus, settings, dense=dense)
        before = (settings.index_dir / "manifest.json").read_text()
        with pytest.raises(BranchsearchError, match="(has vectors|made without vectors).*"
                                                    "another index name.*unchanged"):
            ingest(more, settings, dense=other)
        assert (settings.index_dir / "manifest.json").read_text() == before
        assert (settings.index_dir / "dense.db").exists() == dense  # none made for it
        (settings.index_dir / "manifest.json").unlink()  # as a killed ingest leaves it
        with pytest.raises(BranchsearchError, match="has vectors|made without vectors"):
            ingest(more, settings, dense=other)  # the run after a kill
        assert (settings.index_dir / "dense.db").exists() == dense
        report = ingest(more, settings)  # as it was made
        assert (read_manifest(settings.index_dir).embedding is not None) == dense
        assert set(report.counts) == ({"docstore", "lexical", "dense"} if dense
                                      else {"docstore", "lexical"})
        assert set(report.counts.values()) == {4}
    proc = subprocess.run(CLI + ["ingest", str(more), "--index", "made-True", "--no-dense"],
                          capture_output=True, text=True, env=_env(tmp_path / "h"), timeout=300)
    assert "has vectors (all-MiniLM-L6-v2); --no-dense would add" in _one_error_line(proc)


def test_index_without_manifest_is_refused(tmp_path):
    settings = _settings(tmp_path / "h")
    with pytest.raises(IndexNotFound):
        open_retriever(settings)
    ingest(_corpus(tmp_path / "c.jsonl", 3), settings)
    (settings.index_dir / "manifest.json").unlink()  # as an index built before manifests
    with pytest.raises(IndexIncomplete, match="no manifest.*branchsearch ingest PATH"):
        open_retriever(settings)


def test_stale_lock_is_taken_over_and_named(tmp_path):
    settings = _settings(tmp_path / "h")
    ingest(_corpus(tmp_path / "c.jsonl", 3), settings)
    (settings.index_dir / "manifest.json").unlink()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    (settings.index_dir / "ingest.lock").write_text(json.dumps(
        {"pid": int(dead), "host": os.uname().nodename, "started": "then", "corpus": "/x.jsonl"}))
    assert running_ingest(settings.index_dir) is None  # nobody holds its flock
    with pytest.raises(IndexIncomplete, match=f"PID {dead}.*branchsearch ingest /x.jsonl"):
        require_complete(settings.index_dir, settings.index)
    report = ingest(tmp_path / "c.jsonl", settings)
    assert f"PID {dead}" in report.stale_lock and report.resumed == 3
    assert read_manifest(settings.index_dir) is not None


def test_lock_held_by_a_live_process_stops_a_second_ingest(tmp_path):
    settings = _settings(tmp_path / "h")
    corpus = _corpus(tmp_path / "c.jsonl", 3)
    with IngestLock(settings.index_dir, settings.index, corpus="/first.jsonl"):
        with pytest.raises(IndexBusy, match=f"PID {os.getpid()}.*/first.jsonl"):
            IngestLock(settings.index_dir, settings.index).acquire()
        with pytest.raises(IndexBusy, match=f"being ingested.*PID {os.getpid()}"):
            ingest(corpus, settings)
    ingest(corpus, settings)  # released: the next one runs


def test_an_index_folder_that_cannot_be_written_is_one_line_and_stays_searchable(tmp_path):
    """A re-run into a read-only index folder stopped with a PermissionError traceback from the
    ingest lock; now one line names the folder, nothing changes, searches go on."""
    settings = _settings(tmp_path / "h")
    corpus = _corpus(tmp_path / "c.jsonl", 3)
    ingest(corpus, settings)
    before = sorted(os.listdir(settings.index_dir))
    with read_only_folder(settings.index_dir):
        run = subprocess.run([sys.executable, "-m", "branchsearch.orchestrator.cli", "ingest",
                              str(corpus), "--home", str(settings.home)],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode != 0
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
        assert lines[0].startswith("error: index 'default': cannot write its folder "), lines
    assert sorted(os.listdir(settings.index_dir)) == before
    retriever = open_retriever(settings)
    try:
        assert [h.doc_id for h in retriever.search("keyword2", "bm25", 1)] == ["d2"]
    finally:
        retriever.close()


def test_a_reader_racing_an_ingest_that_starts_names_it_not_a_missing_manifest(tmp_path,
                                                                              monkeypatch):
    """The ingest takes its lock and removes the manifest between the reader's look for a
    running ingest and its read of the manifest: the reader says 'being ingested', not 'has no
    manifest'."""
    from branchsearch.infra.index import manifest as manifest_mod

    settings = _settings(tmp_path / "h")
    ingest(_corpus(tmp_path / "c.jsonl", 3), settings)
    read, held = manifest_mod.read_manifest, []

    def ingest_starts_now(index_dir):
        lock = IngestLock(settings.index_dir, settings.index, corpus="/racing.jsonl")
        held.append(lock.acquire())
        (settings.index_dir / "manifest.json").unlink()
        return read(index_dir)

    monkeypatch.setattr(manifest_mod, "read_manifest", ingest_starts_now)
    try:
        with pytest.raises(IndexBusy, match="being ingested.*/racing.jsonl"):
            require_complete(settings.index_dir, settings.index)
    finally:
        for lock in held:
            lock.release()


# ---- kill -9 at the worst moment: vectors written, docstore not yet ----------------------------

KILLER = textwrap.dedent("""
    import os, signal, sys
    from branchsearch.infra.stores import tantivy as lexical
    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.infra.config.settings import load_settings

    calls = 0
    write = lexical.TantivyStore.write
    def dying_write(self, chunks, delete_doc_ids):
        global calls
        calls += 1
        if calls == int(sys.argv[3]):  # dense store already holds this batch's vectors
            os.kill(os.getpid(), signal.SIGKILL)
        return write(self, chunks, delete_doc_ids)
    lexical.TantivyStore.write = dying_write
    settings = load_settings(overrides={"home": sys.argv[2]}, read_env=False, read_file=False)
    ingest(sys.argv[1], settings, batch_docs=4)
""")


def _killed_ingest(corpus: Path, home: Path, at_write: int) -> None:
    proc = subprocess.run([sys.executable, "-c", KILLER, str(corpus), str(home), str(at_write)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]


def test_kill_mid_batch_then_rerun_leaves_equal_counts(tmp_path):
    home = tmp_path / "h"
    settings = _settings(home)
    corpus = _corpus(tmp_path / "c.jsonl", 10)
    _killed_ingest(corpus, home, at_write=2)  # batch 1 (4 docs) committed, batch 2 half
    with pytest.raises(IndexIncomplete, match="stopped before it finished"):
        open_retriever(settings)
    before = _store_counts(settings)
    assert before["docstore"] == 4 and before["dense"] == 8 and before["pending"] == 4
    report = ingest(corpus, settings)  # resume: batch 1 kept, the rest (re)written
    assert report.resumed == 4 and "PID" in report.stale_lock
    assert _store_counts(settings) == {"docstore": 10, "lexical": 10, "dense": 10, "pending": 0}
    r = open_retriever(settings)
    assert [h.doc_id for h in r.search("keyword7", "bm25", 3)][:1] == ["d7"]
    r.close()


def test_rerun_with_another_corpus_purges_what_the_killed_ingest_left(tmp_path):
    home = tmp_path / "h"
    settings = _settings(home)
    _killed_ingest(_corpus(tmp_path / "c.jsonl", 10), home, at_write=2)
    # the next ingest brings other documents: d4..d7's vectors must not stay behind
    report = ingest(_corpus(tmp_path / "other.jsonl", 3, prefix="x"), settings)
    assert report.purged == 4
    assert _store_counts(settings) == {"docstore": 7, "lexical": 7, "dense": 7, "pending": 0}
    assert read_manifest(settings.index_dir).chunks["dense"] == 7


# ---- the CLI: kill -9 a real ingest, readers and a second ingest meanwhile, eval resumes --------

def _synth(home: Path, docs: int) -> Path:
    from branchsearch.infra.datasets.synth import synth

    corpus = home.parent / "synth"
    synth(corpus, docs=docs, tasks=8, seed=3)
    return corpus


def _docs_committed(index_dir: Path) -> int:
    try:
        db = sqlite3.connect(f"file:{index_dir / 'docs.sqlite'}?mode=ro", uri=True, timeout=1)
        try:
            return db.execute("SELECT COUNT(*) FROM docs").fetchone()[0]
        finally:
            db.close()
    except sqlite3.Error:
        return 0


def test_cli_kill9_refuse_busy_then_eval_resumes(tmp_path):
    home = tmp_path / "home"
    corpus = _synth(home, docs=1200)
    env = _env(home)
    index = "synth"
    index_dir = home / "indexes" / index
    run = lambda *args: subprocess.run([*CLI, *args], capture_output=True, text=True,  # noqa
                                       env=env, timeout=600)
    first = subprocess.Popen([*CLI, "ingest", str(corpus), "--index", index], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while _docs_committed(index_dir) == 0:  # the first batch is committed
            assert first.poll() is None, first.stderr.read()[-2000:]
            assert time.time() < deadline, "the ingest committed nothing in 300 s"
            time.sleep(0.05)
        # while it runs: a second ingest, a retrieve and a Ray search each get one line naming it
        for args in (["ingest", str(corpus), "--index", index],
                     ["retrieve", "contract review", "--index", index],
                     ["search", "contract review", "--index", index, "--branches", "2"]):
            line = _one_error_line(run(*args))
            assert f"PID {first.pid}" in line and "being ingested" in line, line
        assert first.poll() is None, "the ingest finished before it could be killed"
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    line = _one_error_line(run("retrieve", "contract review", "--index", index))
    assert "incomplete" in line and f"branchsearch ingest {corpus.resolve()} --index synth" in line
    done = run("eval", str(corpus), "--index", index, "--mode", "bm25", "--limit", "2", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "missing or incomplete: ingesting" in done.stderr
    manifest = read_manifest(index_dir)
    assert manifest is not None and manifest.documents == 1200
    counts = _store_counts(_settings(home, index=index))
    assert counts == {"docstore": manifest.chunks["docstore"], "lexical": manifest.chunks["docstore"],
                      "dense": manifest.chunks["docstore"], "pending": 0}
    assert json.loads(done.stdout)["metrics"]


def test_a_writer_that_stops_stops_the_embedding_thread_where_it_is(monkeypatch):
    """`overlapped`: a consumer that stops (an error, a ^C) stops the producer inside the model
    call it is in (MiniLM on torch, minutes of texts), not when the call returns, and joins
    it: no thread is left running. A stop that meets the producer anywhere else (finishing,
    between batches) waits for it there and prints nothing."""
    import threading

    from branchsearch.infra.ingest.batches import embed_in_slices, overlapped
    from branchsearch.infra.models.embedder import Embedder

    failed = []
    monkeypatch.setattr(threading, "excepthook", failed.append)
    embedder = Embedder()
    embedder.embed(["loaded"])

    def batches():
        yield "first"
        yield embed_in_slices(embedder, [f"quokka note {i}" for i in range(200_000)])

    batches = overlapped(batches())
    assert next(batches) == "first"
    time.sleep(1.0)  # the producer is embedding
    started = time.monotonic()
    batches.close()
    assert time.monotonic() - started < 10
    for n in range(300):  # stopped at every point of a short run
        batches = overlapped(iter(range(n % 4)), ahead=1)
        next(batches, None)
        batches.close()
    assert not [t for t in threading.enumerate() if t.name == "ingest-embed"]
    assert not failed, failed
    assert embedder.embed(["after"]).shape == (1, embedder.dim)  # the model still works


def test_ctrl_c_on_an_ingest_exits_130_and_it_resumes(tmp_path):
    """^C while the producer thread embeds the next batches: the ingest says `interrupted` and
    exits 130. It left that thread inside torch when the interpreter exited, which aborted the
    process ("terminate called without an active exception", SIGABRT). The index is left
    incomplete, and the same command resumes it."""
    home = tmp_path / "home"
    corpus = _synth(home, docs=600)
    env, index_dir = _env(home), home / "indexes" / "synth"
    proc = subprocess.Popen(prepared([*CLI, "ingest", corpus, "--index", "synth"],
                                     sigint_default=True),
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while _docs_committed(index_dir) == 0:  # the first batch is committed, the next embed
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            assert time.time() < deadline, "the ingest committed nothing in 300 s"
            time.sleep(0.05)
        assert proc.poll() is None, "the ingest finished before it could be interrupted"
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (proc.returncode, stderr[-2000:])
    assert stderr.rstrip().endswith("interrupted"), stderr[-2000:]
    assert "terminate called" not in stderr and "Traceback" not in stderr, stderr[-2000:]
    assert read_manifest(index_dir) is None  # incomplete, not passed off as done
    done = subprocess.run([*CLI, "ingest", str(corpus), "--index", "synth"], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    committed = int(re.search(r"; resumed a stopped ingest: (\d+) documents it had committed "
                              "kept", done.stdout)[1])
    assert committed >= 256, done.stdout  # at least the first batch was kept, not redone
    manifest = read_manifest(index_dir)
    assert manifest is not None and manifest.documents == 600
    counts = _store_counts(_settings(home, index="synth"))
    assert counts == {"docstore": manifest.chunks["docstore"],
                      "lexical": manifest.chunks["docstore"],
                      "dense": manifest.chunks["docstore"], "pending": 0}


def test_ingest_while_a_reader_holds_milvus_lite_is_one_line_and_changes_nothing(tmp_path):
    home = tmp_path / "h"
    settings = _settings(home)
    corpus = _corpus(tmp_path / "c.jsonl", 3)
    ingest(corpus, settings)
    reader = open_retriever(settings)  # this process owns dense.db (as a running search does)
    try:
        _corpus(corpus, 4)
        proc = subprocess.run([*CLI, "ingest", str(corpus)], capture_output=True, text=True,
                              env=_env(home), timeout=600)
        line = _one_error_line(proc)
        assert "open in another process" in line and "milvus_uri" in line, line
        assert read_manifest(settings.index_dir).documents == 3  # still complete, untouched
        assert len(reader.search("keyword1", "bm25", 3)) == 1
    finally:
        reader.close()


# ---- a full disk ------------------------------------------------------------------------------

def _wide_corpus(path: Path, n: int) -> Path:
    """`n` documents of about 180 words each (one or two chunks), from hotpot-mini's text."""
    from conftest import HOTPOT

    words = " ".join(json.loads(line)["text"] for line in
                     (HOTPOT / "corpus.jsonl").read_text().splitlines()).split()
    path.write_text("".join(json.dumps({"_id": f"d{i}", "title": f"Doc {i}", "text": f"marker{i} "
                                        + " ".join(words[(i * 37) % len(words):][:180])}) + "\n"
                            for i in range(n)))
    return path


@contextmanager
def _small_disk(where: Path, kib: int):
    """A real file system of `kib` KiB (tmpfs) mounted at `where`: writes past it get ENOSPC."""
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield where
    finally:  # lazily: a Milvus Lite server still exiting may hold a file there
        subprocess.run(["umount", "-l", str(where)], check=True)


def _full_disk_line(proc) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr[-2000:]  # nothing but the one line
    line = _one_error_line(proc)
    assert "left incomplete" in line and "run the same command again: it resumes" in line, line
    return line


def test_a_full_disk_during_ingest_is_one_line_and_a_rerun_resumes(tmp_path):
    """ENOSPC while writing the embedding cache, Milvus Lite, tantivy or the docstore (which one
    fills the disk first depends on how much is left: 300 KiB is Milvus Lite's upsert with this
    corpus and these versions) was a traceback, or for Milvus Lite a bare "Unexpected error in
    RPC handling"."""
    corpus = _wide_corpus(tmp_path / "c.jsonl", 30)
    with _small_disk(tmp_path / "disk", 4096) as disk:
        filler = disk / "filler"
        with filler.open("wb") as f:  # leave 300 KiB: the stores open, the writes do not fit
            os.posix_fallocate(f.fileno(), 0, (4096 - 300) * 1024)
        env = _env(disk / "h") | {"BRANCHSEARCH_BACKEND_TIMEOUT_S": "2"}  # Milvus' retries
        proc = subprocess.run([*CLI, "ingest", str(corpus)], capture_output=True, text=True,
                              env=env, timeout=600)
        line = _full_disk_line(proc)
        assert "the disk is full" in line and "Free space on that disk" in line, line
        settings = _settings(disk / "h")
        assert read_manifest(settings.index_dir) is None
        with pytest.raises(IndexIncomplete):
            require_complete(settings.index_dir, settings.index)
        filler.unlink()
        again = subprocess.run([*CLI, "ingest", str(corpus)], capture_output=True, text=True,
                               env=env, timeout=600)
        assert again.returncode == 0, again.stderr[-2000:]
        manifest = read_manifest(settings.index_dir)
        assert manifest.documents == 30
        assert len(set(manifest.chunks.values())) == 1, manifest.chunks  # the stores agree


def test_a_full_disk_during_a_bm25_ingest_keeps_the_committed_batches(tmp_path):
    """The docstore and tantivy on a 1 MiB disk: the first batch of 256 documents commits,
    the second fills the disk; after the disk grows, the same command resumes after the first."""
    corpus = _wide_corpus(tmp_path / "c.jsonl", 600)
    with _small_disk(tmp_path / "disk", 1024) as disk:
        env = _env(disk / "h")
        cmd = [*CLI, "ingest", str(corpus), "--no-dense"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        assert "the disk is full" in _full_disk_line(proc)
        subprocess.run(["mount", "-o", "remount,size=16m", str(disk)], check=True)
        again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        assert again.returncode == 0, again.stderr[-2000:]
        assert "resumed a stopped ingest: 256 documents it had committed kept" in again.stdout, \
            again.stdout
        manifest = read_manifest(_settings(disk / "h").index_dir)
        assert manifest.documents == 600 and len(set(manifest.chunks.values())) == 1


def test_a_file_size_limit_during_ingest_is_one_line_and_a_rerun_resumes(tmp_path):
    """RLIMIT_FSIZE (`ulimit -f`, no root needed): writes past it fail with EFBIG, which SQLite
    reports as a bare "disk I/O error"."""
    corpus = _wide_corpus(tmp_path / "c.jsonl", 600)
    env = _env(tmp_path / "h")
    cmd = [*CLI, "ingest", str(corpus), "--no-dense"]
    # not a preexec_fn: with gRPC loaded in this process it sometimes aborted the child before
    # the ingest ran (conftest.prepared says how)
    proc = subprocess.run(prepared(cmd, file_size=400_000), capture_output=True, text=True,
                          env=env, timeout=600)
    line = _full_disk_line(proc)
    assert "file size limit (ulimit -f: 400,000 bytes)" in line and "Raise the limit" in line
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    manifest = read_manifest(_settings(tmp_path / "h").index_dir)
    assert manifest.documents == 600 and len(set(manifest.chunks.values())) == 1


def test_a_lone_surrogate_in_a_document_is_one_line_naming_it(tmp_path):
    """JSON's "\\ud800" in an id or text gave a traceback (and an index left incomplete)."""
    from branchsearch.infra.ingest.corpus import read_corpus
    from branchsearch.infra.errors import CorpusError

    path = tmp_path / "c.jsonl"
    path.write_text('{"_id": "ok", "text": "fine"}\n{"_id": "\\ud800x", "text": "t"}\n')
    with pytest.raises(CorpusError, match=r"c.jsonl:2: 'id' holds a lone surrogate"):
        read_corpus(path)
    path.write_text('{"_id": "a", "text": "x \\udfff y", "acl": ["g"]}\n')
    with pytest.raises(CorpusError, match=r"c.jsonl:1: 'text' holds a lone surrogate"):
        read_corpus(path)


def test_a_document_with_no_text_and_no_title_is_one_line_naming_it(tmp_path):
    """It was indexed as an empty chunk (hostile pass): found by no BM25 search, noise for a
    dense one. A title-only document stays (its title is searched)."""
    from branchsearch.infra.ingest.corpus import read_corpus
    from branchsearch.infra.errors import CorpusError

    path = tmp_path / "c.jsonl"
    path.write_text('{"_id": "t", "title": "Title only", "text": ""}\n'
                    '{"_id": "blank", "title": " ", "text": " \\n\\t "}\n')
    with pytest.raises(CorpusError, match=r"c.jsonl:2: document 'blank' has no text and no "
                                          r"title"):
        read_corpus(path)
    path.write_text('{"_id": "t", "title": "Title only", "text": ""}\n')
    assert [d.id for d in read_corpus(path)] == ["t"]


def test_a_password_in_es_url_is_not_written_to_the_manifest(tmp_path):
    from branchsearch.infra.ingest.pipeline import _backends
    from branchsearch.infra.config.settings import load_settings

    settings = load_settings(overrides={"home": tmp_path, "es_url": "http://u:s3cretpw@es:9200"},
                             read_env=False, read_file=False)
    assert "s3cretpw" not in str(_backends(settings, None))


def test_a_long_document_shows_its_embedding_as_it_goes(tmp_path, monkeypatch):
    """One long document is one batch, and progress counts committed documents: its embedding
    reports every EMBED_SLICE chunks, and the pipe's progress lines say so before any document
    is committed."""
    import io

    from branchsearch.infra.ingest import batches
    from branchsearch.orchestrator.cli.options import ProgressLines

    monkeypatch.setattr(batches, "EMBED_SLICE", 8)
    words = " ".join(f"word{i} of the long ledger, entry {i}." for i in range(2500))
    corpus = tmp_path / "book.jsonl"
    corpus.write_text(json.dumps({"id": "book", "title": "Ledger", "text": words}) + "\n")
    settings = _settings(tmp_path / "home")
    seen, committed = [], []
    report = ingest(corpus, settings, embedded=lambda done, total: seen.append((done, total)),
                    progress=lambda docs, chunks: committed.append((docs, chunks)))
    total = report.chunks
    assert total > 16 and committed == [(1, total)]
    assert seen == [(min(i, total), total) for i in range(8, total + 8, 8)]

    retriever = open_retriever(settings)  # the sliced vectors are searched as any
    try:
        hits = retriever.search("word2400 of the long ledger", k=3, mode="dense")
        assert hits and hits[0].doc_id == "book"
    finally:
        retriever.close()

    stream = io.StringIO()
    bar = ProgressLines(None, "doc", "ingest book", every=0.05, stream=stream)
    bar.set_postfix(chunks=0, embedding=f"8/{total} chunks of the next documents")
    time.sleep(0.3)
    bar.close()
    assert f"ingest book: 0 doc, 0.0 doc/s, 0 s (chunks=0, embedding=8/{total} chunks" in \
        stream.getvalue()


def test_a_tiny_ingest_never_reports_a_rate_of_zero(tmp_path):
    """One document, one chunk, and the seconds the model takes to load: the progress line on
    a pipe said `chunks_per_s=0` (the last line had been fixed, the progress line not), and a
    document every 20 s or slower read `0.0 doc/s`. Every rate shown for work done is > 0."""
    import io
    import re

    corpus = tmp_path / "one.jsonl"
    corpus.write_text(json.dumps({"id": "d1", "title": "T", "text": "Falcon plan."}) + "\n")
    done = subprocess.run([*CLI, "ingest", str(corpus), "--index", "tiny"], capture_output=True,
                          text=True, env=_env(tmp_path / "home"), timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rates = re.findall(r"chunks_per_s=([^,)]+)", done.stderr)
    rates += re.findall(r"([\d.e-]+) chunks/s", done.stdout)
    rates += re.findall(r"([\d.e-]+) doc/s", done.stderr)
    assert len(rates) >= 3 and all(float(r) > 0 for r in rates), (done.stderr, done.stdout)

    from branchsearch.orchestrator.cli.options import ProgressLines

    stream = io.StringIO()
    bar = ProgressLines(None, "doc", "ingest book", every=60, stream=stream)
    bar._start -= 100  # one document (a book) in 100 s
    bar.update(1)
    bar.close()
    assert "ingest book: 1 doc, 0.01 doc/s, 100 s, done" in stream.getvalue(), stream.getvalue()


def test_chunks_of_cjk_thai_and_emoji_text_hold_its_characters_not_u_fffd(tmp_path):
    """A token can hold part of a character (Han, Thai, emoji are 3-4 bytes), so a 256-token
    window could begin or end inside one: each chunk was its window's bytes decoded, U+FFFD
    in place of the cut characters, and that is what the stores kept and searches showed
    (hostile pass: 19 of a random Han text's 26 chunks, 6 of a Thai one's 15). Each chunk is
    now a piece of the document's own text, and together they hold all of it."""
    import random
    import unicodedata

    rng = random.Random(1)
    texts = {"han": "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(3000)),
             "thai": "".join(chr(rng.randint(0x0E01, 0x0E4F)) for _ in range(3000)),
             "emoji": "".join(chr(rng.randint(0x1F300, 0x1F6FF)) for _ in range(3000))}
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"_id": k, "text": v}, ensure_ascii=False) + "\n"
                            for k, v in texts.items()))
    settings = _settings(tmp_path / "h", chunk_overlap=0)  # no overlap: the chunks tile it
    ingest(path, settings, dense=False)
    retriever = open_retriever(settings, need_dense=False)
    try:
        for doc_id, text in texts.items():
            chunks = retriever.docstore.document_chunks(doc_id)
            assert len(chunks) > 10
            assert not [c["chunk_id"] for c in chunks if "\ufffd" in c["text"]], doc_id
            assert "".join(c["text"] for c in chunks) == unicodedata.normalize("NFC", text)
            if doc_id != "emoji":  # what a search shows is that text (emoji are no terms)
                hits = retriever.search(chunks[3]["text"][:8], mode="bm25", k=50)
                assert chunks[3]["text"] in [h.text for h in hits]
    finally:
        retriever.close()


def test_an_id_or_acl_a_server_would_refuse_is_one_line_before_anything_is_written(tmp_path):
    """Milvus Lite and tantivy hold any id and any number of groups, so such a corpus
    ingested on the embedded backends; on Elasticsearch (a chunk id past 512 bytes) or a Milvus
    server (past 1,024, or more than 64 groups) the same corpus failed mid-ingest, the index
    left incomplete, with a line of a thousand characters and no file:line (hostile pass).
    Every backend now refuses it up front, naming the line."""
    from branchsearch.infra.errors import CorpusError
    from branchsearch.infra.ingest.corpus import parse_jsonl, read_corpus

    path = tmp_path / "c.jsonl"
    fits = "é" * 250  # 500 bytes: "#p" and its number still fit in 512
    path.write_text(json.dumps({"_id": fits, "text": "fits", "acl": [f"g{i}" for i in
                                                                      range(64)]}) + "\n")
    assert read_corpus(path)[0].id == fits
    settings = _settings(tmp_path / "h")
    for line, problem in ((json.dumps({"_id": fits + "x", "text": "one byte too long"}),
                           r"c.jsonl:2: document id 'é+'… is 501 bytes long in UTF-8; ids "
                           r"are at most 500"),
                          (json.dumps({"_id": "many", "text": "t", "acl": [
                              f"g{i}" for i in range(65)]}),
                           r"c.jsonl:2: 'acl' names 65 groups; a document names at most 64")):
        path.write_text('{"_id": "ok", "text": "fine"}\n' + line + "\n")
        with pytest.raises(CorpusError, match=problem):
            ingest(path, settings)
        assert not settings.index_dir.exists()
        with pytest.raises(CorpusError, match=problem.replace("c.jsonl", "body")):
            parse_jsonl(path.read_text())  # the service's upload, as a file


def test_the_next_ingest_redoes_the_chunks_an_earlier_version_cut_inside_a_character(
        tmp_path):
    """An index ingested before holds U+FFFD where a window cut a character; re-ingesting the
    unchanged corpus kept those chunks (same fingerprint). Such documents are redone once; a
    document whose own text holds U+FFFD is not redone each time."""
    import random

    from branchsearch.infra.models.tokenizer import TokenCounter

    rng = random.Random(2)
    han = "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(1500))
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"_id": "han", "text": han}, ensure_ascii=False) + "\n"
                    + json.dumps({"_id": "own", "text": "a \ufffd in the text itself"}) + "\n")
    settings = _settings(tmp_path / "h")
    ingest(path, settings, dense=False)
    earlier = TokenCounter().decode(TokenCounter().encode(han)[:256]).strip()  # p0 as it was
    assert "\ufffd" in earlier
    with sqlite3.connect(settings.index_dir / "docs.sqlite") as db:
        db.execute("UPDATE chunks SET text = ? WHERE chunk_id = 'han#p0'", (earlier,))
    report = ingest(path, settings, dense=False)
    assert report.resumed == 1  # "own"
    retriever = open_retriever(settings, need_dense=False)
    try:
        assert "\ufffd" not in retriever.docstore.document_chunks("han")[0]["text"]
        assert "\ufffd" in retriever.docstore.document_chunks("own")[0]["text"]
    finally:
        retriever.close()
    assert ingest(path, settings, dense=False).resumed == 2


def test_each_ingest_says_plainly_whether_it_made_resumed_updated_or_repeated_the_index(
        tmp_path):
    """A first ingest said "0 documents were already committed", as did one that added
    documents to a complete index, and a resumed one said "40 documents were already
    committed" as if that were the whole story. Each now says what happened: a new index, a
    stopped ingest resumed (what it kept, what it committed now), a complete index updated, or
    one that already held every document unchanged."""
    from branchsearch.infra.index.manifest import remove_manifest

    home = tmp_path / "home"
    corpus, env = tmp_path / "c.jsonl", _env(home)

    def run() -> str:
        done = subprocess.run([*CLI, "ingest", str(corpus), "--no-dense"], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.splitlines()[0]

    _corpus(corpus, 40)
    first = run()
    assert "ingested 40 documents, 40 chunks into 'default'" in first, first
    assert "a new index: all 40 documents committed now" in first, first
    assert "already committed" not in first, first
    again = run()
    assert "the index was complete and already held every document, unchanged: nothing " \
           "committed" in again, again
    _corpus(corpus, 50)
    updated = run()
    assert "updated the complete index: 40 documents unchanged kept, 10 new or changed " \
           "committed now" in updated, updated
    _corpus(corpus, 60)
    remove_manifest(_settings(home).index_dir)  # an ingest stopped before its manifest
    resumed = run()
    assert "resumed a stopped ingest: 50 documents it had committed kept, 10 committed now" \
           in resumed, resumed
    assert "not in this corpus" not in resumed, resumed
    _corpus(corpus, 30)  # a smaller corpus: the 30 it lacks stay, and the line says so
    smaller = run()
    assert "the index was complete and already held every document, unchanged: nothing " \
           "committed; 30 documents the index holds are not in this corpus: kept (ingest adds " \
           "and updates, it never deletes)" in smaller, smaller


def test_what_a_batch_counts_as_its_index_made_anew(tmp_path):
    """`manifest.changed_since`, which a batch asks before each question and row: documents
    changed in place (a new `version`) are no change of index; another layout (an ingest
    with other chunking), another folder in its place, or no manifest (removed, or an ingest
    running) are."""
    import shutil
    from dataclasses import replace

    from branchsearch.infra.index.manifest import (Manifest, changed_since, identity,
                                                   read_manifest, write_manifest)

    folder = tmp_path / "idx"
    folder.mkdir()
    first = Manifest(documents=1, chunks={"docstore": 1}, embedding=None, encoding="cl100k_base",
                     chunk_tokens=200, chunk_overlap=20, backends={"lexical": "tantivy"},
                     version="v1")
    write_manifest(folder, first)
    opened = identity(folder)
    assert changed_since(folder, "idx", opened) == ""
    write_manifest(folder, replace(first, version="v2", documents=2))  # a service write
    assert changed_since(folder, "idx", opened) == ""
    write_manifest(folder, replace(first, chunk_tokens=100))  # re-chunked: another layout
    assert "made anew" in changed_since(folder, "idx", opened)
    write_manifest(folder, first)
    kept = tmp_path / "kept"
    folder.rename(kept)  # another folder in its place, the same manifest
    folder.mkdir()
    shutil.copy(kept / "manifest.json", folder / "manifest.json")
    assert read_manifest(folder) == first
    assert "made anew" in changed_since(folder, "idx", opened)
    (folder / "manifest.json").unlink()
    assert "was removed, or is being ingested" in changed_since(folder, "idx", opened)


def test_an_index_whose_files_are_replaced_in_its_folder_is_another_index_by_its_id(
        tmp_path):
    """An index's files replaced in its folder (another index's copied over it, manifest
    last), or a folder removed and made again at once (ext4 and overlayfs often give it the
    freed inode back), keeps the folder's inode, so before, with the same layout, `identity`
    called it the same index. Now the manifest's `index_id` tells them apart: a copy whose id
    is fresh is another index, one with the same id (a backup of this very index) is the same,
    as is an old manifest with no id (today's rule: folder and layout). The files are replaced
    in place here, so the inode is the same on every file system."""
    from dataclasses import replace

    from branchsearch.infra.index.manifest import (Manifest, changed_since, identity,
                                                   write_manifest)

    folder = tmp_path / "idx"
    folder.mkdir()
    first = Manifest(documents=1, chunks={"docstore": 1}, embedding=None, encoding="cl100k_base",
                     chunk_tokens=200, chunk_overlap=20, backends={"lexical": "tantivy"},
                     version="v1", index_id="a" * 32)
    write_manifest(folder, first)
    opened = identity(folder)
    inode = folder.stat().st_ino

    write_manifest(folder, replace(first, index_id="b" * 32))  # an index made anew, one layout
    assert folder.stat().st_ino == inode
    assert "made anew" in changed_since(folder, "idx", opened)
    write_manifest(folder, first)  # this index's own backup
    assert changed_since(folder, "idx", opened) == ""
    write_manifest(folder, replace(first, index_id=""))  # a manifest from before ids
    assert identity(folder) == (inode, "", first.layout())


def test_an_index_keeps_its_id_until_an_ingest_makes_it_anew(tmp_path):
    """`index_id`: made by the ingest that creates the index, kept by one that adds or
    replaces documents and by a service write (a new `version`), new when an ingest changes
    the layout or fills a fresh folder."""
    import shutil

    from branchsearch.infra.index.manifest import renew_version

    settings = _settings(tmp_path / "home")
    corpus = _corpus(tmp_path / "c.jsonl", 5)
    ingest(corpus, settings, dense=False)
    made = read_manifest(settings.index_dir)
    assert len(made.index_id) == 32
    ingest(_corpus(tmp_path / "more.jsonl", 8), settings, dense=False)  # 3 added, 5 again
    again = read_manifest(settings.index_dir)
    assert again.version != made.version and again.index_id == made.index_id
    renew_version(settings.index_dir)  # a service write
    assert read_manifest(settings.index_dir).index_id == made.index_id
    ingest(corpus, _settings(tmp_path / "home", chunk_tokens=64), dense=False)  # re-chunked
    rechunked = read_manifest(settings.index_dir)
    assert rechunked.chunk_tokens == 64 and rechunked.index_id != made.index_id
    shutil.rmtree(settings.index_dir)
    ingest(corpus, settings, dense=False)  # a fresh folder
    assert read_manifest(settings.index_dir).index_id not in (made.index_id, rechunked.index_id)
