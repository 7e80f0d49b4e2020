"""What every command shares: the common options, the settings merge (file, environment,
flags), the caller's ACL groups, a writable-output check and the progress bar."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from branchsearch.infra.stores.protocols import MAX_K
from branchsearch.infra.config.choices import EXECUTORS, POLICIES
from branchsearch.infra.errors import BranchsearchError
from branchsearch.infra.config.settings import Settings, load_settings

HomeOpt = typer.Option(None, "--home", help="data home (default ./.branchsearch)")
IndexOpt = typer.Option(None, "--index", help="index name (default 'default')")
ConfigOpt = typer.Option(None, "--config", help="settings TOML file")
JsonOpt = typer.Option(False, "--json", help="print JSON (for programs) instead of text")


def choice(*allowed: str):
    def check(value):
        if value is not None and value not in allowed:
            raise typer.BadParameter(f"{value!r} is not one of {', '.join(allowed)}")
        return value
    return check


ExecutorOpt = typer.Option(None, "--executor", callback=choice(*EXECUTORS),
                           help="ray (branches as Ray actors) | local (in-process). Default: "
                                "in-process on one machine; ray when a cluster is named "
                                "(--address, RAY_ADDRESS) or the LLM runs in engine actors")
PolicyOpt = typer.Option(None, "--policy", callback=choice(*POLICIES),
                         help=" | ".join(POLICIES))
AclOpt = typer.Option(None, "--acl", help="a group the caller holds (repeat for several); "
                                          "without --acl: public documents only")
AclAdminOpt = typer.Option(False, "--acl-admin", help="see every document, restricted or not "
                                                      "(also: acl_admin = true in settings)")
KOpt = typer.Option(10, "--k", min=1, max=MAX_K, help=f"hits to return (1..{MAX_K})")
AddressOpt = typer.Option(None, "--address", help="Ray cluster to join (default RAY_ADDRESS; "
                                                   "without one, work that uses Ray starts a "
                                                   "local cluster)")


def settings_from(home, index, config, **flags) -> Settings:
    return load_settings(config, {"home": home, "index": index, **flags})


def settings_to_read(home, index, config, **flags) -> tuple[Settings, str | None]:
    """`settings_from` for a command that reads an index (retrieve, search, batch, loadtest).
    With no index named (no --index, and the settings still at the default name) and no index
    of that name in the data home, the home's only index is the one, and the line that says so
    is returned for the caller to print (`say`) once its own checks have passed; with several,
    one error line names them. (`ingest` keeps the default name: it makes indexes.)"""
    settings, several, picked = settings_of_home(home, index, config, **flags)
    if several:
        raise BranchsearchError(f"which index? This data home ({settings.home}) has "
                                f"{', '.join(map(repr, several))}; pick one with --index NAME")
    return settings, picked


def say(note: str | None) -> None:
    """A command's note on stderr (none when None): said once its checks have passed and its
    work starts, so that a mistake found before is its one `error:` line."""
    if note:
        print(note, file=sys.stderr)


def settings_of_home(home, index, config,
                     **flags) -> tuple[Settings, list[str], str | None]:
    """`settings_to_read`'s settings; the home's indexes when none is named and it holds
    several (the settings' index then names none of them), [] otherwise; and, when the home's
    only index is the one, the line that says so, for the caller to print once its own checks
    have passed (a mistake found before is its one `error:` line), else None."""
    from branchsearch.infra.index.catalog import index_names

    settings = settings_from(home, index, config, **flags)
    if index is not None or settings.index != Settings().index or settings.index_dir.exists():
        return settings, [], None
    names = index_names(settings)
    if len(names) == 1:
        return (settings.replace(index=names[0]), [],
                f"index {names[0]!r} (the only one in {settings.home}; --index NAME picks one)")
    return settings, names if len(names) > 1 else [], None


def caller_acl(settings: Settings, groups: list[str] | None, admin: bool) -> list[str] | None:
    """The caller's `acl_groups`: None (public only), its groups, or ACL_ALL for an admin."""
    from branchsearch.infra.stores.acl import caller_groups

    return caller_groups(groups, admin or settings.acl_admin)


def writable_file(path: Path, what: str) -> None:
    """Stop with one line when `path` cannot be written as a file (a folder, no permission, a
    read-only or virtual file system), before any work whose results it would hold."""
    import os

    if path.is_dir():
        raise BranchsearchError(f"{what} {path} is a folder: give a file name")
    _writable_folder(path.parent if str(path.parent) else Path("."), path, what)
    if path.exists() and not os.access(path, os.W_OK):
        raise BranchsearchError(f"{what} {path}: no permission to write there")


def writable_report(path: Path, what: str) -> None:
    """`writable_file` for a JSON report `path` and the Markdown summary written beside it
    (`path` with the suffix `.md`), which must be another file."""
    if path.suffix.lower() == ".md":  # (OUT.MD too: the same file where case is folded)
        raise BranchsearchError(f"{what} {path}: its Markdown summary is written to the same "
                                "name with .md, over the JSON: give OUT.json (OUT.md is "
                                "written beside it)")
    writable_file(path, what)
    writable_file(path.with_suffix(".md"), what)


def writable_folder(path: Path, what: str) -> None:
    """Stop with one line when files cannot be written into the folder `path` (made if
    missing)."""
    if path.exists() and not path.is_dir():
        raise BranchsearchError(f"{what} {path} is not a folder")
    _writable_folder(path, path, what)


def _writable_folder(folder: Path, path: Path, what: str) -> None:
    """A file can be made in `folder`, or in the folder it will be made under: tried with a
    file that is gone at once (a permission check alone passes root in /proc)."""
    import tempfile

    while not folder.exists() and folder != folder.parent:  # created on write
        folder = folder.parent
    if not folder.is_dir():
        raise BranchsearchError(f"{what} {path}: {folder} is not a folder")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:  # (a folder that exists but makes no files, /proc, says ENOENT)
        why = ("no files can be made there" if isinstance(exc, FileNotFoundError)
               else exc.strerror or type(exc).__name__)
        raise BranchsearchError(f"{what} {path}: cannot write in {folder} ({why})") from None


def per_second(rate: float) -> str:
    """A rate for a person: whole numbers from 10 up, two significant digits under, so work
    done never reads "0" (a 2-document ingest is 0.26 chunks/s, not 0)."""
    return f"{rate:.0f}" if rate >= 10 else f"{rate:.2g}"


def duration(seconds: float) -> str:
    """Seconds for a person: "40 s", "12 min", "2 h 5 min"."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60} min"


def progress_bar(total: int | None, unit: str, desc: str):
    """A tqdm bar on a terminal; elsewhere (a pipe, a log file, CI) one plain line every
    few seconds, so long work is never silent. Both take update(n), set_postfix(...),
    format_dict["elapsed"] and close(done=True)."""
    if not _sized_terminal(sys.stderr):
        return ProgressLines(total, unit, desc)
    from tqdm import tqdm

    class Bar(tqdm):
        def close(self, done: bool = True) -> None:  # as ProgressLines.close; the bar shows
            super().close()  # where it stopped either way

    return Bar(total=total, unit=unit, desc=desc, file=sys.stderr, dynamic_ncols=True)


def _sized_terminal(stream) -> bool:
    """`stream` is a terminal that says how wide it is. A pseudo-terminal given no size (`script`,
    a CI runner's or a container's, `pty.openpty`) says 0 columns, and tqdm draws nothing there:
    a long run would show no progress at all."""
    import os

    try:
        return stream.isatty() and os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):  # no descriptor (a test's stream), closed
        return False


class ProgressLines:
    """Progress as plain stderr lines: one every `every` seconds once the work has advanced
    (from a timer thread, so a long step between two updates still shows the clock running)
    and one at close. With a total, each line until the last says about how long is left at
    the rate since the first update (start-up not counted), as the bar's ETA does on a
    terminal. Nothing before the first update or postfix: a command that fails early says
    only its one `error:` line."""

    def __init__(self, total: int | None, unit: str, desc: str, every: float = 5.0,
                 stream=None):
        import threading
        import time
        import weakref

        self._clock = time.monotonic
        self.total, self.unit, self.desc, self.every = total, unit, desc, every
        self.stream = stream if stream is not None else sys.stderr
        self.n = 0
        self.postfix = ""
        self._start = self._clock()
        self._first: tuple[float, int] | None = None  # (when, count) at the first update
        self._stop = threading.Event()
        # the timer holds the bar weakly: a bar dropped unclosed (its command raised) goes quiet
        self._timer = threading.Thread(target=_tick, args=(weakref.ref(self), self._stop,
                                                            every),
                                       name="progress-lines", daemon=True)
        self._timer.start()

    @property
    def format_dict(self) -> dict:
        return {"n": self.n, "total": self.total, "elapsed": self._clock() - self._start}

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._first is None:  # start-up (a model load, a cluster) ends with the first count
            self._first = (self._clock(), self.n)

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kwargs) -> None:
        items = {**(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def close(self, done: bool = True) -> None:
        """Stop the timer and say the last count (`done`: the work ended, not interrupted)."""
        if not self._stop.is_set():
            self._stop.set()
            self._timer.join()
            if self.n or self.postfix:
                self._say(done=done)

    def _say(self, done: bool = False) -> None:
        elapsed = self._clock() - self._start
        count = f"{self.n}/{self.total}" if self.total is not None else f"{self.n}"
        rate = self.n / elapsed if elapsed > 0 else 0.0
        shown = f"{rate:.1f}" if rate >= 0.1 or not self.n else per_second(rate)  # not 0.0
        line = f"{self.desc}: {count} {self.unit}, {shown} {self.unit}/s, {elapsed:.0f} s"
        if not done and self.total is not None and 0 < self.n < self.total and rate > 0:
            left = max((self.total - self.n) / self._pace(rate), 1)  # never "about 0 s"
            line += f", about {duration(left)} left"
        if self.postfix:
            line += f" ({self.postfix})"
        print(line + (", done" if done else ""), file=self.stream, flush=True)

    def _pace(self, rate: float) -> float:
        """The rate the time left is reckoned at: since the first update, once more has been
        done, so the start-up before it (loading a model, starting Ray) is not counted as if
        every item took a share of it; `rate` (the whole run's) until then."""
        if self._first is not None and self.n > self._first[1]:
            since = self._clock() - self._first[0]
            if since > 0:
                return (self.n - self._first[1]) / since
        return rate


def _tick(ref, stop, every: float) -> None:
    while not stop.wait(every):
        bar = ref()
        if bar is None:
            return
        try:
            if bar.n or bar.postfix:  # counted work, or work said under way (`set_postfix`)
                bar._say()
        except (ValueError, OSError):  # the stream was closed under it
            return
        del bar
