"""The LLM through an OpenAI-compatible vLLM server vs vLLM in-process, and the server's batch.

    python bench/llm_endpoint.py [--home .branchsearch] [--questions 4] [--turns 2]

One run on the bundled SmolLM2-135M-Instruct (vLLM CPU build), hotpot-mini (BM25 only):

1. Per turn, the same requests to both engines: for each question, the turn-1 view (no
   chunks) and a turn-2 view (the top 5 BM25 chunks visible), rendered and constrained as
   LLMPolicy does (max 160 tokens). Reports median latency per turn and completion tokens/s.
   Both engines decode with the same grammar settings (xgrammar, no free whitespace) and the
   same CPU binding (`--bind`).
2. The server's batch with 1 vs 3 branches: real episodes (LLMPolicy, `--turns` turns) on
   threads, one client each, while vLLM's /metrics is sampled every 0.1 s
   (`vllm:num_requests_running`). Reports the median and max batch while busy, and the
   aggregate completion tokens/s.

The server is started with the README's command (plus the grammar flag) on a free port and
stopped by its PID; then the in-process engine loads in this process.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOTPOT = ROOT / "tests" / "fixtures" / "hotpot-mini"
GRAMMAR = '{"backend": "xgrammar", "disable_any_whitespace": true}'
MAX_TOKENS = 160


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(root: str, name: str) -> float:
    with urllib.request.urlopen(f"{root}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def start_server(model: str, log: Path, bind: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": bind}
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
         "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(port),
         "--max-model-len", "8192", "--enforce-eager", "--gpu-memory-utilization", "0.3",
         "--structured-outputs-config", GRAMMAR],
        env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    root = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 1200
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"server exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(f"{root}/health", timeout=2).close()
            return proc, root
        except OSError:
            time.sleep(2)
    stop_server(proc)
    sys.exit("server not ready in 20 min")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def requests_for(questions: list[str], retriever) -> list[tuple[list[dict], dict]]:
    """(messages, schema) per turn view: turn 1 without chunks, turn 2 with the top 5."""
    from branchsearch.infra.models.tokenizer import TokenCounter
    from branchsearch.workers.budget import Budget
    from branchsearch.workers.llm_policy import action_schema, render
    from branchsearch.workers.policy import AgentView, VisibleChunk
    from branchsearch.workers.tools import TOOLS

    counter, allowed = TokenCounter("o200k_base"), list(TOOLS)
    schemas = [TOOLS[n].schema for n in allowed]
    out = []
    for q in questions:
        hits = retriever.search(q, mode="bm25", k=5)
        chunks = [VisibleChunk(h.chunk_id, h.doc_id, h.title, h.text[:1200],
                               counter.count(h.text[:1200])) for h in hits]
        used = sum(c.tokens for c in chunks)
        for turn, visible, u in ((1, [], 0), (2, chunks, used)):
            view = AgentView(q, turn, visible, Budget(8192).usage_line(u), u, 8192, allowed,
                             [], "", schemas)
            out.append((render(view, max_calls=2), action_schema(schemas, 2)))
    return out


def per_turn(engine, requests) -> dict:
    """Sequential calls: median latency per turn and median completion tokens/s."""
    from branchsearch.infra.errors import OutputTruncated

    def call(messages, schema, max_tokens):
        try:
            engine.chat(messages, schema=schema, max_tokens=max_tokens, temperature=0.3)
        except OutputTruncated:  # cut at max_tokens: its tokens still count
            pass

    call(*requests[0], 8)  # warm-up (grammar compiled, caches filled)
    latencies, rates, tokens = [], [], []
    for messages, schema in requests:
        before = engine.stats.completion_tokens
        started = time.perf_counter()
        call(messages, schema, MAX_TOKENS)
        elapsed = time.perf_counter() - started
        n = engine.stats.completion_tokens - before
        latencies.append(elapsed)
        rates.append(n / elapsed)
        tokens.append(n)
    return {"latency_s": statistics.median(latencies), "tokens_per_s": statistics.median(rates),
            "completion_tokens": statistics.median(tokens), "calls": len(requests)}


def branches(settings, root: str, questions: list[str]) -> dict:
    """Run one episode per question concurrently (one client each); sample the batch."""
    from branchsearch.infra.index.open import open_retriever
    from branchsearch.workers.factory import make_policy
    from branchsearch.workers.harness import Episode

    policies = [make_policy(settings) for _ in questions]
    samples, stop = [], threading.Event()

    def run(i):
        retriever = open_retriever(settings)
        try:
            return Episode(questions[i], retriever, policies[i], settings).run()
        finally:
            retriever.close()

    def sample():
        while not stop.is_set():
            samples.append(metric(root, "vllm:num_requests_running"))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample)
    sampler.start()
    started = time.perf_counter()
    results = [None] * len(questions)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, run(i)))
               for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    stop.set()
    sampler.join()
    busy = [s for s in samples if s > 0] or [0.0]
    tokens = sum(p.engine.stats.completion_tokens for p in policies)
    return {"branches": len(questions), "batch_median": statistics.median(busy),
            "batch_max": max(busy), "samples_busy": len(busy), "wall_s": wall,
            "turns": sum(r.turns for r in results), "completion_tokens": tokens,
            "tokens_per_s": tokens / wall,
            "terminations": [r.termination for r in results]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--home", default=".branchsearch", help="where the model is converted")
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=2, help="max_turns of the branch episodes")
    ap.add_argument("--bind", default=f"0-{(os.cpu_count() or 1) - 1}",
                    help="VLLM_CPU_OMP_THREADS_BIND for both engines (default: the in-process "
                         "engine's, all cores; on an oversubscribed machine '0' is faster)")
    args = ap.parse_args()
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.bind  # the in-process engine reads it

    sys.path.insert(0, str(ROOT))
    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.infra.models.llm import OpenAIEngine, VLLMEngine
    from branchsearch.infra.models.weights import smollm2_dir
    from branchsearch.infra.index.open import open_retriever
    from branchsearch.infra.config.settings import load_settings

    model = str(smollm2_dir(args.home))
    work = Path(tempfile.mkdtemp(prefix="bench-llm-endpoint-"))
    questions = [json.loads(line)["text"] for line in
                 (HOTPOT / "queries.jsonl").read_text().splitlines()[: args.questions]]
    settings = load_settings(overrides={"home": work / "home", "index": "hotpot",
                                        "search_mode": "bm25", "policy": "llm",
                                        "max_turns": args.turns, "llm_max_tokens": MAX_TOKENS,
                                        "llm_timeout_s": 900},
                             read_env=False, read_file=False)
    ingest(HOTPOT / "corpus.jsonl", settings, dense=False)
    retriever = open_retriever(settings)
    reqs = requests_for(questions, retriever)
    retriever.close()
    load_before = os.getloadavg()

    t = time.perf_counter()
    proc, root = start_server(model, work / "server.log", args.bind)
    server_start = time.perf_counter() - t
    try:
        settings = settings.replace(llm_url=root, llm_model="smollm2")
        server = per_turn(OpenAIEngine(root, "smollm2", timeout_s=900), reqs)
        batch = [branches(settings, root, [questions[i % len(questions)] for i in range(n)])
                 for n in (1, 3)]  # (with fewer than 3 questions, a question runs twice)
    finally:
        stop_server(proc)

    t = time.perf_counter()
    engine = VLLMEngine(model, max_model_len=8192)
    engine._load()
    local_load = time.perf_counter() - t
    local = per_turn(engine, reqs)
    load_after = os.getloadavg()

    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, SHARED with other work "
          f"(load average 1/5/15 min: {'/'.join(f'{x:.1f}' for x in load_before)} before, "
          f"{'/'.join(f'{x:.1f}' for x in load_after)} after); vLLM CPU build, {model}; "
          f"VLLM_CPU_OMP_THREADS_BIND={args.bind} for both engines")
    print(f"server ready in {server_start:.0f} s; in-process engine loaded in {local_load:.0f} s")
    print(f"\nper turn, {len(reqs)} identical requests ({len(questions)} hotpot-mini questions x "
          f"turn 1 and turn 2 views), max {MAX_TOKENS} tokens, medians:\n")
    print("| engine | latency per turn (s) | completion tokens/s | completion tokens |")
    print("|---|---|---|---|")
    for name, row in (("OpenAI-compatible server (HTTP)", server), ("vLLM in-process", local)):
        print(f"| {name} | {row['latency_s']:.2f} | {row['tokens_per_s']:.1f} | "
              f"{row['completion_tokens']:.0f} |")
    print(f"\nserver batch (vllm:num_requests_running sampled every 0.1 s while busy), "
          f"episodes of max {args.turns} turns:\n")
    print("| branches | batch median | batch max | turns | wall (s) | aggregate tokens/s |")
    print("|---|---|---|---|---|---|")
    for row in batch:
        print(f"| {row['branches']} | {row['batch_median']:.0f} | {row['batch_max']:.0f} | "
              f"{row['turns']} | {row['wall_s']:.1f} | {row['tokens_per_s']:.1f} |")
    print("\n" + json.dumps({"server": server, "in_process": local, "batch": batch,
                             "load_before": load_before, "load_after": load_after}))


if __name__ == "__main__":
    main()
