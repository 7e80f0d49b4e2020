"""Seal, index, (optionally) compact and report the segments of one collection on a Milvus
2.3.5 server, between `bench/milvus_scaling.py --insert-only` and its search run.

    python bench/milvus_segments/segments.py --uri URI --collection scale_server_N --rows N
        [--compact auto|always|never] [--json OUT.jsonl] [--timeout-s 3600] [--show-only]

1. flush (seals the growing segments), then wait until the query node holds N rows in sealed
   segments, every segment of >= 1,024 rows with its HNSW index loaded (the bench's rule);
2. compaction: `auto` (default) = `Collection.compact()` only when a partition holds more
   than one segment (a forced compaction in 2.3 rewrites every segment, even a lone one, and
   its HNSW is then built again); wait for the compaction's state Completed, then until the
   query node has swapped the plan's sources for its targets, with their index loaded;
3. print and append (--json) the segment count and rows per segment, per partition.

Timings of each step are in the JSON line (seal_index_s, compact_s, reindex_s).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict

from pymilvus import Collection, MilvusClient, connections, utility

MIN_INDEXED_ROWS = 1024  # indexCoord.segment.minSegmentNumRowsToEnableIndex
ALIAS = "mseg"


def segments(name: str) -> list:
    return list(utility.get_query_segment_info(name, using=ALIAS))


def summary(segs) -> dict:
    parts = defaultdict(list)
    for s in segs:
        parts[str(s.partitionID)].append({"id": s.segmentID, "rows": s.num_rows,
                                          "indexed": bool(s.index_name),
                                          "state": int(s.state)})
    for v in parts.values():
        v.sort(key=lambda x: -x["rows"])
    return {"segments": len(segs), "rows": sum(s.num_rows for s in segs),
            "rows_per_segment": sorted((s.num_rows for s in segs), reverse=True),
            "unindexed_rows_ge_1024": sum(s.num_rows for s in segs
                                          if not s.index_name and s.num_rows >= MIN_INDEXED_ROWS),
            "partitions": dict(parts)}


def ready(client: MilvusClient, name: str, rows: int) -> tuple[bool, dict]:
    info = client.describe_index(name, "vector") or {}
    segs = segments(name)
    s = summary(segs)
    ok = (info.get("state") in ("Finished", 3) and s["rows"] >= rows
          and not s["unindexed_rows_ge_1024"])
    return ok, s


def wait_ready(client, name, rows, deadline, what) -> dict:
    last = None
    while True:
        ok, s = ready(client, name, rows)
        key = (s["segments"], s["rows"], s["unindexed_rows_ge_1024"])
        if key != last:
            print(f"  [{what}] {s['segments']} segments, {s['rows']:,} rows loaded, "
                  f"{s['unindexed_rows_ge_1024']:,} rows in unindexed segments", flush=True)
            last = key
        if ok:
            return s
        if time.time() > deadline:
            raise TimeoutError(f"{what}: not ready before the deadline: {s}")
        time.sleep(2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--uri", required=True)
    ap.add_argument("--collection", required=True)
    ap.add_argument("--rows", type=int, required=True)
    ap.add_argument("--compact", choices=["auto", "always", "never"], default="auto")
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeout-s", type=float, default=3600)
    ap.add_argument("--show-only", action="store_true", help="just print the segments")
    args = ap.parse_args()
    deadline = time.time() + args.timeout_s
    connections.connect(ALIAS, uri=args.uri)
    client = MilvusClient(uri=args.uri)
    name = args.collection
    out = {"collection": name, "n": args.rows}
    if args.show_only:
        print(json.dumps(summary(segments(name))), flush=True)
        return

    t = time.perf_counter()
    client.flush(name)
    before = wait_ready(client, name, args.rows, deadline, "after flush")
    out["seal_index_s"] = round(time.perf_counter() - t, 1)
    out["before_compaction"] = before

    multi = [p for p, segs in before["partitions"].items() if len(segs) > 1]
    do = args.compact == "always" or (args.compact == "auto" and multi)
    out["compacted"] = bool(do)
    if do:
        coll = Collection(name, using=ALIAS)
        t = time.perf_counter()
        coll.compact()
        cid = getattr(coll, "compaction_id", None)
        print(f"  compaction {cid} started (partitions with >1 segment: {len(multi)})",
              flush=True)
        state = coll.wait_for_compaction_completed(timeout=max(1, deadline - time.time()))
        out["compact_s"] = round(time.perf_counter() - t, 1)
        plans = coll.get_compaction_plans()
        merges = [{"sources": list(p.sources), "target": p.target} for p in plans.plans]
        out["plans"] = merges
        print(f"  compaction completed ({state}): {len(merges)} plans (sources, target) "
              f"{[(len(m['sources']), m['target']) for m in merges]} in {out['compact_s']} s",
              flush=True)
        sources = {s for m in merges for s in m["sources"]}
        targets = {m["target"] for m in merges}
        t = time.perf_counter()
        last = None
        while True:  # the query node swaps sources for targets (handoff), then their index loads
            ok, s = ready(client, name, args.rows)
            ids = {x["id"] for v in s["partitions"].values() for x in v}
            # a target with 0 rows (every row deleted) is dropped, never loaded
            swapped = not (ids & sources) and targets <= ids | {0}
            key = (s["segments"], s["rows"], s["unindexed_rows_ge_1024"], swapped)
            if key != last:
                print(f"  [after compaction] {s['segments']} segments, {s['rows']:,} rows, "
                      f"{s['unindexed_rows_ge_1024']:,} unindexed, handed off: {swapped}",
                      flush=True)
                last = key
            if ok and swapped and s["rows"] == args.rows:
                break
            if time.time() > deadline:
                raise TimeoutError(f"compaction handoff not done: {s}")
            time.sleep(2)
        out["reindex_s"] = round(time.perf_counter() - t, 1)
        after = s
    else:
        after = before
    out["after"] = after
    out["load"] = [round(x, 2) for x in os.getloadavg()]
    print(f"SEGMENTS {name}: {after['segments']} segments, rows per segment "
          f"{after['rows_per_segment']}", flush=True)
    for p, segs in after["partitions"].items():
        print(f"  partition {p}: {len(segs)} segment(s): "
              f"{[(x['rows'], 'indexed' if x['indexed'] else 'no index') for x in segs]}",
              flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(out) + "\n")
    client.close()


if __name__ == "__main__":
    main()
