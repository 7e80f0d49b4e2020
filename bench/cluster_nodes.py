"""Batch throughput on a 1- and a 2-"node" Ray cluster emulated on one machine.

Each "node" is a network namespace (`bsnodeA` 10.77.0.1, `bsnodeB` 10.77.0.2, joined by a veth
pair) whose Ray processes are pinned to one core of their own (`taskset -c 0` / `-c 1`,
`ray start --num-cpus 1`), so Ray's head, its worker node and the driver talk over a network
interface, not loopback, and a node can use only its own core. The driver (`branchsearch batch
--address`) runs on node A, as on a head node, pinned to core 0 too. `retriever_replicas` =
nodes (so the index must be one several processes may open: BM25-only or a Milvus server).

For each run in `--runs` (e.g. `1,2,1,2`) a fresh cluster is built, the batch runs, and the
cluster is torn down. Throughput is the steady state: the batch output is polled, each row's
arrival time kept, and questions/s counted between row `--skip` and row n - concurrency (the
start-up — Ray workers, actors, the index opening — and the drain are left out). Printed per
run: `uptime`, wall, steady questions/s, which actor processes ran in which namespace, and CPU
milliseconds per question in the steady window per namespace, for the driver and per kind of
process; then medians per node count and the 2-node / 1-node ratio. The branch pool grows on
demand (a new actor process costs about a CPU-second to start), so the window starts 2 s after
the last new actor process was seen, if that is later than `--skip`.

Needs root (`ip netns`). Cleans up everything it started — the namespaces, the veth pair, every
process in the namespaces (by PID), the Ray temp folder — on success, failure or a signal; it
never touches Ray processes it did not start (no `ray stop`).

    sudo .venv/bin/python bench/cluster_nodes.py --queries /work/shared/data/hotpotqa-dev200 \
        --home /tmp/nodes-home --index hotpot-bm25 --n 200 --concurrency 4 --runs 1,2,1,2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BIN = Path(sys.executable).parent  # the virtualenv running this script
NODES = [("bsnodeA", "bsnvA", "10.77.0.1", 0), ("bsnodeB", "bsnvB", "10.77.0.2", 1)]
PORT = 6390
RAY_TMP = "/tmp/bsnodes-ray"  # Ray's session folder, ours alone (short: socket paths)


def sh(*cmd: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, env=env)


def say(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def ns_exec(ns: str, core: int, *cmd: str) -> list[str]:
    return ["ip", "netns", "exec", ns, "taskset", "-c", str(core), *cmd]


class StartFailed(RuntimeError):
    """A Ray node did not come up (a raylet start timeout on a loaded machine)."""


class Cluster:
    """The namespaces and the Ray nodes in them; `close` removes all of it."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []
        self.logs: list = []

    # --- network ---------------------------------------------------------------------------

    def build_network(self) -> None:
        self.remove_network()  # leftovers of an earlier run of this script (our names only)
        (a, va, ipa, _), (b, vb, ipb, _) = NODES
        for ns in (a, b):
            sh("ip", "netns", "add", ns)
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        sh("ip", "link", "add", va, "type", "veth", "peer", "name", vb)
        for ns, dev, ip in ((a, va, ipa), (b, vb, ipb)):
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ip}/24", "dev", dev)
            sh("ip", "netns", "exec", ns, "ip", "link", "set", dev, "up")
        # (node B's raylet joining the head over this link is the connectivity check)

    def remove_network(self) -> None:
        for ns, dev, _, _ in NODES:
            self.kill_namespace(ns)
            sh("ip", "netns", "del", ns, check=False)
            sh("ip", "link", "del", dev, check=False)  # if it never left the root namespace

    @staticmethod
    def namespace_pids(ns: str) -> list[int]:
        out = sh("ip", "netns", "pids", ns, check=False).stdout
        return [int(p) for p in out.split() if p.strip().isdigit()]

    def kill_namespace(self, ns: str) -> None:
        """Every process in our namespace (all of them ours), TERM then KILL."""
        for sig, pause in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 0.5)):
            pids = self.namespace_pids(ns)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            end = time.monotonic() + pause
            while time.monotonic() < end and self.namespace_pids(ns):
                time.sleep(0.1)

    # --- ray -------------------------------------------------------------------------------

    def start(self, nodes: int, head_cpus: int = 1) -> str:
        """`nodes` Ray nodes, the head (node A) with `head_cpus` logical CPUs, a worker with 1;
        the head's address."""
        os.makedirs(RAY_TMP, exist_ok=True)
        address = f"{NODES[0][2]}:{PORT}"
        for i in range(nodes):
            ns, _, ip, core = NODES[i]
            role = (["--head", f"--port={PORT}", f"--temp-dir={RAY_TMP}",
                     "--include-dashboard=false"] if i == 0 else [f"--address={address}"])
            log = open(Path(RAY_TMP) / f"start-{ns}.log", "w")
            self.logs.append(log)
            self.procs.append(subprocess.Popen(
                ns_exec(ns, core, str(BIN / "ray"), "start", *role, f"--node-ip-address={ip}",
                        f"--num-cpus={head_cpus if i == 0 else 1}", "--num-gpus=0",
                        "--object-store-memory=150000000", "--disable-usage-stats", "--block"),
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=ray_env()))
            say(f"ray start in {ns} (core {core})")
            self.wait_nodes(address, i + 1)
            say(f"{i + 1} node(s) up")
        return address

    def wait_nodes(self, address: str, n: int, timeout: float = 180) -> None:
        probe = ("import ray,sys; ray.init(address=sys.argv[1], log_to_driver=False); "
                 "print(sum(1 for x in ray.nodes() if x['Alive']))")
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for p, log in zip(self.procs, self.logs):
                if p.poll() is not None:
                    tail = Path(log.name).read_text(errors="replace").strip().splitlines()[-1:]
                    raise StartFailed(f"ray start exited: {' '.join(tail)[:300]}")
            try:
                got = subprocess.run(ns_exec(NODES[0][0], NODES[0][3], str(BIN / "python"),
                                             "-c", probe, address), capture_output=True,
                                     text=True, env=ray_env(), timeout=60)
            except subprocess.TimeoutExpired:
                continue
            if got.returncode == 0 and got.stdout.strip().splitlines()[-1:] == [str(n)]:
                return
            time.sleep(2)
        raise StartFailed(f"{n} Ray node(s) not up within {timeout:g} s")

    def close(self) -> None:
        for p in self.procs:  # `ray start --block` stops its node on SIGTERM
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        self.procs = []
        for log in self.logs:
            log.close()
        self.logs = []
        self.remove_network()
        shutil.rmtree(RAY_TMP, ignore_errors=True)


def ray_env() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    env.pop("RAY_ADDRESS", None)
    # `ray start` turns Ray's token authentication on (the token in ~/.ray/auth_token); a
    # driver or node that is to use it must be told so
    env["RAY_AUTH_MODE"] = "token"
    return env


def namespace_procs() -> dict[str, list[int]]:
    return {ns: Cluster.namespace_pids(ns) for ns, *_ in NODES}


def proc_cpu(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_kind(pid: int) -> str:
    """`RetrieverService`, `BranchService`, `raylet`, `gcs_server`, `log_monitor.py`, …"""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    name = argv[0].decode(errors="replace")
    if name.startswith("ray::"):
        return name.removeprefix("ray::").split(".")[0].split()[0]
    script = next((a.decode(errors="replace") for a in argv[1:4] if a.endswith(b".py")
                   or a in (b"ray.util.client.server",)), "")
    return Path(script).name if script else Path(name).name.split()[0]


def cpu_sample(driver: int) -> dict[str, float]:
    """CPU seconds so far of the live processes: per namespace, the driver's alone (it is in
    A), and per namespace and kind of process (`A:raylet`, `B:RetrieverService`, …)."""
    out = {"driver": proc_cpu(driver)}
    for ns, pids in namespace_procs().items():
        out[ns] = 0.0
        for pid in pids:
            cpu = proc_cpu(pid)
            out[ns] += cpu
            key = f"{ns[-1]}:{proc_kind(pid)}"
            out[key] = out.get(key, 0.0) + cpu
    return out


def actor_pids() -> dict[int, str]:
    """The actor processes (branch and retriever actors) in our namespaces, by PID."""
    return {pid: f"{ns}:{kind}" for ns, pids in namespace_procs().items() for pid in pids
            if (kind := proc_kind(pid)) in ("BranchService", "RetrieverService")}


class Rows:
    """Counts the complete lines of a growing file, reading only what was appended."""

    def __init__(self, path: Path):
        self.path, self.offset, self.n = path, 0, 0

    def count(self) -> int:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return 0
        last = data.rfind(b"\n")
        if last >= 0:
            self.n += data.count(b"\n", 0, last + 1)
            self.offset += last + 1
        return self.n


STEP = 5  # CPU is sampled at every STEP-th row


def run_batch(address: str, nodes: int, args, questions: Path, work: Path) -> dict:
    out = work / f"out-{time.monotonic_ns()}.jsonl"
    env = ray_env() | {"BRANCHSEARCH_RETRIEVER_REPLICAS": str(nodes)}
    cmd = ns_exec(NODES[0][0], NODES[0][3], str(BIN / "branchsearch"), "batch", str(questions),
                  "-o", str(out), "--address", address, "--concurrency", str(args.concurrency),
                  "--branches", str(args.branches), "--home", str(args.home), "--index",
                  args.index)
    arrivals: list[float] = []
    actors: dict[int, str] = {}  # every actor process seen
    last_actor = 0.0  # when the last new one was seen (the pool grows on demand)
    hi = args.n - 1 - args.concurrency  # the steady window ends before the drain
    cpu: dict[int, dict] = {}
    started = time.monotonic()
    say(f"batch of {args.n} on {nodes} node(s)")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    errors: list[str] = []
    drain = threading.Thread(target=lambda: errors.append(proc.stderr.read()), daemon=True)
    drain.start()
    rows_seen, next_scan = Rows(out), 0.0
    try:
        while proc.poll() is None:
            n = rows_seen.count()
            while len(arrivals) < n:
                arrivals.append(time.monotonic())
                row = len(arrivals) - 1
                if row % STEP == 0 or row == hi:
                    cpu[row] = cpu_sample(proc.pid)
            now = time.monotonic()
            if now >= next_scan and len(arrivals) < hi:
                found = actor_pids()
                if set(found) - set(actors):
                    last_actor = now
                actors.update(found)
                next_scan = now + 0.5
            time.sleep(0.05)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    stdout = proc.stdout.read()
    drain.join(5)
    wall = time.monotonic() - started
    if proc.returncode != 0 or len(arrivals) < args.n:
        raise RuntimeError(f"batch failed (rc {proc.returncode}, {len(arrivals)} rows): "
                           f"{stdout[-500:]} {''.join(errors)[-1500:]}")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # the window starts at --skip, or past the last actor start (+2 s), whichever is later
    lo = -(-args.skip // STEP) * STEP
    while lo + STEP < hi - 10 and arrivals[lo] < last_actor + 2.0:
        lo += STEP
    late = arrivals[lo] < last_actor + 2.0
    steady = (hi - lo) / (arrivals[hi] - arrivals[lo])
    per_q = {k: round((cpu[hi][k] - cpu[lo].get(k, 0.0)) / (hi - lo) * 1000, 1)
             for k in cpu.get(hi, {}) if lo in cpu}
    per_q = {k: v for k, v in per_q.items() if ":" not in k or v >= 1.0}
    placement: dict[str, dict[str, int]] = {}
    for where in actors.values():
        ns, kind = where.split(":")
        placement.setdefault(ns, {}).setdefault(kind, 0)
        placement[ns][kind] += 1
    return {"nodes": nodes, "concurrency": args.concurrency, "wall_s": round(wall, 2),
            "first_row_s": round(arrivals[0] - started, 2),
            "steady_qps": round(steady, 3), "steady_rows": f"{lo}..{hi}",
            "pool_grew_in_window": late,
            "ok": sum(r.get("status") == "ok" for r in rows),
            "branches_mean": round(statistics.mean(r.get("metrics", {}).get("branches", 0)
                                                   for r in rows), 2),
            "actor_processes": placement, "steady_cpu_ms_per_q": per_q,
            "median_ms": latencies(rows)}


def latencies(rows: list[dict]) -> dict[str, float]:
    """Medians over the rows: a question's latency, its longest branch, a branch's time in
    round trips to a retriever actor beyond the backend's own time (0 when hosted)."""
    def med(xs):
        return round(statistics.median(xs) * 1000, 1) if xs else None

    branches = [b for r in rows for b in r.get("branches", [])]
    took = [r["metrics"]["latency_s"] for r in rows if "metrics" in r]
    return {"question": med(took),
            "question_mean": round(statistics.mean(took) * 1000, 1) if took else None,
            "branch_max": med([r["metrics"]["branch_latency_s_max"] for r in rows
                               if "metrics" in r]),
            "branch": med([b.get("latency_s", 0) for b in branches]),
            "branch_rpc_overhead": med([b.get("rpc_s", 0) - b.get("backend_s", 0)
                                        for b in branches])}


def questions_file(source: Path, n: int, work: Path) -> Path:
    path = source / "queries.jsonl" if source.is_dir() else source
    lines = [line for line in path.read_text().splitlines() if line.strip()][:n]
    if len(lines) < n:
        raise SystemExit(f"{path}: {len(lines)} questions, fewer than --n {n}")
    out = work / "questions.jsonl"
    out.write_text("\n".join(lines) + "\n")
    return out


def on_fresh_cluster(cluster: "Cluster", run):
    """`run()` (which starts `cluster`'s Ray nodes) on a network built anew, torn down after;
    a start that fails (`StartFailed`) is tried once more."""
    for attempt in (1, 2):
        cluster.build_network()
        try:
            return run()
        except StartFailed as exc:
            say(f"cluster start failed ({exc})" + ("; again" if attempt == 1 else ""))
            if attempt == 2:
                raise
        finally:
            cluster.close()


def uptime() -> str:
    return sh("uptime").stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queries", type=Path, required=True, help="BEIR folder or queries JSONL")
    ap.add_argument("--home", type=Path, required=True)
    ap.add_argument("--index", required=True, help="a BM25-only or Milvus-server index")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--per-node", action="store_true",
                    help="--concurrency questions in flight per node (else in all)")
    ap.add_argument("--branches", type=int, default=3)
    ap.add_argument("--skip", type=int, default=20, help="rows of start-up left out")
    ap.add_argument("--runs", default="1,2,1,2", help="node counts, one run each, in order")
    ap.add_argument("--json", type=Path, help="write every run's figures here")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (ip netns)")
    runs = [int(x) for x in args.runs.split(",")]
    if not set(runs) <= {1, 2} or args.n <= args.skip + args.concurrency + 1:
        raise SystemExit("--runs takes 1 and 2; --n must exceed --skip + --concurrency + 1")

    cluster = Cluster()

    def stop(signum, _frame):
        say(f"signal {signum}: cleaning up")
        raise SystemExit(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    results = []
    work = Path(tempfile.mkdtemp(prefix="bsnodes-"))
    try:
        questions = questions_file(args.queries, args.n, work)
        for nodes in runs:
            load = uptime()
            run_args = argparse.Namespace(**{**vars(args), "concurrency": (
                args.concurrency * nodes if args.per_node else args.concurrency)})
            result = on_fresh_cluster(cluster, lambda: run_batch(
                cluster.start(nodes), nodes, run_args, questions, work))
            result["uptime_before"] = load
            result["uptime_after"] = uptime()
            results.append(result)
            print(json.dumps(result), flush=True)
    finally:
        cluster.close()
        shutil.rmtree(work, ignore_errors=True)
    by = {k: [r["steady_qps"] for r in results if r["nodes"] == k] for k in (1, 2)}
    summary = {f"median_qps_{k}_node": round(statistics.median(v), 3) for k, v in by.items() if v}
    if by[1] and by[2]:
        summary["ratio_2_over_1"] = round(statistics.median(by[2]) / statistics.median(by[1]), 3)
    print(json.dumps({"summary": summary, "n": args.n, "concurrency": args.concurrency,
                      "per_node": args.per_node,
                      "branches": args.branches, "index": args.index}), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"runs": results, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
