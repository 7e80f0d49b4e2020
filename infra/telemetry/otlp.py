"""OTLP endpoints, protocols and headers as users write them, and the exporter they name.
"""

from __future__ import annotations

import re

from urllib.parse import unquote, urlsplit, urlunsplit



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
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError:  # a bad port, or a bracket left open ('[::1:4317')
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        shown = re.sub(r"//[^/]*@", "//***@", raw)  # a password there is not echoed
        raise SettingsError(f"otlp_endpoint {shown!r} is not a collector URL; expected "
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
