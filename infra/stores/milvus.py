"""Dense store on Milvus through pymilvus: an embedded Milvus Lite file, or a server by URI.

One collection per index: chunk id (primary key), doc id, ACL groups (array), `acl_key` (the
document's group set as one key, see `acl_key`), vector. A search's cost must not grow with the
rows a filter looks at, so neither filter is evaluated row by row on the array:

* ACL: the caller's groups become `acl_key in [the keys of the group sets it may see]` (public
  callers: `acl_key == "public"`; an admin: no filter). On a server `acl_key` is the partition
  key, so Milvus searches only the partitions those keys hash to, and has a scalar index, so
  the filter is a lookup rather than a comparison per row. The group sets an index holds
  are kept in a small side collection (`acl_sets_collection`), written before the rows that use
  them; this process reads it once, when a caller with groups first searches, and again when
  it is older than `ACL_SETS_REFRESH_S` (a set written by another process in the meantime is
  not yet searched: a new restricted document can show late, never to the wrong caller). A
  collection made before `acl_key` existed keeps the per-row array filter (re-ingest it into a
  fresh collection for the flat cost).
* Exclusions (chunks the agent has seen): not a filter. The search asks for `k + len(exclude)`
  and drops them here, which leaves the same top `k` (exact indexes; see `search`).

Milvus Lite allows one process per file: the
retriever actor that owns this store is its only user, and a second process gets one clear error
naming the file (`infra.stores.milvus_lite` keeps that ownership). Milvus Lite indexes FLAT (exact); a server takes the index from settings (HNSW
by default, or IVF_FLAT, or FLAT) — see `IndexSpec`. Collections use Strong consistency, so a
search sees every write that returned before it (what an ingest followed by a search expects).

Every request goes through `milvus_call`, with a timeout (the settings' `backend_timeout_s`): a
Milvus that stops answering (a server gone) is a `BackendUnavailable` within it, which ends the
branch with status `error`, never a search that hangs. A Milvus Lite process of this one that
died (killed, crashed) is started again on the same file by the next request (`revive_lite`),
or by the watchdog of a process that serves it to others (`serve_lite`). A reader opens with
`create=False`: a collection that is not there is a damaged index (`IndexIncomplete`), not an
empty one.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import threading
import time
import unicodedata
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from branchsearch.infra.errors import (BackendUnavailable, BadQuery, IndexIncomplete,
                                       IndexNameTaken, redact)
from branchsearch.infra.stores.hits import Hit
from branchsearch.infra.stores.milvus_lite import (acquire_lite, busy_error, drop_lite,
                                                  generation, held_elsewhere, is_server,
                                                  lite_down, lite_key, lite_spawn,
                                                  log_lite_under, release_lite, revive_lite,
                                                  served_uri)
from branchsearch.infra.stores.protocols import MAX_K, IndexedChunk, settled
from branchsearch.infra.stores.acl import MAX_DOC_GROUPS, PUBLIC, acl_terms

COLLECTION = "chunks"
ACL_KEY_PUBLIC = "public"  # the `acl_key` of every document any caller sees
ACL_KEY_LIST_MAX = 1000  # more visible group sets than this: the per-row array filter instead
ACL_SETS_REFRESH_S = 2.0  # how old this process's copy of an index's group sets may get
_MILVUS_SAFE = re.compile(r"[A-Za-z0-9_-]+", re.ASCII)
OWNER_NOTE = "branchsearch index: "  # + the index's name: an owned collection's description


def collection_for(index: str) -> str:
    """The Milvus collection of an owned index (Lite file or server); the one place that names
    it. Milvus allows only ASCII letters, digits and '_' in a collection name. An ASCII index
    name keeps `chunks_<index>` with '-' written '_', the name its collection always had: 'a-b'
    and 'a_b' map to one, so a collection records the index it holds (`OWNER_NOTE`) and
    `MilvusStore` refuses it to any other (`IndexNameTaken`). Any other name (an index may be
    named in any script) is
    `uchunks_<the ASCII letters and digits of its NFKD form>_<12 hex of its SHA-256>`: no ASCII
    name maps there (another prefix), and the hash keeps apart names that fold alike
    ('café' and 'cafè' are `uchunks_cafe_…` with different hashes)."""
    if _MILVUS_SAFE.fullmatch(index):
        return f"{COLLECTION}_{index}".replace("-", "_")
    digest = hashlib.sha256(index.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    folded = unicodedata.normalize("NFKD", index).encode("ascii", "ignore").decode()
    slug = "_".join(re.findall(r"[A-Za-z0-9]+", folded))[:64]
    return f"u{COLLECTION}_{slug}_{digest}" if slug else f"u{COLLECTION}_{digest}"


def acl_sets_collection(collection: str) -> str:
    """The side collection holding the group sets (`acl_key` -> groups) of `collection`. No
    `collection_for` name starts with `aclsets_`, so it is never an index's own collection."""
    return f"aclsets_{collection}"


def acl_key(terms: Sequence[str]) -> str:
    """The `acl_key` of a document whose ACL index terms (`IndexedChunk.acl_terms`) are `terms`:
    `ACL_KEY_PUBLIC` when every caller sees it (no ACL, or `PUBLIC` among its groups), else
    `g` + 32 hex of the SHA-256 of its sorted, distinct groups. ASCII whatever the group names
    (no literal to escape), one key per set however the ACL listed it."""
    groups = sorted(set(terms))
    if not groups or PUBLIC in groups:
        return ACL_KEY_PUBLIC
    canon = "\x1f".join(groups).encode("utf-8", "surrogatepass")
    return "g" + hashlib.sha256(canon).hexdigest()[:32]


def quiet_pymilvus() -> None:
    """pymilvus logs every failed request at ERROR before raising it; our stores raise it as one
    `BackendUnavailable` line, so those log lines would only say it twice (and break the CLI's
    one `error:` line). Called after pymilvus is imported: its import resets its loggers."""
    # _utils logs the URI of a failed connection, password and all
    for name in ("pymilvus.decorators", "pymilvus.milvus_client.milvus_client",
                 "pymilvus.milvus_client._utils"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def milvus_error(exc: BaseException) -> str:
    """A pymilvus or gRPC error in one short line: the server's message (a `MilvusException`'s
    `message`, a gRPC error's code and details), not the reprs of its bound methods."""
    if hasattr(exc, "details") and callable(exc.details):
        try:
            code = exc.code()
            why = f"{getattr(code, 'name', code)}: {exc.details()}"
        except Exception:  # noqa: BLE001 — fall back to the text
            why = str(exc)
    else:
        why = str(getattr(exc, "message", "") or exc)
    return f"{type(exc).__name__}: {' '.join(why.split())[:300]}"


def milvus_call(uri: str, what: str, call, *args, timeout_s: float, lite: str | None = None,
                **kwargs):
    """One request to Milvus at `uri` (`call(*args, **kwargs)` of a `MilvusClient`) with a
    timeout; any failure is one `BackendUnavailable` line naming the place and the request.
    `lite`: the file's `lite_key`, so that a dead Lite process fails at once."""
    down = lite_down(lite)
    if down is not None:
        raise BackendUnavailable(f"milvus lite: the server process for {uri} {down}; {what} "
                                 "failed")
    server = is_server(uri)
    if server and (failed := _unreachable_since(uri)):
        raise BackendUnavailable(f"{failed} (not asked again for {UNREACHABLE_S:g} s)")
    try:
        out = call(*args, timeout=timeout_arg(timeout_s), **kwargs)
    except Exception as exc:  # noqa: BLE001 — pymilvus and grpc errors alike
        line = f"milvus at {redact(uri)}: {what} failed ({milvus_error(exc)})"
        if server and _UNREACHABLE.search(line):
            with _unreachable_lock:
                _unreachable[uri] = (time.monotonic(), line)
        raise BackendUnavailable(line) from None
    if server and uri in _unreachable:
        with _unreachable_lock:
            _unreachable.pop(uri, None)
    return out


# A Milvus server that cannot be reached makes each request wait out its timeout (pymilvus
# retries until then: seconds, with the branch pool and the caller waiting). Once one request
# found it unreachable, the others of this process fail at once for UNREACHABLE_S; after that
# requests go to it again. Only a failed connection counts: a slow answer (a timeout under
# load, a large upsert), a bad filter or a missing collection is not an outage.
UNREACHABLE_S = 5.0
_UNREACHABLE = re.compile(r"(?i)fail(?:ed)? (?:connecting|to connect)|connection refused|"
                          r"\bunavailable\b|connect(?:ion)? (?:reset|closed)")
_unreachable: dict[str, tuple[float, str]] = {}  # server URI -> (when, the error line)
_unreachable_lock = threading.Lock()


def _unreachable_since(uri: str) -> str:
    """The error line of the server's last failed request when it was under UNREACHABLE_S
    ago; "" otherwise."""
    failed = _unreachable.get(uri)
    if failed is None or time.monotonic() - failed[0] >= UNREACHABLE_S:
        return ""
    return failed[1]


def milvus_literal(value: str, *, lite: bool) -> str:
    r"""`value` as a string literal of a Milvus filter expression that Milvus reads back as
    exactly `value`; `lite`: for Milvus Lite (an embedded file), else for a server.

    Characters are written as themselves (é, і, 😀, control characters, U+2028 …), and `\` and
    `"` after a backslash: the one form both parsers read alike. JSON's `\uXXXX` is not: Milvus
    Lite's parser keeps only the character after a backslash (`\u00e9` reads `u00e9`), and a
    server reads an emoji's surrogate pair as two U+FFFD. A literal may hold no raw line break,
    and there the two differ: a server (Go's `strconv.Unquote`) reads `\n` and `\r`; Milvus Lite
    reads a backslash before the line break itself (LF or CR LF) and has no form for a carriage
    return without a line feed after it, so such a value is refused for Lite (`BadQuery`), as is
    a string that is not valid Unicode (a lone surrogate) everywhere."""
    if not isinstance(value, str):
        raise TypeError(f"a Milvus filter literal needs a str, not {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BadQuery(f"{value!r} is not valid Unicode (it holds a lone surrogate)") from None
    text = value.replace("\\", "\\\\").replace('"', '\\"')
    if not lite:
        return '"' + text.replace("\n", "\\n").replace("\r", "\\r") + '"'
    if _LONE_CR.search(text):
        raise BadQuery(f"{value!r}: Milvus Lite cannot filter on a value holding a carriage "
                       "return (CR) without a line feed after it")
    return '"' + _LINE_BREAK.sub(lambda m: "\\" + m.group(0), text) + '"'


_LONE_CR = re.compile(r"\r(?!\n)")
_LINE_BREAK = re.compile(r"\r?\n")


def milvus_list(values: Sequence[str], *, lite: bool) -> str:
    """`values` as a Milvus filter list, `[…]`, of `milvus_literal`s."""
    return "[" + ", ".join(milvus_literal(v, lite=lite) for v in values) + "]"


# Milvus Lite keeps rows in SQLite and writes primary keys into its SQL between single quotes,
# unescaped (its `CollectionData::Delete`): a key holding `'` or NUL fails every upsert and
# delete of its row, and a crafted one is SQL. An owned store's keys are chunk ids,
# "{doc_id}#p{n}", and a document id holds no '#', so on Lite those two characters are stored
# as `#q` and `#0`, which no chunk id holds, and read back.
_LITE_OUT = {"'": "#q", "\x00": "#0"}
_LITE_IN = {v: k for k, v in _LITE_OUT.items()}
_LITE_KEY = re.compile("['\x00]")
_LITE_BACK = re.compile("#[q0]")


MILVUS_PORT = 19530  # a server URI without a port


def server_answers(uri: str, timeout_s: float) -> None:
    """Raise `BackendUnavailable` unless the Milvus server at `uri` accepts a TCP connection
    within `timeout_s`: a refused address fails at once, where the client waits out its whole
    timeout for the channel to be ready (30 s by default)."""
    import socket
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(uri)
        with socket.create_connection((parts.hostname or "localhost",
                                       parts.port or MILVUS_PORT), timeout=timeout_s):
            pass
    except (OSError, ValueError) as exc:
        raise BackendUnavailable(f"milvus at {redact(uri)} is not answering "
                                 f"({type(exc).__name__})") from None


# the fix for an index that holds no vectors on a server yet (a new one); an index ingested
# into one is told otherwise (`infra.index.open.server_hint`)
SERVER_HINT = "start Milvus there or unset milvus_uri for the embedded file"


def refused_server(uri: str, timeout_s: float, hint: str = SERVER_HINT) -> None:
    """`server_answers` for an owned index's server, its error line ending with the fix."""
    try:
        server_answers(uri, timeout_s)
    except BackendUnavailable as exc:
        raise BackendUnavailable(f"{exc}; {hint}") from None


def timeout_arg(seconds: float) -> int:
    """A request timeout as pymilvus needs it: whole seconds (at least 1). pymilvus 2.5 bounds
    its retries by `timeout` only when it is an int; a float means 75 retries, minutes on a
    server that is gone."""
    return max(1, math.ceil(seconds))


# (uri, collection) -> the group sets this process knows it holds, {acl_key: groups}, and when
# they were last read; shared by this process's stores on it, so a write is seen at once
_acl_sets: dict[tuple[str, str], dict[str, tuple[str, ...]]] = {}
_acl_sets_read: dict[tuple[str, str], float] = {}
_acl_sets_lock = threading.Lock()


@dataclass(frozen=True)
class IndexSpec:
    """The vector index of a collection and its search parameters.

    `kind`: FLAT (exact), HNSW (graph; `m`, `ef_construction`; searched with `ef`) or IVF_FLAT
    (`nlist`; searched with `nprobe`). Milvus Lite supports FLAT only, so `auto` means FLAT on a
    file and HNSW on a server.
    """

    kind: str = "auto"
    m: int = 16
    ef_construction: int = 200
    ef: int = 64
    nlist: int = 1024
    nprobe: int = 16
    # searches on a server: Strong waits for the server's time tick (~200+ ms a search, measured
    # in bench/milvus_scaling.py); Bounded sees writes older than the server's graceful time
    # (5 s by default). Counts after an ingest always use Strong.
    consistency: str = "Bounded"
    extra: dict = field(default_factory=dict, compare=False)

    def resolved(self, server: bool) -> str:
        kind = self.kind.upper()
        if kind == "AUTO":
            return "HNSW" if server else "FLAT"
        return kind if server else "FLAT"

    def build_params(self, kind: str) -> dict:
        if kind == "HNSW":
            return {"M": self.m, "efConstruction": self.ef_construction}
        if kind == "IVF_FLAT":
            return {"nlist": self.nlist}
        return {}

    def search_params(self, kind: str, k: int) -> dict:
        if kind == "HNSW":
            return {"ef": max(self.ef, k)}
        if kind == "IVF_FLAT":
            return {"nprobe": self.nprobe}
        return {}


def recorded_owner(description: str) -> str | None:
    """The index a collection's description (`OWNER_NOTE`) says it holds; None for one made
    before collections recorded it (or by another program)."""
    return description[len(OWNER_NOTE):] if description.startswith(OWNER_NOTE) else None


class MilvusStore:
    """`owner`: the owned index this collection holds (None: no owner checked or recorded). A
    collection it creates records it in its description; one that records another index is
    refused (`IndexNameTaken`), as is one made before collections recorded their index that
    holds rows when the owner is `fresh` (holds no chunks yet: they are another index's).
    `hint`: the fix a server that cannot be reached is told with. `logs`: the folder a Milvus
    Lite server started for the file writes its glog files in (None: glog's default, /tmp)."""

    def __init__(self, uri: str | Path, dim: int, *, token: str = "", collection: str = COLLECTION,
                 index: IndexSpec | None = None, create: bool = True, timeout_s: float = 30.0,
                 owner: str | None = None, fresh: bool = False, hint: str = SERVER_HINT,
                 logs: Path | None = None):
        self.uri = str(uri)
        self.hint = hint  # what a server's error line ends with
        self.timeout_s = timeout_s
        self._lite = lite_key(self.uri)
        log_lite_under(self._lite, logs)
        self.dim = dim
        self.collection = collection
        self.server = is_server(self.uri)
        self.index = index or IndexSpec()
        if self.server:  # a refused address fails now, not after the client's channel timeout
            refused_server(self.uri, timeout_s, hint)
        else:
            Path(self.uri).parent.mkdir(parents=True, exist_ok=True)
        served = served_uri(self.uri)
        self._served = served is not None  # through the owning process's server (serve_lite)
        if not self.server and not served and held_elsewhere(Path(self.uri)):
            raise busy_error(self.uri)
        self._token = token
        self._owns_lite = self._lite is not None and not self._served  # its server is ours
        if self._owns_lite and lite_down(self._lite) is not None:
            revive_lite(self._lite)  # its server died while another store of ours held it
        self._generation = generation(self._lite)  # of the Lite server it reaches
        self._reconnect_lock = threading.Lock()
        self._client = self._connect(served or self.uri)
        if not self._served:
            acquire_lite(self.uri)
        self.owner = owner
        try:
            exists = self._request("open", "has_collection", collection)
            if not exists and not create:
                raise IndexIncomplete(f"milvus: collection {collection!r} is not in "
                                      f"{redact(self.uri)}")
            if exists and owner is not None:
                self._check_owner(fresh)
        except BaseException:
            self.close()  # a refused open must not keep the Lite file from other processes
            raise
        if not exists:
            self._create()
        self.index_kind = self._index_kind()
        self.sets_collection = acl_sets_collection(collection)
        self._sets_id = (self._lite or self.uri, collection)
        # rows carry `acl_key` when the collection has the field (one made before it has not);
        # searches filter on it when the side collection of group sets is there too (made with
        # it; without it the sets are unknown: the array filter)
        key = self._field("acl_key")
        self.has_key = key is not None
        # Milvus 2.3.5 upserts every row of a partition-key collection into the wrong partition
        # (measured: a filter on the key then finds 3 of 240 rows); insert hashes it right
        self.partitioned = bool(key and key.get("is_partition_key"))
        self.keyed = self.has_key and self._request("open", "has_collection",
                                                    self.sets_collection)

    def _connect(self, uri: str):
        from pymilvus import MilvusClient

        quiet_pymilvus()
        quiet = logging.getLogger("pymilvus.milvus_client._utils")
        level = quiet.level
        quiet.setLevel(logging.CRITICAL)  # it logs a line of its own before raising
        try:
            # an alias of its own: pymilvus shares a connection per (uri, token) otherwise, and
            # closing one store would cut every other store of this process on that server
            with lite_spawn(self._lite if self._owns_lite else None):
                return MilvusClient(uri=uri, token=self._token,
                                    alias=f"branchsearch-{uuid.uuid4().hex}")
        except Exception as exc:
            if not self.server and "opened by another program" in str(exc):
                raise busy_error(self.uri) from None
            hint = self.hint if self.server else "check the index folder"
            raise BackendUnavailable(redact(  # no credentials in a line shown and logged
                f"milvus: cannot open {self.uri} ({type(exc).__name__}: {exc}); {hint}")) from None
        finally:
            quiet.setLevel(level)

    def _request(self, what: str, method: str, *args, **kwargs):
        """`self._client.<method>(*args, **kwargs)` as one `milvus_call`. A Milvus Lite process
        of ours that died since the last request (killed, crashed) is started again on the same
        file first (`revive_lite`), and the client reconnected: a long-running service recovers
        on its next request instead of failing every one until it is restarted."""
        if self._owns_lite and (lite_down(self._lite) is not None
                                or self._generation != generation(self._lite)):
            self._reconnect()
        return milvus_call(self.uri, what, getattr(self._client, method), *args,
                           timeout_s=self.timeout_s, lite=self._lite if self._owns_lite else None,
                           **kwargs)

    def _reconnect(self) -> None:
        with self._reconnect_lock:
            if (lite_down(self._lite) is None
                    and self._generation == generation(self._lite)):
                return  # another thread of this store did it meanwhile
            started = revive_lite(self._lite)
            try:
                client = self._connect(self.uri)
            except BaseException:
                drop_lite(self._lite)  # started but not answering: the next request retries
                raise
            old, self._client, self._generation = self._client, client, started
        try:
            old.close()
        except Exception:  # noqa: BLE001 — its server is gone; nothing to close cleanly
            pass

    def _check_owner(self, fresh: bool) -> None:
        """Refuse the collection when it holds another index than `self.owner` (see the class)."""
        info = self._request("open", "describe_collection", self.collection) or {}
        recorded = recorded_owner(str(info.get("description") or ""))
        fix = "use another index name"
        if recorded is not None:
            if recorded == self.owner:
                return
            holder = f"index {recorded!r} ('-' and '_' are one in a collection name)"
        elif fresh and (rows := self.count()):
            holder = (f"{rows:,} vectors of an index made before collections named theirs (one "
                      "whose name differs only in '-' and '_', or this name under another data "
                      "home or a removed folder)")
            fix += ", or drop that collection if no index uses it"
        else:
            return  # made before collections named their index, by this one
        raise IndexNameTaken(f"index {self.owner!r} cannot use Milvus collection "
                             f"{self.collection!r} in {redact(self.uri)}: it holds {holder}; "
                             f"{fix}")

    def _list(self, values: Sequence[str]) -> str:
        return milvus_list(values, lite=not self.server)

    def _key(self, chunk_id: str) -> str:
        """The primary key a chunk is stored under: its id, on Milvus Lite with `'` and NUL
        written as `#q` and `#0` (see `_LITE_OUT`)."""
        return chunk_id if self.server else _LITE_KEY.sub(lambda m: _LITE_OUT[m[0]], chunk_id)

    def _chunk_id(self, key: str) -> str:
        return key if self.server else _LITE_BACK.sub(lambda m: _LITE_IN[m[0]], key)

    def _create(self) -> None:
        from pymilvus import DataType

        schema = self._client.create_schema(
            auto_id=False, enable_dynamic_field=False,
            description="" if self.owner is None else OWNER_NOTE + self.owner)
        schema.add_field("chunk_id", DataType.VARCHAR, is_primary=True, max_length=1024)
        schema.add_field("doc_id", DataType.VARCHAR, max_length=1024)
        schema.add_field("acl", DataType.ARRAY, element_type=DataType.VARCHAR,
                         max_capacity=MAX_DOC_GROUPS, max_length=256)
        # the partition key on a server (Milvus Lite 2.5.1 takes `is_partition_key` but then
        # refuses every filter on the field: "Invalid expr"), a plain field on Lite
        schema.add_field("acl_key", DataType.VARCHAR, max_length=64,
                         is_partition_key=self.server)
        schema.add_field("vector", DataType.FLOAT_VECTOR, dim=self.dim)
        kind = self.index.resolved(self.server)
        index = self._client.prepare_index_params()
        index.add_index(field_name="vector", index_type=kind, metric_type="IP",
                        params=self.index.build_params(kind))
        if self.server:  # the ACL filter read from a scalar index, not compared row by row
            index.add_index(field_name="acl_key", index_type="")  # (the server's default kind)
        self._create_sets()  # before the rows: a group set is listed before it is used
        self._request("create", "create_collection", self.collection,
                      schema=schema, index_params=index, consistency_level="Strong")

    def _create_sets(self) -> None:
        """The side collection of group sets (Milvus needs a vector in every collection: a
        2-d zero one)."""
        from pymilvus import DataType

        name = acl_sets_collection(self.collection)
        if self._request("create", "has_collection", name):
            return  # left by a collection dropped elsewhere: its sets only lengthen a filter
        schema = self._client.create_schema(auto_id=False, enable_dynamic_field=False)
        schema.add_field("acl_key", DataType.VARCHAR, is_primary=True, max_length=64)
        schema.add_field("acl", DataType.ARRAY, element_type=DataType.VARCHAR,
                         max_capacity=MAX_DOC_GROUPS, max_length=256)
        schema.add_field("v", DataType.FLOAT_VECTOR, dim=2)
        index = self._client.prepare_index_params()
        index.add_index(field_name="v", index_type="FLAT", metric_type="L2")
        self._request("create", "create_collection", name, schema=schema,
                      index_params=index, consistency_level="Strong")

    def _field(self, name: str) -> dict | None:
        info = self._request("open", "describe_collection", self.collection) or {}
        return next((f for f in info.get("fields", ()) if f.get("name") == name), None)

    def _index_kind(self) -> str:
        """The index the collection really has (it may predate the current settings)."""
        try:
            info = self._request("open", "describe_index", self.collection,
                                 "vector") or {}
            return str(info.get("index_type") or "FLAT").upper()
        except Exception:  # noqa: BLE001 — unknown: the settings' (a dead server fails next)
            return self.index.resolved(self.server)

    def write(self, chunks: Sequence[IndexedChunk], vectors, delete_doc_ids: Sequence[str]) -> None:
        """Delete every chunk of `delete_doc_ids`, then write `chunks` (idempotent: writing the
        same batch twice leaves one row per chunk). A chunk id names its document
        (`doc#pN`), so once its document's rows are deleted a chunk is inserted: an upsert is
        a delete by key and an insert, several times an insert's cost on a large collection
        (reports/embedding.md). A chunk of a document not deleted here is upserted; on a
        partition-key collection it is deleted by chunk id and inserted (see `partitioned`)."""
        self.delete_documents(delete_doc_ids)
        rows = self.rows(chunks, vectors)
        cleared = set(delete_doc_ids)
        for i in range(0, len(rows), 1000):
            batch = rows[i:i + 1000]
            if all(r["doc_id"] in cleared for r in batch):
                self._request("insert", "insert", self.collection, batch)
            elif self.partitioned:
                self._request("delete", "delete", self.collection,
                              filter=f"chunk_id in {self._list([r['chunk_id'] for r in batch])}")
                self._request("insert", "insert", self.collection, batch)
            else:
                self._request("upsert", "upsert", self.collection, batch)

    def rows(self, chunks: Sequence[IndexedChunk], vectors) -> list[dict]:
        """The rows of `chunks` as this collection stores them; lists their group sets in the
        side collection first (so a caller who may see a row's set is never without it)."""
        rows = [{"chunk_id": self._key(c.chunk_id), "doc_id": c.doc_id, "acl": c.acl_terms,
                 "vector": v.tolist()} for c, v in zip(chunks, vectors)]
        if self.has_key:
            sets = {}
            for row in rows:
                row["acl_key"] = key = acl_key(row["acl"])
                sets.setdefault(key, row["acl"])
            if self.keyed:
                self._add_sets(sets)
        return rows

    def _add_sets(self, sets: dict[str, list[str]]) -> None:
        with _acl_sets_lock:
            known = _acl_sets.get(self._sets_id, {})
            new = {k: v for k, v in sets.items() if k not in known}
        if not new:
            return
        self._request("upsert", "upsert", self.sets_collection,
                      [{"acl_key": k, "acl": list(v), "v": [0.0, 0.0]} for k, v in new.items()])
        with _acl_sets_lock:
            _acl_sets.setdefault(self._sets_id, {}).update(
                {k: tuple(v) for k, v in new.items()})

    def _visible_keys(self, terms: list[str]) -> list[str] | None:
        """The `acl_key`s of the group sets a caller with ACL `terms` may see (None: too many
        for one filter, or the sets cannot be read: filter the array)."""
        groups = set(terms) - {PUBLIC}
        if not groups:
            return [ACL_KEY_PUBLIC]
        with _acl_sets_lock:
            read = _acl_sets_read.get(self._sets_id)
        if read is None or time.monotonic() - read > ACL_SETS_REFRESH_S:
            self._read_sets(strong=read is None)
        with _acl_sets_lock:
            known = dict(_acl_sets.get(self._sets_id, {}))
        keys = [ACL_KEY_PUBLIC, *sorted(k for k, v in known.items()
                                        if k != ACL_KEY_PUBLIC and groups.intersection(v))]
        return keys if len(keys) <= ACL_KEY_LIST_MAX else None

    def _read_sets(self, strong: bool) -> None:
        """This process's copy of the group sets, from the side collection: the first read
        waits for every write that returned before it (Strong), later ones are as fresh as the
        searches (the index's consistency)."""
        level = "Strong" if strong or not self.server else self.index.consistency
        rows = self._request("search", "query", self.sets_collection,
                             filter='acl_key != ""', output_fields=["acl_key", "acl"],
                             limit=16384, consistency_level=level)
        with _acl_sets_lock:
            _acl_sets.setdefault(self._sets_id, {}).update(
                {r["acl_key"]: tuple(r["acl"]) for r in rows})
            _acl_sets_read[self._sets_id] = time.monotonic()

    def delete_documents(self, doc_ids: Sequence[str]) -> None:
        for i in range(0, len(doc_ids), 500):
            batch = list(doc_ids[i:i + 500])
            self._request("delete", "delete", self.collection,
                          filter=f"doc_id in {self._list(batch)}")

    def acl_filter(self, acl_groups: Sequence[str] | None, *, per_row: bool = False) -> str:
        """The filter that keeps what a caller with `acl_groups` may see: on `acl_key` (see the
        module's docstring); `per_row`, or a collection without `acl_key`: the array filter."""
        terms = acl_terms(acl_groups)
        if terms is None:
            return ""
        keys = None if per_row or not self.keyed else self._visible_keys(terms)
        if keys is None:
            return f"array_contains_any(acl, {self._list(terms)})"
        if len(keys) == 1:
            return f"acl_key == {milvus_literal(keys[0], lite=not self.server)}"
        return f"acl_key in {self._list(keys)}"

    @settled
    def search(self, vector, k: int, exclude_ids: Sequence[str] = (),
               acl_groups: Sequence[str] | None = None, *, per_row: bool = False) -> list[Hit]:
        """The top `k` a caller with `acl_groups` may see, without `exclude_ids`.

        The exclusions are dropped here from the top `k + len(exclude_ids)`: at most that many
        of those are excluded, so the rest begins with the top `k` of what is left — what a
        `not in` filter gives on an exact index (FLAT: Milvus Lite, and a server's segments too
        small to index). On HNSW, `ef` grows to the deeper limit, so the graph is searched at
        least as widely as before. Past `MAX_K` the exclusions go into the filter as before.
        `per_row`: today's filters (the ACL array, `not in`), for benchmarks."""
        exclude = {self._key(c) for c in exclude_ids}
        filters = [f] if (f := self.acl_filter(acl_groups, per_row=per_row)) else []
        limit = k + len(exclude)
        if exclude and (per_row or limit > MAX_K):
            filters.append(f"chunk_id not in {self._list(sorted(exclude))}")
            limit, exclude = k, set()
        result = self._request(
            "search", "search", self.collection, data=[vector.tolist()],
            limit=limit, filter=" and ".join(filters), output_fields=["doc_id"],
            search_params={"metric_type": "IP",
                           "params": self.index.search_params(self.index_kind, limit)},
            consistency_level=self.index.consistency if self.server else "Strong")
        kept = [r for r in result[0] if r["id"] not in exclude][:k]
        return [Hit(self._chunk_id(r["id"]), r["entity"]["doc_id"], float(r["distance"]), rank,
                    "dense")
                for rank, r in enumerate(kept, start=1)]

    def count(self) -> int:
        """Live rows (deletes subtracted; collection stats count deleted rows on a server)."""
        rows = self._request("count", "query", self.collection, filter="",
                             output_fields=["count(*)"], consistency_level="Strong")
        return int(rows[0]["count(*)"]) if rows else 0

    def drop(self) -> None:
        self._client.drop_collection(self.collection)
        if self._client.has_collection(self.sets_collection):
            self._client.drop_collection(self.sets_collection)
        with _acl_sets_lock:
            _acl_sets.pop(self._sets_id, None)
            _acl_sets_read.pop(self._sets_id, None)

    def close(self) -> None:
        """Close the client and, for an embedded file, stop its Milvus Lite server so another
        process can open the file (Milvus Lite allows one process per file) once no other store
        of this process uses it. Closing twice releases once."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self._client.close()
        if not self._served:
            release_lite(self.uri)
