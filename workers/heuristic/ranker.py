"""A learned final ranking for the heuristic policy: a linear model over the features the policy
already computes for every chunk it scored. Pure functions; the weights ship as JSON beside this
file, one per search mode (`ranker_weights.json` for BM25, `ranker_weights_hybrid.json`; see
`weights_for`), retrained by `reports/recall/train_ranker.py`.

Why: the heuristic's one score adds its parts with hand-set weights (support, coverage,
residual, qualifier), chosen on one set. What marks a chunk as evidence differs in kind between
questions (a bridge page the question never names, a page the question names outright) and the
parts the score leaves out — how many other retrieved chunks mention this one's title, how
strong the chunk that led to it was, whether it led anywhere when expanded — tell them apart. A linear model over
those features, fit on one data set, reorders the chunks the trajectory found; it never adds one.

    ranker score(c) = sum_i w_i * (f_i(c) - mean_i) / scale_i      (features below, `FEATURES`)

The final list is then `workers.rank.final_ranking` over these scores (one chunk per document
first), exactly as for the heuristic's own score.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from branchsearch.workers.heuristic.scoring import qualifier_agreement
from branchsearch.workers.heuristic.titles import names
from branchsearch.workers.rank import doc_of
from branchsearch.workers.text import folded, norm_title, terms

WEIGHTS_PATH = Path(__file__).with_name("ranker_weights.json")  # fit on BM25 search
HYBRID_WEIGHTS_PATH = Path(__file__).with_name("ranker_weights_hybrid.json")
_WORDS = re.compile(r"\w+")

FEATURES = (
    "score",            # the heuristic's own score at the end
    "score_rel",        # score / the best score of the episode
    "rank_inv",         # 1 / the chunk's place in the heuristic's order
    "question_support",  # 1 / (1 + 0.6 (r - 1)) for place r in the sub-query's own search
    "from_entity",      # found by a search for an entity the sub-query names
    "from_bridge",      # found by a search for a bridge entity of another chunk
    "origin_rank_inv",  # 1 / its place in the search that found it first
    "coverage",         # share of the sub-query's terms in title + text
    "title_coverage",   # share of the title's terms that the sub-query holds
    "title_in_query",   # every title term is in the sub-query
    "names_q_entity",   # how well the title names an entity of the sub-query (0, 0.85, 1)
    "names_bridge",     # how well the title names a bridge entity another chunk mentions
    "mentioned_by",     # log(1 + other scored documents whose text mentions the title)
    "mentions_q_ent",   # share of the sub-query's entities the chunk's text mentions
    "residual",         # share of the terms its parent left uncovered that it covers
    "qualifier",        # the look-alike qualifier agreement in [-0.5, 0.5]
    "depth",            # hops from the sub-query's searches
    "children_inv",     # 1 - 1 / (1 + chunks found through its bridge entities)
    "parent_score",     # the score of the chunk that led to it (0 for the sub-query's own)
    "expanded",         # its bridge entities were searched
    "pruned",           # pruned from the context and not recalled by the end
    "first_chunk",      # the document's first chunk (#p0)
    "doc_chunks",       # log of the number of its document's chunks the episode scored
    # set-level, scale-free (ranks and shares within the episode):
    "doc_rank_inv",     # 1 / its document's place in the heuristic's document order
    "chain_support",    # best score_rel of another document whose text names its title
    "chain_rank_inv",   # 1 / the heuristic document place of the best such document
    "restates",         # a document with the same title core scored higher (a restatement)
    "novel_terms",      # share of the sub-query's terms it covers that no document above it does
    "novel_entity",     # it names or mentions a sub-query entity no document above it does
)


def episode_features(policy, needed: frozenset[str] | None = None) -> dict[str, list[float]]:
    """Feature vectors (in `FEATURES` order) of every chunk a `HeuristicPolicy` scored, read
    from its state at the end of an episode. `needed`: compute only these (the others are 0.0;
    the policy passes the ones its ranker weighs, a training dump needs them all)."""
    state, rank_decay = policy.state, policy.config.rank_decay
    scores = state.scores
    if not scores:
        return {}
    want = (lambda name: True) if needed is None else needed.__contains__
    order = sorted(scores, key=lambda c: (-scores[c], c))
    place = {cid: i for i, cid in enumerate(order, start=1)}
    best = max(scores.values()) or 1.0
    q, q_ents = state.q_terms, [folded(e) for e in state.q_entities]
    bridge_ents = [e for e, (src, _) in state.links.items() if src]
    texts = {cid: folded(f"{c.title} {c.text}") for cid, c in state.chunks.items()
             if cid in scores}
    children = Counter(o.parent for cid, o in state.origins.items() if o.parent and cid in scores)
    per_doc = Counter(doc_of(cid) for cid in scores)
    def row(cid: str) -> dict[str, float]:
        chunk, origin = state.chunks[cid], state.origins[cid]
        f = {"score": scores[cid], "score_rel": scores[cid] / best, "rank_inv": 1.0 / place[cid],
             "question_support": 1.0 / (1.0 + rank_decay * (origin.rank - 1))
             if origin.kind == "question" else 0.0,
             "from_entity": float(origin.kind == "entity"),
             "from_bridge": float(origin.kind == "bridge"),
             "origin_rank_inv": 1.0 / max(origin.rank, 1),
             "depth": float(state.depth.get(cid, 0)),
             "children_inv": 1.0 - 1.0 / (1 + children[cid]),
             "parent_score": scores.get(origin.parent, 0.0) if origin.parent else 0.0,
             "expanded": float(cid in state.expanded), "pruned": float(cid in state.pruned),
             "first_chunk": float(cid.endswith("#p0")),
             "doc_chunks": math.log(per_doc[doc_of(cid)])}
        if want("coverage") or want("residual"):
            words = terms(f"{chunk.title} {chunk.text}")
            f["coverage"] = len(q & words) / max(len(q), 1)
            f["residual"] = _residual(state, cid, words) if want("residual") else 0.0
        if want("title_coverage") or want("title_in_query"):
            title_terms = terms(norm_title(chunk.title))
            f["title_coverage"] = len(title_terms & q) / max(len(title_terms), 1)
            f["title_in_query"] = float(bool(title_terms) and title_terms <= q)
        if want("names_q_entity"):
            f["names_q_entity"] = max((names(chunk.title, e) for e in q_ents), default=0.0)
        if want("names_bridge"):
            f["names_bridge"] = max((names(chunk.title, e) for e in bridge_ents), default=0.0)
        if want("mentioned_by"):
            core = norm_title(chunk.title)
            f["mentioned_by"] = math.log1p(sum(
                1 for other, text in texts.items()
                if doc_of(other) != chunk.doc_id and len(core) > 3 and core in text))
        if want("mentions_q_ent"):
            f["mentions_q_ent"] = sum(e in texts[cid] for e in q_ents) / max(len(q_ents), 1)
        if want("qualifier"):
            f["qualifier"] = qualifier_agreement(state, cid)
        f.update(sets.get(cid, {}))
        return f

    sets = _set_features(state, order, texts, want)

    out = {}
    for cid in scores:
        f = row(cid)
        out[cid] = [f.get(name, 0.0) for name in FEATURES]
    return out


SET_FEATURES = ("doc_rank_inv", "chain_support", "chain_rank_inv", "restates", "novel_terms",
                "novel_entity")
HEAD = 5  # "above it" for novel_terms / novel_entity: the documents placed before it in the top 5


def _set_features(state, order: list[str], texts: dict[str, str], want
                  ) -> dict[str, dict[str, float]]:
    """Features of a chunk relative to the other documents of the episode, all ranks or shares
    (no raw score), so they mean the same on every data set:

    * the chain: the gold of a multi-hop question is a chain of pages, each naming the next; a
      page whose title is named by a strong page of the episode (one with another title) is a
      link of it
      (`chain_support`: that page's score over the episode's best, `chain_rank_inv`: 1 / its
      place in the heuristic's document order);
    * restating: another document with the same title core placed higher (`restates`);
    * coverage: what it adds to the documents placed before it in the top `HEAD`: sub-query
      terms (`novel_terms`, share of the sub-query's terms) and sub-query entities
      (`novel_entity`, 0/1)."""
    if not any(want(n) for n in SET_FEATURES):
        return {}
    scores, chunks = state.scores, state.chunks
    best = max(scores.values()) or 1.0
    doc_first: dict[str, str] = {}
    for cid in order:
        doc_first.setdefault(chunks[cid].doc_id, cid)
    place = {d: i for i, d in enumerate(doc_first, start=1)}
    doc_texts: dict[str, list[str]] = {}
    for cid, text in texts.items():
        doc_texts.setdefault(chunks[cid].doc_id, []).append(text)
    doc_text = {d: "".join(" " + t for t in ts) for d, ts in doc_texts.items()}
    core = {d: norm_title(chunks[c].title) for d, c in doc_first.items()}
    first: dict[str, int] = {}  # title core -> the first document place holding it
    for d, name in core.items():
        first.setdefault(name, place[d])
    chain: dict[str, tuple[float, int]] = {}
    if want("chain_support") or want("chain_rank_inv"):
        # a document's words, and their set: a phrase it holds has all its words in the set
        doc_words = {d: " " + " ".join(w for t in ts if (w := _words(t)[0])) + " "
                     for d, ts in doc_texts.items()}
        vocab = {d: frozenset().union(*(_words(t)[1] for t in ts))
                 for d, ts in doc_texts.items()}
        for d, name in core.items():
            name_words, needed = _words(name)
            needle = " " + name_words + " "
            if len(needle) <= 5:
                continue
            for other in doc_first:  # in document order: the first that names it is the best
                if core[other] != name and needed <= vocab[other] \
                        and needle in doc_words[other]:  # not a restatement
                    chain[d] = (scores[doc_first[other]] / best, place[other])
                    break
    q_ents = [folded(e) for e in state.q_entities]
    head = list(doc_first)[:HEAD]
    covered: list[set[str]] = [set()]  # covered[i]: sub-query terms of the first i head documents
    mentioned: list[set[str]] = [set()]
    for d in head:
        c = doc_first[d]
        words = terms(f"{chunks[c].title} {chunks[c].text}")
        covered.append(covered[-1] | (state.q_terms & words))
        mentioned.append(mentioned[-1] | {e for e in q_ents if e in doc_text[d]})
    out: dict[str, dict[str, float]] = {}
    for cid in scores:
        d = chunks[cid].doc_id
        k = min(place[d] - 1, len(head))
        support, by = chain.get(d, (0.0, 0))
        words = state.q_terms & terms(f"{chunks[cid].title} {chunks[cid].text}")
        ents = {e for e in q_ents if e in texts[cid]}
        out[cid] = {"doc_rank_inv": 1.0 / place[d], "chain_support": support,
                    "chain_rank_inv": 1.0 / by if by else 0.0,
                    "restates": float(first[core[d]] < place[d]),
                    "novel_terms": len(words - covered[k]) / max(len(state.q_terms), 1),
                    "novel_entity": float(bool(ents - mentioned[k]))}
    return out


@lru_cache(maxsize=16384)
def _words(text: str) -> tuple[str, frozenset[str]]:
    """`text`'s words joined by single spaces, and their set (cached: a question's branches,
    and the next questions, score many of the same chunks)."""
    words = _WORDS.findall(text)
    return " ".join(words), frozenset(words)


def _residual(state, cid: str, words: set[str]) -> float:
    parent = state.origins[cid].parent
    if parent not in state.chunks:
        return 0.0
    p = state.chunks[parent]
    left = state.q_terms - terms(f"{p.title} {p.text}")
    return len(left & words) / max(len(left), 1)


@dataclass(frozen=True)
class LinearRanker:
    """score = sum_i w_i (x_i - mean_i) / scale_i over the features named in `features`."""

    features: tuple[str, ...]
    weights: tuple[float, ...]
    mean: tuple[float, ...]
    scale: tuple[float, ...]
    meta: dict

    @property
    def used(self) -> frozenset[str]:
        """The features with a weight (the only ones `episode_features` must compute)."""
        return frozenset(f for f, w in zip(self.features, self.weights) if w)

    def score(self, x: list[float]) -> float:
        return sum(w * (v - m) / s for w, v, m, s in zip(self.weights, x, self.mean, self.scale))

    def scores(self, feats: dict[str, list[float]]) -> dict[str, float]:
        return {cid: self.score(x) for cid, x in feats.items()}

    def to_json(self) -> dict:
        return {"features": list(self.features), "weights": list(self.weights),
                "mean": list(self.mean), "scale": list(self.scale), "meta": self.meta}

    @classmethod
    def from_json(cls, data: dict) -> LinearRanker:
        names = tuple(data["features"])
        if names != FEATURES:
            raise ValueError(f"ranker weights are for features {names}, this code computes "
                             f"{FEATURES}: retrain (reports/recall/train_ranker.py)")
        n = len(names)
        if not all(len(data[k]) == n for k in ("weights", "mean", "scale")):
            raise ValueError("ranker weights: weights, mean and scale must match the features")
        return cls(names, tuple(map(float, data["weights"])), tuple(map(float, data["mean"])),
                   tuple(float(s) or 1.0 for s in data["scale"]), dict(data.get("meta", {})))


def weights_for(search_mode: str) -> Path:
    """The shipped weights for a search mode. Each file is fit on hotpot + synth episodes
    searched that way and reported on musique and SciFact: the features describe the episode's
    search lists, and a hybrid question list puts other pages first than a BM25 one (BM25's
    weights cost hybrid SciFact 0.004 nDCG@10 against no ranker; hybrid's cost BM25 musique
    0.07 AR@5: reports/recall/README.md). Dense-only search has no fit: BM25's.
    `search_mode` is the mode searched (`infra.retrieval.retriever.searched_mode`): hybrid on an index
    with one backend is that backend's."""
    return HYBRID_WEIGHTS_PATH if search_mode == "hybrid" else WEIGHTS_PATH


@lru_cache(maxsize=4)
def load_ranker(path: str | None = None) -> LinearRanker:
    """The shipped BM25 ranker (or the one at `path`; `weights_for` picks by search mode)."""
    return LinearRanker.from_json(json.loads(Path(path or WEIGHTS_PATH).read_text()))
