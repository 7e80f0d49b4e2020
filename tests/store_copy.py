"""Copies of index folders and data homes that leave the test process's own SQLite locks alone.

POSIX record locks belong to a process and a file: closing any descriptor of a file drops every
lock that process holds on it. The pytest process keeps files of the session's shared home
open — the docstore and the embedding cache (SQLite, the cache in WAL mode) and the Milvus Lite
file's lock — so a plain copy made in it (`shutil.copy`, `copytree`, even reading a file's
first bytes) opens and closes them: another process, seeing itself the last connection, may
then checkpoint and delete a WAL under this one's connection (a shared embedding cache lost so
in CI), or Milvus Lite may lose its file. So `copy_store` copies in a child process, which
holds nothing: each SQLite file (by its header, `SQLite format 3\\0`: the docstore, the
embedding cache and the Milvus Lite data file `dense.db` all are) through SQLite's backup API,
a consistent copy that holds what its WAL holds too, its `-wal`, `-shm` and `-journal` files
left out; every other file as it is.

    python tests/store_copy.py SRC DST [IGNORE_GLOB ...]   # what the child runs
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Iterable
from contextlib import closing
from pathlib import Path

SQLITE_MAGIC = b"SQLite format 3\x00"
_BESIDE = ("-wal", "-shm", "-journal")  # SQLite's files beside a database; its backup holds them


def copy_store(src: str | os.PathLike, dst: str | os.PathLike, ignore: Iterable[str] = ()
               ) -> None:
    """Copy the file or folder `src` to `dst` (a folder's whole tree, its parents made; names
    matching a glob of `ignore` left out, as `shutil.ignore_patterns`), in a child process:
    SQLite files through the backup API, the rest as they are (see the module's docstring)."""
    done = subprocess.run([sys.executable, __file__, str(src), str(dst), *ignore],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"copying {src} to {dst}: {done.stderr[-2000:]}"


def is_sqlite(path: Path) -> bool:
    """Whether `path` is a SQLite database, by its first 16 bytes (opens the file: only in the
    copying child)."""
    with path.open("rb") as f:
        return f.read(len(SQLITE_MAGIC)) == SQLITE_MAGIC


def _copy_file(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if not is_sqlite(src):
        shutil.copy2(src, dst)
        return
    dst.unlink(missing_ok=True)
    with closing(sqlite3.connect(src)) as source, closing(sqlite3.connect(dst)) as copy:
        source.backup(copy)


def _copy_tree(src: Path, dst: Path, ignore: tuple[str, ...]) -> None:
    skip = shutil.ignore_patterns(*ignore)
    dst.mkdir(parents=True, exist_ok=True)
    for root, dirs, files in os.walk(src):
        here, there = Path(root), dst / Path(root).relative_to(src)
        left_out = skip(root, dirs + files)
        dirs[:] = [d for d in dirs if d not in left_out]
        there.mkdir(parents=True, exist_ok=True)
        files = [f for f in files if f not in left_out]
        databases = {f for f in files if is_sqlite(here / f)}
        for name in files:
            if not any(name == db + end for db in databases for end in _BESIDE):
                _copy_file(here / name, there / name)


def main(argv: list[str]) -> None:
    src, dst, ignore = Path(argv[0]), Path(argv[1]), tuple(argv[2:])
    if src.is_dir():
        _copy_tree(src, dst, ignore)
    else:
        _copy_file(src, dst)


if __name__ == "__main__":
    main(sys.argv[1:])
