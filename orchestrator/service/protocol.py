"""What a caller sends: the search request, validated once (`parse_search`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from branchsearch.infra.settings import index_name_problem
from branchsearch.orchestrator.service.admission import Limits
from branchsearch.orchestrator.service.errors import ApiError
from branchsearch.workers.tools import has_words


@dataclass(frozen=True)
class SearchRequest:
    question: str
    index: str | None = None
    branches: int | None = None
    k: int | None = None
    deadline_s: float | None = None


_FIELDS = {"question", "index", "branches", "k", "deadline_s"}


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
    if not isinstance(question, str) or not question.strip():
        raise ApiError(422, "bad_request", "'question' must be a non-empty string")
    if not has_words(question):
        raise ApiError(422, "bad_request", "'question' has no words to search for (only "
                                           "punctuation or symbols)")
    if len(question) > limits.max_question_chars:
        raise ApiError(422, "question_too_long", f"question has {len(question)} characters; "
                                                 f"the limit is {limits.max_question_chars}")
    if not _utf8(question):
        raise ApiError(422, "bad_request", "'question' is not valid Unicode text (a lone "
                                           "surrogate escape such as \\ud800)")
    index = body.get("index")
    if index is not None:
        problem = index_name_problem(index) if isinstance(index, str) and _utf8(index) else \
            "'index' must be a string naming an index"
        if problem:
            raise ApiError(422, "bad_request", problem)
    branches = _int(body, "branches", 1, limits.max_branches)
    k = _int(body, "k", 1, limits.max_k)
    deadline = body.get("deadline_s")
    if deadline is not None:
        if (isinstance(deadline, bool) or not isinstance(deadline, (int, float))
                or not math.isfinite(deadline) or not 0 < deadline <= limits.max_deadline_s):
            raise ApiError(422, "bad_request", f"'deadline_s' must be a number in "
                                               f"(0, {limits.max_deadline_s:g}]")
        deadline = float(deadline)
    return SearchRequest(question.strip(), index, branches, k, deadline)


def _int(body: dict, name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ApiError(422, "bad_request", f"'{name}' must be an integer in [{low}, {high}]")
    return value


def _utf8(text: str) -> bool:
    """Whether `text` can be written as UTF-8 (JSON's `\\ud800` gives a string that cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
