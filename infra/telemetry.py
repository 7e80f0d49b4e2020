"""OpenTelemetry wiring, configured once at the edge (CLI, actor start-up).

Application code only uses the API (`tracer()`); `configure(settings)` installs an SDK tracer
provider with the chosen exporter: none, console, jsonl (one span per line in a file) or otlp.
Exporter failures are logged, never raised into the traced work.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from pathlib import Path

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract, inject

log = logging.getLogger(__name__)
TRACER_NAME = "branchsearch"
_configured: str | None = None
_lock = threading.Lock()


def tracer():
    return trace.get_tracer(TRACER_NAME)


class JsonlSpanExporter:
    """Appends finished spans to a JSONL file (one JSON object per span). Safe across processes:
    each batch is written with one `write` call to a file opened in append mode."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def export(self, spans: Sequence) -> object:
        from opentelemetry.sdk.trace.export import SpanExportResult

        try:
            lines = "".join(json.dumps(span_to_dict(s)) + "\n" for s in spans)
            with self.path.open("a", encoding="utf-8") as f:
                f.write(lines)
            return SpanExportResult.SUCCESS
        except Exception:  # hooks must not throw
            log.exception("jsonl span export failed")
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


def configure(exporter: str = "none", trace_file: str = "", otlp_endpoint: str = "",
              service: str = "branchsearch", span_exporter=None) -> None:
    """Install the global tracer provider once per process. `span_exporter` (e.g. the SDK's
    InMemorySpanExporter) overrides the named exporter, for tests."""
    global _configured
    key = f"{exporter}|{trace_file}|{otlp_endpoint}|{id(span_exporter)}"
    with _lock:
        if _configured == key:
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (BatchSpanProcessor, ConsoleSpanExporter,
                                                    SimpleSpanProcessor)

        provider = trace.get_tracer_provider()
        if not isinstance(provider, TracerProvider):
            import os

            provider = TracerProvider(resource=Resource.create(
                {"service.name": service, "process.pid": os.getpid()}))
            trace.set_tracer_provider(provider)
        if span_exporter is not None:
            provider.add_span_processor(SimpleSpanProcessor(span_exporter))
        elif exporter == "console":
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        elif exporter == "jsonl":
            if not trace_file:
                from branchsearch.infra.errors import SettingsError

                raise SettingsError("trace_exporter=jsonl needs trace_file (or --trace FILE)")
            provider.add_span_processor(SimpleSpanProcessor(JsonlSpanExporter(trace_file)))
        elif exporter == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(
                OTLPSpanExporter(endpoint=otlp_endpoint or None)))
        _configured = key


def configure_from(settings) -> None:
    if settings.trace_exporter != "none":
        configure(settings.trace_exporter, settings.trace_file, settings.otlp_endpoint)


def flush() -> None:
    provider = trace.get_tracer_provider()
    if hasattr(provider, "force_flush"):
        provider.force_flush()


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
