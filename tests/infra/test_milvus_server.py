"""The dense-store contract on Milvus Lite and on a real Milvus server (the `milvus` package's
standalone server, started here; or any Milvus at BRANCHSEARCH_MILVUS_URI), and an ingest plus
hybrid retrieval through `milvus_uri` with an HNSW index."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import numpy as np
import pytest

from branchsearch.infra.stores.acl import ACL_ALL
from branchsearch.infra.stores.protocols import IndexedChunk
from branchsearch.infra.stores.milvus import IndexSpec, MilvusStore
from branchsearch.infra.ingest.pipeline import ingest
from branchsearch.infra.index.manifest import read_manifest
from branchsearch.infra.index.open import open_retriever

from conftest import HOTPOT
from store_copy import copy_store


CHUNKS = [
    IndexedChunk("apple#p0", "apple", "Apple", "a", ()),
    IndexedChunk("bank#p0", "bank", "Bank", "b", ("finance",)),
    IndexedChunk("bank#p1", "bank", "Bank", "c", ("finance",)),
]
VECTORS = np.eye(4, dtype=np.float32)[:3]


def dense_contract(open_store) -> None:
    store = open_store()
    try:
        store.write(CHUNKS, VECTORS, ["apple", "bank"])
        store.write(CHUNKS, VECTORS, ["apple", "bank"])  # idempotent: one row per chunk id
        assert store.count() == 3
        store.write(CHUNKS, VECTORS, ["apple"])  # bank's rows not deleted first: upserted
        assert store.count() == 3
        hits = store.search(VECTORS[1], 3, acl_groups=[ACL_ALL])
        assert [h.chunk_id for h in hits][:1] == ["bank#p0"] and hits[0].score == pytest.approx(1)
        assert {h.chunk_id for h in hits} == {"apple#p0", "bank#p0", "bank#p1"}
        assert "bank#p0" not in {h.chunk_id for h in store.search(
            VECTORS[1], 3, exclude_ids=["bank#p0"], acl_groups=[ACL_ALL])}
        assert [h.chunk_id for h in store.search(VECTORS[1], 3)] == ["apple#p0"]  # public only
        assert {h.chunk_id for h in store.search(VECTORS[1], 3, acl_groups=["finance"])} == \
            {"apple#p0", "bank#p0", "bank#p1"}
        store.write([CHUNKS[1]], VECTORS[1:2], ["bank"])  # bank shrinks to one chunk
        assert store.count() == 2
        store.delete_documents(["apple"])
        assert store.count() == 1
    finally:
        store.close()
    again = open_store()  # reopen: the data is still there
    try:
        assert again.count() == 1
        assert [h.chunk_id for h in again.search(VECTORS[1], 3, acl_groups=["finance"])] == \
            ["bank#p0"]
    finally:
        again.drop()
        again.close()


def test_dense_contract_milvus_lite(tmp_path):
    dense_contract(lambda: MilvusStore(tmp_path / "d.db", 4, collection="contract"))


def test_dense_contract_milvus_server(milvus_uri):
    name = f"contract_{uuid.uuid4().hex[:8]}"
    strong = IndexSpec(consistency="Strong")  # the contract reads right after each write
    dense_contract(lambda: MilvusStore(milvus_uri, 4, collection=name, index=strong))
    store = MilvusStore(milvus_uri, 4, collection=name + "_kind", index=IndexSpec("auto"))
    try:
        assert store.server and store.index_kind == "HNSW"  # ANN on a server by default
    finally:
        store.drop()
        store.close()


def test_ingest_and_hybrid_retrieval_through_milvus_uri(milvus_uri, hotpot_settings):
    index = f"srv{uuid.uuid4().hex[:6]}"
    settings = hotpot_settings.replace(index=index, milvus_uri=milvus_uri,
                                       milvus_consistency="Strong")  # search right after ingest
    report = ingest(HOTPOT, settings)
    manifest = read_manifest(settings.index_dir)
    assert manifest.chunks["dense"] == manifest.chunks["docstore"] == report.chunks
    assert "(HNSW)" in manifest.backends["dense"] and manifest.backends["dense"].startswith(
        "milvus http")
    local = hotpot_settings.replace(index=index + "lite")  # the same corpus on Milvus Lite
    ingest(HOTPOT, local)
    server, lite = open_retriever(settings), open_retriever(local)
    try:
        q = "Were Scott Derrickson and Ed Wood of the same nationality?"
        for mode in ("dense", "hybrid"):
            got = [h.chunk_id for h in server.search(q, mode, 5)]
            assert got == [h.chunk_id for h in lite.search(q, mode, 5)], mode
        assert {"scott-derrickson", "ed-wood"} & {h.doc_id for h in server.search(q, "hybrid", 5)}
        again = ingest(HOTPOT, settings)  # a re-run changes nothing and duplicates nothing
        assert again.resumed == again.documents and server.dense.count() == report.chunks
    finally:
        server.dense.drop()
        server.close()
        lite.close()


def test_lite_file_stays_served_until_its_last_store_closes(tmp_path):
    """Two stores of one process on one Lite file: closing the first leaves the second working
    (one Lite server per file per process); closing the last frees the file for another
    process, which then opens it."""
    import subprocess
    import sys

    db = tmp_path / "shared.db"
    first = MilvusStore(db, 4, collection="shared")
    first.write(CHUNKS, VECTORS, ["apple", "bank"])
    second = MilvusStore(db, 4, collection="shared")
    first.close()
    first.close()  # a second close must not release the file under `second`
    assert [h.chunk_id for h in second.search(VECTORS[0], 1)] == ["apple#p0"]
    assert second.count() == 3
    second.close()
    probe = ("import sys; from branchsearch.infra.stores.milvus import MilvusStore; "
             "s = MilvusStore(sys.argv[1], 4, collection='shared'); print(s.count()); s.close()")
    out = subprocess.run([sys.executable, "-c", probe, str(db)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-500:]
    assert out.stdout.split()[-1] == "3"


def test_an_unreachable_server_is_not_waited_for_again_at_once():
    """A Milvus server nobody answers at (a closed port, as a server killed): the first request
    waits out its timeout and says so; the next ones of this process fail at once for
    UNREACHABLE_S (no branch of a shared pool waits out the timeout for every call), then
    they ask again."""
    import socket
    import time

    from pymilvus import MilvusClient

    from branchsearch.infra.errors import BackendUnavailable
    from branchsearch.infra.stores import milvus

    with socket.socket() as probe:  # a port with no server
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    uri = f"http://root:hunter2@127.0.0.1:{port}"

    def connect(timeout):
        return MilvusClient(uri=uri, timeout=timeout)

    with pytest.raises(BackendUnavailable) as first:
        milvus.milvus_call(uri, "connect", connect, timeout_s=2)
    assert "hunter2" not in str(first.value)
    started = time.monotonic()
    for _ in range(5):
        with pytest.raises(BackendUnavailable, match="not asked again"):
            milvus.milvus_call(uri, "search", connect, timeout_s=2)
    assert time.monotonic() - started < 0.5  # no timeout waited out
    milvus._unreachable[uri] = (time.monotonic() - milvus.UNREACHABLE_S, "old")
    with pytest.raises(BackendUnavailable) as again:  # the window over: asked again
        milvus.milvus_call(uri, "search", connect, timeout_s=2)
    assert "not asked again" not in str(again.value)
    milvus._unreachable.pop(uri, None)


def test_an_owned_index_on_a_refused_server_fails_at_once(hotpot_settings, tmp_path):
    """An owned index whose vectors are on a Milvus server nobody answers at: `indexes`,
    `retrieve`, `search`, `batch` and `ingest` each waited out the client's 10 s channel
    timeout (ingest after loading the embedding model) before saying so. A TCP check answers
    first: one line at once, no password from the URI, and an ingest writes nothing."""
    import json
    import os
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as probe:  # a port with no server
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    index_dir = tmp_path / "indexes" / "hotpot"
    copy_store(hotpot_settings.index_dir, index_dir, ignore=("dense.db*", "*.lock"))
    manifest = json.loads((index_dir / "manifest.json").read_text())
    manifest["backends"]["dense"] = f"milvus http://***@127.0.0.1:{port} (HNSW)"
    (index_dir / "manifest.json").write_text(json.dumps(manifest))
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"_id": "1", "text": "Who directed Ed Wood?"}\n')
    env = {**os.environ, "BRANCHSEARCH_MILVUS_URI": f"http://root:hunter2@127.0.0.1:{port}"}
    said = "is not answering (ConnectionRefusedError); start Milvus there"
    for args in (["indexes", "--json"], ["retrieve", "q", "--index", "hotpot"],
                 ["search", "q", "--index", "hotpot"],
                 ["batch", str(questions), "-o", str(tmp_path / "out.jsonl"), "--index", "hotpot"],
                 ["ingest", str(HOTPOT), "--index", "fresh"]):
        start = time.monotonic()
        run = subprocess.run([sys.executable, "-m", "branchsearch.orchestrator.cli", *args,
                              "--home", str(tmp_path)], capture_output=True, text=True,
                             env=env, timeout=300)
        took = time.monotonic() - start
        assert "hunter2" not in run.stdout + run.stderr, args
        if args[0] == "indexes":
            assert run.returncode == 1, run.stderr
            assert said in json.loads(run.stdout)[0]["health"], run.stdout
        else:
            assert run.returncode == 2 and run.stdout == "", (args, run.stdout, run.stderr)
            lines = run.stderr.strip().splitlines()
            assert len(lines) == 1 and said in lines[0], (args, run.stderr)
        assert took < 6, (args, took)
    assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / "indexes" / "fresh").exists()


def _tmp_names() -> set[str]:
    """What /tmp holds now, /tmp/milvus's files (where Milvus writes its server_id) named
    `milvus/NAME`."""
    shared = Path("/tmp/milvus")
    return set(os.listdir("/tmp")) | {f"milvus/{n}" for n in
                                      (os.listdir(shared) if shared.is_dir() else ())}


def _named_for(pid: int, names: set[str]) -> list[str]:
    """The names a process left: glog's `milvus.HOST.USER.log.LEVEL.DATE-TIME.PID` and Milvus's
    `server_id_PID` (other processes on the machine write beside them)."""
    return sorted(n for n in names if n.endswith((f".{pid}", f"_{pid}")))


def test_a_milvus_server_leaves_nothing_in_tmp(tmp_path):
    """A test's Milvus server, started and stopped: its glog files (~4,000 in /tmp after a
    full run) and its `server_id_PID` file (in /tmp/milvus, where Milvus 2.3.5 always writes
    it) are not left in /tmp; its logs are under its own folder."""
    pytest.importorskip("milvus")
    from milvus_server import start_milvus_server

    before = _tmp_names()
    with start_milvus_server(tmp_path / "milvus") as server:
        pid = server.pid
        assert f"milvus/server_id_{pid}" in _tmp_names()  # Milvus writes it there
    assert _named_for(pid, _tmp_names() - before) == []
    logs = [p.name for p in (tmp_path / "milvus" / "logs").iterdir()]
    assert any(n.endswith(f".{pid}") and ".log.INFO." in n for n in logs), logs


def test_a_milvus_lite_server_of_the_tests_logs_in_their_own_folder(tmp_path):
    """A Milvus Lite server that a test's store starts writes its glog files under the test
    session's folder (conftest sets GLOG_log_dir), not in /tmp, and its socket goes when the
    store closes."""
    from milvus_lite.server_manager import server_manager_instance

    before = _tmp_names()
    store = MilvusStore(tmp_path / "d.db", 4, collection="tidy")
    try:
        server = server_manager_instance._servers[str((tmp_path / "d.db").resolve())]
        pid, socket_path = server._p.pid, Path(server._uds_path)
        store.write(CHUNKS, VECTORS, ["apple", "bank"])
        assert socket_path.is_socket()
    finally:
        store.close()
    assert _named_for(pid, _tmp_names() - before) == []
    assert not socket_path.exists()
    logs = Path(os.environ["GLOG_log_dir"])
    assert logs.is_relative_to(tmp_path.parent)  # the session's basetemp
    assert any(p.name.endswith(f".{pid}") for p in logs.iterdir())


def test_the_products_milvus_lite_servers_log_under_the_home(hotpot_settings, tmp_path):
    """`branchsearch ingest` then `search`, run as a user runs them (no GLOG_log_dir in the
    environment) with a relative `--home`: the Milvus Lite servers they start write their glog
    files under the data home's `logs/milvus` (made on demand), and none of them writes in
    /tmp. The folder does not grow without end: a start keeps it to the newest
    `KEEP_LOG_FILES` glog files (a service restarted daily for a year, a cron job every
    minute, each left two files a start)."""
    import subprocess
    import sys

    home = tmp_path / "home"  # the embeddings, so that the ingest does not embed
    copy_store(Path(hotpot_settings.home) / "cache" / "embeddings.sqlite",
               home / "cache" / "embeddings.sqlite")
    from branchsearch.infra.stores.milvus_lite import KEEP_LOG_FILES

    logs = home / "logs" / "milvus"
    logs.mkdir(parents=True)
    gone = 9_000_000  # pids above any pid_max: no process runs with them
    old = [logs / f"milvus.host.user.log.INFO.20250101-0000{i:02d}.{gone + i}"
           for i in range(KEEP_LOG_FILES + 20)]  # left by earlier starts, oldest first
    live = logs / f"milvus.host.user.log.INFO.20240101-000000.{os.getpid()}"  # a server of
    for age, path in enumerate([*reversed(old), live]):  # this pid still runs: kept
        path.write_text("I0101 started\n")
        os.utime(path, (1e9 - age, 1e9 - age))
    (logs / "notes.txt").write_text("the operator's own file")
    env = {k: v for k, v in os.environ.items() if k != "GLOG_log_dir"}
    before = _tmp_names()
    for args in (["ingest", str(HOTPOT)],
                 ["search", "Were Scott Derrickson and Ed Wood of the same nationality?"]):
        run = subprocess.run([sys.executable, "-m", "branchsearch.orchestrator.cli", *args,
                              "--index", "logged", "--home", "home"],
                             capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
        assert run.returncode == 0, (args, run.stderr[-2000:])
        assert "LOGGINGFILE" not in run.stderr, run.stderr[-2000:]  # glog's "could not create"
    glogs = [p for p in logs.iterdir() if ".log." in p.name and not p.is_symlink()]
    pids = {int(p.name.rpartition(".")[2]) for p in glogs} - {gone + i for i in range(len(old))}
    pids.discard(os.getpid())
    assert len(pids) >= 2, sorted(p.name for p in logs.iterdir())  # the ingest's, the search's
    assert len(glogs) - 1 <= KEEP_LOG_FILES, len(glogs)  # (the running writer's aside)
    assert not old[0].exists() and old[-1].exists()  # the oldest went, the newest stayed
    assert live.exists()  # the oldest of all, but its writer runs
    assert (logs / "notes.txt").exists()
    left = _tmp_names() - before
    assert [n for pid in pids for n in _named_for(pid, left)] == []


def test_a_refused_server_is_told_the_fix_that_fits_the_index(milvus_uri, hotpot_settings):
    """`milvus_uri` at an address nobody answers: an index ingested into a Milvus server keeps
    its vectors only there, so its line names that server (its manifest's address, without
    credentials), or says to start it when it is the one refused (unsetting milvus_uri would
    point it at an embedded file that does not hold them); a new index may still take the
    embedded file instead; an index ingested into its embedded file does not use the server."""
    from conftest import ingest_copy

    from branchsearch.infra.errors import BackendUnavailable, redact
    from branchsearch.infra.index.manifest import write_manifest
    from branchsearch.infra.index.open import server_hint

    refused = "http://127.0.0.1:1"
    on_server = hotpot_settings.replace(index=f"srv{uuid.uuid4().hex[:6]}", milvus_uri=milvus_uri)
    ingest(HOTPOT, on_server)
    embedded = ingest_copy(hotpot_settings, f"lite{uuid.uuid4().hex[:6]}")
    try:
        for attempt in (lambda s: open_retriever(s), lambda s: ingest(HOTPOT, s)):
            with pytest.raises(BackendUnavailable) as said:
                attempt(on_server.replace(milvus_uri=refused))
            line = str(said.value)
            assert "is not answering" in line and "unset milvus_uri" not in line, line
            assert (f"index {on_server.index!r} was ingested into the Milvus server at "
                    f"{redact(milvus_uri)} and keeps its vectors only there: set milvus_uri to "
                    "that server, or start it") in line, line
        manifest = read_manifest(on_server.index_dir)
        assert manifest is not None  # the refused ingest changed nothing
        recorded = dict(manifest.backends)
        manifest.backends["dense"] = f"milvus {refused} (HNSW)"  # as if refused where it was
        write_manifest(on_server.index_dir, manifest)
        try:
            assert server_hint(on_server.replace(milvus_uri=refused)).startswith(
                f"start Milvus there: index {on_server.index!r} was ingested into a Milvus "
                "server")
        finally:
            manifest.backends = recorded
            write_manifest(on_server.index_dir, manifest)
        with pytest.raises(BackendUnavailable) as said:
            ingest(HOTPOT, on_server.replace(index=f"new{uuid.uuid4().hex[:6]}",
                                             milvus_uri=refused))
        assert "unset milvus_uri for the embedded file" in str(said.value)
        lite = open_retriever(embedded.replace(milvus_uri=refused))
        try:
            assert lite.search("Who directed Ed Wood?", "dense", 3)
        finally:
            lite.close()
    finally:
        server = open_retriever(on_server)
        server.dense.drop()
        server.close()
