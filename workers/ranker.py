"""A learned final ranking for the heuristic policy: a linear model over the features the policy
already computes for every chunk it scored. Pure functions; the weights ship as JSON beside this
file (`ranker_weights.json`), retrained by `reports/recall/train_ranker.py`.

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
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from branchsearch.workers.rank import doc_of
from branchsearch.workers.text import norm_title, terms

WEIGHTS_PATH = Path(__file__).with_name("ranker_weights.json")

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
)


def episode_features(policy) -> dict[str, list[float]]:
    """Feature vectors (in `FEATURES` order) of every chunk a `HeuristicPolicy` scored, read
    from its state at the end of an episode."""
    scores = policy.scores
    if not scores:
        return {}
    order = sorted(scores, key=lambda c: (-scores[c], c))
    place = {cid: i for i, cid in enumerate(order, start=1)}
    best = max(scores.values()) or 1.0
    q_ents = [e.lower() for e in policy.q_entities]
    bridge_ents = [e for e, (src, _) in policy.links.items() if src]
    texts = {cid: f"{c.title} {c.text}".lower() for cid, c in policy.chunks.items()
             if cid in scores}
    children = Counter(o.parent for cid, o in policy.origins.items() if o.parent and cid in scores)
    per_doc = Counter(doc_of(cid) for cid in scores)
    out = {}
    from branchsearch.workers.heuristic import _names  # the policy's own title matcher

    for cid in scores:
        chunk, origin = policy.chunks[cid], policy.origins[cid]
        words = policy._terms_of(cid, f"{chunk.title} {chunk.text}")
        q = policy.q_terms
        title_terms = terms(norm_title(chunk.title))
        core = norm_title(chunk.title)
        mentioned = sum(1 for other, text in texts.items()
                        if doc_of(other) != chunk.doc_id and len(core) > 3 and core in text)
        text = texts[cid]
        question = origin.kind == "question"
        out[cid] = [
            scores[cid],
            scores[cid] / best,
            1.0 / place[cid],
            1.0 / (1.0 + policy.rank_decay * (origin.rank - 1)) if question else 0.0,
            float(origin.kind == "entity"),
            float(origin.kind == "bridge"),
            1.0 / max(origin.rank, 1),
            len(q & words) / max(len(q), 1),
            len(title_terms & q) / max(len(title_terms), 1),
            float(bool(title_terms) and title_terms <= q),
            max((_names(chunk.title, e) for e in q_ents), default=0.0),
            max((_names(chunk.title, e) for e in bridge_ents), default=0.0),
            math.log1p(mentioned),
            sum(e in text for e in q_ents) / max(len(q_ents), 1),
            _residual(policy, cid, words),
            policy._qualifier_agreement(cid),
            float(policy.depth.get(cid, 0)),
            1.0 - 1.0 / (1 + children[cid]),
            scores.get(origin.parent, 0.0) if origin.parent else 0.0,
            float(cid in policy.expanded),
            float(cid in policy.pruned),
            float(cid.endswith("#p0")),
            math.log(per_doc[doc_of(cid)]),
        ]
    return out


def _residual(policy, cid: str, words: set[str]) -> float:
    parent = policy.origins[cid].parent
    if parent not in policy.chunks:
        return 0.0
    p = policy.chunks[parent]
    left = policy.q_terms - policy._terms_of(parent, f"{p.title} {p.text}")
    return len(left & words) / max(len(left), 1)


@dataclass(frozen=True)
class LinearRanker:
    """score = sum_i w_i (x_i - mean_i) / scale_i over the features named in `features`."""

    features: tuple[str, ...]
    weights: tuple[float, ...]
    mean: tuple[float, ...]
    scale: tuple[float, ...]
    meta: dict

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


@lru_cache(maxsize=4)
def load_ranker(path: str | None = None) -> LinearRanker:
    """The shipped ranker (or the one at `path`)."""
    return LinearRanker.from_json(json.loads(Path(path or WEIGHTS_PATH).read_text()))
