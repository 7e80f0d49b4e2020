"""The heuristic policy's per-episode state: the query state, where each chunk came from, the
scores, what was expanded, pruned and recalled, and the caches derived from them.

A new policy starts a new episode; nothing here is a tuning knob (those are `config.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from branchsearch.workers.heuristic.titles import strip_article, title_words, words
from branchsearch.workers.policy import VisibleChunk
from branchsearch.workers.text import folded, has_phrase, norm_title


@dataclass
class Origin:
    """Where a chunk came from: the search (query, the chunk's rank in it, its kind) and, for a
    hop, the entity searched and the chunk that led to it."""

    query: str
    rank: int
    kind: str  # question | entity | bridge | residual
    entity: str = ""
    parent: str = ""


@dataclass
class EpisodeState:
    subquery: str = ""
    q_terms: set[str] = field(default_factory=set)
    q_entities: list[str] = field(default_factory=list)
    origins: dict[str, Origin] = field(default_factory=dict)
    chunks: dict[str, VisibleChunk] = field(default_factory=dict)  # everything ever seen
    scores: dict[str, float] = field(default_factory=dict)
    depth: dict[str, int] = field(default_factory=dict)
    expanded: set[str] = field(default_factory=set)
    read: set[str] = field(default_factory=set)
    searched: set[str] = field(default_factory=set)
    bridges: dict[str, str] = field(default_factory=dict)  # entity -> parent chunk
    links: dict[str, tuple[str, float]] = field(default_factory=dict)  # entity -> (parent, sal)
    pruned: set[str] = field(default_factory=set)
    recalled: set[str] = field(default_factory=set)  # recalled once: never again, never re-pruned
    final_features: dict[str, list[float]] = field(default_factory=dict)  # at finish
    pending: dict[tuple, Origin] = field(default_factory=dict)  # (query, parent) -> its origin
    tail_ids: set[str] = field(default_factory=set)  # found by the question tail (none kept)
    tail: Origin | None = None  # the question tail's search, once it is asked
    fork_candidates: dict[str, dict] = field(default_factory=dict)  # forks.note: chunk -> why
    seeds: tuple[str, ...] = ()  # a fork's handed-over chunks, read on its first turn
    # caches
    mentions: dict[str, tuple] = field(default_factory=dict)  # (text size, links checked, found)
    mention_count: dict[str, int] = field(default_factory=dict)
    title_set: tuple = (-1, frozenset())
    link_index: tuple | None = None  # (links, its size, word -> link positions, link order)

    def by_arrival(self) -> list[str]:
        # parents are always recorded before their children
        return [cid for cid in self.origins if cid in self.chunks]

    def ranked(self, ids: set[str]) -> list[str]:
        return sorted((cid for cid in ids if cid in self.scores),
                      key=lambda c: (-self.scores[c], c))

    def title_key(self, cid: str) -> str:
        chunk = self.chunks.get(cid)
        return norm_title(chunk.title) if chunk is not None else ""

    def titles(self) -> frozenset[str]:
        """The normalised titles of every chunk seen (article stripped), cached by count."""
        if self.title_set[0] != len(self.chunks):
            self.title_set = (len(self.chunks), frozenset(
                strip_article(norm_title(c.title)) for c in self.chunks.values()))
        return self.title_set[1]

    def links_sharing_a_word(self, title: str) -> list[str]:
        """The linked entities that share a word with `title`, in link order: the only ones
        `titles.names` or `titles.word_overlap` can credit (a rescoring otherwise tries every
        chunk against every link, most of a branch's CPU time). The index follows `links`,
        which only grows."""
        seen = self.link_index
        if seen is None or seen[0] is not self.links or seen[1] != len(self.links):
            by_word: dict[str, list[int]] = {}
            for pos, entity in enumerate(self.links):
                for word in set(entity.split()):
                    by_word.setdefault(word, []).append(pos)
            seen = self.link_index = (self.links, len(self.links), by_word, list(self.links))
        _, _, by_word, order = seen
        return [order[p] for p in sorted({p for w in title_words(title)
                                          for p in by_word.get(w, ())})]

    def mentioned_links(self, cid: str) -> set[str]:
        """The linked entities the chunk mentions as whole words. Links only grow, so each
        chunk is checked against each link once (again only when a read made its text whole)."""
        chunk = self.chunks[cid]
        size, checked, found = self.mentions.get(cid, (len(chunk.text), 0, set()))
        if size != len(chunk.text):
            checked, found = 0, set()
        if checked < len(self.links):
            text = folded(f"{chunk.title} {chunk.text}")
            text_words = words(text)
            for entity in list(self.links)[checked:]:
                if words(entity) <= text_words and has_phrase(text, entity):
                    found.add(entity)
            self.mentions[cid] = (len(chunk.text), len(self.links), found)
        return found

    def mentions_link_of(self, parent: str, cid: str) -> bool:
        """Whether the chunk names, as whole words, an entity that `parent` links to."""
        return any(self.links[entity][0] == parent for entity in self.mentioned_links(cid))

    def count_mentions(self) -> None:
        """How many chunks seen mention each linked entity *in passing*: not its source, not a
        hit of its own search. 'Florida' turns up all over an episode; 'Raoul Walsh' only in
        the page that links to him and in what his search finds."""
        count: dict[str, int] = {}
        for cid in self.chunks:
            origin = self.origins.get(cid)
            own = folded(origin.entity) if origin and origin.kind == "bridge" else ""
            for entity in self.mentioned_links(cid):
                if entity != own and self.links[entity][0] != cid:
                    count[entity] = count.get(entity, 0) + 1
        self.mention_count = count
