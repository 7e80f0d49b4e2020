"""The driver on a real local Ray cluster: fan-out, failures, one trace across processes, and a
batch killed mid-run then resumed. Plus the planner and branch fusion as plain functions."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from branchsearch.infra.errors import BranchsearchError
from branchsearch.orchestrator.batch import OutputLock
from branchsearch.orchestrator.plan import HeuristicPlanner
from branchsearch.orchestrator.result import BranchReport, SearchResult, fuse_branches
from branchsearch.workers.harness import EpisodeResult

from conftest import HOTPOT, ingest_copy

Q = "Were Scott Derrickson and Ed Wood of the same nationality?"


def test_planner_bounds_and_kinds():
    planner = HeuristicPlanner()
    subs = planner.plan(Q, 3)
    assert [s.kind for s in subs] == ["original", "comparison", "comparison"]
    assert subs[0].text == Q and "Scott Derrickson" in subs[1].text and "Ed Wood" in subs[2].text
    assert len(planner.plan(Q, 1)) == 1
    clauses = planner.plan("Who founded the company that makes the iPhone and where was he born?", 5)
    assert [s.kind for s in clauses] == ["original", "clause", "clause"]
    assert len(planner.plan("hello", 5)) == 1  # bounded by the question too


def test_fusion_of_branches_by_hand():
    def branch(i, weight, status, ids):
        evidence = [{"chunk_id": c, "doc_id": c.split("#")[0], "title": c[0].upper(),
                     "text": f"text of {c}", "rank": r, "score": 1 / r, "provenance": []}
                    for r, c in enumerate(ids, start=1)]
        return BranchReport(i, f"q{i}", weight, "entity", status, episode=EpisodeResult(
            f"q{i}", "finish", evidence=evidence, ranked_chunk_ids=ids))

    a, b = branch(0, 1.0, "ok", ["x#p0", "y#p0"]), branch(1, 0.5, "ok", ["y#p0", "z#p0"])
    dead = branch(2, 1.0, "error", ["w#p0"])
    ranked, evidence = fuse_branches([a, b, dead], k=60)
    # y: 1/62 + 0.5/61 ; x: 1/61 ; z: 0.5/62
    assert ranked == ["y#p0", "x#p0", "z#p0"]
    assert evidence[0]["chunks"][0]["found_by"] == [
        {"branch": 0, "subquery": "q0", "rank": 2}, {"branch": 1, "subquery": "q1", "rank": 1}]
    assert evidence[0]["title"] == "Y" and evidence[0]["chunks"][0]["text"] == "text of y#p0"
    assert evidence[1]["doc_id"] == "x"
    # two branches that return different chunks of one document agree on the document: 'r'
    # (the question's 3rd, an entity branch's 1st, by another chunk) passes 'q' (only the
    # question's 2nd); the question's chunk stands for it, the other follows the documents
    # (k 5: p 1/6, r 1/8 + 0.2/6, q 1/7, s 0.2/7; by chunk ids r#p0 alone had 1/8, below q)
    q, e = branch(0, 1.0, "ok", ["p#p0", "q#p0", "r#p0"]), branch(1, 1.0, "ok", ["r#p1", "s#p0"])
    q.kind = "original"
    ranked, evidence = fuse_branches([q, e], k=5)
    assert ranked == ["p#p0", "r#p0", "q#p0", "s#p0", "r#p1"]
    assert [d["doc_id"] for d in evidence] == ["p", "r", "q", "s"]
    assert [c["chunk_id"] for c in evidence[1]["chunks"]] == ["r#p0", "r#p1"]
    assert evidence[1]["chunks"][1]["found_by"] == [{"branch": 1, "subquery": "q1", "rank": 1}]
    # the document's score comes from both branches, and says so (its place in each)
    assert evidence[1]["found_by"] == [{"branch": 0, "subquery": "q0", "rank": 3},
                                       {"branch": 1, "subquery": "q1", "rank": 1}]
    twice = branch(0, 1.0, "ok", ["p#p0", "q#p0", "p#p0"])
    assert fuse_branches([twice], k=5)[1][0]["chunks"][0]["found_by"] == [
        {"branch": 0, "subquery": "q0", "rank": 1}]  # a repeated chunk: its first place
    assert fuse_branches([q, e], k=5, limit=3)[0] == ["p#p0", "r#p0", "q#p0"]
    # a report reads its episode's fields through; without an episode they are empty
    assert a.turns == 0 and a.ranked_chunk_ids == ["x#p0", "y#p0"] and dead.status == "error"
    late = BranchReport(3, "q3", 1.0, "entity", "timeout", "no result within 8 s")
    assert late.ranked_chunk_ids == [] and late.summary()["termination"] == ""
    assert SearchResult("q", [], [], [a, dead], {}, "t").status == "partial"
    assert SearchResult("q", [], [], [late, dead], {}, "t").to_dict()["status"] == "failed"


@pytest.fixture(scope="module")
def ray_driver(hotpot_settings, tmp_path_factory):
    import ray

    from branchsearch.orchestrator.driver import Driver

    trace_file = tmp_path_factory.mktemp("trace") / "spans.jsonl"
    settings = ingest_copy(hotpot_settings, "hotpot-ray").replace(
        trace_exporter="jsonl", trace_file=str(trace_file), branch_timeout_s=20, branches=3,
        skip_covered=False)  # every planned branch runs: these tests are about fan-out
    driver = Driver(settings, mode="ray", pool_size=3)
    yield driver, trace_file
    driver.close()
    ray.shutdown()


@pytest.mark.ray
def test_a_busy_branch_pool_answers_within_the_deadline(ray_driver, hotpot_settings):
    """A question that finds every branch actor busy waits only until its deadline, then is
    refused as overloaded (a 503 with Retry-After in the service), instead of waiting on an
    actor that is never free."""
    import time

    from branchsearch.infra.errors import Overloaded
    from branchsearch.orchestrator.execution.pool import BranchPool
    from branchsearch.orchestrator.service.errors import api_error

    pool = BranchPool(1, {"num_cpus": 0.05}, hotpot_settings)
    try:
        [held] = pool.acquire(1, timeout=60)
        began = time.perf_counter()
        with pytest.raises(Overloaded) as caught:
            pool.acquire(1, timeout=0.3)
        assert 0.3 <= time.perf_counter() - began < 5
        err = api_error(caught.value)
        assert err.status == 503 and err.error == "overloaded" and "Retry-After" in err.headers
        assert {k: err.body()[k] for k in ("reason", "in_use", "limits")} == {
            "reason": "branch_actors", "in_use": 1, "limits": {"branch_actors": 1}}
        pool.release(held)
        assert len(pool.acquire(1, timeout=0.3)) == 1
        with pytest.raises(BranchsearchError, match="pool holds 1"):
            pool.acquire(2, timeout=0.3)
    finally:
        pool.close()


@pytest.mark.ray
def test_fan_out_fuses_branches_and_shares_one_trace(ray_driver):
    driver, trace_file = ray_driver
    result = driver.search(Q)
    assert [b.status for b in result.branches] == ["ok", "ok", "ok"]
    assert len({b.pid for b in result.branches}) == 3  # each branch in its own actor process
    assert {"ed-wood", "scott-derrickson"} <= {d["doc_id"] for d in result.evidence[:5]}
    multi = [c for d in result.evidence for c in d["chunks"] if len(c["found_by"]) > 1]
    assert multi and all(c["provenance"] for d in result.evidence for c in d["chunks"])
    time.sleep(0.5)
    spans = [json.loads(line) for line in trace_file.read_text().splitlines()]
    mine = [s for s in spans if s["trace_id"] == result.trace_id]
    assert {"query", "plan", "branch", "episode", "turn", "prune"} <= {s["name"] for s in mine}
    pids = {s["resource"].get("process.pid") for s in mine}
    assert os.getpid() in pids and len(pids) >= 2  # driver + actor processes, one trace id
    by_id = {s["span_id"]: s for s in mine}
    branch = next(s for s in mine if s["name"] == "branch")
    assert by_id[branch["parent_id"]]["name"] == "query"  # parent crossed the process boundary


@pytest.mark.ray
@pytest.mark.parametrize("cpus", [64, 0], ids=["a-cpu-each", "sharing-cpus"])
def test_on_ray_covered_branches_are_left_out_as_in_process(ray_driver, cpus):
    """With covering on (the default): where each branch has a CPU of its own, Ray starts
    every planned branch at once (no wait for the question's branch) and drops the covered
    ones' reports; where they would share CPUs, the question's branch runs first and the
    covered ones never start. Either way the result is the question's branch alone, as
    in-process."""
    driver, _ = ray_driver
    executor = driver.executor
    have = executor.cpus
    # covering alone: the bridges that take a covered branch's room are test_chains'
    driver.settings = driver.settings.replace(skip_covered=True, bridges=0)
    executor.cpus = cpus  # as on a cluster of that many CPUs
    try:
        assert executor.at_once(3) == (cpus == 64)
        events = []
        result = driver.search(Q, on_event=events.append)
        alone = driver.search(Q, max_branches=1)
    finally:
        driver.settings = driver.settings.replace(skip_covered=False, bridges=1)
        executor.cpus = have
    assert [b.index for b in result.branches] == [0] and result.metrics["covered"] == 2
    started = sorted(e["branch"] for e in events if e["type"] == "branch_started")
    assert started == ([0, 1, 2] if cpus else [0])
    kinds = [(e["type"], e.get("branch")) for e in events]
    if cpus:
        assert kinds.index(("covered", 1)) > kinds.index(("branch_done", 1))
    assert [c["branch"] for c in result.covered] == [1, 2]
    assert result.ranked_chunk_ids == alone.ranked_chunk_ids


@pytest.mark.ray
def test_on_ray_sharing_cpus_a_branch_the_question_s_branch_misses_still_runs(ray_driver):
    driver, _ = ray_driver
    executor, have = driver.executor, driver.executor.cpus
    # covering alone: the bridges that take a covered branch's room are test_chains'
    driver.settings = driver.settings.replace(skip_covered=True, bridges=0)
    executor.cpus = 0
    question = "Were Scott Derrickson and Tim Burton of the same nationality?"
    try:
        events = []
        result = driver.search(question, on_event=events.append)
    finally:
        driver.settings = driver.settings.replace(skip_covered=False, bridges=1)
        executor.cpus = have
    assert result.branches[0].subquery == question
    assert "Tim Burton nationality" in [b.subquery for b in result.branches[1:]]
    assert {b.status for b in result.branches} == {"ok"}
    assert len(result.branches) + result.metrics["covered"] == 3
    order = [(e["type"], e.get("branch")) for e in events]
    later = [i for i, (kind, b) in enumerate(order) if kind == "branch_started" and b != 0]
    assert later and order.index(("branch_done", 0)) < min(later)  # the second wave


@pytest.mark.ray
def test_on_ray_a_second_wave_with_no_time_left_is_reported_not_sent(ray_driver):
    """Sharing CPUs, the branches after the question's have what is left of one branch
    timeout: when nothing is, they are timed out without taking a branch actor."""
    driver, _ = ray_driver
    executor, have = driver.executor, driver.executor.cpus
    driver.settings = driver.settings.replace(skip_covered=True, branch_timeout_s=0.001)
    executor.cpus = 0
    busy = executor.pool.busy
    try:
        result = driver.search(Q)
    finally:
        driver.settings = driver.settings.replace(skip_covered=False, branch_timeout_s=20)
        executor.cpus = have
    assert [b.status for b in result.branches] == ["timeout"] * 3  # nothing covers: all planned
    assert [b.error for b in result.branches[1:]] == ["not started before the deadline"] * 2
    assert executor.pool.busy == busy  # no actor was taken for them
    assert driver.search(Q).status == "ok"  # the pool is whole


@pytest.mark.ray
def test_on_ray_a_later_wave_with_no_branch_actor_free_keeps_the_first_wave_s_evidence(
        ray_driver):
    """A burst of questions holds every branch actor and the replica's hosting slot: the
    question's own branch ran (hosted, beside the stores), but its bridge finds no actor free
    before the deadline. The bridge is reported as not started and the question's evidence
    stands (partial), instead of the whole question being refused as overloaded (a 503 that
    threw the finished branch away)."""
    driver, _ = ray_driver
    executor = driver.executor
    one = 'The director of the romantic comedy "Big Stone Gap" is based in what New York city?'
    busy = executor.pool.busy
    held = executor.pool.acquire(executor.pool.size - busy, timeout=60)  # others' branches
    events: list[dict] = []

    def watch(event: dict) -> None:  # another question's hosted branch takes the slot as the
        events.append(event)  # bridge wave is about to start
        if event["type"] == "chain" and not any(executor.balancer.hosting):
            executor.balancer.host(0)

    try:
        result = driver.search(one, deadline_s=4, on_event=watch)
    finally:
        executor.balancer.unhost(0)
        for actor in held:
            executor.pool.release(actor)
    own, bridge = result.branches
    assert own.status == "ok" and own.rpc_s == 0  # hosted: no branch actor needed
    assert bridge.kind == "bridge" and bridge.status == "timeout" and bridge.parent == 0
    assert bridge.error.startswith("not started before the deadline") and "busy" in bridge.error
    assert result.status == "partial" and result.evidence
    done = [e for e in events if e["type"] == "branch_done"]
    assert [(e["branch"], e["status"]) for e in done] == [(0, "ok"), (1, "timeout")]
    assert sum(executor.balancer.load) == 0 and executor.pool.busy == busy  # none held
    assert driver.search(one).status == "ok"  # the pool is whole


@pytest.mark.ray
def test_a_crashed_and_a_late_branch_are_reported(ray_driver):
    from branchsearch.workers import scripted

    driver, _ = ray_driver
    driver.settings = driver.settings.replace(branch_timeout_s=8)
    driver.policy_factory = scripted.faulty_factory
    try:
        result = driver.search(Q)
    finally:
        driver.policy_factory = None
        driver.settings = driver.settings.replace(branch_timeout_s=20)
    status = [b.status for b in result.branches]
    assert status == ["ok", "error", "timeout"]
    assert "no policy for branch 1" in result.branches[1].error
    assert "within 8 s" in result.branches[2].error
    assert result.evidence and all(f["branch"] == 0 for d in result.evidence
                                   for c in d["chunks"] for f in c["found_by"])
    # the pool recovered: the next question runs on three working actors
    assert [b.status for b in driver.search(Q).branches] == ["ok", "ok", "ok"]


@pytest.mark.ray
def test_the_question_s_branch_runs_in_its_retriever_and_streams_its_events(ray_driver):
    import ray

    driver, _ = ray_driver
    retriever_pid = ray.get(driver.executor.retrievers[0].ping.remote())
    events = []
    result = driver.search(Q, on_event=events.append)
    own, *others = result.branches
    assert [b.status for b in result.branches] == ["ok", "ok", "ok"]
    assert own.pid == retriever_pid and own.rpc_s == 0 and own.backend_s > 0  # no round trips
    assert all(b.pid != retriever_pid and b.rpc_s > 0 for b in others)  # pool actors
    for b in result.branches:  # each branch's own events reached the driver, hosted or not
        mine = [e["type"] for e in events if e.get("branch") == b.index]
        assert mine[0] == "branch_started" and mine[-1] == "branch_done" and "search" in mine
    assert driver.executor.balancer.hosting == [False]  # the slot is free again


def test_event_buffers_drain_and_forget_a_finished_branch():
    from branchsearch.workers.actor import Events

    events = Events()
    put = events.sink("q1")
    put({"n": 1})
    assert events.take("q1") == [{"n": 1}] and events.take("q1") == []
    put({"n": 2})
    assert events.take("q1", last=True) == [{"n": 2}]
    put({"n": 3})  # a late branch's events after its last drain are not kept
    assert events.take("q1") == [] and events._buffers == {}


def test_a_replica_hosts_one_branch_at_a_time():
    from branchsearch.orchestrator.execution.balancer import ReplicaBalancer

    b = ReplicaBalancer(2)
    assert b.host(0) and not b.host(0) and b.host(1)
    b.unhost(0)
    assert b.host(0) and b.hosting == [True, True]


@pytest.mark.ray
def test_a_late_hosted_branch_is_a_timeout_and_the_next_question_is_hosted_again(ray_driver):
    from branchsearch.workers.heuristic import HeuristicPolicy
    from branchsearch.workers.scripted import SlowPolicy

    driver, _ = ray_driver
    driver.settings = driver.settings.replace(branch_timeout_s=4)
    driver.policy_factory = lambda i, q: SlowPolicy(6) if i == 0 else HeuristicPolicy()
    try:
        result = driver.search(Q)
    finally:
        driver.policy_factory = None
        driver.settings = driver.settings.replace(branch_timeout_s=20)
    assert [b.status for b in result.branches] == ["timeout", "ok", "ok"]
    assert "within 4 s" in result.branches[0].error and result.evidence
    again = driver.search(Q)  # the late branch still sleeps in a replica thread; this one is
    assert [b.status for b in again.branches] == ["ok", "ok", "ok"]  # hosted beside it
    assert again.branches[0].rpc_s == 0


@pytest.mark.ray
def test_a_branch_that_cannot_be_sent_gives_the_pool_its_actors_back(ray_driver):
    import threading

    from branchsearch.workers.heuristic import HeuristicPolicy

    driver, _ = ray_driver
    lock = threading.Lock()  # a factory that closes over a lock cannot be pickled
    driver.policy_factory = lambda i, q, lock=lock: HeuristicPolicy()
    try:
        for _ in range(3):  # more than the pool holds, were actors lost
            with pytest.raises(TypeError, match="serialize"):
                driver.search(Q)
    finally:
        driver.policy_factory = None
    assert [b.status for b in driver.search(Q).branches] == ["ok", "ok", "ok"]


@pytest.mark.ray
def test_batch_killed_mid_run_resumes_without_loss_or_duplicates(hotpot_settings, tmp_path):
    queries = [json.loads(line) for line in (HOTPOT / "queries.jsonl").read_text().splitlines()]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": q["_id"], "question": q["text"]}) + "\n"
                           for q in queries) + "{not json\n" + '{"id": "x"}\n')
    out = tmp_path / "out.jsonl"
    settings = ingest_copy(hotpot_settings, "hotpot-batch")
    cmd = [sys.executable, "-m", "branchsearch.orchestrator.cli", "batch", str(inp), "-o", str(out),
           "--home", str(settings.home), "--index", settings.index,
           "--branches", "2", "--concurrency", "2"]
    env = {**os.environ, "BRANCHSEARCH_BRANCH_TIMEOUT_S": "60"}
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    while time.time() < deadline and (not out.exists() or out.read_text().count("\n") < 3):
        time.sleep(0.2)
    # a second batch on the same output (its rows the first's final rewrite would drop) stops
    # at once, naming the first
    with pytest.raises(BranchsearchError, match=rf"being written by another batch \(PID "
                       rf"{proc.pid}\)"):
        OutputLock(out).acquire()
    os.killpg(proc.pid, signal.SIGKILL)  # (the kernel lets go of its lock: the rerun takes it)
    proc.wait()
    first = out.read_text().count("\n")
    assert 3 <= first < len(queries), "the batch should be killed mid-run"
    with out.open("a") as f:
        f.write('{"id": "torn')  # a write cut short by the crash
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]  # two input lines were malformed
    assert "Traceback" not in done.stderr
    assert "in.jsonl:13" in done.stderr and "in.jsonl:14" in done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    ids = [r["id"] for r in rows]
    assert sorted(ids) == sorted(q["_id"] for q in queries) and len(ids) == len(set(ids))
    assert all(r["evidence"] and r["trace_id"] and r["branches"] for r in rows)
    assert f"{len(queries) - first} ok, 0 partial, 0 failed" in done.stdout
    assert all(r["status"] == "ok" for r in rows)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]  # no lock


def test_a_batch_resumed_on_another_index_asks_its_questions_again(hotpot_settings, tmp_path):
    """Rows name the index that answered them; the same output resumed with another --index
    asks those questions again, and says so (not "3 already ok" with the first index's
    evidence)."""
    first = ingest_copy(hotpot_settings, "resume-a")
    queries = [json.loads(line) for line in (HOTPOT / "queries.jsonl").read_text().splitlines()]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": q["_id"], "question": q["text"]}) + "\n"
                           for q in queries[:3]))

    def batch(index: str):
        return subprocess.run([sys.executable, "-m", "branchsearch.orchestrator.cli", "batch",
                               str(inp), "-o", str(out), "--home", str(first.home), "--index",
                               index, "--branches", "1"], capture_output=True, text=True,
                              timeout=300)

    done = batch("resume-a")
    assert done.returncode == 0 and "3 ok" in done.stdout, done.stderr[-2000:]
    assert {json.loads(line)["index"] for line in out.read_text().splitlines()} == {"resume-a"}
    assert "0 ok, 0 partial, 0 failed; 3 already ok" in batch("resume-a").stdout
    second = ingest_copy(hotpot_settings, "resume-b")
    again = batch(second.index)
    assert again.returncode == 0 and "3 ok, 0 partial, 0 failed; 0 already ok" in again.stdout
    assert "asking again 3 question(s) whose ok row was answered on another index " \
        "(resume-a)" in again.stderr, again.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3 and {r["index"] for r in rows} == {"resume-b"}


def test_a_batch_resumed_after_a_re_ingest_asks_its_questions_again(hotpot_settings, tmp_path):
    """A document fixed and ingested again between a batch and its resume: the resume said
    "2 already ok" and kept rows quoting the document's old text beside rows of the new one.
    Rows name the ingest of the index that answered them (`index_version`); a resume after an
    ingest that changed documents asks them again and says so, one after an ingest that
    changed none resumes, and ok rows of that earlier ingest for questions this input does not
    ask are refused (they would stay beside the new ones), the output unchanged."""
    from branchsearch.infra.ingest.pipeline import ingest

    copy = ingest_copy(hotpot_settings, "re-ingest")
    queries = [json.loads(line) for line in (HOTPOT / "queries.jsonl").read_text().splitlines()]
    inp, out, one = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "one.jsonl"
    inp.write_text("".join(json.dumps({"id": q["_id"], "question": q["text"]}) + "\n"
                           for q in queries[:2]))
    one.write_text(json.dumps({"id": queries[0]["_id"], "question": queries[0]["text"]}) + "\n")

    def batch(questions=inp):
        return subprocess.run([sys.executable, "-m", "branchsearch.orchestrator.cli", "batch",
                               str(questions), "-o", str(out), "--home", str(copy.home),
                               "--index", copy.index, "--branches", "1", "--concurrency", "1"],
                              capture_output=True, text=True, timeout=300)

    def quoted(doc_id: str) -> list[str]:
        return [c["text"] for line in out.read_text().splitlines()
                for e in json.loads(line)["evidence"] if e["doc_id"] == doc_id
                for c in e["chunks"]]

    done = batch()
    assert done.returncode == 0 and "2 ok" in done.stdout, done.stderr[-2000:]
    doc = json.loads((HOTPOT / "corpus.jsonl").read_text().splitlines()[0])  # ed-wood
    assert quoted(doc["_id"]) and all("American" in text for text in quoted(doc["_id"]))
    ingest(HOTPOT, copy)  # the same corpus again: no document changed
    again = batch()
    assert "0 ok, 0 partial, 0 failed; 2 already ok" in again.stdout, again.stderr[-2000:]
    fixed = tmp_path / "fixed.jsonl"
    fixed.write_text(json.dumps(doc | {"text": doc["text"].replace("American", "Canadian")})
                     + "\n")
    ingest(fixed, copy)
    before = out.read_bytes()
    refused = batch(one)  # the other question's row, of the earlier ingest, would stay
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr[-2000:]
    assert lines[0].startswith(f"error: batch output {out} holds ok rows answered before "
                               "the documents of 're-ingest' changed"), lines
    assert out.read_bytes() == before
    again = batch()
    assert again.returncode == 0, again.stderr[-2000:]
    assert "2 ok, 0 partial, 0 failed; 0 already ok" in again.stdout, again.stderr[-2000:]
    assert "asking again 2 question(s) whose ok row was answered before the documents of " \
        "'re-ingest' changed" in again.stderr, again.stderr[-2000:]
    assert quoted(doc["_id"]) and all("Canadian" in text for text in quoted(doc["_id"]))
    assert "0 ok, 0 partial, 0 failed; 2 already ok" in batch().stdout


def test_a_batch_on_an_unknown_index_is_one_error_line(tmp_path):
    """A resume with a mistyped --index said "asking again N question(s) … on 'nosuch'"
    before the error that the index does not exist: the error alone, the output unchanged."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"id": "q1", "question": "Who directed Ed Wood?"}) + "\n")
    row = {"id": "q1", "question": "Who directed Ed Wood?", "index": "hotpot",
           "status": "ok", "evidence": []}
    out.write_text(json.dumps(row) + "\n")
    before = out.read_bytes()
    done = subprocess.run([sys.executable, "-m", "branchsearch.orchestrator.cli", "batch",
                           str(inp), "-o", str(out), "--home", str(tmp_path / "home"),
                           "--index", "nosuch"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: index 'nosuch' not found"), lines
    assert out.read_bytes() == before


def test_a_batch_resumed_with_other_settings_is_refused(hotpot_settings, tmp_path):
    """Each row records the settings that made it (`made_with`); a resume whose settings would
    give other evidence (another --branches, other ACL groups) stops with one line naming what
    differs, as a person writes the values ("acl finance, hr there, none now", not Python's
    "['finance', 'hr']" and None), and leaves the output as it was: finished rows are not
    replaced, nor two configurations mixed in one file. The same settings resume."""
    copy = ingest_copy(hotpot_settings, "resume-settings")
    queries = [json.loads(line) for line in (HOTPOT / "queries.jsonl").read_text().splitlines()]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": q["_id"], "question": q["text"]}) + "\n"
                           for q in queries[:2]))
    env = dict(os.environ, BRANCHSEARCH_LLM_URL="http://user:s3cret@llm.internal:8000/v1")

    def batch(*flags: str):
        return subprocess.run([sys.executable, "-m", "branchsearch.orchestrator.cli", "batch",
                               str(inp), "-o", str(out), "--home", str(copy.home), "--index",
                               copy.index, *flags], capture_output=True, text=True,
                              timeout=300, env=env)

    done = batch("--branches", "1", "--acl", "hr", "--acl", "finance")
    assert done.returncode == 0 and "2 ok" in done.stdout, done.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    made = rows[0]["made_with"]
    assert made["branches"] == 1 and made["acl"] == ["finance", "hr"]
    assert made["policy"] == "heuristic" and "search_mode" in made
    assert "s3cret" not in out.read_text() and "llm_url" not in made
    out.write_bytes(out.read_bytes().rstrip(b"\n"))  # a whole last row that lost its newline
    before = out.read_bytes()  # (a refusal cut it as torn: a finished answer lost)
    for flags, differ in ((("--branches", "2", "--acl", "hr", "--acl", "finance"),
                           "branches 1 there, 2 now"),
                          (("--branches", "1", "--acl", "hr"),
                           "acl finance, hr there, hr now"),
                          (("--branches", "1"), "acl finance, hr there, none now")):
        refused = batch(*flags)
        assert refused.returncode == 2, refused.stderr[-2000:]
        lines = refused.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and differ in lines[0], lines
        assert "['" not in lines[0] and "None" not in lines[0], lines  # values, not reprs
        assert "holds 2 ok row(s) made with other settings" in lines[0]
        assert out.read_bytes() == before
    again = batch("--branches", "1", "--acl", "finance", "--acl", "hr", "--acl", "hr")
    assert again.returncode == 0 and "2 already ok" in again.stdout, again.stderr[-2000:]
    # a question edited under its id is asked again, and named
    inp.write_text(inp.read_text().replace(queries[0]["text"], queries[0]["text"] + " (ed.)"))
    edited = batch("--branches", "1", "--acl", "finance", "--acl", "hr")
    assert edited.returncode == 0 and "1 ok, 0 partial, 0 failed; 1 already ok" in edited.stdout
    assert f"asking again 1 question(s) whose text changed since their ok row was written: " \
        f"{queries[0]['_id']}" in edited.stderr, edited.stderr[-2000:]


def test_a_resume_asks_again_rows_made_with_another_encoding_and_keeps_older_rows(tmp_path):
    """`made_with` records every setting that changes a result, `encoding` among them (the
    agent counts its budget in it; it was not recorded, so a resume mixed the evidence of two
    encodings in one output). A row made with another value is not done; a row an older
    version wrote, naming fewer settings (no `encoding`) or none, still is: it is not asked
    again."""
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.orchestrator.batch import made_with, resume_state

    settings = load_settings(overrides={"home": tmp_path}, read_env=False, read_file=False)
    made = made_with(settings, ["hr"])
    assert made["encoding"] == "o200k_base" and made["acl"] == ["hr"]
    other = made_with(settings.replace(encoding="cl100k_base"), ["hr"])
    older = {k: v for k, v in made.items() if k != "encoding"}
    out = tmp_path / "out.jsonl"
    out.write_text("".join(json.dumps({"id": qid, "question": "Who?", "status": "ok",
                                       "index": "default", **row}) + "\n"
                           for qid, row in (("same", {"made_with": made}),
                                            ("encoding", {"made_with": other}),
                                            ("older", {"made_with": older}),
                                            ("oldest", {}))))
    state = resume_state(out, "default", made)
    assert sorted(state.done) == ["older", "oldest", "same"] and not state.other_index
    assert list(state.other_made) == ["encoding"]


def test_batch_ids_are_non_empty_strings_or_numbers(tmp_path):
    """Ids that are "", true, an array or an object were written as Python text ("['a']"):
    now malformed lines, named with their line numbers. A number id is written back as text
    ("7"), and a re-run finds it done."""
    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.infra.config.settings import load_settings

    settings = load_settings(overrides={"home": tmp_path / "home", "index": "ids"},
                             read_env=False, read_file=False)
    ingest(HOTPOT, settings, dense=False)
    question = json.loads((HOTPOT / "queries.jsonl").read_text().splitlines()[0])["text"]
    ids = ["", "  ", ["a"], {"a": 1}, True, None, "a", 7, 1.5, "7"]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "question": question}) + "\n" for i in ids))
    cmd = [sys.executable, "-m", "branchsearch.orchestrator.cli", "batch", str(inp), "-o",
           str(out), "--home", str(settings.home), "--index", "ids", "--executor", "local",
           "--branches", "1"]
    env = {**os.environ, "BRANCHSEARCH_SEARCH_MODE": "bm25"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    rule = "'id' must be a non-empty string or a number, not"
    for lineno, says in ((1, "'id' is empty"), (2, "'id' is empty"), (3, f"{rule} an array"),
                         (4, f"{rule} an object"), (5, f"{rule} true or false"),
                         (6, "needs 'id'"), (10, "duplicate id '7'")):
        assert f"in.jsonl:{lineno}: {says}" in done.stderr, (lineno, done.stderr[-2000:])
    assert "3 ok" in done.stdout and "7 malformed input lines skipped" in done.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "7", "1.5"]
    assert all(r["status"] == "ok" for r in rows)
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert "0 ok, 0 partial, 0 failed; 3 already ok" in again.stdout, again.stderr[-2000:]
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a", "7", "1.5"]



def test_batch_ids_that_show_nothing_are_malformed_lines(tmp_path):
    """An id of a zero-width space, a byte-order mark or a Hangul filler was run and written
    as an id no reader could tell from an empty one (which is refused): now each is a
    malformed line naming its line number and the id escaped, and the other questions run."""
    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.infra.config.settings import load_settings

    settings = load_settings(overrides={"home": tmp_path / "home", "index": "ids"},
                             read_env=False, read_file=False)
    ingest(HOTPOT, settings, dense=False)
    question = json.loads((HOTPOT / "queries.jsonl").read_text().splitlines()[0])["text"]
    ids = ["\u200b", "\ufeff", "\u3164\u200d", "a\u00e9"]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "question": question}) + "\n" for i in ids))
    done = subprocess.run(
        [sys.executable, "-m", "branchsearch.orchestrator.cli", "batch", str(inp), "-o",
         str(out), "--home", str(settings.home), "--index", "ids", "--executor", "local",
         "--branches", "1"], env={**os.environ, "BRANCHSEARCH_SEARCH_MODE": "bm25"},
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    for lineno, shown in ((1, "'\\u200b'"), (2, "'\\ufeff'"), (3, "'\\u3164\\u200d'")):
        assert (f"skipped {inp}:{lineno}: 'id' {shown} has no character that shows: give each "
                "question an id one can read") in done.stderr, done.stderr[-2000:]
    assert "1 ok" in done.stdout and "3 malformed input lines skipped" in done.stdout
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a\u00e9"]


def test_an_output_row_whose_id_shows_nothing_survives_the_rewrite(tmp_path):
    """An output an earlier version wrote may hold a row whose id shows nothing (it was
    accepted then): the end-of-run rewrite keeps it, as it keeps every other id's latest row,
    rather than drop finished work because its input line would now be refused."""
    from branchsearch.orchestrator.batch import compact

    out = tmp_path / "out.jsonl"
    out.write_text("".join(json.dumps({"id": qid, "question": "Who?", "status": "ok"}) + "\n"
                           for qid in ("a", "\u200b", "\u200b", "b")))
    assert compact(out, ["a", "b"]) == 3
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [
        "a", "b", "\u200b"]


@pytest.fixture(scope="module")
def local_driver(tmp_path_factory):
    """hotpot-mini, BM25 only (no embedding), searched in-process."""
    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.orchestrator.driver import Driver

    settings = load_settings(overrides={"home": tmp_path_factory.mktemp("local"),
                                        "search_mode": "bm25", "branches": 3,
                                        "skip_covered": False},  # every branch runs
                             read_env=False, read_file=False)
    ingest(HOTPOT, settings, dense=False)
    driver = Driver(settings, mode="local")
    yield driver
    driver.close()


def test_local_search_streams_events_in_order(local_driver):
    events = []
    result = local_driver.search(Q, on_event=events.append)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "plan" and kinds[-1] == "result"
    assert events[0]["subqueries"] == [b.subquery for b in result.branches]
    for b in result.branches:  # started, its searches (and prunes), done — branch by branch
        mine = [e["type"] for e in events if e.get("branch") == b.index]
        assert mine[0] == "branch_started" and mine[-1] == "branch_done" and "search" in mine
        done = next(e for e in events if e["type"] == "branch_done" and e["branch"] == b.index)
        assert done["status"] == "ok" and done["turns"] == b.turns
    searched = {i for e in events if e["type"] == "search" for i in e["new_ids"]}
    assert set(result.ranked_chunk_ids) <= searched
    prunes = [e for e in events if e["type"] == "prune"]
    assert all(p["tokens_after"] <= p["tokens_before"] and p["reason"] for p in prunes)
    assert events[-1]["result"]["status"] == "ok" == result.status
    assert json.loads(json.dumps(events))  # plain JSON-able dicts


def test_evidence_that_shares_no_word_with_the_question_is_said_to_match_by_meaning_only(
        hotpot_settings):
    """A dense search always returns nearest neighbours: invented words on a hybrid index got
    ten documents, status ok and no note, a result that looked fine. Now the result says so;
    a question its evidence shares words with gets no note."""
    from branchsearch.orchestrator.driver import Driver
    from branchsearch.orchestrator.result import MEANING_ONLY, evidence_texts, meaning_only

    assert meaning_only("Who directed Éd Wood?", ["Kiss and Tell", "ed wood was a director"]) \
        is False  # accents and case fold, as the search's terms do
    assert meaning_only("qwzx plorfing", ["Terry Richardson", "a photographer"])
    assert not meaning_only("qwzx plorfing", [])  # nothing returned: "no evidence" says it
    assert not meaning_only("東京の人口は", ["Tokyo"])  # no word to judge by: no claim
    assert not meaning_only("세븐틴 7777", ["세븐틴의 앨범"])  # Hangul: not judged either
    # what a lexical search would match is never "meaning only" (a hostile pass found these)
    assert not meaning_only("Hork Bajir", ["The Hork-Bajir Chronicles"])  # split at '-'
    assert not meaning_only("Gone-in-60-Seconds", ["Gone in 60 Seconds (2000 film)"])
    assert not meaning_only("Who is directing it?", ["a film directed by"])  # a stem apart
    assert not meaning_only("الجامع الكبير 3333", ["الجامع الكبير"])  # any script with spaces
    assert meaning_only("Scot Derickson", ["Scott Derrickson is an American director"])
    driver = Driver(hotpot_settings.replace(branches=1), mode="local")
    try:
        invented = driver.search("qwzx plorfing vingledash")
        assert invented.status == "ok" and invented.evidence  # the neighbours, as before
        assert invented.notes == [MEANING_ONLY]
        assert invented.to_dict()["notes"] == [MEANING_ONLY]
        real = driver.search("Which film did Scott Derrickson direct?")
        assert real.notes == [] and not meaning_only(real.question, evidence_texts(real.evidence))
    finally:
        driver.close()


def test_question_checks_empty_and_over_long(local_driver):
    from branchsearch.infra.errors import BranchsearchError

    for empty in ("", "   \n"):
        with pytest.raises(BranchsearchError, match="empty question"):
            local_driver.search(empty)
    for wordless in ("?!?", " … -- ** "):  # nothing to search: no arbitrary neighbours
        with pytest.raises(BranchsearchError, match="no words to search for"):
            local_driver.search(wordless)
    assert local_driver.search("Wer ist Corliss Archer? 1945", max_branches=1).status == "ok"
    long = Q + " " + " ".join(f"padding{i}" for i in range(20000))  # ~100 KB
    result = local_driver.search(long, max_branches=1)
    cap = local_driver.settings.query_max_tokens
    assert result.status == "ok" and result.evidence  # searched, not silently rejected
    assert result.notes and f"to {cap} tokens" in result.notes[0]
    assert result.to_dict()["notes"] == result.notes
    sub = result.branches[0].subquery
    assert local_driver.counter.count(sub) <= cap and sub.startswith(Q)
    assert local_driver.search(Q, max_branches=1).notes == []
    # nothing matched: an empty answer says so, not a bare "ok" that looks like a result
    nothing = local_driver.search("zxqvbnm plorkwundle", max_branches=1)
    assert nothing.status == "ok" and nothing.evidence == []
    assert nothing.notes == ["no evidence: no document this search may see matched the "
                             "question"]


def test_a_deadline_stops_local_branches(local_driver):
    result = local_driver.search(Q, deadline_s=0)
    assert result.status == "failed"
    assert {b.status for b in result.branches} == {"timeout"}
    assert result.evidence == []


@pytest.mark.ray
def test_a_batch_loses_no_question_to_a_retriever_that_died_for_good(ray_driver, tmp_path):
    """A batch through the Ray executor, two questions at once, whose retriever actor is
    killed twice: once as Ray restarts it, once past its restarts (the executor starts it
    again). Either way the questions that met the death run once more. Every row is ok."""
    import threading

    import ray

    from branchsearch.orchestrator.batch import run_batch

    driver, _ = ray_driver
    queries = [json.loads(line) for line in (HOTPOT / "queries.jsonl").read_text().splitlines()]
    items = [(f"{q['_id']}-{n}", q["text"]) for n in range(2) for q in queries]
    asked, lock, before, killed = [0], threading.Lock(), driver.executor.revived, []

    def search(question: str) -> dict:
        with lock:
            asked[0] += 1
            if asked[0] in (4, 11):  # while the other question is running
                killed.append(driver.executor.retriever)
                ray.kill(killed[-1], no_restart=asked[0] == 11)
        return driver.search(question).to_dict()

    counts = run_batch(items, tmp_path / "out.jsonl", search, concurrency=2)
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert counts["ok"] == len(items) == len(rows), counts
    assert all(r["status"] == "ok" and r["evidence"] for r in rows)
    # the one dead for good was started again (Ray's restart after the first kill is counted
    # only when a question met it: on a busy machine none may have been running on it)
    assert driver.executor.retriever is not killed[-1]
    assert ray.get(driver.executor.retriever.ping.remote(), timeout=60)
    assert 1 <= driver.executor.revived - before <= 2


def test_second_wave_finds_enter_the_fused_top_only_when_the_anchor_names_them():
    def branch(i, kind, ids, weight=1.0, text=lambda c: f"text of {c}"):
        evidence = [{"chunk_id": c, "doc_id": c.split("#")[0],
                     "title": c.split("#")[0].replace("_", " ").title() + " (film)",
                     "text": text(c), "rank": r, "score": 1 / r, "provenance": []}
                    for r, c in enumerate(ids, start=1)]
        return BranchReport(i, f"q{i}", weight, kind, episode=EpisodeResult(
            f"q{i}", "finish", evidence=evidence, ranked_chunk_ids=ids))

    own = [f"d{n}#p0" for n in range(10)]
    # the anchor's top document names "Tim Burton" (the title "Tim Burton (film)" without its
    # parenthetical), in another case; no text names "Look Alike"
    anchor = branch(0, "original", own,
                    text=lambda c: "Big Eyes was DIRECTED by TIM BURTON." if c == "d0#p0" else "")
    bridge = branch(1, "bridge", ["look_alike#p0", "tim_burton#p0"], weight=0.5)
    ranked, evidence = fuse_branches([anchor, bridge], k=5, limit=10)
    docs = [d["doc_id"] for d in evidence]
    assert "tim_burton" in docs and "look_alike" not in docs
    assert len(ranked) == 10 and docs[:5] == ["d0", "d1", "d2", "d3", "d4"]
    # a first-wave branch's find (an entity branch) is not held to it
    entity = branch(1, "entity", ["look_alike#p0", "tim_burton#p0"], weight=0.5)
    docs = [d["doc_id"] for d in fuse_branches([anchor, entity], k=5, limit=10)[1]]
    assert "look_alike" in docs and "tim_burton" in docs
    # a title inside a longer word is not named ("Burtonville"); nor one under 4 characters
    word = branch(0, "original", own,
                  text=lambda c: "Burtonville, near Tim" if c == "d0#p0" else "")
    docs = [d["doc_id"] for d in fuse_branches([word, bridge], k=5, limit=10)[1]]
    assert "tim_burton" not in docs
    # with places to spare, unnamed finds still fill them
    short = branch(0, "original", own[:3])
    docs = [d["doc_id"] for d in fuse_branches([short, bridge], k=5, limit=10)[1]]
    assert docs == ["d0", "d1", "d2", "look_alike", "tim_burton"]


def test_a_bridge_of_a_bridges_find_is_admitted_when_its_parent_is_and_names_it():
    """The third hop is named by the second, not by the question's branch: a bridge of a
    bridge's find keeps a place when its parent bridge's first document is admitted and that
    parent's first documents name it; a look-alike it found, or anything found under a parent
    that was not admitted, does not."""
    def branch(i, kind, ids, weight=1.0, parent=None, text=lambda c: ""):
        evidence = [{"chunk_id": c, "doc_id": c.split("#")[0],
                     "title": c.split("#")[0].replace("_", " ").title(), "text": text(c),
                     "rank": r, "score": 1 / r, "provenance": []}
                    for r, c in enumerate(ids, start=1)]
        return BranchReport(i, f"q{i}", weight, kind, parent=parent, episode=EpisodeResult(
            f"q{i}", "finish", evidence=evidence, ranked_chunk_ids=ids))

    own = [f"d{n}#p0" for n in range(10)]
    anchor = branch(0, "original", own,
                    text=lambda c: "Big Eyes was directed by Tim Burton." if c == "d0#p0" else "")
    burton = branch(1, "bridge", ["tim_burton#p0"], 0.5, parent=0,
                    text=lambda c: "Burton married Lena Olin.")
    olin = branch(2, "bridge", ["look_alike#p0", "lena_olin#p0"], 0.5, parent=1)
    docs = [d["doc_id"] for d in fuse_branches([anchor, burton, olin], k=5, limit=10)[1]]
    assert "tim_burton" in docs and "lena_olin" in docs and "look_alike" not in docs
    # the parent not admitted (the question's branch does not name Tim Burton): nor is its find
    silent = branch(0, "original", own)
    docs = [d["doc_id"] for d in fuse_branches([silent, burton, olin], k=5, limit=10)[1]]
    assert not {"tim_burton", "lena_olin"} & set(docs)
    # a bridge of the question's branch is not admitted by another bridge's text
    sibling = branch(2, "bridge", ["look_alike#p0", "lena_olin#p0"], 0.5, parent=0)
    docs = [d["doc_id"] for d in fuse_branches([anchor, burton, sibling], k=5, limit=10)[1]]
    assert "tim_burton" in docs and "lena_olin" not in docs


def test_a_title_is_named_in_either_unicode_form_and_in_scripts_without_spaces():
    from branchsearch.orchestrator.result import named_in

    nfd, nfc = "Zu\u0308rich", "Z\u00fcrich"
    assert named_in(f"born in {nfc} in 1901", nfd) and named_in(f"born in {nfd}.", nfc)
    assert named_in("大阪城は大阪市にある", "大阪") and not named_in("京都にある", "大阪")
    assert named_in("東京タワーの高さ", "東京タワー (塔)")
    assert not named_in("Ulm is a city", "Ulm") and not named_in("Burtonville", "Burton")


def test_a_fused_chunk_keeps_every_branch_s_provenance():
    """A chunk two branches returned: its fused provenance was the last branch's records
    alone, naming no branch (a research user read the question's own branch's chunk as found
    by another branch's query). It now holds each branch's records, in branch order, each
    naming its branch."""
    def branch(i, kind, trail):
        evidence = [{"chunk_id": "x#p0", "doc_id": "x", "title": "X", "text": "text of x",
                     "rank": 1, "score": 1.0, "provenance": trail}]
        return BranchReport(i, f"q{i}", 1.0, kind, "ok", episode=EpisodeResult(
            f"q{i}", "finish", evidence=evidence, ranked_chunk_ids=["x#p0"]))

    own = {"turn": 1, "tool": "search_corpus", "query": "q0", "rank": 2, "score": 0.5,
           "parents": []}
    bridge = {"turn": 2, "tool": "search_corpus", "query": "bridge words", "rank": 1,
              "score": 0.9, "parents": ["y#p0"]}
    _, evidence = fuse_branches([branch(0, "original", [own]), branch(1, "bridge", [bridge])])
    [chunk] = evidence[0]["chunks"]
    assert [f["branch"] for f in chunk["found_by"]] == [0, 1]
    assert chunk["provenance"] == [{"branch": 0, **own}, {"branch": 1, **bridge}]


def test_a_lost_cluster_writes_no_row_and_starts_no_more_questions(tmp_path):
    """A search that raises `ClusterLost` (the Ray cluster's head node is gone) is no failed
    question: no row is written for it, no question starts after it, and the counts say why
    and how many were not run (the resume asks them)."""
    from branchsearch.infra.errors import ClusterLost
    from branchsearch.orchestrator.batch import run_batch

    asked = []

    def search(question: str) -> dict:
        asked.append(question)
        if question == "q3":
            raise ClusterLost("the Ray cluster is lost: gone")
        return {"status": "ok", "evidence": []}

    out = tmp_path / "out.jsonl"
    counts = run_batch([(f"id{i}", f"q{i}") for i in range(1, 7)], out, search, concurrency=1)
    assert asked == ["q1", "q2", "q3"]
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["id1", "id2"]
    assert (counts["ok"], counts["failed"], counts["not_run"]) == (2, 0, 4)
    assert counts["lost"] == counts["stopped"] == "the Ray cluster is lost: gone"


def test_an_output_of_other_settings_or_another_index_is_refused_for_other_questions_too(
        hotpot_settings, tmp_path):
    """An output whose ok rows were made with --branches 1, run with --branches 2 on an input
    of other questions: the refusal looked only at the ids this input asks, so the run went
    on silently and the output held rows of two settings. Likewise rows of another index that
    this input does not ask, which stayed beside the new index's. Now both are one error line
    before anything runs, the output unchanged."""
    copy = ingest_copy(hotpot_settings, "mixed-out")
    queries = [json.loads(line) for line in (HOTPOT / "queries.jsonl").read_text().splitlines()]
    first, second, out = tmp_path / "first.jsonl", tmp_path / "second.jsonl", tmp_path / "o.jsonl"
    for path, q in ((first, queries[0]), (second, queries[1])):
        path.write_text(json.dumps({"id": q["_id"], "question": q["text"]}) + "\n")

    def batch(inp, *flags: str):
        return subprocess.run([sys.executable, "-m", "branchsearch.orchestrator.cli", "batch",
                               str(inp), "-o", str(out), "--home", str(copy.home), "--index",
                               copy.index, "--concurrency", "1", *flags],
                              capture_output=True, text=True, timeout=300)

    done = batch(first, "--branches", "1")
    assert done.returncode == 0 and "1 ok" in done.stdout, done.stderr[-2000:]
    before = out.read_bytes()
    refused = batch(second, "--branches", "2")
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr[-2000:]
    assert "holds 1 ok row(s) made with other settings (branches 1 there, 2 now" in lines[0]
    assert out.read_bytes() == before
    out.write_bytes(before.replace(b'"index": "mixed-out"', b'"index": "elsewhere"'))
    before = out.read_bytes()
    refused = batch(second, "--branches", "1")
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr[-2000:]
    assert "holds ok rows answered on another index (elsewhere) for questions this input " \
        "does not ask" in lines[0] and "give another -o" in lines[0]
    assert out.read_bytes() == before


def test_a_batch_output_in_a_folder_not_made_yet_is_made(hotpot_settings, tmp_path):
    """`-o results/run1/out.jsonl` with no `results/`: a traceback (FileNotFoundError of the
    output's lock file), exit 1. Now the folders are made and the rows written; a run refused
    before it starts (its input missing) leaves no folder behind."""
    copy = ingest_copy(hotpot_settings, "new-folder")
    q = json.loads((HOTPOT / "queries.jsonl").read_text().splitlines()[0])
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": q["_id"], "question": q["text"]}) + "\n")

    def batch(inp, out):
        return subprocess.run([sys.executable, "-m", "branchsearch.orchestrator.cli", "batch",
                               str(inp), "-o", str(out), "--home", str(copy.home), "--index",
                               copy.index, "--concurrency", "1", "--branches", "1"],
                              capture_output=True, text=True, timeout=300)

    out = tmp_path / "results" / "run1" / "out.jsonl"
    done = batch(inp, out)
    assert done.returncode == 0 and "1 ok" in done.stdout, done.stderr[-2000:]
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [q["_id"]]
    assert sorted(p.name for p in out.parent.iterdir()) == ["out.jsonl"]  # no lock left
    refused = batch(tmp_path / "missing.jsonl", tmp_path / "other" / "run" / "out.jsonl")
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1 and "not found" in lines[0], lines
    assert not (tmp_path / "other").exists()


def test_a_batch_resume_asks_again_the_ok_rows_cut_short_for_lack_of_time(hotpot_settings,
                                                                          tmp_path):
    """A batch whose branch_timeout_s left a later wave (bridges, forks, chains) no time to
    start wrote `ok` rows that are not the whole search ("not searched for lack of time" in
    their notes), and a resume with the timeout raised kept them as done: "0 ok; 4 already
    ok", their evidence short for good (hostile pass: 20 of 39 such rows on a synthetic
    corpus held other rankings than a full search). Those rows are not done: the summary
    says how many were cut short, and the resume asks them again."""
    copy = ingest_copy(hotpot_settings, "cut-short")  # the batch process must own its Milvus
    # Lite file (the session's index may be open in this one)
    queries = [json.loads(line) for line in (HOTPOT / "queries.jsonl").read_text().splitlines()]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": q["_id"], "question": q["text"]}) + "\n"
                           for q in queries[:4]))

    def batch(**env):
        return subprocess.run([sys.executable, "-m", "branchsearch.orchestrator.cli", "batch",
                               str(inp), "-o", str(out), "--home", str(copy.home),
                               "--index", copy.index, "--concurrency", "1"],
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, **env})

    def rows() -> dict:
        return {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}

    # one branch timeout of 0.25 s: a wave after the first never has 0.25 s left to start
    hurried = batch(BRANCHSEARCH_BRANCH_TIMEOUT_S="0.25")
    assert out.exists(), hurried.stderr[-2000:]
    cut = {qid for qid, r in rows().items() if r["status"] == "ok" and
           any(n.startswith("not searched for lack of time") for n in r["notes"])}
    assert cut, hurried.stderr[-2000:]
    assert f"{len(cut)} ok row(s) were cut short" in hurried.stderr, hurried.stderr[-2000:]
    again = batch()
    assert again.returncode == 0, again.stderr[-2000:]
    redone = rows()
    assert len(redone) == 4 and all(r["status"] == "ok" for r in redone.values())
    for qid in cut:  # asked again, with the time to search it whole
        assert redone[qid]["metrics"]["late_waves"] == 0 and not any(
            n.startswith("not searched for lack of time") for n in redone[qid]["notes"])
    assert "cut short" not in again.stderr


def test_a_batch_says_how_many_questions_it_searched_cut_to_the_cap(hotpot_settings, tmp_path):
    """A question longer than `query_max_tokens` is searched by its first tokens and its row
    is `ok`, its notes saying so; the summary counts such rows, so a researcher with thousands
    of questions learns how many were not searched whole."""
    copy = ingest_copy(hotpot_settings, "cut-question")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    long = Q + " " + " ".join(f"padding{i}" for i in range(300))
    inp.write_text(json.dumps({"id": "long", "question": long}) + "\n"
                   + json.dumps({"id": "short", "question": Q}) + "\n")
    run = subprocess.run([sys.executable, "-m", "branchsearch.orchestrator.cli", "batch",
                          str(inp), "-o", str(out), "--home", str(copy.home), "--index",
                          copy.index, "--concurrency", "1"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["long"]["status"] == "ok" and rows["long"]["notes"][0].startswith(
        "question cut from")
    cap = copy.query_max_tokens
    assert (f"1 question(s) were longer than query_max_tokens ({cap}) and were searched by "
            f"their first {cap} tokens") in run.stderr, run.stderr[-2000:]


def test_batch_ids_with_control_or_invisible_characters_are_refused_and_shown_escaped(
        tmp_path):
    """Ids holding a newline, an escape sequence or a zero-width character were printed raw in
    the lines naming them ("asking again …: a", then "b" on a line of its own; 'q1' and
    'q1\\u200b' looked the same; ESC drove the terminal), and then run as ids a reader could
    not tell apart. They follow the document ids' rule: each is a malformed line, its id
    escaped; an id that holds a joiner inside an emoji is kept exactly in the file and shown
    quoted with escapes on the terminal."""
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.ingest.pipeline import ingest

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"_id": f"d{i}", "title": f"Town {i}",
                                          "text": f"Town {i} lies by a {w}."}) + "\n"
                              for i, w in enumerate(["volcano", "lake", "river"])))
    settings = load_settings(overrides={"home": tmp_path / "home", "index": "ids"},
                             read_env=False, read_file=False)
    ingest(corpus, settings, dense=False)
    kept = ["q1", "q\u00e9", "\U0001f469\u200d\U0001f4bb"]
    refused = ["a\nb", "q1\u200b", "\ufeffq2", "x\x1b[2Jy"]
    ids = kept + refused
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"

    def batch(suffix: str):
        inp.write_text("".join(json.dumps({"id": i, "question": f"town by a lake{suffix}"})
                               + "\n" for i in ids))
        return subprocess.run([sys.executable, "-m", "branchsearch.orchestrator.cli", "batch",
                               str(inp), "-o", str(out), "--home", str(settings.home),
                               "--index", "ids", "--concurrency", "1", "--branches", "1"],
                              capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, BRANCHSEARCH_SEARCH_MODE="bm25"))

    first = batch("")
    assert first.returncode == 1 and "3 ok" in first.stdout, first.stderr[-2000:]
    skipped = [line for line in first.stderr.splitlines() if line.startswith("skipped ")]
    assert [line.split(": ", 1)[1].split(" holds ")[0] for line in skipped] == [
        "'id' 'a\\nb'", "'id' 'q1\\u200b'", "'id' '\\ufeffq2'", "'id' 'x\\x1b[2Jy'"], skipped
    again = batch(" or a river")
    assert again.returncode == 1 and "3 ok" in again.stdout, again.stderr[-2000:]
    said = [line for line in again.stderr.splitlines() if line.startswith("asking again")]
    assert said == ["asking again 3 question(s) whose text changed since their ok row was "
                    "written: q1, q\u00e9, '\U0001f469\\u200d\U0001f4bb'"], \
        again.stderr[-2000:]
    for run in (first, again):
        assert "\x1b" not in run.stderr and "\u200b" not in run.stderr
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == kept
