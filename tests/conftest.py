"""Shared fixtures: real embedded backends on small shipped corpora, started once per session."""

from __future__ import annotations

import os
import subprocess
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from branchsearch.infra.ingest.pipeline import ingest
from branchsearch.infra.config.settings import load_settings

FIXTURES = Path(__file__).parent / "fixtures"
HOTPOT = FIXTURES / "hotpot-mini"
MUSIQUE = FIXTURES / "musique-mini"


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
