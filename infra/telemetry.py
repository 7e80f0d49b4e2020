"""OpenTelemetry wiring, configured once at the edge (CLI, driver, actor start-up).

Application code only uses the API (`tracer()`) and names its spans plainly: query, plan, branch,
episode, turn, `tool <name>`, prune (and chat for LLM calls). `configure(...)` installs, once per
process, an SDK tracer provider with ONE pipeline processor that

1. gives each span its role after the OpenTelemetry GenAI semantic conventions
   (`gen_ai.operation.name`, `gen_ai.agent.name`, `gen_ai.tool.name`, ...) and its OpenInference
   span kind (`openinference.span.kind` = CHAIN, AGENT, TOOL, RETRIEVER, LLM), so receivers such
   as Arize Phoenix show spans as what they are: `ROLES` below is the one place that knows this;
2. hands finished spans to the chosen exporter: none, console, jsonl (one span per line) or otlp
   (HTTP or gRPC). Calling `configure` again replaces the exporter; it never adds a second one.

Tracing never slows or breaks the traced work. OTLP spans go through `BoundedExportProcessor`
(bounded queue, one background thread, short export timeout). `flush()` waits at most its
timeout, and not at all while the collector is known to be down. Spans that cannot be delivered
(queue full, export failed) are counted (`stats()`) and reported once per process on one stderr
line; the exporters' own per-batch log lines and tracebacks are kept off the terminal.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract, inject
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

TRACER_NAME = "branchsearch"
FLUSH_TIMEOUT_S = 0.5  # the most a query waits for its spans (settings: trace_flush_timeout_s)
EXPORT_TIMEOUT_S = 2.0  # one OTLP export, retries included (settings: otlp_timeout_s)
_lock = threading.Lock()
_configured: str | None = None
_pipeline: "_Pipeline | None" = None


def tracer():
    return trace.get_tracer(TRACER_NAME)


# --- span roles: GenAI semantic conventions + OpenInference span kinds -------------------------

KIND = "openinference.span.kind"
OPERATION = "gen_ai.operation.name"
AGENT_NAME = "branchsearch.branch"
# tools that return chunks of the corpus are retrievers; the rest act on the agent's context
RETRIEVAL_TOOLS = frozenset({"search_corpus", "grep_corpus", "read_document"})

ROLES: dict[str, dict[str, str]] = {
    "query": {KIND: "CHAIN", OPERATION: "invoke_workflow", "gen_ai.workflow.name": "branchsearch"},
    "plan": {KIND: "CHAIN", OPERATION: "plan"},
    "branch": {KIND: "AGENT", OPERATION: "invoke_agent", "gen_ai.agent.name": AGENT_NAME},
    "episode": {KIND: "CHAIN"},  # the agent's loop inside its branch
    "turn": {KIND: "CHAIN"},
    "prune": {KIND: "CHAIN"},  # validation and application of a proposed prune
    "chat": {KIND: "LLM", OPERATION: "chat"},
    "llm": {KIND: "LLM", OPERATION: "chat"},
}


def span_role(name: str) -> dict[str, str]:
    """Attributes naming what a span of this name is (set when the span starts)."""
    if name.startswith("tool "):
        tool = name[5:]
        retrieval = tool in RETRIEVAL_TOOLS
        return {KIND: "RETRIEVER" if retrieval else "TOOL", OPERATION: "execute_tool",
                "gen_ai.tool.name": tool, "gen_ai.tool.type": "datastore" if retrieval
                else "function", "tool.name": tool}
    head = name.split(" ", 1)[0]
    return ROLES.get(name) or (ROLES[head] if head in ("chat", "llm") else {})


def span_io(name: str, attrs) -> dict:
    """Input/output values derived from a finished span's own attributes (OpenInference
    `input.value`/`output.value`, GenAI tool-call arguments and result, retrieved document ids)."""
    out: dict = {}
    if name == "query" and "question" in attrs:
        out["input.value"] = attrs["question"]
    elif name == "plan" and "subqueries" in attrs:
        out |= _json_value("output", list(attrs["subqueries"]))
    elif name == "branch":
        if "branch.subquery" in attrs:
            out["input.value"] = attrs["branch.subquery"]
        if "branch.index" in attrs:
            out["gen_ai.agent.id"] = f"branch-{attrs['branch.index']}"
    elif name == "episode":
        if "subquery" in attrs:
            out["input.value"] = attrs["subquery"]
        if "termination" in attrs:
            out["output.value"] = str(attrs["termination"])
    elif name.startswith("tool "):
        if "args" in attrs:
            out |= {"input.value": attrs["args"], "input.mime_type": "application/json",
                    "gen_ai.tool.call.arguments": attrs["args"]}
        ids = list(attrs.get("ids", ()))
        result = attrs["error"] if "error" in attrs else json.dumps(ids)
        out |= {"output.value": result, "gen_ai.tool.call.result": result}
        if name[5:] in RETRIEVAL_TOOLS:
            out |= {f"retrieval.documents.{i}.document.id": cid for i, cid in enumerate(ids[:50])}
    elif name == "prune":
        if "prune.reason" in attrs:
            out["input.value"] = attrs["prune.reason"]
        if "prune.applied_ids" in attrs:
            out |= _json_value("output", list(attrs["prune.applied_ids"]))
    return {k: v for k, v in out.items() if k not in attrs}


def _json_value(kind: str, value) -> dict:
    return {f"{kind}.value": json.dumps(value), f"{kind}.mime_type": "application/json"}


def with_io(span: ReadableSpan) -> ReadableSpan:
    """The span with `span_io` added (a copy; finished SDK spans are read-only)."""
    attrs = span.attributes or {}
    extra = span_io(span.name, attrs)
    if not extra:
        return span
    return ReadableSpan(
        name=span.name, context=span.context, parent=span.parent, resource=span.resource,
        attributes={**attrs, **extra}, events=span.events, links=span.links, kind=span.kind,
        status=span.status, start_time=span.start_time, end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope)


# --- health: delivered and dropped spans, said once -----------------------------------------------

class ExportHealth:
    """Counts of spans delivered and dropped in this process; the first drop is said once, on
    one stderr line (identical in every process, so Ray's log dedup folds the actors' lines)."""

    def __init__(self):
        self.exported = 0
        self.dropped = 0
        self.last_error = ""
        self.said = False
        self._lock = threading.Lock()

    def delivered(self, n: int) -> None:
        with self._lock:
            self.exported += n

    def drop(self, n: int, target: str, reason: str) -> None:
        with self._lock:
            self.dropped += n
            self.last_error = reason
            first, self.said = not self.said, True
        if first:
            try:
                sys.stderr.write(f"branchsearch: trace export to {target} failed ({reason}); "
                                 "spans are dropped and counted, searches go on "
                                 "(said once per process)\n")
                sys.stderr.flush()
            except Exception:  # a closed stderr must not break the search either
                pass

    def snapshot(self) -> dict:
        with self._lock:
            return {"exported": self.exported, "dropped": self.dropped,
                    "last_error": self.last_error}


HEALTH = ExportHealth()


def stats() -> dict:
    """Spans delivered and dropped by this process's exporter, and the last export error."""
    return HEALTH.snapshot()


class _ExporterLog(logging.Filter):
    """Keeps the OTLP exporters' per-batch warnings and tracebacks off the terminal; the last
    message becomes the reason in our one line."""

    NAMES = ("opentelemetry.exporter.otlp.proto.http.trace_exporter",
             "opentelemetry.exporter.otlp.common.http",
             "opentelemetry.exporter.otlp.proto.grpc.exporter",
             "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
             "opentelemetry.exporter.http.transport._requests",
             "opentelemetry.exporter.http.transport._urllib3",
             "opentelemetry.exporter.http.transport._base",
             "opentelemetry.sdk.trace.export")

    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING and len(self.messages) < 20:
            try:
                self.messages.append(" ".join(record.getMessage().split()))
            except Exception:
                pass
        return False

    def reason(self) -> str:
        """The most telling part of what the exporter logged during the last export."""
        text = " ".join(self.messages)
        for pattern in (r"\[Errno -?\d+\] [^'\")\]]+", r"StatusCode\.[A-Z_]+",
                        r"code: \d{3}[^.]*", r"[Tt]imed out[^.'\"]*"):
            found = re.search(pattern, text)
            if found:
                return found.group(0).strip().rstrip(":").strip()[:200]
        if "due to timeout, max retries or shutdown" in text:
            return "no answer within otlp_timeout_s"
        return self.messages[0][:200] if self.messages else ""

    def install(self) -> None:
        for name in self.NAMES:
            logger = logging.getLogger(name)
            if self not in logger.filters:
                logger.addFilter(self)


_EXPORTER_LOG = _ExporterLog()


class GuardedExporter(SpanExporter):
    """Wraps an exporter: adds `span_io`, never raises, counts what it delivers and drops."""

    def __init__(self, inner: SpanExporter, target: str):
        self.inner = inner
        self.target = target

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        _EXPORTER_LOG.messages = []
        try:
            result = self.inner.export([with_io(s) for s in spans])
            error = "" if result == SpanExportResult.SUCCESS else "export failed"
        except Exception as exc:  # hooks must not throw
            error = f"{type(exc).__name__}: {exc}"[:300]
        if not error:
            HEALTH.delivered(len(spans))
            return SpanExportResult.SUCCESS
        HEALTH.drop(len(spans), self.target, _EXPORTER_LOG.reason() or error)
        return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        try:
            self.inner.shutdown()
        except Exception:
            pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        try:
            return self.inner.force_flush(timeout_millis)
        except Exception:
            return False


# --- bounded, non-blocking export ---------------------------------------------------------------

class BoundedExportProcessor(SpanProcessor):
    """Batches finished spans in a bounded queue; one daemon thread exports them.

    Unlike the SDK's BatchSpanProcessor (whose force_flush exports in the caller's thread and
    ignores its timeout), `force_flush(t)` only wakes the thread and waits at most `t`. After a
    failed export the collector counts as down for `backoff_s` (doubling up to `max_backoff_s`):
    spans wait in the queue (bounded; a full queue drops new spans, counted), flushes return at
    once, and then one batch probes the collector again."""

    def __init__(self, exporter: SpanExporter, *, max_queue: int = 4096, batch_size: int = 512,
                 delay_s: float = 1.0, backoff_s: float = 5.0, max_backoff_s: float = 60.0,
                 flush_timeout_s: float = FLUSH_TIMEOUT_S, target: str = ""):
        self.exporter = exporter
        self.target = target
        self.flush_timeout_s = flush_timeout_s
        self.max_queue, self.batch_size, self.delay_s = max_queue, batch_size, delay_s
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self._next_backoff = backoff_s
        self._queue: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._busy = 0  # spans of the batch being exported now (0: none)
        self._flushers = 0
        self._down_until = 0.0
        self._slow = False  # a flush ran out of time; cleared by the next successful export
        self._stopped = False
        self._start_thread()
        if hasattr(os, "register_at_fork"):  # a forked child gets its own thread and queue
            after_fork = weakref.WeakMethod(self._after_fork)
            os.register_at_fork(after_in_child=lambda: (f := after_fork()) and f())

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name="branchsearch-span-export",
                                        daemon=True)
        self._thread.start()

    def _after_fork(self) -> None:
        self._cond = threading.Condition()
        self._queue.clear()
        self._busy, self._flushers = 0, 0
        if not self._stopped:
            self._start_thread()

    # SpanProcessor hooks: cheap, never block, never raise
    def on_start(self, span, parent_context=None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        try:
            if not span.context.trace_flags.sampled:
                return
            with self._cond:
                if self._stopped or len(self._queue) >= self.max_queue:
                    full = True
                else:
                    full = False
                    self._queue.append(span)
                    if len(self._queue) >= self.batch_size:
                        self._cond.notify_all()
            if full:
                HEALTH.drop(1, self.target, "tracing shut down" if self._stopped else
                            "trace queue full: the collector is slower than the spans arrive, "
                            "or down")
        except Exception:
            pass

    def down(self) -> bool:
        return time.monotonic() < self._down_until

    def force_flush(self, timeout_millis: int = 500) -> bool:
        """Wait at most `timeout_millis` for the queue to drain; True when the spans reached the
        collector (False: still queued, or the collector is down). While the
        collector is down, or after a flush ran out of time and no export has succeeded since,
        only wake the exporting thread and return at once."""
        with self._cond:
            self._flushers += 1
            self._cond.notify_all()
            try:
                if not (self.down() or self._slow or self._stopped):
                    self._cond.wait_for(
                        lambda: (not self._queue and not self._busy) or self.down(),
                        timeout=max(timeout_millis, 0) / 1000)
                    self._slow = bool(self._queue or self._busy) and not self.down()
                return not self._queue and not self._busy and not self.down()
            finally:
                self._flushers -= 1

    def shutdown(self) -> None:
        """Give the queue one flush timeout to leave, then stop; what is left is counted, the
        batch still in flight included (the process is about to end: nobody will learn whether
        the collector took it, so it is not reported as delivered)."""
        self.force_flush(int(self.flush_timeout_s * 1000))
        with self._cond:
            self._stopped = True
            left = len(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(timeout=0.1)
        with self._cond:
            left += self._busy
            self._busy = 0  # an export that still returns must not count these as delivered
        if left:
            HEALTH.drop(left, self.target, "the process ended before the collector took its "
                                           "spans: the collector is slow or down")
        threading.Thread(target=self.exporter.shutdown, daemon=True).start()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopped or (
                    self._queue and not self.down()
                    and (self._flushers or len(self._queue) >= self.batch_size)),
                    timeout=self.delay_s)
                if self._stopped:
                    return
                if not self._queue or self.down():
                    continue
                batch = [self._queue.popleft()
                         for _ in range(min(self.batch_size, len(self._queue)))]
                self._busy = len(batch)
            ok = False
            try:
                ok = self.exporter.export(batch) == SpanExportResult.SUCCESS
            except Exception:
                pass
            with self._cond:
                if self._stopped and not self._busy:
                    return  # shutdown already counted this batch as dropped
                self._busy = 0
                if ok:
                    self._next_backoff = self.backoff_s
                    self._slow = False
                else:
                    self._down_until = time.monotonic() + self._next_backoff
                    self._next_backoff = min(self._next_backoff * 2, self.max_backoff_s)
                self._cond.notify_all()


class _Pipeline(SpanProcessor):
    """The one processor this module adds to the tracer provider: names span roles at start and
    forwards to the current exporting processor, which `configure` swaps."""

    def __init__(self):
        self.current: SpanProcessor | None = None
        self.flush_timeout_s = FLUSH_TIMEOUT_S

    def on_start(self, span, parent_context=None) -> None:
        processor = self.current
        if processor is None:
            return
        try:
            role = span_role(span.name)
            if role:
                span.set_attributes(role)
            processor.on_start(span, parent_context=parent_context)
        except Exception:  # hooks must not throw
            pass

    def on_end(self, span) -> None:
        processor = self.current
        if processor is not None:
            try:
                processor.on_end(span)
            except Exception:
                pass

    def swap(self, processor: SpanProcessor | None, flush_timeout_s: float) -> None:
        old, self.current, self.flush_timeout_s = self.current, processor, flush_timeout_s
        if old is not None:
            _quietly(old.shutdown)

    def force_flush(self, timeout_millis: int | None = None) -> bool:
        processor = self.current
        if processor is None:
            return True
        if timeout_millis is None:
            timeout_millis = int(self.flush_timeout_s * 1000)
        try:
            return processor.force_flush(timeout_millis)
        except Exception:
            return False

    def shutdown(self) -> None:
        self.swap(None, self.flush_timeout_s)


def _quietly(fn) -> None:
    try:
        fn()
    except Exception:
        pass


# --- exporters --------------------------------------------------------------------------------

class JsonlSpanExporter(SpanExporter):
    """Appends finished spans to a JSONL file (one JSON object per span). Safe across processes:
    each batch is written with one `write` call to a file opened in append mode."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            lines = "".join(json.dumps(span_to_dict(s), default=str) + "\n" for s in spans)
            with self.path.open("a", encoding="utf-8") as f:
                f.write(lines)
            return SpanExportResult.SUCCESS
        except Exception as exc:  # hooks must not throw; GuardedExporter says it once
            _EXPORTER_LOG.messages.append(f"{type(exc).__name__}: {exc}")
            return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def span_to_dict(span) -> dict:
    ctx = span.get_span_context()
    return {
        "name": span.name,
        "trace_id": format(ctx.trace_id, "032x"),
        "span_id": format(ctx.span_id, "016x"),
        "parent_id": format(span.parent.span_id, "016x") if span.parent else None,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
        "resource": dict(span.resource.attributes) if span.resource else {},
    }


def normalize_protocol(protocol: str) -> str:
    """`http` or `grpc` (the OTEL spelling `http/protobuf` is `http`)."""
    value = (protocol or "http").strip().lower()
    value = {"http/protobuf": "http"}.get(value, value)
    if value not in ("http", "grpc"):
        from branchsearch.infra.errors import SettingsError

        hint = " (http/json is not supported; use http/protobuf)" if value == "http/json" else ""
        raise SettingsError(f"otlp_protocol must be http or grpc, not {protocol!r}{hint}")
    return value


def otlp_url(endpoint: str, protocol: str = "http") -> str:
    """The URL the exporter talks to. HTTP: a collector's base URL (`http://host:4318`,
    `http://host:6006`, or with a path prefix) gets `/v1/traces` appended; a URL already ending
    in `/v1/traces` is kept. gRPC: `http(s)://host:port`, no path. No scheme means http://."""
    from branchsearch.infra.errors import SettingsError

    protocol = normalize_protocol(protocol)
    raw = (endpoint or "").strip() or ("localhost:4318" if protocol == "http" else
                                       "localhost:4317")
    url = raw if "://" in raw else f"http://{raw}"
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise SettingsError(f"otlp_endpoint {raw!r} is not a collector URL; expected "
                            "http(s)://host:port (e.g. http://localhost:4318)")
    path = parts.path.rstrip("/")
    if protocol == "grpc":
        if path:
            raise SettingsError(f"otlp_endpoint {raw!r}: OTLP over gRPC takes host:port without "
                                "a path; for OTLP over HTTP set otlp_protocol = \"http\"")
        return urlunsplit((parts.scheme, parts.netloc, "", "", ""))
    if not path.endswith("/v1/traces"):
        path += "/v1/traces"
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def otlp_headers(text: str) -> dict[str, str]:
    """`k1=v1,k2=v2` (the OTEL_EXPORTER_OTLP_HEADERS format, values URL-encoded) as a dict."""
    headers: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            from branchsearch.infra.errors import SettingsError

            raise SettingsError("otlp_headers must be key=value pairs separated by commas "
                                f"(got an entry without '=' or key: {item.strip()[:40]!r})")
        headers[unquote(key.strip())] = unquote(value.strip())
    return headers


def _otlp_exporter(url: str, protocol: str, headers: dict[str, str], timeout_s: float):
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            from branchsearch.infra.errors import SettingsError

            raise SettingsError("otlp_protocol = grpc needs opentelemetry-exporter-otlp-proto-grpc"
                                " (pip install opentelemetry-exporter-otlp-proto-grpc)") from None
        return OTLPSpanExporter(endpoint=url, insecure=url.startswith("http://"),
                                headers=tuple((k.lower(), v) for k, v in headers.items()) or None,
                                timeout=timeout_s)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=url, headers=headers or None, timeout=timeout_s)


# --- configuration ----------------------------------------------------------------------------

def _install_pipeline(service: str) -> _Pipeline:
    global _pipeline
    if _pipeline is None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        provider = trace.get_tracer_provider()
        if not isinstance(provider, TracerProvider):
            trace.set_tracer_provider(TracerProvider(resource=Resource.create(
                {"service.name": service, "process.pid": os.getpid()})))
            provider = trace.get_tracer_provider()
        _pipeline = _Pipeline()
        if isinstance(provider, TracerProvider):
            provider.add_span_processor(_pipeline)
    return _pipeline


def configure(exporter: str = "none", trace_file: str = "", otlp_endpoint: str = "",
              service: str = "branchsearch", span_exporter=None, *,
              protocol: str = "http", headers: str = "",
              export_timeout_s: float = EXPORT_TIMEOUT_S,
              flush_timeout_s: float = FLUSH_TIMEOUT_S) -> None:
    """Install (once per process) the tracer provider and set its exporter, replacing the one
    set before. `span_exporter` (e.g. the SDK's InMemorySpanExporter) overrides the named
    exporter, for tests. `none` removes the exporter. Bad values raise SettingsError."""
    global _configured
    key = json.dumps([exporter, trace_file, otlp_endpoint, id(span_exporter), protocol,
                      headers, export_timeout_s, flush_timeout_s])
    with _lock:
        if _configured == key:
            return
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

        if span_exporter is not None:
            processor = SimpleSpanProcessor(GuardedExporter(span_exporter, "test exporter"))
        elif exporter == "none":
            processor = None
        elif exporter == "console":
            processor = SimpleSpanProcessor(GuardedExporter(ConsoleSpanExporter(), "stdout"))
        elif exporter == "jsonl":
            if not trace_file:
                from branchsearch.infra.errors import SettingsError

                raise SettingsError("trace_exporter=jsonl needs trace_file (or --trace FILE)")
            processor = SimpleSpanProcessor(GuardedExporter(JsonlSpanExporter(trace_file),
                                                            str(trace_file)))
        elif exporter == "otlp":
            protocol = normalize_protocol(protocol)
            url = otlp_url(otlp_endpoint, protocol)
            parsed_headers = otlp_headers(headers)
            _EXPORTER_LOG.install()
            target = f"{url} (OTLP/{'gRPC' if protocol == 'grpc' else 'HTTP'})"
            processor = BoundedExportProcessor(
                GuardedExporter(_otlp_exporter(url, protocol, parsed_headers, export_timeout_s),
                                target), target=target, flush_timeout_s=flush_timeout_s)
        else:
            from branchsearch.infra.errors import SettingsError

            raise SettingsError(f"unknown trace exporter {exporter!r}: none, console, jsonl, otlp")
        _install_pipeline(service).swap(processor, flush_timeout_s)
        _configured = key


def configure_from(settings) -> None:
    """Configure from a Settings object (the driver's, which travels to every actor, so actors
    export where the driver says whatever their own environment holds). `none` leaves the
    process as it is (tests may have configured an exporter)."""
    if settings.trace_exporter != "none":
        configure(settings.trace_exporter, settings.trace_file, settings.otlp_endpoint,
                  protocol=getattr(settings, "otlp_protocol", "http"),
                  headers=getattr(settings, "otlp_headers", ""),
                  export_timeout_s=getattr(settings, "otlp_timeout_s", EXPORT_TIMEOUT_S),
                  flush_timeout_s=getattr(settings, "trace_flush_timeout_s", FLUSH_TIMEOUT_S))


def flush(timeout_s: float | None = None) -> bool:
    """Hand this process's finished spans to the exporter, waiting at most `timeout_s` (default:
    the configured flush timeout) and not at all while the collector is down. True when every
    span reached the exporter's destination. Never raises."""
    pipeline = _pipeline
    if pipeline is None:
        return True
    return pipeline.force_flush(None if timeout_s is None else int(timeout_s * 1000))


def current_carrier() -> dict[str, str]:
    """The current span context as W3C trace-context headers, to hand to another process."""
    carrier: dict[str, str] = {}
    inject(carrier)
    return carrier


def attach_carrier(carrier: dict[str, str] | None):
    """Make a remote parent (from `current_carrier`) current; returns a token for `detach`."""
    return otel_context.attach(extract(carrier or {}))


def detach(token) -> None:
    otel_context.detach(token)
