"""Building a policy from settings (the one place that knows every policy by name)."""

from __future__ import annotations

from infra.errors import SettingsError
from infra.settings import Settings


def make_policy(settings: Settings, name: str | None = None):
    name = name or settings.policy
    if name == "heuristic":
        from workers.heuristic import HeuristicPolicy

        return HeuristicPolicy(final_k=settings.final_k, prune=settings.prune)
    if name == "llm":
        raise SettingsError("policy 'llm' is not available yet (see the LLM policy issue)")
    raise SettingsError(f"unknown policy {name!r}")
