"""What the commands print: the result, evaluation and demo views, and columns a terminal
lays out. Every text from the corpus or a caller is shown through `infra/terminal.py`
(`one_line`, `visible`): a control character in it is written as its escape, never sent to
the terminal.
"""

from __future__ import annotations

import unicodedata
from pathlib import Path

from branchsearch.infra.terminal import one_line, visible


def cell_width(text: str) -> int:
    """Terminal columns `text` takes, as the C library's `wcwidth` counts them (what a
    terminal lays its grid by): East Asian wide and full-width characters take two; marks that
    sit on the letter before (nonspacing and enclosing: Thai vowels and tones, Devanagari's
    anusvara and virama, accents), format characters (zero-width space and joiners) and
    Hangul's medial and final jamo take none; everything else, spacing vowel signs included,
    one. (`unicodedata.combining` is no test of a mark: the Thai vowels of 'ที่ดิน' and the
    anusvara of 'हिंदी' have combining class 0.)"""
    return sum(map(_char_width, text))


def _char_width(c: str) -> int:
    if c != "\u00ad" and unicodedata.category(c) in ("Mn", "Me", "Cf") or (
            "\u1160" <= c <= "\u11ff" or "\ud7b0" <= c <= "\ud7ff"):
        return 0
    return 2 if unicodedata.east_asian_width(c) in "WF" else 1


def pad(text: object, width: int) -> str:
    """`visible(text)` padded with spaces to `width` terminal columns (a column stays a
    column when a name is Chinese or Japanese, which str.ljust would count one column a
    character)."""
    line = visible(text)
    return line + " " * max(0, width - cell_width(line))


def print_result(result) -> None:
    """The result for a terminal: every text from the corpus or the caller goes through
    `one_line` (a control character in it is shown as its escape)."""
    question = one_line(result.question)
    print(f"question: {question[:300]}{' …' if len(question) > 300 else ''}\n"
          f"status: {result.status}\ntrace_id: {result.trace_id}")
    for note in getattr(result, "notes", None) or []:
        print(f"note: {one_line(note)}")
    for b in result.branches:
        extra = (f"{b.termination}, {b.turns} turns, {b.tool_calls} calls, "
                 f"{b.context_tokens_final} ctx tokens, pruned {len(b.pruned_ids)}"
                 if b.status == "ok" else b.error)
        fork = f" ({one_line(follows(b))})" if b.parent is not None else ""
        print(f"  branch {b.index} [{b.status}] w={b.weight:g} {b.subquery!r}{fork}: "
              f"{one_line(extra)}")
    for c in getattr(result, "covered", None) or []:
        by = one_line(", ".join(c["by"]))
        print(f"  branch {c['branch']} [covered] '{one_line(c['subquery'])}': left out, the "
              f"question's branch already ranks {by} (skip_covered)")
    print("evidence (rank, fused score):")
    for rank, doc in enumerate(result.evidence, start=1):
        by = ", ".join(f"b{f['branch']}#{f['rank']}" for f in doc["found_by"])
        print(f"  {rank:>2}. {doc['score']:.4f}  {one_line(doc['doc_id'])}  "
              f"({one_line(doc['title'])})  [{by}]")
        for c in doc["chunks"]:
            found = ", ".join(f"b{f['branch']}#{f['rank']}" for f in c["found_by"])
            print(f"      {one_line(c['chunk_id'])}  found by {found}: {one_line(c['text'], 110)}")


def print_evaluation(result: dict) -> None:
    """The report as a table: one column per run, then attribution and comparisons."""
    from branchsearch.orchestrator.evaluation.report import SUMMARY_METRICS

    runs = result["runs"]
    print(f"{Path(result['dataset']).name} ({result['split']}): {runs[0]['queries']} queries, "
          f"index {result.get('index', '?')!r}, embedding: {result.get('embedding') or 'none'}")
    names = [m for m in SUMMARY_METRICS if any(m in r["metrics"] for r in runs)]
    print("  " + "metric".ljust(22) + "".join(r["config"][:22].rjust(24) for r in runs))
    for m in names:
        print("  " + m.ljust(22) + "".join(
            (f"{r['metrics'][m]:.4g}" if m in r["metrics"] else "-").rjust(24) for r in runs))
    if "attribution" in runs[0]:
        print("  attribution: " + ", ".join(f"{k} {v}" for k, v in
                                             runs[0]["attribution"].items()))
    for c in result.get("comparisons", []):
        print(f"  paired vs {c['baseline']} on {c['measure']}: {c['wins']} wins, "
              f"{c['losses']} losses, {c['ties']} ties")
        if c.get("note"):
            print(f"  note: {one_line(c['note'])}")


def follows(b) -> str:
    """Which branch a later wave's branch follows and why: "fork of b0, look_alike; handed
    …", "bridge of b1, bridge = Tim Burton"."""
    handed = f"; handed {', '.join(b.seeds)}" if b.kind == "fork" else ""
    return f"{b.kind} of b{b.parent}, {b.reason}{handed}"


def print_demo_branches(result) -> None:
    print("4. what each branch did:")
    for b in result.branches:
        after = f" ({one_line(follows(b))})" if b.parent is not None else ""
        print(f"   branch {b.index} [{b.status}] {b.kind} w={b.weight:g}: {b.subquery!r}{after}")
        if b.status != "ok":
            print(f"      {one_line(b.error)}")
            continue
        searched = [r["args"].get("query") or r["args"].get("doc_id") for r in b.trace
                    if r["kind"] == "call" and r["tool"] in ("search_corpus", "read_document")]
        print(f"      searched {len(searched)}x: " + "; ".join(map(one_line, searched[:6]))
              + (" …" if len(searched) > 6 else ""))
        for p in [r for r in b.trace if r["kind"] == "prune"][:2]:
            print(f"      pruned {len(p['applied'])} at turn {p['turn']} "
                  f"({p['tokens_before']}→{p['tokens_after']} tokens): "
                  f"{one_line(p['reason'])}")
        print(f"      kept {len(b.final_context_ids)} chunks ({b.context_tokens_final} tokens), "
              f"stopped by {b.termination} after {b.turns} turn{'' if b.turns == 1 else 's'}")


def print_demo_evidence(result, task) -> None:
    gold = list(task.gold)
    print("5. fused evidence (reciprocal rank fusion over branches):")
    for rank, doc in enumerate(result.evidence[:6], start=1):
        mark = "*" if doc["doc_id"] in gold else " "
        found = [f["branch"] for f in doc["found_by"]]
        print(f"   {mark} {rank}. {doc['score']:.4f} {one_line(doc['title'])}  "
              f"[branches {found}]")
        print(f"       {one_line(doc['chunks'][0]['text'], 120)}")
    top = {d["doc_id"] for d in result.evidence[:len(gold) + 1]}
    print(f"   (* = gold; {len(set(gold) & top)}/{len(gold)} gold documents in the top "
          f"{len(gold) + 1}; answer: {task.answer!r}; trace id {result.trace_id})")
