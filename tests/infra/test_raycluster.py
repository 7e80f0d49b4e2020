"""Joining a Ray cluster that uses token authentication (Ray 2.60's `ray start` default): the
right token connects; a wrong or missing one is one line naming what to set, without the line
a second Ray's core prints while it retries."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from store_copy import copy_store

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
CONNECT = ("from branchsearch.infra.raycluster import connect\n"
           "from branchsearch.infra.config.settings import Settings\n"
           "import sys\n"
           "print('cpus', connect(Settings(ray_address=sys.argv[1]))['CPU'])\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def token_cluster():
    """A one-CPU head started with `ray start` and a token of its own; stopped by its
    processes (never `ray stop`, which stops every cluster on the machine)."""
    temp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # Ray's socket paths must stay short
    token, port = secrets.token_hex(16), _free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token,
           "RAY_ADDRESS": ""}
    subprocess.run([RAY, "start", "--head", "--port", str(port), "--temp-dir", temp,
                    "--num-cpus", "1", "--include-dashboard", "false",
                    "--disable-usage-stats"], env=env, check=True, capture_output=True,
                   timeout=120)
    try:
        yield f"127.0.0.1:{port}", token
    finally:
        _stop_head(temp, port)


def _stop_head(temp: str, port: int) -> None:
    """Stop the processes of the head started with `--temp-dir temp --port port`, by their
    command lines (never `ray stop`): those naming the folder, and `ray start`'s client
    server, which names no folder, by its cluster's port."""
    for sig in ("-TERM", "-KILL"):
        subprocess.run(["pkill", sig, "-f", temp])
        subprocess.run(["pkill", sig, "-f", f"ray.util.client.server --address=[^ ]*:{port} "])
        time.sleep(2)


def _connect(address: str, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    return subprocess.run([sys.executable, "-c", CONNECT, address], capture_output=True,
                          text=True, timeout=180,
                          env={**environ, "RAY_ADDRESS": "", "HOME": tempfile.mkdtemp(), **env})


def test_the_clusters_token_connects(token_cluster):
    address, token = token_cluster
    done = _connect(address, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    assert done.returncode == 0 and "cpus 1.0" in done.stdout, done.stderr[-2000:]


@pytest.mark.parametrize("env", [{"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 32},
                                 {"RAY_AUTH_MODE": "disabled"}], ids=["wrong", "none"])
def test_a_refused_token_is_one_line_naming_what_to_set(token_cluster, env):
    address, _ = token_cluster
    done = _connect(address, **env)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "token authentication" in last and "RAY_AUTH_MODE=token" in last, last
    assert "InvalidAuthToken" not in done.stderr


HOLD = ("import ray, sys\n"
        "ray.init(address=sys.argv[1], log_to_driver=False)\n"
        "@ray.remote(num_cpus=2)\n"
        "class Holder:\n"
        "    def ping(self):\n"
        "        return 1\n"
        "h = Holder.options(name='holder', lifetime='detached').remote()\n"
        "ray.get(h.ping.remote(), timeout=120)\n"
        "import time\n"  # the cluster's view of free CPUs trails the actor's start by a report
        "end = time.monotonic() + 30\n"
        "while ray.available_resources().get('CPU', 0) > 1 and time.monotonic() < end:\n"
        "    time.sleep(0.2)\n"
        "print('held', ray.available_resources().get('CPU', 0))\n")


def test_a_batch_joining_a_busy_cluster_plans_on_its_free_cpus(hotpot_settings, tmp_path):
    """`batch --address` on a 3-CPU cluster whose other job (a service, another batch) holds 2
    CPUs planned its actors for all 3: they waited for CPUs that were not coming, and the batch
    stopped at the start timeout. It now plans on the free CPU and answers every question."""
    import json

    temp = tempfile.mkdtemp(prefix="rb", dir="/tmp")
    token, port = secrets.token_hex(16), _free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "RAY_ADDRESS": ""}
    subprocess.run([RAY, "start", "--head", "--port", str(port), "--temp-dir", temp,
                    "--num-cpus", "3", "--include-dashboard", "false",
                    "--disable-usage-stats"], env=env, check=True, capture_output=True,
                   timeout=120)
    address = f"127.0.0.1:{port}"
    try:
        held = subprocess.run([sys.executable, "-c", HOLD, address], env=env, text=True,
                              capture_output=True, timeout=180)
        assert "held 1.0" in held.stdout, held.stderr[-2000:]
        home = tmp_path / "home"
        copy_store(hotpot_settings.index_dir, home / "indexes" / "hotpot")
        questions = tmp_path / "q.jsonl"
        questions.write_text("".join(json.dumps({"id": i, "question": q}) + "\n" for i, q in
                                     enumerate(["Who directed Ed Wood?",
                                                "Were Scott Derrickson and Ed Wood of the same "
                                                "nationality?"])))
        out = tmp_path / "out.jsonl"
        done = subprocess.run(
            [sys.executable, "-m", "branchsearch.orchestrator.cli", "batch", str(questions),
             "-o", str(out), "--home", str(home), "--index", "hotpot", "--address", address],
            env={**env, "BRANCHSEARCH_ACTOR_START_TIMEOUT_S": "60"}, text=True,
            capture_output=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        assert [r["status"] for r in rows] == ["ok", "ok"] and all(r["evidence"] for r in rows)
    finally:
        _stop_head(temp, port)


KILL_AN_ACTOR = (
    "import logging, os, signal, sys, time\n"
    "import ray\n"
    "from branchsearch.infra.raycluster import connect\n"
    "from branchsearch.infra.config.settings import Settings\n"
    "said = []\n"
    "class Keep(logging.Handler):\n"
    "    def emit(self, record):\n"
    "        said.append(record.getMessage())\n"
    "logging.getLogger('branchsearch.ray').addHandler(Keep())\n"
    "logging.getLogger('branchsearch.ray').setLevel(logging.INFO)\n"
    "connect(Settings())\n"
    "@ray.remote(num_cpus=0)\n"
    "class Actor:\n"
    "    def pid(self):\n"
    "        return os.getpid()\n"
    "actor = Actor.remote()\n"
    "os.kill(ray.get(actor.pid.remote(), timeout=120), signal.SIGKILL)\n"
    "try:\n"
    "    ray.get(actor.pid.remote(), timeout=60)\n"
    "except ray.exceptions.RayActorError:\n"
    "    pass\n"
    "end = time.monotonic() + 20\n"  # Ray's notice of the death comes a poll later
    "while not said and time.monotonic() < end:\n"
    "    time.sleep(0.2)\n"
    "time.sleep(1)\n"
    "print('logged:', said[0][:60] if said else None, file=sys.stderr)\n"
    "print('done')\n")


def test_a_worker_process_that_died_is_logged_not_printed_on_stdout(tmp_path):
    """A Ray actor process killed under a driver (a branch actor `kill -9`ed, one the OOM
    killer took, a node lost): Ray's driver printed its notice on stdout ("(raylet) A worker
    died or was killed …", a lost node's 40-line raylet state dump) in the middle of a batch's
    summary. It now goes to the `branchsearch.ray` log, and stdout holds only what the
    program printed."""
    done = subprocess.run([sys.executable, "-c", KILL_AN_ACTOR], capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, "RAY_ADDRESS": "", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "done\n", done.stdout[-2000:]
    assert "logged: ray: A worker died or was killed" in done.stderr, done.stderr[-2000:]
