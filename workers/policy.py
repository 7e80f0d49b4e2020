"""The seam between the harness and whatever decides: the agent's view, tool calls, results.

A policy is anything with `decide(view) -> list[ToolCall]` and `query_state() -> dict`.
Implementations (heuristic, LLM, the scripted one in tests) never inherit from each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class ToolCall:
    name: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class ToolResult:
    """What a tool call produced. `content` is what a model reads; `ids` the chunk ids it added
    (search, grep, read, recall), pruned (prune) or ranked (finish)."""

    call: ToolCall
    ok: bool
    content: str
    ids: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class VisibleChunk:
    id: str
    doc_id: str
    title: str
    text: str  # as shown: snippet cut to the per-result cap
    tokens: int


@dataclass(frozen=True)
class AgentView:
    """Everything a policy may see at the start of a turn."""

    subquery: str
    turn: int
    visible: list[VisibleChunk]
    usage_line: str
    used_tokens: int
    budget_tokens: int
    allowed_tools: list[str]
    last_results: list[ToolResult]
    reminder: str = ""
    tool_schemas: list[dict] = field(default_factory=list)


class Policy(Protocol):
    def decide(self, view: AgentView) -> list[ToolCall]:
        """The tool calls for this turn (several allowed; they run concurrently)."""

    def query_state(self) -> dict:
        """What the policy is looking for now (recorded in the trace and on prune spans)."""
