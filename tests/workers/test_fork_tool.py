"""The `fork` tool (workers/tools.py) through the harness, driven by a scripted policy on the
hotpot-mini fixture (tantivy + Milvus Lite + docstore): a valid call records a candidate in the
heuristic's shape; invalid calls are rejected with a clear observation; the tool is offered
only when the question forks, and the LLM policy's prompt is unchanged when it is not."""

from dataclasses import replace

from branchsearch.orchestrator.forks import choose, fork_tasks
from branchsearch.workers.branch import BranchReport, BranchTask, run_branch
from branchsearch.workers.harness import Episode
from branchsearch.workers.llm_policy import FORK_RULE, SYSTEM, action_schema, render
from branchsearch.workers.scripted import ScriptedPolicy, call
from branchsearch.workers.tools import fork_cap

Q = "What government position was held by the woman who portrayed Corliss Archer in the film Kiss and Tell?"
HEURISTIC_KEYS = {"chunk_id", "gap", "score", "keep_line", "reason", "hop_room", "title"}


def run(retriever, settings, turns, **episode):
    policy = ScriptedPolicy(turns)
    return Episode(Q, retriever, policy, settings, **episode).run(), policy


def search_then(*turns):
    return [[call("search_corpus", query="Corliss Archer", k=5)], *turns,
            [call("finish", ids=[])]]


def ids_of(policy, turn=1):
    return policy.views[turn].last_results[0].ids


def seen(view):
    """The chunk ids in the context (the search's five, in their order)."""
    return [c.id for c in view.visible]


def test_a_fork_call_becomes_a_candidate_the_driver_takes(hotpot_retriever, hotpot_settings):
    settings = hotpot_settings.replace(forks=2)
    result, policy = run(hotpot_retriever, settings, search_then(
        lambda v: [call("fork", chunk_ids=seen(v)[1:3], reason="a second Archer film"),
                   call("prune_chunks", ids=seen(v)[1:3], reason="not the likelier")],
    ), fork_cap=fork_cap(settings))
    assert "fork" in policy.views[0].allowed_tools
    assert "fork" in [s["name"] for s in policy.views[0].tool_schemas]
    forked, pruned = policy.views[2].last_results
    handed = ids_of(policy)[1:3]
    assert forked.ok and forked.ids == handed and "Fork recorded" in forked.content
    assert "1 fork(s) left" in forked.content and pruned.ok
    (candidate,) = result.fork_candidates
    assert HEURISTIC_KEYS <= set(candidate)  # the heuristic's shape, so the driver's wave applies
    assert candidate["chunk_id"] == handed[0] and candidate["chunk_ids"] == handed
    assert candidate["reason"] == "model: a second Archer film" and candidate["by"] == "model"
    assert [r for r in result.trace if r["kind"] == "fork"][0]["chunk_ids"] == handed
    # the second wave takes it unchanged: one fork, seeded with every chunk handed over
    parent = BranchReport(0, Q, episode=result)
    (task,) = fork_tasks([parent], settings.forks)
    assert task.kind == "fork" and task.parent == 0 and task.seeds == tuple(handed)
    assert task.reason == "model: a second Archer film"  # no gap: the model has no score
    assert choose([parent], 0) == []  # the question's budget still bounds it


def test_invalid_fork_calls_are_rejected_with_a_clear_observation(hotpot_retriever,
                                                                  hotpot_settings):
    settings = hotpot_settings.replace(forks=1)
    result, policy = run(hotpot_retriever, settings, search_then(
        lambda v: [call("fork", chunk_ids=["no-such-doc#p0"], reason="made up"),
                   call("fork", chunk_ids=seen(v)[:4], reason="too many"),
                   call("fork", chunk_ids=seen(v)[:1], reason="first"),
                   call("fork", chunk_ids=seen(v)[1:2], reason="over the cap")],
    ), fork_cap=fork_cap(settings))
    unknown, schema, first, over = policy.views[2].last_results
    assert not unknown.ok and unknown.content == (
        "Error: fork rejected: unknown chunk id(s) no-such-doc#p0; hand over only chunks this "
        "branch has seen")
    assert not schema.ok and schema.content.startswith("Error: fork: invalid chunk_ids")
    assert first.ok and not over.ok
    assert over.content == "Error: fork rejected: this branch already handed over 1 fork(s), its cap"
    assert "fork" not in policy.views[2].allowed_tools  # the cap reached: no longer offered
    assert [c["reason"] for c in result.fork_candidates] == ["model: first"]
    rejected = [r for r in result.trace if r["kind"] == "call" and r["tool"] == "fork"
                and not r["ok"]]
    assert len(rejected) == 3  # every rejection is in the trace


def test_a_chunk_is_handed_over_once(hotpot_retriever, hotpot_settings):
    settings = hotpot_settings.replace(forks=2)
    result, policy = run(hotpot_retriever, settings, search_then(
        lambda v: [call("fork", chunk_ids=seen(v)[:2], reason="one"),
                   call("fork", chunk_ids=seen(v)[1:3], reason="two")],
    ), fork_cap=fork_cap(settings))
    again = policy.views[2].last_results[1]
    assert not again.ok and again.content == (
        f"Error: fork rejected: already handed to a fork: {ids_of(policy)[1]}")
    assert len(result.fork_candidates) == 1


def test_a_fork_may_not_fork(hotpot_retriever, hotpot_settings):
    settings = hotpot_settings.replace(forks=2)
    result, policy = run(hotpot_retriever, settings, search_then(
        lambda v: [call("fork", chunk_ids=seen(v)[:1], reason="deeper")],
    ), fork_cap=fork_cap(settings), is_fork=True)
    assert "fork" not in policy.views[0].allowed_tools
    rejected = policy.views[2].last_results[0]
    assert not rejected.ok and rejected.content == (
        "Error: fork rejected: this branch is itself a fork, and a fork may not fork (depth 1)")
    assert result.fork_candidates == []


def views_of(retriever, settings, task):
    policy = ScriptedPolicy([[call("search_corpus", query="Corliss Archer", k=3)],
                             [call("finish", ids=[])]])
    report = run_branch(task, retriever, settings, policy_factory=lambda i, q: policy)
    assert report.status == "ok"
    return policy.views


def test_the_tool_is_offered_only_when_the_question_forks(hotpot_retriever, hotpot_settings):
    on = hotpot_settings.replace(forks=2)
    offered = views_of(hotpot_retriever, on, BranchTask(0, Q, may_fork=True))
    assert "fork" in offered[0].allowed_tools
    for settings, task in [
            (hotpot_settings.replace(forks=0), BranchTask(0, Q, may_fork=True)),  # forks off
            (on, BranchTask(0, Q)),  # one branch: the driver does not mark it may_fork
            (on, BranchTask(3, Q, kind="fork", parent=0, seeds=("ed-wood#p0",),
                            may_fork=True))]:  # a fork
        for view in views_of(hotpot_retriever, settings, task):
            assert "fork" not in view.allowed_tools
            assert "fork" not in [s["name"] for s in view.tool_schemas]
            # what the LLM policy would be given: no fork tool, rule or schema option
            system, user = (m["content"] for m in render(view))
            assert "fork" not in system + user
            assert FORK_RULE not in system
            assert "fork" not in str(action_schema(view.tool_schemas))


def test_the_fork_rule_is_shown_only_with_the_tool(hotpot_retriever, hotpot_settings):
    on = hotpot_settings.replace(forks=2)
    view = views_of(hotpot_retriever, on, BranchTask(0, Q, may_fork=True))[1]
    system, user = (m["content"] for m in render(view))
    assert FORK_RULE in system and "- fork: hand 1-3 chunk ids" in user
    baseline = replace(view, allowed_tools=[n for n in view.allowed_tools if n != "fork"],
                       tool_schemas=[t for t in view.tool_schemas if t["name"] != "fork"])
    base_system, base_user = (m["content"] for m in render(baseline))
    assert system == base_system.replace("\n- Text inside", f"\n{FORK_RULE}\n- Text inside")
    assert base_system.startswith(SYSTEM.split("{max_calls}")[0])  # the baseline's rules
    assert user.replace("\n- fork: hand 1-3 chunk ids of a competing hypothesis to a new "
                        "branch, with a reason args: chunk_ids, reason", "") == base_user
    option = next(o for o in action_schema(view.tool_schemas)["properties"]["calls"]["items"]
                  ["anyOf"] if o["properties"]["tool"]["const"] == "fork")
    assert option["properties"]["args"]["properties"]["chunk_ids"]["maxItems"] == 3


class Replay:
    """A chat engine that answers with fixed outputs (a string, or a function of the messages)
    and keeps what it was shown: the LLM policy's own rendering and parsing run, the model's
    judgement does not (SmolLM2 is too slow to drive these turns here)."""

    def __init__(self, answers):
        self.answers, self.shown, self.schemas = list(answers), [], []

    def chat(self, messages, schema=None, max_tokens=256, temperature=0.0):
        self.shown.append(messages)
        self.schemas.append(schema)
        answer = self.answers.pop(0)
        return answer(messages) if callable(answer) else answer


def shown_ids(messages) -> list[str]:
    import re

    return re.findall(r'<chunk id="([^"]+)"', messages[1]["content"])


SEARCH = '{"calls": [{"tool": "search_corpus", "args": {"query": "Corliss Archer"}}]}'
FINISH = '{"calls": [{"tool": "finish", "args": {"ids": []}}]}'


def fork_answer(messages) -> str:
    import json

    return json.dumps({"calls": [{"tool": "fork", "args": {
        "chunk_ids": shown_ids(messages)[1:3], "reason": "another Archer page"}}]})


def test_the_llm_policy_forks_through_the_tool(hotpot_retriever, hotpot_settings):
    from branchsearch.workers.llm_policy import LLMPolicy

    settings = hotpot_settings.replace(forks=2)
    engine = Replay([SEARCH, fork_answer, FINISH])
    result = Episode(Q, hotpot_retriever, LLMPolicy(engine), settings,
                     fork_cap=fork_cap(settings)).run()
    assert result.termination == "finish" and result.invalid_actions == 0
    assert FORK_RULE in engine.shown[0][0]["content"]
    (candidate,) = result.fork_candidates
    assert candidate["chunk_ids"] == shown_ids(engine.shown[1])[1:3]
    assert candidate["reason"] == "model: another Archer page"


def test_the_llm_policy_without_forks_cannot_fork(hotpot_retriever, hotpot_settings):
    from branchsearch.workers.llm_policy import LLMPolicy

    fork = '{"calls": [{"tool": "fork", "args": {"chunk_ids": ["ed-wood#p0"], "reason": "x"}}]}'
    engine = Replay([SEARCH, fork, FINISH])
    result = Episode(Q, hotpot_retriever, LLMPolicy(engine), hotpot_settings).run()
    assert all(FORK_RULE not in m[0]["content"] for m in engine.shown)
    assert all("fork" not in str(s) for s in engine.schemas)
    # a model that calls it anyway: an invalid action, shown to it next turn
    assert result.invalid_actions == 1 and result.fork_candidates == []
    assert ("your last answer was not a valid action: tool 'fork' is not allowed now"
            in engine.shown[2][1]["content"])


def test_an_llm_fork_starts_from_its_seeds(hotpot_retriever, hotpot_settings):
    from branchsearch.workers.llm_policy import LLMPolicy

    engine = Replay([FINISH])
    policy = LLMPolicy(engine)
    policy.start_from(["janet-waldo#p0", "meet-corliss-archer#p0"])
    result = Episode(Q, hotpot_retriever, policy, hotpot_settings.replace(forks=2),
                     fork_cap=0, is_fork=True).run()
    assert len(engine.shown) == 1  # the first turn read the seeds without asking the model
    assert {"janet-waldo#p0", "meet-corliss-archer#p0"} <= set(result.retrieved_ids)
    user = engine.shown[0][1]["content"]
    assert ("You pursue an alternative another branch set aside, starting from chunks "
            "janet-waldo#p0, meet-corliss-archer#p0.") in user
    assert set(shown_ids(engine.shown[0])) >= {"janet-waldo#p0", "meet-corliss-archer#p0"}
    assert "fork" not in str(engine.schemas[0])
