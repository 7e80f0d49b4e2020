"""HeuristicPolicy: deterministic multi-hop search with no model.

Query state: the sub-query's content terms, the entities named in it, and the bridge entities
found in retained chunks (each with the chunk it came from and a salience). Each turn it

1. scores every visible chunk against the query state (`scoring.py`): how it arrived
   (sub-query search rank, or a bridge search whose entity names the chunk's document,
   inheriting its parent's score; or, for an entity with no page, a bridge search's hit that
   mentions it), how many sub-query terms it covers, and which of them no better chunk already
   covers;
2. expands the best unexpanded chunks (`expansion.py`): searches for their most salient bridge
   entities (entities in sentences that share terms with the sub-query), with provenance to
   the parent;
3. prunes what is spent or redundant (beyond the `keep` best, or below a score floor) and
   recalls a pruned chunk when a new bridge entity names its document;
4. finishes when nothing is left to expand or the hop limit is reached, ranking by the learned
   ranker (`ranker.py`) or by score.
"""

from __future__ import annotations

from dataclasses import fields, replace

from branchsearch.workers.heuristic import expansion, forks, scoring
from branchsearch.workers.heuristic.config import HeuristicConfig
from branchsearch.workers.heuristic.ranker import episode_features, load_ranker
from branchsearch.workers.heuristic.state import EpisodeState, Origin
from branchsearch.workers.policy import AgentView, ToolCall
from branchsearch.workers.rank import crowd, doc_of, final_ranking, hold_back
from branchsearch.workers.text import entities, folded, terms
from branchsearch.workers.tools import MAX_SEARCH_K

KNOBS = frozenset(f.name for f in fields(HeuristicConfig))
STATE = frozenset(f.name for f in fields(EpisodeState)) | {"_pending", "_tail"}


class HeuristicPolicy:
    """The policy of one episode: its knobs (`config`, frozen) and its state (`state`, new).

    `HeuristicPolicy(question_k=4)` sets knobs by name; knobs and state also read (and are set)
    as the policy's own attributes: `policy.final_k`, `policy.scores`.
    """

    def __init__(self, config: HeuristicConfig | None = None, **knobs) -> None:
        object.__setattr__(self, "config", replace(config or HeuristicConfig(), **knobs))
        object.__setattr__(self, "state", EpisodeState())

    def __getattr__(self, name: str):
        if name in STATE:
            return getattr(self.state, name.lstrip("_"))
        if name in KNOBS:
            return getattr(self.config, name)
        raise AttributeError(f"{type(self).__name__!r} has no attribute {name!r}")

    def __setattr__(self, name: str, value) -> None:
        if name in STATE:
            setattr(self.state, name.lstrip("_"), value)
        elif name in KNOBS:
            object.__setattr__(self, "config", replace(self.config, **{name: value}))
        else:
            object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        return f"HeuristicPolicy({self.config!r})"

    # --- Policy protocol -----------------------------------------------------------------------

    def decide(self, view: AgentView) -> list[ToolCall]:
        if view.turn == 1:
            return self._first_turn(view)
        self._absorb(view)
        self._rescore(view)
        visible = {c.id for c in view.visible}
        if view.turn >= self.config.max_turns:  # the last turn: a ranking, not arrival order
            return [self._finish(visible)]
        if "search_corpus" not in view.allowed_tools:  # past the hard limit
            return self._prune_calls(view, visible, force=True) or [self._finish(visible)]
        searches, recalls = self._next_searches(view)
        if not searches and not recalls:  # nothing left to expand or read: keep what we
            prune = self._prune_calls(view, visible) if self.config.prune else []  # return,
            return prune + [self._finish(visible)]  # finish
        calls = self._prune_calls(view, visible) if self.config.prune else []
        if recalls:
            calls.append(ToolCall("recall_chunks", {"ids": recalls}))
        return calls + searches

    def rank(self, view: AgentView) -> list[str]:
        """The ranking `finish` would return now (the harness asks when a limit stops the
        episode before this policy finished): the last turn's results absorbed first."""
        self._absorb(view)
        self._rescore(view)
        return self._finish({c.id for c in view.visible}).args["ids"]

    def start_from(self, seeds: list[str], hop_room: int = 1) -> None:
        """Make this episode a fork: its first turn reads the handed-over chunks `seeds` (a
        parent's pruned alternative), scored as the sub-query's first hits, instead of
        searching the sub-query; it follows `hop_room` hops from them (at least one) and
        never searches the question's tail (its parent did)."""
        self.state.seeds = tuple(seeds)
        self.config = replace(self.config, max_hops=max(hop_room, 1) + 1, tail_page=False,
                              fork_gap=0.0)  # depth 1: a fork never forks

    def fork_candidates(self) -> list[dict]:
        """The pruned hypotheses this episode could not rule out (`forks.candidates`)."""
        return forks.candidates(self.state)

    def query_state(self) -> dict:
        s = self.state
        top = sorted(s.scores, key=s.scores.get, reverse=True)[:5]
        return {"subquery": s.subquery, "terms": sorted(s.q_terms),
                "entities": s.q_entities, "bridges": dict(list(s.bridges.items())[-8:]),
                "top": {cid: round(s.scores[cid], 3) for cid in top}}

    # --- turns -----------------------------------------------------------------------------------

    def _first_turn(self, view: AgentView) -> list[ToolCall]:
        s, c = self.state, self.config
        s.subquery = view.subquery
        s.q_terms = terms(view.subquery)
        s.q_entities = entities(view.subquery)[:4]
        s.links = {folded(e): ("", 1.0) for e in s.q_entities}
        if s.seeds:  # a fork: the handed-over chunks are where it starts
            return [self._read_seed(cid, rank) for rank, cid in enumerate(s.seeds, start=1)]
        calls = [self._search(view.subquery, c.question_k, Origin(view.subquery, 0, "question"))]
        for e in s.q_entities:
            if folded(e) != folded(view.subquery):  # an entity branch's sub-query is searched
                calls.append(self._search(e, c.entity_k, Origin(e, 0, "entity", entity=e)))
        return calls

    def _read_seed(self, cid: str, rank: int) -> ToolCall:
        doc, n = cid.rsplit("#p", 1)
        self.state.origins[cid] = Origin(self.state.subquery, rank, "question")
        return ToolCall("read_document", {"doc_id": doc, "start": int(n), "count": 1})

    def _next_searches(self, view: AgentView) -> tuple[list[ToolCall], list[str]]:
        """(searches, chunk ids to recall) of a turn; none once the question's tail is
        searched (then: rank and finish)."""
        if self.state.tail is not None:
            return [], []
        searches = self._question_page() if view.turn == 2 else []
        searches += self._expansions({c.id for c in view.visible})
        recalls = self._recalls()
        if not searches and not recalls and self.config.tail_page:
            searches = self._question_tail()
        return searches, recalls

    def _question_page(self) -> list[ToolCall]:
        """The sub-query's own search once more, when its hits came from fewer than `question_k`
        documents (long documents split into chunks): a document is the unit of evidence, so
        the search should bring `question_k` of them. Its hits rank after the first page's."""
        return self._more_of_the_question(self.config.question_k)[1]

    def _question_tail(self) -> list[ToolCall]:
        """The sub-query's own search down to `final_k` documents, once, when nothing is left
        to expand: the ranking returns `final_k` documents, and where the hops found nothing
        better the question's own next hits are what single-shot retrieval would return."""
        self.state.tail, calls = self._more_of_the_question(self.config.final_k)
        return calls

    def _more_of_the_question(self, documents: int) -> tuple[Origin, list[ToolCall]]:
        """(the origin of its hits, the search) that brings the sub-query's own hits up to
        `documents` documents; the search excludes what was seen, its hits rank after the
        question's hits so far. No search when there are enough, or the index had no more."""
        s = self.state
        hits = [cid for cid, o in s.origins.items() if o.kind == "question"]
        missing = documents - len({doc_of(cid) for cid in hits})
        origin = Origin(s.subquery, len(hits), "question")
        if missing <= 0 or len(hits) < self.config.question_k:
            return origin, []
        return origin, [self._search(s.subquery, min(2 * missing, MAX_SEARCH_K), origin)]

    def _search(self, query: str, k: int, origin: Origin, parent: str = "") -> ToolCall:
        return expansion.search(self.state, self.config, query, k, origin, parent)

    def _absorb(self, view: AgentView) -> None:
        """Record where each new chunk came from (the policy's own view of provenance)."""
        s = self.state
        by_id = {c.id: c for c in view.visible}
        for result in view.last_results:
            if not result.ok or result.call.name not in ("search_corpus", "recall_chunks",
                                                         "read_document"):
                continue
            if result.call.name == "recall_chunks":
                s.pruned -= set(result.ids)
                s.recalled |= set(result.ids)
                continue
            if result.call.name == "read_document":
                for cid in result.ids:
                    if cid in by_id and cid in s.origins:
                        s.chunks[cid] = by_id[cid]
                continue
            parent = (result.call.args.get("from_ids") or [""])[0]
            origin = s.pending.get((result.call.args["query"], parent))
            for rank, cid in enumerate(result.ids, start=origin.rank + 1 if origin else 1):
                if cid in by_id:
                    s.chunks[cid] = by_id[cid]
                if origin is not None and cid not in s.origins:
                    if origin is s.tail:
                        s.tail_ids.add(cid)
                    s.origins[cid] = Origin(origin.query, rank, origin.kind, origin.entity,
                                            origin.parent)
                    s.depth[cid] = s.depth.get(origin.parent, 0) + (1 if parent else 0)

    # --- scoring, expansion, pruning (scoring.py, expansion.py) ---------------------------------

    def _rescore(self, view: AgentView) -> None:
        scoring.rescore(self.state, self.config)

    def _score(self, cid: str) -> float:
        return scoring.score(self.state, self.config, cid)

    def _qualifier_agreement(self, cid: str) -> float:
        return scoring.qualifier_agreement(self.state, cid)

    def _count_mentions(self) -> None:
        self.state.count_mentions()

    def _expansions(self, visible: set[str]) -> list[ToolCall]:
        return expansion.expansions(self.state, self.config, visible)

    def _residual_query(self, cid: str, linked: list[str]) -> str:
        return expansion.residual_query(self.state, self.config, cid, linked)

    def _recalls(self) -> list[str]:
        return expansion.recalls(self.state)

    def _prune_calls(self, view: AgentView, visible: set[str], force: bool = False
                     ) -> list[ToolCall]:
        s = self.state
        ranked = s.ranked(visible)
        keep = max(2, self.config.keep // 2) if force else self.config.keep
        drop = [cid for cid in ranked[keep:]]
        floor = 0.5 * s.scores.get(ranked[0], 0) if ranked else 0
        drop += [cid for cid in ranked[:keep] if s.scores.get(cid, 0) < floor * 0.5
                 and cid in s.expanded]
        # a recalled chunk stays until it has been expanded (what it bridges to is searched)
        drop = [cid for cid in dict.fromkeys(drop)
                if force or cid not in s.recalled or cid in s.expanded]
        if not drop:
            return []
        if not force:
            forks.note(s, self.config, ranked, keep, drop)
        s.pruned |= set(drop)
        return [ToolCall("prune_chunks", {
            "ids": drop,
            "reason": f"spent or redundant: below the top {keep} by score against the query "
                      f"state (terms {sorted(s.q_terms)[:6]}, bridges "
                      f"{list(s.bridges)[-3:]})"})]

    # --- finish ----------------------------------------------------------------------------------

    def _finish(self, visible: set[str]) -> ToolCall:
        """Rank everything the trajectory scored — kept, pruned or never expanded — by the score
        it holds now (`workers.rank.final_ranking`): a prune frees context, it is no verdict.
        With `learned_rank`, the order is the learned ranker's (`ranker.py`) over the
        features of every scored chunk (kept in `final_features`)."""
        s, c = self.state, self.config
        if not c.rank_all:
            ranked = s.ranked(visible - s.pruned)
        elif c.learned_rank:
            ranker = load_ranker(c.ranker_path)
            s.final_features = episode_features(self, ranker.used)  # only what it weighs
            ranked = final_ranking(ranker.scores(s.final_features), len(s.scores))
        else:
            ranked = final_ranking(s.scores, len(s.scores))
        if c.rank_all:
            ranked = hold_back(ranked, s.tail_ids, c.question_k)
        if c.per_title:
            ranked = crowd(ranked, s.title_key, c.per_title)
        ranked = ranked[: c.final_k]
        return ToolCall("finish", {"ids": ranked, "reason": "no unexpanded bridge entities left"
                                   if ranked else "nothing found"})
