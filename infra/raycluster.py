"""Starting or joining a Ray cluster: one place for `ray.init`, used by the driver's executors,
the service and the distributed ingest."""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import threading
from contextlib import contextmanager

from branchsearch.infra.errors import BackendUnavailable
from branchsearch.infra.config.settings import Settings

log = logging.getLogger("branchsearch.ray")


def connect(settings: Settings, *, object_store_mb: int = 256) -> dict:
    """`ray.init` once: the cluster at `ray_address` / RAY_ADDRESS, else a local one with
    `object_store_mb` of object store. Returns `ray.cluster_resources()`."""
    import ray

    if not ray.is_initialized():
        if threading.current_thread() is not threading.main_thread():
            # Ray ties the GCS and raylet it starts to the starting thread: a cluster started
            # here would die when this thread ends. Connect from the main thread first.
            raise RuntimeError("ray.init() called from a worker thread: connect to Ray from "
                               "the main thread before starting threads that use it")
        address = settings.ray_address or os.environ.get("RAY_ADDRESS") or None
        if address == "local":  # Ray's own word for "start a new local cluster"
            address = None
        if address is not None:
            _answers_or_say(address)
        kwargs = {"ignore_reinit_error": True, "include_dashboard": False,
                  "log_to_driver": False, "configure_logging": False}
        if address is None:
            kwargs |= {"num_cpus": max(os.cpu_count() or 1, 2),
                       "object_store_memory": object_store_mb * 1024 * 1024}
            # the last task events go to a GCS that ends with this process, read by no one
            # after: Ray's shutdown waits 5 s for a GCS already gone (a SIGTERM to the batch's
            # process group stops it first); a setting of the user's own wins
            os.environ.setdefault("RAY_task_events_shutdown_flush_timeout_ms",
                                  str(FLUSH_AT_SHUTDOWN_MS))
        # a local start that times out (a slow raylet on a loaded machine) is tried once more
        for attempt in (1, 2) if address is None else (2,):
            said: list[str] = []  # what Ray's core printed meanwhile
            try:
                with _without_ray_notices(said), _sigterm_handler_kept():
                    ray.init(address=address, **kwargs)
                break
            except Exception as exc:  # noqa: BLE001 — ray raises plain Exception on a timeout
                try:
                    ray.shutdown()  # what the failed start left behind
                except Exception:  # noqa: BLE001
                    pass
                if attempt == 1:
                    continue
                where = f"connect to {address}" if address else "start a local cluster"
                if any(_AUTH_REFUSED in line for line in said):
                    raise BackendUnavailable(
                        f"ray: cannot {where}: the cluster uses token authentication and "
                        "refused this process's token (missing or another cluster's); set "
                        "RAY_AUTH_MODE=token and give the cluster's token in RAY_AUTH_TOKEN, "
                        "RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token") from None
                raise BackendUnavailable(f"ray: cannot {where} ({type(exc).__name__}: "
                                         f"{str(exc)[:300]})") from None
        _watch_started_cluster()  # (a joined cluster started no process here: no watch)
    _cluster_errors_to_log()
    return ray.cluster_resources()


def _started_node():
    """Ray's node of the local cluster this process started (its GCS, raylet and the rest, as
    processes of ours), or None: none started, or a cluster joined."""
    from ray._private import worker

    node = getattr(worker, "_global_node", None)
    processes = getattr(node, "all_processes", None) or {}
    return node if "gcs_server" in processes else None


def local_cluster_lost() -> str | None:
    """Why the local cluster this process started is gone, asked at once (no wait for a restart:
    none restarts it); None while its GCS takes connections, and for a joined cluster
    (`cluster_lost` waits for that one)."""
    return cluster_lost() if _started_node() is not None else None


def stop_lost_cluster() -> None:
    """Kill at once what is left of the local cluster this process started, once it is lost
    (`cluster_lost`): a GCS told to stop (a SIGTERM sent to a batch's whole process group
    reaches it) closes its port but does not end, and Ray's shutdown at exit would give it,
    and each other process, a second's grace first. A joined cluster is not ours to stop."""
    node = _started_node()
    if node is None:
        return
    try:
        node.kill_all_processes(check_alive=False, allow_graceful=False)
    except Exception as exc:  # noqa: BLE001 — Ray's shutdown at exit tries again
        log.info("ray: stopping the lost local cluster: %s: %s", type(exc).__name__, exc)


def _watch_started_cluster() -> None:
    """Start the watch (`raywatch`) that stops what the local cluster `ray.init` just started
    leaves running once it is gone: Ray's agents outlive a driver killed with `kill -9` by a
    minute. A watch that cannot start is logged, not raised: the cluster works without it."""
    from ray._private import worker

    from branchsearch.infra import raywatch

    node = getattr(worker, "_global_node", None)
    if node is None or getattr(node, "all_processes", None) is None:
        return
    try:
        watch = raywatch.start(node)
    except Exception as exc:  # noqa: BLE001 — the cluster works without its watch
        log.info("ray: no watch over the local cluster's processes (%s: %s)",
                 type(exc).__name__, exc)
        return
    _WATCHES[:] = [w for w in _WATCHES if w.poll() is None]  # (reaps those that ended)
    if watch is not None:
        _WATCHES.append(watch)


_WATCHES: list = []  # the watches this process started (`_watch_started_cluster`)


@contextmanager
def _sigterm_handler_kept():
    """Meanwhile `ray.init` keeps a SIGTERM handler this process set (a batch's stop, which
    writes what ran and exits 143): Ray would put its own in its place (`sys.exit(15)`, raised
    wherever the start is, leaving the agents it started for a minute) and its core a C++ one
    that prints a stack. A process without one of its own gets Ray's, as before."""
    import signal
    import threading

    import ray._private.utils as ray_utils

    was = signal.getsignal(signal.SIGTERM)
    set_handler = getattr(ray_utils, "set_sigterm_handler", None)  # (Ray's own, not an API)
    if not callable(was) or set_handler is None or \
            threading.current_thread() is not threading.main_thread():  # (no handler set there)
        yield
        return
    ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = set_handler
        signal.signal(signal.SIGTERM, was)  # in front of the C++ handler Ray's core put there


def _cluster_errors_to_log() -> None:
    """Send the errors Ray's cluster publishes to this driver to the log (`branchsearch.ray`,
    INFO), not to stdout. Ray's driver prints each one there whatever `log_to_driver` says: a
    worker process that died (an actor killed, out of memory) is a 10-line notice naming the
    OOM killer and `ray stop`, a node lost is its raylet's 40-line state dump, in the middle
    of a batch's summary or a `--json` answer. What they mean reaches the user as our own
    lines: the branch or question that met the death is run again, or fails with the reason."""
    from ray._private import worker

    printed = getattr(worker, "print_to_stdstream", None)
    if printed is None or getattr(printed, "to_log", False):
        return

    def to_log(data: dict, ignore_prefix: bool) -> None:
        if data.get("pid") != "raylet":  # (only the cluster's errors come here as "raylet")
            printed(data, ignore_prefix)
            return
        for line in data.get("lines") or ():
            log.info("ray: %s", str(line).split("\n", 1)[0])

    to_log.to_log = True
    worker.print_to_stdstream = to_log  # looked up by name in Ray's error thread at each error


# How long a named cluster's address has to take a TCP connection (Ray's core waits 5 s a try)
REACH_S = 5.0

# How long the GCS of a cluster this process uses may take no connection before the cluster is
# lost: a GCS with fault tolerance (HA Redis) restarting within it is waited for. Ray's core
# ends this process itself after `RAY_gcs_rpc_server_reconnect_timeout_s` (60 s). A local
# cluster this process started has no one to restart its GCS: one that refuses connections
# is gone at once.
LOST_AFTER_S = 10.0

# How long Ray's shutdown waits to send the last task events of a local cluster it started
FLUSH_AT_SHUTDOWN_MS = 1000


def cluster_lost(wait_s: float = LOST_AFTER_S) -> str | None:
    """Why the Ray cluster this process is connected to is gone, or None while its GCS (the
    head node's control service) takes a TCP connection, waiting up to `wait_s` for it to come
    back. A head node that died leaves the actors' calls failing as "unavailable" and Ray's
    core waiting for the GCS until it ends this process with one line of its own; this says
    so first. The reason names no address (a service's caller may read it)."""
    import socket
    import time

    import ray

    host, _, port = ray.get_runtime_context().gcs_address.rpartition(":")
    end = time.monotonic() + wait_s
    started = _started_node() is not None
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
            return None
        except OSError as exc:
            if started and isinstance(exc, ConnectionRefusedError):  # (its port closed)
                return ("its head node (the GCS of the local cluster this process started) "
                        f"takes no connection ({exc.strerror or type(exc).__name__})")
            if time.monotonic() >= end:
                return (f"its head node (the GCS) has taken no connection for {wait_s:g} s "
                        f"({exc.strerror or type(exc).__name__})")
        time.sleep(0.5)


def _answers_or_say(address: str) -> None:
    """Raise one `BackendUnavailable` line when what answers at the address Ray would connect to
    for `address` is no Ray cluster: nothing takes a TCP connection there, no gRPC (HTTP/2)
    server answers (an HTTP/1.1 server, such as Ray's dashboard at 8265), or a gRPC server that
    is no GCS (it does not know the GCS's `GetClusterId`). Ray's own connect to any of
    these retries for many minutes, deaf to Ctrl-C, printing warnings as it goes. The address is the one Ray uses: a loopback name becomes this node's IP
    (`ray://`: the Ray Client server, as given; a gRPC server too, but no GCS). An address Ray
    cannot resolve here ("auto" with no cluster) is left to `ray.init`, which says so at once;
    so is any answer this check cannot judge (a GCS that refuses this process's token says so
    in `GetClusterId`'s status, which `connect` then words)."""
    import socket

    client = address.startswith("ray://")
    if client:
        target = address[len("ray://"):].split("/", 1)[0]
    else:
        try:
            from ray._private.services import canonicalize_bootstrap_address

            target = canonicalize_bootstrap_address(address) or ""
        except Exception:  # noqa: BLE001 — ray.init says what is wrong with it
            return
    host, _, port = target.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        return  # malformed: ray.init says so
    seen = f" (as {target})" if target not in (address, address[len("ray://"):]) else ""
    where = f"ray: cannot connect to {address}{seen}"
    try:
        socket.create_connection((host, int(port)), timeout=REACH_S).close()
    except OSError as exc:
        raise BackendUnavailable(
            f"{where}: nothing answers there ({exc.strerror or type(exc).__name__}); start "
            "the cluster (`ray start --head`) or give its address with --address or "
            "RAY_ADDRESS") from None
    what = "a Ray Client server (`ray://`)" if client else "a Ray cluster's GCS"
    said = _grpc_says(target, gcs=not client)
    if said is not None:
        raise BackendUnavailable(
            f"{where}: something answers there, but not {what} ({said}); give the "
            "cluster's address (the head's GCS port, 6379 unless set; `ray://HOST:10001` "
            "for Ray Client) with --address or RAY_ADDRESS") from None


def _grpc_says(target: str, gcs: bool) -> str | None:
    """Why `target` (host:port, taking TCP connections) is no gRPC server, or with `gcs` no
    Ray GCS: "no gRPC server" when no HTTP/2 channel gets ready within `REACH_S`, "a gRPC
    server without the GCS's services" when `GetClusterId` is unknown there; None when it
    answers as one, or when this cannot be judged (Ray's channel cannot be made here,
    another status): `ray.init` then tries and says."""
    try:
        import grpc
        from ray._private.grpc_utils import init_grpc_channel

        channel = init_grpc_channel(target)  # Ray's: RAY_USE_TLS, token auth
    except Exception:  # noqa: BLE001 — left to ray.init
        return None
    try:
        try:
            grpc.channel_ready_future(channel).result(timeout=REACH_S)
        except grpc.FutureTimeoutError:
            return f"no gRPC server answered within {REACH_S:g} s"
        if not gcs:
            return None
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=REACH_S)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return "a gRPC server without the GCS's services"
        except Exception:  # noqa: BLE001 — left to ray.init
            pass
        return None
    finally:
        channel.close()


# What Ray's C++ core prints on stderr, which is not ours to show a user: a notice at every
# start, and a line a second while a token-authenticated cluster refuses ours (said in one line
# by `connect` instead).
_AUTH_REFUSED = "InvalidAuthToken"
_RAY_NOTICES = ("Token authentication is enabled for this Ray cluster", _AUTH_REFUSED)


@contextmanager
def _without_ray_notices(said: list[str] | None = None):
    """Hold fd 2 in a temporary file while Ray starts, then replay it without Ray's notices
    (they come from C++, past Python's logging); every line held goes to `said`. Processes
    Ray starts meanwhile keep the file."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            for line in held.read().decode(errors="replace").splitlines(keepends=True):
                if said is not None:
                    said.append(line)
                if not any(notice in line for notice in _RAY_NOTICES):
                    sys.stderr.write(line)
            sys.stderr.flush()
