"""Start a local Elasticsearch HTTP API emulator (``noida-db``) for tests.

The PyPI package ``noida-db`` ships a single native binary (inside the
``noida_db`` package directory) that emulates several servers, including the
Elasticsearch REST API (it reports itself as Elasticsearch 8.15.3). This module
launches that binary directly, with only the Elasticsearch service enabled, on
a loopback port and a caller-supplied data directory::

    with start_es_emulator(tmp_path) as es:
        client = Elasticsearch(es.url)
        ...

Importing this module has no side effects; nothing is started until
:func:`start_es_emulator` is called.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from types import TracebackType
from typing import IO, Self

__all__ = ["EsEmulator", "find_noida_binary", "start_es_emulator"]

#: Environment variable that may point at the ``noida-db`` binary explicitly.
BINARY_ENV_VAR = "NOIDA_DB_BINARY"

_HOST = "127.0.0.1"
_LOG_NAME = "noida-es.log"
_DATA_SUBDIR = "noida-data"
_LOG_TAIL_CHARS = 4000
_STOP_GRACE_S = 5.0
# Attempts when the port is chosen automatically (another process may grab the
# free port between our probe and the binary's bind).
_AUTO_PORT_ATTEMPTS = 3


def find_noida_binary() -> pathlib.Path:
    """Return the path of the native ``noida-db`` binary.

    ``$NOIDA_DB_BINARY`` wins if set; otherwise the binary is looked up inside
    the installed ``noida_db`` package (the ``noida-db`` console script on
    ``PATH`` is only a Python wrapper, so it is not used). The executable bit
    is added if the wheel install dropped it.

    Raises:
        RuntimeError: if the binary cannot be found.
    """
    override = os.environ.get(BINARY_ENV_VAR)
    if override:
        path = pathlib.Path(override)
        if not path.is_file():
            raise RuntimeError(
                f"${BINARY_ENV_VAR} points at {path}, which is not a file"
            )
        return _ensure_executable(path)

    spec = importlib.util.find_spec("noida_db")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "The noida-db Elasticsearch emulator is not installed; "
            "run `pip install noida-db` (or set $NOIDA_DB_BINARY)."
        )
    binname = "noida-db.exe" if os.name == "nt" else "noida-db"
    for location in spec.submodule_search_locations:
        candidate = pathlib.Path(location) / binname
        if candidate.is_file():
            return _ensure_executable(candidate)
    raise RuntimeError(
        f"The noida_db package is installed but its binary {binname!r} is missing; "
        "reinstall it with `pip install --force-reinstall noida-db`."
    )


def _ensure_executable(path: pathlib.Path) -> pathlib.Path:
    """Add the user-executable bit to ``path`` when it is missing."""
    if os.name != "nt" and not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | 0o755)
    return path


def _free_port() -> int:
    """Return a currently free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_HOST, 0))
        return int(sock.getsockname()[1])


def _log_tail(log_path: pathlib.Path, limit: int = _LOG_TAIL_CHARS) -> str:
    """Return the last ``limit`` characters of the log file (best effort)."""
    try:
        text = log_path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        return f"<could not read {log_path}: {exc}>"
    return text[-limit:] if text else "<empty log>"


def _answers(url: str) -> bool:
    """Return True when ``GET url/`` returns an Elasticsearch-style JSON banner."""
    try:
        with urllib.request.urlopen(url + "/", timeout=1.0) as resp:
            if resp.status != 200:
                return False
            body = json.loads(resp.read().decode("utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(body, dict) and "version" in body


class EsEmulator:
    """A running ``noida-db`` Elasticsearch emulator process.

    Attributes:
        url: base URL of the HTTP API, e.g. ``http://127.0.0.1:54321``.
        port: the TCP port it listens on.
        data_dir: the directory holding its data and log file.
        log_path: file receiving the process's stdout and stderr.
    """

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        port: int,
        data_dir: pathlib.Path,
        log_path: pathlib.Path,
        log_file: IO[bytes],
    ) -> None:
        self._process = process
        self._log_file = log_file
        self.port = port
        self.url = f"http://{_HOST}:{port}"
        self.data_dir = data_dir
        self.log_path = log_path

    @property
    def pid(self) -> int:
        """Process id of the emulator (also its process group id)."""
        return self._process.pid

    def is_running(self) -> bool:
        """Return True while the emulator process has not exited."""
        return self._process.poll() is None

    def log_tail(self) -> str:
        """Return the end of the emulator's log file."""
        return _log_tail(self.log_path)

    def stop(self) -> None:
        """Stop the emulator and its process group; safe to call twice."""
        proc = self._process
        if proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                proc.wait(timeout=_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                proc.wait(timeout=_STOP_GRACE_S)
        if not self._log_file.closed:
            self._log_file.close()

    def _signal_group(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the emulator's process group (or just the process)."""
        try:
            if os.name == "nt":
                self._process.kill()
            else:
                os.killpg(self._process.pid, sig)
        except ProcessLookupError:
            pass

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped"
        return f"EsEmulator(url={self.url!r}, pid={self.pid}, {state})"


def _launch(
    binary: pathlib.Path, data_dir: pathlib.Path, port: int, timeout_s: float
) -> EsEmulator:
    """Launch one emulator on ``port`` and wait until it answers HTTP."""
    log_path = data_dir / _LOG_NAME
    log_file = open(log_path, "ab")  # noqa: SIM115 (owned by EsEmulator)
    cmd = [
        str(binary),
        "start",  # foreground mode; `up` would daemonise
        "--only",
        "elasticsearch",
        "--elasticsearch-port",
        str(port),
        "--host",
        _HOST,
        "--data-dir",
        str(data_dir / _DATA_SUBDIR),
    ]
    try:
        process = subprocess.Popen(
            cmd,
            cwd=data_dir,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=(os.name != "nt"),
        )
    except OSError as exc:
        log_file.close()
        raise RuntimeError(f"could not execute {binary}: {exc}") from exc

    emulator = EsEmulator(process, port, data_dir, log_path, log_file)
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            emulator.stop()
            raise RuntimeError(
                f"noida-db Elasticsearch emulator exited with code {process.returncode} "
                f"before answering on {emulator.url}; log {log_path}:\n{_log_tail(log_path)}"
            )
        if _answers(emulator.url):
            return emulator
        if time.monotonic() >= deadline:
            emulator.stop()
            raise RuntimeError(
                f"noida-db Elasticsearch emulator did not answer on {emulator.url} "
                f"within {timeout_s:g}s; log {log_path}:\n{_log_tail(log_path)}"
            )
        time.sleep(0.05)


def start_es_emulator(
    data_dir: pathlib.Path, port: int | None = None, timeout_s: float = 30
) -> EsEmulator:
    """Start the Elasticsearch emulator and wait until its HTTP API answers.

    Args:
        data_dir: directory for the emulator's data (subdirectory
            ``noida-data``) and its log file (``noida-es.log``); created if
            missing. Use a fresh directory for an empty server: data persists.
        port: loopback port to listen on; a free one is picked when ``None``.
        timeout_s: how long to wait for the HTTP API to answer.

    Returns:
        The running :class:`EsEmulator`; call ``stop()`` or use it as a
        context manager.

    Raises:
        RuntimeError: if the binary is missing, exits early, or does not
            answer in time (the message includes the end of the log).
    """
    binary = find_noida_binary()
    data_dir = pathlib.Path(data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    if port is not None:
        return _launch(binary, data_dir, port, timeout_s)

    last_error: RuntimeError | None = None
    for _ in range(_AUTO_PORT_ATTEMPTS):
        try:
            return _launch(binary, data_dir, _free_port(), timeout_s)
        except RuntimeError as exc:  # e.g. the free port was taken meanwhile
            last_error = exc
            if "already in use" not in str(exc):
                raise
    assert last_error is not None
    raise last_error
