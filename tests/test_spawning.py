"""How the tests start processes: never through a `preexec_fn` (conftest.prepared says why: with
gRPC loaded in the pytest process, as in any full run, the child sometimes died of SIGABRT before
its command ran; `test_a_file_size_limit_during_ingest_is_one_line_and_a_rerun_resumes` failed so
in CI and passed alone)."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
from pathlib import Path


TESTS = Path(__file__).parent


def test_no_test_starts_a_process_with_a_preexec_fn():
    found = [f"{path.relative_to(TESTS)}:{node.lineno}"
             for path in sorted(TESTS.rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text(), str(path)))
             if isinstance(node, ast.keyword) and node.arg == "preexec_fn"]
    assert not found, f"use conftest.prepared instead of a preexec_fn: {found}"


def test_a_prepared_command_starts_while_grpc_runs_in_this_process():
    """gRPC's event engine polling (a channel retrying a closed port) in this process, and a
    long PATH for the exec to walk: a child forked with a preexec_fn that sets the same limit
    aborted here in 4 to 8 of 20 starts (grpcio 1.85); a prepared one never does, and gets the
    file-size limit and SIGINT as asked."""
    import grpc

    from conftest import prepared

    channel = grpc.insecure_channel("127.0.0.1:1")
    grpc.channel_ready_future(channel)  # connects, and keeps retrying, on gRPC's threads
    try:
        probe = ("import resource, signal\n"
                 "status = dict(line.split(':\\t') for line in open('/proc/self/status'))\n"
                 "bit = 1 << (signal.SIGINT - 1)\n"
                 "print(resource.getrlimit(resource.RLIMIT_FSIZE)[0], "
                 "bool(int(status['SigIgn'], 16) & bit), bool(int(status['SigBlk'], 16) & bit))")
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # as a shell's `cmd &`
        handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            done = subprocess.run(prepared([sys.executable, "-c", probe], file_size=400_000,
                                           sigint_default=True),
                                  capture_output=True, text=True, timeout=60)
        finally:
            signal.signal(signal.SIGINT, handler)
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        assert done.stdout.split() == ["400000", "False", "False"], done.stderr[-2000:]

        env = dict(os.environ, PATH=":".join(f"/nonexistent/d{i}" for i in range(3000))
                   + ":" + os.environ.get("PATH", "/usr/bin:/bin"))
        for _ in range(20):
            done = subprocess.run(prepared(["true"], file_size=400_000), env=env,
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    finally:
        channel.close()
