"""Fusion variants of a second wave, recomputed from `branch_eval.py run` dumps, written as
`branchsearch eval`-shaped reports that `chain_cv.py` cross-validates (issue 34).

    python reports/chains/refuse.py --quota 1,2,3 OUT_PREFIX DUMP.json [...]

Each DUMP holds every branch's ranking of one run (`BRANCHSEARCH_BRIDGES=N branch_eval.py run
... --branches 3`, named `…-brN.json`). For each dump it first checks that the fusion rebuilt
from the branches gives the run's own fused ranking for every question — the anchored RRF alone
(dumps made before admission shipped) or with the shipped admission (v6) — so the variants
differ from the run by the fusion alone. It then writes OUT_PREFIX-b1.json (the question's
branch alone: a 1-branch run), OUT_PREFIX-brN.json (anchored RRF, no admission),
OUT_PREFIX-brNqP.json (under a quota of P) and, with `--link L,...`, OUT_PREFIX-brNlL[qP].json
(admission by name, v5: every fresh document; with `--second-only`, v6 as shipped, names end
in `s`: only what the second wave alone found).

The quota (reports/bridges.md, v4): walking down the fused documents, one that is not in the
anchor's own first 10 ("fresh") keeps its place only while fewer than P fresh ones are above
it; the fresh ones past the quota move below the 10th place. The fused top 10 then holds at
least 10 - P of the question branch's own top 10.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from branchsearch.fusion.admission import admit
from branchsearch.fusion.documents import fuse_documents
from branchsearch.infra.config.settings import Settings
from branchsearch.orchestrator.evaluation.attribution import Trajectory, agent_measures, attribute
from branchsearch.orchestrator.evaluation.measures import doc_ranking, single_shot_metrics
from branchsearch.orchestrator.result import LINK_HEAD, SECOND_WAVE, named_in
from branchsearch.workers.rank import doc_of

K = Settings().branch_rrf_k  # the driver's (`fuse_branches(k=settings.branch_rrf_k)`)


def fused(branches: list[dict], quota: int | None, link: int | None = None,
          titles: dict | None = None, texts: dict | None = None,
          second_only: bool = False, first_within: int | None = None) -> list[str]:
    """`fuse_branches`' ranking of the branches that finished, first chunks then the rest;
    under a quota and/or linked admission (v5: `link` = how many of the anchor's documents
    must name a fresh document's title) when given."""
    ok = [b for b in branches if b["status"] == "ok" and b["ranked"]]
    anchor = next((i for i, b in enumerate(ok) if b["kind"] == "original"), None)
    docs, of_doc = fuse_documents([b["ranked"] for b in ok], doc_of,
                                  weights=[b["weight"] for b in ok], anchor=anchor, k=K)
    if link is not None and anchor is not None:
        first = ({d.id for d in docs if any(ok[li]["kind"] not in SECOND_WAVE
                                            and (first_within is None or r <= first_within)
                                            for li, r in d.ranks.items())}
                 if second_only else set())
        docs = linked_only(docs, ok[anchor]["ranked"], link, titles, texts, first)
    if quota is not None and anchor is not None:
        docs = within_quota(docs, set(doc_ranking(ok[anchor]["ranked"])[:10]), quota)
    return ([of_doc[d.id][0] for d in docs] + [c for d in docs for c in of_doc[d.id][1:]])[:10]


def within_quota(docs: list, own: set, quota: int, window: int = 10) -> list:
    kept, moved, fresh = [], [], 0
    for d in docs:
        if len(kept) >= window:
            break
        if d.id not in own:
            fresh += 1
            if fresh > quota:
                moved.append(d)
                continue
        kept.append(d)
    return kept + moved + docs[len(kept) + len(moved):]


def linked_only(docs: list, anchor_ranked: list[str], link: int, titles: dict, texts: dict,
                first: set = frozenset(), window: int = 10) -> list:
    """v5, as shipped (`fusion.admission.admit`, `orchestrator.result.named_in`): a fresh
    document keeps its place in the first `window` only if a chunk, in the anchor's ranking, of
    one of the anchor's first `link` documents names its title."""
    own = doc_ranking(anchor_ranked)
    head = set(own[:link])
    text = " ".join(texts.get(c, "") for c in anchor_ranked if doc_of(c) in head)
    return admit(docs, set(own[:window]),
                 lambda d: d in first or named_in(text, titles.get(d, "")), window=window)


def per_query(row: dict, ranked: list[str], used: list[dict], titles, texts) -> dict:
    gold = dict.fromkeys(row["gold"], 1)
    t = Trajectory(ranked, list(dict.fromkeys(c for b in used for c in b["retrieved"])),
                   list(dict.fromkeys(c for b in used for c in b["pruned"])),
                   list(dict.fromkeys(c for b in used for c in b["final_context"])))
    m = single_shot_metrics(doc_ranking(ranked), gold) | agent_measures(t, gold, 5)
    kinds = [b["kind"] for b in used]
    m |= {"tokens_read": sum(b["tokens_read"] for b in used), "branches": len(used),
          "bridges": kinds.count("bridge"), "chains": kinds.count("chain")}
    text = " ".join(texts.get(c, "") for c in t.retrieved)
    return {"id": row["id"], "question": row["question"], "gold": row["gold"],
            "ranking": doc_ranking(ranked), "metrics": m,
            "attribution": attribute(t, gold, titles, text, 5)[0]}


def main() -> None:
    import sqlite3

    ap = argparse.ArgumentParser()
    ap.add_argument("--quota", default="1,2,3")
    ap.add_argument("--link", default="", help="v5: L values, e.g. 1,3,5 (with each quota too)")
    ap.add_argument("--second-only", action="store_true",
                    help="v6 (as shipped): only second-wave finds must be named (names end in s)")
    ap.add_argument("--depth", default="",
                    help="v8: D values, e.g. 10,20,30: each branch's ranking cut at D chunks "
                         "(a BRANCHSEARCH_BRANCH_DEPTH dump), with 0..N bridges, as shipped "
                         "(v6 admission); names dDbrM")
    ap.add_argument("--as-run", default="",
                    help="v10: write the run's own fused ranking (every branch) as variant NAME, "
                         "beside b1 (the question's branch alone), without rebuilding fusion")
    ap.add_argument("out")
    ap.add_argument("dumps", nargs="+")
    a = ap.parse_args()
    quotas = [int(q) for q in a.quota.split(",")]
    for path in a.dumps:
        dump = json.loads(Path(path).read_text())
        n = re.search(r"br(\d+)\.json$", path).group(1)
        store = Path(dump["home"]) / "indexes" / dump["index"] / "docs.sqlite"
        db = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
        titles = dict(db.execute("select doc_id, title from docs"))
        texts = dict(db.execute("select chunk_id, text from chunks"))
        rows = dump["rows"]
        if a.as_run:
            write({"b1": lambda r: (r["branches"][0]["ranked"][:10], r["branches"][:1]),
                   a.as_run: lambda r: (r["fused"], r["branches"])}, rows, path, a.out,
                  titles, texts)
            continue
        for row in rows:
            run = doc_ranking(row["fused"])
            if run not in (doc_ranking(fused(row["branches"], None)),
                           doc_ranking(fused(row["branches"], None, LINK_HEAD, titles, texts,
                                             True))):
                raise SystemExit(f"{path}: {row['id']}: the rebuilt fusion differs from the run's")
        if a.depth:
            variants = {"b1": lambda r: (r["branches"][0]["ranked"][:10], r["branches"][:1])}
            for depth in [int(x) for x in a.depth.split(",")]:
                for m in range(int(n) + 1):
                    def make(r, depth=depth, m=m):
                        used = bridged(r["branches"], m)
                        cut = [b | {"ranked": b["ranked"][:depth]} for b in used]
                        return fused(cut, None, LINK_HEAD, titles, texts, True), used
                    variants[f"d{depth}br{m}"] = make

                    def within(r, depth=depth, m=m):  # v9: first-wave only within the top 10
                        used = bridged(r["branches"], m)
                        cut = [b | {"ranked": b["ranked"][:depth]} for b in used]
                        return fused(cut, None, LINK_HEAD, titles, texts, True, 10), used
                    variants[f"d{depth}br{m}w"] = within
            write(variants, rows, path, a.out, titles, texts)
            continue
        variants = {"b1": lambda r: (r["branches"][0]["ranked"][:10], r["branches"][:1]),
                    f"br{n}": lambda r: (fused(r["branches"], None), r["branches"])}
        for q in quotas:
            variants[f"br{n}q{q}"] = lambda r, q=q: (fused(r["branches"], q), r["branches"])
        for li in [int(x) for x in a.link.split(",") if x]:
            for q in [None] + quotas:
                name = f"br{n}l{li}" + (f"q{q}" if q else "") + ("s" if a.second_only else "")
                variants[name] = (
                    lambda r, q=q, li=li: (fused(r["branches"], q, li, titles, texts,
                                                 a.second_only), r["branches"]))
        write(variants, rows, path, a.out, titles, texts)


def bridged(branches: list[dict], m: int) -> list[dict]:
    """The branches of a run with at most its first `m` bridge branches (a run with
    `bridges = m`: the bridges are taken in order, and every branch is independent)."""
    out, seen = [], 0
    for b in branches:
        if b["kind"] == "bridge":
            seen += 1
            if seen > m:
                continue
        out.append(b)
    return out


def write(variants: dict, rows: list[dict], path: str, out: str, titles, texts) -> None:
    for name, make in variants.items():
        pq = [per_query(r, *make(r), titles, texts) for r in rows]
        Path(f"{out}-{name}.json").write_text(json.dumps(
            {"source": path, "runs": [{"config": name, "per_query": pq}]}))
    print(f"{path}: {len(rows)} questions, the run's fusion rebuilt exactly; wrote "
          f"{', '.join(variants)}")


if __name__ == "__main__":
    main()
