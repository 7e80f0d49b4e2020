"""HeuristicPolicy: deterministic multi-hop search with no model.

Query state: the sub-query's content terms, the entities named in it, and the bridge entities
found in retained chunks (each with the chunk it came from and a salience). Each turn it

1. scores every visible chunk against the query state: how it arrived (sub-query search rank,
   or a bridge search whose entity names the chunk's document, inheriting its parent's score;
   or, for an entity with no page, a bridge search's hit that mentions it),
   how many sub-query terms it covers, and which of them no better chunk already covers;
2. expands the best unexpanded chunks: searches for their most salient bridge entities
   (entities in sentences that share terms with the sub-query), with provenance to the parent;
3. prunes what is spent or redundant (beyond the `keep` best, or below a score floor) and
   recalls a pruned chunk when a new bridge entity names its document;
4. finishes when nothing is left to expand or the hop limit is reached, ranking by score.
"""

from __future__ import annotations

import re
from functools import lru_cache
from dataclasses import dataclass, field

from branchsearch.workers.policy import AgentView, ToolCall, VisibleChunk
from branchsearch.workers.tools import MAX_SEARCH_K, QUERY_MAX_CHARS
from branchsearch.workers.rank import crowd, doc_of, final_ranking, hold_back
from branchsearch.workers.text import (bare_title, entities, fold, folded, has_phrase,
                                       norm_title, sentences, terms)


@dataclass
class _Origin:
    query: str
    rank: int
    kind: str  # question | entity | bridge | residual
    entity: str = ""
    parent: str = ""


@dataclass
class HeuristicPolicy:
    max_hops: int = 3
    keep: int = 8
    expand_per_turn: int = 3
    entities_per_chunk: int = 4
    search_k: int = 6
    entity_k: int = 3
    residual_k: int = 3  # hits of one residual search per expanded chunk (0: none)
    residual_entities: int = 8  # the chunk's entities that join the residual words
    expand_floor: float = 0.5
    rank_decay: float = 0.6  # sub-query search: support 1 / (1 + decay * (rank - 1))
    link_weight: float = 0.85  # a bridge child inherits this share of its parent's score
    coverage_weight: float = 0.2
    residual_weight: float = 0.7
    final_k: int = 10
    prune: bool = True
    rank_all: bool = True  # finish ranks every scored chunk, not only the visible ones
    max_turns: int = 12  # the harness's limit: finish (ranked) on the last turn it allows
    qualifier_weight: float = 0.3  # a title's qualifier agreeing (or not) with what led to it
    mention_weight: float = 0.6  # a bridge hit mentioning an entity that has no page here
    common_titles_named: bool = False  # True: a sentence-case title is named by its words alone
    learned_rank: bool = True  # finish by the learned ranker (workers/ranker.py), else by score
    ranker_path: str | None = None  # weights file; None: the shipped BM25 one (make_policy
    # passes the search mode's: workers.ranker.weights_for)
    tail_page: bool = True  # before finishing, the question's search down to final_k documents
    per_title: int = 2  # documents of one title (qualifier dropped) before the other pages get
    # the next places: workers.rank.crowd; 0: off. The smallest value that costs nothing on the
    # fit sets (1 splits hotpot's and synth's look-alike titles; reports/recall/README.md,
    # session 11)
    hop_mode: str = ""  # the search mode of the searches the policy builds (entities, bridge
    # entities, residual words); "": the tool's default. make_policy passes "bm25" on a hybrid
    # index: a name or a bag of leftover words is matched by its words (their embedding is a
    # weak signal); the question's own searches stay hybrid (reports/recall/README.md, session 9)
    named_pages: bool = True  # the search for a name the sub-query holds puts the page titled
    # with it first (the search tool's `named`): a name's page often ranks below longer pages
    # that mention it. Not for bridge entities: their pages are mostly hubs (a state, a
    # country) that then crowd the top (reports/recall/README.md, session 12)
    # episode state
    subquery: str = ""
    q_terms: set[str] = field(default_factory=set)
    q_entities: list[str] = field(default_factory=list)
    origins: dict[str, _Origin] = field(default_factory=dict)
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
    _pending: dict[tuple, _Origin] = field(default_factory=dict)
    _mentions: dict[str, tuple] = field(default_factory=dict)  # (text size, links checked, found)
    _mention_count: dict[str, int] = field(default_factory=dict)
    _title_set: tuple = (-1, frozenset())
    _link_index: tuple | None = None  # (links, its size, word -> link positions, link order)
    tail_ids: set[str] = field(default_factory=set)  # found by the question tail (none kept)
    _tail: _Origin | None = None

    # --- Policy protocol -----------------------------------------------------------------------

    def decide(self, view: AgentView) -> list[ToolCall]:
        if view.turn == 1:
            return self._first_turn(view)
        self._absorb(view)
        self._rescore(view)
        visible = {c.id for c in view.visible}
        if view.turn >= self.max_turns:  # the last turn: return a ranking, not arrival order
            return [self._finish(visible)]
        if "search_corpus" not in view.allowed_tools:  # past the hard limit
            return self._prune_calls(view, visible, force=True) or [self._finish(visible)]
        searches, recalls = [], []
        if self._tail is None:  # (once the question's tail is searched: rank and finish)
            searches = self._question_page() if view.turn == 2 else []
            searches += self._expansions(visible)
            recalls = self._recalls()
            if not searches and not recalls and self.tail_page:
                searches = self._question_tail()
        if not searches and not recalls:  # nothing left to expand or read: keep what we
            prune = self._prune_calls(view, visible) if self.prune else []  # return, finish
            return prune + [self._finish(visible)]
        calls = self._prune_calls(view, visible) if self.prune else []
        if recalls:
            calls.append(ToolCall("recall_chunks", {"ids": recalls}))
        return calls + searches

    def rank(self, view: AgentView) -> list[str]:
        """The ranking `finish` would return now (the harness asks when a limit stops the
        episode before this policy finished): the last turn's results absorbed first."""
        self._absorb(view)
        self._rescore(view)
        return self._finish({c.id for c in view.visible}).args["ids"]

    def query_state(self) -> dict:
        top = sorted(self.scores, key=self.scores.get, reverse=True)[:5]
        return {"subquery": self.subquery, "terms": sorted(self.q_terms),
                "entities": self.q_entities, "bridges": dict(list(self.bridges.items())[-8:]),
                "top": {cid: round(self.scores[cid], 3) for cid in top}}

    # --- turns -----------------------------------------------------------------------------------

    def _first_turn(self, view: AgentView) -> list[ToolCall]:
        self.subquery = view.subquery
        self.q_terms = terms(view.subquery)
        self.q_entities = entities(view.subquery)[:4]
        self.links = {folded(e): ("", 1.0) for e in self.q_entities}
        calls = [self._search(view.subquery, self.search_k, _Origin(view.subquery, 0, "question"))]
        for e in self.q_entities:
            if folded(e) != folded(view.subquery):  # an entity branch's sub-query is searched
                calls.append(self._search(e, self.entity_k, _Origin(e, 0, "entity", entity=e)))
        return calls

    def _question_page(self) -> list[ToolCall]:
        """The sub-query's own search once more, when its hits came from fewer than `search_k`
        documents (long documents split into chunks): a document is the unit of evidence, so
        the search should bring `search_k` of them. Its hits rank after the first page's."""
        return self._more_of_the_question(self.search_k)[1]

    def _question_tail(self) -> list[ToolCall]:
        """The sub-query's own search down to `final_k` documents, once, when nothing is left
        to expand: the ranking returns `final_k` documents, and where the hops found nothing
        better the question's own next hits are what single-shot retrieval would return."""
        self._tail, calls = self._more_of_the_question(self.final_k)
        return calls

    def _more_of_the_question(self, documents: int) -> tuple[_Origin, list[ToolCall]]:
        """(the origin of its hits, the search) that brings the sub-query's own hits up to
        `documents` documents; the search excludes what was seen, its hits rank after the
        question's hits so far. No search when there are enough, or the index had no more."""
        hits = [cid for cid, o in self.origins.items() if o.kind == "question"]
        missing = documents - len({doc_of(cid) for cid in hits})
        origin = _Origin(self.subquery, len(hits), "question")
        if missing <= 0 or len(hits) < self.search_k:
            return origin, []
        return origin, [self._search(self.subquery, min(2 * missing, MAX_SEARCH_K), origin)]

    def _search(self, query: str, k: int, origin: _Origin, parent: str = "") -> ToolCall:
        self.searched.add(folded(query))
        args = {"query": query, "k": k}
        if self.hop_mode and origin.kind != "question":
            args["mode"] = self.hop_mode
        if self.named_pages and origin.kind == "entity":
            args["named"] = True  # a name's own page first
        if parent:
            args["from_ids"] = [parent]
        self._pending[(query, parent)] = origin
        return ToolCall("search_corpus", args)

    def _absorb(self, view: AgentView) -> None:
        """Record where each new chunk came from (the policy's own view of provenance)."""
        by_id = {c.id: c for c in view.visible}
        for result in view.last_results:
            if not result.ok or result.call.name not in ("search_corpus", "recall_chunks",
                                                         "read_document"):
                continue
            if result.call.name == "recall_chunks":
                self.pruned -= set(result.ids)
                self.recalled |= set(result.ids)
                continue
            if result.call.name == "read_document":
                for cid in result.ids:
                    if cid in by_id and cid in self.origins:
                        self.chunks[cid] = by_id[cid]
                continue
            parent = (result.call.args.get("from_ids") or [""])[0]
            origin = self._pending.get((result.call.args["query"], parent))
            for rank, cid in enumerate(result.ids, start=origin.rank + 1 if origin else 1):
                if cid in by_id:
                    self.chunks[cid] = by_id[cid]
                if origin is not None and cid not in self.origins:
                    if origin is self._tail:
                        self.tail_ids.add(cid)
                    self.origins[cid] = _Origin(origin.query, rank, origin.kind, origin.entity,
                                                origin.parent)
                    self.depth[cid] = self.depth.get(origin.parent, 0) + (1 if parent else 0)

    def _rescore(self, view: AgentView) -> None:
        if self.mention_weight:
            self._count_mentions()
        for cid in self._by_arrival():
            self.scores[cid] = self._score(cid)

    def _by_arrival(self) -> list[str]:
        # parents are always recorded before their children
        return [cid for cid in self.origins if cid in self.chunks]

    def _score(self, cid: str) -> float:
        """Best support for a chunk under the current query state, plus term coverage.

        Support is the strongest of: its rank in the sub-query search; the sub-query naming its
        document's title; a bridge entity of a parent chunk naming its title (inheriting the
        parent's score, scaled by the entity's salience), fully or in part. Coverage counts
        sub-query terms in the chunk, and separately the *residual* terms its parent left
        uncovered — the part of the question the next hop must answer.
        """
        chunk, origin = self.chunks[cid], self.origins[cid]
        words = terms(f"{chunk.title} {chunk.text}")
        coverage = len(self.q_terms & words) / max(len(self.q_terms), 1)
        support, parent = 0.15 / origin.rank, origin.parent
        if origin.kind == "question":
            support, parent = 1.0 / (1.0 + self.rank_decay * (origin.rank - 1)), ""
        title_terms = terms(norm_title(chunk.title))
        if title_terms and title_terms <= self.q_terms and (
                _named_in(chunk.title, self.subquery) if len(title_terms) == 1
                else self.common_titles_named or _names_page(chunk.title, self.subquery)):
            # the sub-query names the page: a longer title's words written as a name, or a
            # one-word title as a name ("Casino, New South Wales" is not named by "hotel and
            # casino"; "Body water" is not named by "what body of water")
            support = max(support, 0.95 if len(title_terms) > 1 else 0.6)
            parent = ""
        for entity in self._links_sharing_a_word(chunk.title):
            source, salience = self.links[entity]
            if source == cid:
                continue
            quality = _names(chunk.title, entity)
            if quality:
                via = quality * (self.link_weight * salience * self.scores.get(source, 0.0)
                                 if source else 0.95 if " " in entity else 0.6)
            else:
                overlap = _word_overlap(chunk.title, entity)
                if overlap < 0.5 or not source:
                    continue
                via = 0.5 * overlap * salience * self.scores.get(source, 0.0)
            if via > support:
                support, parent = via, source
        if origin.kind == "bridge" and self.mention_weight:
            via = self._mention_support(cid, origin)
            if via > support:
                support, parent = via, origin.parent
        residual = 0.0
        if parent in self.chunks and (origin.kind != "residual" or parent != origin.parent
                                      or self._mentions_link_of(parent, cid)):
            # a residual search's hit covers the parent's leftover terms by construction:
            # that counts only when it also mentions what the parent links to; and a leftover
            # of one or two words (a one-hop claim its first hit already covers) is weak
            # evidence of a next hop
            p = self.chunks[parent]
            left = self.q_terms - terms(f"{p.title} {p.text}")
            residual = len(left & words) / max(len(left), 1) * min(1.0, len(left) / 3)
        return (support + self.coverage_weight * coverage + self.residual_weight * residual
                + self.qualifier_weight * self._qualifier_agreement(cid))

    def _mention_support(self, cid: str, origin: _Origin) -> float:
        """A bridge search's hit that mentions the entity, when no page seen is titled by it:
        the entity has no page here ('Raoul Walsh' directed 'Jump for Glory'; the corpus has
        'Betrayed (1917 film)', directed by Raoul Walsh, not a Raoul Walsh page), so the pages
        that mention it are where the next hop is. Inherits from the parent like a titled page,
        scaled by `mention_weight`, the hit's rank, and how many other chunks mention the
        entity in passing. Only a page titled by a name (not a paper titled by its claim, where
        no entity has a page and an absent one says nothing) takes it."""
        entity = folded(origin.entity)
        source, salience = self.links.get(entity, (origin.parent, 0.5))
        if (not source or source == cid or _strip_article(entity) in self._titles()
                or entity not in self._mentioned_links(cid)
                or len(norm_title(self.chunks[cid].title).split()) > NAME_WORDS):
            return 0.0
        return (self.mention_weight * self.link_weight * salience * self.scores.get(source, 0.0)
                / origin.rank / (1 + self._mention_count.get(entity, 0)))

    def _count_mentions(self) -> None:
        """How many chunks seen mention each linked entity *in passing*: not its source, not a
        hit of its own search. 'Florida' turns up all over an episode; 'Raoul Walsh' only in
        the page that links to him and in what his search finds."""
        count: dict[str, int] = {}
        for cid in self.chunks:
            origin = self.origins.get(cid)
            own = folded(origin.entity) if origin and origin.kind == "bridge" else ""
            for entity in self._mentioned_links(cid):
                if entity != own and self.links[entity][0] != cid:
                    count[entity] = count.get(entity, 0) + 1
        self._mention_count = count

    def _mentioned_links(self, cid: str) -> set[str]:
        """The linked entities the chunk mentions as whole words. Links only grow, so each
        chunk is checked against each link once (again only when a read made its text whole)."""
        chunk = self.chunks[cid]
        size, checked, found = self._mentions.get(cid, (len(chunk.text), 0, set()))
        if size != len(chunk.text):
            checked, found = 0, set()
        if checked < len(self.links):
            text = folded(f"{chunk.title} {chunk.text}")
            words = _words(text)
            for entity in list(self.links)[checked:]:
                if _words(entity) <= words and has_phrase(text, entity):
                    found.add(entity)
            self._mentions[cid] = (len(chunk.text), len(self.links), found)
        return found

    def _titles(self) -> frozenset[str]:
        """The normalised titles of every chunk seen (article stripped), cached by count."""
        if self._title_set[0] != len(self.chunks):
            self._title_set = (len(self.chunks), frozenset(
                _strip_article(norm_title(c.title)) for c in self.chunks.values()))
        return self._title_set[1]

    def _links_sharing_a_word(self, title: str) -> list[str]:
        """The linked entities that share a word with `title`, in link order: the only ones
        `_names` or `_word_overlap` can credit (a rescoring otherwise tries every chunk against
        every link, most of a branch's CPU time). The index follows `links`, which only grows."""
        seen = self._link_index
        if seen is None or seen[0] is not self.links or seen[1] != len(self.links):
            by_word: dict[str, list[int]] = {}
            for pos, entity in enumerate(self.links):
                for word in set(entity.split()):
                    by_word.setdefault(word, []).append(pos)
            seen = self._link_index = (self.links, len(self.links), by_word, list(self.links))
        _, _, by_word, order = seen
        return [order[p] for p in sorted({p for w in _title_words(title)
                                          for p in by_word.get(w, ())})]

    def _mentions_link_of(self, parent: str, cid: str) -> bool:
        """Whether the chunk names, as whole words, an entity that `parent` links to."""
        return any(self.links[entity][0] == parent for entity in self._mentioned_links(cid))

    def _qualifier_agreement(self, cid: str) -> float:
        """In [-0.5, 0.5], for a chunk with look-alikes (other documents whose titles share its
        name and differ in the qualifier: 'Contract C-7867 review (2015)' / '(2017)'): how far
        its qualifier agrees with what is known about the thing it names — the sub-query, and
        every other chunk that mentions that name (its title core, or the bridge entity that
        found it), the look-alikes excepted. 0 without a qualifier or without a look-alike: the
        qualifier only decides between chunks that the name alone cannot."""
        chunk = self.chunks[cid]
        qualifier = _dashless(terms(title_qualifier(chunk.title)))  # '1992–93' = '1992-93'
        if not qualifier:
            return 0.0
        core = _series_core(chunk.title)
        alike = {o.doc_id for o in self.chunks.values()
                 if o.doc_id != chunk.doc_id and _series_core(o.title) == core}
        if not alike:
            return 0.0
        names = {n for n in (core, folded(self.origins[cid].entity)) if len(n) > 3}
        known = set(self.q_terms)
        for other in self.chunks.values():
            if other.doc_id == chunk.doc_id or other.doc_id in alike:
                continue
            text = folded(other.text)
            if any(n in text for n in names):
                known |= terms(other.text)
        return len(qualifier & _dashless(known)) / len(qualifier) - 0.5

    def _expansions(self, visible: set[str]) -> list[ToolCall]:
        ranked = self._ranked(visible)
        best = self.scores.get(ranked[0], 0.0) if ranked else 0.0
        frontier = [cid for cid in ranked
                    if cid not in self.expanded and self.scores[cid] >= self.expand_floor * best
                    and self.depth.get(cid, 0) < self.max_hops - 1]
        calls: list[ToolCall] = []
        for cid in frontier[: self.expand_per_turn]:
            chunk = self.chunks[cid]
            if chunk.text.endswith("…") and cid not in self.read:
                # the snippet was cut: read the whole chunk, expand it next turn
                self.read.add(cid)
                n = int(cid.rsplit("#p", 1)[1])
                calls.append(ToolCall("read_document", {"doc_id": chunk.doc_id, "start": n,
                                                        "count": 1, "from_ids": [cid]}))
                continue
            self.expanded.add(cid)
            linked = self._bridge_entities(cid)
            for entity, salience in linked:  # every entity links; the most salient are searched
                old = self.links.get(folded(entity))
                if old is None or (old[0] and self.scores.get(old[0], 0) * old[1]
                                   < self.scores[cid] * salience):
                    self.links[folded(entity)] = (cid, salience)
            fresh = [(e, sal) for e, sal in linked if folded(e) not in self.searched]
            for entity, salience in fresh[: self.entities_per_chunk]:
                self.bridges[entity] = cid
                calls.append(self._search(entity, self.entity_k,
                                          _Origin(entity, 0, "bridge", entity, cid), parent=cid))
            query = self._residual_query(cid, [e for e, _ in linked])
            if query and folded(query) not in self.searched:
                calls.append(self._search(query, self.residual_k,
                                          _Origin(query, 0, "residual", "", cid), parent=cid))
        return calls

    def _residual_query(self, cid: str, linked: list[str]) -> str:
        """What the next hop from this chunk must find, as one search: the sub-query's words
        the chunk does not cover, with the entities it mentions ("the waterfall in the country
        where the Bubye River is found" from the Bubye River page: "waterfall country Zimbabwe
        Limpopo River ..."). It finds the page that a relation, not a name, leads to — a
        Victoria Falls page that the Bubye River page never names. Empty when the chunk
        covers the whole sub-query or mentions no entity."""
        if not self.residual_k or not linked:
            return ""
        chunk = self.chunks[cid]
        covered = terms(f"{chunk.title} {chunk.text}")
        left = [w for w in re.findall(r"[\w'-]+", self.subquery)
                if (t := terms(w)) and not t <= covered]
        if not left:
            return ""
        query = ""  # within the search tool's cap: the words first, then as many entities
        for part in dict.fromkeys(left + linked[: self.residual_entities]):
            if len(query) + 1 + len(part) > QUERY_MAX_CHARS:
                break
            query = f"{query} {part}" if query else part
        return query

    def _bridge_entities(self, cid: str) -> list[tuple[str, float]]:
        """Entities a chunk mentions (bridge candidates), most salient first, with a salience in
        (0.5, 1]: the share of sub-query terms in the sentence that mentions the entity, with a
        bonus for the chunk's first sentence (where a page introduces its subject's links)."""
        chunk = self.chunks[cid]
        own = norm_title(chunk.title)
        best: dict[str, tuple[float, int, str]] = {}
        for i, sentence in enumerate(sentences(chunk.text)):
            overlap = min(len(self.q_terms & terms(sentence)) / 3, 1.0)
            for e in entities(sentence, chunk.text):
                low = folded(e)
                if low == own or low in own or low in SKIP or _in_query(e, self.subquery):
                    continue
                salience = 0.5 + 0.35 * overlap + (0.15 if i == 0 else 0.0)
                key = (-salience - 0.01 * len(e.split()), i, e)
                if low not in best or key < best[low]:
                    best[low] = key
        return [(e, -k - 0.01 * len(e.split())) for k, _, e in sorted(best.values())]

    def _recalls(self) -> list[str]:
        """Pruned chunks whose document a newer bridge entity names."""
        out = []
        for cid in self.pruned - self.recalled:  # once: prune/recall must not cycle
            title = self.chunks[cid].title
            if any(_names(title, e) for e in self.bridges):
                out.append(cid)
        return sorted(out)

    def _prune_calls(self, view: AgentView, visible: set[str], force: bool = False
                     ) -> list[ToolCall]:
        ranked = self._ranked(visible)
        keep = max(2, self.keep // 2) if force else self.keep
        drop = [cid for cid in ranked[keep:]]
        floor = 0.5 * self.scores.get(ranked[0], 0) if ranked else 0
        drop += [cid for cid in ranked[:keep] if self.scores.get(cid, 0) < floor * 0.5
                 and cid in self.expanded]
        # a recalled chunk stays until it has been expanded (what it bridges to is searched)
        drop = [cid for cid in dict.fromkeys(drop)
                if force or cid not in self.recalled or cid in self.expanded]
        if not drop:
            return []
        self.pruned |= set(drop)
        return [ToolCall("prune_chunks", {
            "ids": drop,
            "reason": f"spent or redundant: below the top {keep} by score against the query "
                      f"state (terms {sorted(self.q_terms)[:6]}, bridges "
                      f"{list(self.bridges)[-3:]})"})]

    def _ranked(self, ids: set[str]) -> list[str]:
        return sorted((cid for cid in ids if cid in self.scores),
                      key=lambda c: (-self.scores[c], c))

    def _title_key(self, cid: str) -> str:
        chunk = self.chunks.get(cid)
        return norm_title(chunk.title) if chunk is not None else ""

    def _finish(self, visible: set[str]) -> ToolCall:
        """Rank everything the trajectory scored — kept, pruned or never expanded — by the score
        it holds now (`workers.rank.final_ranking`): a prune frees context, it is no verdict.
        With `learned_rank`, the order is the learned ranker's (`workers.ranker`) over the
        features of every scored chunk (kept in `final_features`)."""
        if not self.rank_all:
            ranked = self._ranked(visible - self.pruned)
        elif self.learned_rank:
            from branchsearch.workers.ranker import episode_features, load_ranker

            ranker = load_ranker(self.ranker_path)
            self.final_features = episode_features(self, ranker.used)  # only what it weighs
            ranked = final_ranking(ranker.scores(self.final_features), len(self.scores))
        else:
            ranked = final_ranking(self.scores, len(self.scores))
        if self.rank_all:
            ranked = hold_back(ranked, self.tail_ids, self.search_k)
        if self.per_title:
            ranked = crowd(ranked, self._title_key, self.per_title)
        ranked = ranked[: self.final_k]
        return ToolCall("finish", {"ids": ranked, "reason": "no unexpanded bridge entities left"
                                   if ranked else "nothing found"})


# a title of at most this many words is a name (encyclopedia pages: 3 words at the median of
# hotpot's and musique's corpora, 5 at the 90th percentile), longer is a sentence (a paper's
# title: 12 at SciFact's median, 7 at its 10th percentile)
NAME_WORDS = 8

SKIP = frozenset("""january february march april may june july august september october november
december monday tuesday wednesday thursday friday saturday sunday one two three four five six
seven eight nine ten originally however during later after""".split())


@lru_cache(maxsize=65536)
def _names(title: str, entity: str) -> float:
    """How well a document title names this entity: 1.0 exactly (after dropping a parenthetical
    qualifier and a leading article), 0.85 when the title adds one word ('Manchester United
    F.C.') or the entity adds a prefix ('Governor Nelson Rockefeller'), else 0."""
    t, e = _strip_article(norm_title(title)), _strip_article(folded(entity))
    if not t or len(e) < 3:
        return 0.0
    if t == e:
        return 1.0
    t_words, e_words = len(t.split()), len(e.split())
    if e_words >= 2 and t.startswith(e + " ") and t_words - e_words <= 1:
        return 0.85
    return 0.85 if t_words >= 2 and e.endswith(" " + t) else 0.0  # 'Governor Nelson Rockefeller' names
    # 'Nelson Rockefeller'; 'Esma Sultan Mansion' does not name 'Esma Sultan'


@lru_cache(maxsize=16384)
def _words(text: str) -> frozenset[str]:
    return frozenset(re.findall(r"\w+", text))


@lru_cache(maxsize=16384)
def _title_words(title: str) -> frozenset[str]:
    return frozenset(norm_title(title).split())


@lru_cache(maxsize=65536)
def _word_overlap(title: str, entity: str) -> float:
    """Jaccard overlap of the words of a title and an entity ('International Boxing Council'
    vs 'International Boxing Federation': 0.5)."""
    t, e = _title_words(title), set(folded(entity).split())
    return len(t & e) / len(t | e) if t and e and len(t) > 1 else 0.0


def title_qualifier(title: str) -> str:
    """The qualifier of a title: 'Kiss and Tell (1945 film)' -> '1945 film', 'Brown County,
    Kansas' -> 'Kansas', 'Ed Wood' -> ''."""
    m = re.search(r"\(([^)]*)\)\s*$", title)
    if m:
        return m.group(1)
    head, comma, tail = title.partition(",")
    if comma:
        return tail.strip()
    m = _LEADING_YEAR.match(title)
    return m.group(1) if m else ""


# a title that opens with a year or a season names one of a series: '1974 Texas Tech Red
# Raiders football team', '1995–96 Manchester United F.C. season'
_LEADING_YEAR = re.compile(r"((?:1[0-9]|20)\d\d(?:[–-]\d{2,4})?)\s+\S")


def _dashless(words) -> set[str]:
    """Words with those joined by a dash also split ('1992-93' -> '1992', '93')."""
    out = set(words)
    for w in words:
        if "-" in w:
            out.update(p for p in w.split("-") if p)
    return out


def _series_core(title: str) -> str:
    """`norm_title` without a leading year: what the titles of one series share."""
    core = norm_title(title)
    m = _LEADING_YEAR.match(core)
    return core[m.end(1):].strip() if m else core


def _names_page(title: str, query: str) -> bool:
    """Whether the query names a page of a longer title (all its words are in the query). A
    proper name ('Siege of Cassel', two or more capitalised words) is named by its words,
    however the query writes them. A title with one capital ('Body water', 'Political party',
    a concept; 'Gila monster', 'Argand lamp', '2018 Kansas gubernatorial election', built on a
    name) is named when the query writes that word as a name too — capitalised, and not as its
    first word — or writes the whole title as the title does."""
    bare, query = fold(bare_title(title)), fold(query)
    capitals = [w for w in bare.split() if w[:1].isupper()]
    if len(capitals) >= 2:
        return True
    parts = query.split(None, 1)
    rest = parts[1] if len(parts) == 2 else ""  # the query past its first word
    return any(has_phrase(rest, w) for w in capitals) or has_phrase(query, bare)


def _named_in(title: str, query: str) -> bool:
    """Whether the query writes a one-word title's word as the title does (capitalised)."""
    word = fold(bare_title(title))
    return bool(word) and has_phrase(fold(query), word)


def _strip_article(text: str) -> str:
    return text[4:] if text.startswith("the ") else text


def _in_query(entity: str, query: str) -> bool:
    return folded(entity) in folded(query)
