"""A batch on one machine answers in the batch process and worker processes
(`execution.processes`): the default hybrid index on Milvus Lite, whose file the batch process
owns, is searched by every worker through the owner's server; results equal the one-process
batch, question by question, whichever process answered."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import HOTPOT, ingest_copy


def _batch(settings, inp, out, *extra):
    cmd = [sys.executable, "-m", "branchsearch.orchestrator.cli", "batch", str(inp), "-o",
           str(out), "--home", str(settings.home), "--index", settings.index, *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "RAY_ADDRESS": ""})
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    return {row["id"]: row for row in map(json.loads, out.read_text().splitlines())}


def test_worker_processes_give_the_one_process_results_on_a_lite_index(hotpot_settings,
                                                                        tmp_path):
    settings = ingest_copy(hotpot_settings, "hotpot-processes")
    queries = [json.loads(line) for line in (HOTPOT / "queries.jsonl").read_text().splitlines()]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": q["_id"], "question": q["text"]}) + "\n"
                           for q in queries))
    one = _batch(settings, inp, tmp_path / "one.jsonl", "--concurrency", "1")
    many = _batch(settings, inp, tmp_path / "many.jsonl", "--concurrency", "3")
    assert sorted(one) == sorted(many) == sorted(q["_id"] for q in queries)
    for qid, row in one.items():
        assert row["status"] == many[qid]["status"] == "ok"
        assert row["ranked_chunk_ids"] == many[qid]["ranked_chunk_ids"], qid
    # the owner released the file: a later one-process run opens it again
    again = _batch(settings, inp, tmp_path / "again.jsonl", "--concurrency", "1")
    assert {k: r["ranked_chunk_ids"] for k, r in again.items()} == \
        {k: r["ranked_chunk_ids"] for k, r in one.items()}


def test_a_busy_batch_process_hands_questions_to_a_worker(hotpot_settings):
    from branchsearch.orchestrator.driver import open_driver
    from branchsearch.orchestrator.execution.processes import QuestionProcesses

    settings = ingest_copy(hotpot_settings, "hotpot-handover")
    questions = [json.loads(line)["text"] for line in
                 (HOTPOT / "queries.jsonl").read_text().splitlines()][:4]
    processes = QuestionProcesses(settings, workers=1)
    try:
        assert processes.wait_started() == ""
        here = [processes.search(q) for q in questions]  # free: this process answers
        with processes._free:  # busy (as with another question): a worker answers
            there = [processes.search(q) for q in questions]
    finally:
        processes.close()
    assert {b["pid"] for r in here for b in r["branches"]} == {os.getpid()}
    assert os.getpid() not in {b["pid"] for r in there for b in r["branches"]}
    assert [r["ranked_chunk_ids"] for r in here] == [r["ranked_chunk_ids"] for r in there]
    # closed, the file is this process's to open again: a plain driver gives the same
    driver = open_driver(settings, "local")
    try:
        assert [driver.search(q).to_dict()["ranked_chunk_ids"] for q in questions] == \
            [r["ranked_chunk_ids"] for r in here]
    finally:
        driver.close()


def test_a_lite_server_that_dies_under_a_batch_is_started_again_for_every_process(
        hotpot_settings):
    """The batch process owns the Lite file and its workers reach its server through a socket:
    a server killed mid-batch left every later question failing (the workers had no way to
    start it). The batch process's watchdog starts it again and points the socket at it; the
    worker's and this process's next questions are answered as before the kill."""
    import signal

    from milvus_lite.server_manager import server_manager_instance

    from branchsearch.orchestrator.execution.processes import QuestionProcesses

    # a deadline well above the watchdog's restart, short enough that without it the
    # questions fail rather than wait for minutes
    settings = ingest_copy(hotpot_settings, "hotpot-lite-dies").replace(
        backend_timeout_s=15.0, backend_retries=0)
    questions = [json.loads(line)["text"] for line in
                 (HOTPOT / "queries.jsonl").read_text().splitlines()][:3]
    key = str((settings.index_dir / "dense.db").resolve())
    processes = QuestionProcesses(settings, workers=1)
    try:
        assert processes.wait_started() == ""
        with processes._free:  # a worker answers
            before = [processes.search(q) for q in questions]
        for kill in range(2):
            dead = server_manager_instance._servers[key]
            os.kill(dead._p.pid, signal.SIGKILL)
            dead._p.wait()
            with processes._free:
                there = [processes.search(q) for q in questions]
            here = [processes.search(q) for q in questions]  # this process, through the socket
            for answers in (there, here):
                assert [r["status"] for r in answers] == ["ok"] * len(questions), answers
                assert [r["ranked_chunk_ids"] for r in answers] == \
                    [r["ranked_chunk_ids"] for r in before]
            assert server_manager_instance._servers[key] is not dead
    finally:
        processes.close()
    assert key not in server_manager_instance._servers  # closed: the watchdog started nothing


def test_workers_that_cannot_start_leave_the_batch_to_this_process(hotpot_settings, capsys):
    """A worker that fails to start (here: its settings name an index that is not there) is
    one line on stderr; the questions are answered here, none waits for a worker."""
    import multiprocessing

    from branchsearch.orchestrator.execution.processes import QuestionProcesses

    settings = ingest_copy(hotpot_settings, "hotpot-broken-workers")
    question = json.loads((HOTPOT / "queries.jsonl").read_text().splitlines()[0])["text"]
    processes = QuestionProcesses(settings, workers=0)
    try:
        processes._start_workers(multiprocessing.get_context("forkserver"), 1,
                                 (settings.replace(index="no-such-index"), {}, os.getpid()))
        assert processes.pool is None and "no-such-index" in processes._broken
        assert "worker processes could not start" in capsys.readouterr().err
        with processes._free:  # busy: still nobody else to ask; answered once free
            import threading

            answer = []
            asking = threading.Thread(target=lambda: answer.append(processes.search(question)))
            asking.start()
            asking.join(0.5)
            assert not answer  # it waits for this process, not for a worker
        asking.join(120)
        assert answer[0]["status"] == "ok"
        assert {b["pid"] for b in answer[0]["branches"]} == {os.getpid()}
    finally:
        processes.close()


def test_killed_batch_leaves_no_worker_behind(hotpot_settings, tmp_path):
    """SIGKILL runs no clean-up: the workers notice their batch is gone and end, and with them
    the fork server."""
    import signal
    import time

    import psutil

    settings = ingest_copy(hotpot_settings, "hotpot-killed")
    queries = [json.loads(line)["text"] for line in
               (HOTPOT / "queries.jsonl").read_text().splitlines()]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": f"{i}", "question": queries[i % len(queries)]})
                           + "\n" for i in range(3000)))
    proc = subprocess.Popen([sys.executable, "-m", "branchsearch.orchestrator.cli", "batch",
                             str(inp), "-o", str(out), "--home", str(settings.home), "--index",
                             settings.index, "--concurrency", "2"],
                            env={**os.environ, "RAY_ADDRESS": ""}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and (not out.exists() or out.read_text().count("\n") < 3):
        time.sleep(0.1)
    helpers = psutil.Process(proc.pid).children(recursive=True)
    assert helpers, "the batch should run worker processes"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    gone, alive = psutil.wait_procs(helpers, timeout=20)
    for p in alive:  # do not leave them to the next test
        p.kill()
    assert not alive, [p.pid for p in alive]


def test_a_worker_that_dies_loses_no_question_and_the_workers_start_again(hotpot_settings,
                                                                           capsys):
    """A worker process killed (as the OOM killer would) breaks the whole process pool: the
    question sent to it is answered in this process, one line says so, and a new pool
    starts."""
    import signal
    import threading
    import time

    from branchsearch.orchestrator.execution.processes import QuestionProcesses

    settings = ingest_copy(hotpot_settings, "hotpot-worker-dies")
    questions = [json.loads(line)["text"] for line in
                 (HOTPOT / "queries.jsonl").read_text().splitlines()][:3]
    processes = QuestionProcesses(settings, workers=1)
    answered: list[dict] = []
    try:
        assert processes.wait_started() == ""
        old = processes.pool
        with processes._free:  # this process busy (another question): the worker answers
            first = [processes.search(q) for q in questions]
            os.kill(next(iter(old._processes)), signal.SIGKILL)
            time.sleep(0.5)
            asking = threading.Thread(target=lambda: answered.append(
                processes.search(questions[0])))
            asking.start()  # sent to the dead pool; then waits for this process
            deadline = time.time() + 60
            while processes.pool is old and time.time() < deadline:
                time.sleep(0.05)
        asking.join(timeout=120)
        assert processes.wait_started() == ""
        assert processes.pool is not None and processes.pool is not old  # started again
        with processes._free:
            again = [processes.search(q) for q in questions]
    finally:
        processes.close()
    ranked = [r["ranked_chunk_ids"] for r in first]
    assert answered[0]["ranked_chunk_ids"] == ranked[0]
    assert {b["pid"] for b in answered[0]["branches"]} == {os.getpid()}
    assert [r["ranked_chunk_ids"] for r in again] == ranked
    assert os.getpid() not in {b["pid"] for r in again for b in r["branches"]}
    assert "a worker process died" in capsys.readouterr().err


def test_a_resume_with_nothing_left_to_ask_starts_no_search(hotpot_settings, tmp_path):
    """A re-run whose every id is ok already rewrites its output and ends: it opened the
    driver and started worker processes, then waited for them to load, to ask nothing (7-20 s
    on this machine, where `indexes` takes 0.4 s)."""
    import time

    settings = ingest_copy(hotpot_settings, "hotpot-nothing-left")
    queries = [json.loads(line) for line in (HOTPOT / "queries.jsonl").read_text().splitlines()]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": q["_id"], "question": q["text"]}) + "\n"
                           for q in queries[:2]))
    out = tmp_path / "out.jsonl"
    first = _batch(settings, inp, out, "--concurrency", "2")
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "branchsearch.orchestrator.cli", "indexes", "--home",
                    str(settings.home)], capture_output=True, timeout=120)
    cli = time.monotonic() - start  # a command that opens no index: the CLI's own start
    start = time.monotonic()
    again = _batch(settings, inp, out, "--concurrency", "2")
    took = time.monotonic() - start
    assert again == first
    assert took < cli + 3.0, (took, cli)
