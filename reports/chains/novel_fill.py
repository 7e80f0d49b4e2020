"""v16 (reports/bridges.md): the second-wave branches' documents that the anchor's top 10 lacks
("novel"), placed in the fused top 10, rerun offline over `branch_eval.py run` dumps; and how
often a bridge's novel documents are gold at all.

    python reports/chains/novel_fill.py OUT.json musique=DUMP.json hotpot=DUMP.json [...]
    python reports/chains/fusion_grid.py --cv OUT.json musique,hotpot,hard --report ...

A point "nf h m": the shipped fused list's first h documents, then each second-wave branch
(bridge, chain, fork; branch order) adds its first m novel documents not yet placed, then the
shipped order. OUT holds each question's (AR@5, AR@10, nDCG@10) at every point and at the
shipped fusion (under fusion_grid's key for it), so `fusion_grid.py --cv` chooses among them.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import fusion_grid  # noqa: E402

from branchsearch.orchestrator.evaluation.measures import (  # noqa: E402
    doc_ranking, single_shot_metrics)

SHIPPED = " ".join(str(v) for v in fusion_grid.SHIPPED.values())
SECOND_WAVE = ("bridge", "chain", "fork")


def _anchor_top10(row: dict) -> set[str]:
    anchor = next((b for b in row["branches"] if b["kind"] == "original"
                   and b["status"] == "ok"), None)
    return set(doc_ranking(anchor["ranked"])[:10]) if anchor else set()


def novel(branch: dict, own10: set[str]) -> list[str]:
    return [d for d in doc_ranking(branch["ranked"]) if d not in own10]


def novel_fill(row: dict, h: int, m: int) -> list[str]:
    fused, own10 = doc_ranking(row["fused"]), _anchor_top10(row)
    out = fused[:h]
    for b in row["branches"]:
        if b["kind"] in SECOND_WAVE and b["status"] == "ok":
            out += [d for d in novel(b, own10) if d not in out][:m]
    return out + [d for d in fused if d not in out]


def outcome(gold: list[str], docs: list[str]) -> tuple[int, int, float]:
    """`fusion_grid.outcome` of a document ranking."""
    ndcg = single_shot_metrics(docs, dict.fromkeys(gold, 1))["ndcg@10"]
    return int(set(gold) <= set(docs[:5])), int(set(gold) <= set(docs[:10])), round(ndcg, 6)


def main(out: str, sets: dict[str, str]) -> None:
    outcomes = {}
    for name, path in sets.items():
        rows = json.loads(Path(path).read_text())["rows"]
        got = {SHIPPED: [fusion_grid.outcome(r["gold"], r["fused"]) for r in rows]}
        for h, m in itertools.product(range(3, 9), (1, 2, 3)):
            got[f"nf {h} {m}"] = [outcome(r["gold"], novel_fill(r, h, m))
                                  for r in rows]
        outcomes[name] = got
        bridges = [(b, r) for r in rows for b in r["branches"]
                   if b["kind"] == "bridge" and b["status"] == "ok"]
        first = sum(bool(n) and n[0] in r["gold"]
                    for b, r in bridges for n in [novel(b, _anchor_top10(r))])
        anywhere = sum(any(d in r["gold"] for d in novel(b, _anchor_top10(r))[:10])
                       for b, r in bridges)
        print(f"{name}: {len(bridges)} bridges; a gold document first among their novel "
              f"documents {first}, anywhere in their top 10's novel documents {anywhere}")
        print("  " + " | ".join(f"{p}: {fusion_grid.mean(o[0] for o in got[p]):.3f} / "
                                f"{fusion_grid.mean(o[1] for o in got[p]):.3f}" for p in got))
    Path(out).write_text(json.dumps(outcomes))


if __name__ == "__main__":
    main(sys.argv[1], dict(a.split("=", 1) for a in sys.argv[2:]))
