"""What tracing costs a search: tracing off vs OTLP to a dead collector (a closed loopback port)
vs OTLP to a live receiver on loopback, in one process, one run, the same question every time.

    python bench/trace_overhead.py --home /tmp/bs [--runs 10] [--branches 1] [--executor local]

The index is tests/fixtures/hotpot-mini, ingested into `--home` when absent. Modes run in this
order after one warm-up search: off (no tracer provider: the API's no-op spans), dead, live.
`--telemetry FILE` loads another telemetry module in place of branchsearch.infra.telemetry
(e.g. `git show <rev>:infra/telemetry.py > old.py`), to measure an older version the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # otlp_receiver

Q = "Were Scott Derrickson and Ed Wood of the same nationality?"


def load_telemetry(path: str | None):
    if path:  # must happen before anything imports the real module
        spec = importlib.util.spec_from_file_location("branchsearch.infra.telemetry", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["branchsearch.infra.telemetry"] = module
        spec.loader.exec_module(module)
        import branchsearch.infra as infra

        infra.telemetry = module
    from branchsearch.infra import telemetry

    return telemetry


def timed(driver, runs: int, branches: int) -> list[float]:
    walls = []
    for _ in range(runs):
        started = time.perf_counter()
        result = driver.search(Q, max_branches=branches)
        walls.append(time.perf_counter() - started)
        bad = [f"{b.status}: {b.error}" for b in result.branches if b.status != "ok"]
        if bad:
            raise SystemExit(f"a branch did not finish ok: {bad}")
    return walls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--home", default="/tmp/branchsearch-trace-bench")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--branches", type=int, default=1)
    ap.add_argument("--executor", default="local", choices=["local", "ray"])
    ap.add_argument("--telemetry", help="a telemetry.py to load instead of the installed one")
    ap.add_argument("--modes", default="off,dead,live")
    args = ap.parse_args()

    telemetry = load_telemetry(args.telemetry)
    from otlp_receiver import HttpReceiver, closed_port

    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.orchestrator.driver import Driver

    settings = load_settings(overrides={"home": args.home, "index": "hotpot",
                                        "branches": args.branches},
                             read_env=False, read_file=False)
    if not (settings.index_dir / "docs.sqlite").exists():
        ingest(ROOT / "tests" / "fixtures" / "hotpot-mini", settings)
    driver = Driver(settings, mode=args.executor, pool_size=args.branches)  # one actor a branch
    timed(driver, 1, args.branches)  # warm-up: models, indexes, actors

    receiver = HttpReceiver()
    dead = f"http://127.0.0.1:{closed_port()}/v1/traces"  # full URL: old versions need it
    stats = getattr(telemetry, "stats", dict)  # cumulative counts (newer telemetry only)
    rows, marks = [], []
    for mode in args.modes.split(","):
        if mode != "off":
            endpoint = dead if mode == "dead" else receiver.base_url + "/v1/traces"
            # (dataclasses.replace: settings validation imports the installed telemetry module)
            traced = dataclasses.replace(settings, trace_exporter="otlp", otlp_endpoint=endpoint)
            telemetry.configure_from(traced)  # replaces (and closes) the previous exporter
        marks.append(stats())  # counts before this mode (the previous exporter closed)
        if mode != "off" and args.executor == "ray":  # actors configure tracing at start
            driver.close()
            driver = Driver(traced, mode="ray", pool_size=args.branches)
            timed(driver, 1, args.branches)
        walls = timed(driver, args.runs, args.branches)
        rows.append((mode, walls))
        print(f"  {mode}: " + " ".join(f"{w:.3f}" for w in walls), file=sys.stderr, flush=True)
    newer = args.telemetry is None
    if newer:
        telemetry.flush(5.0)
    time.sleep(1.0)
    received = len(receiver.spans)
    if newer:
        telemetry.configure("none")
    marks.append(stats())
    driver.close()
    receiver.close()

    load = os.getloadavg()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load average {load[0]:.1f} at the end; executor {args.executor}, "
          f"{args.branches} branch(es), {args.runs} runs per mode, heuristic policy, "
          f"hotpot-mini; telemetry: {args.telemetry or 'installed'}")
    off = statistics.median(rows[0][1]) if rows[0][0] == "off" else None
    print(f"{'mode':<6} {'median s':>9} {'min s':>7} {'max s':>7} {'extra (median)':>15}  spans")
    for i, (mode, walls) in enumerate(rows):
        med = statistics.median(walls)
        extra = f"{med - off:+.3f} s" if off is not None else "-"
        a, b = marks[i], marks[i + 1]
        spans = (f"exported {b['exported'] - a['exported']}, dropped {b['dropped'] - a['dropped']}"
                 if a and b else "")
        print(f"{mode:<6} {med:>9.3f} {min(walls):>7.3f} {max(walls):>7.3f} {extra:>15}  {spans}")
    print(f"live receiver got {received} spans (span counts: this process only; Ray actors "
          "count their own)")


if __name__ == "__main__":
    main()
