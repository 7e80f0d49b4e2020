"""Bursts against the service as it is deployed: p50 / p99 / max of N concurrent 3-branch
searches, one key each, over two indexes, for `serve --standalone` with each executor and for
Ray Serve. Each mode is started as its own process (`branchsearch serve …`), warmed with one
burst (both indexes started, models loaded), then measured over `--bursts` bursts.

    python bench/service_burst.py [--corpus tests/fixtures/hotpot-mini] [--n 30] [--bursts 3]
        [--modes standalone-local,standalone-ray,serve]

Hardware and load average are printed with the table; one run, no repetition: a shared machine
gives noisy absolute figures, so compare modes within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ("Were Scott Derrickson and Ed Wood of the same nationality?",
             "Who was born first, Scott Derrickson or Ed Wood?")
ARGS = {"standalone-local": ["--standalone", "--executor", "local"],
        "standalone-ray": ["--standalone", "--executor", "ray"], "serve": []}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def burst(url: str, keys: list[str]) -> list[tuple[int, float]]:
    async def one(client, i, key):
        began = time.perf_counter()
        r = await client.post("/v1/search", headers={"Authorization": f"Bearer {key}"}, json={
            "question": QUESTIONS[i % 2], "index": ("one", "two")[i % 2], "branches": 3,
            "deadline_s": 120})
        return r.status_code, time.perf_counter() - began

    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        return await asyncio.gather(*[one(client, i, k) for i, k in enumerate(keys)])


def run_mode(mode: str, home: Path, keys: list[str], bursts: int) -> dict:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "branchsearch.orchestrator.cli", "serve",
                             *ARGS[mode], "--home", str(home), "--index", "one", "--keys",
                             str(home / "keys.json"), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        began = time.time()
        while time.time() - began < 600:
            try:
                if httpx.get(url + "/readyz", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        ready_s = time.time() - began
        asyncio.run(burst(url, keys))  # warm: both indexes started
        latencies, codes = [], {}
        for _ in range(bursts):
            for code, seconds in asyncio.run(burst(url, keys)):
                codes[code] = codes.get(code, 0) + 1
                latencies.append(seconds)
        os.kill(proc.pid, signal.SIGTERM)
        exit_code = proc.wait(120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    latencies.sort()
    return {"mode": mode, "ready_s": round(ready_s, 1), "codes": codes,
            "p50": statistics.median(latencies),
            "p99": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "max": latencies[-1], "exit": exit_code}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", default=str(ROOT / "tests/fixtures/hotpot-mini"))
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--bursts", type=int, default=3)
    ap.add_argument("--modes", default="standalone-local,standalone-ray,serve")
    args = ap.parse_args()

    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.orchestrator.service.auth import KeyStore

    home = Path(tempfile.mkdtemp(prefix="bs-burst-"))
    for index in ("one", "two"):
        ingest(args.corpus, load_settings(overrides={"home": home, "index": index},
                                          read_env=False, read_file=False))
    store = KeyStore(home / "keys.json")
    keys = [store.add(f"u{i}", ("research",)) for i in range(args.n)]
    load = os.getloadavg()[0]
    rows = [run_mode(mode, home, keys, args.bursts) for mode in args.modes.split(",")]
    print(f"\nhardware: {os.cpu_count()} CPUs ({platform.machine()}), shared; load average "
          f"{load:.1f} at start, {os.getloadavg()[0]:.1f} at end; {args.bursts} bursts of "
          f"{args.n} concurrent 3-branch searches (one key each, two indexes) per mode, "
          "after one warm-up burst")
    print(f"{'mode':<18} {'ready s':>8} {'p50 s':>7} {'p99 s':>7} {'max s':>7}  answers  "
          "SIGTERM exit")
    for r in rows:
        print(f"{r['mode']:<18} {r['ready_s']:>8} {r['p50']:>7.2f} {r['p99']:>7.2f} "
              f"{r['max']:>7.2f}  {r['codes']}  {r['exit']}")


if __name__ == "__main__":
    main()
