"""A real standalone Milvus for tests and benchmarks: the PyPI package `milvus` (2.3.5).

`start_milvus_server(dir)` extracts its binary under `dir`, starts `milvus run standalone` on
free ports (gRPC proxy and metrics), waits for `/healthz`, and yields the URI. It stops the
`milvus` binary by its own PID (SIGTERM, then SIGKILL): stopping only the package's Python wrapper
can leave the binary running.

It leaves nothing in /tmp: the server's glog files go to `dir/logs` (the package's glog.conf,
`--log_dir=logs/` from the folder it starts in), and the `server_id_PID` file Milvus 2.3.5 writes
in /tmp/milvus (a path built in, no setting moves it) is removed once the binary has stopped.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass
class MilvusServerHandle:
    uri: str
    pid: int
    data_dir: Path
    started_s: float


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_pid(pid: int, grace_s: float = 15.0) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.time() + grace_s
    while time.time() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not our child: poll for it
            done = 0 if _alive(pid) else pid
        if done:
            return
        time.sleep(0.2)
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


SERVER_ID_DIR = Path("/tmp/milvus")  # Milvus 2.3.5's sessionutil writes server_id_PID here


def _forget_server_id(pid: int) -> None:
    """Remove the `server_id_PID` file the stopped binary `pid` wrote (only its own: other
    Milvus servers on the machine keep theirs; the shared folder stays)."""
    (SERVER_ID_DIR / f"server_id_{pid}").unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _own_etcd_ports(config):
    """The package's config leaves Milvus's embedded etcd on its fixed ports (client 2379, peer
    2380), so a second server on the machine panics at start ("bind: address already in use").
    Point etcd at a config file of its own with free ports (`etcd.config.path`)."""
    write = config.write_config

    def write_config() -> None:
        write()
        etcd_file = Path(config.base_data_dir) / "configs" / "embedEtcd.yaml"
        client, peer = _free_port(), _free_port()
        etcd_file.parent.mkdir(parents=True, exist_ok=True)
        etcd_file.write_text(
            "name: default\n"
            f"listen-client-urls: http://127.0.0.1:{client}\n"
            f"advertise-client-urls: http://127.0.0.1:{client}\n"
            f"listen-peer-urls: http://127.0.0.1:{peer}\n"
            f"initial-advertise-peer-urls: http://127.0.0.1:{peer}\n"
            f"initial-cluster: default=http://127.0.0.1:{peer}\n")
        milvus_yaml = Path(config.base_data_dir) / "configs" / "milvus.yaml"
        text = milvus_yaml.read_text()
        milvus_yaml.write_text(text.replace("\netcd:\n", f"\netcd:\n  config:\n    path: {etcd_file}\n",
                                            1))

    config.write_config = write_config
    return config


@contextmanager
def start_milvus_server(data_dir: str | Path, timeout_s: float = 300):
    """Yield a `MilvusServerHandle`; raises RuntimeError when the server cannot start."""
    from milvus import MilvusServer, MilvusServerConfig

    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    server = MilvusServer(_own_etcd_ports(MilvusServerConfig()), wait_for_started=False)
    server.set_base_dir(str(data_dir))
    port = _free_port()
    server.listen_port = port
    started = time.perf_counter()
    server.start()
    pid = server.server_proc.pid
    try:
        try:
            server.wait_started(timeout=timeout_s * 1000)
        except (TimeoutError, RuntimeError) as exc:
            log = data_dir / "logs" / "milvus-stderr.log"
            tail = log.read_text()[-500:] if log.exists() else ""
            raise RuntimeError(f"milvus server did not start in {timeout_s:.0f} s ({exc}); "
                               f"{tail}") from None
        yield MilvusServerHandle(f"http://127.0.0.1:{port}", pid, data_dir,
                                 time.perf_counter() - started)
    finally:
        _stop_pid(pid)
        _forget_server_id(pid)
        server.server_proc = None  # stopped by PID above; the wrapper has nothing left to stop
        for fd in server.proc_fds.values():
            fd.close()
        server.proc_fds.clear()
