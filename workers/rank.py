"""The final ranking of an episode: over everything the trajectory scored, not only what stayed
in the active context. Pure functions.

Pruning is about the *context* (what a policy keeps reading); it is not a verdict on the
evidence. A chunk pruned on turn 3 because eight others scored higher may, by the end, score
higher than any of them (its child confirmed it as a bridge). So the ranking a branch returns
is taken over every chunk it scored — kept, pruned or never expanded — by the score the policy
holds at the end, and documents are spread before a document's second chunk is repeated
(and, by `crowd`, a title's documents after its first few before other titles').
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from branchsearch.infra.stores.hits import doc_of


def final_ranking(scores: Mapping[str, float], limit: int,
                  doc: Callable[[str], str] = doc_of) -> list[str]:
    """Chunk ids, best first: the best chunk of each document in order of score, then the
    other chunks in order of score; at most `limit`.

    Ties: equal scores are ordered by chunk id, so the result never depends on dict order.
    Documents first because a reader (and every document-level measure) gains nothing from a
    second chunk of a document before the first chunk of another that scored almost as well.
    """
    ordered = sorted(scores, key=lambda cid: (-scores[cid], cid))
    firsts, rest, seen = [], [], set()
    for cid in ordered:
        d = doc(cid)
        (rest if d in seen else firsts).append(cid)
        seen.add(d)
    return (firsts + rest)[:limit]


def hold_back(ranked: list[str], late: set[str], head: int,
              doc: Callable[[str], str] = doc_of) -> list[str]:
    """`ranked` with the chunks of `late` moved below its first `head` documents that are not
    late; every other order kept. A late chunk competes for the places after the head, never
    for the head itself."""
    first, held, rest, docs = [], [], [], set()
    for cid in ranked:
        if len(docs) >= head:
            rest.append(cid)
        elif cid in late:
            held.append(cid)
        else:
            first.append(cid)
            docs.add(doc(cid))
    return first + held + rest


def crowd(ranked: list[str], title_of: Callable[[str], str], per_title: int,
          doc: Callable[[str], str] = doc_of) -> list[str]:
    """`ranked` with each title's documents after its first `per_title` moved below every
    document not crowded out (search engines' "host crowding"; order otherwise kept). Chunks of
    an article split into many documents under one title (a passage each) would otherwise fill
    the head with one article: `per_title` of them say what it holds, the next places go to other
    pages. Documents are placed by their first chunk in `ranked`, and every document's first
    chunk still comes before any document's second (`final_ranking`'s rule), so a cut at k keeps
    as many documents as it did. An empty title ('(untitled)' without its qualifier) is no
    title: such a document is never crowded."""
    kept, held, repeats, count, seen = [], [], [], {}, set()
    for cid in ranked:
        d = doc(cid)
        if d in seen:
            repeats.append(cid)
            continue
        seen.add(d)
        title = title_of(cid) or ("", d)  # no title: a group of its own
        count[title] = count.get(title, 0) + 1
        (kept if count[title] <= per_title else held).append(cid)
    return kept + held + repeats
