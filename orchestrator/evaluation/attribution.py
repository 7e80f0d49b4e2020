"""Agent measures and failure attribution, from what the branches did. Pure functions.

Everything is at document level (qrels label documents). For one query:

* trajectory_recall   share of gold documents any branch ever retrieved
* precision / f1      of the final top-k documents against the gold set
* prune_accuracy      share of pruned chunks that were not gold (1.0 when nothing was pruned)
* bridge_preserved    all gold present at termination (final context or evidence), counted
                      only for queries whose gold was all retrieved at some point
* answer_found        the reference answer string appears in the final evidence text

Attribution (first that applies, in this order):

* ok               every gold document is in the final top k
* early_stop       a gold document was never retrieved, but a retrieved chunk names its title:
                   one more hop would have reached it
* retrieval_miss   a gold document was never retrieved, and nothing retrieved points to it
* premature_prune  a gold document was retrieved, then pruned and not recalled, so it was not
                   in the context at termination nor in the evidence
* overload         every gold document was present at termination, but ranked out of the top k
* not_in_corpus    the only gold documents the top k lacks are ones the corpus does not hold (a
                   qrels line naming a document corpus.jsonl lacks): the data's miss, which no
                   search can reach. It is the last class: a query that also missed gold the
                   corpus holds is attributed by that, and those documents alone are named.

Gold the corpus lacks (`absent`) is the data's miss, which no search can reach: the measures
above leave it out of their gold set, as the attribution sets it apart, and a query whose gold
the corpus wholly lacks has none of the gold-based ones (trajectory_recall, precision, f1,
bridge_preserved). Only the BEIR scores (`measures.single_shot_metrics`: recall, all-recall,
nDCG) count it missed, as BEIR's evaluate scores the qrels as given.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from branchsearch.infra.ingest.chunking import split_chunk_id

CLASSES = ("ok", "retrieval_miss", "premature_prune", "early_stop", "overload",
           "not_in_corpus")


def _doc(cid: str) -> str:
    return split_chunk_id(cid)[0]


@dataclass(frozen=True)
class Trajectory:
    """What the branches of one query did (union over branches)."""

    final_ranking: Sequence[str]  # fused chunk ids, best first
    retrieved: Sequence[str]  # every chunk id any branch fetched
    pruned: Sequence[str]  # chunk ids pruned (at any time)
    final_context: Sequence[str]  # chunk ids visible at termination
    evidence_text: str = ""


def agent_measures(t: Trajectory, gold: Mapping[str, int], k: int = 5, answer: str = "",
                   absent: Collection[str] = ()) -> dict[str, float]:
    """The measures of one query; `absent`: gold documents the corpus lacks, left out."""
    gold_docs = set(gold) - set(absent)
    pruned_docs = [_doc(c) for c in t.pruned]
    out = {"prune_accuracy": (sum(d not in gold_docs for d in pruned_docs) / len(pruned_docs)
                              if pruned_docs else 1.0)}
    if gold_docs:
        final_docs = list(dict.fromkeys(_doc(c) for c in t.final_ranking))[:k]
        ever = {_doc(c) for c in t.retrieved}
        present = {_doc(c) for c in t.final_context} | {_doc(c) for c in t.final_ranking}
        hit = len(gold_docs & set(final_docs))
        precision = hit / len(final_docs) if final_docs else 0.0
        recall = hit / len(gold_docs)
        out |= {"trajectory_recall": len(gold_docs & ever) / len(gold_docs),
                "precision": precision,
                "f1": 2 * precision * recall / (precision + recall) if precision + recall else 0.0}
        if gold_docs <= ever:
            out["bridge_preserved"] = float(gold_docs <= present)
    if answer:
        out["answer_found"] = float(answer_in(answer, t.evidence_text))
    return out


def answer_in(answer: str, text: str) -> bool:
    norm = lambda s: re.sub(r"\W+", " ", s.lower()).strip()  # noqa: E731
    a = norm(answer)
    return bool(a) and f" {a} " in f" {norm(text)} "


def attribute(t: Trajectory, gold: Mapping[str, int], titles: Mapping[str, str],
              retrieved_text: str, k: int = 5,
              absent: Collection[str] = ()) -> tuple[str, list[str]]:
    """(class, the gold documents behind it). `absent`: gold documents the corpus lacks."""
    final_docs = list(dict.fromkeys(_doc(c) for c in t.final_ranking))[:k]
    missing = [g for g in gold if g not in final_docs]
    if not missing:
        return "ok", []
    if all(g in absent for g in missing):
        return "not_in_corpus", missing
    missing = [g for g in missing if g not in absent]
    ever = {_doc(c) for c in t.retrieved}
    never = [g for g in missing if g not in ever]
    if never:
        text = f" {re.sub(r'[^a-z0-9]+', ' ', retrieved_text.lower())} "
        reachable = [g for g in never if _title_in(titles.get(g, ""), text)]
        return ("early_stop", reachable) if reachable else ("retrieval_miss", never)
    present = {_doc(c) for c in t.final_context} | {_doc(c) for c in t.final_ranking}
    lost = [g for g in missing if g not in present and g in {_doc(c) for c in t.pruned}]
    if lost:
        return "premature_prune", lost
    return "overload", missing


def _title_in(title: str, text: str) -> bool:
    core = re.sub(r"\s*\([^)]*\)\s*$", "", title).lower()
    core = re.sub(r"[^a-z0-9]+", " ", core).strip()
    return len(core) > 3 and f" {core} " in text
