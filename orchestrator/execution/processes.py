"""Whole questions in parallel processes on one machine: the batch's answer to the GIL.

A question's branches run in-process (`local`): its policy, harness and token counting are
Python, so one process answers one question at a time at most one core's worth, and threads add
nothing past the first. A batch with `concurrency` > 1 therefore runs its questions in worker
processes, as many as the machine has cores (at most `concurrency`); each opens the index itself
with its own in-process driver. The docstore and tantivy read concurrently from any number of
processes. A Milvus Lite file has one owning process: this one owns it, and the workers reach
its Lite server through that server's socket (`infra.stores.milvus.serve_lite`).

Workers come from a fork server that imported the heavy modules once, so start-up (the
embedder, the tokenizer) is paid once per worker, in parallel, and before the first question.
"""

from __future__ import annotations

import multiprocessing.forkserver
import os
from concurrent.futures import ProcessPoolExecutor

from branchsearch.infra.config.settings import Settings

_PRELOAD = ["branchsearch.orchestrator.driver", "branchsearch.workers.heuristic.policy",
            "branchsearch.infra.models.embedder", "branchsearch.infra.stores.milvus",
            "branchsearch.infra.stores.tantivy", "sentence_transformers"]

_driver = None  # this worker's driver
_failed: BaseException | None = None  # or why it could not start


def worker_count(concurrency: int) -> int:
    """Worker processes for `concurrency` questions in flight: one a core, at most that."""
    return max(1, min(concurrency, os.cpu_count() or 1))


def _watch(owner: int) -> None:
    """End this worker once the batch process is gone (killed, it closes nothing: its workers
    would wait for questions forever)."""
    import time

    while True:
        time.sleep(1.0)
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            os._exit(1)
        except PermissionError:  # alive, another user's: not ours to judge
            pass


def _start(settings: Settings, served: dict[str, str], owner: int) -> None:
    global _driver, _failed
    import threading

    threading.Thread(target=_watch, args=(owner,), name="watch-batch", daemon=True).start()
    try:
        import signal

        import torch

        signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C is the batch's to handle: it stops
        # starting questions and waits for these, whose rows are then written whole

        torch.set_num_threads(1)  # a query's embedding is small; the cores go to the workers
        from branchsearch.infra.stores.milvus import use_served_lite
        from branchsearch.orchestrator.driver import open_driver

        for db, socket in served.items():
            use_served_lite(db, socket)
        _driver = open_driver(settings, "local")
    except BaseException as exc:  # noqa: BLE001 — said by every question this worker gets
        _failed = exc


def _search(question: str, acl_groups) -> dict:
    if _failed is not None:
        raise _failed
    return _driver.search(question, acl_groups=acl_groups).to_dict()


def _ready() -> bool:
    if _failed is not None:
        raise _failed
    return True


class QuestionProcesses:
    """`search(question) -> result dict` on `workers` processes; `close()` stops them."""

    def __init__(self, settings: Settings, workers: int, acl_groups=None):
        from branchsearch.infra.index.open import check_readable
        from branchsearch.infra.index.profile import index_profile

        check_readable(settings)  # one line here rather than one per question
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(_PRELOAD)
        multiprocessing.forkserver.ensure_running()  # imports while the Lite server starts
        self.acl_groups = acl_groups
        self._owner = None
        served: dict[str, str] = {}
        profile = index_profile(settings)
        if profile.lite_file:  # this process owns the file; the workers use its server
            from branchsearch.infra.index.open import dense_store, open_retriever
            from branchsearch.infra.stores.milvus import serve_lite

            if profile.manifest is not None:  # an owned index: its dense store alone
                self._owner = dense_store(settings, profile.manifest.embedding["dim"],
                                          create=False)
            else:  # an external index on a Lite file: opened as a reader does
                self._owner = open_retriever(settings)
            served[profile.lite_file] = serve_lite(profile.lite_file)
        self.pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_start,
                                        initargs=(settings, served, os.getpid()))
        try:  # every worker started, or the reason one could not
            for future in [self.pool.submit(_ready) for _ in range(workers)]:
                future.result()
        except BaseException:
            self.close()
            raise

    def search(self, question: str) -> dict:
        return self.pool.submit(_search, question, self.acl_groups).result()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self._owner is not None:
            self._owner.close()
            self._owner = None

