"""`branchsearch batch` as a user runs it: a fresh process per run, wall time from the command
to its exit, at several --concurrency values, interleaved round by round.

    python bench/batch_cli.py --home /tmp/bs-home --index hotpotqa-dev200 \\
        --queries ../shared/data/hotpotqa-dev200 [--n 200] [--concurrency 1 2 4] [--rounds 2]

Per run: wall seconds, seconds to the first row written (start-up: imports, opening the index),
and the steady rate: questions/s over the second half of the rows (by then any worker process
has started), read by polling the output file every 20 ms. Medians over rounds; the machine's
load is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(args, concurrency: int, inp: Path, out: Path) -> dict:
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "branchsearch.orchestrator.cli", "batch", str(inp), "-o",
           str(out), "--home", args.home, "--index", args.index, "--concurrency",
           str(concurrency)]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "RAY_ADDRESS": ""})
    seen: list[tuple[int, float]] = []  # (rows written, when first seen)
    while proc.poll() is None:
        time.sleep(0.02)
        n = out.read_bytes().count(b"\n") if out.exists() else 0
        if n and (not seen or n > seen[-1][0]):
            seen.append((n, time.perf_counter() - started))
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"batch failed: {proc.stderr.read().decode()[-500:]}")
    ok = sum(json.loads(line)["status"] == "ok" for line in out.read_text().splitlines())
    half = next((p for p in seen if p[0] >= args.n // 2), None)
    end = seen[-1] if seen else None
    steady = ((end[0] - half[0]) / (end[1] - half[1]) if half and end and end[1] > half[1]
              else float("nan"))
    return {"wall": wall, "first": seen[0][1] if seen else wall, "steady": steady, "ok": ok}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--home", default=".branchsearch")
    ap.add_argument("--index", default="hotpotqa-dev200")
    ap.add_argument("--queries", type=Path, required=True)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from branchsearch.infra.datasets.beir import read_queries

    questions = [q.text for q in read_queries(args.queries)][: args.n]
    args.n = len(questions)
    work = Path(tempfile.mkdtemp(prefix="bench-batch-"))
    inp = work / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": str(i), "question": q}) + "\n"
                           for i, q in enumerate(questions)))
    results: dict[int, list[dict]] = {c: [] for c in args.concurrency}
    for r in range(args.rounds):
        for c in args.concurrency:
            m = run(args, c, inp, work / f"out-{c}.jsonl")
            results[c].append(m)
            print(f"round {r + 1}, concurrency {c}: {m['wall']:.2f} s wall, first row "
                  f"{m['first']:.2f} s, steady {m['steady']:.1f} q/s, {m['ok']}/{args.n} ok, "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    base = statistics.median(m["wall"] for m in results[args.concurrency[0]])
    base_rate = statistics.median(m["steady"] for m in results[args.concurrency[0]])
    print(f"\n{args.n} questions of {args.queries.name}, {os.cpu_count()} cores, medians of "
          f"{args.rounds}")
    print("| concurrency | wall s | vs first | first row s | steady q/s | vs first |")
    print("|---|---|---|---|---|---|")
    for c, ms in results.items():
        wall = statistics.median(m["wall"] for m in ms)
        rate = statistics.median(m["steady"] for m in ms)
        print(f"| {c} | {wall:.2f} | {wall / base:.2f}x | "
              f"{statistics.median(m['first'] for m in ms):.2f} | {rate:.1f} | "
              f"{rate / base_rate:.2f}x |")


if __name__ == "__main__":
    main()
