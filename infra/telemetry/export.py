"""Getting finished spans out without slowing or breaking the traced work: a bounded queue with
one background thread, export health (spans dropped, the collector down), the JSONL exporter, and
the exporters' own log lines kept off the terminal.
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

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from branchsearch.infra.telemetry.conventions import with_io

FLUSH_TIMEOUT_S = 0.5  # the most a query waits for its spans (settings: trace_flush_timeout_s)
EXPORT_TIMEOUT_S = 2.0  # one OTLP export, retries included (settings: otlp_timeout_s)



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


def _quietly(fn) -> None:
    try:
        fn()
    except Exception:
        pass


class JsonlSpanExporter(SpanExporter):
    """Appends finished spans to a JSONL file (one JSON object per span). Safe across processes:
    each batch is written with one `write` call to a file opened in append mode."""

    def __init__(self, path: str | Path):
        """A path that can hold no file (a folder, or under a file or an unwritable place) is
        a bad setting, said at once; a failure once it exports is counted and said once."""
        from branchsearch.infra.errors import SettingsError

        self.path = Path(path)
        if self.path.is_dir():
            raise SettingsError(f"trace file {self.path} is a folder: give a file path, as "
                                f"{self.path / 'spans.jsonl'}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            why = ("a file holds a name on its path"
                   if isinstance(exc, (FileExistsError, NotADirectoryError))
                   else exc.strerror or str(exc))
            raise SettingsError(f"trace file {self.path}: its folder {self.path.parent} cannot "
                                f"be made ({why})") from None

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
