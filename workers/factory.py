"""Building a policy from settings (the one place that knows every policy by name)."""

from __future__ import annotations

from branchsearch.infra.errors import SettingsError
from branchsearch.infra.config.settings import Settings


def make_policy(settings: Settings, name: str | None = None, engine=None,
                kind: str = "original", max_hops: int = 0):
    """`kind`: the branch's (`orchestrator.plan`); only the question's own branch ("original")
    searches the question tail: fused, an entity branch's tail changed no ranking and cost 4–8 %
    of a 3-branch question's tokens (reports/recall/README.md). The planner's other
    branches (comparison, clause, entity) follow one hop from what their own searches find
    (`max_hops` 2, the question's branch 3): each sub-query is narrower than the question,
    around a name or one clause, so it starts a hop nearer its evidence; the third hop changed
    no fused ranking and cost 5–8 % of a 3-branch question's tokens. (Not 1: an
    entity branch then only repeats the question branch's search for that name.)
    `max_hops` > 0 sets the heuristic branch's hops whatever its kind (a bridge of a bridge: 1,
    `orchestrator.chains.DEEPER_HOPS`)."""
    name = name or settings.policy
    if name == "heuristic":
        from branchsearch.workers.heuristic import HeuristicConfig, HeuristicPolicy
        from branchsearch.workers.heuristic.ranker import weights_for

        mode, hops = index_modes(settings)
        return HeuristicPolicy(HeuristicConfig(
            final_k=settings.final_k, prune=settings.prune, max_turns=settings.max_turns,
            learned_rank=settings.learned_rank, per_title=settings.per_title,
            ranker_path=str(weights_for(mode)), hop_mode=hops,
            tail_page=kind == "original",
            max_hops=max_hops or (3 if kind == "original" else OTHER_MAX_HOPS),
            fork_gap=settings.fork_gap if settings.forks else 0.0))
    if name == "llm":
        from branchsearch.workers.llm_policy import LLMPolicy

        # chunk text shown to the model: what is left of its window, at ~3 characters a token
        room = settings.llm_max_model_len - settings.llm_max_tokens - 900
        return LLMPolicy(engine or make_engine(settings), max_tokens=settings.llm_max_tokens,
                         max_context_chars=max(room, 500) * 3)
    raise SettingsError(f"unknown policy {name!r}")


OTHER_MAX_HOPS = 2  # the hops of a branch other than the question's own


_MODES: dict[tuple, tuple[str, str]] = {}  # index_modes, by what they were read from


def index_modes(settings: Settings) -> tuple[str, str]:
    """(`searched_mode`, `hop_mode`) for a policy on `settings`' index. On an owned tantivy
    index both read its files (the manifest, tantivy's meta.json): kept while those are
    unchanged (same inode, size and mtime), so a branch does not parse them again, and a
    re-ingest or a service's upsert is seen by the next branch.
    Elsewhere (Elasticsearch, external indexes) they are asked every time, as before."""
    from branchsearch.infra.index.manifest import file_signature as signature, manifest_path
    from branchsearch.infra.retrieval.retriever import searched_mode

    if settings.external is not None or settings.es_url:
        mode = searched_mode(settings)
        return mode, hop_mode(settings, mode)
    key = (settings.index_dir, settings.search_mode, signature(manifest_path(settings.index_dir)),
           signature(settings.index_dir / "tantivy" / "meta.json"))
    modes = _MODES.get(key)
    if modes is None:
        mode = searched_mode(settings)
        modes = _MODES[key] = (mode, hop_mode(settings, mode))
        if len(_MODES) > 256:  # indexes re-ingested many times in one process
            _MODES.pop(next(iter(_MODES)), None)
    return modes


def hop_mode(settings: Settings, mode: str) -> str:
    """The heuristic's `hop_mode` when its searches run in `mode` (`searched_mode`): on a hybrid
    index the hop searches (entities, bridge entities, residual words) are BM25 and the question
    searches hybrid, unless the index's BM25 does not fold accents (tantivy made before
    folding): there the dense side is what matched a name written without its accents."""
    from branchsearch.infra.index.open import lexical_folds

    return "bm25" if mode == "hybrid" and lexical_folds(settings) else ""


def make_engine(settings: Settings, *, actors: bool = False, index: int = 0):
    """The chat engine a policy or planner talks to: an endpoint by URL; else, with `actors`
    (the Ray executor started named engine actors), engine `index`; else vLLM in this process.
    Only the caller knows where it runs, so it says so: nothing here asks Ray."""
    if settings.llm_url:
        from branchsearch.infra.models.llm import OpenAIEngine

        return OpenAIEngine(settings.llm_url, settings.llm_model, settings.llm_api_key,
                            timeout_s=settings.llm_timeout_s, seed=settings.llm_seed)
    if actors:
        from branchsearch.workers.engine_actor import RemoteEngine, engine_name

        return RemoteEngine(engine_name(index % max(settings.llm_engines, 1)))
    return local_engine(settings)


_LOCAL: dict = {}


def local_engine(settings: Settings):
    """One in-process vLLM engine per model, shared by every policy in this process."""
    from branchsearch.infra.models.llm import VLLMEngine
    from branchsearch.infra.models.weights import resolve_llm_model

    model = resolve_llm_model(settings)
    if model not in _LOCAL:
        _LOCAL[model] = VLLMEngine(model, max_model_len=settings.llm_max_model_len,
                                   tensor_parallel_size=settings.llm_tensor_parallel)
    return _LOCAL[model]
