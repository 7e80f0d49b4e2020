"""Chains: plan the hops of a compositional question and take competing answers of a hop in
parallel (issue 34).

A compositional question nests one question inside another: "What is the name of the waterfall
in *the country* where the Bubye River is found?" asks about the country that the inner clause
("the Bubye River is found") picks out. `hops` splits it (pure): the **inner hop** is the last
relative clause with two or more content words (from its marker to the question's end), the
**outer hop** the text before that marker, and its **slot** the outer's last noun phrase ("the
country"). With `settings.chains = N > 0` and more than one branch the driver

1. adds the inner hop as a branch of the first wave (kind "hop", weight `HOP_WEIGHT`) when the
   planner left room under the question's branch budget;
2. once the first wave has ended, takes the inner branch's top N distinct document titles that
   the inner clause does not itself name (`answers`) — the hop's competing answers — and runs
   one branch each in a second wave (kind "chain", weight `CHAIN_WEIGHT`), its sub-query the
   outer hop with the slot replaced by that answer (`substitute`: "What is the name of the
   waterfall in Zimbabwe");
3. fuses every list by the same anchored RRF (the question's branch anchors).

Where one context has to guess which answer of the inner hop is right, the chain branches
follow each guess in their own context. `--branches 1` runs no chain. Bounds: N chain branches
and one hop branch a question, depth 1 (a chain branch does not chain again).

**Bridges** are next hops found in the text instead: a question's answer is often one hop past
an entity that its branch's top chunk names but no title does ("Big Eyes ... directed by Tim
Burton" for "Who is the spouse of Big Eye's main director?"). With `settings.bridges = N > 0`
and more than one branch, the second wave also runs one branch (kind "bridge") for each of the N
entities of that chunk nearest a word of the question (`bridges`), its sub-query the entity and
the question's words the chunk lacks ("Tim Burton spouse"). They are traced and streamed as
chains are (a `chain` span and event; the reason "bridge = Tim Burton").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from branchsearch.orchestrator.plan import _RELATIVE, _residual
from branchsearch.workers.branch import BranchReport, BranchTask
from branchsearch.workers.text import PREFIX, entities, sentences, too_short, unspaced

HOP_WEIGHT = 0.5  # the inner hop's branch in fusion
CHAIN_WEIGHT = 0.5  # each second-hop branch in fusion
_WORDS = re.compile(r"[\w'-]+")
_SLOT = re.compile(r"\b(?:the|a|an)\s+(?:[\w'-]+\s+){0,2}[\w'-]+\s*$", re.I)


@dataclass(frozen=True)
class Hops:
    outer: str  # the question before the inner hop's marker ("What is ... in the country")
    slot: str  # the outer's last noun phrase, which the inner hop answers ("the country")
    inner: str  # the inner hop's content terms ("Bubye River found")

    def to_dict(self) -> dict:
        return {"outer": self.outer, "slot": self.slot, "inner": self.inner}


def hops(question: str) -> Hops | None:
    """The question's innermost hop and the outer hop around it; None when the question has no
    relative clause of two or more content words, or nothing before it to substitute into."""
    q = " ".join(question.split()).strip(" ?")
    marks = list(_RELATIVE.finditer(q))
    for i in range(len(marks) - 1, -1, -1):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(q)
        if len(_residual(q[marks[i].end():end], []).split()) < 2:
            continue
        outer = q[:marks[i].start()].rstrip(" ,")
        slot = _SLOT.search(outer)
        if slot is None or not _residual(outer[:slot.start()], []):
            return None
        return Hops(outer, slot.group(0).strip(), _residual(q[marks[i].end():], []))
    return None


def substitute(chain: Hops, answer: str) -> str:
    """The outer hop with its slot replaced by a candidate answer of the inner hop."""
    answer = " ".join(answer.split())
    if not answer:
        raise ValueError("substitute: empty answer")
    return chain.outer[:len(chain.outer) - len(chain.slot)] + answer


def _core(title: str) -> str:
    return " ".join(re.sub(r"\([^)]*\)", " ", title).lower().split())


def answers(report: BranchReport, chain: Hops, n: int) -> list[str]:
    """The inner branch's candidate answers: the titles of its ranked documents in order
    (the document id when it has no title), distinct, leaving out those the inner clause
    names; at most `n`."""
    titles = {c["chunk_id"]: c.get("title") or c.get("doc_id") or "" for c in report.evidence}
    named = chain.inner.lower()
    out: list[str] = []
    for cid in report.ranked_chunk_ids:
        title = titles.get(cid) or cid.rsplit("#p", 1)[0]
        core = _core(title)
        if core and core not in named and core not in (_core(t) for t in out):
            out.append(title)
        if len(out) >= n:
            break
    return out


def chain_tasks(reports: list[BranchReport], chain: Hops, n: int, *,
                deadline: float | None = None,
                acl_groups: tuple[str, ...] | None = None,
                first: int | None = None) -> list[BranchTask]:
    """The second wave: one branch per candidate answer of the inner hop's branch (kind
    "hop", finished ok), numbered from `first` (default: after the reports' branches); []
    when there is none."""
    inner = next((r for r in reports if r.kind == "hop" and r.status == "ok"), None)
    if inner is None or n <= 0:
        return []
    first = max(r.index for r in reports) + 1 if first is None else first
    return [BranchTask(first + i, substitute(chain, a), CHAIN_WEIGHT, "chain", acl_groups,
                       deadline, parent=inner.index, reason=f"{chain.slot} = {a}")
            for i, a in enumerate(answers(inner, chain, n))]


BRIDGE_WEIGHT = 0.5  # each bridge branch in fusion
# A bridge of a bridge fetches the page its parent's top chunk names: one hop, its own search
# ranked, nothing expanded (reports/bridges.md, "v12")
DEEPER_HOPS = 1


def bridges(report: BranchReport, question: str, n: int, *, skip: tuple[str, ...] = (),
            before: str = "") -> list[tuple[str, str]]:
    """The next hops a branch's top chunk points to: (entity, sub-query) for at most `n`
    entities the chunk's text names and the question does not, nearest first to a word of the
    question that the chunk's title lacks ("directed by Tim Burton" for "Big Eye's main
    director"). The sub-query is the entity and the question's words the chunk does not hold
    (what is left to find: "Tim Burton spouse"). A bridge of a bridge passes `skip`, the
    entities already taken, and `before`, the top chunk of the hop before: an entity it names is
    not next, and its words are not left to find.

    In a script without spaces (Chinese, Japanese) the chunk's names are the ones it marks
    (《论语》, 「東京」: `entities`), 2 characters are a name (`too_short`), and a "word" of
    `_WORDS` is a whole run between punctuation, which a question's run seldom matches: then
    no word is near, the names come in the order the chunk writes them, and the sub-query
    keeps the question's runs ("论语 孔子的弟子编成的书有多少篇"). Nothing is segmented."""
    top = _top(report)
    if top is None or n <= 0:
        return []
    title, text = top.get("title") or "", top.get("text") or ""
    stems = [w.lower()[:PREFIX] for w in _WORDS.findall(text)]
    titled = {w.lower()[:PREFIX] for w in _WORDS.findall(title)}
    asked = _residual(question, []).split()
    cues = {w.lower()[:PREFIX] for w in asked} - titled
    near = [i for i, s in enumerate(stems) if s in cues]  # where the text answers the question
    q, core = question.lower(), _core(title)
    found: list[tuple[int, int, str]] = []
    named = (e for sentence in sentences(text) for e in entities(sentence, context=text))
    for name in dict.fromkeys(named):
        low = name.lower()
        if too_short(name, 4) or _calendar(name) or low in q \
                or (core and (_within(low, core) or _within(core, low))) \
                or any(_same_entity(name, other) for other in skip) or _said(low, before):
            continue
        at = text.find(name)
        at = len(_WORDS.findall(text[:at])) if at >= 0 else len(stems)
        found.append((min((abs(i - at) for i in near), default=0), at, name))
    held = set(stems) | titled | {w.lower()[:PREFIX] for w in _WORDS.findall(before)}
    left = [w for w in asked if w.lower()[:PREFIX] not in held]
    taken: list[str] = []
    for _, _, name in sorted(found):
        if len(taken) >= n:
            break
        if not any(_same_entity(name, other) for other in taken):
            taken.append(name)
    return [(name, " ".join([name] + left)) for name in taken]


def _said(low: str, text: str) -> bool:
    """Whether `text` writes the (lower-cased) name `low`: as whole words, or — in a script that
    does not set words apart (《论语》 in '孔子的论语') — anywhere."""
    text = text.lower()
    return low in text if unspaced(low) else re.search(rf"\b{re.escape(low)}\b", text) is not None


def _within(low: str, text: str) -> bool:
    """Whether `text` holds the (lower-cased) name `low` as whole words: not a piece of a longer
    word ("wilm" is not in "wilmington"), a name ending in punctuation included ("made of?");
    in a script that does not set words apart, anywhere."""
    if unspaced(low):
        return low in text
    return re.search(rf"(?<!\w){re.escape(low)}(?!\w)", text) is not None


_CALENDAR = frozenset("january february march april may june july august september october "
                      "november december monday tuesday wednesday thursday friday saturday "
                      "sunday".split())


def _calendar(name: str) -> bool:
    """A date, not a next hop: a name of calendar words and numbers only ("April", "16 July",
    "April 1992", "Monday"; reports/bridges.md, "v13")."""
    words = [w.strip(".,").lower() for w in name.split()]
    return any(w in _CALENDAR for w in words) and all(w in _CALENDAR or w.isdigit()
                                                      for w in words)


def _same_entity(a: str, b: str) -> bool:
    """Two names of one entity: equal, or one inside the other at word boundaries, once
    case, a leading article and trailing punctuation are set aside ("The Exorcism of Emily
    Rose" and "Exorcism of Emily Rose", "Lake District" and "English Lake District")."""
    def key(name: str) -> str:
        words = name.casefold().strip(" .,;:!?").split()
        return " ".join(words[1:] if len(words) > 1 and words[0] in ("the", "a", "an")
                        else words)

    a, b = key(a), key(b)
    return a == b or f" {a} " in f" {b} " or f" {b} " in f" {a} "


def bridge_tasks(reports: list[BranchReport], question: str, n: int, *,
                 deadline: float | None = None, acl_groups: tuple[str, ...] | None = None,
                 first: int) -> list[BranchTask]:
    """The second wave of bridges: one branch per next hop the question's branch (kind
    "original", finished ok) points to (`bridges`), numbered from `first`."""
    own = next((r for r in reports if r.kind == "original" and r.status == "ok"), None)
    if own is None:
        return []
    return [BranchTask(first + i, sub, BRIDGE_WEIGHT, "bridge", acl_groups, deadline,
                       parent=own.index, reason=f"bridge = {name}")
            for i, (name, sub) in enumerate(bridges(own, question, n))]


def deeper_bridge_tasks(reports: list[BranchReport], question: str, *,
                        deadline: float | None = None,
                        acl_groups: tuple[str, ...] | None = None,
                        first: int, room: int,
                        wave: tuple[int, ...] | None = None) -> list[BranchTask]:
    """A later wave of bridges: one bridge of each bridge of the wave before that finished ok
    (in order), from that bridge's top chunk, skipping the entities any bridge took and those
    the question's branch's top chunk names; at most `room`, numbered from `first`. `wave`:
    the branch numbers of the wave before (bridge_depth 3 passes the bridges of bridges); by
    default the second wave, the bridges of the question's branch."""
    own = next((r for r in reports if r.kind == "original" and r.status == "ok"), None)
    if own is None or room <= 0:
        return []
    before = _top_text(own)
    taken = [r.reason.split(" = ", 1)[1] for r in reports
             if r.kind == "bridge" and r.reason.startswith("bridge = ")]
    out: list[BranchTask] = []
    for parent in (r for r in reports if r.kind == "bridge" and r.status == "ok"
                   and (r.parent == own.index if wave is None else r.index in wave)):
        if len(out) >= room:
            break
        for name, sub in bridges(parent, question, 1, skip=tuple(taken),
                                 before=before):
            taken.append(name)
            out.append(BranchTask(first + len(out), sub, BRIDGE_WEIGHT, "bridge", acl_groups,
                                  deadline, parent=parent.index, reason=f"bridge = {name}",
                                  hops=DEEPER_HOPS))
    return out


def _top(report: BranchReport) -> dict | None:
    """The branch's top-ranked chunk (its evidence entry), or None."""
    return next((c for c in report.evidence if c.get("chunk_id") in report.ranked_chunk_ids[:1]),
                None)


def _top_text(report: BranchReport) -> str:
    top = _top(report)
    return "" if top is None else f"{top.get('title') or ''} {top.get('text') or ''}"
