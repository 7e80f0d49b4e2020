"""Covered branches, offline: what the rule of `orchestrator.cover` does to recall and cost.

    python reports/cover/cover_eval.py DUMP.json [...]

Each DUMP is a `reports/recall/branch_eval.py run ... --branches 3` dump (the default planner,
every planned branch run). Branches are independent and deterministic, so dropping the covered
ones from a dump is exactly a run that did not launch them. Prints, per dump: the question's
branch alone, every planned branch fused (the default before), and the covered ones left out:
AR@5 / AR@10 / R@5, attribution, branches and tokens read per question; then the same on the
questions planned to two or more branches, and how many of their other branches were covered.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recall"))

from branch_eval import docstore_text, fused, load_dump, plan_rule, score  # noqa: E402

from branchsearch.orchestrator.cover import covering, head_titles  # noqa: E402
from branchsearch.orchestrator.plan import HeuristicPlanner  # noqa: E402
from branchsearch.workers.rank import doc_of  # noqa: E402


def uncovered(row: dict, titles: dict) -> list[dict]:
    """The row's branches without the covered ones (the question's branch always kept)."""
    anchor = row["branches"][0]
    if anchor["kind"] != "original" or anchor["status"] != "ok":
        return row["branches"]
    head = head_titles((doc_of(c), titles.get(doc_of(c), "")) for c in anchor["ranked"])
    names = {s.text: s.names for s in HeuristicPlanner().plan(row["question"], 3)}
    return [anchor] + [b for b in row["branches"][1:]
                       if covering(names.get(b["subquery"], ()), head) is None]


def main(paths: list[str]) -> None:
    everything = plan_rule("all")
    out = []
    for path in paths:
        dump = load_dump(path)
        titles, texts = docstore_text(dump)
        rows = dump["rows"]
        keep = {id(r): uncovered(r, titles) for r in rows}

        def gated(branches, rows=rows, keep=keep):
            return next(keep[id(r)] for r in rows if r["branches"] is branches)

        def figures(rows_):
            return {
                "one": score(rows_, lambda r: r["branches"][0]["ranked"],
                             lambda r: r["branches"][:1], titles, texts),
                "all": score(rows_, lambda r: fused(r, everything, 0.2, 5, 0.0),
                             lambda r: r["branches"], titles, texts),
                "uncovered": score(rows_, lambda r: fused(r, gated, 0.2, 5, 0.0),
                                   lambda r: keep[id(r)], titles, texts)}
        many = [r for r in rows if len(r["branches"]) > 1]
        others = sum(len(r["branches"]) - 1 for r in many)
        dropped = sum(len(r["branches"]) - len(keep[id(r)]) for r in many)
        out.append({"dump": path, "queries": len(rows), "whole": figures(rows),
                    "planned_2plus": len(many), "other_branches": others, "covered": dropped,
                    "two_plus": figures(many) if many else {}})
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
