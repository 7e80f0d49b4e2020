"""Resident memory of the Ray GCS (the head node's control service) against the actor calls a
long run makes, on the local cluster `--executor ray` starts (`infra.raycluster.connect`).

    python bench/ray_gcs_memory.py --calls 300000

Ray's GCS keeps one task event a call, up to `RAY_task_events_max_num_task_in_gcs` (100,000 in
Ray 2.60); past that it drops the oldest, so its memory levels off. Each step makes `calls/10`
calls of a one-line actor method in rounds of 100 and prints the GCS's RSS (psutil) 2 s after
(workers report their events about every second). Not timed: no bench lock needed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import psutil
import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from branchsearch.infra.config.settings import Settings  # noqa: E402
from branchsearch.infra.raycluster import connect  # noqa: E402


@ray.remote(num_cpus=0.5)
class Echo:
    def call(self, x):
        return x


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=300_000)
    calls = parser.parse_args().calls
    connect(Settings(ray_address=None))
    gcs = next(p for p in psutil.Process().children(recursive=True) if p.name() == "gcs_server")
    echo = Echo.remote()
    ray.get(echo.call.remote(0))
    time.sleep(2)
    print(f"Ray {ray.__version__}, {psutil.cpu_count()} CPUs; GCS RSS by actor calls")
    print("| calls | GCS MB | s |\n|---:|---:|---:|")
    print(f"| 0 | {gcs.memory_info().rss >> 20} | 0 |", flush=True)
    start, done, step = time.monotonic(), 0, max(calls // 10, 100)
    while done < calls:
        ray.get([echo.call.remote(j) for j in range(100)])
        done += 100
        if done % step == 0 or done >= calls:
            time.sleep(2)
            print(f"| {done:,} | {gcs.memory_info().rss >> 20} | "
                  f"{time.monotonic() - start:.0f} |", flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
