"""What a caller sends: the search request, validated once (`parse_search`); and the shapes
of what the service answers, as the OpenAPI schema documents them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from branchsearch.infra.config.settings import (INDEX_NAME_CHARS, index_name,
                                                index_name_problem)
from branchsearch.orchestrator.service.admission import Limits
from branchsearch.orchestrator.service.errors import ApiError
from branchsearch.infra.nfc import nfc
from branchsearch.workers.query import question_problem


@dataclass(frozen=True)
class SearchRequest:
    question: str
    index: str | None = None
    branches: int | None = None
    k: int | None = None
    deadline_s: float | None = None
    # when the service received it (wall clock, set by the app, never by a body): the deadline
    # counts from here, queues between the ingress and the searcher included
    received_at: float | None = None


_FIELDS = {"question", "index", "branches", "k", "deadline_s"}


def check_no_query(query: bytes) -> None:
    """The `/v1` routes take no query string: a search's fields go in its JSON body, and
    `?index=other` would otherwise search the default index. 422 naming the parameters."""
    if not query:
        return
    from urllib.parse import parse_qsl

    names = sorted({k for k, _ in parse_qsl(query.decode("latin-1"),
                                            keep_blank_values=True)}) or ["?"]
    raise ApiError(422, "bad_request", f"unknown query parameter(s): {', '.join(names)[:200]}; "
                   "this API takes none (a search's fields go in its JSON body; a '?' in a "
                   "document id is sent as %3F)")


def parse_search(body: object, limits: Limits) -> SearchRequest:
    """Validate a /v1/search body; ApiError 422 names the first bad field."""
    if not isinstance(body, dict):
        raise ApiError(422, "bad_request", "body must be a JSON object {question, index?, "
                                           "branches?, k?, deadline_s?}")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        hint = " (ACL groups come from the API key)" if any("acl" in u or "group" in u
                                                            for u in unknown) else ""
        raise ApiError(422, "bad_request", f"unknown field(s): {', '.join(unknown)}{hint}")
    question = body.get("question")
    problem = question_problem(question)
    if problem:
        raise ApiError(422, "bad_request", problem)
    if len(question) > limits.max_question_chars:
        raise ApiError(422, "question_too_long", f"question has {len(question)} characters; "
                                                 f"the limit is {limits.max_question_chars}")
    index = index_name(body.get("index"))
    if index is not None:
        # (the name rule refuses a lone surrogate too: it is no letter or digit)
        problem = index_name_problem(index) if isinstance(index, str) else \
            "'index' must be a string naming an index"
        if problem:
            raise ApiError(422, "bad_request", problem)
    branches = _int(body, "branches", 1, limits.max_branches)
    k = _int(body, "k", 1, limits.max_k,
             "(a search returns at most the settings' final_k chunks, and max_k caps it)")
    deadline = body.get("deadline_s")
    if deadline is not None:
        if (isinstance(deadline, bool) or not isinstance(deadline, (int, float))
                or not math.isfinite(deadline) or not 0 < deadline <= limits.max_deadline_s):
            raise ApiError(422, "bad_request", f"'deadline_s' must be a number in "
                                               f"(0, {limits.max_deadline_s:g}]")
        deadline = float(deadline)
    question = nfc(question.strip())  # the documents' form (`infra.nfc`)
    return SearchRequest(question, index, branches, k, deadline)


def _int(body: dict, name: str, low: int, high: int, why: str = "") -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ApiError(422, "bad_request", f"'{name}' must be an integer in [{low}, {high}]"
                                           + (f" {why}" if why else ""))
    return value


# --- the OpenAPI description: what a caller sends and gets back -------------------------------
# `parse_search` and the searcher validate; these only document what they accept and answer
# (`app.create_app` builds the schema from the service's own Limits). The models are not used
# to check or filter answers: the Schemathesis test (tests/orchestrator/service/test_service_schema.py) checks real
# answers against them.

# letters, digits, '-' and '_', at least one letter or digit. "A letter of any script" has no
# portable JSON Schema form (ECMA-262's \p{L} needs the u flag, Python's re lacks it), so the
# pattern refuses what `index_name_problem` refuses in ASCII and whitespace, and lets every
# other character through: a client checking it never refuses a name the service takes.
_NAME_CHAR = r"[^\x00-\x2c\x2e\x2f\x3a-\x40\x5b-\x5e\x60\x7b-\x7f\s]"  # and '-', '_'
_ALNUM_CHAR = r"[^\x00-\x2f\x3a-\x40\x5b-\x60\x7b-\x7f\s]"
INDEX_NAME_PATTERN = f"^{_NAME_CHAR}*{_ALNUM_CHAR}{_NAME_CHAR}*$"
INDEX_NAME_SCHEMA = {"type": "string", "minLength": 1, "maxLength": INDEX_NAME_CHARS,
                     "pattern": INDEX_NAME_PATTERN,
                     "description": f"an index name: 1-{INDEX_NAME_CHARS} letters, digits, '-' "
                                    "or '_' (letters and digits of any script; at most 200 bytes "
                                    "in UTF-8)"}


def search_body_schema(limits: Limits) -> dict:
    """The /v1/search body as JSON Schema, with this service's limits."""
    def optional(schema: dict) -> dict:  # absent and null mean "the server's default"
        return {"anyOf": [schema, {"type": "null"}]}

    return {
        "type": "object", "required": ["question"], "additionalProperties": False,
        "properties": {
            "question": {"type": "string", "minLength": 1,
                         "maxLength": limits.max_question_chars,
                         "description": "what to find evidence for: text holding at least "
                                        "one letter or digit (any script), and no control "
                                        "character but tab, newline and carriage return"},
            "index": optional({**INDEX_NAME_SCHEMA, "description": "the index to search (the "
                               "server's default index when absent; a server without one, "
                               "serving a home of several indexes, answers 422)"}),
            "branches": optional({"type": "integer", "minimum": 1,
                                  "maximum": limits.max_branches,
                                  "description": "at most this many branches (the planner may "
                                                 "use fewer)"}),
            "k": optional({"type": "integer", "minimum": 1, "maximum": limits.max_k,
                           "description": "at most this many evidence chunks"}),
            "deadline_s": optional({"type": "number", "exclusiveMinimum": 0,
                                    "maximum": limits.max_deadline_s,
                                    "description": "seconds the search may take (default "
                                                   f"{limits.default_deadline_s:g})"}),
        }}


DOCUMENT_SCHEMA = {
    "type": "object", "required": ["id", "text"],
    "description": "a document; ids are unique within a body",
    "properties": {
        "id": {"anyOf": [{"type": "string", "minLength": 1, "pattern": r"^[^\s#]+$"},
                         {"type": "integer"}],
               "description": "the document's id (or `_id`): no whitespace or '#'; a number is "
                              "read as its text"},
        "title": {"type": "string"},
        "text": {"type": "string"},
        "acl": {"type": "array", "items": {"type": "string", "minLength": 1},
                "description": "the groups that may see it (none: everyone); group names hold "
                               "no comma and are not '*' or the reserved public group"},
    }}
DOCUMENTS_BODY = {"required": True, "content": {
    "application/json": {"schema": {"type": "array", "minItems": 1, "items": DOCUMENT_SCHEMA}},
    "application/x-ndjson": {"schema": {"type": "string", "description": "one document (the "
                                        "JSON object above) a line"}}}}


class _Open(BaseModel):
    """Fields beyond the ones listed may appear (results grow; clients should ignore them)."""

    model_config = ConfigDict(extra="allow")


class ErrorBody(BaseModel):
    """Every answer that is not a 200: a short code and one line for people."""

    model_config = ConfigDict(extra="forbid")
    error: str = Field(description="a short code: unauthorized, forbidden, bad_request, "
                                   "question_too_long, index_not_found, too_many_requests, "
                                   "overloaded, deadline_exceeded, …")
    detail: str = Field(description="what went wrong, in one line")


class KeyLimits(BaseModel):
    model_config = ConfigDict(extra="forbid")
    per_key_concurrency: int = Field(description="the key's requests that run at once")
    per_key_queue: int = Field(description="the key's requests that may wait for a slot (under "
                                           "Ray Serve as a searcher replica cuts it)")


class KeyRefusal(ErrorBody):
    """A 429 `too_many_requests`: the key has its limit of requests; why, and its counts and
    limits, as data (the detail says the same for people)."""

    reason: Literal["queue_full", "no_queue", "deadline_in_queue"] = Field(
        description="queue_full: per_key_queue of the key's requests wait already; no_queue: "
                    "the service queues none (per_key_queue 0); deadline_in_queue: this one "
                    "waited in the key's queue until its deadline")
    running: int = Field(description="the key's requests running when it was refused")
    waiting: int = Field(description="the key's requests waiting for a slot then (not this one)")
    limits: KeyLimits


class Overload(ErrorBody):
    """A 503 `overloaded`: a limit of the server's capacity is met; which, how many of what it
    counts were in use, and the limit, as data (the detail says the same for people)."""

    error: Literal["overloaded"] = Field(description="overloaded")
    reason: Literal["max_in_flight", "max_open_indexes", "branch_actors", "searcher_queue"] = \
        Field(description="max_in_flight: the server runs its most requests; "
                          "max_open_indexes: it keeps its most indexes open, each in use; "
                          "branch_actors: no branch actors were free within the deadline; "
                          "searcher_queue: Ray Serve's queue for the searcher is full")
    in_use: int | None = Field(description="how many of what the limit counts were in use: "
                               "requests in flight, indexes open or starting, branch actors "
                               "busy; null where the service cannot count them (Serve's queue)")
    limits: dict[str, int] = Field(description="the limit met, by its setting's name (e.g. "
                                   "{\"max_in_flight\": 64}); empty where the service does not "
                                   "know it")
    past_deadline: int | None = Field(None, description="max_in_flight only: of the requests "
                                      "in flight, the searches past their deadline (answered "
                                      "504) whose thread still waits on a backend; they hold "
                                      "their places until it answers or times out "
                                      "(branchsearch_searches_past_deadline in /metrics)")


class Health(BaseModel):
    model_config = ConfigDict(extra="forbid")
    status: Literal["up"]


class NotReady(BaseModel):
    model_config = ConfigDict(extra="forbid")
    index: str = Field(description="an index that cannot serve now")
    error: str = Field(description="the error code its searches answer now, e.g. "
                       "backend_unavailable, index_incomplete, index_misconfigured")


class Ready(BaseModel):
    model_config = ConfigDict(extra="forbid")
    status: Literal["ready"]
    indexes: int = Field(description="how many indexes the service serves (those of its data "
                         "home and the external ones declared)")
    indexes_not_ready: int = Field(0, description="how many of them cannot serve now: a "
                                   "backend that does not answer, a start that failed, or one "
                                   "not open that could not open now (their searches answer "
                                   "503; the server log says why)")
    not_ready: list[NotReady] | None = Field(None, description="which, to a caller with a key "
                                             "(those of them it may use); absent without one")


class KeyInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    groups: list[str]
    indexes: list[str] = Field(description="the indexes the key may use (empty: all of them)")
    all_indexes: bool
    admin: bool
    created: str
    revoked: bool


class IndexList(BaseModel):
    model_config = ConfigDict(extra="forbid")
    indexes: list[str]


class Upserted(BaseModel):
    model_config = ConfigDict(extra="forbid")
    index: str
    upserted: list[str] = Field(description="the ids written, in the body's order")
    documents: int
    chunks: int


class Deleted(BaseModel):
    model_config = ConfigDict(extra="forbid")
    index: str
    deleted: str


class FoundBy(BaseModel):
    """A branch that returned the document or chunk, at this rank."""

    model_config = ConfigDict(extra="forbid")
    branch: int
    subquery: str
    rank: int


class EvidenceChunk(_Open):
    chunk_id: str = Field(description='"{doc_id}#p{n}"')
    rank: int
    score: float
    text: str
    provenance: list[dict[str, Any]] = Field(description="for each time a branch fetched it: "
                                             "branch, turn, tool, query, rank, score, parents")
    found_by: list[FoundBy]


class EvidenceDocument(_Open):
    doc_id: str
    title: str
    score: float = Field(description="the document's fused score")
    found_by: list[FoundBy]
    chunks: list[EvidenceChunk]


class BranchSummary(_Open):
    index: int
    subquery: str
    kind: str
    weight: float
    status: Literal["ok", "error", "timeout"]
    error: str = Field(description="why the branch did not finish ok (empty when it did)")
    termination: str
    turns: int
    tokens_read: int
    latency_s: float


class CoveredBranch(_Open):
    """A planned branch left out (not run, or run beside the question's branch and not fused):
    the question's own branch already ranks the pages it is about (`skip_covered`). Its
    `covered` event says the same."""

    branch: int
    subquery: str
    by: list[str] = Field(description="the covering titles, in the question's branch's order")
    ids: list[str] = Field(description="the first chunk of each covering title")


class SearchResponse(_Open):
    """The search's result (`branchsearch search --json`), the caller's ACL applied."""

    question: str
    index: str
    status: Literal["ok", "partial"] = Field(description="partial: some branches failed or "
                                             "timed out; the evidence is from the others (a "
                                             "search whose every branch failed is a 503 or 504)")
    notes: list[str] = Field(description="what to know about this result: the question was "
                             "cut, nothing matched, or the evidence matches by meaning only "
                             "(shares no word with the question)")
    evidence: list[EvidenceDocument] = Field(description="documents in fused order, each "
                                             "with its chunks")
    ranked_chunk_ids: list[str]
    branches: list[BranchSummary]
    covered: list[CoveredBranch] = Field(default_factory=list, description="planned branches "
                                         "left out: the question's branch covers them")
    metrics: dict[str, Any]
    trace_id: str


def _event(kind: str, required: tuple[str, ...], **props) -> dict:
    return {"type": "object", "required": ["type", *required],
            "properties": {"type": {"const": kind}, **props}}


_STR, _INT, _IDS = {"type": "string"}, {"type": "integer"}, {"type": "array",
                                                             "items": {"type": "string"}}
_INT_OR_NULL = {"type": ["integer", "null"]}
# With `Accept: text/event-stream`: the schema of one event (as Open API 3.1 tools read an event
# stream's schema; 3.2 calls it itemSchema): `event: TYPE` and one `data:` line of JSON.
SSE_EVENT_SCHEMA = {
    "type": "object", "required": ["event", "data"],
    "description": "Server-Sent Events as the search runs: plan, then per branch "
                   "branch_started, search and prune, branch_done (a fork, or a `chain` for a next "
                   "hop — a chain's answer or a bridge's entity — when one runs, first); "
                   "`covered` for a planned branch the question's own branch covers (not "
                   "fused); `rerun` when a backend process died under the branches and they "
                   "start again (the branch events after it replace those before); last "
                   "`result` (the JSON "
                   "answer under `result`), or `error` when the search fails after events were "
                   "sent.",
    "properties": {
        "event": {"enum": ["plan", "branch_started", "search", "prune", "branch_done",
                           "covered", "fork", "chain", "rerun", "result", "error"]},
        "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": {
            "oneOf": [
                _event("plan", ("subqueries",), subqueries={"type": "array", "items": _STR},
                       budget_tokens=_INT, hops={"type": "object"}),
                _event("branch_started", ("branch", "subquery"), branch=_INT, subquery=_STR),
                _event("search", ("branch", "tool", "new_ids"), branch=_INT, tool=_STR,
                       query={"type": ["string", "null"]}, new_ids=_IDS),
                _event("prune", ("branch", "ids"), branch=_INT, ids=_IDS, reason=_STR,
                       tokens_before=_INT_OR_NULL, tokens_after=_INT_OR_NULL),
                _event("branch_done", ("branch", "status"), branch=_INT,
                       status={"enum": ["ok", "error", "timeout"]}, error=_STR,
                       termination=_STR, turns=_INT, context_tokens_final=_INT,
                       tokens_read=_INT, latency_s={"type": "number"}),
                _event("covered", ("branch", "subquery", "by", "ids"), branch=_INT,
                       subquery=_STR, by=_IDS, ids=_IDS),
                _event("fork", ("branch", "parent", "reason", "handed"), branch=_INT,
                       parent=_INT, reason=_STR, handed=_IDS, subquery=_STR),
                _event("chain", ("branch", "parent", "reason", "subquery"), branch=_INT,
                       parent=_INT, reason=_STR, subquery=_STR),
                _event("rerun", ("reason",), reason=_STR),
                _event("result", ("result",),
                       result={"$ref": "#/components/schemas/SearchResponse"}),
                _event("error", ("status", "error", "detail"), status=_INT, error=_STR,
                       detail=_STR),
            ]}},
    }}
