"""The result of a question, and fusing branch rankings into its evidence."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache

from branchsearch.fusion.admission import admit
from branchsearch.fusion.documents import fuse_documents
from branchsearch.workers.branch import BranchReport
from branchsearch.workers.rank import doc_of

__all__ = ["BranchReport", "SearchResult", "fuse_branches", "evidence_texts", "meaning_only",
           "result_status"]

# a document only second-wave branches found enters the fused top only when one of the anchor's
# first LINK_HEAD documents names it (`fusion.admission`, `named_in`)
LINK_HEAD = 3
SECOND_WAVE = ("bridge", "chain", "fork")  # the kinds of branch that follow the first wave

# An empty answer, the same whether nothing matched or only documents the caller may not see
# did: saying which would tell a caller that hidden documents match its words
NOTHING_VISIBLE = "no document this search may see matched"
MEANING_ONLY = ("matched by meaning only: no document returned shares a word with the question "
                "(weak evidence unless the question is a paraphrase)")


def result_status(branch_statuses: Iterable[str]) -> str:
    """The one rule: ok (every branch ok) | partial (some failed; evidence from the rest) |
    failed (none ok, or no branch)."""
    statuses = list(branch_statuses)
    ok = sum(s == "ok" for s in statuses)
    return "ok" if ok and ok == len(statuses) else "partial" if ok else "failed"


@dataclass
class SearchResult:
    question: str
    evidence: list[dict]  # documents in order of their best chunk, each with its chunks
    ranked_chunk_ids: list[str]
    branches: list[BranchReport]
    metrics: dict
    trace_id: str
    notes: list[str] = field(default_factory=list)  # question cut; no or weak evidence
    # planned branches left out because the question's branch covers them (`orchestrator.cover`):
    # each {branch, subquery, by: the covering titles, ids: their chunks}, as its `covered` event
    covered: list[dict] = field(default_factory=list)

    @property
    def status(self) -> str:
        return result_status(b.status for b in self.branches)

    def to_dict(self, full: bool = False) -> dict:
        return {"question": self.question, "status": self.status, "notes": self.notes,
                "evidence": self.evidence, "ranked_chunk_ids": self.ranked_chunk_ids,
                "branches": [b.to_dict(full) | {"trace_id": self.trace_id}
                             for b in self.branches],
                "covered": self.covered, "metrics": self.metrics, "trace_id": self.trace_id}


def meaning_only(question: str, texts: Iterable[str]) -> bool:
    """True when `texts` (the titles and chunk texts returned) are some and none shares a
    word with the question: a dense search always returns its nearest neighbours, so a
    question of invented words gets ten documents that look like a result. Words are compared
    loosely, so that what a lexical search matched is never called meaning only: accents and
    case folded, split at every non-word character ('Hork-Bajir' is two words), stopwords
    aside, and two words of 5+ letters that begin alike count as one ('directing',
    'directed'). A question in a script whose words are not set apart (Chinese, Japanese,
    Thai; Hangul's take attached particles) is not judged: its words cannot be told apart."""
    from branchsearch.workers.text import PREFIX, unspaced, words

    asked = words(question)
    if not asked or unspaced(question):
        return False
    texts = list(texts)
    if not texts:
        return False
    stems = {w[:PREFIX] for w in asked if len(w) >= PREFIX}
    for text in texts:
        found = words(text)
        if asked & found or stems & {w[:PREFIX] for w in found if len(w) >= PREFIX}:
            return False
    return True


def named_in(text: str, title: str) -> bool:
    """Whether `text` writes the document title `title`, case and Unicode form aside: the title
    without a trailing parenthetical ('Lake District (film)' -> 'lake district'), as whole
    words and at least 4 characters, so that a short title is not found inside any text — or,
    in a script that does not set words apart (大阪, 東京タワー), anywhere, from 2 characters."""
    from branchsearch.workers.text import has_phrase, unspaced

    # (not `workers.text.bare_title`, which also cuts at a comma: the rule was measured so)
    name = _named(re.sub(r"\s*\([^()]*\)\s*$", "", title)).strip()
    if unspaced(name):
        return len(name) >= 2 and name in _named(text)
    return len(name) >= 4 and has_phrase(_named(text), name)


@lru_cache(maxsize=256)
def _named(text: str) -> str:  # (cached: one head text is asked about every fresh document)
    return unicodedata.normalize("NFC", text).casefold()


def evidence_texts(evidence: list[dict]) -> list[str]:
    return [text for doc in evidence
            for text in [doc.get("title", "")] + [c.get("text", "") for c in doc["chunks"]]]


def _linked(ok: list[BranchReport], doc, chunks: dict, admitted) -> dict[int, str]:
    """For each bridge of a bridge (a branch of kind "bridge" whose parent is a bridge) whose
    parent's first document is `admitted`: the text of that parent's first `LINK_HEAD`
    documents, which admits what the bridge of it found (the hop after, named by the hop
    before). Keyed by the branch's place in `ok`."""
    at = {b.index: li for li, b in enumerate(ok)}
    out: dict[int, str] = {}
    for li, b in enumerate(ok):
        p = at.get(b.parent) if b.kind == "bridge" and b.parent is not None else None
        if p is None or ok[p].kind != "bridge":
            continue
        docs, text = _head(ok[p], doc, chunks)
        if docs and admitted(docs[0]):
            out[li] = text
    return out


def _head(branch: BranchReport, doc, chunks: dict) -> tuple[list[str], str]:
    """A branch's documents in its order, and the text of its chunks of the first
    `LINK_HEAD` of them (what admission reads for names)."""
    docs = list(dict.fromkeys(doc(c) for c in branch.ranked_chunk_ids))
    head = set(docs[:LINK_HEAD])
    return docs, " ".join(chunks.get(c, {}).get("text", "") for c in branch.ranked_chunk_ids
                          if doc(c) in head)


def fuse_branches(branches: list[BranchReport], k: int = 60,
                  limit: int = 10) -> tuple[list[str], list[dict]]:
    """Anchored RRF over the *document* rankings of the branches that finished
    (`fusion.documents`: a document's place in a branch is its first chunk's, so branches that
    return different chunks of one document agree on it; weights from the planner; the
    question's own branch anchors, the others add). A document that only second-wave branches
    (bridges, chains, forks) found keeps a place in the first `limit` only when the text of the
    anchor's first `LINK_HEAD` documents names its title (`fusion.admission`, `named_in`). The
    ranking lists each document's best chunk in fused order, then the documents' other chunks,
    as `workers.rank.final_ranking` does.

    Returns the fused chunk ids (at most `limit`) and the evidence: documents in fused order,
    each with its fused score and the branches that found it (its place in each), and its
    chunks (as the branches returned them: `workers.evidence`), each with which branches
    returned that chunk at what rank, and its provenance: the records of every branch that
    returned it, in branch order, each naming its `branch` (not one branch's, unnamed). This
    is the only place chunks are grouped by document."""
    ok = [b for b in branches if b.status == "ok" and b.ranked_chunk_ids]
    anchor = next((i for i, b in enumerate(ok) if b.kind == "original"), None)
    chunks = {c["chunk_id"]: c for b in ok for c in b.evidence}
    trails: dict[str, list[dict]] = {}  # chunk -> every branch's provenance of it, in order
    for b in ok:
        for c in b.evidence:
            trails.setdefault(c["chunk_id"], []).extend(
                {"branch": b.index, **p} for p in c.get("provenance") or [])

    def doc(chunk_id: str) -> str:
        return chunks.get(chunk_id, {}).get("doc_id") or doc_of(chunk_id)

    found: dict[str, list[tuple[int, int]]] = {}  # chunk -> (branch, rank), branch order
    for li, b in enumerate(ok):
        for rank, cid in enumerate(b.ranked_chunk_ids, start=1):
            if not any(i == li for i, _ in found.get(cid, ())):  # a repeat: its first place
                found.setdefault(cid, []).append((li, rank))
    fused, of_doc = fuse_documents([b.ranked_chunk_ids for b in ok], doc,
                                   weights=[b.weight for b in ok], anchor=anchor, k=k)
    if anchor is not None and len(ok) > 1:
        own, text = _head(ok[anchor], doc, chunks)
        titles = {doc(cid): c.get("title", "") for cid, c in reversed(chunks.items())}
        first = {d.id for d in fused if any(ok[li].kind not in SECOND_WAVE for li in d.ranks)}
        own_top = set(own[:limit])

        def named(d: str) -> bool:
            return d in own_top or d in first or named_in(text, titles.get(d, ""))

        linked = _linked(ok, doc, chunks, named)
        ranks = {d.id: d.ranks for d in fused}
        fused = admit(fused, own_top, lambda d: named(d) or any(
            named_in(linked[li], titles.get(d, "")) for li in ranks[d] if li in linked),
            window=limit)
    ranked = ([of_doc[d.id][0] for d in fused] +
              [c for d in fused for c in of_doc[d.id][1:]])[:limit]
    by_id = {d.id: d for d in fused}

    def finders(places) -> list[dict]:
        return [{"branch": ok[li].index, "subquery": ok[li].subquery, "rank": r}
                for li, r in sorted(places)]

    docs: dict[str, dict] = {}
    for rank, cid in enumerate(ranked, start=1):
        chunk, doc_id = chunks.get(cid, {}), doc(cid)
        # the document's score and the branches it came from (its place in each): the chunks'
        # own found_by say which branch returned that chunk
        entry = docs.setdefault(doc_id, {"doc_id": doc_id, "title": chunk.get("title", ""),
                                         "score": round(by_id[doc_id].score, 6),
                                         "found_by": finders(by_id[doc_id].ranks.items()),
                                         "chunks": []})
        entry["chunks"].append({
            "chunk_id": cid, "rank": rank, "score": entry["score"],
            "text": chunk.get("text", ""), "provenance": trails.get(cid, []),
            "found_by": finders(found[cid])})
    return ranked, list(docs.values())
