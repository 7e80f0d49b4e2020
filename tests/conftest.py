"""Shared fixtures: real embedded backends on small shipped corpora, started once per session."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from branchsearch.infra.ingest.pipeline import ingest
from branchsearch.infra.config.settings import load_settings

FIXTURES = Path(__file__).parent / "fixtures"
HOTPOT = FIXTURES / "hotpot-mini"
MUSIQUE = FIXTURES / "musique-mini"


@pytest.fixture(scope="session", autouse=True)
def milvus_logs(tmp_path_factory):
    """The session's folder for glog files. Every Milvus Lite server the tests start (in this
    process, its subprocesses and Ray workers, which inherit the environment) writes them in
    /tmp by default, a few per server and thousands per full run; `GLOG_log_dir` sends them
    under the session's basetemp, which pytest removes with its old basetemps. (A standalone
    server's glog goes to its own `logs/` folder: tests/milvus_server.py.)"""
    folder = tmp_path_factory.mktemp("milvus-logs")
    before = os.environ.get("GLOG_log_dir")
    os.environ["GLOG_log_dir"] = str(folder)
    try:
        yield folder
    finally:
        if before is None:
            os.environ.pop("GLOG_log_dir", None)
        else:
            os.environ["GLOG_log_dir"] = before


@pytest.fixture(scope="session")
def hotpot_settings(tmp_path_factory):
    """Settings pointing at an index of hotpot-mini (tantivy + Milvus Lite + docstore)."""
    home = tmp_path_factory.mktemp("home")
    settings = load_settings(overrides={"home": home, "index": "hotpot"}, read_env=False,
                             read_file=False)
    ingest(HOTPOT, settings)
    return settings


@pytest.fixture(scope="session")
def hotpot_retriever(hotpot_settings):
    from branchsearch.infra.index.open import open_retriever

    retriever = open_retriever(hotpot_settings)
    yield retriever
    retriever.close()


@contextmanager
def read_only_folder(folder: Path):
    """`folder` (or a file) made unwritable for this process: immutable (`chattr +i`) for root,
    whom permissions do not stop, else mode 0555."""
    if os.geteuid() == 0:
        made = subprocess.run(["chattr", "+i", str(folder)], capture_output=True)
        if made.returncode:
            pytest.skip(f"chattr +i: {made.stderr.decode().strip()}")
        undo = ["chattr", "-i", str(folder)]
    else:
        folder.chmod(0o555)
        undo = ["chmod", "755", str(folder)]
    try:
        yield
    finally:
        subprocess.run(undo, check=True)


# What a `preexec_fn` would do in the child, done by a small Python that then execs the command
# (same pid, so signals and process groups reach the command): argv[1] the RLIMIT_FSIZE in bytes
# or -1, argv[2] "1" to give the command SIGINT as a terminal does (default, unblocked).
_PREPARE = """import os, resource, signal, sys
if int(sys.argv[1]) >= 0:
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), int(sys.argv[1])))
if sys.argv[2] == "1":
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
os.execvp(sys.argv[3], sys.argv[3:])
"""


def prepared(cmd, *, file_size: int | None = None, sigint_default: bool = False) -> list[str]:
    """`cmd` (for subprocess) started under a file-size limit of `file_size` bytes and/or with
    SIGINT as a terminal gives it. Never pass subprocess a `preexec_fn` instead: it makes
    subprocess fork() rather than vfork(), so the at-fork handlers of every library this pytest
    process has loaded run in the child. Once gRPC is loaded (pymilvus for Milvus Lite, Ray, the
    OTLP exporter: any earlier test in a full run) its handler restarts gRPC's event-engine
    threads in that child; subprocess then closes the child's descriptors before exec, and a
    thread polling the closed epoll fd aborts the child (SIGABRT, "epoll_wait error: Bad file
    descriptor") before the command runs: an intermittent failure of whatever test spawned it."""
    return [sys.executable, "-c", _PREPARE, str(-1 if file_size is None else file_size),
            "1" if sigint_default else "0", *map(str, cmd)]


def ingest_copy(settings, index: str):
    """The hotpot-mini fixture as another index in the same home (embeddings come from the
    home's cache), for tests whose processes must own their own Milvus Lite file."""
    copy = settings.replace(index=index)
    ingest(HOTPOT, copy)
    return copy


@pytest.fixture(scope="session")
def es_url(tmp_path_factory):
    """A real cluster when BRANCHSEARCH_ES_URL is set, else the noida-db emulator on a free port."""
    url = os.environ.get("BRANCHSEARCH_ES_URL")
    if url:
        yield url
        return
    from es_emulator import start_es_emulator

    with start_es_emulator(tmp_path_factory.mktemp("es")) as emulator:
        yield emulator.url



@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI (`BRANCHSEARCH_CI=1`, set by .ci/run) a skipped test is a failure: every component
    the suite needs is installed there, so a skip means something is missing or broken."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("BRANCHSEARCH_CI") == "1" and report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, where every component is installed: {reason}"


@pytest.fixture(scope="session")
def milvus_uri(tmp_path_factory):
    """BRANCHSEARCH_MILVUS_URI when set, else a standalone Milvus started for this session."""
    uri = os.environ.get("BRANCHSEARCH_MILVUS_URI")
    if uri:
        yield uri
        return
    try:
        from milvus_server import start_milvus_server
        import milvus  # noqa: F401
    except ImportError:
        pytest.skip("the `milvus` package is not installed (pip install -e '.[test]')")
    with ExitStack() as stack:
        try:
            server = stack.enter_context(start_milvus_server(tmp_path_factory.mktemp("milvus")))
        except RuntimeError as exc:
            pytest.skip(f"a Milvus server could not start here: {exc}")
        yield server.uri
