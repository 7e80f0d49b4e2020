"""Engine throughput with 1 vs 4 concurrent branches: the batching gain of one shared engine.

    python bench/llm_engine.py [--home .branchsearch] [--rounds 3]

Each "branch" is a thread sending the same kind of request an LLMPolicy sends (a rendered
agent view, the action schema, max 160 tokens) to one `VLLMEngine`; concurrent calls are
gathered into one batch. Reports completion tokens per second (median over rounds) and the
ratio, measured in one run on the bundled SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from branchsearch.infra.config.settings import load_settings  # noqa: E402
from branchsearch.workers.budget import Budget  # noqa: E402
from branchsearch.workers.factory import local_engine  # noqa: E402
from branchsearch.workers.llm_policy import action_schema, render  # noqa: E402
from branchsearch.workers.policy import AgentView  # noqa: E402
from branchsearch.workers.tools import TOOLS  # noqa: E402

QUESTIONS = ["Who directed the film Ed Wood?", "Where was Shirley Temple born?",
             "What did Scott Derrickson direct?", "Which band recorded Brother?",
             "When was the Laleli Mosque built?", "Who founded Local H?",
             "What is the capital of Vermont?", "Who wrote Kiss and Tell?"]


def request(i: int):
    allowed = list(TOOLS)
    view = AgentView(QUESTIONS[i % len(QUESTIONS)], 1, [], Budget(8192).usage_line(0), 0,
                     8192, allowed, [], "", [TOOLS[n].schema for n in allowed])
    return render(view, max_calls=2), action_schema(view.tool_schemas, 2)


def run(engine, n: int) -> tuple[float, int]:
    before = engine.stats.completion_tokens
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=n) as pool:
        list(pool.map(lambda i: engine.chat(request(i)[0], schema=request(i)[1], max_tokens=160,
                                            temperature=0.3), range(n)))
    elapsed = time.perf_counter() - started
    tokens = engine.stats.completion_tokens - before
    return tokens / elapsed, tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--home", default=".branchsearch")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    settings = load_settings(overrides={"home": args.home})
    engine = local_engine(settings)
    t = time.perf_counter()
    engine.chat(request(0)[0], schema=request(0)[1], max_tokens=16)  # load + warm-up
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; model {engine.model}; "
          f"load + first call {time.perf_counter() - t:.1f} s")
    rows = {}
    for n in (1, 4):
        rates = [run(engine, n)[0] for _ in range(args.rounds)]
        rows[n] = statistics.median(rates)
    print("| concurrent branches | completion tokens/s (median) |\n|---|---|")
    for n, rate in rows.items():
        print(f"| {n} | {rate:.1f} |")
    print(f"batching gain (4 vs 1): {rows[4] / rows[1]:.2f}x")


if __name__ == "__main__":
    main()
