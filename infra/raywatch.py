"""The watch over a local Ray cluster this process started: once the cluster's own processes are
gone (the driver shut it down, or ended however it ended: `kill -9`, the OOM killer, a
scheduler's preemption), whatever they started that still runs is stopped.

Ray ties the processes `ray.init` starts (GCS, raylet, dashboard, monitors) to the driver
(Linux: `PR_SET_PDEATHSIG`), but not the agents its raylet starts: the dashboard agent and the
runtime env agent see their raylet die at once, then try for 60 s to tell the dead GCS, holding
about 200 MB, and a batch resumed meanwhile starts a second cluster beside them. The watch is a
small process of its own (`start`), run by path with the standard library alone, so that it
costs little and outlives the driver: it notes every process under the cluster's while they run
(by pid and start time, so a reused pid is never taken for one of them), and when they are
gone it stops the noted ones still running (SIGTERM, then SIGKILL). A driver that ended
without stopping its cluster is said in one line on the driver's stderr; a shut-down cluster's
leftovers are stopped without a word. Linux only (`/proc`); elsewhere nothing is started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

NOTE_S = 1.0  # how often the cluster's processes are noted, and its roots asked
GRACE_S = 1.0  # how long a leftover has to end on its own, and then after SIGTERM

Noted = dict[int, int]  # pid → start time (clock ticks after boot), which pid reuse changes


def start(node) -> subprocess.Popen | None:
    """Start the watch over `node` (Ray's `_global_node` of a cluster `ray.init` started here);
    None where there is no `/proc` or the node names no process. It shares the caller's
    stderr (for its one line), not its stdin or stdout."""
    if not os.path.isdir("/proc/self") or sys.platform != "linux":
        return None
    roots = [info.process.pid for infos in node.all_processes.values() for info in infos
             if info.process is not None]
    if not roots:
        return None
    command = [sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()),
               node.get_session_dir_path(), *map(str, roots)]
    return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            close_fds=True, start_new_session=True)


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, start time, state) of a process, None when there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()  # the name, in brackets, may hold anything
    return int(fields[1]), int(fields[19]), fields[0]


def running(pid: int, started: int) -> bool:
    """Whether `pid` is still the process that started at `started`, and not a zombie."""
    stat = _stat(pid)
    return stat is not None and stat[1] == started and stat[2] not in "ZX"


def _table() -> dict[int, tuple[int, int]]:
    """Every process: pid → (parent pid, start time)."""
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (stat := _stat(int(name))) is not None:
            table[int(name)] = stat[:2]
    return table


def descendants(roots: Noted, table: dict[int, tuple[int, int]]) -> Noted:
    """The processes under `roots` (themselves included) that still run, by `table`."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found: Noted = {}
    todo = [pid for pid, started in roots.items() if table.get(pid, (0, -1))[1] == started]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found[pid] = table[pid][1]
            todo.extend(children.get(pid, ()))
    return found


def of_session(session: str, table: dict[int, tuple[int, int]]) -> Noted:
    """The processes (but this one) whose command line names the cluster's session folder: a
    worker its raylet started less than a note before dying is re-parented to pid 1, out of
    every root's tree, and Ray gives each its session folder."""
    found: Noted = {}
    needle = session.encode()
    for pid, (_, started) in table.items():
        if pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if needle in f.read():
                    found[pid] = started
        except OSError:
            pass
    return found


def stop(noted: Noted) -> list[str]:
    """SIGTERM the noted processes still running, SIGKILL those still there after `GRACE_S`;
    the names of those stopped."""
    left = {pid: started for pid, started in noted.items() if running(pid, started)}
    names = [_name(pid) for pid in sorted(left)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, started in left.items():
            if running(pid, started):
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
        end = time.monotonic() + GRACE_S
        while any(running(p, s) for p, s in left.items()) and time.monotonic() < end:
            time.sleep(0.05)
    return names


def _name(pid: int) -> str:
    """The process's title (Ray's `ray::DashboardAgent`) or its program's name."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            first = f.read().split(b"\0", 1)[0].decode(errors="replace")
    except OSError:
        return str(pid)
    return os.path.basename(first.split(" ", 1)[0]) or str(pid)


def watch(driver: int, session: str, root_pids: list[int]) -> None:
    """Note the processes under `root_pids` until every root is gone or the driver is; then
    stop what was noted and still runs after `GRACE_S`, saying so when the driver ended."""
    table = _table()
    roots = {pid: table[pid][1] for pid in root_pids if pid in table}
    driver_started = table.get(driver, (0, -1))[1]
    noted: Noted = dict(roots)
    while (running(driver, driver_started)
           and any(running(pid, started) for pid, started in roots.items())):
        noted.update(descendants(roots, _table()))
        time.sleep(NOTE_S)
    table = _table()
    noted.update(descendants(roots, table))
    noted.update(of_session(session, table))  # workers started since the last note, orphaned
    ended = not running(driver, driver_started)
    end = time.monotonic() + GRACE_S  # what a cluster shut down stops on its own
    while any(running(pid, started) for pid, started in noted.items()) and \
            time.monotonic() < end:
        time.sleep(0.05)
    names = stop(noted)
    if names and ended:
        print(f"branchsearch: process {driver} ended without stopping the Ray cluster it "
              f"started ({session}); stopped the {len(names)} process(es) it left: "
              f"{_counted(names)}", file=sys.stderr, flush=True)


def _counted(names: list[str]) -> str:
    """`ray::A, ray::B ×3`: each name once, in first-seen order, with its count past one."""
    counts = {name: names.count(name) for name in names}
    return ", ".join(name + (f" ×{n}" if n > 1 else "") for name, n in counts.items())


if __name__ == "__main__":
    for sig in (signal.SIGINT, signal.SIGHUP):  # a terminal's Ctrl-C or hangup is the driver's
        signal.signal(sig, signal.SIG_IGN)
    watch(int(sys.argv[1]), sys.argv[2], [int(pid) for pid in sys.argv[3:]])
