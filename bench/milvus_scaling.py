"""Dense search latency vs corpus size: Milvus Lite (FLAT, exact) vs a Milvus server (HNSW).

    python bench/milvus_scaling.py [--sizes 10000 50000 100000] [--queries 200] [--dim 384]
                                   [--uri http://HOST:19530]   # default: start the `milvus`
                                                               # package's server here

Vectors are synthetic, not a model's: unit vectors drawn around 2,000 random centroids (noise
0.6 of the centroid norm), so that, like real sentence embeddings, they are clustered; queries
are perturbed copies of stored vectors. Search cost depends on N, dim and the index, not on what
the vectors mean; HNSW recall on these is indicative only (real embeddings: measure on your data).
Each size goes into a fresh collection through `infra.stores.milvus.MilvusStore` (the code the
retriever uses): insert time, index build (the server indexes sealed segments after a flush),
then --queries searches with k=10 as the agent issues them, one at a time, for each caller
(public: no groups, the agent's default; one group; two groups; admin) with 20 excluded ids
(10 of the caller's exact top 30, 10 random), in two filter forms on the same collection:
`before` = the per-row filters (`array_contains_any(acl, [...]) and chunk_id not in [...]`),
`after` = what the store does now (`acl_key` filter, exclusions dropped from a deeper search).
Rows: 80 % public, 10 % group g1, 5 % g2, 5 % g1+g2. Per caller and form: median and p95
latency, CPU ms of the Milvus process per search, recall@10 against exact numpy search, and
for `after` the share of queries whose top 10 equals `before`'s. One run per size; the machine
may be shared (load printed). Projections to larger N are printed separately and marked as
such.

Large sizes do not fit one 10-minute run on 2 cores, so a run can stop inserting after
--insert-budget-s and a later run with the same --workdir resumes (the collection and the
inserted count are kept there; insert seconds add up). Only a complete collection is searched.
--keep leaves it for a later search-only run (e.g. with other --ef values).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from branchsearch.infra.stores.acl import ACL_ALL  # noqa: E402
from branchsearch.infra.stores.protocols import IndexedChunk  # noqa: E402
from branchsearch.infra.stores.milvus import IndexSpec, MilvusStore  # noqa: E402


CONSISTENCY = "Bounded"
CALLERS = {"public": None, "g1": ["g1"], "g1+g2": ["g1", "g2"], "admin": [ACL_ALL]}


def acl_of(i: int) -> tuple[str, ...]:
    """Row i's groups: 80 % public, 10 % g1, 5 % g2, 5 % g1 and g2."""
    return (("g1",), ("g2",), ("g1", "g2"), ())[0 if i % 10 == 0 else 1 if i % 20 == 1
                                                else 2 if i % 20 == 11 else 3]


def visible(n: int, groups) -> np.ndarray:
    """Which of rows 0..n-1 a caller with `groups` sees (the ACL rule, by numpy)."""
    if groups == [ACL_ALL]:
        return np.ones(n, bool)
    i = np.arange(n)
    g1, g2 = i % 10 == 0, (i % 20 == 1)
    both = i % 20 == 11
    seen = ~(g1 | g2 | both)
    if groups and "g1" in groups:
        seen |= g1 | both
    if groups and "g2" in groups:
        seen |= g2 | both
    return seen


def vectors(n: int, dim: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centroids = rng.standard_normal((2000, dim)).astype(np.float32)
    centroids /= np.linalg.norm(centroids, axis=1, keepdims=True)
    out = np.empty((n, dim), dtype=np.float32)
    for start in range(0, n, 50_000):
        m = min(50_000, n - start)
        v = centroids[rng.integers(0, len(centroids), m)] + \
            0.6 / np.sqrt(dim) * rng.standard_normal((m, dim)).astype(np.float32)
        out[start:start + m] = v / np.linalg.norm(v, axis=1, keepdims=True)
    return out


def rss_mb(pid: int | None) -> float | None:
    if not pid:
        return None
    try:
        import psutil

        proc = psutil.Process(pid)
        return round(sum(p.memory_info().rss for p in [proc, *proc.children(True)]) / 2**20, 0)
    except Exception:
        return None


def cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of a process and its children so far."""
    if not pid:
        return None
    try:
        import psutil

        procs = [psutil.Process(pid)]
        procs += procs[0].children(True)
        return sum(p.cpu_times().user + p.cpu_times().system for p in procs)
    except Exception:
        return None


def lite_pid(path: str) -> int | None:
    try:
        import psutil

        for p in psutil.process_iter(["cmdline"]):
            if any(path in (c or "") for c in p.info["cmdline"] or []) and p.pid != os.getpid():
                return p.pid
    except Exception:
        pass
    return None


def _state(workdir: Path, kind: str, n: int) -> tuple[Path, dict]:
    path = workdir / f"scale_{kind}_{n}.json"
    return path, (json.loads(path.read_text()) if path.exists() else
                  {"inserted": 0, "insert_s": 0.0, "index_build_s": 0.0, "runs": 0})


def run(kind: str, uri: str, n: int, dim: int, queries: int, pid: int | None, *,
        workdir: Path, budget_s: float = 0, keep: bool = False, ef: int = 64,
        insert_only: bool = False) -> dict | None:
    """One size: insert (resuming), build, search. None when the insert budget ran out first."""
    state_path, state = _state(workdir, kind, n)
    spec = IndexSpec("FLAT" if kind == "lite" else "HNSW", consistency=CONSISTENCY, ef=ef)
    store = MilvusStore(uri, dim, collection=f"scale_{kind}_{n}", index=spec)
    done = False
    try:
        data = vectors(n, dim)
        t = time.perf_counter()
        step = 1000
        state["runs"] += 1
        for s in range(state["inserted"], n, step):
            chunks = [IndexedChunk(f"d{i}#p0", f"d{i}", "", "", acl_of(i))
                      for i in range(s, min(s + step, n))]
            store._client.insert(store.collection, store.rows(chunks, data[s:s + step]))
            state["inserted"] = min(s + step, n)
            if budget_s and time.perf_counter() - t > budget_s and state["inserted"] < n:
                break
        state["insert_s"] += time.perf_counter() - t
        state_path.write_text(json.dumps(state))
        if state["inserted"] < n or insert_only:
            print(f"{kind} {n:,}: {state['inserted']:,} inserted so far "
                  f"({state['insert_s']:.0f} s); run again with the same --workdir", flush=True)
            keep = True
            return None
        t = time.perf_counter()
        if store.server:  # seal segments, wait for the HNSW build (again: compactions)
            first = not state.get("indexed")
            if first:
                store._client.flush(store.collection)
            _wait_index(store)
            if first:
                state["index_build_s"] += time.perf_counter() - t
                state["indexed"] = True
                state_path.write_text(json.dumps(state))
        t = time.perf_counter()
        if not store.server:
            store._client.load_collection(store.collection)
        rng = np.random.default_rng(1)
        picks = rng.integers(0, n, queries)
        qv = data[picks] + 0.3 / np.sqrt(dim) * rng.standard_normal((queries, dim)).astype(
            np.float32)
        qv /= np.linalg.norm(qv, axis=1, keepdims=True)
        store.search(qv[0], 10)  # warm (load)
        load_s = time.perf_counter() - t
        exact = data @ qv.T  # (n, queries)
        owner = pid or lite_pid(uri)
        out = {"backend": kind, "index": store.index_kind, "n": n, "dim": dim,
               "ef": ef if store.index_kind == "HNSW" else None,
               "consistency": CONSISTENCY if store.server else "-",
               "insert_s": round(state["insert_s"], 1), "insert_runs": state["runs"],
               "insert_rows_s": round(n / state["insert_s"], 0),
               "index_build_s": round(state["index_build_s"], 1),
               "load_s": round(round(load_s, 1), 1), "queries": queries,
               "keyed": store.keyed, "server_rss_mb": rss_mb(owner),
               "unindexed_rows": unindexed_rows(store) if store.server else None,
               "vectors_mb": round(n * dim * 4 / 2**20, 0), "callers": {}}
        for name, groups in CALLERS.items():
            seen = visible(n, groups)
            excludes, truths = [], []
            for j in range(queries):
                scores = np.where(seen, exact[:, j], -np.inf)
                top30 = np.argpartition(-scores, 30)[:30]
                top30 = top30[np.argsort(-scores[top30])]
                ex = np.concatenate([top30[::3], rng.integers(0, n, 10)])
                excludes.append([f"d{i}#p0" for i in ex])
                scores[ex] = -np.inf
                truths.append({f"d{i}#p0" for i in np.argpartition(-scores, 10)[:10]})
            row, tops = {}, {}
            for form in ("before", "after"):
                lat, recall, tops[form] = [], [], []
                store.search(qv[-1], 10, exclude_ids=excludes[-1], acl_groups=groups,
                             per_row=form == "before")  # warm: a caller's first search reads
                cpu0 = cpu_s(owner)                     # the group sets (once per process)
                for j in range(queries):
                    t = time.perf_counter()
                    hits = store.search(qv[j], 10, exclude_ids=excludes[j], acl_groups=groups,
                                        per_row=form == "before")
                    lat.append((time.perf_counter() - t) * 1000)
                    ids = [h.chunk_id for h in hits]
                    tops[form].append(ids)
                    recall.append(len(truths[j] & set(ids)) / 10)
                cpu1 = cpu_s(owner)
                lat.sort()
                row[form] = {
                    "ms_median": round(statistics.median(lat), 2),
                    "ms_p95": round(lat[int(0.95 * len(lat))], 2),
                    # CPU seconds the Milvus process (Lite server / milvus binary) per search
                    "server_cpu_ms": (round(1000 * (cpu1 - cpu0) / queries, 2)
                                      if cpu0 is not None and cpu1 is not None else None),
                    "recall_at_10": round(float(np.mean(recall)), 4)}
            row["after"]["same_top10_as_before"] = round(float(np.mean(
                [a == b for a, b in zip(tops["after"], tops["before"])])), 4)
            row["after"]["same_set_as_before"] = round(float(np.mean(
                [set(a) == set(b) for a, b in zip(tops["after"], tops["before"])])), 4)
            out["callers"][name] = row
            print(f"  {kind} {n:,} {name}: {json.dumps(row)}", flush=True)
        public = out["callers"]["public"]["after"]  # the agent's default caller, as before
        out |= {"search_ms_median": public["ms_median"], "search_ms_p95": public["ms_p95"],
                "recall_at_10": public["recall_at_10"]}  # (bench/scaling_model.py reads these)
        done = True
        return out
    finally:
        if done and not keep:
            store.drop()
            state_path.unlink(missing_ok=True)
        store.close()


MIN_INDEXED_ROWS = 1024  # the server's indexCoord.segment.minSegmentNumRowsToEnableIndex


def unindexed_rows(store, least: int = 0) -> int | None:
    """Rows the server's query node holds in segments without a vector index (searched by brute
    force): growing segments, segments too small to index, and sealed ones whose index (after a
    compaction) is not built or not loaded yet. `least`: count only segments of that many rows
    or more."""
    try:
        from pymilvus import connections, utility

        alias = "bench-segments"
        if not connections.has_connection(alias):
            connections.connect(alias, uri=store.uri)
        segs = utility.get_query_segment_info(store.collection, using=alias)
        return sum(s.num_rows for s in segs if not s.index_name and s.num_rows >= least)
    except Exception:
        return None


def _wait_index(store, timeout_s: float = 1800) -> None:
    """Until the HNSW index is built and loaded for every sealed segment: the index's
    `Finished` alone comes before compacted segments are indexed (measured at 1M: 12 of 24
    segments were searched by brute force right after it)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        info = store._client.describe_index(store.collection, "vector") or {}
        left = unindexed_rows(store, MIN_INDEXED_ROWS)
        # (`pending_index_rows` is no guide: it stayed at 692,800 of 1M after every loaded
        # segment had its index)
        if info.get("state") in ("Finished", 3) and not left:
            return
        time.sleep(2)
    raise TimeoutError("index build did not finish")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 50_000, 100_000])
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--uri", default="")
    ap.add_argument("--pid", type=int, default=None, help="the --uri server's PID (memory)")
    ap.add_argument("--backends", nargs="+", default=["lite", "server"])
    ap.add_argument("--consistency", default="Bounded", help="server searches: Bounded|Strong")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="keeps Lite files and insert progress between runs (default: a temp dir)")
    ap.add_argument("--insert-budget-s", type=float, default=0,
                    help="stop inserting after this long; a later run resumes (0: no limit)")
    ap.add_argument("--keep", action="store_true", help="keep the collections after searching")
    ap.add_argument("--ef", type=int, default=64, help="HNSW search breadth")
    ap.add_argument("--insert-only", action="store_true",
                    help="insert (resuming), then stop; a later run builds and searches")
    ap.add_argument("--json", type=Path, default=None, help="append each row here (JSON lines)")
    args = ap.parse_args()
    global CONSISTENCY
    CONSISTENCY = args.consistency
    print(f"host: {platform.node()}, {os.cpu_count()} cores; load average {os.getloadavg()}",
          flush=True)
    rows = []
    tmp = args.workdir or Path(tempfile.mkdtemp(prefix="bench-milvus-"))
    tmp.mkdir(parents=True, exist_ok=True)
    opts = {"workdir": tmp, "budget_s": args.insert_budget_s, "keep": args.keep, "ef": args.ef,
            "insert_only": args.insert_only}

    def record(row):
        if row is None:
            return
        row |= {"load": [round(x, 2) for x in os.getloadavg()]}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    if "lite" in args.backends:
        for n in args.sizes:
            record(run("lite", str(tmp / f"lite{n}.db"), n, args.dim, args.queries, None,
                       **opts))
    if "server" in args.backends:
        if args.uri:
            servers = [(args.uri, args.pid)]
        else:
            from milvus_server import start_milvus_server

            ctx = start_milvus_server(tmp / "server")
            handle = ctx.__enter__()
            print(f"milvus server {handle.uri} (PID {handle.pid}) started in "
                  f"{handle.started_s:.0f} s", flush=True)
            servers = [(handle.uri, handle.pid)]
        try:
            for n in args.sizes:
                record(run("server", servers[0][0], n, args.dim, args.queries,
                           servers[0][1], **opts))
        finally:
            if not args.uri:
                ctx.__exit__(None, None, None)
    print("\n| backend | index | N | caller | before ms median / p95 | before CPU ms | "
          "after ms median / p95 | after CPU ms | recall@10 before / after | same top 10 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        for name, c in r["callers"].items():
            b, a = c["before"], c["after"]
            print(f"| {r['backend']} | {r['index']} | {r['n']:,} | {name} | {b['ms_median']} / "
                  f"{b['ms_p95']} | {b['server_cpu_ms']} | {a['ms_median']} / {a['ms_p95']} | "
                  f"{a['server_cpu_ms']} | {b['recall_at_10']} / {a['recall_at_10']} | "
                  f"{a['same_top10_as_before']} |")
    _project(rows)


def _project(rows: list[dict]) -> None:
    """PROJECTED figures: FLAT grows linearly in N (fit through the measured sizes); HNSW grows
    about logarithmically (fit a + b·log N). Marked as projections."""
    print("\nPROJECTED (not measured): public caller's search ms median (after) at larger N, "
          "fitted on the sizes above")
    for backend in ("lite", "server"):
        pts = [(r["n"], r["callers"]["public"]["after"]["ms_median"]) for r in rows
               if r["backend"] == backend]
        if len(pts) < 2:
            continue
        n, ms = np.array([p[0] for p in pts], float), np.array([p[1] for p in pts], float)
        x = n if backend == "lite" else np.log(n)
        b, a = np.polyfit(x, ms, 1)
        for target in (1_000_000, 10_000_000):
            xt = target if backend == "lite" else np.log(target)
            print(f"  {backend} ({'FLAT, linear' if backend == 'lite' else 'HNSW, log'} fit): "
                  f"N={target:,}: ~{a + b * xt:.1f} ms (projected)")


if __name__ == "__main__":
    main()
