"""A `--executor ray` batch killed with `kill -9` (the OOM killer, a scheduler's preemption)
leaves no process of the Ray cluster it started, and the same command resumes it to one line per
question. Real components: the CLI in a subprocess, its local Ray cluster, Milvus Lite, tantivy."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil

from conftest import HOTPOT, ingest_copy

CLI = [sys.executable, "-m", "branchsearch.orchestrator.cli"]


def _questions(path, copies: int) -> list[str]:
    """hotpot-mini's questions `copies` times under ids of their own: enough for a batch to be
    caught in the middle."""
    rows = [json.loads(line) for line in (HOTPOT / "queries.jsonl").read_text().splitlines()]
    ids = []
    with path.open("w") as f:
        for k in range(copies):
            for row in rows:
                ids.append(f"{row['_id']}-{k}")
                f.write(json.dumps({"id": ids[-1], "question": row["text"]}) + "\n")
    return ids


def _running(procs: list[psutil.Process]) -> list[str]:
    alive = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{proc.pid} {proc.name()}")
        except psutil.NoSuchProcess:
            pass
    return alive


def _lines(path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_a_killed_ray_batch_leaves_no_process_of_its_cluster_and_resumes_whole(
        hotpot_settings, tmp_path):
    settings = ingest_copy(hotpot_settings, "killed-ray")
    ids = _questions(tmp_path / "q.jsonl", copies=8)
    out, err = tmp_path / "out.jsonl", tmp_path / "stderr.txt"
    command = [*CLI, "batch", str(tmp_path / "q.jsonl"), "-o", str(out), "--home",
               str(settings.home), "--index", "killed-ray", "--executor", "ray"]
    with err.open("w") as stderr:
        batch = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        end = time.monotonic() + 240
        while _lines(out) < 3 and batch.poll() is None and time.monotonic() < end:
            time.sleep(0.2)
        assert batch.poll() is None and 3 <= _lines(out) < len(ids), err.read_text()[-2000:]
        cluster = psutil.Process(batch.pid).children(recursive=True)
        names = " ".join(proc.name() for proc in cluster)
        assert "raylet" in names and "RuntimeEnvAgent" in names, names
    finally:
        os.kill(batch.pid, signal.SIGKILL)
        batch.wait()
    # Ray's agents saw their raylet die at once, then waited 60 s on the dead GCS
    end = time.monotonic() + 15
    while _running(cluster) and time.monotonic() < end:
        time.sleep(0.25)
    assert _running(cluster) == [], f"left running after kill -9: {_running(cluster)}"
    said = [line for line in err.read_text().splitlines() if "Ray cluster" in line]
    assert len(said) == 1 and f"process {batch.pid} ended" in said[0], said

    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["id"] for row in rows] == ids  # none lost, none twice, in input order
    assert all(row["status"] == "ok" for row in rows)


def test_a_sigterm_to_a_ray_batchs_group_ends_it_within_seconds(hotpot_settings, tmp_path):
    """A scheduler's SIGTERM to the whole process group of a running `--executor ray` batch
    reaches its local cluster too: the GCS closes its port (and does not end), the raylet
    ends 10 s later. The batch waited 10 s to call the cluster lost, then Ray's shutdown 5 s
    to send task events to the dead GCS and a second's grace to each process left: 9-20 s
    (median 10.2 s of 3 on this machine). A cluster this process started is lost once its
    GCS refuses connections, and what is left of it is killed: about 3 s. The rows written
    stay whole, no process of the cluster stays, and the exit says `terminated` (143)."""
    settings = ingest_copy(hotpot_settings, "sigterm-ray")
    ids = _questions(tmp_path / "q.jsonl", copies=8)
    out = tmp_path / "out.jsonl"
    command = [*CLI, "batch", str(tmp_path / "q.jsonl"), "-o", str(out), "--home",
               str(settings.home), "--index", "sigterm-ray", "--executor", "ray"]
    batch = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)  # its own group, as a job's
    try:
        end = time.monotonic() + 240
        while _lines(out) < 3 and batch.poll() is None and time.monotonic() < end:
            time.sleep(0.2)
        assert batch.poll() is None and 3 <= _lines(out) < len(ids)
        cluster = psutil.Process(batch.pid).children(recursive=True)
        sent = time.monotonic()
        os.killpg(batch.pid, signal.SIGTERM)
        _, stderr = batch.communicate(timeout=120)
        took = time.monotonic() - sent
    finally:
        if batch.poll() is None:
            batch.kill()
            batch.wait()
    assert batch.returncode == 143, stderr[-2000:]
    assert stderr.splitlines()[-1].startswith("terminated") and "Traceback" not in stderr
    assert took < 6.0, f"{took:.1f} s from SIGTERM to exit"
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and all(row["status"] == "ok" for row in rows)
    written = [row["id"] for row in rows]
    assert len(set(written)) == len(written) and set(written) <= set(ids)  # once each
    end = time.monotonic() + 15
    while _running(cluster) and time.monotonic() < end:
        time.sleep(0.25)
    assert _running(cluster) == [], f"left running: {_running(cluster)}"
