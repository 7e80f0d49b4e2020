"""What each span is: its role after the OpenTelemetry GenAI semantic conventions and its
OpenInference span kind (`ROLES` is the one place that knows this), and its input/output
attributes.
"""

from __future__ import annotations

import json

from opentelemetry.sdk.trace import ReadableSpan


KIND = "openinference.span.kind"


OPERATION = "gen_ai.operation.name"


AGENT_NAME = "branchsearch.branch"


RETRIEVAL_TOOLS = frozenset({"search_corpus", "grep_corpus", "read_document"})


ROLES: dict[str, dict[str, str]] = {
    "query": {KIND: "CHAIN", OPERATION: "invoke_workflow", "gen_ai.workflow.name": "branchsearch"},
    "plan": {KIND: "CHAIN", OPERATION: "plan"},
    "branch": {KIND: "AGENT", OPERATION: "invoke_agent", "gen_ai.agent.name": AGENT_NAME},
    "episode": {KIND: "CHAIN"},  # the agent's loop inside its branch
    "turn": {KIND: "CHAIN"},
    "prune": {KIND: "CHAIN"},  # validation and application of a proposed prune
    "chat": {KIND: "LLM", OPERATION: "chat"},
    "llm": {KIND: "LLM", OPERATION: "chat"},
}


def span_role(name: str) -> dict[str, str]:
    """Attributes naming what a span of this name is (set when the span starts)."""
    if name.startswith("tool "):
        tool = name[5:]
        retrieval = tool in RETRIEVAL_TOOLS
        return {KIND: "RETRIEVER" if retrieval else "TOOL", OPERATION: "execute_tool",
                "gen_ai.tool.name": tool, "gen_ai.tool.type": "datastore" if retrieval
                else "function", "tool.name": tool}
    head = name.split(" ", 1)[0]
    return ROLES.get(name) or (ROLES[head] if head in ("chat", "llm") else {})


def span_io(name: str, attrs) -> dict:
    """Input/output values derived from a finished span's own attributes (OpenInference
    `input.value`/`output.value`, GenAI tool-call arguments and result, retrieved document ids)."""
    out: dict = {}
    if name == "query" and "question" in attrs:
        out["input.value"] = attrs["question"]
    elif name == "plan" and "subqueries" in attrs:
        out |= _json_value("output", list(attrs["subqueries"]))
    elif name == "branch":
        if "branch.subquery" in attrs:
            out["input.value"] = attrs["branch.subquery"]
        if "branch.index" in attrs:
            out["gen_ai.agent.id"] = f"branch-{attrs['branch.index']}"
    elif name == "episode":
        if "subquery" in attrs:
            out["input.value"] = attrs["subquery"]
        if "termination" in attrs:
            out["output.value"] = str(attrs["termination"])
    elif name.startswith("tool "):
        if "args" in attrs:
            out |= {"input.value": attrs["args"], "input.mime_type": "application/json",
                    "gen_ai.tool.call.arguments": attrs["args"]}
        ids = list(attrs.get("ids", ()))
        result = attrs["error"] if "error" in attrs else json.dumps(ids)
        out |= {"output.value": result, "gen_ai.tool.call.result": result}
        if name[5:] in RETRIEVAL_TOOLS:
            out |= {f"retrieval.documents.{i}.document.id": cid for i, cid in enumerate(ids[:50])}
    elif name == "prune":
        if "prune.reason" in attrs:
            out["input.value"] = attrs["prune.reason"]
        if "prune.applied_ids" in attrs:
            out |= _json_value("output", list(attrs["prune.applied_ids"]))
    return {k: v for k, v in out.items() if k not in attrs}


def _json_value(kind: str, value) -> dict:
    return {f"{kind}.value": json.dumps(value), f"{kind}.mime_type": "application/json"}


def with_io(span: ReadableSpan) -> ReadableSpan:
    """The span with `span_io` added (a copy; finished SDK spans are read-only)."""
    attrs = span.attributes or {}
    extra = span_io(span.name, attrs)
    if not extra:
        return span
    return ReadableSpan(
        name=span.name, context=span.context, parent=span.parent, resource=span.resource,
        attributes={**attrs, **extra}, events=span.events, links=span.links, kind=span.kind,
        status=span.status, start_time=span.start_time, end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope)
