"""Resident memory of the Ray actors a search starts: a retriever actor and branch actors.

    python bench/scaling_actor_memory.py   # indexes hotpot-bm25 (--no-dense) and hotpot-mini
                                           # (hybrid) under /tmp/scale/home

One question with 2 branches through Ray per index, then the RSS of the retriever actor and of
each branch actor (psutil; shared library pages included). Not timed: no bench lock needed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import psutil
import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from branchsearch.infra.config.settings import load_settings  # noqa: E402
from branchsearch.orchestrator.driver import Driver  # noqa: E402

Q = "Were Scott Derrickson and Ed Wood of the same nationality?"


def rss_mb(pid: int) -> int:
    return round(psutil.Process(pid).memory_info().rss / 2**20)


def main(home: str = "/tmp/scale/home") -> None:
    out = {}
    for name, index in (("bm25", "hotpot-bm25"), ("hybrid", "hotpot-mini")):
        s = load_settings(overrides={"home": home, "index": index, "branches": 2,
                                     "search_mode": "bm25" if name == "bm25" else "hybrid"})
        d = Driver(s, mode="ray", pool_size=2)
        try:
            d.search(Q, max_branches=2)
            retriever = ray.get(d.executor.retriever.ping.remote())
            branches = ray.get([a.ping.remote() for a in d.executor.pool._idle])
            out[name] = {"retriever_mb": rss_mb(retriever),
                         "branch_mb": [rss_mb(p) for p in branches]}
        finally:
            d.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
