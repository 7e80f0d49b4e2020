"""The seam between the harness and whatever decides: the agent's view, tool calls, results.

A policy is anything with `decide(view) -> list[ToolCall]` and `query_state() -> dict`; output
that is no valid action raises `InvalidAction`. Implementations (heuristic, LLM, the scripted one
in `workers.scripted`) never inherit from each other.
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
    last_error: str = ""  # why the policy's last output was not a valid action


class InvalidAction(Exception):
    """Raised by a policy whose output is not a valid action (unparseable, cut at max_tokens,
    a tool not allowed now). The harness counts it, records it in the trace and shows the message
    to the policy next turn (`AgentView.last_error`); several in a row end the episode."""


class Policy(Protocol):
    def decide(self, view: AgentView) -> list[ToolCall]:
        """The tool calls for this turn (several allowed; they run concurrently)."""

    def query_state(self) -> dict:
        """What the policy is looking for now (recorded in the trace and on prune spans)."""

    # optional: `rank(view) -> list[str]`, the ranking `finish` would return now, asked for when
    # the episode stops without `finish` (a limit or the deadline); without it, arrival order
