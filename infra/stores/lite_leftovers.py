"""What a Milvus Lite server killed with its owner leaves in the temp folder, cleared by the
next owner of the same file.

`kill -9` of a process group that owns a Lite file gives neither the server nor its owner time
to clean up: the server's socket (`tmpXXXX_<file>.sock`, named by milvus_lite in the temp
folder) and, for a batch whose workers reach the server through the owner, the link folder
(`branchsearch-lite-XXXX/`, `milvus_lite.serve_lite`) stay behind. Each is recorded beside the
file's lock when it is made (`claim`); the next process that starts a server for the file (it
then holds the file's lock, so the recorded one's owner is dead) removes what the record names
when nothing listens there. Nothing else is touched: not another file's socket, not one in use.
A clean close forgets its record (`forget`).
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
from pathlib import Path

SOCKET = "sock-path"  # the record of the server's socket
LINK = "link-path"  # the record of the folder of the link a batch's workers connect through


def record(key: str, kind: str) -> Path:
    """The file beside an embedded file's (by `lite_key`) lock that names what of `kind` this
    process made for it last."""
    db = Path(key)
    return db.parent / f".{db.name}.{kind}"


def claim(key: str, kind: str, made: Path) -> None:
    """This process (holding the file's lock) made `made` for the file: what the record of
    `kind` names from a previous owner goes when nothing listens there, and the record names
    `made`. A record that cannot be written (a folder made read-only) leaves `made` to stay if
    this process is killed."""
    path = record(key, kind)
    try:
        left = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        left = ""
    if left and Path(left) != made:
        _remove_dead(kind, Path(left))
    try:
        path.write_text(f"{made}\n", encoding="utf-8")
    except OSError:
        pass


def forget(key: str, kind: str) -> None:
    """What the record of `kind` names went with a clean close: the record goes too."""
    record(key, kind).unlink(missing_ok=True)


def _remove_dead(kind: str, left: Path) -> None:
    if kind == SOCKET:
        if _nobody_listens(left, follow=False):
            left.unlink(missing_ok=True)
    elif (left.name.startswith("branchsearch-lite-") and left.is_dir()
          and _nobody_listens(left / "milvus.sock", follow=True)):
        shutil.rmtree(left, ignore_errors=True)


def _nobody_listens(path: Path, *, follow: bool) -> bool:
    """Whether `path` is a Unix socket nobody listens on (`follow`: a link to one, or a link
    whose socket is gone)."""
    try:
        mode = os.stat(path, follow_symlinks=follow).st_mode
    except FileNotFoundError:
        return follow and path.is_symlink()  # a link to a socket that went
    except OSError:
        return False
    if not stat.S_ISSOCK(mode):
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    finally:
        probe.close()
    return False
