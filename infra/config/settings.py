"""One settings object, merged from a TOML file, `BRANCHSEARCH_*` environment and flags.

Precedence (later wins): defaults < TOML file < environment < explicit overrides (CLI flags).
The TOML file is `--config PATH`, else `BRANCHSEARCH_CONFIG`, else `<home>/branchsearch.toml`
if it exists. Keys are the field names below, at the top of the file (`budget_tokens = 16384`)
or in their section's table (`[agent]` then `budget_tokens = 16384`): `SECTIONS` says which
section holds each field, and `Settings.section(name)` reads one. Every knob has one default,
here; the object stays flat because it travels whole to every actor.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import unicodedata
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from branchsearch.infra.models.tokenizer import encoding_problem
from branchsearch.infra.stores.protocols import MAX_K
from branchsearch.infra.config.choices import (MILVUS_CONSISTENCIES, MILVUS_INDEXES, MODES,
                                        OTLP_PROTOCOLS, PLANNERS, POLICIES, STATIC_QUERIES,
                                        TRACE_EXPORTERS, MilvusConsistency, Mode,
                                        OtlpProtocol, Planner, Policy, StaticQueries,
                                        TraceExporter, one_of)
from branchsearch.infra.models.embed_export import BACKENDS as EMBED_BACKENDS
from branchsearch.infra.models.embed_export import DEFAULT_BACKEND as EMBED_DEFAULT_BACKEND
from branchsearch.infra.errors import SettingsError


@dataclass(frozen=True)
class Settings:
    # where data lives
    home: Path = Path(".branchsearch")
    index: str = "default"
    # chunking and token counting
    encoding: str = "o200k_base"
    chunk_tokens: int = 256
    chunk_overlap: int = 32
    # embeddings
    embed_model: str = "all-MiniLM-L6-v2"  # or a sentence-transformers model path
    embed_batch: int = 64
    embed_device: str = "cpu"
    # static-minilm: a new index's first ingest fits the static model to this many of its
    # chunks (MiniLM teaches it; infra/models/static_tune.py); 0: the distilled model as is
    static_tune_chunks: int = 4096
    # who embeds the queries of an index fitted that way: "minilm" (MiniLM onto the fitted
    # model's axes: recall nearer MiniLM's, at a MiniLM query's cost) | "static" (the fitted
    # model: a tokenizer pass; figures in reports/embedding.md)
    static_queries: StaticQueries = "minilm"
    # the CPU runtime: torch | onnx | onnx-int8 | openvino | openvino-int8 (reports/embedding.md);
    # an exported one whose packages are missing falls back to torch with one line
    embed_backend: str = EMBED_DEFAULT_BACKEND
    # backends: empty means embedded (Milvus Lite file, tantivy index under home)
    milvus_uri: str = ""
    milvus_token: str = ""
    milvus_index: str = "auto"  # auto (Lite: FLAT, server: HNSW) | FLAT | HNSW | IVF_FLAT
    milvus_hnsw_m: int = 16
    milvus_hnsw_ef_construction: int = 200
    # HNSW search breadth (at least k): 128 keeps recall@10 at 0.99-1.0 on a 1M-chunk graph
    # (0.975 at 64) for ~0.6 ms a search (reports/scaling.md §1c)
    milvus_search_ef: int = 128
    milvus_consistency: MilvusConsistency = "Bounded"  # server searches (Strong: +~200 ms each)
    es_url: str = ""
    es_api_key: str = ""
    # retrieval
    search_mode: Mode = "hybrid"  # the agent's search_corpus default
    rrf_k: int = 60  # hybrid BM25 + dense fusion (long candidate lists)
    branch_rrf_k: int = 5  # fusing branch rankings (short, already ordered by the agents)
    hybrid_candidates: int = 50  # from each of BM25 and dense (1..MAX_K)
    grep_max_pattern: int = 200
    # access control: a caller sees public documents and those of its groups (`--acl G`);
    # acl_admin = true (or `--acl-admin`) sees every document (see infra/backends.ACL_ALL)
    acl_admin: bool = False
    # the branch agent
    budget_tokens: int = 8192
    soft_limit: float = 0.5
    hard_limit: float = 0.92
    max_turns: int = 12
    max_tokens_read: int = 60000
    no_progress_turns: int = 3
    result_token_cap: int = 120
    search_k: int = 8  # a search call's k when it names none (the heuristic names its own)
    read_window_tokens: int = 400
    final_k: int = 10
    prune: bool = True
    learned_rank: bool = True  # heuristic: finish by workers/heuristic/ranker.py (else its score)
    per_title: int = 2  # heuristic policy: documents of one title before other pages get the
    # next places (workers.rank.crowd); 0: off, for corpora whose titles repeat by design
    policy: Policy = "heuristic"
    planner: Planner = "heuristic"
    # LLM engines (policy or planner = llm): an OpenAI-compatible endpoint by URL, else vLLM
    llm_url: str = ""
    llm_api_key: str = ""
    llm_model: str = "smollm2"  # alias of the bundled SmolLM2-135M-Instruct, or a model path/name
    llm_engines: int = 1  # vLLM engine actors shared by all branches
    llm_tensor_parallel: int = 1  # GPUs per engine
    llm_max_model_len: int = 4096
    llm_max_tokens: int = 256
    llm_detached: bool = False  # keep engines alive across driver runs (named, detached)
    llm_timeout_s: float = 120.0  # one call to llm_url; timed out: retried (3 attempts in all)
    # a `seed` sent with every request to llm_url, for reproducible sampling; None: none sent.
    # A seeded request whose prompt the server prefills in chunks kills a vLLM CPU server
    # ("CPU Generator does not use offset"), so set it only for a server that supports it
    llm_seed: int | None = None
    # orchestration
    branches: int = 3
    # forks (orchestrator/forks.py): after the first wave, at most `forks` branches a question
    # pursue chunks a branch pruned within `fork_gap` (relative) of its keep line; 0: none.
    # Never with one branch (`branches = 1` is the single-context baseline)
    forks: int = 0
    fork_gap: float = 0.15
    # chains (orchestrator/chains.py): for a compositional question, its inner hop runs as a
    # branch and its top `chains` answers each seed a branch for the outer hop; 0: none
    chains: int = 0
    # bridges (orchestrator/chains.py): the entities named near the question's words in its
    # branch's top chunk each seed a branch for the next hop; 0: none. With bridge_depth 2,
    # each bridge that finished runs one bridge of its own (the hop after that), within
    # `branches`; with 3, each of those one more. Never with one branch. Measured in
    # reports/bridges.md (v10; depth 3: v21)
    bridges: int = 1
    bridge_depth: int = 2
    # covered branches (orchestrator/cover.py): a planned branch whose entities the question's
    # own branch already ranks among its first documents is not fused, and in-process not run
    skip_covered: bool = True
    branch_timeout_s: float = 120.0
    branch_retries: int = 1
    branch_num_cpus: float = 0.5
    branch_num_gpus: float = 0.0  # used only when the cluster has GPUs (LLM policies)
    ray_address: str = ""
    batch_concurrency: int = 2
    # retriever actors the branches share, load-balanced (least-loaded). More than 1 only with
    # server backends: a Milvus Lite file has one owning process, so Lite keeps 1 (README: Scaling)
    retriever_replicas: int = 1
    # the branches of one question share what the backends answered (infra/retrieval/fetch_cache.py):
    # fewer backend searches, the same results; off: every branch asks the backends itself
    fetch_cache: bool = True
    backend_retries: int = 2  # a backend error in a tool is retried this often, then ends the branch
    backend_backoff_s: float = 0.2  # first retry's wait; doubles each retry
    # one request to Milvus or Elasticsearch; one not answered in time is a backend error
    # (Milvus takes whole seconds: 0.5 is 1)
    backend_timeout_s: float = 30.0
    actor_start_timeout_s: float = 300.0  # waiting for actors (engines, retriever, pool) to start
    query_max_tokens: int = 96  # a longer question is cut to this many tokens before searching
    # telemetry: none | console | jsonl | otlp. The standard OTEL_TRACES_EXPORTER,
    # OTEL_EXPORTER_OTLP_[TRACES_]{ENDPOINT,PROTOCOL,HEADERS} are read here, on the driver side,
    # so they reach every actor inside this object (see `_otel_env`).
    trace_exporter: TraceExporter = "none"
    trace_file: str = ""
    otlp_endpoint: str = ""  # a collector's base URL (http://host:4318) or the full .../v1/traces
    otlp_protocol: OtlpProtocol = "http"  # http (OTLP/HTTP protobuf) | grpc
    otlp_headers: str = ""  # k1=v1,k2=v2 (e.g. an API key header)
    otlp_timeout_s: float = 2.0  # one export, retries included (in the background)
    trace_flush_timeout_s: float = 0.5  # the most a query waits for its spans to leave

    # the service's limits (`serve`; orchestrator/service/admission.py `Limits`): what one
    # request may ask, and how much the server takes on at once
    max_body_bytes: int = 1 << 20  # request bodies (documents PUT included)
    max_question_chars: int = 1000
    max_branches: int = 8
    max_k: int = 50  # a request's k; the service takes at most final_k (what a search returns)
    default_deadline_s: float = 60.0
    max_deadline_s: float = 300.0
    per_key_concurrency: int = 4  # searches in flight per key
    # searches of one key that wait (first come, first served, within their deadline) for one of
    # its `per_key_concurrency` slots; past it 429 at once. 0: 429 at once past the slots
    per_key_queue: int = 16
    max_in_flight: int = 64  # whole server (standalone; Ray Serve uses its own queue limits)
    retry_after_s: int = 1
    # an index other than the default unused this long is closed (its retriever process and
    # models freed) and opened again by its next request; 0: kept open until the server stops
    index_idle_close_s: float = 900.0
    # the most indexes open at once (the default one included): a search of one more closes
    # the least recently used open index no request is using; all in use: 503 overloaded
    max_open_indexes: int = 8

    # indexes an enterprise already has: `[indexes.NAME]` tables (see infra/stores/external.py)
    indexes: tuple = ()

    @property
    def external(self):
        """The external index named by `index`, or None for an index of our own."""
        return next((spec for spec in self.indexes if spec.name == self.index), None)

    @property
    def index_dir(self) -> Path:
        return Path(self.home) / "indexes" / self.index

    def section(self, name: str) -> dict[str, Any]:
        """The fields of one section (`SECTIONS`), by name."""
        if name not in SECTIONS:
            raise SettingsError(f"no settings section {name!r} (sections: "
                                f"{', '.join(SECTIONS)})")
        return {field: getattr(self, field) for field in SECTIONS[name]}

    def replace(self, **changes: Any) -> "Settings":
        return load_settings(base=self, overrides=changes, read_env=False, read_file=False)


_FIELDS = {f.name: f for f in fields(Settings)}

# The rooms of the settings: which component reads which fields. A field is in exactly one.
SECTIONS: dict[str, tuple[str, ...]] = {
    "index": ("home", "index", "indexes"),
    "ingest": ("encoding", "chunk_tokens", "chunk_overlap", "embed_model", "embed_batch",
               "embed_device", "embed_backend", "static_tune_chunks", "static_queries"),
    "stores": ("milvus_uri", "milvus_token", "milvus_index", "milvus_hnsw_m",
               "milvus_hnsw_ef_construction", "milvus_search_ef", "milvus_consistency", "es_url",
               "es_api_key", "backend_retries", "backend_backoff_s", "backend_timeout_s"),
    "retrieval": ("search_mode", "rrf_k", "branch_rrf_k", "hybrid_candidates",
                  "grep_max_pattern", "acl_admin", "fetch_cache"),
    "agent": ("budget_tokens", "soft_limit", "hard_limit", "max_turns", "max_tokens_read",
              "no_progress_turns", "result_token_cap", "search_k", "read_window_tokens",
              "final_k", "prune", "learned_rank", "per_title", "policy", "planner",
              "query_max_tokens", "forks", "fork_gap", "chains", "bridges",
              "bridge_depth", "skip_covered"),
    "llm": ("llm_url", "llm_api_key", "llm_model", "llm_engines", "llm_tensor_parallel",
            "llm_max_model_len", "llm_max_tokens", "llm_detached", "llm_timeout_s", "llm_seed"),
    "execution": ("branches", "branch_timeout_s", "branch_retries", "branch_num_cpus",
                  "branch_num_gpus", "ray_address", "batch_concurrency", "retriever_replicas",
                  "actor_start_timeout_s"),
    "tracing": ("trace_exporter", "trace_file", "otlp_endpoint", "otlp_protocol", "otlp_headers",
                "otlp_timeout_s", "trace_flush_timeout_s"),
    "service": ("max_body_bytes", "max_question_chars", "max_branches", "max_k",
                "default_deadline_s", "max_deadline_s", "per_key_concurrency", "per_key_queue",
                "max_in_flight", "retry_after_s", "index_idle_close_s", "max_open_indexes"),
}
SECTION_OF = {name: section for section, names in SECTIONS.items() for name in names}

# Whether a setting changes a question's evidence on a given index. A batch row records the
# values of those that do (`orchestrator.batch.made_with`), and a resume keeps only rows made
# with the same values. A field is in exactly one of the three (tests/infra/test_infra.py).
CHANGES_RESULT: tuple[str, ...] = (
    "encoding",  # the agent counts its budget in it
    "static_queries", "embed_backend",  # how a query is embedded
    "milvus_search_ef", "milvus_consistency",  # what a dense search returns
    "search_mode", "rrf_k", "branch_rrf_k", "hybrid_candidates",
    "budget_tokens", "soft_limit", "hard_limit", "max_turns", "max_tokens_read",
    "no_progress_turns", "result_token_cap", "search_k", "read_window_tokens", "final_k",
    "prune", "learned_rank", "per_title", "policy", "planner", "query_max_tokens", "forks",
    "fork_gap", "chains", "bridges", "bridge_depth", "skip_covered",
    "branches",
)
# ... only when an LLM plans or searches (policy or planner "llm")
CHANGES_RESULT_WITH_LLM: tuple[str, ...] = (
    "llm_model", "llm_seed", "llm_max_tokens", "llm_max_model_len")
NO_RESULT_CHANGE: tuple[str, ...] = (
    # where the data and the servers are, and their credentials (the index is in every row)
    "home", "index", "indexes", "milvus_uri", "milvus_token", "es_url", "es_api_key",
    "llm_url", "llm_api_key", "ray_address",
    # kept by the index: its manifest, the Milvus index built at its ingest
    "chunk_tokens", "chunk_overlap", "embed_model", "static_tune_chunks", "milvus_index",
    "milvus_hnsw_m", "milvus_hnsw_ef_construction",
    # speed and resources: the same evidence, sooner or later
    "embed_batch", "embed_device", "fetch_cache", "llm_engines", "llm_tensor_parallel",
    "llm_detached", "branch_num_cpus", "branch_num_gpus", "batch_concurrency",
    "retriever_replicas",
    # retries and limits: whether a question or a call ends ok, not what an ok one found (an
    # ok row a branch timeout cut short says so, `late_waves`, and a batch asks it again)
    "backend_retries", "backend_backoff_s", "backend_timeout_s", "llm_timeout_s",
    "branch_timeout_s", "branch_retries", "actor_start_timeout_s", "grep_max_pattern",
    # who asks: the row's `acl` ("*" for an admin)
    "acl_admin",
    # telemetry, and the service's limits
    "trace_exporter", "trace_file", "otlp_endpoint", "otlp_protocol", "otlp_headers",
    "otlp_timeout_s", "trace_flush_timeout_s", "max_body_bytes", "max_question_chars",
    "max_branches", "max_k", "default_deadline_s", "max_deadline_s", "per_key_concurrency",
    "per_key_queue", "max_in_flight", "retry_after_s", "index_idle_close_s", "max_open_indexes",
)


def _flatten_sections(data: dict[str, Any], path) -> dict[str, Any]:
    """A settings file's `[section]` tables as top-level keys, each checked to belong to its
    section (`[indexes.NAME]` tables stay as they are: they declare external indexes)."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if key in SECTIONS and isinstance(value, dict):  # `index = "x"` is the field
            for name, inner in value.items():
                if SECTION_OF.get(name) != key:
                    where = (f"; it belongs in [{SECTION_OF[name]}]" if name in SECTION_OF
                             else "")
                    raise SettingsError(f"settings file {path}: [{key}] has no setting "
                                        f"{name!r}{where}")
                if name in flat:
                    raise SettingsError(f"settings file {path}: {name} is set twice (at the "
                                        f"top and in [{key}])")
                flat[name] = inner
        else:
            if key in flat:
                raise SettingsError(f"settings file {path}: {key} is set twice (at the top and "
                                    f"in [{SECTION_OF.get(key, '?')}])")
            flat[key] = value
    return flat


def _coerce(name: str, value: Any) -> Any:
    if name == "indexes":
        from branchsearch.infra.stores.external import parse_indexes

        return parse_indexes(value)
    if name == "llm_seed":  # the one optional number: "" or "none" (any case) is no seed
        if value is None or isinstance(value, str) and value.strip().lower() in ("", "none"):
            return None
        if isinstance(value, bool) or isinstance(value, float) and not value.is_integer():
            raise SettingsError(f"setting llm_seed: cannot read {value!r} as int (or none)")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise SettingsError(f"setting llm_seed: cannot read {value!r} as int (or none)") \
                from None
    kind = type(getattr(Settings, name)) if name != "home" else Path
    try:
        if kind is bool and isinstance(value, str):
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if kind is int and (isinstance(value, bool) or isinstance(value, float)
                            and not value.is_integer()):  # a TOML 1.5 or true, not rounded
            raise ValueError(value)
        return kind(value)
    except (TypeError, ValueError):
        raise SettingsError(f"setting {name}: cannot read {value!r} as {kind.__name__}") from None


INDEX_NAME_CHARS = 100  # an index name is 1..100 characters
INDEX_NAME_BYTES = 200  # and at most this many bytes in UTF-8 (a file name holds 255)
INDEX_NAME_RULE = (f"index names are 1-{INDEX_NAME_CHARS} letters, digits, '-' or '_' (any "
                   f"script; at most {INDEX_NAME_BYTES} bytes in UTF-8)")


def index_name(name: object) -> object:
    """An index name as stored: NFC, so that `café` typed decomposed (macOS input, NFD) names
    the index `café` typed composed; anything else as given, for `index_name_problem`."""
    return unicodedata.normalize("NFC", name) if isinstance(name, str) else name


def index_name_problem(name: object) -> str:
    """Why `name` cannot name an index ("" when it can). The one rule for every command and the
    service: the name is a folder under `home/indexes`, a Milvus collection and an Elasticsearch
    index, so it holds no path separator, dot or space and fits in one file name."""
    if not isinstance(name, str) or not name:
        return f"the index name is empty ({INDEX_NAME_RULE})"
    shown = repr(name) if len(name) <= 40 else f"{name[:20]!r}… ({len(name)} characters)"
    if not _without_marks(name).replace("-", "").replace("_", "").isalnum():
        return f"index name {shown} is not allowed: {INDEX_NAME_RULE}"
    if len(name) > INDEX_NAME_CHARS or len(name.encode("utf-8")) > INDEX_NAME_BYTES:
        return f"index name {shown} is too long: {INDEX_NAME_RULE}"
    return ""


def _without_marks(name: str) -> str:
    """`name` without the combining marks that sit on a letter or digit: part of that letter
    (the vowel signs of 'हिन्दी' or 'ที่ดิน', an accent NFC has no composed form for). A mark on
    nothing, first or after '-', stays, and is refused."""
    out: list[str] = []
    for c in name:
        if not (unicodedata.category(c).startswith("M") and out and out[-1].isalnum()):
            out.append(c)
    return "".join(out)


_RAW_IN_USERINFO = ("its user or password holds a raw '/', '?' or '#'; percent-encode them "
                    "(%2F, %3F, %23) as in http://USER:PA%2FSS@HOST:PORT")


def es_url_problem(url: str) -> str | None:
    """What the Elasticsearch client would refuse in `url` (None when it is usable or unset):
    checked here, and then by the client's own parser. The message never repeats the URL: it
    may hold a password that did not parse as one."""
    if not url:
        return None
    from urllib.parse import urlsplit

    if any(c.isspace() or not c.isprintable() for c in url):
        return "has a space or a control character; write http://HOST:PORT"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        _, sep, rest = url.partition("://")
        if sep and "@" in rest and any(c in rest.rpartition("@")[0] for c in "/?#"):
            # the parser ended the host at a '/', '?' or '#' of the password: its tail read
            # as the port
            return _RAW_IN_USERINFO
        host = rest.partition("/")[0].rpartition("@")[2]
        if "IPv6" in str(e) or ("[" not in host and host.count(":") > 1):
            # "http://[::1:9200" (a bracket not closed) or "http://::1:9200" (none)
            return "an IPv6 host goes in brackets before the port, as in http://[::1]:9200"
        return "its port is not a number from 0 to 65535 (one URL: http://HOST:PORT)"
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        return "needs a scheme and a host, as in http://HOST:9200 or https://HOST"
    if parts.username is None and "@" in parts.path + parts.query + parts.fragment:
        # "http://elastic:12/ab@es:9200" parses as host elastic, port 12: a password with a
        # raw '/', '?' or '#' after digits (the client would go to the wrong host)
        return _RAW_IN_USERINFO
    if port is None and parts.scheme.lower() == "http":
        return "an http:// URL needs its port, as in http://HOST:9200"
    try:
        from elastic_transport import Urllib3HttpNode
        from elastic_transport.client_utils import url_to_node_config
    except ImportError:  # no client installed: nothing will read it
        return None
    try:  # the node the client would make (no connection yet)
        Urllib3HttpNode(url_to_node_config(url)).close()
    except Exception:  # noqa: BLE001 — its message would repeat the URL
        return "the Elasticsearch client cannot read it; write http://HOST:PORT"
    return None


def _check_home(home: Path, index_dir: Path) -> None:
    """The data home and the index folder must be folders where they exist: a file there (a
    `--home` that names a file) would fail deep inside the first write."""
    path = index_dir
    while not path.exists() and path != path.parent:
        path = path.parent
    if path.is_dir() or not path.exists():
        return
    if path == home:
        raise SettingsError(f"data home {home} is a file, not a folder; give --home a folder "
                            "(it is created if missing)")
    if home.is_relative_to(path):
        raise SettingsError(f"data home {home}: {path} is a file, not a folder; give --home a "
                            "folder (it is created if missing)")
    raise SettingsError(f"{path} is a file where branchsearch keeps a folder of the data home "
                        f"{home}; move it away")


def _validate(s: Settings) -> None:
    from branchsearch.infra.errors import register_secret

    from urllib.parse import unquote, urlsplit

    def password(url: str) -> str:
        try:
            return urlsplit(url).password or ""
        except ValueError:
            return ""

    urls = [s.es_url, s.milvus_uri, s.llm_url, s.otlp_endpoint,
            *[url for spec in s.indexes for url in (spec.es_url, spec.milvus_uri)]]
    for secret in (s.milvus_token, s.es_api_key, s.llm_api_key, *[
            v.split("=", 1)[-1] for v in s.otlp_headers.split(",")], *[
            form for url in urls for form in (password(url), unquote(password(url)))]):
        register_secret(secret.strip())  # masked in every message that leaves the process
        # (a URL's password as written, "%40", and as a client sends it, "@")
    checks = [
        (s.chunk_tokens >= 16, "chunk_tokens must be >= 16"),
        (0 <= s.chunk_overlap < s.chunk_tokens, "chunk_overlap must be in [0, chunk_tokens)"),
        (0 < s.soft_limit <= s.hard_limit <= 1, "need 0 < soft_limit <= hard_limit <= 1"),
        (s.budget_tokens >= 256, "budget_tokens must be >= 256"),
        (s.rrf_k > 0, "rrf_k must be > 0"),
        (1 <= s.hybrid_candidates <= MAX_K, f"hybrid_candidates must be in 1..{MAX_K}"),
        (s.max_turns >= 1, "max_turns must be >= 1"),
        (1 <= s.search_k <= MAX_K and 1 <= s.final_k <= MAX_K,
         f"search_k and final_k must be in 1..{MAX_K}"),
        (s.branches >= 1, "branches must be >= 1"),
        (s.forks >= 0, "forks must be >= 0 (0: none)"),
        (s.static_tune_chunks == 0 or s.static_tune_chunks >= 32,
         "static_tune_chunks must be 0 (the distilled model) or at least 32"),
        (s.static_queries in STATIC_QUERIES,
         f"static_queries must be {one_of(STATIC_QUERIES)}"),
        (s.chains >= 0, "chains must be >= 0 (0: none)"),
        (s.bridges >= 0, "bridges must be >= 0 (0: none)"),
        (s.bridge_depth in (1, 2, 3), "bridge_depth must be 1, 2 or 3"),
        (0 <= s.fork_gap <= 1, "fork_gap must be in [0, 1]"),
        (s.per_title >= 0, "per_title must be >= 0 (0: off)"),
        (s.embed_backend in EMBED_BACKENDS, f"embed_backend must be {one_of(EMBED_BACKENDS)}"),
        (s.embed_batch >= 1, "embed_batch must be >= 1"),
        (s.retriever_replicas >= 1, "retriever_replicas must be >= 1"),
        (s.backend_retries >= 0 and s.backend_backoff_s >= 0,
         "backend_retries and backend_backoff_s must be >= 0"),
        (s.actor_start_timeout_s > 0, "actor_start_timeout_s must be > 0"),
        *((getattr(s, name) >= 1, f"{name} must be >= 1") for name in (
            "max_body_bytes", "max_question_chars", "max_branches", "max_k",
            "per_key_concurrency", "max_in_flight", "retry_after_s", "max_open_indexes")),
        (0 < s.default_deadline_s <= s.max_deadline_s,
         "default_deadline_s must be > 0 and at most max_deadline_s"),
        (s.index_idle_close_s >= 0, "index_idle_close_s must be >= 0 (0: never close)"),
        (s.per_key_queue >= 0, "per_key_queue must be >= 0 (0: 429 at once past the slots)"),
        (s.llm_timeout_s > 0, "llm_timeout_s must be > 0"),
        (s.llm_seed is None or 0 <= s.llm_seed < 2 ** 63, "llm_seed must be in [0, 2^63) or none"),
        (0 < s.backend_timeout_s <= 3600, "backend_timeout_s must be in (0, 3600]"),
        (s.query_max_tokens >= 8, "query_max_tokens must be >= 8"),
        (s.trace_exporter in TRACE_EXPORTERS,
         f"trace_exporter must be {one_of(TRACE_EXPORTERS)}"),
        (s.otlp_protocol in OTLP_PROTOCOLS, f"otlp_protocol must be {one_of(OTLP_PROTOCOLS)}"),
        (0 < s.otlp_timeout_s <= 60, "otlp_timeout_s must be in (0, 60]"),
        (0 <= s.trace_flush_timeout_s <= 10, "trace_flush_timeout_s must be in [0, 10]"),
        (s.search_mode in MODES, f"search_mode must be {one_of(MODES)}"),
        (s.milvus_index.upper() in (i.upper() for i in MILVUS_INDEXES),
         f"milvus_index must be {one_of(MILVUS_INDEXES)}"),
        (s.milvus_consistency in MILVUS_CONSISTENCIES,
         f"milvus_consistency must be {one_of(MILVUS_CONSISTENCIES)}"),
        (s.policy in POLICIES, f"policy must be {one_of(POLICIES)}"),
        (s.planner in PLANNERS, f"planner must be {one_of(PLANNERS)}"),
    ]
    for ok, message in checks:
        if not ok:
            raise SettingsError(f"bad settings: {message}")
    problem = encoding_problem(s.encoding)
    if problem:
        raise SettingsError(problem)
    problem = index_name_problem(s.index)
    if problem:
        raise SettingsError(problem)
    # (an external index's own es_url is checked with its table: `parse_external`)
    problem = es_url_problem(s.es_url)
    if problem:
        raise SettingsError(f"setting es_url: {problem}")
    _check_home(Path(s.home), s.index_dir)
    if s.trace_exporter == "otlp":  # a bad collector URL or header list stops here, clearly
        from branchsearch.infra.telemetry import otlp_headers, otlp_url

        otlp_url(s.otlp_endpoint, s.otlp_protocol)
        otlp_headers(s.otlp_headers)


def _otel_env(env) -> dict[str, str]:
    """The standard OpenTelemetry exporter variables as settings. They rank with the environment:
    above the TOML file, below `BRANCHSEARCH_*` variables and flags."""
    out: dict[str, str] = {}
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        if exporter not in ("otlp", "console", "none"):
            raise SettingsError(f"OTEL_TRACES_EXPORTER={exporter!r}: branchsearch exports otlp, "
                                "console or none")
        out["trace_exporter"] = exporter
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "").strip().lower()
    if protocol:
        if protocol not in ("grpc", "http/protobuf", "http"):
            raise SettingsError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: branchsearch speaks "
                                "grpc or http/protobuf")
        out["otlp_protocol"] = "grpc" if protocol == "grpc" else "http"
    endpoint = (env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
                or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip())
    if endpoint:  # a base URL gets /v1/traces when the exporter is built (telemetry.otlp_url)
        out["otlp_endpoint"] = endpoint
    headers = env.get("OTEL_EXPORTER_OTLP_TRACES_HEADERS") or env.get("OTEL_EXPORTER_OTLP_HEADERS")
    if headers and headers.strip():
        out["otlp_headers"] = headers.strip()
    return out


# `BRANCHSEARCH_*` variables that are not settings: read by one command or tool each.
OTHER_VARIABLES = frozenset({
    "CONFIG", "KEYS", "API_KEY", "MODEL_CACHE", "CI", "SCREENSHOT", "CHROMIUM",
    "LOADTEST_QUERIES", "LOADTEST_SEED", "LOADTEST_INDEX", "LOADTEST_BRANCHES",
    "LOADTEST_DEADLINE_S", "LOADTEST_THINK"})


def _refuse_misspelt(env) -> None:
    """A `BRANCHSEARCH_*` variable that is no setting but nearly spells one is a typo: refused,
    as an unknown key in the TOML file is, instead of silently running on the default. Other
    unknown names pass (another tool's variable may share the prefix)."""
    for key in env:
        if not key.startswith("BRANCHSEARCH_"):
            continue
        name = key.removeprefix("BRANCHSEARCH_")
        if name in OTHER_VARIABLES or (name.lower() in _FIELDS and name == name.upper()):
            continue
        near = difflib.get_close_matches(name.lower(), _FIELDS, n=1, cutoff=0.8)
        if near:
            raise SettingsError(f"environment variable {key} is not a setting; did you mean "
                                f"BRANCHSEARCH_{near[0].upper()}?")


def _read_toml(path: Path) -> dict[str, Any]:
    """The settings file as a table; SettingsError in one line for every way it can be bad."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise SettingsError(f"settings file not found: {path}") from None
    except IsADirectoryError:
        raise SettingsError(f"settings file {path} is a folder: give the TOML file") from None
    except OSError as exc:
        raise SettingsError(f"settings file {path}: cannot read it "
                            f"({exc.strerror or exc})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise SettingsError(f"settings file {path}:{line}: not UTF-8 text (byte "
                            f"{raw[exc.start:exc.start + 1]!r} at offset {exc.start}); a TOML "
                            "file is UTF-8") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"settings file {path}: not valid TOML ({exc})") from None
    except ValueError:  # CPython's int limit: a number of more than 4,300 digits
        raise SettingsError(f"settings file {path}: a number has more than 4,300 digits"
                            ) from None


def load_settings(
    config: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    *,
    base: Settings | None = None,
    read_env: bool = True,
    read_file: bool = True,
) -> Settings:
    """Merge defaults, TOML, environment and `overrides` (None values are ignored)."""
    values: dict[str, Any] = dataclasses.asdict(base or Settings())
    given: dict[str, Any] = {}  # what a file, the environment or an override set
    source: dict[str, str] = {}  # where a file or the environment set it, for error lines
    env = os.environ if read_env else {}
    if "BRANCHSEARCH_HOME" in env:
        values["home"] = env["BRANCHSEARCH_HOME"]
    if overrides and overrides.get("home") is not None:
        values["home"] = overrides["home"]

    if read_file:
        path = config or env.get("BRANCHSEARCH_CONFIG") or None  # set but empty: unset
        if path is None and (Path(values["home"]) / "branchsearch.toml").exists():
            path = Path(values["home"]) / "branchsearch.toml"
        if path is not None:
            data = _flatten_sections(_read_toml(Path(path)), path)
            unknown = sorted(set(data) - set(_FIELDS))
            if unknown:
                raise SettingsError(f"settings file {path}: unknown keys {', '.join(unknown)}")
            values.update(data)
            given.update(data)
            source.update(dict.fromkeys(data, f"settings file {path}"))

    otel = _otel_env(env)
    values.update(otel)
    given.update(otel)
    _refuse_misspelt(env)
    for name in _FIELDS:
        key = f"BRANCHSEARCH_{name.upper()}"
        if key in env:
            values[name] = given[name] = env[key]
            source[name] = key
    for name, value in (overrides or {}).items():
        if name not in _FIELDS:
            raise SettingsError(f"unknown setting {name!r}")
        if value is not None:
            values[name] = given[name] = value
            source.pop(name, None)  # a flag's own error names the flag
    if given.get("otlp_endpoint") and "trace_exporter" not in given and \
            values["trace_exporter"] == "none":
        values["trace_exporter"] = "otlp"  # a collector named and no exporter chosen: export there

    reading = "index"  # the setting being read when a value is refused
    try:
        values["index"] = index_name(values["index"])
        read = {}
        for reading, value in values.items():
            read[reading] = _coerce(reading, value)
        reading = ""  # then the checks across settings, which name the ones they involve
        settings = Settings(**read)
        _validate(settings)
    except SettingsError as exc:
        raise SettingsError(_set_by(str(exc), source, reading)) from None
    return settings


def _set_by(message: str, source: dict[str, str], reading: str) -> str:
    """`message` with where the settings at fault were set ("set by BRANCHSEARCH_BRANCHES"),
    so a bad value in the environment or a file is found without reading this code: the one
    being read, else the ones the check names."""
    named = sorted({where for name, where in source.items()
                    if name == reading or not reading and
                    re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", message)})
    return f"{message} (set by {', '.join(named)})" if named else message
