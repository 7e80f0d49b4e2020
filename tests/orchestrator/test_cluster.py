"""Actor planning as a pure function on synthetic cluster resources."""

import pytest

from branchsearch.infra.errors import BranchsearchError
from branchsearch.infra.config.settings import Settings
from branchsearch.orchestrator.execution.actor_plan import (BRANCH_ACTORS_PER_CPU,
                                                            MIN_BRANCH_CPUS, plan_actors)

S = Settings()  # 3 branches, branch_num_cpus 0.5


def fits(plan, resources):
    demand = plan.demand()
    return all(demand[r] <= resources.get(r, 0) + 1e-9 for r in ("CPU", "GPU"))


def test_two_cores_with_an_llm_engine_fit_every_actor():
    """The case that hung: 2 CPUs, one engine actor, 3 branches x concurrency 2."""
    resources = {"CPU": 2.0}
    plan = plan_actors(S.replace(policy="llm"), resources, 6, engines=1)
    assert len(plan.engines) == 1 and plan.branch_actors == 6 and fits(plan, resources)
    assert plan.branch["num_cpus"] >= MIN_BRANCH_CPUS and "num_gpus" not in plan.branch
    # the old sizing ignored the engine: 0.5 + 0.5 + 6 x 0.25 = 2.5 > 2 CPUs
    assert plan.demand()["CPU"] <= 2.0
    # what an index's start waits for beside a service's running pool: not the pool
    # (its start line read "asks CPU 1.6, 0.1 free" for a retriever that asked none)
    alone = plan.demand(pool=False)
    assert alone["CPU"] == pytest.approx(plan.demand()["CPU"]
                                         - plan.branch_actors * plan.branch["num_cpus"])


@pytest.mark.parametrize("cpus, pool, engines", [
    (1, 3, 0), (2, 6, 1), (2, 64, 2), (4, 12, 1), (16, 6, 0), (0.6, 3, 1), (3, 7, 3)])
def test_every_plan_fits_or_shrinks(cpus, pool, engines):
    resources = {"CPU": float(cpus)}
    plan = plan_actors(S, resources, pool, engines=engines)
    assert fits(plan, resources)
    assert S.branches <= plan.branch_actors <= pool
    assert plan.shrunk_from == (pool if plan.branch_actors < pool else 0)
    assert plan.branch["num_cpus"] <= S.branch_num_cpus


def test_a_large_pool_shrinks_on_a_small_cluster():
    plan = plan_actors(S, {"CPU": 1.0}, 100)
    assert plan.branch_actors < 100 and plan.shrunk_from == 100
    assert plan.branch["num_cpus"] >= MIN_BRANCH_CPUS


def test_too_small_a_cluster_stops_with_one_line_naming_the_shortage():
    with pytest.raises(BranchsearchError, match=r"not enough CPUs: the cluster has 0.2"):
        plan_actors(S, {"CPU": 0.2}, 3, engines=1)
    with pytest.raises(BranchsearchError, match="needs? 4 GPUs, the cluster has 2"):
        plan_actors(S.replace(llm_engines=2, llm_tensor_parallel=2), {"CPU": 8, "GPU": 2}, 3,
                    engines=2)


def test_gpus_go_to_engines_first_and_branches_only_when_asked():
    resources = {"CPU": 8.0, "GPU": 4.0}
    plan = plan_actors(S, resources, 3, engines=2)
    assert [e["num_gpus"] for e in plan.engines] == [1, 1]
    assert "num_gpus" not in plan.branch  # branch_num_gpus is 0 by default
    asked = plan_actors(S.replace(branch_num_gpus=1.0), resources, 3, engines=2)
    assert asked.branch["num_gpus"] == pytest.approx(0.666) and fits(asked, resources)
    cpu_only = plan_actors(S.replace(branch_num_gpus=1.0), {"CPU": 8.0}, 3, engines=1)
    assert "num_gpus" not in cpu_only.branch and "num_gpus" not in cpu_only.engines[0]


@pytest.mark.parametrize("free, indexes", [(1.85, 2), (1.85, 5), (0.5, 1), (15.8, 3), (2, 0)])
def test_the_service_pool_fits_what_is_free_with_room_for_every_index(free, indexes):
    """The service's one branch pool is planned from what is free after Serve's own actors,
    leaving a retriever's share for each index and one more: nothing it starts can pend."""
    from branchsearch.orchestrator.execution.actor_plan import plan_service

    plan = plan_service(S, {"CPU": free}, indexes, 6)
    demand = plan.branch_actors * plan.branch["num_cpus"] + \
        (indexes + 1) * plan.retriever["num_cpus"]
    assert demand <= free + 1e-9
    assert S.branches <= plan.branch_actors <= 6
    assert plan.branch["num_cpus"] >= MIN_BRANCH_CPUS


def test_the_service_pool_is_capped_and_spread_over_several_nodes():
    """The service plans as a driver does: a heuristic pool of at most 2 actors a free CPU,
    and on 2+ nodes its retrievers and branch actors spread (`ray.available_resources()`
    names each node, as `cluster_resources()` does)."""
    from branchsearch.orchestrator.execution.actor_plan import plan_service

    one = {"CPU": 1.5, "node:10.77.0.1": 1.0, "node:__internal_head__": 1.0}
    two = {**one, "CPU": 3.0, "node:10.77.0.2": 1.0}
    single = plan_service(S, one, 1, 40)
    assert single.branch_actors == 3  # ceil(2 x 1.5), not 40
    assert "scheduling_strategy" not in single.branch | single.retriever
    spread = plan_service(S, two, 1, 40)
    assert spread.branch_actors == 6
    assert spread.branch["scheduling_strategy"] == spread.retriever["scheduling_strategy"] \
        == "SPREAD"
    llm = plan_service(S.replace(policy="llm"), one, 1, 12)
    assert llm.branch_actors == 12  # an LLM branch waits on a model: not capped


def test_a_service_without_room_for_one_question_says_so():
    from branchsearch.orchestrator.execution.actor_plan import plan_service

    with pytest.raises(BranchsearchError, match="not enough CPUs for the service"):
        plan_service(S, {"CPU": 0.1}, 2, 6)


def test_on_several_nodes_replicas_and_branch_actors_are_spread():
    """Ray packs actors onto the driver's node while it is under half busy: on 2 one-CPU nodes
    both replicas landed on the head. Spread them (and the pool) when there are 2+ nodes."""
    one = {"CPU": 1.0, "node:10.77.0.1": 1.0, "node:__internal_head__": 1.0}
    two = {**one, "CPU": 2.0, "node:10.77.0.2": 1.0}
    single = plan_actors(S, one, 12, retrievers=1)
    assert "scheduling_strategy" not in single.retriever
    assert "scheduling_strategy" not in single.branch
    spread = plan_actors(S, two, 12, retrievers=2)
    assert spread.retriever["scheduling_strategy"] == "SPREAD"
    assert spread.branch["scheduling_strategy"] == "SPREAD"
    assert spread.retrievers == 2 and fits(spread, two)
    # what cluster_resources() without node entries (synthetic resources) means: one node
    assert "scheduling_strategy" not in plan_actors(S, {"CPU": 8.0}, 6).retriever


@pytest.mark.parametrize("cpus, pool, expected", [(1, 12, 3), (2, 12, 4), (4, 6, 6), (8, 40, 16)])
def test_a_cpu_bound_pool_holds_at_most_two_branch_actors_a_cpu(cpus, pool, expected):
    """On a 1-CPU node, batch --concurrency 4 x 3 branches grew the pool to 11 actors, each a
    process that cost about a CPU-second to start and then mostly waited: more start-up than
    the batch's own work. A heuristic pool stops at 2 a CPU (never below one question's
    branches); the LLM policy's, whose branches wait on a model, keeps its size."""
    assert BRANCH_ACTORS_PER_CPU == 2
    resources = {"CPU": float(cpus)}
    plan = plan_actors(S, resources, pool)
    assert plan.branch_actors == expected and fits(plan, resources)
    assert plan_actors(S.replace(policy="llm"), {"CPU": 1.0}, 12).branch_actors == 12


def test_a_joined_busy_cluster_is_planned_on_its_free_cpus():
    """`free_share`: what a process joining a cluster others use plans on first (its CPUs cut
    to the free ones; GPUs whole: an engine waits for a GPU rather than run on CPUs).
    tests/infra/test_raycluster.py runs it on a real cluster."""
    from branchsearch.orchestrator.execution.actor_plan import free_share

    total = {"CPU": 8.0, "GPU": 2.0, "node:10.0.0.1": 1.0, "node:10.0.0.2": 1.0}
    share = free_share(total, {"CPU": 1.5, "GPU": 0.0})
    assert (share["CPU"], share["GPU"], share["node:10.0.0.2"]) == (1.5, 2.0, 1.0)
    plan = plan_actors(S, share, 12)
    assert fits(plan, share) and S.branches <= plan.branch_actors < 12
    assert plan.branch["scheduling_strategy"] == "SPREAD"  # still two nodes
    engine = plan_actors(S.replace(policy="llm"), share, 3, engines=1).engines[0]
    assert engine["num_gpus"] == 1  # busy GPUs are still GPUs
