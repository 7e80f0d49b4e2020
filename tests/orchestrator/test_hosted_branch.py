"""The question's own branch hosted by its retriever replica, when that replica fails (a Ray
cluster of its own: a replica killed here must not touch another module's actors)."""

import pytest

from conftest import ingest_copy

Q = "Were Scott Derrickson and Ed Wood of the same nationality?"


@pytest.mark.ray
def test_a_replica_lost_under_a_hosted_branch_runs_it_on_a_pool_actor(hotpot_settings):
    """The replica restarts (max_restarts) while it hosts the question's branch: a pool actor
    runs that branch again, the others' events still arrive, the next question is hosted."""
    import threading

    import ray

    from branchsearch.orchestrator.driver import Driver
    from branchsearch.workers.heuristic import HeuristicPolicy
    from branchsearch.workers.scripted import SlowPolicy

    settings = ingest_copy(hotpot_settings, "hotpot-rescue").replace(
        branches=3, branch_timeout_s=40, search_mode="bm25", skip_covered=False)
    driver = Driver(settings, mode="ray", pool_size=3)
    try:
        replica = driver.executor.retrievers[0]
        driver.policy_factory = lambda i, q: SlowPolicy(2) if i == 0 else HeuristicPolicy()
        threading.Timer(1.0, lambda: ray.kill(replica, no_restart=False)).start()
        events = []
        result = driver.search(Q, on_event=events.append)
        assert [b.status for b in result.branches] == ["ok", "ok", "ok"], \
            [b.error for b in result.branches]
        restarted = ray.get(replica.ping.remote())  # the replica's new process
        assert result.branches[0].pid != restarted  # it ran again, on a pool actor
        for b in result.branches[1:]:  # the healthy branches' events were all kept
            mine = [e for e in events if e.get("branch") == b.index]
            assert [e["type"] for e in mine].count("branch_done") == 1
            found = {i for e in mine if e["type"] == "search" for i in e["new_ids"]}
            assert b.ranked_chunk_ids and set(b.ranked_chunk_ids) <= found
        driver.policy_factory = None
        again = driver.search(Q)
        assert [b.status for b in again.branches] == ["ok", "ok", "ok"]
        executor = driver.executor
        assert executor.balancer.hosting == [False] and len(executor.pool._idle) == executor.pool._created
    finally:
        driver.close()
        ray.shutdown()


@pytest.mark.ray
def test_hosted_and_pool_branches_rank_as_the_in_process_run(hotpot_settings):
    """Where a branch runs changes nothing it finds: Ray (hosted + pool actors) and the local
    executor give the same fused and per-branch rankings, question by question."""
    import json

    import ray

    from branchsearch.orchestrator.driver import Driver

    from conftest import HOTPOT

    questions = [json.loads(line)["text"]
                 for line in (HOTPOT / "queries.jsonl").read_text().splitlines()]
    settings = ingest_copy(hotpot_settings, "hotpot-same").replace(
        branches=3, branch_timeout_s=60, search_mode="bm25", skip_covered=False)
    got = {}
    for mode in ("local", "ray"):
        driver = Driver(settings, mode=mode, pool_size=3)
        try:
            got[mode] = [(r.ranked_chunk_ids, [b.ranked_chunk_ids for b in r.branches],
                          [b.status for b in r.branches])
                         for r in (driver.search(q) for q in questions)]
        finally:
            driver.close()
    ray.shutdown()
    assert got["ray"] == got["local"]
    assert any(len(branches) > 1 for _, branches, _ in got["ray"])  # some questions branch


@pytest.mark.ray
def test_a_replica_restarted_under_a_service_write_opens_the_index(hotpot_settings):
    """A document write through the service holds the index's lock while its retriever actor
    makes it. The actor lost under it (its node died) was restarted by Ray, and its new
    process refused to open the index "being ingested right now" by that very write, so it
    died for good: on a 2-node cluster the write got a 503 and the searches then meeting it
    failed their branches ("search failed after 2 retries: ... creation task"). It opens now."""
    import time

    import ray

    from branchsearch.infra.index.manifest import SERVICE_WRITE, IngestLock
    from branchsearch.orchestrator.driver import Driver

    settings = ingest_copy(hotpot_settings, "hotpot-written").replace(
        branches=1, search_mode="bm25")
    driver = Driver(settings, mode="ray", pool_size=1)
    try:
        replica = driver.executor.retrievers[0]
        before = ray.get(replica.ping.remote(), timeout=120)
        with IngestLock(settings.index_dir, settings.index, corpus=SERVICE_WRITE):
            ray.kill(replica, no_restart=False)
            deadline = time.monotonic() + 120
            after = before
            while after == before:  # until its new process answers (old: ActorDiedError)
                assert time.monotonic() < deadline
                try:
                    after = ray.get(replica.ping.remote(), timeout=120)
                except ray.exceptions.ActorUnavailableError:  # restarting
                    time.sleep(0.5)
        assert [b.status for b in driver.search(Q).branches] == ["ok"]
    finally:
        driver.close()
        ray.shutdown()
