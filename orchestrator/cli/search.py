"""Searching: `retrieve` (one single-shot retrieval, no agent) and `search` (parallel branch
agents, the fused evidence)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from branchsearch.infra.config.choices import MODES
from branchsearch.orchestrator.cli.options import (AclAdminOpt, AclOpt, AddressOpt, ConfigOpt,
                                                   ExecutorOpt, HomeOpt, IndexOpt, JsonOpt, KOpt,
                                                   PolicyOpt, caller_acl, choice, say,
                                                   settings_to_read)
from branchsearch.orchestrator.cli.render import one_line, print_result


def register(app: typer.Typer) -> None:
    app.command()(retrieve)
    app.command()(search)


def retrieve(query: str, mode: str = typer.Option("hybrid", callback=choice(*MODES),
                                                 help=" | ".join(MODES)),
             k: int = KOpt, home: Optional[Path] = HomeOpt,
             index: Optional[str] = IndexOpt, config: Optional[Path] = ConfigOpt,
             acl: Optional[list[str]] = AclOpt, acl_admin: bool = AclAdminOpt,
             as_json: bool = JsonOpt):
    """Single-shot retrieval (no agent)."""
    from branchsearch.infra.retrieval.retriever import one_side
    from branchsearch.infra.index.open import open_retriever
    from branchsearch.orchestrator.result import MEANING_ONLY, NOTHING_VISIBLE, meaning_only
    from branchsearch.workers.query import check_question

    query = check_question(query, "query")  # in NFC, as documents are indexed
    settings, picked = settings_to_read(home, index, config)
    groups = caller_acl(settings, acl, acl_admin)
    retriever = open_retriever(settings, need_dense=mode != "bm25")
    say(picked)
    side = one_side(settings) if mode == "hybrid" else ""
    if side:  # the results would say `source: bm25` and nothing else: say why, once
        why = ("its config maps no " + ("dense" if side == "bm25" else "lexical") + " store"
               if settings.external is not None else "ingested --no-dense")
        print(f"note: index {settings.index!r} has only its {side} side ({why}): this hybrid "
              f"search is a {side} search", file=sys.stderr)
    hits = retriever.search(query, mode=mode, k=k, acl_groups=groups)
    if mode != "bm25" and side != "bm25" and meaning_only(query, [t for h in hits
                                                                   for t in (h.title, h.text)]):
        print(f"note: {MEANING_ONLY}", file=sys.stderr)
    if as_json:
        print(json.dumps([h.to_dict() for h in hits]))
        return
    if not hits:
        print(f"no hits: {NOTHING_VISIBLE} the query ({mode} search of index "
              f"{settings.index!r})")
    for h in hits:
        print(f"{h.rank:>3}. {one_line(h.chunk_id)}  {h.score:.4f}  {one_line(h.title)}\n"
              f"     {one_line(h.text, 160)}")


def search(question: str, branches: Optional[int] = typer.Option(None, min=1,
                                                                  help="at most N branches"),
           policy: Optional[str] = PolicyOpt,
           trace: Optional[Path] = typer.Option(
               None, help="append spans (JSONL) here; episode traces are appended to *.episodes.jsonl"),
           executor: str = ExecutorOpt, address: Optional[str] = AddressOpt,
           acl: Optional[list[str]] = AclOpt, acl_admin: bool = AclAdminOpt,
           home: Optional[Path] = HomeOpt, index: Optional[str] = IndexOpt,
           config: Optional[Path] = ConfigOpt, as_json: bool = JsonOpt):
    """Search with parallel branch agents; prints the fused evidence."""
    from branchsearch.orchestrator.driver import open_driver
    from branchsearch.orchestrator.execution import pick_executor
    from branchsearch.workers.query import check_question

    question = check_question(question)  # in NFC, as documents are indexed
    flags = {"branches": branches, "policy": policy, "ray_address": address}
    if trace:
        flags |= {"trace_exporter": "jsonl", "trace_file": str(trace)}
    settings, picked = settings_to_read(home, index, config, **flags)
    groups = caller_acl(settings, acl, acl_admin)
    driver = open_driver(settings, pick_executor(settings, executor))
    say(picked)
    try:
        result = driver.search(question, acl_groups=groups)
    finally:
        driver.close()
    if trace:  # the branches' episode traces (the fourth store) beside the spans, appended
        episodes = trace.with_name(trace.stem + ".episodes.jsonl")  # as they are, each line
        with episodes.open("a") as out:  # with the trace id that joins it to its spans
            out.write("".join(json.dumps({"trace_id": result.trace_id, "branch": b.index, **r},
                                         default=str) + "\n"
                              for b in result.branches for r in b.trace))
        print(f"spans: {trace}; episode traces: {episodes}", file=sys.stderr)
    if as_json:
        print(json.dumps(result.to_dict(), default=str))
    else:
        print_result(result)
    if result.status == "failed":  # no branch finished: the evidence is not an answer
        raise typer.Exit(1)
