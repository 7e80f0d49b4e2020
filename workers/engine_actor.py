"""A vLLM engine as a named Ray actor, shared by every branch actor on the cluster.

One engine per GPU group (tensor parallel by setting) loads the model once; branch actors find
it by name (`branchsearch-llm-{i}` in the `branchsearch` namespace — named actors are visible
cluster-wide, so this works across nodes) and call `chat`. The actor runs calls on a thread pool
and `VLLMEngine` gathers concurrent calls into one batch, so concurrent branches batch together.
"""

from __future__ import annotations

import ray

NAMESPACE = "branchsearch"


def engine_name(index: int) -> str:
    return f"branchsearch-llm-{index}"


class EngineService:
    def __init__(self, model: str, max_model_len: int, tensor_parallel_size: int,
                 batch_window_s: float = 0.02):
        from branchsearch.infra.models.llm import VLLMEngine

        self.engine = VLLMEngine(model, max_model_len=max_model_len,
                                 tensor_parallel_size=tensor_parallel_size,
                                 batch_window_s=batch_window_s)
        self.engine._load()

    def chat(self, messages, schema=None, max_tokens=512, temperature=0.0) -> str:
        return self.engine.chat(messages, schema=schema, max_tokens=max_tokens,
                                temperature=temperature)

    def stats(self) -> dict:
        return dict(self.engine.stats.__dict__)


EngineActor = ray.remote(EngineService)


class RemoteEngine:
    """Looks like a ChatEngine; forwards to a named engine actor."""

    def __init__(self, name: str):
        self.name = name
        self.handle = ray.get_actor(name, namespace=NAMESPACE)

    def chat(self, messages, *, schema=None, max_tokens=512, temperature=0.0) -> str:
        """A dead or unreachable engine actor is a backend failure (the branch ends `error`);
        an exception inside the engine comes back as itself (Ray re-raises the cause's type)."""
        from branchsearch.infra.errors import BackendUnavailable

        try:
            return ray.get(self.handle.chat.remote(messages, schema, max_tokens, temperature))
        except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as exc:
            raise BackendUnavailable(f"llm engine actor {self.name} is gone: "
                                     f"{type(exc).__name__}: {str(exc)[:300]}") from None


def start_engines(settings, resources: dict, plan: list[dict] | None = None) -> list:
    """Create (or reuse) `llm_engines` named engine actors sized to the cluster, or with the
    resources of `plan` (one options dict per engine, from `orchestrator.execution.actor_plan`)."""
    from branchsearch.infra.models.weights import resolve_llm_model

    model = resolve_llm_model(settings)
    handles = []
    for i in range(max(settings.llm_engines, 1)):
        opts: dict = {"name": engine_name(i), "namespace": NAMESPACE, "get_if_exists": True,
                      "lifetime": "detached" if settings.llm_detached else None,
                      "max_concurrency": 32}
        gpus = resources.get("GPU", 0)
        if plan:
            opts |= plan[i % len(plan)]
        elif gpus >= settings.llm_tensor_parallel:
            opts["num_gpus"] = settings.llm_tensor_parallel
        else:
            opts["num_cpus"] = min(1.0, resources.get("CPU", 1) / 4)
        handles.append(EngineActor.options(**{k: v for k, v in opts.items() if v is not None})
                       .remote(model, settings.llm_max_model_len, settings.llm_tensor_parallel))
    return handles
