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
        for sig in ("-TERM", "-KILL"):
            subprocess.run(["pkill", sig, "-f", temp])
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
