"""What the tools work on: the four stores of one episode, its budget and token counter.

Tools (`workers.tools`) are functions over a `Workspace`; the loop (`workers.harness`) never
touches the stores itself. Retrieved text is data: `render` delimits and escapes it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from html import escape

from branchsearch.infra.stores.hits import Hit, label
from branchsearch.infra.config.settings import Settings
from branchsearch.infra.models.tokenizer import TokenCounter
from branchsearch.workers.budget import Budget
from branchsearch.workers.context import (ActiveContext, EpisodeTrace, Provenance,
                                          ProvenanceRecord, RetrievalCache)
from branchsearch.workers.policy import VisibleChunk


@dataclass
class Workspace:
    settings: Settings
    counter: TokenCounter
    budget: Budget
    acl_groups: list[str] | None = None  # from the caller's identity, never from tool arguments
    query_state: Callable[[], dict] = dict  # the policy's, recorded with every prune
    on_event: Callable[[dict], None] | None = None  # search/prune events as they happen
    context: ActiveContext = field(default_factory=ActiveContext)
    cache: RetrievalCache = field(default_factory=RetrievalCache)
    provenance: Provenance = field(default_factory=Provenance)
    trace: EpisodeTrace = field(default_factory=EpisodeTrace)
    turn: int = 0
    tokens_read: int = 0  # full text of every chunk fetched
    pruned: list[str] = field(default_factory=list)
    finish_ids: list[str] | None = None  # set by `finish`
    progress: bool = False  # something new arrived (or was pruned/recalled) this turn
    fork_cap: int = 0  # fork candidates the `fork` tool may record (0: not offered)
    is_fork: bool = False  # this branch is a fork: it may not fork (depth 1)
    forks: list[dict] = field(default_factory=list)  # the candidates `fork` recorded

    @property
    def can_fork(self) -> bool:
        """The `fork` tool is offered: forks are on for this branch and its cap not reached."""
        return not self.is_fork and len(self.forks) < self.fork_cap

    @property
    def used(self) -> int:
        return self.context.tokens

    @property
    def _counts_agree(self) -> bool:
        """A hit's `text_tokens` (the retriever's, in `settings.encoding`) count for this
        counter."""
        return self.counter.encoding_name == self.settings.encoding

    def known(self, ids: list[str]) -> tuple[str, ...]:
        """The ids among `ids` that this episode has seen (provenance parents)."""
        return tuple(cid for cid in ids if cid in self.cache)

    def show(self, hits: list[Hit], *, tool: str, query: str, parents: tuple[str, ...] = (),
             cap: int | None = None, allow_cached: bool = False) -> list[str]:
        """Cache, record provenance and show new hits, each cut to the cap and the room left.
        With `allow_cached` (reading), cached chunks come back and visible snippets are
        replaced by the longer text."""
        added: list[str] = []
        cap = cap or self.settings.result_token_cap
        for hit in hits:
            if hit.chunk_id in self.cache and not allow_cached:
                continue
            before = self.context.get(hit.chunk_id)
            if before is not None and (before.text == hit.text
                                       or self.counter.count(before.text) >= cap):
                continue
            room = self.budget.room(self.used - (before.tokens if before else 0))
            if room < 16:
                break  # over budget: unseen hits stay findable by later searches
            shown, shown_tokens, full_tokens = self.counter.cut(
                hit.text, min(cap, room - 8), *((hit.text_tokens, hit.head)
                                                if self._counts_agree else ()))
            if self.cache.add(copy.copy(hit)):
                self.tokens_read += full_tokens
            self.provenance.add(ProvenanceRecord(hit.chunk_id, self.turn, tool, query, hit.rank,
                                                 round(hit.score, 6), parents))
            self.context.add(self.visible_chunk(hit, shown, shown_tokens))
            added.append(hit.chunk_id)
        self.progress |= bool(added)
        return added

    def visible_chunk(self, hit: Hit, shown: str, shown_tokens: int) -> VisibleChunk:
        header = hit.label_tokens if self._counts_agree else None
        if header is None:
            header = self.counter.count(label(hit.chunk_id, hit.title))
        tokens = shown_tokens + header
        return VisibleChunk(hit.chunk_id, hit.doc_id, hit.title, shown, tokens)

    def render(self, ids: list[str]) -> str:
        """Retrieved text is data: delimited, escaped, never interpreted."""
        shown = [c for c in map(self.context.get, ids) if c is not None]
        return "\n".join(f'<chunk id="{escape(c.id)}" title="{escape(c.title)}">'
                         f"{escape(c.text, quote=False)}</chunk>" for c in shown)

    def emit(self, event: dict) -> None:
        """An event for whoever watches (the driver's `on_event`); a watcher that fails never
        breaks the episode."""
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:  # noqa: BLE001 — hooks must not throw into the traced work
                pass
