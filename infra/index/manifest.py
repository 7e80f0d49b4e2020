"""Index completeness: the manifest an ingest writes last, and the lock it holds while it runs.

An index is usable only when `manifest.json` exists. An ingest takes `ingest.lock` (an
exclusive `flock` on a file that names its PID), removes the manifest before it changes any
store, and writes a new one — counts per store, embedding model and dimension, encoding, time —
atomically (temporary file, fsync, rename) as its very last step; then it removes the lock. So:

* a killed ingest leaves no manifest: readers refuse the index and say which command finishes it;
* a running ingest holds the lock: a second ingest, or a reader, stops with one line naming it;
* a lock file whose `flock` nobody holds is stale (its process died): the next ingest takes it
  over and resumes.

`flock` is released by the kernel when its process dies (even by kill -9), so liveness never
depends on PID reuse. It is a local-filesystem lock: one index folder is ingested from one host.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from branchsearch.infra.errors import IndexBusy, IndexIncomplete, IndexNotFound, IndexNotWritable

MANIFEST = "manifest.json"
LOCK = "ingest.lock"
FORMAT = 1


@dataclass
class Manifest:
    """What a completed ingest committed. Written last; its presence means 'complete'."""

    documents: int
    chunks: dict[str, int]  # store -> chunk count: docstore, lexical, dense (when embedded)
    embedding: dict | None  # {"model": name, "dim": n}, None for a BM25-only index
    encoding: str
    chunk_tokens: int
    chunk_overlap: int
    backends: dict[str, str]  # lexical / dense -> "tantivy", "elasticsearch URL", "milvus URI"
    corpus: str = ""
    finished_at: str = ""
    seconds: dict[str, float] = field(default_factory=dict)
    format: int = FORMAT
    # what the index holds, as an id: new at each ingest that commits a document, kept by one
    # that commits none (`next_version`); a batch row names it, so a resume after documents
    # changed asks again what it answered before. "": a manifest written before versions.
    version: str = ""
    # which index this is, as an id: new when an ingest makes the index (a fresh folder, or
    # one with no manifest) or changes its layout, kept by ingests and service writes that
    # only change its documents (`index_id_for`). "": a manifest written before index ids.
    index_id: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    def layout(self) -> tuple:
        """What a reader opens the index by: its stores, its embedder and how it was chunked.
        An ingest that changes it (`--no-dense`, another encoding) changes the index under
        whoever has it open; one that only adds or replaces documents does not."""
        return (json.dumps(self.embedding, sort_keys=True), self.encoding, self.chunk_tokens,
                self.chunk_overlap, json.dumps(self.backends, sort_keys=True))


def next_version(previous: "Manifest | None", committed: int) -> str:
    """The `version` of an index an ingest has just filled: the previous one when it committed
    no document (the same text again changes no evidence), else a new one."""
    if previous is not None and previous.version and not committed:
        return previous.version
    return uuid.uuid4().hex[:16]


def index_id_for(previous: "Manifest | None", layout: tuple) -> str:
    """The `index_id` of an index an ingest has just filled with `layout`: the previous one
    when the index was complete and keeps its layout (documents added or replaced in place),
    else a new one (the index made anew, or an ingest resumed after one stopped unfinished:
    no manifest kept the id)."""
    if previous is not None and previous.index_id and previous.layout() == layout:
        return previous.index_id
    return uuid.uuid4().hex


def renew_version(index_dir: Path) -> None:
    """A new `version` for an index whose documents a write changed outside an ingest (the
    service's upsert and delete, holding the ingest lock); nothing for an index without a
    manifest (the write's own check refuses one)."""
    manifest = read_manifest(index_dir)
    if manifest is not None:
        manifest.version = next_version(None, 1)
        write_manifest(index_dir, manifest)


def manifest_path(index_dir: Path) -> Path:
    return Path(index_dir) / MANIFEST


def file_signature(path: Path) -> tuple | None:
    """(inode, size, mtime) of an index file, None when it is not there: a file rewritten
    (an ingest's manifest, tantivy's meta.json) signs differently."""
    try:
        st = Path(path).stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def read_manifest(index_dir: Path) -> Manifest | None:
    path = manifest_path(index_dir)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return None  # a torn or unreadable manifest is no manifest
    known = Manifest.__dataclass_fields__
    try:
        return Manifest(**{k: v for k, v in data.items() if k in known})
    except TypeError:
        return None


def identity(index_dir: Path) -> tuple | None:
    """What a reader's open files stay good for: the index's folder (its inode: a folder
    removed and made again is another index), its `index_id` (an index made anew has another,
    even in a folder that reuses a freed inode; "" in manifests written before ids) and its
    layout (`Manifest.layout`: an ingest that changes it changes the index under its readers).
    Documents added, replaced or deleted in place (an ingest, a service write: a new
    `version`) keep it. None: no complete index there. A reader that compares identities over
    time holds the folder open (`hold`), so its inode cannot be reused while it reads."""
    manifest = read_manifest(index_dir)
    if manifest is None:
        return None
    try:
        folder = Path(index_dir).stat().st_ino
    except OSError:
        return None
    return folder, manifest.index_id, manifest.layout()


def hold(index_dir: Path) -> int | None:
    """An open descriptor of the index's folder, kept by a reader for as long as it reads: a
    removed folder's inode stays taken meanwhile, so a folder made in its place (restored by
    `cp -a` from a backup, made by an ingest) has another and `identity` tells them apart.
    None when the folder cannot be opened (`identity` says so then)."""
    try:
        return os.open(index_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None


def changed_since(index_dir: Path, name: str, opened: tuple | None) -> str:
    """Why the index at `index_dir` is no longer the one a reader opened (`opened`: its
    `identity` then), or "": its folder removed, its manifest gone (being ingested again) or
    the index made anew. A new `version` alone is not such a change: a reader goes on, and
    whatever it wrote carries the version it began with."""
    now = identity(index_dir)
    if now is None:
        return f"index {name!r} was removed, or is being ingested, while this batch read it"
    if now != opened:
        return f"index {name!r} was made anew while this batch read it"
    return ""


def write_manifest(index_dir: Path, manifest: Manifest) -> None:
    """Atomically replace the manifest (write a temporary file, fsync, rename, fsync the dir)."""
    index_dir = Path(index_dir)
    manifest.finished_at = manifest.finished_at or time.strftime("%Y-%m-%dT%H:%M:%S%z")
    tmp = index_dir / f".{MANIFEST}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(manifest.to_dict(), f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, manifest_path(index_dir))
    _fsync_dir(index_dir)


def ingested_as(index_dir: Path, manifest: Manifest) -> str | None:
    """The name an index was ingested under when its folder has been copied or renamed since,
    else None. Its Milvus Lite file names the collection after that name (`chunks_<index>`), so
    under the new name the vectors are not found: readers would call it damaged and an ingest
    would fill a second, empty collection. Known from the Lite file's recorded path; an index
    whose vectors are on a server records no folder."""
    kind, _, rest = str((manifest.backends or {}).get("dense", "")).partition(" ")
    lite = Path(rest.rpartition(" (")[0] or rest)  # "<path> (<vector index>)"; the path may hold " ("
    if (kind != "milvus-lite" or lite.name != "dense.db" or lite.parent.parent.name != "indexes"
            or not (Path(index_dir) / "dense.db").exists()):
        return None  # not a folder carrying its own Lite file (`milvus_uri` may name another's)
    from branchsearch.infra.stores.milvus import collection_for

    old = lite.parent.name
    return old if old and collection_for(old) != collection_for(Path(index_dir).name) else None


def check_name(index_dir: Path, index: str, manifest: Manifest) -> None:
    """One clear error for an index folder copied or renamed since its ingest (`ingested_as`)."""
    old = ingested_as(index_dir, manifest)
    if old is not None:
        raise IndexIncomplete(
            f"index {index!r} was ingested as {old!r} and its folder copied or renamed since; "
            f"its vectors are stored under that name: rename the folder back to {old!r}, or "
            f"ingest the corpus into a new index")


def remove_manifest(index_dir: Path) -> None:
    """Mark the index incomplete (the first thing an ingest does before touching a store)."""
    try:
        manifest_path(index_dir).unlink()
    except FileNotFoundError:
        return
    _fsync_dir(Path(index_dir))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- the ingest lock ---------------------------------------------------------------------------

@dataclass
class LockInfo:
    pid: int
    host: str
    started: str
    corpus: str

    def describe(self) -> str:
        where = "" if self.host == socket.gethostname() else f" on {self.host}"
        return f"PID {self.pid}{where}, started {self.started}, corpus {self.corpus}"


def _read_info(path: Path) -> LockInfo | None:
    try:
        data = json.loads(path.read_text() or "{}")
        return LockInfo(int(data["pid"]), str(data["host"]), str(data["started"]),
                        str(data.get("corpus", "")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


SERVICE_WRITE = "service write"  # the `corpus` of the lock a service's document write holds


class IngestLock:
    """The exclusive right to ingest into one index folder, held for the life of a process.

    `acquire()` raises IndexBusy naming the running ingest; `stale` tells whether a dead
    ingest left the lock behind (its index is then incomplete and this ingest resumes it).
    """

    def __init__(self, index_dir: Path, index: str, corpus: str = ""):
        self.index_dir = Path(index_dir)
        self.index = index
        self.corpus = corpus
        self.path = self.index_dir / LOCK
        self.stale: LockInfo | None = None
        self._fd: int | None = None

    def acquire(self) -> "IngestLock":
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                info = _read_info(self.path)
                running = info.describe() if info else "another process"
                raise IndexBusy(
                    f"index {self.index!r} is being ingested by {running}; wait for it to "
                    f"finish (or stop that process) and run this again") from None
            try:  # the holder may have removed the file between our open and flock: retry
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self.stale = _read_info(self.path)
        info = LockInfo(os.getpid(), socket.gethostname(),
                        time.strftime("%Y-%m-%d %H:%M:%S"), self.corpus)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(asdict(info)).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def _open(self) -> int:
        try:
            self.index_dir.mkdir(parents=True, exist_ok=True)
            return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise IndexNotWritable(
                f"index {self.index!r}: cannot write its folder {self.index_dir} "
                f"({exc.strerror or exc}); an ingest needs write access to it") from None

    def release(self) -> None:
        """Remove the lock file, then drop the flock (in that order: see `acquire`'s retry)."""
        if self._fd is None:
            return
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "IngestLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def running_ingest(index_dir: Path) -> LockInfo | None:
    """The live ingest holding this index's lock, or None (no lock, or a stale one)."""
    path = Path(index_dir) / LOCK
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_info(path) or LockInfo(0, "?", "?", "?")
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def stale_ingest(index_dir: Path) -> LockInfo | None:
    """The ingest that died holding this index's lock (its file is left, its flock is not)."""
    if running_ingest(index_dir) is not None:
        return None
    return _read_info(Path(index_dir) / LOCK)


def require_complete(index_dir: Path, index: str, home: Path | str = "") -> Manifest:
    """The manifest of a complete index that no ingest is writing, else one clear error."""
    index_dir = Path(index_dir)
    run = f"branchsearch ingest PATH --index {index}" + (f" --home {home}" if home else "")
    _not_busy(index_dir, index)
    manifest = read_manifest(index_dir)
    if manifest is not None:
        check_name(index_dir, index, manifest)
        return manifest
    _not_busy(index_dir, index)  # an ingest that started after the first look took it away
    manifest = read_manifest(index_dir)  # ... or has finished since
    if manifest is not None:
        check_name(index_dir, index, manifest)
        return manifest
    dead = stale_ingest(index_dir)
    if dead is not None:
        corpus = dead.corpus or "PATH"
        raise IndexIncomplete(
            f"index {index!r} is incomplete: its ingest ({dead.describe()}) stopped before it "
            f"finished; run `branchsearch ingest {corpus} --index {index}"
            + (f" --home {home}" if home else "") + "` to complete it")
    if not (index_dir / "docs.sqlite").exists():
        raise IndexNotFound(f"index {index!r} not found under {home or index_dir.parent.parent} "
                            f"(run `{run}` first)")
    raise IndexIncomplete(
        f"index {index!r} has no manifest: its ingest never finished (or it was built before "
        f"manifests); run `{run}` to complete it")


def _not_busy(index_dir: Path, index: str) -> None:
    """IndexBusy while an ingest writes the index. A service's document write holds the same
    lock (`SERVICE_WRITE`) but leaves a complete index to read: its searches go on meanwhile,
    and its retriever actor, which makes the write, must open the index even when Ray
    restarts it under that write (refused, it would die for good, the write waiting on it)."""
    live = running_ingest(index_dir)
    if live is not None and live.corpus != SERVICE_WRITE:
        raise IndexBusy(f"index {index!r} is being ingested right now ({live.describe()}); "
                        f"wait for that ingest to finish, then run this again")


def is_complete(index_dir: Path) -> bool:
    """A manifest and no ingest running (what `eval` and `demo` check before trusting it)."""
    return running_ingest(index_dir) is None and read_manifest(index_dir) is not None
