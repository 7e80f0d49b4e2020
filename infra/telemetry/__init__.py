"""OpenTelemetry wiring, configured once at the edge (CLI, driver, actor start-up).

Application code only uses the API (`tracer()`) and names its spans plainly: query, plan, branch,
episode, turn, `tool <name>`, prune (and chat for LLM calls). `configure(...)` installs, once per
process, an SDK tracer provider with ONE pipeline processor that

1. gives each span its role after the OpenTelemetry GenAI semantic conventions
   (`gen_ai.operation.name`, `gen_ai.agent.name`, `gen_ai.tool.name`, ...) and its OpenInference
   span kind (`openinference.span.kind` = CHAIN, AGENT, TOOL, RETRIEVER, LLM), so receivers such
   as Arize Phoenix show spans as what they are: `conventions.ROLES` is the one place that knows this;
2. hands finished spans to the chosen exporter: none, console, jsonl (one span per line) or otlp
   (HTTP or gRPC). Calling `configure` again replaces the exporter; it never adds a second one.

Tracing never slows or breaks the traced work. OTLP spans go through `BoundedExportProcessor`
(bounded queue, one background thread, short export timeout). `flush()` waits at most its
timeout, and not at all while the collector is known to be down. Spans that cannot be delivered
(queue full, export failed) are counted (`stats()`) and reported once per process on one stderr
line; the exporters' own per-batch log lines and tracebacks are kept off the terminal.

This module is the API and `configure`; `conventions` names span roles, `export` delivers spans
(bounded queue, health, JSONL), `otlp` reads endpoints and headers.
"""

from __future__ import annotations

import json
import os
import threading

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract, inject
from opentelemetry.sdk.trace import SpanProcessor

from branchsearch.infra.telemetry.conventions import span_role
from branchsearch.infra.telemetry.export import (_EXPORTER_LOG, EXPORT_TIMEOUT_S, FLUSH_TIMEOUT_S,
                                                 BoundedExportProcessor, ExportHealth,
                                                 GuardedExporter, JsonlSpanExporter, _quietly,
                                                 stats)
from branchsearch.infra.telemetry.otlp import (_otlp_exporter, normalize_protocol, otlp_headers,
                                               otlp_url)

__all__ = ["tracer", "configure", "configure_from", "flush", "stats", "current_carrier",
           "attach_carrier", "detach", "otlp_url", "otlp_headers", "normalize_protocol",
           "ExportHealth", "JsonlSpanExporter", "EXPORT_TIMEOUT_S", "FLUSH_TIMEOUT_S"]

TRACER_NAME = "branchsearch"
_lock = threading.Lock()
_configured: str | None = None
_pipeline: "_Pipeline | None" = None


def tracer():
    return trace.get_tracer(TRACER_NAME)


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
