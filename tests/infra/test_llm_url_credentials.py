"""An `llm_url` with a user and password (`http://USER:PASSWORD@HOST:PORT/v1`: an endpoint behind
a proxy that asks for HTTP basic auth). The settings treat the password as a secret; the client
must send it as basic auth and go to HOST, not take `USER:PASSWORD@HOST` for a host name to
look up ("Name or service not known", after three attempts)."""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from branchsearch.infra.errors import BackendUnavailable, SettingsError
from branchsearch.infra.models.llm import OpenAIEngine

USER, PASSWORD = "analyst", "p@ss:w/rd"  # '@', ':' and '/' percent-encoded in the URL
ENCODED = "p%40ss%3Aw%2Frd"


@pytest.fixture
def endpoint():
    """A loopback OpenAI-style endpoint that answers only with the right basic credentials."""
    wanted = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            seen.append(self.headers.get("Authorization", ""))
            ok = self.path == "/v1/models" and seen[-1] == wanted
            body = json.dumps({"data": [{"id": "smollm2"}]} if ok else {"error": "no"}).encode()
            self.send_response(200 if ok else 401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def test_an_llm_url_with_user_and_password_reaches_its_host_with_basic_auth(endpoint):
    host, seen = endpoint
    engine = OpenAIEngine(f"http://{USER}:{ENCODED}@{host}", "smollm2", attempts=1)
    assert engine.check() == ["smollm2"]
    assert engine.base_url == f"http://{host}/v1"  # what errors show: no credentials
    with pytest.raises(BackendUnavailable, match="HTTP 401") as caught:
        OpenAIEngine(f"http://{USER}:wrong@{host}/v1", "smollm2", attempts=1).check()
    assert "wrong" not in str(caught.value)
    assert seen[-1].startswith("Basic ")
    with pytest.raises(SettingsError, match="credentials once"):  # which one to send?
        OpenAIEngine(f"http://{USER}:{ENCODED}@{host}", "smollm2", api_key="sk-1")
