"""Expanding a chunk: searches for its most salient bridge entities and for what the next hop
must find (the residual), each with provenance to the chunk; and recalling a pruned chunk when
a new bridge entity names its document.
"""

from __future__ import annotations

import re

from branchsearch.workers.heuristic.config import HeuristicConfig
from branchsearch.workers.heuristic.state import EpisodeState, Origin
from branchsearch.workers.heuristic.titles import in_query, names
from branchsearch.workers.policy import ToolCall
from branchsearch.workers.text import entities, folded, norm_title, sentences, terms
from branchsearch.workers.tools import QUERY_MAX_CHARS

# words that look like entities (capitalised) and never are a bridge
SKIP = frozenset("""january february march april may june july august september october november
december monday tuesday wednesday thursday friday saturday sunday one two three four five six
seven eight nine ten originally however during later after""".split())

# salience of a bridge entity: this base, plus this much for the share of the sub-query's terms
# in its sentence (three terms count fully), plus this much in the chunk's first sentence
SALIENCE_BASE, SALIENCE_OVERLAP, SALIENCE_FIRST = 0.5, 0.35, 0.15


def search(state: EpisodeState, config: HeuristicConfig, query: str, k: int, origin: Origin,
           parent: str = "") -> ToolCall:
    """A `search_corpus` call whose hits will get `origin` (rank counted on from its rank)."""
    state.searched.add(folded(query))
    args = {"query": query, "k": k}
    if config.hop_mode and origin.kind != "question":
        args["mode"] = config.hop_mode
    if config.named_pages and origin.kind == "entity":
        args["named"] = True  # a name's own page first
    if parent:
        args["from_ids"] = [parent]
    state.pending[(query, parent)] = origin
    return ToolCall("search_corpus", args)


def expansions(state: EpisodeState, config: HeuristicConfig, visible: set[str]
               ) -> list[ToolCall]:
    """The calls that expand the best unexpanded visible chunks (at most `expand_per_turn`,
    scoring at least `expand_floor` of the best, within `max_hops`): a cut snippet is read
    whole first; a whole one links its bridge entities and searches the most salient ones and
    its residual."""
    ranked = state.ranked(visible)
    best = state.scores.get(ranked[0], 0.0) if ranked else 0.0
    frontier = [cid for cid in ranked
                if cid not in state.expanded and state.scores[cid] >= config.expand_floor * best
                and state.depth.get(cid, 0) < config.max_hops - 1]
    calls: list[ToolCall] = []
    for cid in frontier[: config.expand_per_turn]:
        chunk = state.chunks[cid]
        if chunk.text.endswith("…") and cid not in state.read:
            # the snippet was cut: read the whole chunk, expand it next turn
            state.read.add(cid)
            n = int(cid.rsplit("#p", 1)[1])
            calls.append(ToolCall("read_document", {"doc_id": chunk.doc_id, "start": n,
                                                    "count": 1, "from_ids": [cid]}))
            continue
        state.expanded.add(cid)
        calls += _expand(state, config, cid)
    return calls


def _expand(state: EpisodeState, config: HeuristicConfig, cid: str) -> list[ToolCall]:
    linked = bridge_entities(state, cid)
    for entity, salience in linked:  # every entity links; the most salient are searched
        old = state.links.get(folded(entity))
        if old is None or (old[0] and state.scores.get(old[0], 0) * old[1]
                           < state.scores[cid] * salience):
            state.links[folded(entity)] = (cid, salience)
    calls = []
    fresh = [(e, sal) for e, sal in linked if folded(e) not in state.searched]
    for entity, salience in fresh[: config.entities_per_chunk]:
        state.bridges[entity] = cid
        calls.append(search(state, config, entity, config.entity_k,
                            Origin(entity, 0, "bridge", entity, cid), parent=cid))
    query = residual_query(state, config, cid, [e for e, _ in linked])
    if query and folded(query) not in state.searched:
        calls.append(search(state, config, query, config.residual_k,
                            Origin(query, 0, "residual", "", cid), parent=cid))
    return calls


def residual_query(state: EpisodeState, config: HeuristicConfig, cid: str,
                   linked: list[str]) -> str:
    """What the next hop from this chunk must find, as one search: the sub-query's words
    the chunk does not cover, with the entities it mentions ("the waterfall in the country
    where the Bubye River is found" from the Bubye River page: "waterfall country Zimbabwe
    Limpopo River ..."). It finds the page that a relation, not a name, leads to — a
    Victoria Falls page that the Bubye River page never names. Empty when the chunk
    covers the whole sub-query or mentions no entity."""
    if not config.residual_k or not linked:
        return ""
    chunk = state.chunks[cid]
    covered = terms(f"{chunk.title} {chunk.text}")
    left = [w for w in re.findall(r"[\w'-]+", state.subquery)
            if (t := terms(w)) and not t <= covered]
    if not left:
        return ""
    query = ""  # within the search tool's cap: the words first, then as many entities
    for part in dict.fromkeys(left + linked[: config.residual_entities]):
        if len(query) + 1 + len(part) > QUERY_MAX_CHARS:
            break
        query = f"{query} {part}" if query else part
    return query


def bridge_entities(state: EpisodeState, cid: str) -> list[tuple[str, float]]:
    """Entities a chunk mentions (bridge candidates), most salient first, with a salience in
    (0.5, 1]: the share of sub-query terms in the sentence that mentions the entity, with a
    bonus for the chunk's first sentence (where a page introduces its subject's links)."""
    chunk = state.chunks[cid]
    own = norm_title(chunk.title)
    best: dict[str, tuple[float, int, str]] = {}
    for i, sentence in enumerate(sentences(chunk.text)):
        overlap = min(len(state.q_terms & terms(sentence)) / 3, 1.0)
        for e in entities(sentence, chunk.text):
            low = folded(e)
            if low == own or low in own or low in SKIP or in_query(e, state.subquery):
                continue
            salience = (SALIENCE_BASE + SALIENCE_OVERLAP * overlap
                        + (SALIENCE_FIRST if i == 0 else 0.0))
            key = (-salience - 0.01 * len(e.split()), i, e)
            if low not in best or key < best[low]:
                best[low] = key
    return [(e, -k - 0.01 * len(e.split())) for k, _, e in sorted(best.values())]


def recalls(state: EpisodeState) -> list[str]:
    """Pruned chunks whose document a newer bridge entity names."""
    out = []
    for cid in state.pruned - state.recalled:  # once: prune/recall must not cycle
        title = state.chunks[cid].title
        if any(names(title, e) for e in state.bridges):
            out.append(cid)
    return sorted(out)
