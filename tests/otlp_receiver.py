"""Real OTLP trace receivers on loopback, for tests and benchmarks: HTTP (protobuf at
`/v1/traces`, like a collector on :4318 or Phoenix on :6006) and gRPC (like a collector on :4317).
Each decodes `ExportTraceServiceRequest`s with opentelemetry-proto and keeps the spans as dicts."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest, ExportTraceServiceResponse)


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


def decode(request: ExportTraceServiceRequest) -> list[dict]:
    spans = []
    for rs in request.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append({"name": s.name, "trace_id": s.trace_id.hex(),
                              "span_id": s.span_id.hex(), "parent_id": s.parent_span_id.hex(),
                              "attributes": {a.key: _value(a.value) for a in s.attributes},
                              "resource": resource})
    return spans


class _Store:
    def __init__(self):
        self.spans: list[dict] = []
        self.requests: list[dict] = []  # path (HTTP), headers, status we answered
        self.lock = threading.Lock()

    def wait_for(self, predicate, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if predicate(self.spans):
                    return True
            time.sleep(0.05)
        with self.lock:
            return predicate(self.spans)


class HttpReceiver(_Store):
    """OTLP/HTTP protobuf receiver: POST /v1/traces → 200; any other path → 405 (as Phoenix and
    collectors answer a base URL)."""

    def __init__(self):
        super().__init__()
        store = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                ok = self.path == "/v1/traces"
                with store.lock:
                    store.requests.append({"path": self.path, "headers": dict(self.headers),
                                           "status": 200 if ok else 405})
                if not ok:
                    self.send_response(405)
                    self.end_headers()
                    return
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                with store.lock:
                    store.spans += decode(request)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class GrpcReceiver(_Store):
    """OTLP/gRPC receiver (TraceService/Export) on an insecure loopback port."""

    def __init__(self):
        super().__init__()
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        store = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                with store.lock:
                    store.requests.append({"headers": dict(context.invocation_metadata()),
                                           "status": 0})
                    store.spans += decode(request)
                return ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server.start()

    def close(self) -> None:
        self.server.stop(0)


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
