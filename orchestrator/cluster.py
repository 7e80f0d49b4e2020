"""Connecting to Ray and sizing actors from what the cluster really has.

An actor that asks for a resource the cluster lacks (e.g. `num_gpus=1` on a CPU machine) pends
forever, so every request is derived from `ray.cluster_resources()`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from branchsearch.infra.errors import BackendUnavailable
from branchsearch.infra.settings import Settings


def connect(settings: Settings) -> dict:
    """`ray.init` once: the cluster at `ray_address` / RAY_ADDRESS, else a local one."""
    import ray

    if not ray.is_initialized():
        address = settings.ray_address or os.environ.get("RAY_ADDRESS") or None
        kwargs = {"ignore_reinit_error": True, "include_dashboard": False,
                  "log_to_driver": False, "configure_logging": False}
        if address is None:
            kwargs |= {"num_cpus": max(os.cpu_count() or 1, 2),
                       "object_store_memory": 256 * 1024 * 1024}
        try:
            ray.init(address=address, **kwargs)
        except (ConnectionError, RuntimeError) as exc:
            raise BackendUnavailable(f"ray: cannot connect to {address} ({exc})") from None
    return ray.cluster_resources()


@dataclass(frozen=True)
class ActorPlan:
    retriever: dict
    branch: dict
    pool_size: int


def plan_actors(settings: Settings, resources: dict, pool_size: int) -> ActorPlan:
    """Fractional CPUs that fit the cluster; GPUs only when it has them and settings ask."""
    cpus = float(resources.get("CPU", 1))
    retriever_cpus = min(1.0, cpus / 4)
    per_branch = min(settings.branch_num_cpus, max(cpus - retriever_cpus, 0.1) / pool_size)
    branch = {"num_cpus": round(per_branch, 3)}
    if resources.get("GPU", 0) >= 1 and settings.branch_num_gpus > 0:
        branch["num_gpus"] = min(settings.branch_num_gpus, resources["GPU"] / pool_size)
    return ActorPlan({"num_cpus": round(retriever_cpus, 3)}, branch, pool_size)
