"""Retriever replicas without Ray: how many start (`IndexProfile.replicas`: a Milvus Lite file keeps
one owner), which one serves the next branch (`ReplicaBalancer`), and that the actor plan
counts them (`plan_actors`)."""

from __future__ import annotations

import threading

import pytest

from branchsearch.infra.errors import BranchsearchError, SettingsError
from branchsearch.infra.stores.external import parse_indexes
from branchsearch.infra.config.settings import Settings, load_settings
from branchsearch.orchestrator.execution.actor_plan import plan_actors
from branchsearch.infra.index.profile import index_profile
from branchsearch.orchestrator.execution.balancer import ReplicaBalancer


def replica_count(s: Settings) -> tuple[int, str]:
    return index_profile(s).replicas(s.retriever_replicas)


def lite_file(s: Settings) -> str:
    return index_profile(s).lite_file

SERVER = "http://milvus.internal:19530"


def settings(tmp_path, **changes) -> Settings:
    return load_settings(overrides={"home": tmp_path, "index": "ix", **changes},
                         read_env=False, read_file=False)


def test_replicas_need_a_server_dense_store(tmp_path):
    lite = settings(tmp_path, retriever_replicas=3)
    n, note = replica_count(lite)
    assert n == 1 and "Milvus Lite" in note and "one owning process" in note
    assert str(tmp_path / "indexes" / "ix" / "dense.db") in note
    assert replica_count(lite.replace(milvus_uri=SERVER)) == (3, "")
    assert replica_count(lite.replace(search_mode="bm25")) == (3, "")  # no dense store opened
    assert replica_count(lite.replace(milvus_uri=str(tmp_path / "x.db")))[0] == 1  # Lite by path
    assert replica_count(lite.replace(retriever_replicas=1)) == (1, "")  # nothing to explain
    with pytest.raises(SettingsError, match="retriever_replicas"):
        settings(tmp_path, retriever_replicas=0)


def test_external_indexes_count_their_own_dense_store(tmp_path):
    tables = {"es": {"lexical": "elasticsearch", "es_index": "docs", "es_url": "http://es:9200"},
              "both": {"lexical": "elasticsearch", "es_index": "docs",
                       "es_url": "http://es:9200", "dense": "milvus",
                       "milvus_collection": "c", "milvus_uri": str(tmp_path / "lite.db")}}
    base = settings(tmp_path, retriever_replicas=2).replace(indexes=parse_indexes(tables))
    assert replica_count(base.replace(index="es")) == (2, "")  # Elasticsearch only
    assert lite_file(base.replace(index="both")) == str(tmp_path / "lite.db")
    assert replica_count(base.replace(index="both"))[0] == 1
    # a bm25 search of a hybrid external index still opens the collection (its groups count)
    assert lite_file(base.replace(index="both", search_mode="bm25")) == str(tmp_path / "lite.db")


def test_least_loaded_then_round_robin():
    b = ReplicaBalancer(2)
    first = [b.take() for _ in range(3)]  # one question, 3 branches
    assert first == [0, 1, 0] and b.load == [2, 1]
    assert b.take() == 1  # the less loaded, not the next in turn
    b.done(0)
    b.done(0)
    assert b.load == [0, 2] and b.take() == 0 and b.take() == 0
    for r in (0, 0, 1, 1):
        b.done(r)
    assert b.load == [0, 0] and sum(b.served) == 6
    b.done(1)  # a second done for the same branch never goes below zero
    assert b.load == [0, 0]
    with pytest.raises(ValueError):
        ReplicaBalancer(0)


def test_balancer_spreads_concurrent_questions_evenly():
    b = ReplicaBalancer(3)
    seen: list[int] = []
    lock = threading.Lock()

    def question():
        picks = [b.take() for _ in range(3)]
        with lock:
            seen.extend(picks)
        for p in picks:
            b.done(p)

    threads = [threading.Thread(target=question) for _ in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert b.load == [0, 0, 0] and len(seen) == 120
    assert max(b.served) - min(b.served) <= 40 and min(b.served) >= 20  # no replica starved


@pytest.mark.parametrize("cpus, retrievers", [(2, 1), (2, 2), (2, 4), (4, 3), (64, 8)])
def test_plan_counts_every_replica(cpus, retrievers):
    resources = {"CPU": float(cpus)}
    plan = plan_actors(Settings(), resources, 6, retrievers=retrievers)
    assert plan.retrievers == retrievers
    assert plan.demand()["CPU"] <= cpus + 1e-9  # the replicas fit beside the branch pool
    # together the replicas take at most a quarter of a small cluster, one CPU each on a big one
    assert retrievers * plan.retriever["num_cpus"] <= min(cpus / 4, retrievers) + 1e-9
    one = plan_actors(Settings(), resources, 6)
    assert plan.branch_actors >= Settings().branches and plan.branch_actors <= one.branch_actors


def test_replicas_that_leave_no_room_for_branches_are_refused():
    with pytest.raises(BranchsearchError, match="retriever actor"):
        plan_actors(Settings(), {"CPU": 0.1}, 3, retrievers=2)
