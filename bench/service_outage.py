"""What callers of `branchsearch serve --address` see when the worker node of a two-node Ray
cluster is lost under a burst: killed (SIGKILL to every process of the node), or its network
down for `--outage` seconds and then back.

The nodes are `bench/cluster_nodes.py`'s network namespaces (`bsnodeA` 10.77.0.1, the head,
and `bsnodeB` 10.77.0.2, joined by a veth pair, one core each; one Ray CPU each, the head
`--head-cpus`, 2 as in `tests/orchestrator/service/test_service_cluster.py`). A small BM25
index (the service tests' corpus) is ingested, `serve --address --host 0.0.0.0` puts Serve's
proxy and an ingress replica on each node and the searcher on the head, and `--callers`
threads (a third of them streaming, `Accept: text/event-stream`) post searches through the
head's proxy while `/readyz` is asked every 0.5 s. The callers run in the head's namespace
(`ip netns exec`: the namespaces are reachable only from each other), in a child process of
this script that reports every answer with its time (CLOCK_MONOTONIC, which namespaces share).

Per scenario (a fresh cluster each) it prints one JSON line: where the Serve replicas, the
readiness board and the retriever actors were just before the fault; answers and their
statuses (all, after the fault, during the outage); answers that are neither JSON nor a whole
event stream or are a 500; cut streams (no `result` or `error` event at the end, or the
connection lost mid-stream); transport errors (no HTTP answer); what the refusals and the
`/readyz` 503s said; seconds from the fault to the first `/readyz` 503 (or "never"), and from
the network's return (after a kill: from that first 503) to `/readyz` 200; `uptime` before and
after. `--json` keeps the figures with every `/readyz` poll; `--logs` the head's Ray logs.

Needs root (`ip netns`). Cleans up everything it started — the `serve` process, the
namespaces and every process in them (by PID), the veth pair, the Ray temp folder, its work
folder — on success, failure or a signal; never `ray stop`.

    .venv/bin/python bench/service_outage.py --polite            # kill, then netdown
    .venv/bin/python bench/service_outage.py --polite --head-cpus 2
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent),
                str(Path(__file__).resolve().parent.parent / "tests")]
from cluster_nodes import (BIN, NODES, RAY_TMP, Cluster, namespace_procs,  # noqa: E402
                           on_fresh_cluster, proc_kind, ray_env, say, sh, uptime)

SERVE_PORT = 8000
QUESTION = "Alpha harbor budget {i}"


# --- the callers, in the head's namespace (`--drive`) -----------------------------------------

def drive(url: str, key: str, callers: int, polite: bool) -> None:
    """Wait for /readyz 200, say `ready`, then post searches from `callers` threads and poll
    /readyz every 0.5 s until a line arrives on stdin; print every answer and poll as JSON.
    `polite`: a caller refused with a `Retry-After` waits that long (at most 5 s) first."""
    import httpx

    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(url + "/readyz", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("/readyz not 200 within 300 s")
        time.sleep(0.5)
    answers, polls, stop = [], [], threading.Event()
    auth = {"Authorization": f"Bearer {key}"}

    def caller(i: int, streaming: bool) -> None:
        body = {"question": QUESTION.format(i=i), "branches": 2, "deadline_s": 10}
        with httpx.Client(base_url=url, timeout=60) as client:
            while not stop.is_set():
                began = time.monotonic()
                row = {"caller": i, "stream": streaming, "t0": began}
                try:
                    if streaming:
                        row |= stream_once(client, body, auth)
                    else:
                        r = client.post("/v1/search", headers=auth, json=body)
                        row |= {"status": r.status_code,
                                "ctype": r.headers.get("content-type", ""),
                                "json": is_json(r.text), "head": r.text[:200],
                                "retry_after": retry_after(r)}
                except httpx.TransportError as exc:
                    row |= {"transport": repr(exc)[:200]}
                row["t1"] = time.monotonic()
                answers.append(row)
                if polite and row.get("retry_after"):
                    stop.wait(min(row["retry_after"], 5.0))

    def poller() -> None:
        with httpx.Client(base_url=url, timeout=5) as client:
            due = time.monotonic()
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    r = client.get("/readyz")
                    got, said = r.status_code, "" if r.status_code == 200 else r.text[:200]
                except httpx.HTTPError as exc:
                    got, said = type(exc).__name__, repr(exc)[:200]
                polls.append({"t0": t0, "t1": time.monotonic(), "status": got, "said": said})
                due = max(due + 0.5, time.monotonic())
                stop.wait(due - time.monotonic())

    threads = [threading.Thread(target=caller, args=(i, i < callers // 3))
               for i in range(callers)] + [threading.Thread(target=poller)]
    for t in threads:
        t.start()
    print("ready", flush=True)
    sys.stdin.readline()
    stop.set()
    for t in threads:
        t.join(120)
    print(json.dumps({"answers": answers, "polls": polls,
                      "unfinished": sum(t.is_alive() for t in threads)}), flush=True)


def stream_once(client, body: dict, auth: dict) -> dict:
    """One streamed search: its status, content type, whether every event's data was JSON and
    the last event was `result` or `error` (else the stream was cut)."""
    import httpx

    events, json_ok, cut = [], True, False
    with client.stream("POST", "/v1/search", json=body,
                       headers=auth | {"Accept": "text/event-stream"}) as r:
        ctype = r.headers.get("content-type", "")
        if not ctype.startswith("text/event-stream"):
            text = r.read().decode(errors="replace")
            return {"status": r.status_code, "ctype": ctype, "json": is_json(text),
                    "head": text[:200], "retry_after": retry_after(r)}
        try:
            for line in r.iter_lines():
                if line.startswith("event:"):
                    events.append(line[6:].strip())
                elif line.startswith("data:"):
                    json_ok = json_ok and is_json(line[5:])
        except httpx.TransportError as exc:
            cut = repr(exc)[:200]
    return {"status": r.status_code, "ctype": ctype, "json": json_ok, "events": len(events),
            "last": events[-1] if events else None,
            "cut": cut or not events or events[-1] not in ("result", "error")}


def retry_after(r) -> float | None:
    try:
        return float(r.headers["retry-after"])
    except (KeyError, ValueError):
        return None


def is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


# --- the scenarios ----------------------------------------------------------------------------

def prepare(work: Path) -> tuple[Path, str]:
    """A home with the service tests' corpus ingested as BM25 index `bm`, and an API key."""
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.orchestrator.service.auth import KeyStore
    from service_fixtures import write_corpus

    home = work / "home"
    home.mkdir()
    settings = load_settings(overrides={"home": home, "index": "bm"}, read_env=False,
                             read_file=False)
    ingest(write_corpus(home / "corpus.jsonl"), settings, dense=False)
    return home, KeyStore(home / "keys.json").add("alpha", ("alpha",))


SHOWN = ("ReadinessBoard", "RetrieverService")  # actors whose node matters here


def placement() -> dict[str, list[str]]:
    """The Serve replicas (by deployment), the readiness board and the retriever actors in
    each namespace."""
    def shown(kind: str) -> str | None:
        if kind.startswith("ServeReplica:"):
            return kind.rsplit(":", 1)[-1]
        return kind if kind in SHOWN else None

    return {ns: sorted(name for pid in pids if (name := shown(proc_kind(pid))))
            for ns, pids in namespace_procs().items()}


def scenario(name: str, cluster: Cluster, home: Path, key: str, args, work: Path) -> dict:
    head, worker = NODES
    address = cluster.start(2, args.head_cpus)
    log = open(work / f"serve-{name}.log", "w")
    serve = subprocess.Popen(
        ["ip", "netns", "exec", head[0], "taskset", "-c", str(head[3]), str(BIN / "branchsearch"),
         "serve", "--address", address, "--host", "0.0.0.0", "--port", str(SERVE_PORT),
         "--home", str(home), "--index", "bm", "--keys", str(home / "keys.json")],
        stdout=log, stderr=subprocess.STDOUT, env=ray_env(), start_new_session=True)
    load = subprocess.Popen(
        ["ip", "netns", "exec", head[0], sys.executable, __file__, "--drive",
         f"http://{head[2]}:{SERVE_PORT}", "--key", key, "--callers", str(args.callers),
         *(["--polite"] if args.polite else [])],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ray_env(),
        start_new_session=True)
    try:
        while not select.select([load.stdout], [], [], 1.0)[0]:
            if serve.poll() is not None:
                raise RuntimeError(f"serve exited {serve.returncode}: "
                                   f"{(work / f'serve-{name}.log').read_text()[-2000:]}")
        if load.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the callers did not start ({load.wait(30)}); serve log: "
                               f"{(work / f'serve-{name}.log').read_text()[-2000:]}")
        say(f"{name}: serving; load for {args.warm:g} s, then the fault")
        time.sleep(args.warm)
        placed = placement()
        say(f"{name}: placement {placed}")
        fault = time.monotonic()
        back = None
        if name == "kill":
            pids = Cluster.namespace_pids(worker[0])
            for pid in pids:  # the worker node dies: every process of it at once
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            say(f"kill: SIGKILL to the worker node's {len(pids)} processes")
            time.sleep(args.after)
        else:
            sh("ip", "netns", "exec", worker[0], "ip", "link", "set", worker[1], "down")
            say(f"netdown: {worker[1]} down for {args.outage:g} s")
            time.sleep(args.outage)
            sh("ip", "netns", "exec", worker[0], "ip", "link", "set", worker[1], "up")
            back = time.monotonic()
            say("netdown: up again")
            time.sleep(args.after)
        load.stdin.write("stop\n")
        load.stdin.flush()
        out, _ = load.communicate(timeout=300)
        data = json.loads(out.strip().splitlines()[-1])
    finally:
        if load.poll() is None:
            os.killpg(load.pid, signal.SIGKILL)
            load.wait(30)
        stopped = stop_serve(serve)
        log.close()
        if args.logs:  # `serve`'s, and the head's Ray logs (the replicas' among them)
            (args.logs / name).mkdir(parents=True, exist_ok=True)
            shutil.copy(log.name, args.logs / name)
            shutil.copytree(Path(RAY_TMP) / "session_latest" / "logs", args.logs / name / "ray",
                            dirs_exist_ok=True, ignore_dangling_symlinks=True)
    return summarise(name, data, fault, back, placed) | {"serve_exit": stopped}


def stop_serve(serve: subprocess.Popen) -> int | None:
    """SIGTERM (`serve` drains and takes its application away), SIGKILL after 90 s."""
    if serve.poll() is None:
        os.killpg(serve.pid, signal.SIGTERM)
        try:
            serve.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait(30)
    return serve.returncode


def summarise(name: str, data: dict, fault: float, back: float | None, placed) -> dict:
    answers, polls = data["answers"], data["polls"]
    http = [a for a in answers if "status" in a]
    bad = [a for a in http
           if a["status"] == 500 or not (a["json"] and (
               a["ctype"].startswith("application/json")
               or a["ctype"].startswith("text/event-stream")))]
    cut = [a for a in http if a.get("cut")]
    after = [p for p in polls if p["t0"] >= fault]
    first_503 = next((p for p in after if p["status"] == 503), None)
    since = back if back is not None else (first_503["t0"] if first_503 else None)
    ready_again = next((p for p in polls if since is not None and p["t0"] >= since
                        and p["status"] == 200), None)
    during = Counter(str(p["status"]) for p in after if back is None or p["t0"] < back)
    return {
        "scenario": name, "placement": placed, "answers": len(http),
        "streamed": sum(a["stream"] for a in http),
        "statuses": dict(Counter(str(a["status"]) for a in http)),
        "statuses_after_fault": dict(Counter(str(a["status"]) for a in http
                                             if a["t1"] >= fault)),
        **({"statuses_during_outage": dict(Counter(str(a["status"]) for a in http
                                                   if fault <= a["t1"] < back))}
           if back is not None else {}),
        "non_json_or_500": len(bad), "bad_examples": [a.get("head", "")[:120] for a in bad[:3]],
        "cut_streams": len(cut), "cut_examples": [str(a.get("cut"))[:120] for a in cut[:3]],
        "transport_errors": sum("transport" in a for a in answers),
        "transport_examples": [a["transport"] for a in answers if "transport" in a][:3],
        "refusals_said": said_once(a for a in http if a["status"] != 200),
        "readyz_polls": len(polls),
        "readyz_before_fault": dict(Counter(str(p["status"]) for p in polls
                                            if p["t0"] < fault)),
        "readyz_said": said_once(p for p in after if p["status"] != 200),
        "readyz_from_fault": dict(during),
        "readyz_503_after_fault_s": (round(first_503["t0"] - fault, 1) if first_503
                                     else "never"),
        ("readyz_200_after_return_s" if back is not None else "readyz_200_after_503_s"):
            round(ready_again["t0"] - since, 1) if ready_again else
            ("n/a" if since is None else "never"),
        "longest_readyz_s": round(max((p["t1"] - p["t0"] for p in polls), default=0), 2),
        "unfinished_threads": data["unfinished"],
        "polls": [[round(p["t0"] - fault, 2), p["status"]] for p in polls],
    }


def said_once(rows) -> dict[str, int]:
    """How often each distinct refusal was said: its status and the start of its text
    (numbers masked, so "for 12 s" and "for 14 s" count as one)."""
    import re

    def said(r: dict) -> str:
        return f"{r['status']} " + re.sub(r"\d+", "N", r.get("head") or r.get("said", ""))[:140]

    return dict(Counter(said(r) for r in rows).most_common(6))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", default="kill,netdown", help="kill, netdown, in order")
    ap.add_argument("--callers", type=int, default=16)
    ap.add_argument("--outage", type=float, default=50, help="seconds the network is down")
    ap.add_argument("--warm", type=float, default=10, help="seconds of load before the fault")
    ap.add_argument("--after", type=float, default=30,
                    help="seconds of load after the kill, or after the network's return")
    ap.add_argument("--head-cpus", type=int, default=1, help="the head's Ray CPUs")
    ap.add_argument("--polite", action="store_true",
                    help="callers wait a refusal's Retry-After (at most 5 s) before the next")
    ap.add_argument("--json", type=Path,
                    help="write every scenario's figures and /readyz polls here")
    ap.add_argument("--logs", type=Path,
                    help="keep each scenario's `serve` log and the head's Ray logs here")
    ap.add_argument("--tmp", type=Path, help="where its work folder goes (default: TMPDIR)")
    ap.add_argument("--drive", help=argparse.SUPPRESS)  # the callers' process: the service URL
    ap.add_argument("--key", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.drive:
        return drive(args.drive, args.key, args.callers, args.polite)
    if os.geteuid() != 0:
        raise SystemExit("needs root (ip netns)")
    names = args.scenarios.split(",")
    if not set(names) <= {"kill", "netdown"}:
        raise SystemExit("--scenarios takes kill and netdown")
    # a token of this run's own: nothing written to ~/.ray
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(16))
    cluster = Cluster()

    def stop(signum, _frame):
        say(f"signal {signum}: cleaning up")
        raise SystemExit(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    results = []
    work = Path(tempfile.mkdtemp(prefix="bsoutage-", dir=args.tmp))
    try:
        home, key = prepare(work)
        for name in names:
            load = uptime()
            result = on_fresh_cluster(
                cluster, lambda: scenario(name, cluster, home, key, args, work))
            result["uptime_before"] = load
            result["uptime_after"] = uptime()
            results.append(result)
            print(json.dumps({k: v for k, v in result.items() if k != "polls"}), flush=True)
    finally:
        cluster.close()
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
