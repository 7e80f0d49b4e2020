#!/usr/bin/env python
"""Benchmark + correctness probe for embedded Milvus Lite (2.5.x C++ engine vs 3.x pure Python).

Runs unchanged under either of these environments:

    /tmp/mv25:  pip install "pymilvus<2.6" "milvus-lite==2.5.1" numpy
    /tmp/mv3:   pip install "milvus-lite>=3" pymilvus numpy

    python bench/milvus_lite_versions.py --n 10000 50000 --dim 384

Uses seeded random unit vectors (no embedding model). Each N gets a fresh
temp directory holding its own .db; one process per database file.
Prints a probe of accepted index types, a results table, and correctness checks.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback

T_PROC0 = time.perf_counter()
import numpy as np  # noqa: E402

T_IMPORT0 = time.perf_counter()
from pymilvus import DataType, MilvusClient  # noqa: E402
import pymilvus  # noqa: E402

T_IMPORT = time.perf_counter() - T_IMPORT0

try:
    from importlib.metadata import version as _pkg_version

    MILVUS_LITE_VERSION = _pkg_version("milvus-lite")
except Exception:  # pragma: no cover
    MILVUS_LITE_VERSION = "?"

class _ErrCapture(logging.Handler):
    def emit(self, record):
        if not record.name.startswith("milvus_lite"):
            return
        msg = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            msg += f" [{type(record.exc_info[1]).__name__}: {record.exc_info[1]}]"
        _LOG_ERRORS.append(msg)


_LOG_ERRORS: list[str] = []
_h = _ErrCapture(level=logging.WARNING)
logging.getLogger("milvus_lite").addHandler(_h)

GROUPS = ["groupA", "groupB", "groupC", "groupD", "groupE"]
CHUNKS_PER_DOC = 5
COLL = "chunks"


# ---------------------------------------------------------------- helpers
def rss_mb_tree(pid: int | None = None) -> float:
    """RSS (MiB) of this process plus all descendants (2.5.x runs a server subprocess)."""
    pid = pid or os.getpid()
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(d))
        except Exception:
            continue
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except Exception:
            pass
        stack.extend(children.get(p, []))
    return total / 1024.0


def n_child_procs() -> int:
    me, n = os.getpid(), 0
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                        n += 1
            except Exception:
                pass
    return n


def unit(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    v = rng.standard_normal((n, dim)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    return v


def pct(xs, q):
    return float(np.percentile(np.asarray(xs), q))


def hit_id(h):
    return h.get("id") if isinstance(h, dict) else h.id


def hit_entity(h):
    if isinstance(h, dict):
        return h.get("entity", h)
    return h.entity


def row_id(i: int) -> str:
    return f"doc_{i // CHUNKS_PER_DOC}#p{i % CHUNKS_PER_DOC}"


def acl_for(i: int, rng_acl: np.random.Generator) -> list[str]:
    k = int(rng_acl.integers(1, 3))  # 1 or 2 groups per chunk -> groupA ~ 36% of rows
    return sorted(rng_acl.choice(GROUPS, size=k, replace=False).tolist())


ZERO_ROW_BUG: list[str] = []


def safe_query(client: MilvusClient, **kw) -> list:
    """client.query that maps milvus-lite 2.5.1's zero-row error (collections with an ARRAY
    field raise 'Unsupported data type: 0' when nothing matches) to [] and records it."""
    try:
        return list(client.query(COLL, **kw))
    except Exception as e:  # noqa: BLE001
        if "Unsupported data type" in str(e):
            ZERO_ROW_BUG.append(str(e)[:120])
            return []
        raise


def count_rows(client: MilvusClient) -> int:
    try:
        r = client.query(COLL, filter="", output_fields=["count(*)"])
        return int(r[0]["count(*)"])
    except Exception:
        # fallback: stats (may lag deletes)
        return int(client.get_collection_stats(COLL).get("row_count", -1))


# ---------------------------------------------------------------- schema
def make_schema(client: MilvusClient, dim: int, with_array: bool):
    schema = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field("id", DataType.VARCHAR, is_primary=True, max_length=64)
    schema.add_field("doc_id", DataType.VARCHAR, max_length=64)
    schema.add_field("vec", DataType.FLOAT_VECTOR, dim=dim)
    schema.add_field("acl_str", DataType.VARCHAR, max_length=256)
    if with_array:
        schema.add_field("acl", DataType.ARRAY, element_type=DataType.VARCHAR,
                         max_capacity=8, max_length=32)
    return schema


def make_index(client: MilvusClient, index_type: str, metric: str):
    ip = client.prepare_index_params()
    params = {}
    if index_type == "IVF_FLAT":
        params = {"nlist": 128}
    elif index_type == "HNSW":
        params = {"M": 16, "efConstruction": 200}
    ip.add_index(field_name="vec", index_type=index_type, metric_type=metric, params=params)
    return ip


def probe_index_types(tmp: str, metric: str) -> list[tuple[str, str]]:
    """Which vector index types does this version accept (and what does describe_index say)?"""
    out = []
    path = os.path.join(tmp, "probe.db")
    t0 = time.perf_counter()
    client = MilvusClient(path)
    out.append(("(first MilvusClient() in process)", f"{time.perf_counter() - t0:.2f}s"))
    rng = np.random.default_rng(1)
    vecs = unit(rng, 300, 16)
    for it in ["FLAT", "AUTOINDEX", "IVF_FLAT", "HNSW", "DISKANN"]:
        name = f"p_{it.lower()}"
        _LOG_ERRORS.clear()
        try:
            sch = MilvusClient.create_schema(auto_id=False)
            sch.add_field("id", DataType.VARCHAR, is_primary=True, max_length=16)
            sch.add_field("vec", DataType.FLOAT_VECTOR, dim=16)
            ip = client.prepare_index_params()
            ip.add_index(field_name="vec", index_type=it, metric_type=metric,
                         params={"nlist": 8} if it == "IVF_FLAT" else
                         ({"M": 8, "efConstruction": 64} if it == "HNSW" else {}))
            client.create_collection(name, schema=sch, index_params=ip)
            client.insert(name, [{"id": str(i), "vec": vecs[i].tolist()} for i in range(300)])
            res = client.search(name, data=[vecs[0].tolist()], limit=1, anns_field="vec")
            ok = hit_id(res[0][0]) == "0"
            try:
                d = client.describe_index(name, index_name="vec")
            except Exception:
                idx = client.list_indexes(name)
                d = client.describe_index(name, index_name=idx[0]) if idx else {}
            try:
                client.flush(name)
            except Exception:
                pass
            time.sleep(0.5)  # give background index builders a moment to log failures
            bg = f"; background ERROR logged: {_LOG_ERRORS[0][:90]}" if _LOG_ERRORS else ""
            out.append((it, f"accepted (describe: index_type={d.get('index_type')}, "
                            f"self-hit={'ok' if ok else 'WRONG'}){bg}"))
        except Exception as e:  # noqa: BLE001
            out.append((it, f"REJECTED: {type(e).__name__}: {str(e)[:160]}"))
        finally:
            try:
                client.drop_collection(name)
            except Exception:
                pass
    client.close()
    return out


# ---------------------------------------------------------------- main bench
def run_one(n: int, dim: int, metric: str, index_type: str, nq: int, tmp_root: str,
            batch: int = 1000) -> dict:
    res: dict = {"n": n, "index": index_type, "checks": [], "notes": []}
    tmp = tempfile.mkdtemp(prefix=f"mlbench_{n}_", dir=tmp_root)
    path = os.path.join(tmp, "bench.db")

    t0 = time.perf_counter()
    client = MilvusClient(path)
    res["open_s"] = time.perf_counter() - t0
    res["child_procs"] = n_child_procs()

    # schema: try ARRAY<VARCHAR>, fall back to plain VARCHAR acl_str only
    with_array = True
    try:
        client.create_collection(COLL, schema=make_schema(client, dim, True),
                                 index_params=make_index(client, index_type, metric))
    except Exception as e:  # noqa: BLE001
        res["notes"].append(f"ARRAY field rejected ({type(e).__name__}: {str(e)[:120]}); "
                            f"using VARCHAR acl_str only")
        with_array = False
        try:
            client.drop_collection(COLL)
        except Exception:
            pass
        client.create_collection(COLL, schema=make_schema(client, dim, False),
                                 index_params=make_index(client, index_type, metric))
    res["array_field"] = with_array

    rng = np.random.default_rng(42)
    rng_acl = np.random.default_rng(7)
    vecs = unit(rng, n, dim)
    acls = [acl_for(i, rng_acl) for i in range(n)]
    ids = [row_id(i) for i in range(n)]

    # ---- insert
    t0 = time.perf_counter()
    for s in range(0, n, batch):
        rows = []
        for i in range(s, min(n, s + batch)):
            r = {"id": ids[i], "doc_id": ids[i].split("#")[0], "vec": vecs[i].tolist(),
                 "acl_str": "|" + "|".join(acls[i]) + "|"}
            if with_array:
                r["acl"] = acls[i]
            rows.append(r)
        client.insert(COLL, rows)
    ins = time.perf_counter() - t0
    res["insert_s"] = ins
    res["insert_rate"] = n / ins

    qrng = np.random.default_rng(123)
    queries = unit(qrng, nq, dim)
    warm = unit(np.random.default_rng(99), 5, dim)
    # exact ground truth (COSINE == IP on unit vectors)
    gt = np.argsort(-(queries @ vecs.T), axis=1)[:, :10]

    def search(q, flt="", out=None, limit=10):
        return client.search(COLL, data=[q.tolist()], limit=limit, filter=flt,
                             output_fields=out or [], anns_field="vec")[0]

    # ---- search straight after insert (data not flushed yet), then flush
    t0 = time.perf_counter()
    search(warm[0])
    res["first_search_s"] = time.perf_counter() - t0
    for w in warm[1:]:
        search(w)
    lat = []
    for q in queries[:20]:
        t0 = time.perf_counter()
        search(q)
        lat.append(time.perf_counter() - t0)
    res["plain_unflushed"] = lat
    t0 = time.perf_counter()
    try:
        client.flush(COLL)
    except Exception as e:  # noqa: BLE001
        res["notes"].append(f"flush failed: {type(e).__name__}: {str(e)[:120]}")
    res["flush_s"] = time.perf_counter() - t0
    for w in warm:  # warm-up after flush (index build may happen here)
        search(w)
    res["rss_after_insert_mb"] = rss_mb_tree()
    res["count_after_insert"] = count_rows(client)
    res["checks"].append(("row count after insert == N",
                          res["count_after_insert"] == n, res["count_after_insert"]))

    # ---- plain search
    lat, recall = [], []
    plain_top = []
    for qi, q in enumerate(queries):
        t0 = time.perf_counter()
        hits = search(q)
        lat.append(time.perf_counter() - t0)
        got = [hit_id(h) for h in hits]
        plain_top.append(got)
        recall.append(len(set(got) & {ids[j] for j in gt[qi]}) / 10)
    res["plain"] = lat
    res["recall@10"] = float(np.mean(recall))

    # ---- exclusion filter: exclude this query's plain top-10 + 40 random ids (50 total)
    lat, leaked, short = [], 0, 0
    xrng = np.random.default_rng(5)
    for qi, q in enumerate(queries):
        excl = list(plain_top[qi]) + [ids[j] for j in xrng.choice(n, 40, replace=False)]
        flt = f"id not in {json.dumps(excl)}"
        t0 = time.perf_counter()
        hits = search(q, flt)
        lat.append(time.perf_counter() - t0)
        got = [hit_id(h) for h in hits]
        leaked += len(set(got) & set(excl))
        short += len(got) < 10
    res["exclude"] = lat
    res["checks"].append(("`id not in [50 ids]` excludes (leaked ids over 50 queries)",
                          leaked == 0 and short == 0, f"leaked={leaked}, short_results={short}"))

    # ---- ACL filters
    has_a = np.array(["groupA" in a for a in acls])
    res["acl_frac"] = float(has_a.mean())
    gt_acl = None
    acl_ok_idx = np.nonzero(has_a)[0]
    sims = queries @ vecs[acl_ok_idx].T
    gt_acl = [{ids[acl_ok_idx[j]] for j in np.argsort(-s)[:10]} for s in sims]

    def acl_run(flt, key, field):
        lat, bad, rec = [], 0, []
        for qi, q in enumerate(queries):
            t0 = time.perf_counter()
            hits = search(q, flt, out=[field])
            lat.append(time.perf_counter() - t0)
            for h in hits:
                v = hit_entity(h).get(field)
                ok = ("groupA" in v) if field == "acl" else ("|groupA|" in v)
                bad += not ok
            rec.append(len({hit_id(h) for h in hits} & gt_acl[qi]) / 10)
        res[key] = lat
        res[key + "_recall"] = float(np.mean(rec))
        res["checks"].append((f"`{flt}` returns only permitted rows", bad == 0,
                              f"violations={bad}, recall@10 vs exact filtered={np.mean(rec):.3f}"))

    if with_array:
        try:
            acl_run('array_contains_any(acl, ["groupA"])', "acl_array", "acl")
        except Exception as e:  # noqa: BLE001
            res["notes"].append(f"array_contains_any failed: {type(e).__name__}: {str(e)[:160]}")
    try:
        acl_run('acl_str like "%|groupA|%"', "acl_like", "acl_str")
    except Exception as e:  # noqa: BLE001
        res["notes"].append(f"like filter failed: {type(e).__name__}: {str(e)[:160]}")

    res["rss_after_search_mb"] = rss_mb_tree()

    # ---- correctness: query matching nothing
    try:
        r0 = client.query(COLL, filter='doc_id == "no_such_doc"', output_fields=["id"])
        res["checks"].append(("query matching 0 rows returns []", len(r0) == 0, f"{len(r0)} rows"))
    except Exception as e:  # noqa: BLE001
        res["checks"].append(("query matching 0 rows returns []", False,
                              f"RAISES {type(e).__name__}: {str(e)[:120]}"))

    # ---- correctness: query(ids=...)
    try:
        qids = [ids[0], ids[1], ids[n - 1], "doc_nonexistent#p0"]
        rows = client.query(COLL, ids=qids, output_fields=["id", "doc_id", "acl_str"])
        got = sorted(r["id"] for r in rows)
        res["checks"].append(("query(ids=[3 real + 1 missing]) returns the 3 rows",
                              got == sorted(qids[:3]), got))
    except Exception as e:  # noqa: BLE001
        res["checks"].append(("query(ids=...)", False, f"{type(e).__name__}: {e}"[:200]))

    # ---- correctness: upsert replaces by primary key
    try:
        target = ids[10]
        newv = unit(np.random.default_rng(777), 1, dim)[0]
        before = count_rows(client)
        r = {"id": target, "doc_id": "upserted_doc", "vec": newv.tolist(), "acl_str": "|groupZ|"}
        if with_array:
            r["acl"] = ["groupZ"]
        client.upsert(COLL, [r])
        after = count_rows(client)
        rows = client.query(COLL, ids=[target], output_fields=["doc_id", "acl_str"])
        hits = search(newv, out=["doc_id"], limit=3)
        top = hit_id(hits[0]) if hits else None
        old_hits = search(vecs[10], limit=10)
        old_vec_still_top = bool(old_hits) and hit_id(old_hits[0]) == target and \
            abs(float(old_hits[0].get("distance", 0)) - 1.0) < 1e-3
        ok = (after == before and len(rows) == 1 and rows[0]["doc_id"] == "upserted_doc"
              and top == target and not old_vec_still_top)
        res["checks"].append(("upsert replaces by PK (count same, 1 row, new fields, new vector "
                              "found, old vector gone)", ok,
                              f"count {before}->{after}, rows={len(rows)}, "
                              f"doc_id={rows[0]['doc_id'] if rows else None}, top_for_new={top}, "
                              f"old_vec_exact_match_left={old_vec_still_top}"))
    except Exception as e:  # noqa: BLE001
        res["checks"].append(("upsert", False, f"{type(e).__name__}: {e}"[:200]))

    # ---- correctness: delete by filter
    try:
        before = count_rows(client)
        victim = "doc_7"
        victims = [f"{victim}#p{k}" for k in range(CHUNKS_PER_DOC)]
        dr = client.delete(COLL, filter=f'doc_id == "{victim}"')
        after = count_rows(client)
        nbug = len(ZERO_ROW_BUG)
        rows = safe_query(client, ids=victims, output_fields=["id"])
        rows_f = safe_query(client, filter=f'doc_id == "{victim}"', output_fields=["id"])
        bugnote = (" (post-delete queries raised the zero-row error; treated as [])"
                   if len(ZERO_ROW_BUG) > nbug else "")
        hits = search(vecs[7 * CHUNKS_PER_DOC], limit=10)
        in_search = any(hit_id(h) in victims for h in hits)
        ok = (after == before - CHUNKS_PER_DOC and not rows and not rows_f and not in_search)
        res["checks"].append((f"delete(filter='doc_id == \"{victim}\"') removes its "
                              f"{CHUNKS_PER_DOC} chunks", ok,
                              f"return={dr}, count {before}->{after}, query_ids_left={len(rows)}, "
                              f"query_filter_left={len(rows_f)}, still_in_search={in_search}{bugnote}"))
    except Exception as e:  # noqa: BLE001
        res["checks"].append(("delete by filter", False, f"{type(e).__name__}: {e}"[:200]))

    # ---- persistence: close and reopen (same process), time it
    try:
        client.close()
        try:
            from milvus_lite.server_manager import server_manager_instance
            server_manager_instance.release_server(path)
        except Exception as e:  # noqa: BLE001
            res["notes"].append(f"release_server: {type(e).__name__}: {e}")
        t0 = time.perf_counter()
        client = MilvusClient(path)
        client.load_collection(COLL)
        c = count_rows(client)
        search(queries[0])
        res["reopen_s"] = time.perf_counter() - t0
        res["checks"].append(("reopen: rows persisted (N - 5 deleted)", c == n - CHUNKS_PER_DOC, c))
    except Exception as e:  # noqa: BLE001
        res["checks"].append(("reopen", False, f"{type(e).__name__}: {e}"[:200]))
    finally:
        try:
            client.close()
        except Exception:
            pass
    size = 0
    for dp, _, fs in os.walk(tmp):
        for f in fs:
            try:
                size += os.path.getsize(os.path.join(dp, f))
            except OSError:
                pass
    res["disk_mb"] = size / 2**20
    res["db_is_dir"] = os.path.isdir(path)
    return res


def fmt_ms(xs):
    if not xs:
        return "      n/a      "
    return f"{statistics.median(xs) * 1e3:6.2f} / {pct(xs, 90) * 1e3:6.2f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[10000, 50000])
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--metric", default="COSINE", choices=["COSINE", "IP"])
    ap.add_argument("--index", nargs="+", default=["FLAT"],
                    help="vector index type(s) to benchmark, e.g. FLAT AUTOINDEX")
    ap.add_argument("--queries", type=int, default=50)
    ap.add_argument("--no-probe", action="store_true", help="skip the index-type probe")
    ap.add_argument("--tmp", default=None, help="parent dir for temp .db files")
    a = ap.parse_args()

    tmp_root = tempfile.mkdtemp(prefix="milvus_lite_bench_", dir=a.tmp)
    print(f"# milvus-lite {MILVUS_LITE_VERSION}  pymilvus {pymilvus.__version__}  "
          f"numpy {np.__version__}  python {sys.version.split()[0]}")
    print(f"# dim={a.dim} metric={a.metric} queries={a.queries} (nq=1, top-10)  "
          f"import pymilvus: {T_IMPORT:.2f}s")
    try:
        if not a.no_probe:
            t0 = time.perf_counter()
            probe = probe_index_types(tmp_root, a.metric)
            print(f"\n## index types accepted (probe incl. first MilvusClient start: "
                  f"{time.perf_counter() - t0:.2f}s)")
            for it, msg in probe:
                print(f"  {it:10s} {msg}")
        results = []
        for idx in a.index:
            for n in a.n:
                try:
                    results.append(run_one(n, a.dim, a.metric, idx, a.queries, tmp_root))
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    print(f"!! run n={n} index={idx} failed: {type(e).__name__}: {e}")
        print("\n## results (latency ms: median / p90)")
        hdr = (f"{'milvus-lite':11s} {'index':9s} {'N':>7s} {'open s':>6s} {'ins vec/s':>9s} "
               f"{'1st srch s':>10s} {'unflushed':>15s} {'flush s':>7s} {'plain':>15s} {'id not in 50':>15s} "
               f"{'array_any ACL':>15s} {'like ACL':>15s} {'recall':>6s} {'RSS MB':>7s} "
               f"{'disk MB':>7s} {'reopen s':>8s}")
        print(hdr)
        print("-" * len(hdr))
        for r in results:
            print(f"{MILVUS_LITE_VERSION:11s} {r['index']:9s} {r['n']:7d} {r['open_s']:6.2f} "
                  f"{r['insert_rate']:9.0f} {r['first_search_s']:10.2f} "
                  f"{fmt_ms(r['plain_unflushed']):>15s} {r['flush_s']:7.2f} {fmt_ms(r['plain']):>15s} "
                  f"{fmt_ms(r['exclude']):>15s} {fmt_ms(r.get('acl_array')):>15s} "
                  f"{fmt_ms(r.get('acl_like')):>15s} {r['recall@10']:6.3f} "
                  f"{r['rss_after_search_mb']:7.0f} {r['disk_mb']:7.1f} "
                  f"{r.get('reopen_s', float('nan')):8.2f}")
        for r in results:
            print(f"\n## correctness  index={r['index']} N={r['n']}  (ARRAY field: "
                  f"{r['array_field']}, rows with groupA: {r['acl_frac']:.0%}, server child "
                  f"procs: {r['child_procs']}, .db is a directory: {r['db_is_dir']})")
            for name, ok, detail in r["checks"]:
                print(f"  [{'PASS' if ok else 'FAIL'}] {name}: {detail}")
            for note in r["notes"]:
                print(f"  note: {note}")
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    print(f"\n# total wall time {time.perf_counter() - T_PROC0:.1f}s")


if __name__ == "__main__":
    main()
