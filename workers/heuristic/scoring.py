"""Scoring a chunk against the query state: how it arrived, whether the sub-query or a bridge
entity names its page, the terms it covers and the qualifier of a look-alike title.

Functions of the episode state and the knobs; the policy rescores every chunk each turn.
"""

from __future__ import annotations

from branchsearch.workers.heuristic.config import HeuristicConfig
from branchsearch.workers.heuristic.state import EpisodeState, Origin
from branchsearch.workers.heuristic.titles import (NAME_WORDS, dashless, named_in, names,
                                                   names_page, series_core, strip_article,
                                                   title_qualifier, word_overlap)
from branchsearch.workers.text import folded, norm_title, terms

HOP_SUPPORT = 0.15  # support of a hop's hit: this over its rank in that search
NAMED_SUPPORT = 0.95  # the sub-query (or a page-less query entity) names a page of 2+ words
NAMED_ONE_WORD_SUPPORT = 0.6  # ... a page of one word
OVERLAP_MIN = 0.5  # a title sharing at least this share of its words with a bridge entity
OVERLAP_SHARE = 0.5  # ... takes this share of the overlap times the entity's salience times
# its source's score


def rescore(state: EpisodeState, config: HeuristicConfig) -> None:
    if config.mention_weight:
        state.count_mentions()
    for cid in state.by_arrival():
        state.scores[cid] = score(state, config, cid)


def score(state: EpisodeState, config: HeuristicConfig, cid: str) -> float:
    """Best support for a chunk under the current query state, plus term coverage.

    Support is the strongest of: its rank in the sub-query search; the sub-query naming its
    document's title; a bridge entity of a parent chunk naming its title (inheriting the
    parent's score, scaled by the entity's salience), fully or in part. Coverage counts
    sub-query terms in the chunk, and separately the *residual* terms its parent left
    uncovered — the part of the question the next hop must answer.
    """
    chunk, origin = state.chunks[cid], state.origins[cid]
    words = terms(f"{chunk.title} {chunk.text}")
    coverage = len(state.q_terms & words) / max(len(state.q_terms), 1)
    support, parent = HOP_SUPPORT / origin.rank, origin.parent
    if origin.kind == "question":
        support, parent = 1.0 / (1.0 + config.rank_decay * (origin.rank - 1)), ""
    title_terms = terms(norm_title(chunk.title))
    if title_terms and title_terms <= state.q_terms and (
            named_in(chunk.title, state.subquery) if len(title_terms) == 1
            else config.common_titles_named or names_page(chunk.title, state.subquery)):
        # the sub-query names the page: a longer title's words written as a name, or a
        # one-word title as a name ("Casino, New South Wales" is not named by "hotel and
        # casino"; "Body water" is not named by "what body of water")
        support = max(support, NAMED_SUPPORT if len(title_terms) > 1 else NAMED_ONE_WORD_SUPPORT)
        parent = ""
    for entity in state.links_sharing_a_word(chunk.title):
        source, salience = state.links[entity]
        if source == cid:
            continue
        quality = names(chunk.title, entity)
        if quality:
            via = quality * (config.link_weight * salience * state.scores.get(source, 0.0)
                             if source else NAMED_SUPPORT if " " in entity
                             else NAMED_ONE_WORD_SUPPORT)
        else:
            overlap = word_overlap(chunk.title, entity)
            if overlap < OVERLAP_MIN or not source:
                continue
            via = OVERLAP_SHARE * overlap * salience * state.scores.get(source, 0.0)
        if via > support:
            support, parent = via, source
    if origin.kind == "bridge" and config.mention_weight:
        via = mention_support(state, config, cid, origin)
        if via > support:
            support, parent = via, origin.parent
    residual = 0.0
    if parent in state.chunks and (origin.kind != "residual" or parent != origin.parent
                                   or state.mentions_link_of(parent, cid)):
        # a residual search's hit covers the parent's leftover terms by construction:
        # that counts only when it also mentions what the parent links to; and a leftover
        # of one or two words (a one-hop claim its first hit already covers) is weak
        # evidence of a next hop
        p = state.chunks[parent]
        left = state.q_terms - terms(f"{p.title} {p.text}")
        residual = len(left & words) / max(len(left), 1) * min(1.0, len(left) / 3)
    return (support + config.coverage_weight * coverage + config.residual_weight * residual
            + config.qualifier_weight * qualifier_agreement(state, cid))


def mention_support(state: EpisodeState, config: HeuristicConfig, cid: str,
                    origin: Origin) -> float:
    """A bridge search's hit that mentions the entity, when no page seen is titled by it:
    the entity has no page here ('Raoul Walsh' directed 'Jump for Glory'; the corpus has
    'Betrayed (1917 film)', directed by Raoul Walsh, not a Raoul Walsh page), so the pages
    that mention it are where the next hop is. Inherits from the parent like a titled page,
    scaled by `mention_weight`, the hit's rank, and how many other chunks mention the
    entity in passing. Only a page titled by a name (not a paper titled by its claim, where
    no entity has a page and an absent one says nothing) takes it."""
    entity = folded(origin.entity)
    source, salience = state.links.get(entity, (origin.parent, 0.5))
    if (not source or source == cid or strip_article(entity) in state.titles()
            or entity not in state.mentioned_links(cid)
            or len(norm_title(state.chunks[cid].title).split()) > NAME_WORDS):
        return 0.0
    return (config.mention_weight * config.link_weight * salience
            * state.scores.get(source, 0.0)
            / origin.rank / (1 + state.mention_count.get(entity, 0)))


def qualifier_agreement(state: EpisodeState, cid: str) -> float:
    """In [-0.5, 0.5], for a chunk with look-alikes (other documents whose titles share its
    name and differ in the qualifier: 'Contract C-7867 review (2015)' / '(2017)'): how far
    its qualifier agrees with what is known about the thing it names — the sub-query, and
    every other chunk that mentions that name (its title core, or the bridge entity that
    found it), the look-alikes excepted. 0 without a qualifier or without a look-alike: the
    qualifier only decides between chunks that the name alone cannot."""
    chunk = state.chunks[cid]
    qualifier = dashless(terms(title_qualifier(chunk.title)))  # '1992–93' = '1992-93'
    if not qualifier:
        return 0.0
    core = series_core(chunk.title)
    alike = {o.doc_id for o in state.chunks.values()
             if o.doc_id != chunk.doc_id and series_core(o.title) == core}
    if not alike:
        return 0.0
    names_ = {n for n in (core, folded(state.origins[cid].entity)) if len(n) > 3}
    known = set(state.q_terms)
    for other in state.chunks.values():
        if other.doc_id == chunk.doc_id or other.doc_id in alike:
            continue
        text = folded(other.text)
        if any(n in text for n in names_):
            known |= terms(other.text)
    return len(qualifier & dashless(known)) / len(qualifier) - 0.5
