"""Milvus Lite: an embedded Milvus file, served by a process that this one starts and owns.

Milvus Lite lets one process own a file. This module keeps that ownership honest for the
stores (`infra.stores.milvus`):

* **Counting**: each open store of this process on a file counts (`acquire_lite`,
  `release_lite`); the last one to close stops the server, so another process can open the
  file. A file another process holds is refused at once (`held_elsewhere`, `busy_error`), before
  milvus-lite's own failed open could delete the holder's lock file.
* **Reviving**: a server process of ours that died (killed, crashed) is started again on the
  same file by the next request (`lite_down`, `revive_lite`); its `generation` tells a store
  that its client reaches a dead server.
* **Serving**: a batch's worker processes reach the owner's server through a socket link
  (`serve_lite`, `use_served_lite`), kept pointing at a live server by a watchdog.
* **Signals**: a server starts with ^C blocked (`lite_spawn`): it ends with its owner, not with
  the terminal's ^C to the process group.
* **Logs**: a server writes its glog files under the data home (`log_lite_under`,
  `lite_log_dir`), not in /tmp, where a long batch or a service would leave them by thousands;
  each start keeps the folder to the newest `KEEP_LOG_FILES` (`prune_logs`).
* **Leftovers**: what a server killed with its owner (`kill -9` of the process group) leaves in
  the temp folder goes when the next server starts on the same file (`lite_leftovers`).

A server URI (`is_server`) needs none of this.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from pathlib import Path

from branchsearch.infra.errors import BackendUnavailable, IndexBusy
from branchsearch.infra.stores import lite_leftovers as leftovers


def lite_key(uri: str | Path) -> str | None:
    """The key Milvus Lite's server manager holds an embedded file's server under; None for a
    server URI. (Resolving it touches the filesystem: a store works it out once.)"""
    return None if is_server(uri) else _lite_key(uri)


def lite_down(key: str | None) -> str | None:
    """Why this process's Milvus Lite server for an embedded file (by `lite_key`) cannot
    answer: "exited (status N)" when its process died (killed, crashed), "is not running" when
    this process has stores open on the file but no server for it (a restart that failed);
    None when it is alive, or the URI is a server, or the file is not this process's. A request
    to a dead one would be retried by pymilvus until its deadline; asked first, it fails at
    once, or starts it again (`revive_lite`)."""
    if key is None:
        return None
    try:
        from milvus_lite.server_manager import server_manager_instance
    except ImportError:
        return None
    server = server_manager_instance._servers.get(key)
    if server is None:
        return "is not running" if _lite_users.get(key) else None
    status = None if server._p is None else server._p.poll()
    return None if status is None else f"exited (status {status})"


_lite_generation: dict[str, int] = {}  # embedded file -> times this process restarted its server
_revive_lock = threading.Lock()


def revive_lite(key: str) -> int:
    """Start this process's Milvus Lite server for an embedded file (by `lite_key`) again if it
    is down (`lite_down`); returns its generation (how many times it was started again), which
    the stores on the file compare with theirs to know their client reaches a dead server. The
    file is what the dead process left: every write that had returned (Lite persists each one).
    A start that fails is one `BackendUnavailable`, and the next call tries again."""
    with _revive_lock:
        down = lite_down(key)
        if down is not None:
            from milvus_lite.server_manager import server_manager_instance

            _forget_lite(key)
            started, why = None, _lock_file_opens(key)
            try:
                if not why:
                    with lite_spawn(key):
                        started = server_manager_instance.start_and_get_uri(key)
            except Exception as exc:  # noqa: BLE001 — a folder made read-only, a full disk
                why = f" ({type(exc).__name__}: {exc})"
            if not started:
                raise BackendUnavailable(f"milvus lite: the server process for {key} {down} "
                                         f"and could not be started again{why}; the next "
                                         "request tries again")
            logging.getLogger(__name__).warning(
                "milvus lite: the server process for %s %s; started another on the same file",
                key, down)
        return _lite_generation.get(key, 0)


def generation(key: str | None) -> int:
    """How many times this process started its Lite server for an embedded file (by
    `lite_key`) again: a store compares it with the one it connected at to know that its
    client reaches a dead server."""
    return _lite_generation.get(key, 0)


def drop_lite(key: str) -> None:
    """Stop this process's Milvus Lite server for an embedded file, whatever state it is in (one
    that started but does not answer), so that the next request starts another."""
    with _revive_lock:
        _forget_lite(key)


_unstopped: list = []  # Lite servers whose cleanup failed: kept, so that milvus_lite's own
# cleanup on garbage collection does not fail again (a traceback on stderr at each)


def _forget_lite(key: str) -> None:
    """Under `_revive_lock`: out of milvus_lite's server manager, its process stopped and our
    lock on the file dropped; a cleanup that fails (the lock file in a folder made read-only)
    does not keep it listed. First, the generation moves on: a store that looks meanwhile (the
    server not listed while it restarts) sees its client is stale, and waits for the lock
    rather than send to the dead server."""
    from milvus_lite.server_manager import server_manager_instance

    _lite_generation[key] = _lite_generation.get(key, 0) + 1
    server = server_manager_instance._servers.pop(key, None)
    if server is not None:
        try:
            server.stop()
        except Exception:  # noqa: BLE001 — see above
            _unstopped.append(server)


def _lock_file_opens(key: str) -> str:
    """"" when this process can open the Lite file's lock file (a server start needs it), else
    why not. Asked before a restart: milvus_lite's server object for a start that fails on it
    raises again in its cleanup on garbage collection, a traceback on stderr each time."""
    db = Path(key)
    try:
        with open(db.parent / f".{db.name}.lock", "a"):
            return ""
    except OSError as exc:
        return f" ({type(exc).__name__}: {exc.strerror or exc})"


def is_server(uri: str | Path) -> bool:
    return str(uri).startswith(("http://", "https://", "tcp://", "grpc://"))


_lite_users: dict[str, int] = {}  # embedded file -> open stores of this process on it


def _lite_key(uri: str | Path) -> str:
    return str(Path(uri).absolute().resolve())


def acquire_lite(uri: str | Path) -> None:
    """Count one more open store of this process on an embedded file (see `release_lite`)."""
    if not is_server(uri):
        key = _lite_key(uri)
        _lite_users[key] = _lite_users.get(key, 0) + 1


def release_lite(uri: str | Path) -> None:
    """One store of this process is done with an embedded file. The last one stops this
    process's Milvus Lite server for it, so another process can open the file (Milvus Lite
    allows one process per file); while other stores of this process still use the file, its
    server stays up (stopping it would cut them off). A server URI needs nothing."""
    if is_server(uri):
        return
    key = _lite_key(uri)
    left = _lite_users.get(key, 0) - 1
    if left > 0:
        _lite_users[key] = left
        return
    _lite_users.pop(key, None)
    try:
        from milvus_lite.server_manager import server_manager_instance
    except ImportError:
        return
    server_manager_instance.release_server(str(uri))
    leftovers.forget(key, leftovers.SOCKET)  # its socket went with it


_served: dict[str, str] = {}  # Lite file -> socket of the server another process runs for it


def lite_log_dir(home: str | Path) -> Path:
    """Where the Milvus Lite servers of the indexes under the data home `home` write their
    glog files."""
    return Path(home) / "logs" / "milvus"


KEEP_LOG_FILES = 100  # glog files (a few KB each, two per server start) a start leaves


def prune_logs(folder: Path, keep: int = KEEP_LOG_FILES) -> None:
    """Delete all but the newest `keep` glog files in `folder` (glog writes new ones at every
    server start and never deletes one). Its links to the newest (`milvus.INFO`), files of
    other names and the files of a server still running (glog ends a file's name with its
    writer's pid) stay; a file that cannot be deleted is left."""
    def running(path: Path) -> bool:
        pid = path.name.rpartition(".")[2]
        return pid.isdigit() and Path(f"/proc/{pid}").exists()

    try:
        files = [p for p in folder.iterdir() if ".log." in p.name and not p.is_symlink()
                 and p.is_file() and not running(p)]
        files.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return
    for old in files[keep:]:
        try:
            old.unlink()
        except OSError:
            pass


_lite_logs: dict[str, Path] = {}  # embedded file -> the folder its server's glog files go to
_glog_env = threading.Lock()  # held while GLOG_log_dir is set for a server that starts


def log_lite_under(key: str | None, folder: str | Path | None) -> None:
    """A Milvus Lite server this process starts for an embedded file (by `lite_key`) writes its
    glog files in `folder`, made when the server starts, instead of glog's default, /tmp (a
    few files per server start). `GLOG_log_dir` set in the environment wins. None: no change."""
    if key is not None and folder is not None:
        _lite_logs[key] = Path(folder).absolute()  # the server runs in the file's folder


@contextmanager
def _logging_to(folder: Path | None):
    """`GLOG_log_dir` set to `folder` meanwhile (the server copies the environment when it
    starts), unless the environment sets it already; the lock keeps two starts that log to
    different folders from seeing each other's. A folder that cannot be made leaves glog's
    default."""
    import os

    if folder is None:
        yield
        return
    with _glog_env:
        if "GLOG_log_dir" in os.environ:
            yield
            return
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            yield
            return
        prune_logs(folder, KEEP_LOG_FILES - 2)  # room for the two this start writes
        os.environ["GLOG_log_dir"] = str(folder)
        try:
            yield
        finally:
            os.environ.pop("GLOG_log_dir", None)


@contextmanager
def lite_spawn(key: str | None = None):
    """Around anything that may start a Milvus Lite server process (for the embedded file
    `key`, by `lite_key`: its logs go where `log_lite_under` says). SIGINT is blocked in this
    thread meanwhile, so the process starts with it blocked (a signal mask survives fork and
    exec) and a ^C, which the terminal sends to the whole process group, does not kill it under
    a batch that finishes its questions on ^C (each would wait out backend_timeout_s and
    fail). The server still ends with its owner: it exits when the owner's lock on the
    file goes. A ^C meanwhile reaches this process once the mask is restored."""
    import signal

    before = _server_of(key)
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        with _logging_to(_lite_logs.get(key) if key is not None else None):
            yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    started = _server_of(key)
    if started is not None and started is not before:
        leftovers.claim(key, leftovers.SOCKET, Path(started._uds_path))


def _server_of(key: str | None):
    """milvus_lite's server object of this process for an embedded file (by `lite_key`)."""
    if key is None:
        return None
    try:
        from milvus_lite.server_manager import server_manager_instance
    except ImportError:
        return None
    return server_manager_instance._servers.get(key)


LITE_WATCH_S = 0.5  # how often a process that serves a Lite file checks its server is alive
_serving: dict[str, tuple[Path, threading.Event, threading.Thread]] = {}  # served files (by
# `lite_key`) -> the link the other processes connect through, and its watchdog


def serve_lite(db: str | Path) -> str:
    """The socket URI (`unix:…`) through which other processes reach this process's Milvus
    Lite server for `db`, started if it is not running. Milvus Lite lets one process own a
    file; other processes of the same job (a batch's worker processes) reach that owner's
    server through this socket (`use_served_lite`) instead of opening the file. The owner
    keeps a store open on `db` while they do, and ends with `stop_serving_lite`.

    The URI is a link to the server's socket, kept by a watchdog thread: a server that dies
    is started again on the same file (`revive_lite`) and the link pointed at the new one, so
    the clients of every process reconnect by themselves (gRPC connects again, through the
    link; pymilvus retries a failed request meanwhile)."""
    import tempfile

    from milvus_lite.server_manager import server_manager_instance

    key = _lite_key(db)
    if key in _serving:
        return f"unix:{_serving[key][0]}"
    with lite_spawn(key):
        uri = server_manager_instance.start_and_get_uri(str(db))
    if not uri:
        raise BackendUnavailable(f"milvus lite: cannot serve {db}")
    link = Path(tempfile.mkdtemp(prefix="branchsearch-lite-")) / "milvus.sock"
    leftovers.claim(key, leftovers.LINK, link.parent)
    _point(link, uri)
    stop = threading.Event()
    watchdog = threading.Thread(target=_keep_serving, args=(key, link, stop), daemon=True,
                                name="lite-watchdog")
    _serving[key] = (link, stop, watchdog)
    watchdog.start()
    return f"unix:{link}"


def stop_serving_lite(db: str | Path) -> None:
    """This process no longer serves `db` to others: the watchdog ends (before the owner's
    store closes the server: it must not start it again) and the link goes."""
    import shutil

    key = _lite_key(db)
    entry = _serving.pop(key, None)
    if entry is not None:
        link, stop, watchdog = entry
        stop.set()
        watchdog.join()
        shutil.rmtree(link.parent, ignore_errors=True)
        leftovers.forget(key, leftovers.LINK)


def _keep_serving(key: str, link: Path, stop: threading.Event) -> None:
    from milvus_lite.server_manager import server_manager_instance

    seen = _lite_generation.get(key, 0)
    while not stop.wait(LITE_WATCH_S):
        try:
            if lite_down(key) is not None:
                revive_lite(key)
            with _revive_lock:  # (a store of this process may have revived it)
                now = _lite_generation.get(key, 0)
                server = server_manager_instance._servers.get(key)
            if now != seen and server is not None:
                _point(link, server.uds_path)
                seen = now
        except Exception as exc:  # noqa: BLE001 — tried again at the next look
            logging.getLogger(__name__).warning("%s", exc)


def _point(link: Path, uri: str) -> None:
    """`link` to the socket of `uri` (`unix:PATH`), replaced in one step."""
    import os

    fresh = link.with_name(link.name + ".new")
    fresh.unlink(missing_ok=True)
    os.symlink(uri.removeprefix("unix:"), fresh)
    os.replace(fresh, link)


def use_served_lite(db: str | Path, socket_uri: str | None) -> None:
    """In this process, open `db` through `socket_uri` (a `serve_lite`'s, maybe another
    process's); None: open the file itself again."""
    if socket_uri is None:
        _served.pop(_lite_key(db), None)
    else:
        _served[_lite_key(db)] = socket_uri


def served_uri(uri: str | Path) -> str | None:
    """The socket to reach the Lite file `uri` through (`use_served_lite`); None: open it."""
    return None if is_server(uri) or not _served else _served.get(_lite_key(uri))


def held_elsewhere(db: Path) -> bool:
    """Whether another process holds Milvus Lite's lock on `db` (its `.NAME.lock` lockf).

    Asked before opening: a failed open makes milvus-lite 2.5.1 delete the holder's lock file
    (its failed server object cleans up on garbage collection). Never probes a file this process
    serves itself: closing the probe would drop our own POSIX lock and stop that server."""
    import fcntl

    try:
        from milvus_lite.server_manager import server_manager_instance
    except ImportError:
        return False
    if str(db.absolute().resolve()) in server_manager_instance._servers:
        return False
    lock = db.parent / f".{db.name}.lock"
    if not lock.exists():
        return False
    with open(lock, "a") as f:
        try:
            fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.lockf(f, fcntl.LOCK_UN)
    return False


def busy_error(uri: str) -> IndexBusy:
    return IndexBusy(f"milvus lite: {uri} is open in another process (a running ingest, search "
                     "or serve); Milvus Lite allows one process per file: wait for it to finish, "
                     "or use a Milvus server (milvus_uri)")
