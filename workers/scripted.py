"""Policies for testing the loop without a model (as OpenTelemetry ships an in-memory exporter).

`ScriptedPolicy` replays fixed turns of tool calls, deterministically; `RaisingPolicy` and
`SlowPolicy` are a crashed and a late branch; `faulty_factory` mixes them for driver tests;
`BusyPolicy` is a branch that keeps a CPU busy until its limits end it.
"""

from __future__ import annotations

from collections.abc import Callable

from branchsearch.workers.policy import AgentView, InvalidAction, ToolCall


class ScriptedPolicy:
    """Each turn is a list of ToolCalls, or a function of the view returning one; a turn that
    is an `InvalidAction` instance is raised (an output that did not parse)."""

    def __init__(self, turns: list[list[ToolCall] | Callable[[AgentView], list[ToolCall]]]):
        self.turns = list(turns)
        self.views: list[AgentView] = []
        self.seeds: list[str] = []

    def start_from(self, seeds: list[str], hop_room: int = 1) -> None:
        """A fork: the first turn reads the handed-over chunks (as the LLM policy's does),
        then the script runs."""
        from branchsearch.workers.tools import seed_reads

        self.seeds = list(seeds)
        self.turns.insert(0, seed_reads(self.seeds))

    def decide(self, view: AgentView) -> list[ToolCall]:
        self.views.append(view)
        if not self.turns:
            return []
        turn = self.turns.pop(0)
        if isinstance(turn, InvalidAction):
            raise turn
        return turn(view) if callable(turn) else turn

    def query_state(self) -> dict:
        return {"scripted_turns_left": len(self.turns)}


def call(name: str, **args) -> ToolCall:
    return ToolCall(name, args)


class RaisingPolicy:
    """Fails on the first decision (a crashed branch)."""

    def decide(self, view):
        raise RuntimeError("branch exploded on purpose")

    def query_state(self) -> dict:
        return {}


class SlowPolicy:
    """Sleeps through its deadline (a late branch)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def decide(self, view):
        import time

        time.sleep(self.seconds)
        return [ToolCall("finish", {"ids": []})]

    def query_state(self) -> dict:
        return {}


class BusyPolicy:
    """Works `turn_s` seconds of CPU a turn and never finishes: a long branch that only its
    limits end (`max_turns`, `no_progress_turns`, its deadline, its search called off)."""

    def __init__(self, turn_s: float):
        self.turn_s = turn_s

    def decide(self, view):
        import time

        end = time.perf_counter() + self.turn_s
        while time.perf_counter() < end:
            pass
        return []

    def query_state(self) -> dict:
        return {}


def busy_factory(index: int, subquery: str):
    """Every branch a `BusyPolicy` of 20 ms a turn (a factory Ray actors can import)."""
    return BusyPolicy(0.02)


def faulty_factory(index: int, subquery: str):
    """Branch 1 cannot even build its policy, branch 2 is too slow, the rest are heuristic."""
    from branchsearch.workers.heuristic import HeuristicPolicy

    if index == 1:
        raise ValueError("no policy for branch 1")
    if index == 2:
        return SlowPolicy(30)
    return HeuristicPolicy()
