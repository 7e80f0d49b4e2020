"""Planning every actor a driver (or the service) starts against what the cluster has.

An actor that asks for more than the cluster has pends forever, so the plan counts every actor
it starts — the LLM engine actors, the retriever actor and the branch pool — before any is
started. When the pool does not fit it shrinks; when even the smallest plan does not fit it
stops at once with one line naming the shortage. On a cluster of several nodes the retriever
replicas and the branch actors are spread over the nodes (Ray's default packs actors onto the
driver's node while it is less than half busy, which put every replica on the head node and left
the other nodes' CPUs to the branch actors alone). `plan_actors` is a pure function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from branchsearch.infra.errors import BranchsearchError
from branchsearch.infra.config.settings import Settings

MIN_BRANCH_CPUS = 0.05  # below this a branch actor is starved; shrink the pool instead
# A heuristic branch is CPU work (its policy, and the searches of its replica): past this many
# branch actors a CPU, more only queue for it, and each costs a process start (about a
# CPU-second) and its memory. The LLM policy's branches wait on a model: not capped.
BRANCH_ACTORS_PER_CPU = 2


@dataclass(frozen=True)
class ActorPlan:
    """Ray options for each kind of actor, and how many branch actors the pool may hold."""

    engines: tuple[dict, ...]  # one options dict per LLM engine actor
    retriever: dict
    branch: dict
    branch_actors: int
    shrunk_from: int = 0  # the pool size asked for, when it had to shrink
    retrievers: int = 1  # retriever actors (replicas), each with the `retriever` options

    def demand(self, *, pool: bool = True) -> dict[str, float]:
        """Total CPU and GPU the plan asks for; `pool=False`: without the branch pool (a
        service's pool, shared and already running, is not what an index's start waits for)."""
        actors = [*self.engines, *[self.retriever] * self.retrievers,
                  *([self.branch] * self.branch_actors if pool else [])]
        return {r: round(sum(a.get(f"num_{r.lower()}s", 0) for a in actors), 6)
                for r in ("CPU", "GPU")}


def node_count(resources: dict) -> int:
    """How many nodes `ray.cluster_resources()` describes (each node has a `node:<ip>`
    resource; the head also has `node:__internal_head__`)."""
    return max(sum(1 for k in resources if k.startswith("node:")
                   and k != "node:__internal_head__"), 1)


def free_share(total: dict, free: dict) -> dict:
    """`total` (`ray.cluster_resources()`) with its CPUs cut to the free ones
    (`ray.available_resources()`): what a process joining a busy cluster plans on first. GPUs
    stay whole: a GPU job's engine must not be planned onto CPUs because another job holds
    the GPUs for now (it waits for them, and says so)."""
    share = dict(total)
    if "CPU" in total:
        share["CPU"] = min(float(total["CPU"]), float(free.get("CPU", 0)))
    return share


def plan_actors(settings: Settings, resources: dict, pool_size: int, *,
                engines: int = 0, retrievers: int = 1) -> ActorPlan:
    """Fit `engines` LLM engine actors, `retrievers` retriever actors and a pool of up to
    `pool_size` branch actors (at least `settings.branches`, one question's worth) into
    `resources` (`ray.cluster_resources()`), at most BRANCH_ACTORS_PER_CPU a CPU for a policy
    that is CPU work. GPUs are used only when the cluster has them.
    The retrievers share at most a quarter of the CPUs (1 each on a large cluster). On several
    nodes the retrievers and the branch actors are spread over them (`SPREAD`)."""
    cpus, gpus = float(resources.get("CPU", 0)), float(resources.get("GPU", 0))
    need = max(min(settings.branches, pool_size), 1)
    engine_opts: list[dict] = []
    tp = max(settings.llm_tensor_parallel, 1)
    if engines and gpus >= tp:
        if engines * tp > gpus:
            raise BranchsearchError(
                f"not enough GPUs: {engines} LLM engine(s) x llm_tensor_parallel {tp} need "
                f"{engines * tp} GPUs, the cluster has {gpus:g} (lower llm_engines)")
        engine_opts = [{"num_gpus": tp, "num_cpus": _down(min(1.0, cpus / 8))}] * engines
    elif engines:
        engine_opts = [{"num_cpus": _down(min(1.0, cpus / 4, cpus / (2 * engines)))}] * engines
    retrievers = max(retrievers, 1)
    retriever = {"num_cpus": _down(min(1.0, cpus / (4 * retrievers)))}
    left = cpus - retrievers * retriever["num_cpus"] - sum(e["num_cpus"] for e in engine_opts)
    fits = math.floor(round(left / MIN_BRANCH_CPUS, 6)) if left > 0 else 0
    if fits < need:
        raise BranchsearchError(
            f"not enough CPUs: the cluster has {cpus:g}; {engines} LLM engine actor(s) and "
            f"{retrievers} retriever actor(s) take {cpus - max(left, 0):g}, leaving "
            f"{max(left, 0):g} for {need} branch "
            f"actor(s) of at least {MIN_BRANCH_CPUS:g} CPU (add CPUs, or lower branches or "
            "llm_engines)")
    pool = min(pool_size, fits)
    if settings.policy != "llm":
        pool = min(pool, max(need, math.ceil(round(BRANCH_ACTORS_PER_CPU * cpus, 6))))
    branch = {"num_cpus": _down(min(settings.branch_num_cpus, left / pool))}
    gpus_left = gpus - sum(e.get("num_gpus", 0) for e in engine_opts)
    if gpus_left > 0 and settings.branch_num_gpus > 0:
        branch["num_gpus"] = _down(min(settings.branch_num_gpus, gpus_left / pool))
    if node_count(resources) > 1:  # one replica a node, and the pool over every node
        retriever["scheduling_strategy"] = branch["scheduling_strategy"] = "SPREAD"
    return ActorPlan(tuple(engine_opts), retriever, branch, pool,
                     pool_size if pool < pool_size else 0, retrievers)


def _down(x: float) -> float:
    """Rounded down to 1/1000: requests that sum to at most what is there."""
    return math.floor(x * 1000 + 1e-9) / 1000


@dataclass(frozen=True)
class ServicePlan:
    """The service's one branch pool (shared by every index) and each retriever actor's share."""

    retriever: dict
    branch: dict
    branch_actors: int
    retriever_room: int = 1  # indexes whose retrievers the plan left CPU for


def plan_service(settings: Settings, free: dict, indexes: int, pool_size: int) -> ServicePlan:
    """Fit a branch pool of up to `pool_size` actors into what is `free` now
    (`ray.available_resources()` once Serve's replicas, proxy and controller are placed),
    leaving room for the retriever actors of `indexes` indexes plus one made later; capped
    and spread over several nodes as `plan_actors` does. Raises one line when not even one
    question's branches fit."""
    cpus = float(free.get("CPU", 0))
    slots = (max(indexes, 0) + 1) * max(settings.retriever_replicas, 1)
    retriever = {"num_cpus": _down(min(1.0, cpus / (4 * slots)))}
    left = cpus - slots * retriever["num_cpus"]
    fits = math.floor(round(left / MIN_BRANCH_CPUS, 6)) if left > 0 else 0
    need = max(settings.branches, 1)
    if fits < need:
        raise BranchsearchError(
            f"not enough CPUs for the service: {cpus:g} free; {slots} retriever actor(s) take "
            f"{slots * retriever['num_cpus']:g}, leaving {max(left, 0):g} for {need} branch "
            f"actor(s) of at least {MIN_BRANCH_CPUS:g} CPU (add CPUs, or lower branches)")
    pool = max(min(pool_size, fits), need)
    if settings.policy != "llm":  # as for a driver: more only queue for the CPUs
        pool = min(pool, max(need, math.ceil(round(BRANCH_ACTORS_PER_CPU * cpus, 6))))
    branch = {"num_cpus": _down(min(settings.branch_num_cpus, left / pool))}
    if node_count(free) > 1:  # one replica a node, and the pool over every node
        retriever["scheduling_strategy"] = branch["scheduling_strategy"] = "SPREAD"
    return ServicePlan(retriever, branch, pool, max(indexes, 0) + 1)
