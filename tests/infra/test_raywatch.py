"""The watch over a started local Ray cluster (`infra/raywatch.py`): once the cluster's roots
are gone it stops exactly the processes that were under them, says so only when the driver
ended without stopping its cluster, and leaves every other process alone. Real processes: a
driver, its root, an orphan-to-be, a stranger; then a real local Ray cluster shut down cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from branchsearch.infra import raywatch

# a root that starts a child that outlives it (as Ray's agents outlive their raylet) and
# prints the child's pid
ROOT = ("import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(300)\n")
# a driver that starts the root and the watch over it, prints both pids, then sleeps
DRIVER = ("import subprocess, sys, time\n"
          "root = subprocess.Popen([sys.executable, '-c', sys.argv[1]], stdout=sys.stdout)\n"
          "time.sleep(0.5)\n"
          "watch = subprocess.Popen([sys.executable, '-I', '-S', sys.argv[2], "
          "str(__import__('os').getpid()), 'session_x', str(root.pid)], "
          "start_new_session=True)\n"
          "print(root.pid, watch.pid, flush=True)\n"
          "time.sleep(300)\n")


def _gone(pid: int, within: float) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in "ZX":
                    return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


def test_a_killed_driver_leaves_nothing_under_its_roots_and_a_stranger_alone(tmp_path):
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    err = tmp_path / "stderr.txt"
    with err.open("w") as stderr:
        driver = subprocess.Popen([sys.executable, "-c", DRIVER, ROOT, raywatch.__file__],
                                  stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        child = int(driver.stdout.readline())
        root, watch = map(int, driver.stdout.readline().split())
        time.sleep(2 * raywatch.NOTE_S)  # the child noted while its root runs
        os.kill(root, signal.SIGKILL)  # as PR_SET_PDEATHSIG kills the raylet with the driver
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        assert _gone(child, 10), "the child its root left still runs"
        assert _gone(watch, 10), "the watch did not end"
        assert stranger.poll() is None  # never noted: not under a root
    finally:
        stranger.kill()
        stranger.wait()
    said = err.read_text().splitlines()
    assert len(said) == 1 and said[0].startswith(
        f"branchsearch: process {driver.pid} ended without stopping the Ray cluster it started "
        "(session_x); stopped the 1 process(es) it left: python"), said


def _connected(ray_address: str, then: str) -> subprocess.CompletedProcess:
    """A Python process that connects (`raycluster.connect`, the default settings) with
    RAY_ADDRESS `ray_address`, runs `then` (`ray` and `_WATCHES` in scope) and exits (Ray's
    exit hook shuts the cluster down)."""
    script = ("import ray\n"
              "from branchsearch.infra.config.settings import Settings\n"
              "from branchsearch.infra.raycluster import _WATCHES, connect\n"
              "connect(Settings())\n" + then)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "RAY_ADDRESS": ray_address})
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def test_a_worker_orphaned_before_its_first_note_is_stopped_by_its_session(tmp_path):
    """A worker the raylet starts less than a note before it dies is re-parented to pid 1,
    under no root: the watch finds it by the session folder its command line names."""
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)",
                               "--session-dir=session_x"])
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    with (tmp_path / "stderr.txt").open("w") as stderr:
        driver = subprocess.Popen([sys.executable, "-c", DRIVER, ROOT, raywatch.__file__],
                                  stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        driver.stdout.readline()
        root, watch = map(int, driver.stdout.readline().split())
        time.sleep(2 * raywatch.NOTE_S)
        os.kill(root, signal.SIGKILL)
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        assert _gone(orphan.pid, 10) or orphan.poll() is not None, "the orphan still runs"
        assert _gone(watch, 10), "the watch did not end"
        assert stranger.poll() is None
    finally:
        for p in (orphan, stranger):
            p.kill()
            p.wait()


def test_a_cluster_its_driver_shut_down_ends_its_watch_without_a_word():
    done = _connected("", "print(_WATCHES[-1].pid, flush=True)\n")
    assert _gone(int(done.stdout.split()[-1]), 10), "the watch outlived its cluster"
    assert "Ray cluster" not in done.stderr, done.stderr


def test_ray_address_local_starts_a_watched_cluster_of_our_size():
    """`RAY_ADDRESS=local` is Ray's word for "start a new local cluster": it is started as one
    with no address is (the object store's 256 MB, a watch over its processes), not as a
    joined cluster (Ray's own defaults: gigabytes of object store, and after a kill -9 of the
    driver its agents left running)."""
    done = _connected("local", "store = ray.available_resources().get('object_store_memory', 0)\n"
                               "print(len(_WATCHES), int(store), flush=True)\n")
    watches, store = map(int, done.stdout.split()[-2:])
    assert watches == 1
    assert 0 < store <= 256 * 1024 * 1024
