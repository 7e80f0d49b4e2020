"""Offline evaluation of branch fusion and branch planning from one run's per-branch dump.

    python reports/recall/branch_eval.py run  DATASET INDEX OUT.json [--branches 3]
        [--ranker on|off] [--features] [--policy-arg question_k=10] [--rule RULE]
        runs `orchestrator.evaluation.run.eval_agent` (the function behind `branchsearch eval
        --policy heuristic`) with the local executor and keeps every branch's ranking,
        retrieved/pruned/kept ids, tokens read and searches (settings from BRANCHSEARCH_* env,
        home from --home). `--rule candidates --branches 10`: every candidate sub-query of
        `orchestrator.plan.candidates` runs as a branch, so `table --plan RULE` simulates any
        planner rule exactly.
    python reports/recall/branch_eval.py table OUT.json [...] [--share S --k K --agreement A
        --plan all|no-lone-entity|one-entity|v1|kinds:a,b|... --branches N --tail M,P]
        scores, from the dump, the question's own branch alone (= a 1-branch run: branches are
        independent and deterministic) and the fused branches that a planner rule keeps:
        AR@5, AR@10, R@5, trajectory recall, all found (every gold document retrieved
        somewhere: the most a final ranking or fusion of these trajectories could put in a top
        10), tokens read, duplicate searches, attribution.
        `--tail M,P`: instead of `fusion.anchored`, the anchor's first M documents, then up to
        P documents of the other branches' top 10s that the anchor's top 10 lacks (by rank,
        round the branches), then the anchor's rest (tried in session 3, not shipped).
    python reports/recall/branch_eval.py ceilings OUT.json [...]
        per candidate kind (a `--rule candidates` dump): what the question's branch plus that
        kind's branches could reach: all gold in the union of their top 10s, all gold found
        anywhere in their trajectories, trajectory recall, tokens read.
    python reports/recall/branch_eval.py pair ONE.json OTHER.json [--share 0]
        two runs of the same questions (e.g. `run --branches 1` and the same with
        `--policy-arg hop_mode=hybrid`): each run's question branch alone, and the two fused
        as two branches (`fusion.documents`, ONE's branch anchoring, `--share`, `--k`), with
        all found of the pair and OTHER's tokens read over ONE's.
    python reports/recall/branch_eval.py fit OUT.json [...] --on NAME
        grid-searches share, k and agreement of `fusion.anchored` on the dump named NAME and
        reports the chosen values on every dump (fit on one set, report on the others).
"""

from __future__ import annotations

import argparse
import json
import math
import sqlite3
import sys
import time
from collections import Counter
from pathlib import Path

from branchsearch.fusion.documents import fuse_documents
from branchsearch.infra.config.choices import MODES
from branchsearch.orchestrator.evaluation.attribution import Trajectory, agent_measures, attribute
from branchsearch.orchestrator.evaluation.measures import doc_ranking, single_shot_metrics
from branchsearch.workers.rank import doc_of


def run(dataset: str, index: str, out: str, branches: int, home: str,
        features: bool = False, ranker: bool = True, policy_args: dict | None = None,
        rule: str = "") -> None:
    from branchsearch.infra.datasets.beir import read_queries
    from branchsearch.infra.stores.docstore import DocStore
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.orchestrator.driver import Driver
    from branchsearch.orchestrator.evaluation.run import eval_agent
    from branchsearch.orchestrator.plan import HeuristicPlanner

    settings = load_settings(None, {"home": home, "index": index, "branches": branches})
    queries = read_queries(dataset)
    policies: dict[int, object] = {}

    def own(index):  # `branch.NAME`: only the branches other than the question's own
        return {k.removeprefix("branch."): v for k, v in (policy_args or {}).items()
                if index > 0 or not k.startswith("branch.")}

    def policy(index, subquery):  # workers.factory.make_policy's, the learned ranking on/off
        from dataclasses import replace

        from branchsearch.workers.factory import make_policy
        from branchsearch.workers.heuristic import HeuristicPolicy

        # the planner keeps the question's own branch first: only it searches the question
        # tail (make_policy's kind="original")
        own_settings = settings.replace(learned_rank=ranker and not features)
        made = make_policy(own_settings, "heuristic", kind="original" if index == 0 else "entity")
        policies[index] = HeuristicPolicy(replace(made.config, **own(index)))
        return policies[index]

    driver = Driver(settings, mode="local", planner=HeuristicPlanner(rule) if rule else None,
                    policy_factory=policy if features or not ranker or policy_args else None)
    search, rows = driver.search, []
    counted = driver.executor.retriever.backend_requests  # requests reaching the backends

    def keep(question, **kw):
        policies.clear()
        before = dict(counted)
        result = search(question, **kw)
        rows.append({"question": question, "fused": result.ranked_chunk_ids,
                     "backend": {k: v - before.get(k, 0) for k, v in counted.items()
                                 if v - before.get(k, 0)},
                     "fetch_cache": getattr(driver.executor, "last_cache_stats", {}),
                     "latency_s": result.metrics["latency_s"], "branches": [{
                         "index": b.index, "kind": b.kind, "weight": b.weight,
                         "parent": b.parent, "reason": b.reason,
                         "subquery": b.subquery, "status": b.status,
                         "termination": b.termination, "ranked": b.ranked_chunk_ids,
                         "retrieved": b.retrieved_ids, "pruned": b.pruned_ids,
                         "final_context": b.final_context_ids, "tokens_read": b.tokens_read,
                         "context_tokens_final": b.context_tokens_final,
                         "turns": b.turns, "latency_s": b.latency_s,
                         "searches": [[c["tool"], str(c["args"].get("query")
                                                      or c["args"].get("pattern")
                                                      or c["args"].get("doc_id"))]
                                      for c in b.trace if c.get("kind") == "call" and c.get(
                                          "tool") in ("search_corpus", "grep_corpus",
                                                      "read_document")]}
                         for b in result.branches]})
        if features:  # every scored chunk's ranker features at the end of each branch
            from branchsearch.workers.heuristic.ranker import episode_features

            for b in rows[-1]["branches"]:
                p = policies.get(b["index"])
                b["features"] = ({c: [round(v, 5) for v in x] for c, x in
                                  episode_features(p).items()} if p is not None else {})
                b["tail"] = sorted(p.tail_ids) if p is not None else []  # rank.hold_back
        return result

    driver.search = keep
    docstore = DocStore(settings.index_dir / "docs.sqlite")
    started = time.time()
    try:
        res = eval_agent(driver, queries, max_branches=branches, docstore=docstore)
    finally:
        docstore.close()
        driver.close()
    for row, pq in zip(rows, res["per_query"]):
        row["id"], row["gold"] = pq["id"], pq["gold"]
    Path(out).write_text(json.dumps({"dataset": dataset, "index": index, "home": home,
                                     "eval": {k: v for k, v in res.items() if k != "per_query"},
                                     "seconds": round(time.time() - started), "rows": rows}))


def load_dump(path: str) -> dict:
    """A dump `run` wrote; a file that is not one is a ValueError naming it."""
    try:
        dump = json.loads(Path(path).read_text())
    except ValueError as exc:
        raise ValueError(f"{path} is not JSON ({exc})") from None
    if not (isinstance(dump, dict) and isinstance(dump.get("rows"), list) and dump["rows"]
            and "index" in dump):
        raise ValueError(f"{path} is not a dump of `branch_eval.py run` (no index or no rows)")
    return dump


# --- planner rules: which of the planned branches a rule launches ------------------------------

def plan_rule(name: str, max_branches: int = 3):
    """A planner rule of `orchestrator.plan` (`v1`, `kinds:a,b`, ...): the branches
    `plan.select` launches from the dump's branches taken as the candidates, at most
    `max_branches` (exact on a dump run with `--rule candidates`: every candidate branch ran).
    `all`: every planned branch. `no-lone-entity`: an entity branch only when the question
    names two or more entities (a lone entity branch restates the question, whose own branch
    already searches every entity it names). `one-entity`: as no-lone-entity, and of two
    entity branches only the first (the planner's order)."""
    from branchsearch.orchestrator.plan import RULES, SubQuery, select

    if name in RULES or name.startswith("kinds:"):
        select([SubQuery("q")], name, 1)  # an unknown kind fails here

        def chosen(branches: list[dict]) -> list[dict]:
            subs = [SubQuery(b["subquery"], b["weight"], b["kind"]) for b in branches]
            by_sub = {(b["subquery"], b["kind"]): b for b in reversed(branches)}
            return [by_sub[(s.text, s.kind)] for s in select(subs, name, max_branches)]
        return chosen

    if name not in ("all", "no-lone-entity", "one-entity"):
        raise ValueError(f"unknown --plan {name!r}: all, no-lone-entity, one-entity, "
                         f"{', '.join(RULES)} or kinds:<kind>,...")

    def keep(branches: list[dict]) -> list[dict]:
        entity = [b for b in branches if b["kind"] == "entity"]
        if name == "all":
            return branches
        drop = set()
        if len(entity) == 1:
            drop.add(entity[0]["index"])
        elif name == "one-entity":
            drop |= {b["index"] for b in entity[1:]}
        return [b for b in branches if b["index"] not in drop]
    return keep


def fused(row: dict, keep, share: float, k: float, agreement: float,
          tail: tuple[int, int] | None = None) -> list[str]:
    ok = [b for b in keep(row["branches"]) if b["status"] == "ok" and b["ranked"]]
    anchor = next((i for i, b in enumerate(ok) if b["kind"] == "original"), None)
    if tail is not None and anchor is not None:
        return novel_tail(ok[anchor]["ranked"], [b["ranked"] for i, b in enumerate(ok)
                                                 if i != anchor], *tail)
    # by document, as orchestrator.result.fuse_branches; each shown by its first chunk
    fused_docs, chunks = fuse_documents([b["ranked"] for b in ok], doc_of,
                                        weights=[b["weight"] for b in ok], anchor=anchor, k=k,
                                        share=share, agreement=agreement, limit=10)
    return [chunks[d.id][0] for d in fused_docs]


def novel_tail(anchor: list[str], others: list[list[str]], head: int, novel: int,
               limit: int = 10) -> list[str]:
    """The anchor's first `head` documents; then up to `novel` documents that are in another
    branch's top 10 and not in the anchor's, taken by rank round the branches; then the
    anchor's rest and the other branches' rest. One chunk per document."""
    out, seen = [], set()

    def add(chunk_id: str) -> bool:
        if doc_of(chunk_id) in seen or len(out) >= limit:
            return False
        seen.add(doc_of(chunk_id))
        out.append(chunk_id)
        return True

    for c in anchor:
        if len(out) >= head:
            break
        add(c)
    own = {doc_of(c) for c in anchor[:10]}
    fresh = sorted((r, i, c) for i, lst in enumerate(others)
                   for r, c in enumerate(lst[:10]) if doc_of(c) not in own)
    taken = 0
    for _, _, c in fresh:
        if taken >= novel:
            break
        taken += add(c)
    for c in anchor + [c for lst in others for c in lst]:
        add(c)
    return out


def score(rows: list[dict], ranking, branches, titles=None, texts=None) -> dict:
    """Means over queries of the measures `eval_agent` reports, for a ranking function and
    the branches (a function of the row) whose trajectories count."""
    out, classes = Counter(), Counter()
    for row in rows:
        used = branches(row)
        ranked = ranking(row)
        gold = row["gold"] if isinstance(row["gold"], dict) else dict.fromkeys(row["gold"], 1)
        m = single_shot_metrics(doc_ranking(ranked), gold)
        t = Trajectory(ranked, list(dict.fromkeys(c for b in used for c in b["retrieved"])),
                       list(dict.fromkeys(c for b in used for c in b["pruned"])),
                       list(dict.fromkeys(c for b in used for c in b["final_context"])))
        m |= agent_measures(t, gold, 5)
        # every gold document retrieved somewhere in the trajectories: what a perfect final
        # ranking of everything found could put in a top 10 (the ceiling of any fusion)
        positive = {g for g, v in gold.items() if v > 0}
        m["all_found"] = float(bool(positive) and positive <= {doc_of(c) for c in t.retrieved})
        queries = Counter((tool, q.lower()) for b in used for tool, q in
                          {(s[0], s[1]) for s in b["searches"]})
        m |= {"tokens_read": sum(b["tokens_read"] for b in used),
              "searches": sum(queries.values()),
              "duplicate_searches": sum(v - 1 for v in queries.values()),
              "branches": len(used), "context_tokens_final": sum(
                  b.get("context_tokens_final", 0) for b in used) / max(len(used), 1),
              "latency_s": sum(b.get("latency_s", 0) for b in used)}
        for name in ("all_recall@5", "all_recall@10", "all_found", "recall@5", "ndcg@10",
                     "trajectory_recall",
                     "tokens_read", "searches", "duplicate_searches", "branches",
                     "prune_accuracy", "context_tokens_final", "latency_s"):
            out[name] += m[name]
        if titles is not None:
            text = " ".join(texts.get(c, "") for c in t.retrieved)
            classes[attribute(t, gold, titles, text, 5)[0]] += 1
    n = max(len(rows), 1)
    res = {name: round(v / n, 4) for name, v in out.items()}
    if titles is not None:
        res["attribution"] = {c: classes.get(c, 0) for c in
                              ("ok", "retrieval_miss", "premature_prune", "early_stop",
                               "overload")}
    return res


def docstore_text(dump: dict):
    db = sqlite3.connect(f"file:{Path(dump['home']) / 'indexes' / dump['index'] / 'docs.sqlite'}"
                         "?mode=ro", uri=True)
    titles = dict(db.execute("select doc_id, title from docs"))
    texts = dict(db.execute("select chunk_id, text from chunks"))
    db.close()
    return titles, texts


def table(paths: list[str], share: float, k: float, agreement: float, plan: str,
          max_branches: int = 3, tail: tuple[int, int] | None = None) -> list[dict]:
    keep = plan_rule(plan, max_branches)
    out = []
    for path in paths:
        dump = load_dump(path)
        titles, texts = docstore_text(dump)
        rows = dump["rows"]
        one = score(rows, lambda r: r["branches"][0]["ranked"], lambda r: r["branches"][:1],
                    titles, texts)
        many = score(rows, lambda r: fused(r, keep, share, k, agreement, tail),
                     lambda r: keep(r["branches"]), titles, texts)
        backend = Counter()  # backend requests per question (dumps that counted them)
        for row in rows:
            backend.update(row.get("backend", {}))
        out.append({"dump": path, "index": dump["index"], "queries": len(rows),
                    "one_branch": one, "branches": many,
                    "backend_requests": {k: round(v / max(len(rows), 1), 2)
                                         for k, v in sorted(backend.items())},
                    "params": {"share": share, "k": k, "agreement": agreement, "plan": plan,
                               "branches": max_branches, "tail": tail}})
    return out


def ceilings(paths: list[str]) -> list[dict]:
    """Per candidate kind of a `--rule candidates` dump: the question's branch plus every branch
    of that kind (`+kind`), and all the candidates (`all`). `union_top10`: share of questions
    whose gold all lie in the union of those branches' top 10s (what a fusion could at most
    put in a top 10); `all_found`: all gold retrieved somewhere in their trajectories;
    `trajectory_recall`: mean share of gold retrieved; `tokens_read`: mean per question."""
    out = []
    for path in paths:
        dump = load_dump(path)
        rows = dump["rows"]
        kinds = sorted({b["kind"] for r in rows for b in r["branches"]} - {"original"})

        def reach(use) -> dict:
            top = found = share = tokens = 0.0
            for row in rows:
                gold = set(row["gold"])
                used = [b for b in row["branches"] if b["kind"] == "original" or use(b)]
                in_top = {doc_of(c) for b in used for c in b["ranked"][:10]}
                seen = in_top | {doc_of(c) for b in used for c in b["retrieved"]}
                top += gold <= in_top
                found += gold <= seen
                share += len(gold & seen) / max(len(gold), 1)
                tokens += sum(b["tokens_read"] for b in used)
            n = max(len(rows), 1)
            return {"union_top10": round(top / n, 3), "all_found": round(found / n, 3),
                    "trajectory_recall": round(share / n, 3), "tokens_read": round(tokens / n)}

        res = {"original": reach(lambda b: False)}
        for kind in kinds:
            res["+" + kind] = reach(lambda b, kind=kind: b["kind"] == kind) | {
                "questions": sum(any(b["kind"] == kind for b in r["branches"]) for r in rows)}
        res["all"] = reach(lambda b: True)
        out.append({"dump": path, "index": dump["index"], "queries": len(rows), "kinds": res})
    return out


def pair(one_path: str, other_path: str, share: float, k: float) -> dict:
    """ONE's and OTHER's question branch alone, and fused with ONE's branch as the anchor."""
    one, other = (load_dump(p)["rows"] for p in (one_path, other_path))
    if [r["question"] for r in one] != [r["question"] for r in other]:
        raise ValueError("pair: the two dumps must hold the same questions in the same order")

    def fused_pair(a: list[str], b: list[str]) -> list[str]:
        docs, chunks = fuse_documents([a, b], doc_of, anchor=0, k=k, share=share, limit=10)
        return [chunks[d.id][0] for d in docs]

    both = [dict(r, branches=[r["branches"][0], o["branches"][0]],
                 fused=fused_pair(r["branches"][0]["ranked"], o["branches"][0]["ranked"]))
            for r, o in zip(one, other)]
    keys = ("all_recall@5", "all_recall@10", "all_found", "tokens_read")
    out = {"one": score(one, lambda r: r["branches"][0]["ranked"], lambda r: r["branches"][:1]),
           "other": score(other, lambda r: r["branches"][0]["ranked"],
                          lambda r: r["branches"][:1])}
    out = {name: {key: m[key] for key in keys} for name, m in out.items()}
    m = score(both, lambda r: r["fused"], lambda r: r["branches"])
    out["pair"] = {key: m[key] for key in keys}
    out["other_tokens_over_one"] = round(out["other"]["tokens_read"] /
                                         max(out["one"]["tokens_read"], 1), 3)
    out["params"] = {"share": share, "k": k}
    return out


GRID = {"share": (0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0), "k": (2, 5, 10, 20, 60),
        "agreement": (0.0, 0.2, 0.5, 1.0)}


def fit(paths: list[str], on: str, plan: str) -> dict:
    """Choose (share, k, agreement) by AR@5, then AR@10, on the dump whose index is `on`;
    ties go to the smaller share, k and agreement (the simpler fusion). Report all dumps."""
    keep = plan_rule(plan)
    dumps = {d["index"]: d["rows"] for d in map(load_dump, paths)}
    results = {}
    for share in GRID["share"]:
        for k in GRID["k"]:
            for agreement in GRID["agreement"]:
                results[(share, k, agreement)] = {
                    name: score(rows, lambda r: fused(r, keep, share, k, agreement),
                                lambda r: keep(r["branches"]))
                    for name, rows in dumps.items()}
    best = max(results, key=lambda p: (results[p][on]["all_recall@5"],
                                       results[p][on]["all_recall@10"], -p[0], -p[1], -p[2]))
    return {"fit_on": on, "plan": plan, "chosen": dict(zip(("share", "k", "agreement"), best)),
            "reported": {name: {m: results[best][name][m] for m in
                                ("all_recall@5", "all_recall@10")} for name in dumps}}


def policy_arg(item: str) -> tuple[str, object]:
    """`NAME=VALUE` of a --policy-arg, the value read as the type of HeuristicPolicy's field
    NAME (`branch.NAME`: the same field): a number, true/false, or a word (hop_mode=hybrid).
    An unknown field or a value of the wrong type is an error here, not a silent setting."""
    import dataclasses

    from branchsearch.workers.heuristic import HeuristicConfig

    name, sep, text = item.partition("=")
    fields = {f.name: f for f in dataclasses.fields(HeuristicConfig)}
    field = fields.get(name.removeprefix("branch."))
    if not sep or field is None or field.default is dataclasses.MISSING:  # not state
        raise ValueError(f"--policy-arg {item!r}: NAME=VALUE with NAME a HeuristicPolicy field")
    default = field.default
    if isinstance(default, bool):
        if text.lower() not in ("true", "false"):
            raise ValueError(f"--policy-arg {item!r}: {name} takes true or false")
        return name, text.lower() == "true"
    if isinstance(default, (int, float)):
        try:
            value = int(text) if isinstance(default, int) else float(text)
        except ValueError:
            raise ValueError(f"--policy-arg {item!r}: {name} takes a number") from None
        if not math.isfinite(value) or (isinstance(default, int) and value < 0):
            raise ValueError(f"--policy-arg {item!r}: {name} takes a finite number"
                             + (" >= 0" if isinstance(default, int) else ""))
        return name, value
    if name.removeprefix("branch.") == "hop_mode" and text and text not in MODES:
        raise ValueError(f"--policy-arg {item!r}: hop_mode is one of {', '.join(MODES)} or "
                         "empty")
    return name, text


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=("run", "table", "fit", "ceilings", "pair"))
    ap.add_argument("args", nargs="+")
    ap.add_argument("--branches", type=int, default=3)
    ap.add_argument("--home", default=".branchsearch")
    ap.add_argument("--share", type=float, default=None,
                    help="the non-anchor branches' share (default: 0.3 for table, 0 for pair)")
    ap.add_argument("--k", type=float, default=5)
    ap.add_argument("--agreement", type=float, default=0.0)
    ap.add_argument("--plan", default="all")
    ap.add_argument("--on", default="")
    ap.add_argument("--tail", default="", metavar="M,P",
                    help="table: the novel-tail fusion (anchor's M documents, then up to P "
                         "the anchor's top 10 lacks) instead of fusion.anchored")
    ap.add_argument("--rule", default="",
                    help="run: the planner rule (orchestrator.plan.RULES); `candidates` runs "
                         "every candidate branch (with --branches 9) for `table --plan RULE`")
    ap.add_argument("--features", action="store_true",
                    help="run: keep every scored chunk's ranker features (learned_rank off)")
    ap.add_argument("--policy-arg", action="append", default=[], metavar="NAME=VALUE",
                    help="run: a HeuristicPolicy field, e.g. question_k=10 (repeatable); "
                         "branch.NAME=NUMBER: only in the branches other than the question's")
    ap.add_argument("--ranker", choices=("on", "off"), default="on",
                    help="run: the heuristic's learned final ranking (workers/ranker.py)")
    a = ap.parse_args()
    try:
        _command(a)
    except (OSError, ValueError) as exc:  # a dump missing, not JSON or not one `run` wrote;
        # a bad argument: one line, as the CLI's errors are
        print(f"branch_eval: {a.cmd}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


WANT = {"run": (3, "DATASET INDEX OUT.json"), "pair": (2, "ONE.json OTHER.json")}


def _command(a) -> None:
    plan_rule(a.plan)
    if a.cmd in WANT and len(a.args) != WANT[a.cmd][0]:
        raise ValueError(f"takes {WANT[a.cmd][1]}, got {len(a.args)} argument(s)")
    share = a.share if a.share is not None else (0.0 if a.cmd == "pair" else 0.3)
    if a.cmd == "run":
        args = dict(policy_arg(x) for x in a.policy_arg)
        run(*a.args, a.branches, a.home, a.features, a.ranker == "on", args, a.rule)
    elif a.cmd == "table":
        tail = tuple(int(x) for x in a.tail.split(",")) if a.tail else None
        print(json.dumps(table(a.args, share, a.k, a.agreement, a.plan, a.branches, tail),
                         indent=1))
    elif a.cmd == "pair":
        print(json.dumps(pair(*a.args, share, a.k), indent=1))
    elif a.cmd == "ceilings":
        print(json.dumps(ceilings(a.args), indent=1))
    else:
        print(json.dumps(fit(a.args, a.on, a.plan), indent=1))

if __name__ == "__main__":
    main()
