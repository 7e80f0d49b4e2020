"""The service's open indexes: one driver per index, started on first use and closed when no
request needs it any more.

A driver (an index's stores, retriever and policy; on Ray, its retriever actors) takes seconds to
start and holds hundreds of MB, so the service keeps one per index and shares it between requests.
`Drivers` decides when one starts and when one goes:

* **Start**: on an index's first request, in the background, one start per index whatever the
  number of callers waiting on it (`open`); a caller waits at most its deadline, then gets a 503
  `index_starting` while the start goes on. A start that failed is kept (`failed`: readiness
  counts the index not ready) until one succeeds.
* **Retire**: a driver leaves service when its index changed on disk (another ingest's layout,
  a folder removed or made anew, an ingest left incomplete: `_stale`), when its retriever actor
  died for good (`retire_dead`), when no request used it for `idle_close_s` (the default
  index excepted), or to make room: with `max_open` indexes open (or starting), the start of
  one more first retires the least recently used open index no request is using (the default
  one last), and waits for it to close; when every open index is in use, the caller gets a
  503 `overloaded` at once (`_make_room`). The next request starts a fresh one.
* **Close**: a retired driver closes only once the last request holding it (`using`, `hold`,
  `let_go`) has left, and a new driver of the same index starts only after that (a Milvus Lite
  file has one owner). Once the service closes (`close`), no driver starts: `open` answers 503
  `shutting_down`, and a start under way closes the driver it made.

No HTTP and no Ray here: `make(settings)` starts a driver, `close(driver, docstore)` closes one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from branchsearch.infra.config.settings import Settings
from branchsearch.infra.errors import IndexNotFound, error_line, overload
from branchsearch.infra.index.catalog import index_names
from branchsearch.orchestrator.service.errors import ApiError, error_code, shutting_down

log = logging.getLogger("branchsearch.service")
SETTINGS_INDEX = object()  # `Drivers`' default index when none is given: the settings' index


class Drivers:
    def __init__(self, settings: Settings, *, make: Callable[[Settings], object],
                 close: Callable[[object, object], None], default: object = SETTINGS_INDEX,
                 idle_close_s: float = 0.0, max_open: int = 0, retry_after_s: int = 1):
        """`make(settings)`: start the driver of `settings.index`; `close(driver, docstore)`:
        close one; `default`: the default index (`settings.index` unless given; None: none);
        `idle_close_s` > 0: close an index (not the default) unused that long;
        `max_open` > 0: the most indexes open at once (`_make_room`), a refusal past it
        saying `Retry-After: retry_after_s`."""
        self.settings, self._make, self._close, self.idle_close_s = (settings, make, close,
                                                                     idle_close_s)
        self.max_open, self.retry_after_s = max_open, retry_after_s
        self.default = settings.index if default is SETTINGS_INDEX else default
        self.by_index: dict[str, object] = {}  # the drivers in service
        self._docstores: dict[str, object] = {}
        self._opened_as: dict[str, tuple] = {}  # index -> what it was opened as (`_stale`)
        self._users: dict[object, int] = {}  # driver -> the requests using it now
        self._probing: dict[object, int] = {}  # driver -> how many of those are probes
        self.retiring: dict[str, tuple] = {}  # index -> (driver, docstore) closing when idle
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # a driver's last request ended
        self._background: dict[str, dict] = {}  # index -> its one start, while it runs
        self._write_locks: dict[str, threading.Lock] = {}
        self._last_used: dict[str, float] = {}  # index -> when its last request ended
        # index -> why its last start failed (a log line, and the code a caller may see),
        # until one succeeds (`failed`)
        self._failed: dict[str, tuple[str, str]] = {}
        self._closing = threading.Event()  # set by close(): no start begins, the reaper stops
        if idle_close_s > 0:
            threading.Thread(target=self._reap_idle, daemon=True, name="idle-indexes").start()

    def open(self, index: str, wait: float | None = None):
        """The index's driver, started on first use. The start (its actors may take a while,
        or fail on a full cluster) runs in the background, one per index whatever the number
        of callers waiting on it, so searches of other indexes go on meanwhile. `wait`: the
        most seconds to wait for it (a request's deadline); past it, a 503 index_starting
        while the start goes on. A failed start is tried again by the next caller. Once
        `close` has begun, a 503 shutting_down, also to a caller already waiting."""
        with self._lock:
            if self._closing.is_set():
                raise shutting_down()
            if index in self.by_index:
                if not self._stale(index):
                    return self.by_index[index]
                self._retire(index)
        if index not in index_names(self.settings):  # nothing to start: answered now
            raise index_not_found(index)
        self._profile(index)  # nor for an index that cannot be searched: no room is made for it
        with self._lock:
            if self._closing.is_set():
                raise shutting_down()
            if index in self.by_index:  # another caller's start finished meanwhile
                return self.by_index[index]
            start = self._background.get(index)
            if start is None:
                start = self._background[index] = {"done": threading.Event(),
                                                   "after": self._make_room()}
                threading.Thread(target=self._start, args=(index, start), daemon=True,
                                 name=f"start-{index}").start()
        end = None if wait is None else time.monotonic() + wait
        # a caller waits for the start, its deadline or the service closing, whichever comes
        # first: a start stuck on a backend must not hold a stopping server's request threads
        # (the process joins them at exit) until the backend's timeout
        while not start["done"].wait(0.25 if end is None else
                                     min(0.25, max(0.0, end - time.monotonic()))):
            if self._closing.is_set():
                raise shutting_down()
            if end is not None and time.monotonic() >= end:
                raise ApiError(503, "index_starting", f"index {index!r} is still starting; "
                               "retry later", {"Retry-After": "5"})
        if "error" in start:
            raise start["error"]
        return start["driver"]

    def _start(self, index: str, start: dict) -> None:
        try:
            with self._idle:  # a retired driver's stores close before new ones open (Lite),
                # and the one retired to make room for this one closes before it starts
                while index in self.retiring or start["after"] in self.retiring:
                    self._idle.wait()
            start["driver"] = self._open(index)
        except BaseException as exc:  # noqa: BLE001 — re-raised in the waiting callers
            start["error"] = exc
            if not isinstance(exc, (IndexNotFound, ApiError)):  # (ApiError: a start to retry)
                with self._lock:
                    self._failed[index] = (error_line(exc, 1000), error_code(exc))
        finally:
            with self._idle:
                self._background.pop(index, None)
                self._idle.notify_all()  # (`close` waits for the starts under way)
            start["done"].set()

    def _open(self, index: str):
        """Check the index, then start its driver (`open` runs one start per index)."""
        from branchsearch.infra.stores.docstore import DocStore

        settings = self.settings.replace(index=index)
        opened_as = _opened_as(settings)  # before the stores open: a later ingest shows
        profile = self._profile(index)
        docstore = DocStore(profile.folder / "docs.sqlite") if profile.kind == "owned" else None
        try:
            _unchanged(index, opened_as, settings)  # the docstore opened is the one seen
            driver = self._make(settings)
        except BaseException as exc:
            if docstore is not None:
                docstore.close()
            if isinstance(exc, IndexNotFound):  # gone while it started: said as above, not
                raise index_not_found(index) from None  # with the server's paths
            raise
        try:  # the driver's stores, opened by path meanwhile, are that index's too: a write's
            # ownership check reads this docstore and must see what the write will change
            _unchanged(index, opened_as, settings)
        except BaseException:
            self._close(driver, docstore)
            raise
        with self._lock:
            if not self._closing.is_set():  # (else `close` has begun: this one closes here)
                self.by_index[index] = driver
                self._docstores[index] = docstore
                self._last_used[index] = time.monotonic()
                self._write_locks.setdefault(index, threading.Lock())
                if opened_as is not None:
                    self._opened_as[index] = opened_as
                self._failed.pop(index, None)
                return driver
        self._close(driver, docstore)
        raise shutting_down()

    def _profile(self, index: str):
        """The index's profile, if it can be searched: not found, incomplete, being ingested,
        damaged or a copied folder is its answer now, before any room is made or actor started
        for it (not the death of a retriever actor that found it)."""
        from branchsearch.infra.index.profile import index_profile

        profile = index_profile(self.settings.replace(index=index))
        if isinstance(profile.problem, IndexNotFound):  # (its message names the home)
            raise index_not_found(index)
        profile.require_searchable()
        return profile

    def _make_room(self) -> str | None:
        """Room for one more index within `max_open` (those open and those starting): none
        needed, None; else the least recently used open index that no request uses (the
        default index only when no other is idle) is retired, as the idle timer retires one,
        and its name returned: the new start waits for its close. Every open index in use: a
        503 `overloaded` at once, as when the server has its most requests in flight.
        Holding the lock."""
        if not self.max_open or len(self.by_index.keys() | self._background.keys()) < self.max_open:
            return None
        idle = [i for i, d in self.by_index.items() if not self._users.get(d)]
        if not idle:
            raise ApiError(503, "overloaded", "the server has the most indexes open that it "
                           f"keeps (max_open_indexes = {self.max_open}), each with a request in "
                           "flight or starting; retry", {"Retry-After": str(self.retry_after_s)},
                           overload("max_open_indexes",
                                    len(self.by_index.keys() | self._background.keys()),
                                    max_open_indexes=self.max_open))
        index = min(idle, key=lambda i: (i == self.default, self._last_used.get(i, 0.0)))
        self._retire(index, f"was closed to make room for another (max_open_indexes = "
                     f"{self.max_open})")
        return index

    def _stale(self, index: str) -> bool:
        """Whether the index on disk is no longer the one its driver opened: an ingest (another
        process: the CLI) changed its layout (`Manifest.layout`: stores, embedder, chunking),
        its folder was removed and made anew, or it was left incomplete (no manifest, and no
        ingest under way: a failed or stopped one, or a removed folder). The driver's open
        stores would rank a different index from the one a fresh service would search, or
        from its policy's reading of the new manifest. (Documents an ingest only adds or
        replaces reach the open stores: tantivy's reader reloads itself, SQLite and the servers
        are shared; Milvus Lite's file is the service's while it is open.) One stat a request;
        more only when the manifest changed or is gone. Holding the lock."""
        from branchsearch.infra.index.manifest import read_manifest, running_ingest

        seen = self._opened_as.get(index)
        if seen is None:  # an external index: nothing of ours to watch
            return False
        folder, stat = seen[:2]
        now = _stat(folder)
        if now == stat:
            return False
        manifest = None if now is None else read_manifest(folder)
        if manifest is None:  # an ingest under way: searches go on over what was there
            return running_ingest(folder) is None
        seen_now = (folder, now, manifest.layout(), _file_id(folder / "docs.sqlite"))
        if _same_index(seen, seen_now):  # only documents added or replaced: the same stores
            self._opened_as[index] = seen_now
            return False
        return True

    def moved(self, index: str) -> bool:
        """Whether the index's folder is no longer the one its driver opened (removed, or
        made anew): what a write did meanwhile went to the old, removed files."""
        with self._lock:
            seen = self._opened_as.get(index)
        return seen is not None and not _same_index(
            seen, _opened_as(self.settings.replace(index=index)))

    def _retire(self, index: str, why: str = "changed on disk (another layout, removed, made "
                "anew or left incomplete)") -> None:
        """Take the index's driver out of service; it is closed once the requests using it end
        (`using`). Holding the lock."""
        old = self.by_index.pop(index), self._docstores.pop(index)
        log.info("index %r %s: its stores close once the %d request(s) using them end", index,
                 why, self._users.get(old[0], 0))
        self.retiring[index] = old
        threading.Thread(target=self._close_when_idle, args=(index, old), daemon=True,
                         name=f"retire-{index}").start()

    def retire_dead(self, index: str, driver, exc: BaseException) -> None:
        """Retire the index's `driver`, whose retriever actor is dead for good (once: the
        first request to find it; a driver already replaced stays replaced)."""
        with self._lock:
            if self.by_index.get(index) is driver:
                log.error("index %r: its retriever actor died for good (%s)", index,
                          error_line(exc, 300))
                self._retire(index, "lost its retriever actor")

    def _close_when_idle(self, index: str, old: tuple) -> None:
        try:
            with self._idle:
                while self._users.get(old[0]):
                    self._idle.wait()
            self._close(*old)
        except Exception as exc:  # noqa: BLE001 — a store that fails to close: logged
            log.warning("closing the old stores of index %r: %s", index, error_line(exc, 500))
        finally:
            with self._idle:
                if self.retiring.get(index) is old:
                    del self.retiring[index]
                self._idle.notify_all()

    @contextmanager
    def using(self, index: str, wait: float | None = None):
        """(driver, docstore) of the index for one request; a driver retired meanwhile (its
        index changed on disk) is closed only once its last request leaves here. `wait` bounds
        the whole: a start waited for again (the driver retired meanwhile) gets what is left."""
        end = None if wait is None else time.monotonic() + wait
        while True:
            left = None if end is None else max(end - time.monotonic(), 0.0)
            driver = self.open(index, left)
            if (held := self.hold(index, driver)) is not None:
                break
        try:
            yield driver, held[0]
        finally:
            self.let_go(driver, index)

    def hold(self, index: str, driver, probe: bool = False) -> tuple | None:
        """Count one more user of `driver` if it still serves `index` (not retired meanwhile):
        a driver in use is neither closed nor reaped. `probe`: a readiness probe, whose answer
        is out already, which `close` does not wait for. Returns (its docstore,), or None."""
        with self._lock:
            if self.by_index.get(index) is not driver:
                return None
            self._users[driver] = self._users.get(driver, 0) + 1
            if probe:
                self._probing[driver] = self._probing.get(driver, 0) + 1
            return (self._docstores[index],)

    def also(self, driver) -> None:
        """One more user of `driver`, which a request holds now (a thread of its own that may
        outlive the request: its search)."""
        with self._lock:
            self._users[driver] += 1

    def let_go(self, driver, index: str | None, probe: bool = False) -> None:
        """One user of `driver` less; `index`: a request used it (readiness probes do not
        count as use); `probe`: held as a probe (`hold`)."""
        with self._idle:
            self._users[driver] -= 1
            if probe:
                self._probing[driver] -= 1
                if not self._probing[driver]:
                    del self._probing[driver]
            if index is not None:
                self._last_used[index] = time.monotonic()
            if not self._users[driver]:
                del self._users[driver]
                self._idle.notify_all()

    def _reap_idle(self) -> None:
        """Close the indexes (other than the default) no request used for
        `index_idle_close_s`: each holds a retriever process and its models (hundreds of MB
        a hybrid index) that a service in front of many indexes would otherwise keep for
        every index ever asked once. The next request opens it again, as on first use."""
        idle_s = self.idle_close_s
        while not self._closing.wait(min(max(idle_s / 4, 0.05), 60.0)):
            now = time.monotonic()
            with self._lock:
                for index in [i for i, d in self.by_index.items()
                              if i != self.default and not self._users.get(d)
                              and now - self._last_used.get(i, now) >= idle_s]:
                    self._retire(index, f"was not used for {idle_s:g} s")

    def opened(self) -> list[tuple[str, object]]:
        """(index, driver) of every driver in service now."""
        with self._lock:
            return list(self.by_index.items())

    def failed(self) -> dict[str, tuple[str, str]]:
        """The indexes whose last start failed, each with why (a log line, for the server's
        log only) and the code a caller may see (`errors.error_code`): a request asked for
        them and they do not serve. Not an index that is not there, nor a start to retry at
        once (changed on disk while it started)."""
        with self._lock:
            return dict(self._failed)

    def write_lock(self, index: str) -> threading.Lock:
        """The lock that makes the service's document writes to `index` one at a time."""
        with self._lock:
            return self._write_locks.setdefault(index, threading.Lock())

    def close(self, wait_s: float = 10.0) -> None:
        """Close every driver once its requests have left, waiting at most `wait_s` for them (a
        server stopping past its grace cancels its requests, but their searches run on in
        threads), and not for readiness probes; a driver still in use then (by a request or a
        probe) is left to the process's exit, since closing
        stores under a search can crash the process. From now on no driver starts (`open`
        answers 503 shutting_down); the starts under way, waited for within the same
        `wait_s`, close the driver they made. Then wait (at most 30 s) for the retired ones
        to close."""
        self._closing.set()
        end = time.monotonic() + wait_s
        with self._idle:
            self._idle.wait_for(lambda: not self._background, timeout=wait_s)
            self._idle.wait_for(lambda: all(self._users.get(d, 0) == self._probing.get(d, 0)
                                            for d in self.by_index.values()),
                                timeout=max(end - time.monotonic(), 0.0))
            for index, driver in self.by_index.items():
                if self._users.get(driver):
                    log.warning("index %r: %d search(es) still running at close; its stores "
                                "are left open", index, self._users[driver])
                    continue
                self._close(driver, self._docstores[index])
            self.by_index.clear()
            self._docstores.clear()
            self._idle.wait_for(lambda: not self.retiring, timeout=30)  # their own threads


def _stat(folder: Path) -> tuple | None:
    """The index manifest's signature: an ingest that finishes replaces it."""
    from branchsearch.infra.index.manifest import file_signature, manifest_path

    return file_signature(manifest_path(folder))


def _file_id(path: Path) -> tuple | None:
    """(device, inode): another file at the same path differs, while the driver's docstore
    holds the old one open (so its inode is not reused)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _opened_as(settings: Settings) -> tuple | None:
    """(folder, manifest stat, layout, docstore file) of an owned index as its driver opens it,
    taken before its stores open (an ingest that finishes meanwhile shows as a change); None
    for an external index, or one without a readable manifest (its profile refuses it)."""
    from branchsearch.infra.index.manifest import read_manifest

    if settings.external is not None:
        return None
    folder = settings.index_dir
    stat, manifest = _stat(folder), read_manifest(folder)
    if manifest is None:
        return None
    return folder, stat, manifest.layout(), _file_id(folder / "docs.sqlite")


def _unchanged(index: str, opened_as: tuple | None, settings: Settings) -> None:
    """ApiError 503 `index_starting` (retry) when the index on disk is no longer the one
    `opened_as` saw: its folder removed and made anew (another docstore file), another layout,
    or an ingest under way. The service's docstore (the ACL guard, a write's ownership check)
    and the driver's stores would be two indexes. The docstore file's identity is compared
    while the service holds it open, so its inode cannot be reused meanwhile."""
    if opened_as is None:  # an external index: nothing of ours on disk
        return
    if not _same_index(opened_as, _opened_as(settings)):
        raise ApiError(503, "index_starting", f"index {index!r} changed on disk while it was "
                       "starting (removed and made anew, or ingested with another layout); "
                       "retry", {"Retry-After": "5"})


def _same_index(seen: tuple, now: tuple | None) -> bool:
    """Whether two `_opened_as` readings are one index for the stores open on it: the same
    folder, layout and docstore file (its manifest may differ: documents added)."""
    return now is not None and (now[0], now[2], now[3]) == (seen[0], seen[2], seen[3])


def index_not_found(index: str) -> IndexNotFound:
    """What a caller learns of an index that is not there (not where the server keeps them)."""
    return IndexNotFound(f"index {index!r} not found (make it with `branchsearch ingest PATH "
                         f"--index {index}`)")
