"""Per-query latency of the driver: 1 branch in-process vs 1 and 3 branches through Ray, the
share of wall time spent outside backend and policy work, and batch throughput with 1, 2 and 4
concurrent questions. One run; medians over the same questions for every configuration.

    python bench/orchestrator_latency.py --home /tmp/bs --index hotpotqa-dev200 \\
        --queries ../shared/data/hotpotqa-dev200 [--n 30] [--batch-n 40 | 0: no batch]

Machine CPU per question comes from /proc/stat (every process: the driver, Ray's workers and
daemons), less the rate the machine was busy while the bench slept just before each
configuration; on 2 cores it shows why 3 branches through Ray cannot come within 1.5x of one.

Overhead share (per query) = 1 - work / wall. Work is the policy's deciding time plus the wall
time of the retrieval phases (a turn's tool calls fetch concurrently), of which through Ray only
the backend's share counts (backend time measured inside the retriever actor / round-trip time).
Summed over branches when they run one after another in-process, the busiest branch when they
run in parallel. Everything else (harness bookkeeping, token counting, Ray dispatch and RPC,
fusion) is overhead.

Each configuration meets the questions as new ones: its agent token caches emptied and its
query vectors embedded afresh (an empty embedding cache of its own; `--warm-embeddings` keeps
the data home's, where every question asked before is a lookup).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from branchsearch.infra.datasets.beir import read_queries  # noqa: E402
from branchsearch.infra.config.settings import load_settings  # noqa: E402
from branchsearch.orchestrator.batch import run_batch  # noqa: E402
from branchsearch.orchestrator.driver import Driver  # noqa: E402
from branchsearch.infra.models.tokenizer import agent_counter  # noqa: E402


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (user + system, every process: the
    driver, Ray's workers and daemons), from /proc/stat; 0 where there is none."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0
    # user, nice, system, irq, softirq (not idle, iowait, steal; guest is inside user)
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / os.sysconf("SC_CLK_TCK")


def forget_token_counts() -> None:
    """Empty this process's agent token caches, so a configuration measured after another on
    the same questions does not find their chunks already counted (new questions would not).
    (The Ray actors' caches are not reached: the second Ray configuration finds them warm.)"""
    agent_counter(load_settings().encoding).forget()


def fresh_embeddings(driver: Driver) -> None:
    """Point the retrievers' query-embedding caches at an empty file of their own: this
    configuration embeds its questions' queries as new ones."""
    path = Path(tempfile.mkdtemp(prefix="bench-embed-")) / "embeddings.sqlite"
    if driver.mode == "local":
        _cache_at(driver.executor, path)
        return
    import ray

    ray.get([r.__ray_call__.remote(_cache_at, path) for r in driver.executor.retrievers])


def _cache_at(owner, path: Path) -> None:  # owner: LocalExecutor or the retriever actor
    embedder = owner.retriever.embedder
    if embedder is not None:
        embedder.cache_at(path)
        # torch builds its kernels per input shape on first use: a running process has met
        # every query length before; without this the first configuration pays for them
        embedder.embed_queries([" ".join(["lighthouse"] * n) for n in range(1, 97)])


def idle_rate(seconds: float = 3.0) -> float:
    """The machine's busy CPU per second while this process sleeps: what others (and an idle
    Ray cluster's daemons) use, subtracted from every measurement."""
    before = busy_cpu_s()
    time.sleep(seconds)
    return (busy_cpu_s() - before) / seconds


def measure(driver: Driver, questions: list[str], branches: int, warm_embeddings: bool) -> dict:
    driver.search(questions[0], max_branches=branches)  # warm-up
    forget_token_counts()  # every configuration counts its chunks' tokens afresh
    if not warm_embeddings:
        fresh_embeddings(driver)  # ... and embeds its queries afresh
    idle = idle_rate()
    walls, shares, multi = [], [], []  # multi: the questions planned to 2+ branches
    cpu0, started = busy_cpu_s(), time.perf_counter()
    for q in questions:
        r = driver.search(q, max_branches=branches)
        work = [b.policy_s + b.fetch_s * (min(b.backend_s / b.rpc_s, 1.0) if b.rpc_s else 1.0)
                for b in r.branches]
        busy = sum(work) if driver.mode == "local" else max(work)
        walls.append(r.metrics["latency_s"])
        if len(r.branches) + r.metrics.get("covered", 0) > 1:  # planned so, covered or not
            multi.append(len(walls) - 1)
        shares.append(max(0.0, 1 - busy / r.metrics["latency_s"]))
    busy = busy_cpu_s() - cpu0 - idle * (time.perf_counter() - started)
    cpu = max(busy, 0.0) / len(questions)
    return {"p50_ms": 1000 * statistics.median(walls), "walls": walls, "multi": multi,
            "overhead": statistics.median(shares),
            "cpu_ms": 1000 * cpu, "floor_ms": 1000 * cpu / (os.cpu_count() or 1),
            "idle_cores": idle}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--home", default=".branchsearch")
    ap.add_argument("--index", default="hotpotqa-dev200")
    ap.add_argument("--queries", type=Path, required=True)
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--batch-n", type=int, default=40)
    ap.add_argument("--warm-embeddings", action="store_true",
                    help="keep the data home's query-embedding cache (questions asked before)")
    args = ap.parse_args()
    settings = load_settings(overrides={"home": args.home, "index": args.index})
    questions = [q.text for q in read_queries(args.queries)]
    sample = questions[: args.n]
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; {args.queries.name}, "
          f"{len(sample)} questions, heuristic policy; query embeddings "
          f"{'from the home cache' if args.warm_embeddings else 'afresh'}")

    rows = []
    local = Driver(settings, mode="local")
    rows.append(("1 branch, in-process", measure(local, sample, 1, args.warm_embeddings)))
    rows.append(("3 branches, in-process (one after another)", measure(local, sample, 3, args.warm_embeddings)))
    local.close()
    ray_driver = Driver(settings, mode="ray", pool_size=3)
    rows.append(("1 branch, Ray actors", measure(ray_driver, sample, 1, args.warm_embeddings)))
    rows.append(("3 branches, Ray actors", measure(ray_driver, sample, 3, args.warm_embeddings)))
    ray_driver.close()
    base = rows[0][1]["p50_ms"]
    one = rows[0][1]["walls"]  # 1 branch in-process, question by question
    print("\n| configuration | median latency ms | vs 1 branch in-process | questions planned "
          "to 2+ branches: n, median ms, vs the same questions with 1 branch in-process | overhead share (median) | "
          "machine CPU ms per question | its floor on these cores, ms |")
    print("|---|---|---|---|---|---|---|")
    for name, m in rows:
        multi = "–"
        if m["multi"]:  # those questions' median, against the same questions with 1 branch
            mine = statistics.median(m["walls"][i] for i in m["multi"])
            theirs = statistics.median(one[i] for i in m["multi"])
            multi = f"{len(m['multi'])}, {1000 * mine:.0f}, {mine / theirs:.2f}x"
        print(f"| {name} | {m['p50_ms']:.0f} | {m['p50_ms'] / base:.2f}x | {multi} | "
              f"{100 * m['overhead']:.1f} % | {m['cpu_ms']:.0f} | {m['floor_ms']:.0f} |")
    print("(machine CPU: every process's busy time over the run, per question, less what the "
          "machine used while the bench slept just before (" + ", ".join(
              f"{m['idle_cores']:.2f}" for _, m in rows) + " cores): Ray's workers and daemons "
          "at work included; the floor is that divided by the cores, the wall time no "
          "scheduling could beat. Run it on an otherwise idle machine)")
    if args.batch_n <= 0:
        return

    batch = [(str(i), q) for i, q in enumerate(questions[: args.batch_n])]
    print(f"\nbatch throughput, {len(batch)} questions, 3 branches each")
    print("| concurrency | questions/s | vs 1 |\n|---|---|---|")
    first = None
    out_dir = Path(settings.home) / "bench-batch"
    out_dir.mkdir(parents=True, exist_ok=True)
    for concurrency in (1, 2, 4):
        driver = Driver(settings.replace(batch_concurrency=concurrency, branches=3), mode="ray")
        out = out_dir / f"c{concurrency}.jsonl"
        out.unlink(missing_ok=True)
        started = time.perf_counter()
        run_batch(batch, out, lambda q: driver.search(q).to_dict(), concurrency=concurrency)
        rate = len(batch) / (time.perf_counter() - started)
        driver.close()
        first = first or rate
        print(f"| {concurrency} | {rate:.2f} | {rate / first:.2f}x |")


if __name__ == "__main__":
    main()
