"""Dense search latency vs corpus size: Milvus Lite (FLAT, exact) vs a Milvus server (HNSW).

    python bench/milvus_scaling.py [--sizes 10000 50000 100000] [--queries 200] [--dim 384]
                                   [--uri http://HOST:19530]   # default: start the `milvus`
                                                               # package's server here

Vectors are synthetic, not a model's: unit vectors drawn around 2,000 random centroids (noise
0.6 of the centroid norm), so that, like real sentence embeddings, they are clustered; queries
are perturbed copies of stored vectors. Search cost depends on N, dim and the index, not on what
the vectors mean; HNSW recall on these is indicative only (real embeddings: measure on your data).
Each size goes into a fresh collection through `infra.stores.milvus.MilvusStore` (the code the retriever
uses): insert time, index build (the server indexes sealed segments after a flush), then
--queries searches with k=10 as the agent issues them (with an ACL filter and 20 excluded ids),
one at a time; median and p90 latency, recall@10 against exact numpy search, and the resident
memory of the server process. One run per size; the machine may be shared (load printed).
Projections to larger N are printed separately and marked as such.

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

from branchsearch.infra.stores.acl import ACL_ALL; from branchsearch.infra.stores.protocols import IndexedChunk  # noqa: E402
from branchsearch.infra.stores.milvus import IndexSpec, MilvusStore  # noqa: E402


CONSISTENCY = "Bounded"


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
        insert_only: bool = False, unfiltered: bool = False) -> dict | None:
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
            chunks = [IndexedChunk(f"d{i}#p0", f"d{i}", "", "", ("g",) if i % 10 == 0 else ())
                      for i in range(s, min(s + step, n))]
            store._client.insert(store.collection, [
                {"chunk_id": c.chunk_id, "doc_id": c.doc_id, "acl": c.acl_terms,
                 "vector": v.tolist()} for c, v in zip(chunks, data[s:s + step])])
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
        if store.server and not state.get("indexed"):  # seal segments, wait for the HNSW build
            store._client.flush(store.collection)
            _wait_index(store)
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
        lat, recall = [], []
        exact = data @ qv.T  # (n, queries)
        public = np.arange(n) % 10 != 0
        owner = pid or lite_pid(uri)
        cpu0, client0 = cpu_s(owner), time.process_time()
        for j in range(queries):
            excluded = rng.integers(0, n, 20)
            exclude = [f"d{i}#p0" for i in excluded]
            t = time.perf_counter()
            hits = store.search(qv[j], 10, exclude_ids=exclude)
            lat.append((time.perf_counter() - t) * 1000)
            scores = np.where(public, exact[:, j], -np.inf)
            scores[excluded] = -np.inf
            truth = {f"d{i}#p0" for i in np.argpartition(-scores, 10)[:10]}
            recall.append(len(truth & {h.chunk_id for h in hits}) / 10)
        cpu1, client1 = cpu_s(owner), time.process_time()
        lat.sort()
        plain = {}
        if unfiltered:  # the same queries without the ACL filter and exclusions: filter cost
            plain_lat, c0 = [], cpu_s(owner)
            for j in range(queries):
                t = time.perf_counter()
                store.search(qv[j], 10, acl_groups=[ACL_ALL])
                plain_lat.append((time.perf_counter() - t) * 1000)
            c1 = cpu_s(owner)
            plain_lat.sort()
            plain = {"unfiltered_ms_median": round(statistics.median(plain_lat), 2),
                     "unfiltered_ms_p95": round(plain_lat[int(0.95 * queries)], 2),
                     "unfiltered_server_cpu_ms": (round(1000 * (c1 - c0) / queries, 2)
                                                  if c0 is not None and c1 is not None else None)}
        done = True
        return {"backend": kind, "index": store.index_kind, "n": n, "dim": dim,
                "ef": ef if store.index_kind == "HNSW" else None,
                "consistency": CONSISTENCY if store.server else "-",
                "insert_s": round(state["insert_s"], 1), "insert_runs": state["runs"],
                "insert_rows_s": round(n / state["insert_s"], 0),
                "index_build_s": round(state["index_build_s"], 1),
                "load_s": round(load_s, 1),
                "search_ms_median": round(statistics.median(lat), 2),
                "search_ms_p90": round(lat[int(0.9 * len(lat))], 2),
                "search_ms_p95": round(lat[int(0.95 * len(lat))], 2),
                "recall_at_10": round(float(np.mean(recall)), 4), "queries": queries,
                # CPU seconds the Milvus process (Lite server / milvus binary) spent per search
                "server_cpu_ms_per_search": (round(1000 * (cpu1 - cpu0) / queries, 2)
                                             if cpu0 is not None and cpu1 is not None else None),
                # this client, incl. the recall bookkeeping (an upper bound of the client's cost)
                "client_cpu_ms_per_search": round(1000 * (client1 - client0) / queries, 2),
                "server_rss_mb": rss_mb(pid or lite_pid(uri)),
                "vectors_mb": round(n * dim * 4 / 2**20, 0)} | plain
    finally:
        if done and not keep:
            store.drop()
            state_path.unlink(missing_ok=True)
        store.close()


def _wait_index(store, timeout_s: float = 1800) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        info = store._client.describe_index(store.collection, "vector") or {}
        total, done = info.get("total_rows", 0), info.get("indexed_rows", 0)
        if info.get("state") in ("Finished", 3) or (total and done >= total):
            return
        time.sleep(0.5)
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
    ap.add_argument("--unfiltered", action="store_true",
                    help="also search without the ACL filter and exclusions (their cost)")
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
            "insert_only": args.insert_only, "unfiltered": args.unfiltered}

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
    print("\n| backend | index | N | insert s | index build s | search ms median | p95 | "
          "recall@10 | RSS MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['backend']} | {r['index']} | {r['n']:,} | {r['insert_s']} | "
              f"{r['index_build_s']} | {r['search_ms_median']} | {r['search_ms_p95']} | "
              f"{r['recall_at_10']} | {r['server_rss_mb']} |")
    _project(rows)


def _project(rows: list[dict]) -> None:
    """PROJECTED figures: FLAT grows linearly in N (fit through the measured sizes); HNSW grows
    about logarithmically (fit a + b·log N). Marked as projections."""
    print("\nPROJECTED (not measured): search ms median at larger N, fitted on the sizes above")
    for backend in ("lite", "server"):
        pts = [(r["n"], r["search_ms_median"]) for r in rows if r["backend"] == backend]
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
