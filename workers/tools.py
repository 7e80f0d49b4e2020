"""The branch agent's tools: a JSON schema beside each, a fetch step and an apply step.

`fetch(ep, args)` describes the retriever request `(method, args, kwargs)` and touches no
episode state, so the harness runs the requests of one turn together (concurrently, or as one
round trip to a remote retriever); `apply(ep, args, fetched)` gets the value, or the exception
the request raised, changes the stores and runs in call order.
Tools return a `ToolResult`; a rule they enforce is an `Rejected` with the message to show.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from branchsearch.workers.policy import ToolCall, ToolResult

if TYPE_CHECKING:
    from branchsearch.workers.harness import Episode


class Rejected(Exception):
    """A call the harness refuses; the message becomes the error observation."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict
    apply: Callable[["Episode", dict, Any], ToolResult]
    fetch: Callable[["Episode", dict], tuple] | None = None

    @property
    def schema(self) -> dict:
        return {"name": self.name, "description": self.description,
                "parameters": self.parameters}


def _obj(properties: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": properties, "required": required,
            "additionalProperties": False}


_IDS = {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 200}
_FROM = {"type": "array", "items": {"type": "string"}, "maxItems": 20,
         "description": "chunk ids whose content led to this call (provenance)"}


# --- search_corpus / grep_corpus -------------------------------------------------------------

def _fetch_search(ep: "Episode", args: dict) -> tuple:
    return ("search", (args["query"],), {
        "mode": args.get("mode", ep.settings.search_mode), "k": args.get("k", ep.settings.search_k),
        "exclude_ids": ep.cache.ids(), "acl_groups": ep.acl_groups})


def _fetch_grep(ep: "Episode", args: dict) -> tuple:
    return ("grep", (args["pattern"],), {"k": args.get("k", ep.settings.search_k),
                                         "exclude_ids": ep.cache.ids(),
                                         "acl_groups": ep.acl_groups})


def _apply_hits(ep: "Episode", args: dict, hits, tool: str, query: str) -> ToolResult:
    call = ToolCall(tool, args)
    if isinstance(hits, Exception):  # BadQuery (e.g. an invalid regex) or a backend failure
        raise Rejected(str(hits))
    parents = ep.known_parents(args.get("from_ids", []))
    added = ep.add_hits(hits, tool=tool, query=query, parents=parents)
    if not added:
        return ToolResult(call, True, "No new results.")
    return ToolResult(call, True, ep.render_chunks(added), added)


def _apply_search(ep, args, hits):
    return _apply_hits(ep, args, hits, "search_corpus", args["query"])


def _apply_grep(ep, args, hits):
    return _apply_hits(ep, args, hits, "grep_corpus", args["pattern"])


# --- read_document ---------------------------------------------------------------------------

def _fetch_read(ep: "Episode", args: dict) -> tuple:
    start = args.get("start", 0)
    return ("read_document", (args["doc_id"], start, start + args.get("count", 3)), {})


def _apply_read(ep: "Episode", args: dict, doc) -> ToolResult:
    if isinstance(doc, Exception):
        raise Rejected(str(doc))
    from branchsearch.infra.backends import acl_visible

    if not acl_visible(doc["acl"], ep.acl_groups):
        raise Rejected(f"unknown document id {args['doc_id']!r}")  # never reveal ACL'd docs
    from branchsearch.infra.hits import Hit

    hits = [Hit(c["chunk_id"], doc["doc_id"], 0.0, i + 1, "read", c["text"], doc["title"])
            for i, c in enumerate(doc["chunks"])]
    added = ep.add_hits(hits, tool="read_document", query=args["doc_id"],
                        parents=ep.known_parents(args.get("from_ids", [])),
                        cap=ep.settings.read_window_tokens, allow_cached=True)
    if not added:
        return ToolResult(ToolCall("read_document", args), True, "No new chunks in that window.")
    return ToolResult(ToolCall("read_document", args), True, ep.render_chunks(added), added)


# --- prune / recall / finish -----------------------------------------------------------------

def _apply_prune(ep: "Episode", args: dict, _=None) -> ToolResult:
    return ep.prune(args["ids"], args["reason"])


def _apply_recall(ep: "Episode", args: dict, _=None) -> ToolResult:
    return ep.recall(args["ids"])


def _apply_finish(ep: "Episode", args: dict, _=None) -> ToolResult:
    return ep.finish(args["ids"], args.get("reason", ""))


TOOLS: dict[str, Tool] = {t.name: t for t in [
    Tool("search_corpus",
         "Hybrid BM25 + dense search. Returns only chunks not seen before in this episode.",
         _obj({"query": {"type": "string", "minLength": 1, "maxLength": 500},
               "k": {"type": "integer", "minimum": 1, "maximum": 20},
               "mode": {"enum": ["hybrid", "bm25", "dense"]}, "from_ids": _FROM}, ["query"]),
         _apply_search, _fetch_search),
    Tool("grep_corpus",
         "Chunks containing a term that matches a regex (whole lower-cased terms, e.g. "
         "'acme.*', '19[0-9]{2}'). Returns only chunks not seen before.",
         _obj({"pattern": {"type": "string", "minLength": 1, "maxLength": 200},
               "k": {"type": "integer", "minimum": 1, "maximum": 20}, "from_ids": _FROM},
              ["pattern"]),
         _apply_grep, _fetch_grep),
    Tool("read_document", "Read a window of chunks of one document by id; chunks already "
                          "visible as snippets are shown in full.",
         _obj({"doc_id": {"type": "string", "minLength": 1},
               "start": {"type": "integer", "minimum": 0},
               "count": {"type": "integer", "minimum": 1, "maximum": 10}, "from_ids": _FROM},
              ["doc_id"]),
         _apply_read, _fetch_read),
    Tool("prune_chunks", "Remove chunks from the visible context by id (they stay recallable).",
         _obj({"ids": _IDS, "reason": {"type": "string", "minLength": 1, "maxLength": 500}},
              ["ids", "reason"]),
         _apply_prune),
    Tool("recall_chunks", "Bring pruned chunks back into the context by id, without a search.",
         _obj({"ids": _IDS}, ["ids"]), _apply_recall),
    Tool("finish", "Stop and return the supporting chunk ids, best first.",
         _obj({"ids": {**_IDS, "minItems": 0}, "reason": {"type": "string", "maxLength": 500}},
              ["ids"]),
         _apply_finish),
]}


def validate_args(call: ToolCall) -> None:
    """Raise Rejected with a readable message if the call does not fit its tool's schema."""
    if call.name == "invalid_action":  # a model output that did not parse (see llm_policy)
        raise Rejected(f"invalid action: {call.args.get('error', 'unparseable output')}")
    tool = TOOLS.get(call.name)
    if tool is None:
        raise Rejected(f"unknown tool {call.name!r}; tools: {', '.join(TOOLS)}")
    if not isinstance(call.args, dict):
        raise Rejected(f"{call.name}: arguments must be a JSON object")
    import jsonschema

    errors = sorted(jsonschema.Draft7Validator(tool.parameters).iter_errors(call.args),
                    key=lambda e: list(e.path))
    if errors:
        where = "/".join(str(p) for p in errors[0].path) or "arguments"
        raise Rejected(f"{call.name}: invalid {where}: {errors[0].message}")
