"""The LLM as users configure it: a real OpenAI-compatible vLLM server (the CPU build serving the
bundled SmolLM2) on a loopback port, started once for this module with the README's command.

What must hold: both `llm_url` forms reach it; a wrong model, path or key is one clear error at
start; the LLM planner and policy work through it, two branches at once batched by the server;
a prompt longer than the server's prefill chunk leaves the server alive (our client sends no
per-request seed unless `llm_seed` asks for one: a seeded, chunked prefill kills a vLLM CPU
engine); and a server that fails (a wrong path, stopped mid-episode) ends the branch with status
`error` and the reason — never an ok, empty result. The last test stops the server: keep it
last. A small CPU model at ~20 tokens/s on a shared machine: few tests, few turns.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import HOTPOT

from branchsearch.infra.errors import BackendUnavailable, OutputTruncated, SettingsError
from branchsearch.infra.models.llm import OpenAIEngine, api_base

pytestmark = pytest.mark.llm
pytest.importorskip("vllm", reason="install branchsearch[llm] (scripts/setup.sh)")

Q = "Were Scott Derrickson and Ed Wood of the same nationality?"
KEY = "test-key"
# The server prefills at most this many tokens per engine step; a longer prompt is prefilled in
# chunks. Given explicitly (the README's command leaves vLLM's default, 2048-4096 on CPU by
# version) so the long-prompt test knows how long "longer" is.
CHUNK_TOKENS = 2048


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def running_requests(root: str) -> float:
    """vllm:num_requests_running from the server's Prometheus metrics (the batch now)."""
    with urllib.request.urlopen(f"{root}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("vllm:num_requests_running"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def prompt_tokens_computed(root: str) -> float:
    """Prompt tokens the server has prefilled (not taken from its prefix cache), from its
    metrics."""
    with urllib.request.urlopen(f"{root}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("vllm:prompt_tokens_by_source_total") and \
                    'source="local_compute"' in line:
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError("the server's metrics have no vllm:prompt_tokens_by_source_total")


def answer(engine, messages: list[dict], max_tokens: int) -> str:
    """What the model wrote at the LLM policy's temperature; cut at max_tokens is still an
    answer here."""
    from branchsearch.workers.llm_policy import LLMPolicy

    try:
        return engine.chat(messages, max_tokens=max_tokens, temperature=LLMPolicy.temperature)
    except OutputTruncated as cut:
        return cut.text


def count_tokens(root: str, messages: list[dict]) -> int:
    """The prompt's length in the server's own tokens, chat template included (POST /tokenize)."""
    request = urllib.request.Request(
        f"{root}/tokenize", data=json.dumps({"model": "smollm2", "messages": messages}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return int(json.loads(r.read())["count"])


class Server:
    """The vLLM OpenAI-compatible server in its own process group, stopped by its PID."""

    def __init__(self, model: Path, log: Path):
        self.port = free_port()
        self.root = f"http://127.0.0.1:{self.port}"
        # INFO: the chunked-prefill test reads the engine's config from the log (an in-process
        # engine loaded earlier in the session sets VLLM_LOGGING_LEVEL=ERROR in os.environ)
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_API_KEY": KEY,
               "VLLM_LOGGING_LEVEL": "INFO"}
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
             "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(self.port),
             "--max-model-len", "8192", "--enforce-eager", "--gpu-memory-utilization", "0.3",
             "--max-num-batched-tokens", str(CHUNK_TOKENS)],
            env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float = 900) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited {self.proc.returncode}:\n"
                                   + self.log.read_text()[-3000:])
            try:
                with urllib.request.urlopen(f"{self.root}/health", timeout=2):
                    return
            except OSError:
                time.sleep(2)
        self.stop()
        raise RuntimeError("vLLM server not ready in time:\n" + self.log.read_text()[-3000:])

    def stop(self, sig=signal.SIGTERM) -> None:
        """The server and its engine-core child (same process group, ours)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    from branchsearch.infra.models.weights import smollm2_dir

    model = smollm2_dir(request.config.cache.mkdir("branchsearch-llm"))  # converted once
    srv = Server(model, tmp_path_factory.mktemp("vllm") / "server.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def settings(tmp_path_factory, server):
    """BM25-only hotpot-mini (no embedder to load) and the LLM through the server."""
    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.infra.config.settings import load_settings

    s = load_settings(overrides={"home": tmp_path_factory.mktemp("home"), "index": "hotpot",
                                 "search_mode": "bm25", "policy": "llm", "max_turns": 2,
                                 "llm_url": server.root + "/v1", "llm_api_key": KEY,
                                 "llm_model": "smollm2", "llm_max_tokens": 160,
                                 # a turn took > 120 s with the 2 cores shared 10 ways
                                 "llm_timeout_s": 900},
                      read_env=False, read_file=False)
    ingest(HOTPOT / "corpus.jsonl", s, dense=False)
    return s


def test_url_forms_key_and_model_are_checked_at_start(server, settings):
    from branchsearch.orchestrator.driver import Driver

    assert api_base("http://h:8000") == api_base("http://h:8000/") == "http://h:8000/v1"
    assert api_base("http://h:8000/v1/") == "http://h:8000/v1"
    assert api_base("https://p.example/openai/v1beta") == "https://p.example/openai/v1beta"
    for url in (server.root, server.root + "/v1", server.root + "/v1/"):
        assert OpenAIEngine(url, "smollm2", KEY).check() == ["smollm2"]
    with pytest.raises(SettingsError, match=r"'gpt-4o' is not served .*it serves: smollm2"):
        Driver(settings.replace(llm_model="gpt-4o"), mode="local")
    with pytest.raises(BackendUnavailable, match=r"HTTP 404 .*/v2/models.*check llm_url"):
        Driver(settings.replace(llm_url=server.root + "/v2"), mode="local")
    with pytest.raises(BackendUnavailable, match=r"HTTP 401 .*check llm_api_key"):
        Driver(settings.replace(llm_api_key="wrong"), mode="local")
    started = time.perf_counter()
    with pytest.raises(BackendUnavailable, match=r"after 3 attempts.*Connection refused"):
        Driver(settings.replace(llm_url=f"http://127.0.0.1:{free_port()}"), mode="local")
    assert time.perf_counter() - started < 10  # bounded: 0.5 s + 1 s of backoff


def test_planner_and_two_concurrent_branches_through_the_server(server, settings):
    """The LLM plans, then two branches run at once, each with its own client: the server
    batches their turns (vllm:num_requests_running reaches 2)."""
    from branchsearch.infra.index.open import open_retriever
    from branchsearch.orchestrator.plan import LLMPlanner
    from branchsearch.workers.factory import make_engine, make_policy
    from branchsearch.workers.harness import Episode

    planner = LLMPlanner(make_engine(settings))
    subs = planner.plan(Q, 3)
    assert planner.last_fallback == "" and subs[0].text == Q
    assert len(subs) >= 2 and all(s.kind == "llm" for s in subs[1:])

    policies = [make_policy(settings) for _ in range(2)]
    results, running, stop = [None, None], [], threading.Event()

    def branch(i):
        retriever = open_retriever(settings)
        try:
            results[i] = Episode(subs[i].text, retriever, policies[i], settings).run()
        finally:
            retriever.close()

    def sample():
        while not stop.is_set():
            running.append(running_requests(server.root))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    threads = [threading.Thread(target=branch, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    sampler.join()
    for result, policy in zip(results, policies):
        assert result.termination in ("finish", "max_turns", "no_progress"), result.detail
        assert result.tool_calls >= 1 and result.retrieved_ids, policy.log
        assert policy.engine.stats.requests == result.turns
    assert max(running) == 2  # both branches' turns in one server batch


def test_a_prompt_longer_than_a_prefill_chunk_leaves_the_server_alive(server, settings):
    """A real question's prompt (corpus passages, ~1.4 chunks) sent as the LLM policy sends it:
    through the client `make_engine` builds, at the policy's temperature. The server prefills
    it in two steps and keeps answering. (With a per-request seed, as the client sent before,
    the CPU engine died here: "CPU Generator does not use offset", EngineDeadError.)

    Chunked by construction: the engine runs with chunked prefill and at most CHUNK_TOKENS
    tokens per step (its log says so), and it prefilled more than that for this request."""
    from conftest import HOTPOT

    from branchsearch.workers.factory import make_engine

    engine = make_engine(settings)
    assert settings.llm_seed is None and engine.seed is None
    docs = [json.loads(line) for line in (HOTPOT / "corpus.jsonl").read_text().splitlines()]
    passages = [f"[{d['title']}] {d['text']}" for d in docs]
    # a fresh first line: no prefix of this prompt is in the server's prefix cache
    text, n = f"Request {time.time_ns()}. Evidence:", 0
    while True:
        messages = [{"role": "user", "content": f"{text}\n\nQuestion: {Q} Answer briefly."}]
        tokens = count_tokens(server.root, messages)
        if tokens > 1.4 * CHUNK_TOKENS:
            break
        assert n < len(passages), f"the corpus is {tokens} tokens: too short"
        text += "\n" + "\n".join(passages[n:n + 4])
        n += 4
    assert tokens < 2 * CHUNK_TOKENS  # two chunks: the prefill is split once
    log = server.log.read_text(errors="replace")
    assert f"'max_num_batched_tokens': {CHUNK_TOKENS}" in log
    assert "enable_chunked_prefill=True" in log
    before = prompt_tokens_computed(server.root)
    assert answer(engine, messages, max_tokens=16).strip()
    assert prompt_tokens_computed(server.root) - before > CHUNK_TOKENS  # more than one step's
    with urllib.request.urlopen(f"{server.root}/health", timeout=10) as r:
        assert r.status == 200  # the engine is alive
    assert answer(engine, [{"role": "user", "content": Q}], max_tokens=8).strip()  # answering


def test_a_seed_is_sent_only_when_llm_seed_asks_and_the_server_takes_it(server, settings):
    """`llm_seed` set: the client sends it and the server answers (a prompt shorter than one
    prefill chunk, which a seed does not break)."""
    from branchsearch.workers.factory import make_engine

    engine = make_engine(settings.replace(llm_seed=7))
    assert engine.seed == 7
    assert answer(engine, [{"role": "user", "content": Q}], max_tokens=8).strip()
    with urllib.request.urlopen(f"{server.root}/health", timeout=10) as r:
        assert r.status == 200


def test_wrong_path_ends_the_branch_with_error_not_an_empty_ok(server, settings):
    """Past the start check (a client built by hand): the 404 reaches the branch, which ends
    `error` with the reason; nothing looks like a search that found nothing."""
    from branchsearch.orchestrator.driver import Driver
    from branchsearch.workers.llm_policy import LLMPolicy

    wrong = OpenAIEngine(server.root + "/v1/v1", "smollm2", KEY)
    driver = Driver(settings.replace(branches=1), mode="local",
                    policy_factory=lambda i, s: LLMPolicy(wrong))
    try:
        result = driver.search(Q)
    finally:
        driver.close()
    [branch] = result.branches
    assert branch.status == "error" and not result.evidence
    assert "HTTP 404" in branch.error and "/v1/v1/chat/completions" in branch.error
    assert "check llm_url" in branch.error
    assert result.status == "failed" and result.to_dict()["status"] == "failed"


def test_server_stopped_mid_episode_ends_the_branch_with_error(server, settings):
    """Kill the server while it generates the first turn: the branch retries, then ends
    `error` with the reason. (Stops the module's server: keep this test last.)"""
    from branchsearch.orchestrator.driver import Driver

    driver = Driver(settings.replace(branches=1, max_turns=3), mode="local")  # check passes
    out = {}
    searching = threading.Thread(target=lambda: out.update(result=driver.search(Q)))
    searching.start()
    deadline = time.monotonic() + 300
    while running_requests(server.root) < 1:  # the first decision is being generated
        assert time.monotonic() < deadline and searching.is_alive()
        time.sleep(0.05)
    server.stop(signal.SIGKILL)
    searching.join(timeout=120)
    driver.close()
    [branch] = out["result"].branches
    assert branch.status == "error" and out["result"].status == "failed"
    assert not out["result"].evidence
    assert "after 3 attempts" in branch.error, branch.error
