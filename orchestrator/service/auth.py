"""API keys bound to ACL groups: the only source of a service caller's groups.

A key is shown once when it is made; the keys file stores only its SHA-256 (keys are 32 random
bytes, so a fast unsalted hash is enough: nothing to brute-force) with the key's name, groups,
allowed indexes and admin flag. The file is JSON, written atomically with mode 0600; a server
re-reads it when it changes, so `keys revoke` takes effect without a restart.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import os
import re
import secrets
import tempfile
import threading
import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from branchsearch.infra.errors import BranchsearchError, KeysFileError
from branchsearch.infra.stores.acl import MAX_GROUP_CHARS

PREFIX = "bsk_"
_NAME = re.compile(r"^[^\W_][\w.-]{0,63}$")  # letters and digits of any script, as groups
_GROUP = re.compile(rf"^[^\s,]{{1,{MAX_GROUP_CHARS}}}$")  # a group a document may hold too


@dataclass(frozen=True)
class ApiKey:
    """What a key grants. `indexes` empty means every index."""

    name: str
    groups: tuple[str, ...]
    indexes: tuple[str, ...] = ()
    admin: bool = False
    created: str = ""
    revoked: bool = False
    digest: str = field(default="", repr=False)

    def may_use(self, index: str) -> bool:
        return not self.indexes or index in self.indexes

    def public(self) -> dict:
        """The key as `keys list` and `/v1/whoami`-style answers show it (no digest).
        `all_indexes`: the key may use every index (its `indexes` list is then empty, which
        read alone looks like none)."""
        return {"name": self.name, "groups": list(self.groups), "indexes": list(self.indexes),
                "all_indexes": not self.indexes, "admin": self.admin, "created": self.created,
                "revoked": self.revoked}


class AuthError(Exception):
    """Missing, unknown or revoked key (HTTP 401); the message never echoes the key."""


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def parse_list(text: str | None) -> tuple[str, ...]:
    """`g1,g2` -> ('g1', 'g2'); blanks dropped, order kept, duplicates removed."""
    items = [p.strip() for p in (text or "").split(",") if p.strip()]
    for item in items:
        if not _GROUP.match(item):
            raise BranchsearchError(f"bad name {item!r} (no spaces or commas, ≤ 128 characters)")
    return tuple(dict.fromkeys(items))


class KeyStore:
    """The keys file. Thread-safe; re-reads the file when its mtime or size changes."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._stamp: tuple | None = None
        self._keys: dict[str, ApiKey] = {}  # name -> key

    # --- file ---------------------------------------------------------------------------------

    def _load(self, missing_ok: bool = True) -> dict[str, ApiKey]:
        """The keys; a missing file holds none (`keys add` makes it), unless not `missing_ok`
        (a server: its keys file gone is KeysFileError, a 503, not 401s for every key)."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            if not missing_ok:
                raise KeysFileError(f"keys file {self.path} is gone; put it back, or make one "
                                    "with `branchsearch keys add`") from None
            self._stamp, self._keys = None, {}
            return self._keys
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp != self._stamp:
            try:
                rows = json.loads(self._read() or "{}").get("keys", [])
                keys = {r["name"]: ApiKey(r["name"], _groups(r.get("groups", ())),
                                          tuple(r.get("indexes", ())), bool(r.get("admin")),
                                          r.get("created", ""), bool(r.get("revoked")),
                                          r["digest"]) for r in rows}
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise KeysFileError(f"keys file {self.path} is not valid ({exc}); "
                                        "fix it or make a new one with `branchsearch keys add`"
                                        ) from None
            self._stamp, self._keys = stamp, keys
        return self._keys

    def _read(self) -> str:
        try:
            return self.path.read_text()
        except (OSError, UnicodeDecodeError) as exc:  # a folder, no permission, not text
            raise KeysFileError(f"keys file {self.path} cannot be read ({exc}); give the keys "
                                "file (`branchsearch keys add` makes one)") from None

    def _target(self) -> Path:
        """The file a write replaces: a symlinked keys file's target (the link stays a link,
        and commands naming the link or the file lock the same lock file)."""
        return Path(os.path.realpath(self.path))

    @contextmanager
    def _changing(self) -> Iterator[dict[str, ApiKey]]:
        """The keys as the file holds them now, to change in place and write back, with every
        other writer held off: a thread of this process (the lock) and another `keys` command
        (an exclusive flock on KEYS.lock). Without it, a `keys add` running beside a `keys
        revoke` could write back the key the revoke had just revoked, still active."""
        target = self._target()
        lock_path = target.with_name(target.name + ".lock")
        with self._lock:
            self._load()  # a path through a file raises ENOTDIR here: the CLI's one line
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
            except OSError as exc:
                raise KeysFileError(f"keys file {self.path} cannot be written "
                                    f"({exc.strerror or exc}); nothing was changed") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                self._stamp = None  # read what the last writer wrote, whatever the mtime says
                keys = dict(self._load())
                yield keys
                self._save(keys)
            finally:
                os.close(fd)  # (closing releases the flock)

    def _save(self, keys: dict[str, ApiKey]) -> None:
        """Write the keys whole (a temporary file of its own renamed over the old), or raise
        KeysFileError with the file as it was."""
        data = {"keys": [asdict(k) | {"groups": list(k.groups), "indexes": list(k.indexes)}
                         for k in keys.values()]}
        target, tmp = self._target(), None
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp",
                                       dir=target.parent)  # mode 0600
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1)
            os.replace(tmp, target)
        except OSError as exc:  # a read-only home, a full disk
            try:
                if tmp is not None:
                    os.unlink(tmp)  # (a half-written one, if it got that far)
            except OSError:
                pass
            raise KeysFileError(f"keys file {self.path} cannot be written ({exc.strerror or exc}"
                                "); nothing was changed") from None
        self._stamp = None

    # --- commands -----------------------------------------------------------------------------

    def add(self, name: str, groups: tuple[str, ...], indexes: tuple[str, ...] = (),
            admin: bool = False, everything: bool = False) -> str:
        """Make a key; returns it (the only time it exists in clear). An admin key writes the
        documents of its own groups; `everything` (admins only) makes it global: it sees and
        writes every document, whatever its groups."""
        name = unicodedata.normalize("NFC", name)  # one name however it was typed
        if not _NAME.fullmatch(name):
            raise BranchsearchError(f"bad key name {name!r}: a letter or digit (any script), "
                                    "then letters, digits, _ . - (≤ 64 characters)")
        from branchsearch.infra.stores.acl import ACL_ALL, caller_groups

        groups = tuple(caller_groups(groups) or ())  # '*' is reserved; names stripped, NFC
        from branchsearch.infra.config.settings import index_name, index_name_problem

        indexes = [index_name(i) for i in indexes]
        for index in indexes:  # a name no index can have would allow nothing, silently
            problem = index_name_problem(index)
            if problem:
                raise BranchsearchError(f"--indexes: {problem}")
        if everything:
            if not admin:
                raise BranchsearchError("only an admin key can see every document (--admin "
                                        "--all-groups)")
            groups = (ACL_ALL,)
        from datetime import datetime, timezone

        with self._changing() as keys:
            if name in keys and not keys[name].revoked:
                raise BranchsearchError(f"key {name!r} exists; revoke it first or pick "
                                        "another name")
            key = PREFIX + secrets.token_urlsafe(32)
            keys[name] = ApiKey(name, tuple(groups), tuple(indexes), admin,
                                datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                False, digest(key))
        return key

    def revoke(self, name: str) -> None:
        name = unicodedata.normalize("NFC", name)  # as `add` stored it
        with self._changing() as keys:
            if name not in keys:
                raise BranchsearchError(f"no key named {name!r} in {self.path}")
            keys[name] = ApiKey(**{**asdict(keys[name]), "revoked": True})

    def check(self) -> None:
        """KeysFileError when a server could not take a key now: its keys file gone, not valid,
        or holding no key (an emptied file refuses every caller)."""
        with self._lock:
            if not self._load(missing_ok=False):
                raise KeysFileError(f"keys file {self.path} holds no key; make one with "
                                    "`branchsearch keys add`")

    def list(self) -> list[ApiKey]:
        with self._lock:
            return list(self._load().values())

    def authenticate(self, key: str | None) -> ApiKey:
        """The key's grant, or AuthError (missing, unknown, revoked)."""
        if not key:
            raise AuthError("missing API key: send 'Authorization: Bearer KEY'")
        wanted = digest(key)
        with self._lock:
            keys = self._load(missing_ok=False)
        for k in keys.values():
            if hmac.compare_digest(k.digest, wanted):
                if k.revoked:
                    raise AuthError(f"API key {k.name!r} was revoked")
                return k
        raise AuthError("unknown API key")


def bearer(header: str | None) -> str | None:
    """The key of an `Authorization: Bearer KEY` header (None when absent or another scheme)."""
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    return value.strip() or None if scheme.lower() == "bearer" else None


def _groups(names) -> tuple[str, ...]:
    """A key's groups as searches and writes compare them (stripped, NFC: a keys file written
    before names were normalised may hold an NFD `café`); `*` stays as it is."""
    from branchsearch.infra.stores.acl import ACL_ALL, group_name

    return tuple(g if g == ACL_ALL else group_name(g) for g in names)
