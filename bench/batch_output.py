"""What a batch's resume and end-of-run rewrite cost on a large output: time and peak memory of
`check_output`, `resume_state` and `compact` over an output of N rows shaped as `batch` writes
them (10 evidence documents of 2 chunks each, about 14 KB a row, as on hotpot), a tenth of the
ids written twice (a failed row, then its retry).

    python bench/batch_output.py [--rows 20000] [--dir /tmp]

Each step runs in a fresh process (its peak RSS is its own); one run, this machine.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def row(i: int, rng: random.Random, status: str = "ok") -> dict:
    words = "the of a river band city album formed capital country county mayor".split()
    text = lambda n: " ".join(rng.choice(words) for _ in range(n))  # noqa: E731
    evidence = [{"doc_id": f"d{i}-{k}", "title": text(3), "score": 0.1,
                 "found_by": [{"branch": 0, "subquery": text(12), "rank": k + 1}],
                 "chunks": [{"chunk_id": f"d{i}-{k}#p{c}", "rank": 2 * k + c + 1, "score": 0.1,
                             "text": text(90), "provenance": [{"turn": 1, "tool": "search"}],
                             "found_by": [{"branch": 0, "subquery": text(12), "rank": k + 1}]}
                            for c in range(2)]} for k in range(10)]
    return {"id": f"q{i}", "question": text(14), "index": "bench", "status": status,
            "evidence": evidence, "ranked_chunk_ids": [f"d{i}-{k}#p0" for k in range(10)],
            "metrics": {"latency_s": 0.05}}


def write(path: Path, rows: int) -> None:
    rng = random.Random(7)
    with path.open("w", encoding="utf-8") as f:
        for i in range(rows):
            if i % 10 == 0:
                f.write(json.dumps(row(i, rng, "failed") | {"error": "boom"}) + "\n")
            f.write(json.dumps(row(i, rng)) + "\n")


def step(name: str, path: Path, rows: int) -> None:
    from branchsearch.orchestrator.batch import check_output, compact, resume_state

    started = time.perf_counter()
    if name == "check_output":
        check_output(path, path.with_name("input.jsonl"))
    elif name == "resume_state":
        assert len(resume_state(path, "bench").done) == rows
    else:
        assert compact(path, [f"q{i}" for i in range(rows)]) == rows
    took = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"step": name, "seconds": round(took, 2), "peak_rss_mb": round(peak)}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--step", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.step:
        return step(a.step, Path(a.path), a.rows)
    path = Path(a.dir) / f"bench-batch-{a.rows}.jsonl"
    write(path, a.rows)
    size = path.stat().st_size
    print(f"output: {a.rows:,} ids, {size / 2 ** 20:,.0f} MB ({path})")
    base = subprocess.run([sys.executable, "-c", "import resource, branchsearch.orchestrator.batch;"
                           "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)"],
                          capture_output=True, text=True, check=True).stdout.strip()
    print(f"a fresh process importing the batch module: {base} MB")
    for name in ("check_output", "resume_state", "compact"):
        out = subprocess.run([sys.executable, __file__, "--step", name, "--path", str(path),
                              "--rows", str(a.rows)],
                             capture_output=True, text=True)
        print(out.stdout.strip() or out.stderr.strip()[-500:])
    path.unlink()


if __name__ == "__main__":
    main()
