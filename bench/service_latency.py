"""The cost of the service layer: /v1/search latency against the in-process driver on the same
questions (medians, one run), then requests/s at 1, 4 and 8 concurrent clients.

    python bench/service_latency.py [--corpus tests/fixtures/hotpot-mini] [--n 20]
        [--executor local|ray] [--branches 3] [--seconds 30] [--concurrency 1,4,8]
        [--mode serve|standalone] [--json reports/service_latency.json]

Ingest into a fresh home and copy it (Milvus Lite has one owner per file): the in-process
`Driver` reads the copy, the service (Ray Serve by default: proxy → Ingress → Searcher, same
executor) reads the original. Latency is measured interleaved — question i through the driver,
then through POST /v1/search — for `--rounds` passes over the questions, so load drifting on a
shared machine hits both sides alike. The ratio is median HTTP latency / median driver latency;
the layer's own cost is also given per request as HTTP wall time minus the driver latency the
service measured inside (`metrics.latency_s`). Throughput: each client loops over the questions
for `--seconds` (closed loop); requests/s = answers / wall time. The load average at start and
end is printed with the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def median_ms(xs: list[float]) -> float:
    return round(1000 * statistics.median(xs), 1)


def interleaved(driver, client, questions: list[str], rounds: int) -> dict:
    """Each question through the in-process driver, then over HTTP; medians of both."""
    driver.search(questions[0], acl_groups=["*"])  # warm-up, both sides
    client.post("/v1/search", json={"question": questions[0]})
    direct, http, layer, codes = [], [], [], []
    for _ in range(rounds):
        for q in questions:
            t = time.perf_counter()
            driver.search(q, acl_groups=["*"])  # the service's dev key is ACL_ALL too
            direct.append(time.perf_counter() - t)
            t = time.perf_counter()
            r = client.post("/v1/search", json={"question": q})
            wall = time.perf_counter() - t
            codes.append(r.status_code)
            if r.status_code == 200:
                http.append(wall)
                layer.append(wall - r.json()["metrics"]["latency_s"])
    return {"driver_median_ms": median_ms(direct), "http_median_ms": median_ms(http),
            "layer_median_ms": median_ms(layer), "samples": len(direct),
            "non_200": len(codes) - codes.count(200)}


def throughput(url: str, questions: list[str], clients: int, seconds: float) -> dict:
    import httpx

    done, lat, errors = [], [], {}
    lock = threading.Lock()
    stop = time.perf_counter() + seconds

    def client_loop(offset: int) -> None:
        with httpx.Client(base_url=url, timeout=300) as c:
            i = offset
            while time.perf_counter() < stop:
                t = time.perf_counter()
                r = c.post("/v1/search", json={"question": questions[i % len(questions)]})
                with lock:
                    if r.status_code == 200:
                        done.append(time.perf_counter())
                        lat.append(time.perf_counter() - t)
                    else:
                        errors[r.status_code] = errors.get(r.status_code, 0) + 1
                i += clients

    started = time.perf_counter()
    threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(clients)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    wall = time.perf_counter() - started
    return {"clients": clients, "answers": len(done), "wall_s": round(wall, 1),
            "rps": round(len(done) / wall, 2), "median_ms": median_ms(lat) if lat else None,
            "errors": errors}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", default=str(ROOT / "tests/fixtures/hotpot-mini"))
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--executor", default="local", choices=("local", "ray"))
    ap.add_argument("--branches", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--mode", default="serve", choices=("serve", "standalone"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import httpx

    from branchsearch.infra.datasets.beir import read_queries
    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.orchestrator.service import deploy as service
    from service_fixtures import free_port, start_uvicorn

    load_start = os.getloadavg()
    home = Path(tempfile.mkdtemp(prefix="bs-svc-bench-"))
    settings = load_settings(overrides={"home": home, "index": "bench",
                                        "branches": args.branches},
                             read_env=False, read_file=False)
    ingest(args.corpus, settings)
    questions = [q.text for q in read_queries(Path(args.corpus))][:args.n]
    print(f"{len(questions)} questions from {args.corpus}; executor {args.executor}, "
          f"{args.branches} branches; service via {args.mode}", file=sys.stderr)

    import shutil

    from branchsearch.orchestrator.driver import Driver

    twin = Path(str(home) + "-driver")
    shutil.copytree(home, twin)
    driver = Driver(settings.replace(home=twin), mode=args.executor)
    limits = {"per_key_concurrency": 64, "max_in_flight": 256}
    if args.mode == "serve":
        from ray import serve

        from branchsearch.infra.raycluster import connect

        connect(settings)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(service.build_application(service.ServeOptions(
            home=str(home), index="bench", executor=args.executor, searcher_max_ongoing=16,
            searcher_max_queued=64, limits=limits)), name="branchsearch", route_prefix="/")
        url, stop = f"http://127.0.0.1:{port}", serve.shutdown
    else:
        from branchsearch.orchestrator.service.admission import Limits

        state = service.local_state(settings, executor=args.executor, limits=Limits(**limits))
        state.searcher.target.drivers.open("bench")
        server = start_uvicorn(service.create_app(state), state)
        url = server.url

        def stop():
            server.stop()
            state.searcher.target.close()
    try:
        with httpx.Client(base_url=url, timeout=300) as client:
            lat = interleaved(driver, client, questions, args.rounds)
        driver.close()
        rates = [throughput(url, questions, int(c), args.seconds)
                 for c in args.concurrency.split(",")]
    finally:
        stop()
    out = {"corpus": args.corpus, "questions": len(questions), "executor": args.executor,
           "branches": args.branches, "mode": args.mode, "latency": lat,
           "ratio": round(lat["http_median_ms"] / lat["driver_median_ms"], 3),
           "throughput": rates, "cpus": os.cpu_count(),
           "cpu": platform.processor() or platform.machine(),
           "loadavg_start": [round(x, 1) for x in load_start],
           "loadavg_end": [round(x, 1) for x in os.getloadavg()]}
    print(f"\nhardware: {out['cpus']} CPUs ({out['cpu']}), shared; load average start "
          f"{out['loadavg_start'][0]}, end {out['loadavg_end'][0]}")
    print(f"latency, medians of {lat['samples']} interleaved samples ({len(questions)} questions "
          f"x {args.rounds} rounds, one run):")
    print(f"  in-process driver            {lat['driver_median_ms']:>9.1f} ms")
    print(f"  POST /v1/search ({args.mode:<10}) {lat['http_median_ms']:>9.1f} ms")
    print(f"  ratio HTTP / in-process      {out['ratio']:>9.3f}")
    print(f"  layer per request (HTTP wall - driver time inside): {lat['layer_median_ms']:.1f} ms"
          f"; non-200 answers: {lat['non_200']}")
    print("throughput (closed loop, each client loops over the questions):")
    print("  clients   answers   wall s    req/s   median ms   errors")
    for r in rates:
        print(f"  {r['clients']:>7} {r['answers']:>9} {r['wall_s']:>8} {r['rps']:>8} "
              f"{r['median_ms'] or '-':>11}   {r['errors'] or '-'}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
