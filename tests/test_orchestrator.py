"""The driver on a real local Ray cluster: fan-out, failures, one trace across processes, and a
batch killed mid-run then resumed. Plus the planner and branch fusion as plain functions."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from branchsearch.orchestrator.plan import HeuristicPlanner
from branchsearch.orchestrator.result import BranchReport, fuse_branches

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
    a = BranchReport(0, "q", 1.0, "original", "ok", ranked_chunk_ids=["x#p0", "y#p0"])
    b = BranchReport(1, "q2", 0.5, "entity", "ok", ranked_chunk_ids=["y#p0", "z#p0"])
    dead = BranchReport(2, "q3", 1.0, "entity", "error", ranked_chunk_ids=["w#p0"])
    chunks = {"y#p0": {"doc_id": "y", "title": "Y", "text": "why"}}
    ranked, evidence = fuse_branches([a, b, dead], chunks, k=60)
    # y: 1/62 + 0.5/61 ; x: 1/61 ; z: 0.5/62
    assert ranked == ["y#p0", "x#p0", "z#p0"]
    assert evidence[0]["chunks"][0]["found_by"] == [
        {"branch": 0, "subquery": "q", "rank": 2}, {"branch": 1, "subquery": "q2", "rank": 1}]
    assert evidence[1]["doc_id"] == "x"


@pytest.fixture(scope="module")
def ray_driver(hotpot_settings, tmp_path_factory):
    import ray

    import scripted
    from branchsearch.orchestrator.driver import Driver

    ray.cloudpickle.register_pickle_by_value(scripted)
    trace_file = tmp_path_factory.mktemp("trace") / "spans.jsonl"
    settings = ingest_copy(hotpot_settings, "hotpot-ray").replace(
        trace_exporter="jsonl", trace_file=str(trace_file), branch_timeout_s=20, branches=3)
    driver = Driver(settings, mode="ray", pool_size=3)
    yield driver, trace_file
    driver.close()
    ray.shutdown()


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
def test_a_crashed_and_a_late_branch_are_reported(ray_driver):
    import scripted

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
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    first = out.read_text().count("\n")
    assert 3 <= first < len(queries), "the batch should be killed mid-run"
    with out.open("a") as f:
        f.write('{"id": "torn')  # a write cut short by the crash
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "in.jsonl:13" in done.stderr and "in.jsonl:14" in done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    ids = [r["id"] for r in rows]
    assert sorted(ids) == sorted(q["_id"] for q in queries) and len(ids) == len(set(ids))
    assert all(r["evidence"] and r["trace_id"] and r["branches"] for r in rows)
    assert f"{len(queries) - first} ok, 0 partial, 0 failed" in done.stdout
    assert all(r["status"] == "ok" for r in rows)
