"""Tracing never slows or breaks a search: bounded export to a dead collector, base-URL and gRPC
endpoints, the standard OTEL_* variables, GenAI/OpenInference span roles. Real components: the
in-process driver over the hotpot-mini index, OTLP receivers on loopback (tests/otlp_receiver.py),
a subprocess standing in for an actor on another node."""

import json
import os
import pickle
import subprocess
import sys
import time

import pytest
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from branchsearch.infra import telemetry
from branchsearch.infra.errors import SettingsError
from branchsearch.infra.config.settings import load_settings

from otlp_receiver import GrpcReceiver, HttpReceiver, closed_port

Q = "Were Scott Derrickson and Ed Wood of the same nationality?"
OTEL_VARS = ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
             "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL",
             "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_HEADERS",
             "OTEL_EXPORTER_OTLP_TRACES_HEADERS", "BRANCHSEARCH_OTLP_ENDPOINT",
             "BRANCHSEARCH_TRACE_EXPORTER")


@pytest.fixture(autouse=True)
def fresh_tracing(monkeypatch):
    """Each test starts with no exporter, fresh counters and no OTEL_* variables."""
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(telemetry.export, "HEALTH", telemetry.ExportHealth())
    telemetry.configure("none")
    yield
    telemetry.configure("none")


@pytest.fixture
def receiver():
    r = HttpReceiver()
    yield r
    r.close()


def otlp(settings, endpoint, **more):
    return settings.replace(trace_exporter="otlp", otlp_endpoint=endpoint, **more)


def span(name, **attrs):
    with telemetry.tracer().start_as_current_span(name) as s:
        s.set_attributes(attrs)


# --- endpoints, protocols, headers -------------------------------------------------------------

def test_endpoint_forms():
    assert telemetry.otlp_url("http://h:4318") == "http://h:4318/v1/traces"
    assert telemetry.otlp_url("http://h:6006/") == "http://h:6006/v1/traces"  # Phoenix's base
    assert telemetry.otlp_url("http://h:4318/v1/traces") == "http://h:4318/v1/traces"
    assert telemetry.otlp_url("https://h/otel") == "https://h/otel/v1/traces"  # a path prefix
    assert telemetry.otlp_url("h:4318") == "http://h:4318/v1/traces"
    assert telemetry.otlp_url("") == "http://localhost:4318/v1/traces"
    assert telemetry.otlp_url("", "grpc") == "http://localhost:4317"
    assert telemetry.otlp_url("http://h:4317/", "grpc") == "http://h:4317"
    assert telemetry.otlp_url("h:4318", "http/protobuf") == "http://h:4318/v1/traces"
    for bad, protocol in [("http://h:4318/v1/traces", "grpc"), ("ftp://h", "http"),
                          ("http://h:99999", "http"), ("http://h", "http/json")]:
        with pytest.raises(SettingsError):
            telemetry.otlp_url(bad, protocol)
    assert telemetry.otlp_headers("api_key=a%20b, x-team = search") == {"api_key": "a b",
                                                                       "x-team": "search"}
    with pytest.raises(SettingsError):
        telemetry.otlp_headers("novalue")


def test_settings_reject_bad_trace_values():
    for bad in [{"otlp_protocol": "http/json"}, {"otlp_endpoint": "ftp://x"},
                {"otlp_headers": "nokey"}, {"trace_flush_timeout_s": -1}]:
        with pytest.raises(SettingsError):
            load_settings(overrides={"trace_exporter": "otlp", **bad}, read_env=False,
                          read_file=False)


def test_standard_otel_variables_become_settings(monkeypatch, tmp_path):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-api-key=s3cr%20t")
    s = load_settings(overrides={"home": tmp_path}, read_file=False)
    assert (s.trace_exporter, s.otlp_endpoint, s.otlp_protocol, s.otlp_headers) == (
        "otlp", "http://collector:4317", "grpc", "x-api-key=s3cr%20t")
    # the traces-specific variable wins over the general one; ours win over both
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4318/v1/traces")
    assert load_settings(read_file=False).otlp_endpoint == "http://traces:4318/v1/traces"
    monkeypatch.setenv("BRANCHSEARCH_OTLP_ENDPOINT", "http://ours:4318")
    assert load_settings(read_file=False).otlp_endpoint == "http://ours:4318"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(SettingsError, match="http/protobuf"):
        load_settings(read_file=False)


def test_a_collector_named_without_an_exporter_means_otlp(monkeypatch, tmp_path):
    """Before, an endpoint alone exported nothing, silently (the exporter stayed 'none')."""
    only = dict(read_env=False, read_file=False)
    assert load_settings(**only).trace_exporter == "none"
    assert load_settings(overrides={"otlp_endpoint": "http://c:4318"}, **only
                         ).trace_exporter == "otlp"
    assert load_settings(overrides={"otlp_endpoint": "http://c:4318", "trace_exporter": "none"},
                         **only).trace_exporter == "none"  # chosen explicitly: kept
    console = load_settings(overrides={"trace_exporter": "console"}, **only)
    assert console.replace(otlp_endpoint="http://c:4318").trace_exporter == "console"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    assert load_settings(overrides={"home": tmp_path}, read_file=False).trace_exporter == "otlp"
    monkeypatch.setenv("BRANCHSEARCH_TRACE_EXPORTER", "jsonl")
    assert load_settings(overrides={"home": tmp_path}, read_file=False).trace_exporter == "jsonl"


def test_env_settings_reach_a_process_with_another_environment(monkeypatch, receiver, tmp_path):
    """Actors get the driver's Settings object (pickled), never re-read their environment: a
    process whose own OTEL_EXPORTER_OTLP_ENDPOINT points at a dead port (a node started with
    `ray start` elsewhere) still exports to the collector the driver's environment named."""
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.base_url)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-api-key=s3cr%20t")
    settings = load_settings(overrides={"home": tmp_path}, read_file=False)
    blob = tmp_path / "settings.pickle"
    blob.write_bytes(pickle.dumps(settings))
    code = (
        "import pickle, sys\n"
        "from branchsearch.infra import telemetry\n"
        "settings = pickle.loads(open(sys.argv[1], 'rb').read())\n"
        "telemetry.configure_from(settings)\n"
        "with telemetry.tracer().start_as_current_span('branch') as s:\n"
        "    s.set_attributes({'branch.index': 0, 'branch.subquery': 'q'})\n"
        "print(telemetry.flush(5.0))\n")
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{closed_port()}",
           "OTEL_EXPORTER_OTLP_HEADERS": "x-api-key=wrong"}
    out = subprocess.run([sys.executable, "-c", code, str(blob)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr
    assert receiver.wait_for(lambda spans: any(s["name"] == "branch" for s in spans))
    branch = next(s for s in receiver.spans if s["name"] == "branch")
    assert branch["attributes"]["openinference.span.kind"] == "AGENT"
    assert branch["resource"]["process.pid"] != os.getpid()
    assert receiver.requests[0]["path"] == "/v1/traces"
    headers = {k.lower(): v for k, v in receiver.requests[0]["headers"].items()}
    assert headers["x-api-key"] == "s3cr t"


# --- the pipeline ------------------------------------------------------------------------------

def test_configure_replaces_the_exporter(tmp_path, receiver):
    assert issubclass(telemetry.JsonlSpanExporter, SpanExporter)
    first = tmp_path / "first.jsonl"
    telemetry.configure("jsonl", str(first))
    span("query", question="one")
    telemetry.configure("otlp", otlp_endpoint=receiver.base_url)  # the base URL
    span("query", question="two")
    assert telemetry.flush(5.0)
    lines = [json.loads(line) for line in first.read_text().splitlines()]
    assert [s["attributes"]["question"] for s in lines] == ["one"]  # not "two" as well
    assert [s["attributes"]["question"] for s in receiver.spans] == ["two"]
    assert receiver.requests[0]["path"] == "/v1/traces"
    mem_a, mem_b = InMemorySpanExporter(), InMemorySpanExporter()
    telemetry.configure(span_exporter=mem_a)
    telemetry.configure(span_exporter=mem_b)
    span("plan")
    assert not mem_a.get_finished_spans() and len(mem_b.get_finished_spans()) == 1


def test_span_roles_follow_genai_and_openinference():
    mem = InMemorySpanExporter()
    telemetry.configure(span_exporter=mem)
    tracer = telemetry.tracer()
    with tracer.start_as_current_span("query") as q:
        q.set_attribute("question", "Q?")
        span("plan", subqueries=["a", "b"])
        with tracer.start_as_current_span("branch") as b:
            b.set_attributes({"branch.index": 1, "branch.subquery": "a"})
            with tracer.start_as_current_span("episode"), tracer.start_as_current_span("turn"):
                span("tool search_corpus", args='{"query": "a"}', ids=["d1#p0", "d2#p0"])
                with tracer.start_as_current_span("tool prune_chunks"):
                    span("prune", **{"prune.reason": "off topic", "prune.applied_ids": ["d2#p0"]})
                span("chat")
    got = {s.name: dict(s.attributes) for s in mem.get_finished_spans()}
    kinds = {name: a.get("openinference.span.kind") for name, a in got.items()}
    assert kinds == {"query": "CHAIN", "plan": "CHAIN", "branch": "AGENT", "episode": "CHAIN",
                     "turn": "CHAIN", "tool search_corpus": "RETRIEVER",
                     "tool prune_chunks": "TOOL", "prune": "CHAIN", "chat": "LLM"}
    ops = {name: a.get("gen_ai.operation.name") for name, a in got.items()}
    assert ops["query"] == "invoke_workflow" and ops["plan"] == "plan"
    assert ops["branch"] == "invoke_agent" and ops["chat"] == "chat"
    assert ops["tool search_corpus"] == ops["tool prune_chunks"] == "execute_tool"
    assert got["branch"]["gen_ai.agent.name"] == "branchsearch.branch"
    assert got["branch"]["gen_ai.agent.id"] == "branch-1"
    search = got["tool search_corpus"]
    assert search["gen_ai.tool.name"] == "search_corpus"
    assert search["gen_ai.tool.call.arguments"] == search["input.value"] == '{"query": "a"}'
    assert search["retrieval.documents.1.document.id"] == "d2#p0"
    assert got["query"]["input.value"] == "Q?"
    assert got["prune"]["prune.reason"] == "off topic"  # prune attributes are kept
    assert json.loads(got["prune"]["output.value"]) == ["d2#p0"]


def test_a_failing_exporter_never_breaks_the_work(tmp_path, capfd):
    folder = tmp_path / "a-directory.jsonl"
    telemetry.configure("jsonl", str(folder))
    folder.mkdir()  # made after (a folder given is refused): every write fails, IsADirectoryError
    for _ in range(5):
        span("turn")
    assert telemetry.stats()["dropped"] == 5
    assert telemetry.stats()["last_error"] == "[Errno 21] Is a directory"
    err = capfd.readouterr().err
    assert err.count("branchsearch: trace export to") == 1 and "Traceback" not in err


def test_grpc_protocol_reaches_a_grpc_receiver():
    grpc_receiver = GrpcReceiver()
    try:
        telemetry.configure("otlp", otlp_endpoint=grpc_receiver.base_url, protocol="grpc",
                            headers="x-api-key=k")
        span("tool grep_corpus", args="{}", ids=["a#p0"])
        assert telemetry.flush(5.0)
        assert grpc_receiver.wait_for(lambda spans: len(spans) == 1)
        assert grpc_receiver.spans[0]["attributes"]["openinference.span.kind"] == "RETRIEVER"
        assert grpc_receiver.requests[0]["headers"]["x-api-key"] == "k"
    finally:
        grpc_receiver.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_flush_to_a_dead_collector_is_bounded(protocol, capfd):
    telemetry.configure("otlp", otlp_endpoint=f"http://127.0.0.1:{closed_port()}",
                        protocol=protocol, flush_timeout_s=0.5)
    waits = []
    for _ in range(3):
        for _ in range(20):
            span("turn")
        started = time.perf_counter()
        assert telemetry.flush() is False  # the spans did not leave, and flush says so
        waits.append(time.perf_counter() - started)
    assert max(waits) < 1.5 and sum(waits) < 2.5, waits
    deadline = time.monotonic() + 15
    while telemetry.stats()["dropped"] == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert telemetry.stats()["dropped"] >= 20 and telemetry.stats()["exported"] == 0
    err = capfd.readouterr().err
    assert err.count("branchsearch: trace export to") == 1, err
    assert "Traceback" not in err and "Transient error" not in err


def test_a_short_process_with_a_dead_collector_says_its_spans_were_dropped():
    """A command that ends before its exporter learns the collector is down must still say,
    once, that its spans did not arrive (its printed trace id names spans nobody has)."""
    import subprocess
    import sys

    code = ("import sys; from branchsearch.infra import telemetry; "
            "telemetry.configure('otlp', otlp_endpoint=sys.argv[1], export_timeout_s=5.0); "
            "[telemetry.tracer().start_span('turn').end() for _ in range(3)]; "
            "telemetry.flush()")
    for endpoint in (f"http://127.0.0.1:{closed_port()}", "http://10.255.255.1:4318"):
        out = subprocess.run([sys.executable, "-c", code, endpoint], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-500:]
        assert out.stderr.count("branchsearch: trace export to") == 1, (endpoint, out.stderr)
        assert "Traceback" not in out.stderr


def test_a_silent_collector_costs_one_flush_timeout(capfd):
    """A collector that accepts connections and never answers (hung, or a black hole)."""
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)  # the kernel completes connections; nobody reads or answers
        telemetry.configure("otlp", otlp_endpoint=f"127.0.0.1:{silent.getsockname()[1]}",
                            export_timeout_s=1.0, flush_timeout_s=0.3)
        waits = []
        for _ in range(4):
            span("turn")
            started = time.perf_counter()
            telemetry.flush()
            waits.append(time.perf_counter() - started)
        assert waits[0] < 1.0 and sum(waits[1:]) < 0.5, waits  # later flushes do not wait
        deadline = time.monotonic() + 15
        while telemetry.stats()["dropped"] == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert telemetry.stats()["dropped"] >= 1
    err = capfd.readouterr().err
    assert err.count("branchsearch: trace export to") == 1 and "Traceback" not in err


# --- a whole search ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def local_driver(hotpot_settings):
    from branchsearch.orchestrator.driver import Driver

    driver = Driver(hotpot_settings.replace(branches=2, skip_covered=False), mode="local")
    driver.search(Q)  # warm: models and indexes loaded
    yield driver
    driver.close()


def timed_search(driver) -> float:
    started = time.perf_counter()
    result = driver.search(Q)
    assert [b.status for b in result.branches] == ["ok", "ok"]
    return time.perf_counter() - started


def test_a_dead_collector_costs_a_search_little(local_driver, hotpot_settings, capfd):
    off = min(timed_search(local_driver) for _ in range(2))
    telemetry.configure_from(otlp(hotpot_settings, f"http://127.0.0.1:{closed_port()}"))
    dead = [timed_search(local_driver) for _ in range(3)]
    # one flush timeout (0.5 s) at most, on a noisy shared machine: a generous bound
    assert max(dead) < off + 3.0, (off, dead)
    deadline = time.monotonic() + 15
    while telemetry.stats()["dropped"] == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert telemetry.stats()["dropped"] > 0
    err = capfd.readouterr().err
    assert err.count("branchsearch: trace export to") == 1 and "Traceback" not in err


def test_a_search_reaches_a_real_receiver_with_span_kinds(local_driver, hotpot_settings,
                                                           receiver):
    telemetry.configure_from(otlp(hotpot_settings, receiver.base_url))  # base URL form
    result = local_driver.search(Q)
    assert receiver.wait_for(lambda spans: any(s["name"] == "query" for s in spans))
    mine = [s for s in receiver.spans if s["trace_id"] == result.trace_id]
    names = {s["name"] for s in mine}
    assert {"query", "plan", "branch", "episode", "turn"} <= names
    assert any(n.startswith("tool ") for n in names)
    kinds = {s["attributes"].get("openinference.span.kind") for s in mine}
    assert {"CHAIN", "AGENT", "RETRIEVER"} <= kinds
    branches = [s for s in mine if s["name"] == "branch"]
    assert len(branches) == 2 and all(
        b["attributes"]["gen_ai.operation.name"] == "invoke_agent" for b in branches)
    tools = [s for s in mine if s["name"].startswith("tool ")]
    assert all(t["attributes"]["gen_ai.tool.name"] == t["name"][5:] for t in tools)
    assert {r["path"] for r in receiver.requests} == {"/v1/traces"}
    assert telemetry.stats()["dropped"] == 0


@pytest.mark.ray
def test_otel_variables_reach_ray_actors_through_settings(hotpot_settings, receiver,
                                                           monkeypatch):
    """The driver's environment names the collector; the actors' environment names a dead port
    (as on nodes started with `ray start` elsewhere). Actor spans still reach the collector."""
    import ray

    from branchsearch.orchestrator.driver import Driver

    from conftest import ingest_copy

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.base_url)
    settings = load_settings(overrides={"home": hotpot_settings.home}, read_file=False)
    settings = ingest_copy(settings.replace(index="hotpot"), "hotpot-trace-ray").replace(
        branches=2, branch_timeout_s=60, skip_covered=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    driver = Driver(settings, mode="ray", pool_size=2)  # actors inherit the dead variable
    try:
        result = driver.search(Q)
        assert [b.status for b in result.branches] == ["ok", "ok"]
        assert receiver.wait_for(lambda spans: sum(
            s["name"] == "episode" and s["trace_id"] == result.trace_id for s in spans) == 2)
        mine = [s for s in receiver.spans if s["trace_id"] == result.trace_id]
        pids = {s["resource"]["process.pid"] for s in mine}
        assert os.getpid() in pids and len(pids) >= 3  # the driver and both branch actors
        by_id = {s["span_id"]: s for s in mine}
        branch = next(s for s in mine if s["name"] == "branch")
        assert by_id[branch["parent_id"]]["name"] == "query"
    finally:
        driver.close()
        ray.shutdown()
