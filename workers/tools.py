"""The branch agent's tools: functions over a `Workspace`, a JSON schema beside each.

A tool has an `apply(ws, args, fetched) -> ToolResult` step that changes the workspace, and the
retrieving tools a `fetch(ws, args)` step before it that only *describes* the retriever request
`(method, args, kwargs)`, so the harness runs the requests of one turn together (concurrently,
or in one round trip to a remote retriever) and then applies the calls in order. A rule a tool
enforces is a `Rejected` with the message to show.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import lru_cache
from dataclasses import dataclass
from typing import Any

from branchsearch.infra.config.choices import MODES
from branchsearch.infra.nfc import nfc
from branchsearch.infra.stores.hits import Hit
from branchsearch.infra.telemetry import tracer
from branchsearch.workers.context import ProvenanceRecord
from branchsearch.workers.policy import ToolCall, ToolResult
from branchsearch.workers.workspace import Workspace

QUERY_MAX_CHARS = 500  # the search cap: a longer query is rejected (questions are cut to fit)
MAX_SEARCH_K = 20  # the most hits one search_corpus / grep_corpus call may ask for


class Rejected(Exception):
    """A call the harness refuses; the message becomes the error observation."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict
    apply: Callable[[Workspace, dict, Any], ToolResult]
    fetch: Callable[[Workspace, dict], tuple] | None = None

    @property
    def schema(self) -> dict:
        return {"name": self.name, "description": self.description,
                "parameters": self.parameters}


# --- search_corpus / grep_corpus / read_document: fetch, then show --------------------------

def fetch_search(ws: Workspace, args: dict) -> tuple:
    return ("search", (args["query"],), {
        "mode": args.get("mode", ws.settings.search_mode), "k": args.get("k", ws.settings.search_k),
        "exclude_ids": ws.cache.ids(), "acl_groups": ws.acl_groups,
        "named": args.get("named", False)})


def fetch_grep(ws: Workspace, args: dict) -> tuple:
    return ("grep", (args["pattern"],), {"k": args.get("k", ws.settings.search_k),
                                         "exclude_ids": ws.cache.ids(),
                                         "acl_groups": ws.acl_groups})


def fetch_read(ws: Workspace, args: dict) -> tuple:
    start = args.get("start", 0)  # the retriever checks the caller's groups before the fetch
    return ("read_document", (args["doc_id"], start, start + args.get("count", 3)),
            {"acl_groups": ws.acl_groups})


def _shown(ws: Workspace, call: ToolCall, hits: list[Hit], query: str, empty: str,
           **show) -> ToolResult:
    added = ws.show(hits, tool=call.name, query=query,
                    parents=ws.known(call.args.get("from_ids", [])), **show)
    ws.emit({"type": "search", "tool": call.name, "query": query, "new_ids": added})
    if not added:
        return ToolResult(call, True, empty)
    return ToolResult(call, True, ws.render(added), added)


def apply_search(ws: Workspace, args: dict, hits) -> ToolResult:
    if isinstance(hits, Exception):  # BadQuery, e.g. an unknown mode
        raise Rejected(str(hits))
    return _shown(ws, ToolCall("search_corpus", args), hits, args["query"], "No new results.")


def apply_grep(ws: Workspace, args: dict, hits) -> ToolResult:
    if isinstance(hits, Exception):  # BadQuery, e.g. an invalid regex
        raise Rejected(str(hits))
    return _shown(ws, ToolCall("grep_corpus", args), hits, args["pattern"], "No new results.")


def apply_read(ws: Workspace, args: dict, doc) -> ToolResult:
    if isinstance(doc, Exception):  # unknown, or not visible to the caller: the same message
        raise Rejected(str(doc))
    hits = [Hit(c["chunk_id"], doc["doc_id"], 0.0, i + 1, "read", c["text"], doc["title"],
                text_tokens=c.get("text_tokens"), label_tokens=c.get("label_tokens"),
                head=c.get("head")) for i, c in enumerate(doc["chunks"])]
    return _shown(ws, ToolCall("read_document", args), hits, args["doc_id"],
                  "No new chunks in that window.", cap=ws.settings.read_window_tokens,
                  allow_cached=True)


# --- prune_chunks / recall_chunks / finish --------------------------------------------------

def apply_prune(ws: Workspace, args: dict, _=None) -> ToolResult:
    """Three layers: the policy proposed `ids`; validate and apply here; record it all."""
    ids, reason = args["ids"], args["reason"]
    before = ws.used
    applied, rejected = [], {}
    for cid in dict.fromkeys(ids):
        if cid not in ws.cache:
            rejected[cid] = "unknown chunk id"
        elif cid not in ws.context:
            rejected[cid] = "not visible (already pruned)"
        else:
            applied.append(cid)
    if applied and len(applied) == len(ws.context):
        rejected[applied.pop()] = "last evidence in context"
    ws.context.remove(applied)
    ws.pruned += applied
    ws.progress |= bool(applied)
    after, state = ws.used, ws.query_state()
    ws.trace.record("prune", turn=ws.turn, proposed=list(ids), applied=applied,
                    rejected=rejected, reason=reason, tokens_before=before,
                    tokens_after=after, query_state=state)
    with tracer().start_as_current_span("prune") as span:
        span.set_attributes({
            "prune.proposed_ids": list(ids), "prune.applied_ids": applied,
            "prune.rejected_ids": list(rejected),
            "prune.rejected_reasons": json.dumps(rejected), "prune.reason": reason,
            "prune.tokens_before": before, "prune.tokens_after": after,
            "prune.query_state": json.dumps(state, default=str)[:4000]})
    ws.emit({"type": "prune", "ids": applied, "reason": reason, "tokens_before": before,
             "tokens_after": after})
    lines = [f"Pruned {len(applied)} chunk(s)."]
    lines += [f"Not pruned {cid}: {why}" for cid, why in rejected.items()]
    ok = bool(applied) or not rejected
    return ToolResult(ToolCall("prune_chunks", args), ok,
                      ("" if ok else "Error: ") + " ".join(lines), applied)


def apply_recall(ws: Workspace, args: dict, _=None) -> ToolResult:
    ids = args["ids"]
    restored, problems = [], []
    for cid in dict.fromkeys(ids):
        hit = ws.cache.get(cid)
        if hit is None:
            problems.append(f"{cid}: unknown chunk id")
            continue
        if cid in ws.context:
            problems.append(f"{cid}: already visible")
            continue
        chunk = ws.visible_chunk(hit, *ws.counter.cut(hit.text, ws.settings.result_token_cap)[:2])
        if chunk.tokens > ws.budget.room(ws.used):
            problems.append(f"{cid}: does not fit the budget {ws.budget.usage_line(ws.used)}")
            continue
        ws.context.add(chunk)
        ws.provenance.add(ProvenanceRecord(cid, ws.turn, "recall_chunks", "", 0, 0.0))
        restored.append(cid)
    ws.progress |= bool(restored)
    ws.trace.record("recall", turn=ws.turn, proposed=list(ids), applied=restored,
                    rejected=problems)
    if not restored:
        raise Rejected("nothing recalled: " + "; ".join(problems))
    text = ws.render(restored)
    if problems:
        text += "\nNot recalled: " + "; ".join(problems)
    return ToolResult(ToolCall("recall_chunks", args), True, text, restored)


def apply_finish(ws: Workspace, args: dict, _=None) -> ToolResult:
    ids, reason = args["ids"], args.get("reason", "")
    known = [cid for cid in dict.fromkeys(ids) if cid in ws.cache]
    unknown = [cid for cid in ids if cid not in ws.cache]
    ws.finish_ids = known
    ws.trace.record("finish", turn=ws.turn, ids=known, unknown=unknown, reason=reason)
    note = f" Ignored unknown ids: {', '.join(unknown)}." if unknown else ""
    return ToolResult(ToolCall("finish", args), True,
                      f"Finished with {len(known)} chunk(s).{note}", known)


# --- fork: hand a competing hypothesis to a branch of its own -------------------------------

FORKS_A_BRANCH = 4  # the most fork candidates one branch records (the heuristic's REPORTED)
FORK_SEEDS = 3  # the most chunks one fork is handed


def fork_cap(settings) -> int:
    """The fork candidates a first-wave branch may record with the `fork` tool: the question's
    fork budget (`settings.forks`), at most `FORKS_A_BRANCH`; 0: the tool is not offered."""
    return min(settings.forks, FORKS_A_BRANCH)


def seed_reads(seeds: list[str]) -> list[ToolCall]:
    """A fork's first turn: read each handed-over chunk (`doc#pN`) where it is."""
    calls = []
    for cid in seeds:
        doc, _, n = cid.rpartition("#p")
        calls.append(ToolCall("read_document", {"doc_id": doc, "start": int(n), "count": 1})
                     if doc and n.isdigit() else ToolCall("read_document", {"doc_id": cid}))
    return calls


def apply_fork(ws: Workspace, args: dict, _=None) -> ToolResult:
    """Record a fork candidate: chunks of this branch supporting a hypothesis it will not
    pursue itself. The driver's second wave (`orchestrator.forks`) runs the best candidates of
    a question as branches of their own, within the question's `forks` budget; the candidate
    has the heuristic's shape (`workers.heuristic.forks`), with `chunk_ids` for all it hands
    over and `by: model`. The model has no score, so its gap is 0: `fork_gap` does not apply."""
    if ws.is_fork:
        raise Rejected("fork rejected: this branch is itself a fork, and a fork may not fork "
                       "(depth 1)")
    if ws.fork_cap <= 0:
        raise Rejected("fork rejected: forks are off for this question (forks = 0 or one "
                       "branch)")
    if len(ws.forks) >= ws.fork_cap:
        raise Rejected(f"fork rejected: this branch already handed over {len(ws.forks)} "
                       f"fork(s), its cap")
    ids = list(dict.fromkeys(args["chunk_ids"]))
    unknown = [cid for cid in ids if cid not in ws.cache]
    if unknown:
        raise Rejected(f"fork rejected: unknown chunk id(s) {', '.join(unknown)}; hand over "
                       "only chunks this branch has seen")
    handed = {cid for f in ws.forks for cid in f["chunk_ids"]}
    again = [cid for cid in ids if cid in handed]
    if again:
        raise Rejected(f"fork rejected: already handed to a fork: {', '.join(again)}")
    reason = " ".join(args["reason"].split())
    first = ws.cache.get(ids[0])
    candidate = {"chunk_id": ids[0], "chunk_ids": ids, "gap": 0.0, "score": 0.0,
                 "keep_line": 0.0, "reason": f"model: {reason}", "hop_room": 1,
                 "title": first.title if first is not None else "", "by": "model",
                 "turn": ws.turn}
    ws.forks.append(candidate)
    ws.trace.record("fork", turn=ws.turn, chunk_ids=ids, reason=reason)
    left = ws.fork_cap - len(ws.forks)
    return ToolResult(ToolCall("fork", args), True,
                      f"Fork recorded: {', '.join(ids)} will be handed to a new branch when "
                      f"this one ends (if the question's fork budget allows). Keep your own "
                      f"choice here; {left} fork(s) left.", ids)


# --- the table -------------------------------------------------------------------------------

def _obj(properties: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": properties, "required": required,
            "additionalProperties": False}


_IDS = {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 200}
_FROM = {"type": "array", "items": {"type": "string"}, "maxItems": 20,
         "description": "chunk ids whose content led to this call (provenance)"}

TOOLS: dict[str, Tool] = {t.name: t for t in [
    Tool("search_corpus",
         "Hybrid BM25 + dense search. Returns only chunks not seen before in this episode.",
         _obj({"query": {"type": "string", "minLength": 1, "maxLength": QUERY_MAX_CHARS},
               "k": {"type": "integer", "minimum": 1, "maximum": MAX_SEARCH_K},
               "mode": {"enum": ["hybrid", *(m for m in MODES if m != "hybrid")]},
               "named": {"type": "boolean", "description": "the query is a name: the pages "
                         "titled with it come first"},
               "from_ids": _FROM}, ["query"]),
         apply_search, fetch_search),
    Tool("grep_corpus",
         "Chunks containing a term that matches a regex (whole lower-cased terms, e.g. "
         "'acme.*', '19[0-9]{2}'). Returns only chunks not seen before.",
         _obj({"pattern": {"type": "string", "minLength": 1, "maxLength": 200},
               "k": {"type": "integer", "minimum": 1, "maximum": MAX_SEARCH_K}, "from_ids": _FROM},
              ["pattern"]),
         apply_grep, fetch_grep),
    Tool("read_document", "Read a window of chunks of one document by id; chunks already "
                          "visible as snippets are shown in full.",
         _obj({"doc_id": {"type": "string", "minLength": 1},
               "start": {"type": "integer", "minimum": 0},
               "count": {"type": "integer", "minimum": 1, "maximum": 10}, "from_ids": _FROM},
              ["doc_id"]),
         apply_read, fetch_read),
    Tool("prune_chunks", "Remove chunks from the visible context by id (they stay recallable).",
         _obj({"ids": _IDS, "reason": {"type": "string", "minLength": 1, "maxLength": 500}},
              ["ids", "reason"]),
         apply_prune),
    Tool("recall_chunks", "Bring pruned chunks back into the context by id, without a search.",
         _obj({"ids": _IDS}, ["ids"]), apply_recall),
    Tool("finish", "Stop and return the supporting chunk ids, best first.",
         _obj({"ids": {**_IDS, "minItems": 0}, "reason": {"type": "string", "maxLength": 500}},
              ["ids"]),
         apply_finish),
    Tool("fork", "Hand 1-3 chunk ids that support a competing hypothesis (another bridge "
                 "entity, another answer of a hop) to a new branch that pursues it after this "
                 "one, instead of pruning it away; this branch keeps its own choice.",
         _obj({"chunk_ids": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                             "maxItems": FORK_SEEDS},
               "reason": {"type": "string", "minLength": 1, "maxLength": 300}},
              ["chunk_ids", "reason"]),
         apply_fork),
]}


def validate_args(call: ToolCall) -> None:
    """Raise Rejected with a readable message if the call does not fit its tool's schema."""
    tool = TOOLS.get(call.name)
    if tool is None:
        raise Rejected(f"unknown tool {call.name!r}; tools: {', '.join(TOOLS)}")
    if not isinstance(call.args, dict):
        raise Rejected(f"{call.name}: arguments must be a JSON object")
    if _surely_fits(TOOLS[call.name].parameters, call.args):
        return  # the common case, without jsonschema's cost (per call, more than a search)
    errors = sorted(_validator(call.name).iter_errors(call.args), key=lambda e: list(e.path))
    if errors:
        where = "/".join(str(p) for p in errors[0].path) or "arguments"
        raise Rejected(f"{call.name}: invalid {where}: {errors[0].message}")


_TYPES = {"string": str, "integer": int, "boolean": bool, "array": list, "object": dict}
_KNOWN = {"type", "properties", "required", "additionalProperties", "items", "minItems",
          "maxItems", "minLength", "maxLength", "minimum", "maximum", "enum", "description"}


def _surely_fits(schema: dict, value) -> bool:
    """True only when `value` certainly fits `schema` (the subset of JSON Schema the tool table
    uses). False means "ask jsonschema", which also words the error: a keyword this does not
    know, or a value it does not take exactly (a bool as integer, 3.0), is left to it."""
    if not _KNOWN.issuperset(schema):
        return False
    kind = _TYPES.get(schema.get("type", ""))
    if "type" in schema and (kind is None or type(value) is not kind):
        return False  # `type(...) is`: True is no integer, 3.0 is left to jsonschema
    if "enum" in schema and not any(type(value) is type(e) and value == e
                                    for e in schema["enum"]):
        return False
    if isinstance(value, str) and not (schema.get("minLength", 0) <= len(value)
                                       <= schema.get("maxLength", len(value))):
        return False  # len() counts code points, as JSON Schema does
    if type(value) is int and not (schema.get("minimum", value) <= value
                                   <= schema.get("maximum", value)):
        return False
    if isinstance(value, list):
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            return False
        items = schema.get("items", {})
        return all(_surely_fits(items, v) for v in value)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        if any(k not in value for k in schema.get("required", ())):
            return False
        if schema.get("additionalProperties", True) is not True and set(value) - set(props):
            return False
        return all(_surely_fits(props[k], v) for k, v in value.items() if k in props)
    return True


@lru_cache(maxsize=None)
def _validator(name: str):
    """The tool's compiled argument schema (built once: a validator per call cost more than
    the search it checked)."""
    import jsonschema

    return jsonschema.Draft7Validator(TOOLS[name].parameters)


def fit_query(text: str, counter, max_tokens: int, max_chars: int = QUERY_MAX_CHARS
              ) -> tuple[str, int]:
    """`text` cut to `max_tokens` tokens (and the search cap in characters, at a word);
    returns (text, tokens it had). In Unicode NFC (`infra.nfc`): a planner's or a model's
    sub-query is searched in the form the documents are stored in."""
    text = " ".join(nfc(text).split())
    tokens = counter.encode(text)
    cut = counter.head(tokens[:max_tokens]) if len(tokens) > max_tokens else text
    if len(cut) > max_chars:
        cut = cut[:max_chars].rsplit(" ", 1)[0] or cut[:max_chars]
    return cut.strip(), len(tokens)
