"""A deterministic scripted policy: replays fixed turns of tool calls (tests only)."""

from __future__ import annotations

from collections.abc import Callable

from workers.policy import AgentView, ToolCall


class ScriptedPolicy:
    """Each turn is a list of ToolCalls, or a function of the view returning one."""

    def __init__(self, turns: list[list[ToolCall] | Callable[[AgentView], list[ToolCall]]]):
        self.turns = list(turns)
        self.views: list[AgentView] = []

    def decide(self, view: AgentView) -> list[ToolCall]:
        self.views.append(view)
        if not self.turns:
            return []
        turn = self.turns.pop(0)
        return turn(view) if callable(turn) else turn

    def query_state(self) -> dict:
        return {"scripted_turns_left": len(self.turns)}


def call(name: str, **args) -> ToolCall:
    return ToolCall(name, args)
