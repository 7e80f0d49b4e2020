"""Whole questions in parallel processes on one machine: the batch's answer to the GIL.

A question's branches run in-process (`local`): its policy, harness and token counting are
Python, so one process answers one question at a time at most one core's worth, and threads add
nothing past the first. A batch with `concurrency` > 1 therefore answers in as many processes
as the machine has cores (at most `concurrency`): this one and worker processes, each with its
own in-process driver. The docstore and tantivy read concurrently from any number of processes.
A Milvus Lite file has one owning process: this one owns it, and the workers reach its Lite
server through that server's socket (`infra.stores.milvus_lite.serve_lite`), which this process
keeps alive: a Lite server that dies under the batch is started again within a second.

Workers come from a fork server that imports the heavy modules (torch, the embedder) afresh —
seconds on a small machine. This process answers questions from the start, so the batch is
never slower than one process while they start, and they join as each is ready.
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
    """Worker processes beside this one for `concurrency` questions in flight: one process a
    core in all, at most `concurrency`."""
    return max(0, min(concurrency, os.cpu_count() or 1) - 1)


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

        for sig in (signal.SIGINT, signal.SIGTERM):  # ^C and a scheduler's stop, sent to
            signal.signal(sig, signal.SIG_IGN)  # the whole group, are the batch's to handle:
        # it stops starting questions and waits for these, whose rows are then written whole
        # (`close` ends the workers; `_watch` ends them if the batch dies)

        torch.set_num_threads(1)  # a query's embedding is small; the cores go to the workers
        from branchsearch.infra.stores.milvus_lite import use_served_lite
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


def _start_fork_server() -> None:
    """Start the fork server ignoring ^C and SIGTERM (an ignored signal stays ignored across
    fork and exec): one sent to the process group while it imports would print its traceback
    and end it; the batch handles them itself."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        multiprocessing.forkserver.ensure_running()  # signal handlers are the main thread's
        return
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for sig, was in old.items():
            signal.signal(sig, was)


MAX_RESTARTS = 3  # worker pools started again after one of their processes died


class QuestionProcesses:
    """`search(question) -> result dict` in this process and `workers` worker processes;
    `close()` stops them. A question goes to this process when it is free, else to a worker
    once they have started (until then, it waits for this process)."""

    def __init__(self, settings: Settings, workers: int, acl_groups=None):
        import threading

        from branchsearch.infra.index.open import check_readable
        from branchsearch.infra.index.profile import index_profile
        from branchsearch.orchestrator.driver import open_driver

        check_readable(settings)  # one line here rather than one per question
        self.acl_groups = acl_groups
        self._owner = self._local = self.pool = self._lite = self._starter = None
        self._free = threading.Lock()  # held while this process answers a question
        self._free_pool = threading.Lock()  # one question retires a broken pool
        self._broken = ""  # why the workers could not start: then this process answers alone
        served: dict[str, str] = {}
        profile = index_profile(settings)
        try:
            if workers:  # the fork server imports on its own core while this process opens
                context = multiprocessing.get_context("forkserver")
                context.set_forkserver_preload(_PRELOAD)
                _start_fork_server()
            if profile.lite_file and workers:  # this process owns the file; all use its server
                from branchsearch.infra.index.open import dense_store, open_retriever
                from branchsearch.infra.stores.milvus_lite import serve_lite, use_served_lite

                if profile.manifest is not None:  # an owned index: its dense store alone
                    self._owner = dense_store(settings, profile.manifest.embedding["dim"],
                                              create=False)
                else:  # an external index on a Lite file: opened as a reader does
                    self._owner = open_retriever(settings)
                served[profile.lite_file] = serve_lite(profile.lite_file)
                self._lite = profile.lite_file  # this process's driver goes through it too:
                use_served_lite(self._lite, served[self._lite])  # closing it stops nothing
            self._local = open_driver(settings, "local")
            if workers:  # starting a worker blocks until the fork server has imported
                self._start = (context, workers, (settings, served, os.getpid()))
                self._restarts = 0
                self._starter = threading.Thread(
                    target=self._start_workers, name="batch-workers", daemon=True,
                    args=self._start)
                self._starter.start()
        except BaseException:
            self.close()
            raise

    def _start_workers(self, context, workers: int, initargs: tuple) -> None:
        """Start the workers; they take questions once every one has started. One that fails
        leaves the questions to this process, with one line saying why."""
        from concurrent.futures import wait

        pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_start,
                                   initargs=initargs)
        try:
            started = [pool.submit(_ready) for _ in range(workers)]
            wait(started)
            for future in started:
                future.result()
        except Exception as exc:  # noqa: BLE001 — said once; the batch goes on here
            import sys

            from branchsearch.infra.errors import error_line

            self._broken = error_line(exc, 300)
            pool.shutdown(wait=False, cancel_futures=True)
            print(f"batch: worker processes could not start ({self._broken}); answering in "
                  "this process alone", file=sys.stderr)
            return
        self.pool = pool

    def wait_started(self) -> str:
        """Wait until the workers have started; "" or why they could not."""
        if self._starter is not None:
            self._starter.join()
        return self._broken

    def search(self, question: str) -> dict:
        from concurrent.futures.process import BrokenProcessPool

        pool = self.pool  # None until every worker has started
        if pool is not None and not self._free.acquire(blocking=False):
            try:
                return pool.submit(_search, question, self.acl_groups).result()
            except BrokenProcessPool as exc:  # a worker died (killed, out of memory)
                self._lost_workers(pool, exc)
            self._free.acquire()  # then this question is answered here
        elif pool is None:
            self._free.acquire()
        try:
            return self._answer(question)
        finally:
            self._free.release()

    def _lost_workers(self, pool, exc: BaseException) -> None:
        """A worker process died, which breaks the whole pool: this process answers alone
        while a new pool starts (at most MAX_RESTARTS times a batch; then alone to the end).
        The questions the dead pool held are answered again, here."""
        import sys
        import threading

        from branchsearch.infra.errors import error_line

        with self._free_pool:
            if self.pool is not pool:  # another question saw it first
                return
            self.pool = None
            pool.shutdown(wait=False, cancel_futures=True)
            again = self._restarts < MAX_RESTARTS
            print(f"batch: a worker process died ({error_line(exc, 200)}); "
                  + ("answering in this process while new workers start" if again
                     else "answering in this process alone"), file=sys.stderr)
            if again:
                self._restarts += 1
                self._starter = threading.Thread(target=self._start_workers, args=self._start,
                                                 name="batch-workers", daemon=True)
                self._starter.start()

    def _answer(self, question: str) -> dict:
        return self._local.search(question, acl_groups=self.acl_groups).to_dict()

    def close(self) -> None:
        if self._starter is not None:  # a worker mid-start is stopped once it has started
            self._starter.join()
            self._starter = None
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        if self._local is not None:
            self._local.close()
            self._local = None
        if self._lite is not None:
            from branchsearch.infra.stores.milvus_lite import stop_serving_lite, use_served_lite

            use_served_lite(self._lite, None)
            stop_serving_lite(self._lite)
            self._lite = None
        if self._owner is not None:
            self._owner.close()
            self._owner = None
