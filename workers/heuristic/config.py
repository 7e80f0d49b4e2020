"""The heuristic policy's tuning knobs: one frozen dataclass, one default per knob.

The knobs that `Settings` also holds (`final_k`, `prune`, `max_turns`, `learned_rank`,
`per_title`) take their default from it: `workers.factory.make_policy` passes the settings'
values, so those are the ones in effect. Its own `question_k` (the sub-query's search) is
distinct from `Settings.search_k` (the search tool's k when a call names none).
"""

from __future__ import annotations

from dataclasses import dataclass

from branchsearch.infra.config.settings import Settings


@dataclass(frozen=True)
class HeuristicConfig:
    max_hops: int = 3  # make_policy: 3 on the question's own branch, else OTHER_MAX_HOPS
    keep: int = 8  # chunks kept in context; the rest are pruned (half past the hard limit)
    expand_per_turn: int = 3
    entities_per_chunk: int = 4  # bridge entities searched per expanded chunk
    question_k: int = 6  # hits of the sub-query's own search (a page of it)
    entity_k: int = 3  # hits of an entity's or a bridge entity's search
    residual_k: int = 3  # hits of one residual search per expanded chunk (0: none)
    residual_entities: int = 8  # the chunk's entities that join the residual words
    expand_floor: float = 0.5  # expand a chunk scoring at least this share of the best
    rank_decay: float = 0.6  # sub-query search: support 1 / (1 + decay * (rank - 1))
    link_weight: float = 0.85  # a bridge child inherits this share of its parent's score
    coverage_weight: float = 0.2
    residual_weight: float = 0.7
    final_k: int = Settings.final_k
    prune: bool = Settings.prune
    rank_all: bool = True  # finish ranks every scored chunk, not only the visible ones
    max_turns: int = Settings.max_turns  # the harness's limit: finish (ranked) on the last turn
    qualifier_weight: float = 0.3  # a title's qualifier agreeing (or not) with what led to it
    mention_weight: float = 0.6  # a bridge hit mentioning an entity that has no page here
    common_titles_named: bool = False  # True: a sentence-case title is named by its words alone
    learned_rank: bool = Settings.learned_rank  # finish by the learned ranker (ranker.py), else
    # by score
    ranker_path: str | None = None  # weights file; None: the shipped BM25 one (make_policy
    # passes the search mode's: ranker.weights_for)
    tail_page: bool = True  # before finishing, the question's search down to final_k documents
    per_title: int = Settings.per_title  # documents of one title (qualifier dropped) before the
    # other pages get the next places: workers.rank.crowd; 0: off. The smallest value that
    # costs nothing on the fit sets (1 splits hotpot's and synth's look-alike titles;
    # reports/recall/README.md)
    hop_mode: str = ""  # the search mode of the searches the policy builds (entities, bridge
    # entities, residual words); "": the tool's default. make_policy passes "bm25" on a hybrid
    # index: a name or a bag of leftover words is matched by its words (their embedding is a
    # weak signal); the question's own searches stay hybrid (reports/recall/README.md)
    fork_gap: float = Settings.fork_gap  # a pruned chunk within this share of the keep line's
    # score is a fork candidate (workers/heuristic/forks.py); 0: none recorded
    named_pages: bool = True  # the search for a name the sub-query holds puts the page titled
    # with it first (the search tool's `named`): a name's page often ranks below longer pages
    # that mention it. Not for bridge entities: their pages are mostly hubs (a state, a
    # country) that then crowd the top (reports/recall/README.md)
