"""Search events for callers: Server-Sent Events framing, the result object, the ACL guard.

The driver reports events (`plan`, `branch_started`, `search`, `prune`, `branch_done`,
`covered`, `fork`, `chain`, `rerun`, `result`) through `on_event` as they happen; the service
sends `error` last when a search fails after events were sent. A `covered` event names a
planned branch that the question's own branch covers (`orchestrator.cover`: not fused). A
`fork` (the branch it starts, its parent, why, the chunks handed over) comes before that fork's
own `branch_started`; so does a `chain`, any next-hop branch (`orchestrator.chains`): a bridge
(reason "bridge = NAME", parent the branch whose top chunk names the entity), a bridge of a
bridge (the same reason, parent that bridge), or the second hop of a compositional question
(reason "SLOT = ANSWER", parent its inner hop's branch). Bridges are on by default (`bridges =
1`, `bridge_depth = 2`), so most searches send `chain` events. Everything here is a plain
function over JSON-able dicts.
"""

from __future__ import annotations

import json
from collections.abc import Callable

EVENT_TYPES = ("plan", "branch_started", "search", "prune", "branch_done", "covered", "fork",
               "chain", "rerun", "result", "error")
SEARCH_TOOLS = ("search_corpus", "grep_corpus", "read_document")


def sse(event: dict) -> str:
    """One event as an SSE frame: `event: <type>` and one `data:` line of JSON."""
    return f"event: {event.get('type', 'message')}\ndata: {json.dumps(event, default=str)}\n\n"


def parse_sse(text: str) -> list[dict]:
    """The events of an SSE body (tests and the bench read streams with it)."""
    events = []
    for frame in text.split("\n\n"):
        data = [line[5:].strip() for line in frame.splitlines() if line.startswith("data:")]
        if data:
            events.append(json.loads("\n".join(data)))
    return events


def result_dict(result, k: int | None = None) -> dict:
    """`SearchResult.to_dict()` with at most `k` evidence chunks, and no process ids (a
    caller learns nothing of the machines behind the service)."""
    out = result.to_dict()
    out["branches"] = [{key: v for key, v in b.items() if key != "pid"} for b in out["branches"]]
    if k is not None:
        out["ranked_chunk_ids"] = out["ranked_chunk_ids"][:k]
        keep = set(out["ranked_chunk_ids"])
        docs = []
        for doc in out["evidence"]:
            chunks = [c for c in doc["chunks"] if c["chunk_id"] in keep]
            if chunks:
                docs.append({**doc, "chunks": chunks})
        out["evidence"] = docs
    return out


def branch_done(b) -> dict:
    return {"type": "branch_done", "branch": b.index, "status": b.status, "error": b.error,
            "termination": b.termination, "turns": b.turns,
            "context_tokens_final": b.context_tokens_final, "tokens_read": b.tokens_read,
            "latency_s": round(b.latency_s, 4)}


# --- the ACL guard ---------------------------------------------------------------------------

def chunk_ids_in(event: dict) -> list[str]:
    """Every chunk id an event or result mentions."""
    if event.get("type") == "result":
        r = event["result"]
        return list(r.get("ranked_chunk_ids", [])) + [
            cid for b in r.get("branches", []) for name in
            ("ranked_chunk_ids", "pruned_ids", "final_context_ids", "seeds")
            for cid in b.get(name) or []] + [
            cid for b in r.get("branches", []) for c in b.get("fork_candidates") or []
            for cid in [c.get("chunk_id", ""), *(c.get("chunk_ids") or [])]] + [
            cid for c in r.get("covered") or [] for cid in c.get("ids") or []] + [
            cid for doc in r.get("evidence", []) for c in doc.get("chunks", [])
            for p in c.get("provenance") or [] for cid in p.get("parents") or []]
    return (list(event.get("new_ids", [])) + list(event.get("ids", []))
            + list(event.get("handed", [])))


def guard(event: dict, hidden: Callable[[list[str]], set[str]]) -> tuple[dict, int]:
    """Drop every chunk id (and evidence) that `hidden(ids)` says the caller may not see.
    Returns the event and how many ids were dropped — non-zero means a layer below leaked."""
    ids = chunk_ids_in(event)
    bad = hidden(ids) if ids else set()
    if not bad:
        return event, 0
    keep = lambda xs: [x for x in xs if x not in bad]  # noqa: E731
    if event.get("type") != "result":
        out = dict(event)
        if out.get("type") == "covered":
            return _uncovered(out, bad), len(bad)
        for name in ("new_ids", "ids", "handed"):
            if name in out:
                out[name] = keep(out[name])
        return out, len(bad)
    r = dict(event["result"])
    r["ranked_chunk_ids"] = keep(r.get("ranked_chunk_ids", []))
    r["branches"] = [{**b, **{n: keep(b[n]) for n in ("ranked_chunk_ids", "pruned_ids",
                                                       "final_context_ids", "seeds")
                              if b.get(n) is not None},
                      **({"fork_candidates": [
                          c for c in b["fork_candidates"] if c.get("chunk_id") not in bad
                          and not bad & set(c.get("chunk_ids") or [])]}
                         if b.get("fork_candidates") else {})}
                     for b in r.get("branches", [])]
    docs = []
    for doc in r.get("evidence", []):
        chunks = [{**c, "provenance": [{**p, "parents": keep(p.get("parents") or [])}
                                       for p in c.get("provenance") or []]}
                  for c in doc["chunks"] if c["chunk_id"] not in bad]
        if chunks:
            docs.append({**doc, "chunks": chunks})
    r["evidence"] = docs
    if r.get("covered"):
        r["covered"] = [_uncovered(c, bad) for c in r["covered"]]
    return {**event, "result": r}, len(bad)


def _uncovered(covered: dict, bad: set[str]) -> dict:
    """A `covered` entry without the hidden ids: a hidden document's title goes with its id."""
    pairs = [(t, c) for t, c in zip(covered.get("by", []), covered.get("ids", []))
             if c not in bad]
    return {**covered, "by": [t for t, _ in pairs], "ids": [c for _, c in pairs]}


def public(event: dict) -> dict:
    """The event as a caller may see it: branch errors without credentials or internal
    addresses (`infra.errors.public_line`); the server log keeps them whole."""
    from branchsearch.infra.errors import public_line

    def scrubbed(d: dict) -> dict:  # a branch's error and its episode's detail say the same
        return {**d, **{k: public_line(d[k]) for k in ("error", "detail") if d.get(k)}}

    if event.get("type") == "branch_done":
        return scrubbed(event)
    if event.get("type") == "result":
        r = event["result"]
        return {**event, "result": {**r, "branches": [scrubbed(b)
                                                      for b in r.get("branches", [])]}}
    return event
