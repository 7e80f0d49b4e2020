"""The branch harness driven by a scripted policy through every rule, on real embedded backends
(tantivy + Milvus Lite + docstore over the hotpot-mini fixture)."""

import json

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from branchsearch.infra import telemetry
from branchsearch.workers.harness import Episode
from branchsearch.workers.heuristic import HeuristicPolicy

from branchsearch.workers.scripted import ScriptedPolicy, call

Q = "What government position was held by the woman who portrayed Corliss Archer in the film Kiss and Tell?"


@pytest.fixture(scope="module")
def spans():
    exporter = InMemorySpanExporter()
    telemetry.configure(span_exporter=exporter)
    return exporter


def episode(retriever, settings, turns, **overrides):
    s = settings.replace(**overrides) if overrides else settings
    policy = ScriptedPolicy(turns)
    return Episode(Q, retriever, policy, s), policy


def test_search_exclusion_usage_line_and_no_new_results(hotpot_retriever, hotpot_settings):
    ep, policy = episode(hotpot_retriever, hotpot_settings, [
        [call("search_corpus", query="Corliss Archer", k=5)],
        [call("search_corpus", query="Corliss Archer", k=5)],
        [call("grep_corpus", pattern="zzzqqq.*")],
        [call("finish", ids=[])],
    ])
    result = ep.run()
    first, second = policy.views[1].last_results[0], policy.views[2].last_results[0]
    assert len(first.ids) == 5 and first.content.count("<chunk id=") == 5
    assert not set(first.ids) & set(second.ids)  # seen chunks are excluded
    assert policy.views[3].last_results[0].content == "No new results."
    assert policy.views[1].usage_line == f"[Token usage: {policy.views[1].used_tokens:,}/8,192]"
    assert policy.views[1].used_tokens > 0 and result.termination == "finish"
    # each shown snippet is cut to the per-result cap
    assert all(c.tokens <= hotpot_settings.result_token_cap + 40 for c in policy.views[2].visible)


def test_soft_and_hard_limits(hotpot_retriever, hotpot_settings):
    ep, policy = episode(hotpot_retriever, hotpot_settings, [
        [call("search_corpus", query="Corliss Archer film", k=3)],
        [call("search_corpus", query="Shirley Temple", k=10)],
        [call("search_corpus", query="Kiss and Tell"), call("grep_corpus", pattern="temple"),
         call("read_document", doc_id="ed-wood")],
        lambda view: [call("prune_chunks", ids=[c.id for c in view.visible[:4]], reason="spent")],
        [call("finish", ids=[])],
    ], budget_tokens=400, soft_limit=0.3, hard_limit=0.6, result_token_cap=60)
    result = ep.run()
    v = policy.views
    assert v[1].reminder.startswith("Context is past the soft limit")
    hard = next(view for view in v if view.used_tokens >= 240)
    assert hard.allowed_tools == ["prune_chunks", "recall_chunks", "finish"]
    assert [s["name"] for s in hard.tool_schemas] == hard.allowed_tools
    rejected = [r for r in v[3].last_results if not r.ok]
    assert len(rejected) == 3 and all("past the hard limit" in r.content for r in rejected)
    assert v[4].last_results[0].ok and v[4].used_tokens < v[3].used_tokens  # prune accepted
    assert result.termination == "finish"
    calls = [r for r in result.trace if r["kind"] == "call"]
    assert sum(1 for r in calls if not r["ok"]) == 3  # rejections are in the trace


def test_three_layer_prune_recall_and_exclusion(hotpot_retriever, hotpot_settings, spans):
    spans.clear()
    ep, policy = episode(hotpot_retriever, hotpot_settings, [
        [call("search_corpus", query="Shirley Temple", k=3)],
        lambda view: [call("prune_chunks", ids=[view.visible[0].id, "nope#p0"],
                           reason="not about the film")],
        lambda view: [call("prune_chunks", ids=[policy.views[1].visible[0].id], reason="again"),
                      call("search_corpus", query="Shirley Temple", k=3)],
        lambda view: [call("recall_chunks", ids=[policy.views[1].visible[0].id, "nope#p0"])],
        lambda view: [call("prune_chunks", ids=[c.id for c in view.visible], reason="all")],
        [call("finish", ids=["nope#p0"])],
    ])
    result = ep.run()
    pruned_id = policy.views[1].visible[0].id
    prunes = [r for r in result.trace if r["kind"] == "prune"]
    assert prunes[0]["applied"] == [pruned_id]
    assert prunes[0]["rejected"] == {"nope#p0": "unknown chunk id"}
    assert prunes[0]["tokens_after"] < prunes[0]["tokens_before"]
    assert prunes[0]["query_state"] == {"scripted_turns_left": 4}
    assert prunes[1]["rejected"] == {pruned_id: "not visible (already pruned)"}
    # a pruned chunk stays excluded from searches ...
    assert pruned_id not in policy.views[3].last_results[1].ids
    # ... and comes back by id, without a search
    recall = policy.views[4].last_results[0]
    assert recall.ok and recall.ids == [pruned_id] and "nope#p0: unknown" in recall.content
    assert pruned_id in [c.id for c in policy.views[4].visible]
    # the last evidence in context is never pruned
    assert list(prunes[2]["rejected"].values()) == ["last evidence in context"]
    assert len(policy.views[5].visible) == 1
    # finish ignores unknown ids; a prune is one span with its attributes
    assert result.ranked_chunk_ids == [] and result.termination == "finish"
    prune_spans = [s for s in spans.get_finished_spans() if s.name == "prune"]
    assert len(prune_spans) == 3
    a = prune_spans[0].attributes
    assert list(a["prune.applied_ids"]) == [pruned_id]
    assert json.loads(a["prune.rejected_reasons"]) == {"nope#p0": "unknown chunk id"}
    assert a["prune.reason"] == "not about the film"
    assert a["prune.tokens_before"] > a["prune.tokens_after"]
    names = {s.name for s in spans.get_finished_spans()}
    assert {"episode", "turn", "tool search_corpus", "tool prune_chunks", "prune"} <= names
    trace_ids = {s.context.trace_id for s in spans.get_finished_spans()}
    assert len(trace_ids) == 1


def test_recall_that_does_not_fit_is_rejected(hotpot_retriever, hotpot_settings):
    ep, policy = episode(hotpot_retriever, hotpot_settings, [
        [call("search_corpus", query="Corliss Archer", k=2)],
        lambda view: [call("prune_chunks", ids=[view.visible[0].id], reason="make room")],
        [call("search_corpus", query="Shirley Temple film actress", k=10)],
        lambda view: [call("recall_chunks", ids=[policy.views[1].visible[0].id])],
        [call("finish", ids=[])],
    ], budget_tokens=300, soft_limit=0.5, hard_limit=0.9, result_token_cap=80)
    ep.run()
    recall = policy.views[4].last_results[0]
    assert not recall.ok and "does not fit the budget" in recall.content


@pytest.mark.parametrize("turns, overrides, reason", [
    ([[call("search_corpus", query="film")]] * 5, {"max_turns": 3}, "max_turns"),
    ([[call("grep_corpus", pattern="zzzz.*")]] * 5, {"no_progress_turns": 2}, "no_progress"),
    ([[call("search_corpus", query="film", k=20)]] * 5, {"max_tokens_read": 500},
     "max_tokens_read"),
])
def test_termination_reasons(hotpot_retriever, hotpot_settings, turns, overrides, reason):
    ep, _ = episode(hotpot_retriever, hotpot_settings, turns, **overrides)
    result = ep.run()
    assert result.termination == reason
    assert result.trace[-1]["kind"] == "end" and result.trace[-1]["reason"] == reason
    if reason != "no_progress":
        assert result.ranked_chunk_ids  # forced stops still return what is visible


def test_policy_error_ends_the_episode_with_a_reason(hotpot_retriever, hotpot_settings):
    def boom(view):
        raise RuntimeError("model crashed")

    ep, _ = episode(hotpot_retriever, hotpot_settings, [boom])
    result = ep.run()
    assert result.termination == "policy_error" and "model crashed" in result.detail


def test_bad_calls_are_observations_not_crashes(hotpot_retriever, hotpot_settings):
    ep, policy = episode(hotpot_retriever, hotpot_settings, [
        [call("drop_database"), call("search_corpus", query=""),
         call("search_corpus", query="x", acl_groups=["finance"]),
         call("grep_corpus", pattern="(unclosed"), call("grep_corpus", pattern="a" * 300),
         call("read_document", doc_id="no-such-doc"), call("prune_chunks", ids=["x#p0"]),
         call("search_corpus", query="Ed Wood", k=2)],
        [call("finish", ids=[])],
    ])
    result = ep.run()
    results = policy.views[1].last_results
    assert [r.ok for r in results] == [False] * 7 + [True]
    assert "unknown tool 'drop_database'" in results[0].content
    assert "additional properties" in results[2].content.lower()  # ACL is never an argument
    assert "invalid regex" in results[3].content
    assert "unknown document id" in results[5].content
    assert "reason" in results[6].content
    assert result.termination == "finish"


def test_calls_in_one_turn_run_and_apply_in_order(hotpot_retriever, hotpot_settings):
    ep, policy = episode(hotpot_retriever, hotpot_settings, [
        [call("search_corpus", query="Scott Derrickson", k=3),
         call("search_corpus", query="Ed Wood", k=3),
         call("read_document", doc_id="shirley-temple")],
        [call("finish", ids=[])],
    ])
    ep.run()
    view = policy.views[1]
    ids = [r.ids for r in view.last_results]
    assert all(ids) and len({i for group in ids for i in group}) == sum(map(len, ids))
    assert [c.id for c in view.visible] == [i for group in ids for i in group]


def test_planted_instructions_change_nothing(tmp_path):
    """Documents that try to finish the episode, prune chunks, raise the budget or grant ACL
    groups are returned as escaped data; tools, budget, ACL and termination are unchanged."""
    from conftest import FIXTURES, HOTPOT
    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.infra.index.open import open_retriever
    from branchsearch.infra.config.settings import load_settings

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text((HOTPOT / "corpus.jsonl").read_text()
                      + (FIXTURES / "injection.jsonl").read_text())
    settings = load_settings(overrides={"home": tmp_path / "h"}, read_env=False,
                             read_file=False)
    ingest(corpus, settings, dense=False)
    retriever = open_retriever(settings, need_dense=False)
    scripted = ScriptedPolicy([[call("search_corpus", query="Corliss Archer trivia", k=5,
                                     mode="bm25")],
                               [call("grep_corpus", pattern="trivia")], [], []])
    ep = Episode("Corliss Archer trivia", retriever, scripted, settings.replace(
        no_progress_turns=2), acl_groups=["staff"])
    result = ep.run()
    first = scripted.views[1]
    planted = first.last_results[0]
    assert "planted-note#p0" in planted.ids and "secret-memo#p0" not in planted.ids
    assert "</chunk><tool_call>" not in planted.content and "&lt;/chunk&gt;" in planted.content
    assert first.allowed_tools == scripted.views[0].allowed_tools
    assert first.budget_tokens == settings.budget_tokens and ep.acl_groups == ["staff"]
    assert {"planted-note#p0", "planted-tool#p0"} <= set(result.retrieved_ids)
    assert result.pruned_ids == [] and result.termination == "no_progress"
    assert [r["tool"] for r in result.trace if r["kind"] == "call"] == [
        "search_corpus", "grep_corpus"]

    heuristic = Episode("Corliss Archer trivia", retriever, HeuristicPolicy(),
                        settings.replace(search_mode="bm25"), acl_groups=["staff"]).run()
    assert "secret-memo#p0" not in heuristic.retrieved_ids
    assert all(r["args"] != {"ids": [], "reason": "injected"} for r in heuristic.trace
               if r["kind"] == "call")
    assert heuristic.termination == "finish" and heuristic.ranked_chunk_ids
    retriever.close()


def test_trace_exports_as_jsonl(hotpot_retriever, hotpot_settings, tmp_path):
    ep, _ = episode(hotpot_retriever, hotpot_settings, [
        [call("search_corpus", query="Ed Wood", k=2)], [call("finish", ids=[])]])
    ep.run()
    path = tmp_path / "trace.jsonl"
    ep.trace.export(path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["start", "call", "turn", "finish", "call", "turn", "end"]
    assert [r["seq"] for r in rows] == list(range(7))


def test_invalid_actions_are_counted_shown_and_end_the_episode_in_a_row(hotpot_retriever,
                                                                        hotpot_settings):
    from branchsearch.workers.policy import InvalidAction

    ep, policy = episode(hotpot_retriever, hotpot_settings, [
        InvalidAction("not JSON (Expecting value at 0)"),
        [call("search_corpus", query="Ed Wood", k=2)],
        InvalidAction("output cut at max_tokens"), InvalidAction("again"),
        InvalidAction("and again"), [call("finish", ids=[])],
    ], no_progress_turns=10)
    result = ep.run()
    assert policy.views[1].last_error == "not JSON (Expecting value at 0)"
    assert policy.views[1].last_results == [] and policy.views[2].last_error == ""
    assert result.invalid_actions == 4 and result.termination == "policy_error"
    assert "3 invalid actions in a row: and again" in result.detail
    assert [r["message"] for r in result.trace if r["kind"] == "invalid_action"] == [
        "not JSON (Expecting value at 0)", "output cut at max_tokens", "again", "and again"]
    assert {r["tool"] for r in result.trace if r["kind"] == "call"} == {"search_corpus"}


def test_an_llm_engine_down_ends_the_branch_with_error(hotpot_retriever, hotpot_settings):
    from branchsearch.infra.errors import BackendUnavailable
    from branchsearch.workers.branch import BranchTask, run_branch

    def down(view):
        raise BackendUnavailable("llm endpoint http://127.0.0.1:9 is not reachable")

    report = run_branch(BranchTask(0, Q), hotpot_retriever, hotpot_settings,
                        policy_factory=lambda i, q: ScriptedPolicy([
                            [call("search_corpus", query="Corliss Archer", k=2)], down]))
    assert report.status == "error" and "not reachable" in report.error
    assert report.termination == "backend_error" and report.turns == 2
    assert report.episode.retrieved_ids  # what it did before is still in the report


def test_read_document_checks_the_callers_groups_before_the_fetch(tmp_path):
    from conftest import FIXTURES, HOTPOT
    from branchsearch.infra.errors import BadQuery
    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.infra.index.open import open_retriever
    from branchsearch.infra.config.settings import load_settings

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text((HOTPOT / "corpus.jsonl").read_text()
                      + (FIXTURES / "injection.jsonl").read_text())
    settings = load_settings(overrides={"home": tmp_path / "h", "search_mode": "bm25"},
                             read_env=False, read_file=False)
    ingest(corpus, settings, dense=False)
    retriever = open_retriever(settings, need_dense=False)
    try:
        assert retriever.read_document("secret-memo", acl_groups=["finance"])["chunks"]
        for groups in (None, ["staff"]):
            with pytest.raises(BadQuery, match="unknown document id 'secret-memo'"):
                retriever.read_document("secret-memo", acl_groups=groups)
        ep, policy = episode(retriever, settings, [
            [call("read_document", doc_id="secret-memo"), call("read_document", doc_id="ed-wood")],
            [call("finish", ids=[])]])
        ep.acl_groups = ep.ws.acl_groups = ["staff"]
        ep.run()
        hidden, public = policy.views[1].last_results
        assert not hidden.ok and "unknown document id 'secret-memo'" in hidden.content
        assert public.ok and public.ids[0].startswith("ed-wood#")
    finally:
        retriever.close()


def test_a_branch_whose_every_retrieval_fails_is_an_error_not_an_empty_ok(tmp_path):
    """A store that breaks in a way that is not 'the backend is down' (here the docstore's
    SQLite file closed under the retriever): every search_corpus fails, and the branch must
    say so, not finish 'ok' with no evidence. One failure among answers stays an observation."""
    from conftest import HOTPOT

    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.infra.index.open import open_retriever
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.workers.branch import BranchTask, run_branch

    settings = load_settings(overrides={"home": str(tmp_path), "index": "lex",
                                        "search_mode": "bm25"}, read_env=False, read_file=False)
    ingest(HOTPOT, settings, dense=False)
    retriever = open_retriever(settings, need_dense=False)
    try:
        ok = run_branch(BranchTask(0, Q), retriever, settings)
        assert ok.status == "ok" and ok.episode.ranked_chunk_ids
        mixed = run_branch(BranchTask(0, Q), retriever, settings,
                           policy_factory=lambda i, q: ScriptedPolicy([
                               [call("search_corpus", query="Corliss Archer", k=2),
                                call("search_corpus", query="x", mode="nonsense")]]))
        assert mixed.status == "ok"  # a bad call among good ones is the policy's to read
        retriever.docstore.close()
        broken = run_branch(BranchTask(0, Q), retriever, settings)
        # one of its searches ('Arthur') has no hit, so it never reaches the broken docstore:
        # an empty answer is no proof that retrieval works
        some_empty = run_branch(BranchTask(0, "Which magazine was started first, Arthur's "
                                               "Magazine or First for Women?"),
                                retriever, settings)
    finally:
        retriever.close()
    for report in (broken, some_empty):
        assert report.status == "error" and report.termination == "backend_error"
        assert "every retrieval failed" in report.error and "search_corpus" in report.error
        assert not report.episode.ranked_chunk_ids
        end = [r for r in report.episode.trace if r["kind"] == "end"][-1]
        assert end["reason"] == "backend_error"  # the trace tells the same ending
    assert any(r["kind"] == "call" and r["ok"] for r in some_empty.episode.trace)
