"""The service's OpenAPI schema is one clients can use, and the live service keeps to it.

A real service on loopback (uvicorn, the in-process executor, real stores, a keys file): the
schema declares the bearer scheme on /v1 and no scheme on the public routes, a 200 model and
the one error body for each status a route answers, the service's own limits as constraints,
/metrics as text; 405 answers carry `Allow`. Then Schemathesis generates requests from the
served /openapi.json (valid and invalid ones) and checks every answer: no 5xx, every status
documented, every body matching its schema. Document writes are fuzzed on a throwaway index.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

from branchsearch.infra.ingest.pipeline import ingest
from branchsearch.infra.config.settings import load_settings
from branchsearch.orchestrator.service import deploy as service
from branchsearch.orchestrator.service.admission import Limits
from branchsearch.orchestrator.service.app import ServiceState, create_app
from branchsearch.orchestrator.service.auth import KeyStore

from service_fixtures import CORPUS, start_uvicorn, write_corpus

schemathesis = pytest.importorskip("schemathesis")

LIMITS = Limits(max_body_bytes=32 * 1024, max_question_chars=200, max_branches=2, max_k=10,
                default_deadline_s=20, max_deadline_s=30, per_key_concurrency=4,
                max_in_flight=8)
SEARCHED, SCRATCH = "fuzz", "scratch"  # SCRATCH takes the fuzzed document writes
# per operation and generation mode (positive, negative); the whole run stops generating past
# the time limit. A longer, random exploration: BRANCHSEARCH_FUZZ_EXAMPLES=200
# BRANCHSEARCH_FUZZ_SECONDS=900 BRANCHSEARCH_FUZZ_RANDOM=1
MAX_EXAMPLES = int(os.environ.get("BRANCHSEARCH_FUZZ_EXAMPLES", 12))
TIME_LIMIT_S = float(os.environ.get("BRANCHSEARCH_FUZZ_SECONDS", 75))
RANDOM = bool(os.environ.get("BRANCHSEARCH_FUZZ_RANDOM"))  # default: the same cases every run


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    home = tmp_path_factory.mktemp("schema-home")
    settings = load_settings(overrides={"home": home, "index": SEARCHED, "branches": 2},
                             read_env=False, read_file=False)
    ingest(write_corpus(home / "corpus.jsonl"), settings)
    ingest(write_corpus(home / "scratch.jsonl", CORPUS[:2]), settings.replace(index=SCRATCH))
    store = KeyStore(home / "keys.json")
    admin = store.add("fuzzer", (), admin=True, everything=True)
    reader = store.add("reader", ("alpha",), (SEARCHED,))
    state = service.local_state(settings, executor="local", keys_path=home / "keys.json",
                                limits=LIMITS)
    state.searcher.target.drivers.open(SEARCHED)
    server = start_uvicorn(create_app(state), state)
    yield server.url, {"admin": admin, "reader": reader}, state
    server.stop()
    state.searcher.target.close()


def test_schema_declares_security_answers_and_limits(live):
    url, _, state = live
    spec = httpx.get(f"{url}/openapi.json", timeout=30).json()
    schemes = spec["components"]["securitySchemes"]
    assert schemes == {"bearer": {"type": "http", "scheme": "bearer",
                                  "description": schemes["bearer"]["description"]}}
    error_ref = {"$ref": "#/components/schemas/ErrorBody"}
    assert spec["components"]["schemas"]["ErrorBody"]["required"] == ["error", "detail"]
    assert "HTTPValidationError" not in spec["components"]["schemas"]  # never sent
    ids = [op["operationId"] for ops in spec["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids)), ids  # generated clients need them unique (HEAD twins)
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            if path.startswith("/v1/"):
                assert op["security"] == [{"bearer": []}], (method, path)
                assert "401" in op["responses"], (method, path)
            else:
                assert "security" not in op, (method, path)
            for status, answer in op["responses"].items():
                if status == "503":  # overloaded: the limit met as data; the others plain
                    assert answer["content"]["application/json"]["schema"]["anyOf"] == [
                        {"$ref": "#/components/schemas/Overload"}, error_ref], (method, path)
                elif status not in ("200", "429"):
                    assert answer["content"] == {"application/json": {"schema": error_ref}}, (
                        method, path, status)
                elif status == "429":  # a key's refusal: why, its counts and limits as data
                    assert answer["content"] == {"application/json": {"schema": {
                        "$ref": "#/components/schemas/KeyRefusal"}}}, (method, path)
    refusal = spec["components"]["schemas"]["KeyRefusal"]
    assert refusal["required"] == ["error", "detail", "reason", "running", "waiting", "limits"]
    assert refusal["properties"]["reason"]["enum"] == ["queue_full", "no_queue",
                                                       "deadline_in_queue"]
    overload = spec["components"]["schemas"]["Overload"]
    assert overload["required"] == ["error", "detail", "reason", "in_use", "limits"]
    assert overload["properties"]["past_deadline"]["anyOf"] == [{"type": "integer"},
                                                                {"type": "null"}]
    assert overload["properties"]["reason"]["enum"] == ["max_in_flight", "max_open_indexes",
                                                        "branch_actors", "searcher_queue"]
    assert spec["components"]["schemas"]["KeyLimits"]["required"] == ["per_key_concurrency",
                                                                      "per_key_queue"]
    search = spec["paths"]["/v1/search"]["post"]
    assert set(search["responses"]) == {"200", "400", "401", "403", "404", "413", "415", "422",
                                        "429", "503", "504"}
    assert set(search["responses"]["200"]["content"]) == {"application/json",
                                                          "text/event-stream"}
    body = search["requestBody"]["content"]["application/json"]["schema"]
    props = body["properties"]
    assert body["required"] == ["question"] and body["additionalProperties"] is False
    assert (props["question"]["minLength"], props["question"]["maxLength"]) == (1, 200)
    limits = {name: props[name]["anyOf"][0] for name in ("index", "branches", "k",
                                                         "deadline_s")}
    assert (limits["branches"]["minimum"], limits["branches"]["maximum"]) == (1, 2)
    assert (limits["k"]["minimum"], limits["k"]["maximum"]) == (1, 10)
    assert (limits["deadline_s"]["exclusiveMinimum"], limits["deadline_s"]["maximum"]) == (0, 30)
    assert (limits["index"]["minLength"], limits["index"]["maxLength"]) == (1, 100)
    put = spec["paths"]["/v1/indexes/{index}/documents"]["put"]
    assert {"409", "413", "415"} <= set(put["responses"])
    index = next(p for p in put["parameters"] if p["name"] == "index")["schema"]
    assert index["maxLength"] == 100 and index["pattern"].startswith("^")
    assert spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"] == {
        "text/plain": {"schema": {"type": "string"}}}
    ready = spec["paths"]["/readyz"]["get"]["responses"]
    assert ready["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Ready"} and ready["503"]["content"]
    # a service with other limits documents its own
    other = create_app(ServiceState(state.searcher, None, Limits(max_question_chars=77,
                                                                 max_branches=5)))
    props = other.openapi()["paths"]["/v1/search"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]["properties"]
    assert props["question"]["maxLength"] == 77
    assert props["branches"]["anyOf"][0]["maximum"] == 5


def test_405_answers_carry_allow(live):
    url, keys, _ = live
    with httpx.Client(base_url=url, timeout=30) as client:
        for method, path, allowed in (("DELETE", "/v1/search", {"POST"}),
                                      ("POST", "/healthz", {"GET", "HEAD"}),
                                      ("GET", f"/v1/indexes/{SEARCHED}/documents", {"PUT"})):
            r = client.request(method, path, headers={"Authorization": f"Bearer {keys['admin']}"})
            assert r.status_code == 405, (method, path, r.text)
            assert r.json()["error"] == "method_not_allowed"
            assert {m.strip() for m in r.headers["allow"].split(",")} == allowed, r.headers


# 5xx answers a correct service gives: a deadline of microseconds (the schema allows any
# positive number), an index still starting when it runs out, every branch slot busy
EXPECTED_5XX = {(504, "deadline_exceeded"), (503, "index_starting"), (503, "overloaded")}


def _error_code(response) -> str:
    try:
        return response.json().get("error", "")
    except Exception:  # noqa: BLE001 — not JSON (a stream): no code
        return ""


def test_schemathesis_finds_no_server_error_or_schema_violation(live, capsys):
    """Schemathesis against the served schema: every operation, valid and invalid inputs, with
    a global admin key; searches as JSON and as an event stream (each event checked against
    the schema's event schema); document writes on the throwaway index (its name pinned) as
    well as on generated index names."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable

    from branchsearch.orchestrator.service.events import parse_sse
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.errors import FailureGroup
    from schemathesis.specs.openapi.checks import (response_schema_conformance,
                                                   status_code_conformance)

    url, keys, _ = live
    # 503 and 504 are answers the schema documents (a deadline of microseconds, an index still
    # starting when it runs out); which ones are acceptable is checked below
    config = schemathesis.Config.from_dict({"checks": {"not_a_server_error": {
        "expected-statuses": ["2xx", "3xx", "4xx", "503", "504"]}}})
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", config=config, timeout=30)
    checks = [not_a_server_error, status_code_conformance, response_schema_conformance]
    # the key is fixed (a negative case would otherwise mostly drop it: one more 401); invalid
    # keys are the auth tests' (tests/orchestrator/service/test_service.py)
    auth = {"Authorization": f"Bearer {keys['admin']}"}
    runs = []  # (method, path, pinned path parameters, headers)
    for path, ops in schema.raw_schema["paths"].items():
        for method in ops:
            runs.append((method.upper(), path, None, auth))
            if "{index}" in path:
                runs.append((method.upper(), path, {"index": SCRATCH}, auth))
            if path == "/v1/search":
                runs.append((method.upper(), path, None, {**auth,
                                                          "Accept": "text/event-stream"}))
    counts = {"operations": len({(m, p) for m, p, _, _ in runs}), "calls": 0, "failures": 0,
              "server_errors": 0, "events": 0}
    statuses: dict[int, int] = {}
    failures: list[str] = []
    stop_at = time.monotonic() + TIME_LIMIT_S

    def server_error(status: int, code: str) -> bool:
        return status >= 500 and (status, code) not in EXPECTED_5XX

    for method, path, pinned, headers in runs:
        operation = schema[path][method]
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            where = f"{method} {path} [{mode.value}{', stream' if 'Accept' in headers else ''}]"
            strategy = operation.as_strategy(generation_mode=mode, path_parameters=pinned,
                                             headers=headers)

            @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
                      phases=[Phase.generate], derandomize=not RANDOM,
                      suppress_health_check=list(HealthCheck))
            @given(case=strategy)
            def fuzz(case):
                if time.monotonic() > stop_at:
                    return
                counts["calls"] += 1
                try:
                    response = case.call(headers=headers, timeout=60)
                except Exception as exc:  # noqa: BLE001 — a dropped connection is a finding
                    failures.append(f"{where}: {type(exc).__name__}: {exc}")
                    return
                status = response.status_code
                statuses[status] = statuses.get(status, 0) + 1
                if server_error(status, _error_code(response)):
                    counts["server_errors"] += 1
                    failures.append(f"{where} -> {status}: {response.text[:500]}")
                if response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
                    events = parse_sse(response.text)
                    counts["events"] += len(events)
                    last = events[-1] if events else {}
                    if last.get("type") not in ("result", "error") or server_error(
                            last.get("status", 0), last.get("error", "")):
                        counts["server_errors"] += 1
                        failures.append(f"{where} -> stream ended with {last}")
                try:
                    case.validate_response(response, checks=checks, headers=headers)
                except (FailureGroup, AssertionError) as exc:
                    counts["failures"] += 1
                    failures.append(f"{where} -> {status}: {str(exc)[:1500]}")

            try:
                fuzz()
            except Unsatisfiable:  # nothing to make invalid (no parameters, no body)
                assert mode is GenerationMode.NEGATIVE, where

    with capsys.disabled():
        print(f"\nSchemathesis: {counts['operations']} operations, {len(runs)} runs x "
              f"(positive, negative) of <= {MAX_EXAMPLES} examples: {counts['calls']} calls "
              f"({counts['events']} stream events), {counts['failures']} failing calls, "
              f"{counts['server_errors']} server errors; statuses "
              f"{dict(sorted(statuses.items()))}")
        for failure in failures[:10]:
            print(failure)
    assert counts["calls"] >= counts["operations"] * 2
    assert failures == [] and counts["server_errors"] == 0
    assert statuses.get(200, 0) > 0 and counts["events"] > 0  # past validation, not only 4xx


def test_the_fuzzed_service_still_answers(live):
    """After the fuzzing: the searched index is intact, readyz is ready."""
    url, keys, _ = live
    with httpx.Client(base_url=url, timeout=120) as client:
        r = client.post("/v1/search", json={"question": "Harbor Festival in June"},
                        headers={"Authorization": f"Bearer {keys['reader']}"})
        assert r.status_code == 200, r.text
        assert "pub-harbor" in {d["doc_id"] for d in r.json()["evidence"]}
        assert client.get("/readyz").json()["status"] == "ready"
        assert json.loads(client.get("/healthz").text) == {"status": "up"}
