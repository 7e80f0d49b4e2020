"""The token budget of a branch's working context and the rules it implies."""

from __future__ import annotations

from dataclasses import dataclass

ALWAYS_ALLOWED = ("prune_chunks", "recall_chunks", "finish", "fork")  # add no tokens


@dataclass(frozen=True)
class Budget:
    tokens: int = 8192
    soft_limit: float = 0.5
    hard_limit: float = 0.92

    @property
    def soft_tokens(self) -> int:
        return int(self.tokens * self.soft_limit)

    @property
    def hard_tokens(self) -> int:
        return int(self.tokens * self.hard_limit)

    def usage_line(self, used: int) -> str:
        return f"[Token usage: {used:,}/{self.tokens:,}]"

    def state(self, used: int) -> str:
        """ok | soft | hard."""
        if used >= self.hard_tokens:
            return "hard"
        return "soft" if used >= self.soft_tokens else "ok"

    def reminder(self, used: int) -> str:
        state = self.state(used)
        if state == "hard":
            return ("Context is past the hard limit: only prune_chunks, recall_chunks (if it "
                    "fits) and finish are accepted.")
        if state == "soft":
            return "Context is past the soft limit: prune chunks you no longer need, or finish."
        return ""

    def allows(self, tool: str, used: int) -> bool:
        return tool in ALWAYS_ALLOWED or self.state(used) != "hard"

    def room(self, used: int) -> int:
        """Tokens that can still be shown: search snippets are cut to this, a recall must fit
        in it. The hard limit is crossed by results that fit here; past it, only prune, recall
        and finish are accepted."""
        return max(self.tokens - used, 0)
