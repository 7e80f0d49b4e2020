"""Retriever replicas on a real local Ray cluster: two replicas over a real Milvus server (the
`milvus` package's standalone server, or any Milvus at BRANCHSEARCH_MILVUS_URI) both serve
searches and give the same results as one; on a Milvus Lite file one replica starts."""

from __future__ import annotations

import logging
import uuid

import pytest

from branchsearch.infra.ingest.pipeline import ingest

from conftest import HOTPOT, ingest_copy

QUESTIONS = ["Were Scott Derrickson and Ed Wood of the same nationality?",
             "What government position was held by the woman who portrayed Corliss Archer in "
             "the film Kiss and Tell?",
             "Which magazine was started first, Arthur's Magazine or First for Women?"]


@pytest.fixture(scope="module")
def server_uri(milvus_uri):
    """The session's one Milvus server (conftest): two standalone servers cannot run on one
    machine (their embedded etcd both bind port 2380)."""
    return milvus_uri


@pytest.fixture(scope="module")
def ray_session():
    import ray

    yield
    ray.shutdown()


def evidence(driver) -> list[list[tuple[str, list[str]]]]:
    out = []
    for q in QUESTIONS:
        r = driver.search(q)
        assert r.status == "ok", [b.error for b in r.branches]
        out.append([(d["doc_id"], [c["chunk_id"] for c in d["chunks"]]) for d in r.evidence])
    return out


@pytest.mark.ray
def test_two_replicas_both_serve_and_match_one(server_uri, hotpot_settings, ray_session):
    import ray

    from branchsearch.orchestrator.driver import Driver

    index = f"rep{uuid.uuid4().hex[:6]}"
    settings = hotpot_settings.replace(index=index, milvus_uri=server_uri, branches=3,
                                       milvus_consistency="Strong", branch_timeout_s=60)
    ingest(HOTPOT, settings)
    drivers = {}
    try:
        two = drivers[2] = Driver(settings.replace(retriever_replicas=2), mode="ray",
                                  pool_size=3)
        assert len(two.executor.retrievers) == 2 and two.executor.replica_note == ""
        assert two.executor.plan.retrievers == 2
        pids = ray.get([r.ping.remote() for r in two.executor.retrievers])
        assert len(set(pids)) == 2  # two processes, each with its own clients
        got_two = evidence(two)
        served = ray.get([r.served.remote() for r in two.executor.retrievers])
        assert all(n > 0 for n in served), served  # both replicas answered tool calls
        assert two.executor.balancer.load == [0, 0]
        two.close()
        one = drivers[1] = Driver(settings.replace(retriever_replicas=1), mode="ray",
                                  pool_size=3)
        assert len(one.executor.retrievers) == 1
        got_one = evidence(one)
        assert got_two == got_one  # same evidence, same order, whichever replica served
        assert any("scott-derrickson" in [d for d, _ in ev] for ev in got_one)
    finally:
        for d in drivers.values():
            d.close()
        from branchsearch.infra.index.open import open_retriever

        r = open_retriever(settings)
        r.dense.drop()
        r.close()


@pytest.mark.ray
def test_a_lite_index_keeps_one_retriever(hotpot_settings, ray_session, caplog):
    from branchsearch.orchestrator.driver import Driver

    settings = ingest_copy(hotpot_settings, "hotpot-replicas").replace(
        retriever_replicas=2, branches=2, branch_timeout_s=60)
    with caplog.at_level(logging.WARNING, logger="branchsearch.executors"):
        driver = Driver(settings, mode="ray", pool_size=2)
    try:
        assert len(driver.executor.retrievers) == 1
        notes = [r.getMessage() for r in caplog.records if "retriever_replicas" in r.getMessage()]
        assert len(notes) == 1 and "one owning process" in notes[0]
        assert driver.search(QUESTIONS[0]).status == "ok"
    finally:
        driver.close()


@pytest.mark.ray
def test_a_branch_actor_lost_is_replaced_and_the_question_runs_again(hotpot_settings,
                                                                       ray_session):
    """A pool actor dies (its node gone, killed): the branch placed on it fails, the pool
    replaces it, and the question runs once more (a `rerun` event first), as after a retriever's
    death, instead of a partial result with 'actor died'."""
    import ray

    from branchsearch.orchestrator.driver import Driver

    settings = ingest_copy(hotpot_settings, "hotpot-branch-death").replace(
        branches=3, branch_timeout_s=60, skip_covered=False)  # the planned branches run
    driver = Driver(settings, mode="ray", pool_size=2)
    try:
        before = driver.search(QUESTIONS[0])  # a comparison: branches beside the hosted one
        assert before.status == "ok" and len(before.branches) >= 2
        pool = driver.executor.pool
        for actor in list(pool._idle):
            ray.kill(actor, no_restart=True)
        events = []
        after = driver.search(QUESTIONS[0], on_event=events.append)
        assert after.status == "ok", [b.error for b in after.branches]
        assert [e["type"] for e in events].count("rerun") == 1
        assert "a branch process died" in next(e for e in events if e["type"] == "rerun")["reason"]
        assert after.evidence == before.evidence
    finally:
        driver.close()
