"""A Milvus Lite process that dies under its stores (killed, crashed) is started again on the
same file by the next request, and every store of this process on the file reconnects to the
new one: the rows written before the kill are all there, searches rank as before it, and
writes go on. (A service used to answer 503 on every request until it was restarted.)"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from branchsearch.infra.stores.milvus import MilvusStore
from branchsearch.infra.stores.milvus_lite import lite_key
from branchsearch.infra.stores.protocols import IndexedChunk

DIM = 8


def _rows(start: int, n: int, seed: int):
    rng = np.random.default_rng(seed)
    chunks = [IndexedChunk(f"dóc{i}#p0", f"dóc{i}", "", "", ("é-team",) if i % 3 else ())
              for i in range(start, start + n)]
    vectors = rng.standard_normal((n, DIM)).astype(np.float32)
    return chunks, vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def _top(store: MilvusStore, query, groups) -> list[str]:
    return [h.chunk_id for h in store.search(query, 10, ["dóc5#p0"], groups)]


def _kill(store: MilvusStore):
    from milvus_lite.server_manager import server_manager_instance

    server = server_manager_instance._servers[lite_key(store.uri)]
    os.kill(server._p.pid, signal.SIGKILL)
    server._p.wait()
    return server


def test_a_killed_lite_process_is_started_again_with_every_write(tmp_path):
    from milvus_lite.server_manager import server_manager_instance

    db = tmp_path / "dense.db"
    writer, reader = MilvusStore(db, DIM), MilvusStore(db, DIM, create=False)  # one server
    try:
        chunks, vectors = _rows(0, 300, seed=1)
        writer.write(chunks, vectors, [])
        query = vectors[5]
        callers = (None, ["é-team"])
        before = [_top(reader, query, groups) for groups in callers]
        dead = _kill(writer)

        assert reader.count() == 300  # the first request after the kill: started again
        revived = server_manager_instance._servers[lite_key(db)]
        assert revived is not dead and revived._p.poll() is None
        assert [_top(reader, query, groups) for groups in callers] == before
        more, more_vectors = _rows(300, 50, seed=2)
        writer.write(more, more_vectors, ["dóc0"])  # the other store reconnected too
        assert reader.count() == 349 and writer.count() == 349
        before = [_top(reader, query, groups) for groups in callers]  # (dóc0 deleted)

        _kill(reader)  # and again, with 16 searches at once from two stores: every one is
        # answered by the new server (one used to reach the old client while it restarted)
        with ThreadPoolExecutor(16) as pool:
            tops = list(pool.map(lambda i: _top((reader, writer)[i % 2], query, callers[i % 2]),
                                 range(16)))
        assert tops == [before[i % 2] for i in range(16)]
        assert writer.count() == 349
        assert [h.chunk_id for h in writer.search(more_vectors[0], 1)] == ["dóc300#p0"]
    finally:
        writer.close()
        reader.close()
    assert lite_key(db) not in server_manager_instance._servers  # the last close stops it


def test_a_restart_that_fails_is_an_error_at_once_and_tried_again(tmp_path, monkeypatch):
    """A Lite process that cannot be started again (here: milvus-lite pointed at a folder
    without its binary, `BIN_PATH`; seen for real with the index folder made read-only) left
    the store without a server, and nothing tried again: every later request waited out its
    deadline, and an error of the restart itself (a PermissionError) passed for a rejected
    tool call, a BM25-only result reported `ok`. Now each request is one BackendUnavailable at
    once, and the first one after the cause is gone starts the server, every row there."""
    import gc
    import sys
    import time

    import pytest

    from conftest import read_only_folder

    from branchsearch.infra.errors import BackendUnavailable

    store = MilvusStore(tmp_path / "dense.db", DIM, timeout_s=60.0)
    try:
        chunks, vectors = _rows(0, 40, seed=3)
        store.write(chunks, vectors, [])
        monkeypatch.setenv("BIN_PATH", str(tmp_path / "no-binary-here"))
        _kill(store)
        for _ in range(2):
            began = time.monotonic()
            with pytest.raises(BackendUnavailable, match="could not be started again"):
                store.count()
            assert time.monotonic() - began < 5  # not the 60 s request deadline
        monkeypatch.delenv("BIN_PATH")
        assert store.count() == 40
        assert [h.chunk_id for h in store.search(vectors[6], 1)] == ["dóc6#p0"]

        # the lock file cannot be opened (made immutable): the same, and no traceback from
        # milvus_lite's cleanup of a failed start (a batch's watchdog printed two a second)
        lock = tmp_path / ".dense.db.lock"
        unraisable = []
        monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
        with read_only_folder(lock):
            _kill(store)
            for _ in range(3):
                with pytest.raises(BackendUnavailable, match="could not be started again"):
                    store.count()
            gc.collect()
        assert not unraisable, [u.exc_value for u in unraisable]
        assert store.count() == 40
    finally:
        store.close()


def test_a_store_opened_after_the_server_died_starts_it_again(tmp_path):
    """A process whose Lite server died while it held a store on the file, and which opens
    another store there before any request (a new question's retriever), starts it again
    rather than fail to connect to the dead one's socket."""
    from milvus_lite.server_manager import server_manager_instance

    db = tmp_path / "dense.db"
    first = MilvusStore(db, DIM)
    try:
        chunks, vectors = _rows(0, 40, seed=3)
        first.write(chunks, vectors, [])
        dead = _kill(first)
        second = MilvusStore(db, DIM, create=False)
        try:
            assert second.count() == 40
            assert server_manager_instance._servers[lite_key(db)] is not dead
        finally:
            second.close()
        assert first.count() == 40  # the first store reaches the new server too
    finally:
        first.close()


OWNER = """
import sys, time
from branchsearch.infra.stores.milvus import MilvusStore
from branchsearch.infra.stores.milvus_lite import serve_lite
from milvus_lite.server_manager import server_manager_instance

store = MilvusStore(sys.argv[1], 8)
print(next(iter(server_manager_instance._servers.values()))._uds_path, flush=True)
print(serve_lite(sys.argv[1]).removeprefix("unix:"), flush=True)  # as a batch with workers
time.sleep(600)
"""


def test_a_socket_left_by_a_killed_owner_goes_with_the_next_open(tmp_path):
    """`kill -9` of a process group that owns a Lite file (the server dies with it) leaves the
    server's socket in the temp folder (`tmpXXXX_dense.db.sock`), the folder of the link a
    batch's workers connect through (`branchsearch-lite-XXXX/`) and the file's lock file. The
    next open of the same file works, and removes that socket (nothing listens on it), and the
    next serve of it that folder; a socket of another file, and one in use, stay."""
    import socket
    import subprocess
    import sys

    from branchsearch.infra.stores.milvus_lite import serve_lite, stop_serving_lite

    db = tmp_path / "dense.db"
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(db)], stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        left = Path(owner.stdout.readline().strip())
        link = Path(owner.stdout.readline().strip())
        assert left.is_socket() and link.is_symlink()
    finally:
        os.killpg(owner.pid, signal.SIGKILL)
        owner.wait()
        owner.stdout.close()
    time.sleep(0.5)  # the server, in the same group, is gone too
    assert left.is_socket() and link.is_symlink()  # what kill -9 leaves
    other = tmp_path / "tmpother_dense.db.sock"  # a dead server's socket of another file
    socket.socket(socket.AF_UNIX).bind(str(other))

    store = MilvusStore(db, DIM)  # the next run: works, and the leftover goes
    try:
        chunks, vectors = _rows(0, 10, seed=3)
        store.write(chunks, vectors, [])
        assert store.count() == 10
        assert not left.exists()
        assert other.is_socket()
        served = Path(serve_lite(db).removeprefix("unix:"))
        try:
            assert not link.parent.exists() and served.parent.is_dir()
        finally:
            stop_serving_lite(db)
    finally:
        store.close()

    listening = socket.socket(socket.AF_UNIX)  # a socket in use is never removed
    live = tmp_path / "live.sock"
    listening.bind(str(live))
    listening.listen()
    try:
        (tmp_path / ".dense.db.sock-path").write_text(f"{live}\n")
        store = MilvusStore(db, DIM, create=False)
        store.close()
        assert live.is_socket()
    finally:
        listening.close()
