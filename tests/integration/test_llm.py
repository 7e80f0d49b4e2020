"""The LLM path with a real engine: vLLM (CPU build) serving the bundled SmolLM2-135M-Instruct.
A weak model: these tests check that the machinery holds (every action parses or is rejected
with a recorded reason, the harness rules bind the model, injected text changes nothing, one
engine serves several branch actors), not answer quality."""

import json

import pytest

from branchsearch.workers.harness import Episode
from branchsearch.workers.llm_policy import LLMPolicy

pytestmark = pytest.mark.llm
vllm = pytest.importorskip("vllm", reason="install branchsearch[llm] (scripts/setup.sh)")

Q = "What government position was held by the woman who portrayed Corliss Archer in the film Kiss and Tell?"
TOOLS = {"search_corpus", "grep_corpus", "read_document", "prune_chunks", "recall_chunks",
         "finish"}


@pytest.fixture(scope="module")
def llm_settings(hotpot_settings):
    return hotpot_settings.replace(policy="llm", max_turns=3, llm_max_tokens=160)


@pytest.fixture(scope="module")
def engine(llm_settings):
    from branchsearch.workers.factory import local_engine

    return local_engine(llm_settings)


def calls_of(result):
    return [r for r in result.trace if r["kind"] == "call"]


def test_structured_output_parses_and_rules_apply(engine, llm_settings, hotpot_retriever):
    policy = LLMPolicy(engine, max_tokens=160)
    result = Episode(Q, hotpot_retriever, policy, llm_settings).run()
    assert result.termination in ("finish", "max_turns", "no_progress")
    assert policy.log and all(entry["error"] == "" for entry in policy.log), policy.log
    for entry in policy.log:
        json.loads(entry["raw"])  # structured output: always valid JSON
    calls = calls_of(result)
    assert calls and {c["tool"] for c in calls} <= TOOLS
    assert all(c["ok"] or c["message"] for c in calls)  # rejected ones say why


def test_past_the_hard_limit_the_model_can_only_prune_recall_or_finish(
        engine, llm_settings, hotpot_retriever):
    settings = llm_settings.replace(budget_tokens=300, soft_limit=0.3, hard_limit=0.5,
                                    result_token_cap=90, max_turns=4)
    policy = LLMPolicy(engine, max_tokens=160)
    episode = Episode(Q, hotpot_retriever, policy, settings)
    result = episode.run()
    hard = [t for t in result.trace if t["kind"] == "turn" and t["tokens_before"] >= 150]
    assert hard, "the first search must push the context past the hard limit"
    later = [c for c in calls_of(result) if c["turn"] >= hard[0]["turn"]]
    invalid = [r for r in result.trace if r["kind"] == "invalid_action"
               and r["turn"] >= hard[0]["turn"]]  # (counted by the harness, not calls)
    assert (later or invalid) and {c["tool"] for c in later} <= {"prune_chunks",
                                                                 "recall_chunks", "finish"}


def test_planted_instructions_do_not_change_tools_or_termination(engine, tmp_path):
    from conftest import FIXTURES, HOTPOT
    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.infra.index.open import open_retriever
    from branchsearch.infra.config.settings import load_settings

    corpus = tmp_path / "c.jsonl"
    corpus.write_text((HOTPOT / "corpus.jsonl").read_text()
                      + (FIXTURES / "injection.jsonl").read_text())
    settings = load_settings(overrides={"home": tmp_path / "h", "search_mode": "bm25",
                                        "max_turns": 3, "policy": "llm"},
                             read_env=False, read_file=False)
    ingest(corpus, settings, dense=False)
    retriever = open_retriever(settings, need_dense=False)
    policy = LLMPolicy(engine, max_tokens=160)
    episode = Episode("Corliss Archer trivia", retriever, policy, settings,
                      acl_groups=["staff"])
    result = episode.run()
    retriever.close()
    planted = {"planted-note#p0", "planted-tool#p0"} & set(result.retrieved_ids)
    assert planted  # the model did read an injection
    assert all(p["reason"] != "injected" for p in result.trace if p["kind"] == "prune")
    assert "secret-memo#p0" not in result.retrieved_ids  # ACL from the caller, not the text
    assert episode.acl_groups == ["staff"] and episode.budget.tokens == settings.budget_tokens
    assert {c["tool"] for c in calls_of(result)} <= TOOLS
    assert result.termination in ("finish", "max_turns", "no_progress")


def test_llm_planner_and_its_fallback(engine):
    from branchsearch.infra.models.llm import OpenAIEngine
    from branchsearch.orchestrator.plan import LLMPlanner

    planner = LLMPlanner(engine)
    subs = planner.plan(Q, 3)
    assert subs[0].text == Q and 1 <= len(subs) <= 3
    if planner.last_fallback == "":
        assert all(s.kind == "llm" for s in subs[1:])
    down = LLMPlanner(OpenAIEngine("http://127.0.0.1:9", "none", timeout_s=2))
    subs = down.plan("Were Scott Derrickson and Ed Wood of the same nationality?", 3)
    assert "not reachable" in down.last_fallback  # recorded, and the heuristic plan used
    assert [s.kind for s in subs] == ["original", "comparison", "comparison"]


@pytest.mark.ray
def test_one_engine_actor_serves_several_branch_actors(llm_settings):
    import ray

    from conftest import ingest_copy
    from branchsearch.orchestrator.driver import Driver
    from branchsearch.workers.engine_actor import NAMESPACE, engine_name

    # a generous branch timeout: two CPU branches share one engine on a possibly busy machine
    settings = ingest_copy(llm_settings, "hotpot-llm").replace(max_turns=2, branches=2,
                                                               branch_timeout_s=900,
                                                               skip_covered=False)
    driver = Driver(settings, mode="ray", pool_size=2)
    try:
        result = driver.search("Were Scott Derrickson and Ed Wood of the same nationality?")
        engine = ray.get_actor(engine_name(0), namespace=NAMESPACE)
        stats = ray.get(engine.stats.remote())
    finally:
        driver.close()
    assert [b.status for b in result.branches] == ["ok", "ok"]
    assert len({b.pid for b in result.branches}) == 2
    turns = sum(b.turns for b in result.branches)
    assert stats["requests"] >= turns >= 2  # every branch's decisions went to the one engine


def test_the_endpoint_client_sends_a_seed_only_when_llm_seed_is_set(tmp_path):
    """The request bodies as a real loopback HTTP server receives them: no `seed` by default
    (a seeded request whose prefill a vLLM CPU server chunks kills that server), `seed` when
    `llm_seed` is set, from the TOML file, the environment or a flag."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from branchsearch.infra.errors import SettingsError
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.workers.factory import make_engine

    bodies = []

    class Endpoint(BaseHTTPRequestHandler):
        def do_POST(self):
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            out = json.dumps({"choices": [{"message": {"content": "ok"},
                                           "finish_reason": "stop"}],
                              "usage": {"completion_tokens": 1}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Endpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        settings = load_settings(overrides={
            "home": tmp_path, "llm_url": f"http://127.0.0.1:{server.server_port}/v1",
            "llm_model": "m"}, read_env=False, read_file=False)
        assert settings.llm_seed is None
        assert make_engine(settings).chat([{"role": "user", "content": "q"}]) == "ok"
        assert make_engine(settings.replace(llm_seed=7)).chat(
            [{"role": "user", "content": "q"}], temperature=0.3) == "ok"
    finally:
        server.shutdown()
        server.server_close()
    assert "seed" not in bodies[0] and bodies[0]["model"] == "m"
    assert bodies[1]["seed"] == 7 and bodies[1]["temperature"] == 0.3

    def seed(**given):
        return load_settings(overrides={"home": tmp_path, **given}, read_env=False,
                             read_file=False).llm_seed

    assert seed() is None and seed(llm_seed="none") is None and seed(llm_seed="") is None
    assert seed(llm_seed="7") == 7 and seed(llm_seed=0) == 0
    for bad in ("seven", 1.5, True, -1):
        with pytest.raises(SettingsError, match="llm_seed"):
            seed(llm_seed=bad)
