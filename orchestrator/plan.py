"""Planning: decompose a question into weighted sub-queries, one branch each.

`HeuristicPlanner` keeps the original question as the first branch (weight 1.0). The other
branches are chosen by a *rule* from the candidate sub-queries `candidates(question)` lists:

* comparison: "X or Y", "X and Y ... same/both/older/first" -> one per compared entity, carrying
  the question's remaining terms (weight 0.8);
* clause: conjunctions of clauses ("... and which ...", "...; ...") -> one per clause (0.7);
* entity / entity_last: when the question names two or more entities, the first (last) of them
  with the question's content terms, the other names left out (0.5);
* residual: the question's content terms with every name left out (0.5);
* relative: one per relative clause ("the state *where* X lived", "the person *under whom* ..."),
  its content terms (0.5).

Rule "v2" (the default): comparison, else clause; a question that compares nothing and joins
no clauses is searched by its own branch alone. Rule "v1" adds, for the rest, an entity branch
when the question names two or more entities: the question's branch already searches every
entity the question names and follows their bridges, so entity branches find nothing it misses
(measured in reports/recall/README.md). "kinds:a,b": the candidates of kind a, then of kind b (for offline comparisons).
"candidates": every candidate. Duplicates are dropped and the count is bounded by
`max_branches` and by the question itself. `select` is the rule as a pure function of the
candidates, so an offline dump of every candidate branch (reports/recall/branch_eval.py `run
--rule candidates`) simulates any rule exactly (branches are independent and deterministic).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from branchsearch.workers.text import STOPWORDS, entities


@dataclass(frozen=True)
class SubQuery:
    text: str
    weight: float = 1.0
    kind: str = "original"  # original | comparison | clause | entity | entity_last | residual
    #                         | relative | llm
    names: tuple[str, ...] = ()  # the entities it is about (`orchestrator.cover`)

    def to_dict(self) -> dict:
        return {"text": self.text, "weight": self.weight, "kind": self.kind,
                "names": list(self.names)}


_COMPARE = re.compile(r"\b(same|both|older|younger|first|earlier|later|larger|smaller|longer|"
                      r"shorter|more|less|higher|lower|bigger|taller|either|neither|which one)\b",
                      re.I)
_CLAUSE = re.compile(r"\s*(?:;|,?\s+and\s+(?=(?:what|which|who|where|when|how)\b))\s*", re.I)
_RELATIVE = re.compile(r"\s*,?\s+(?:(?:in|at|on|under|by|from|with|for|to|of|during)\s+)?"
                       r"(?:which|whom|whose|where|who|that|when)\s+", re.I)

RULES = ("v2", "v1", "candidates")  # and "kinds:<kind>,<kind>,..." of KINDS
KINDS = ("comparison", "clause", "entity", "entity_last", "residual", "relative")


def _residual(question: str, remove: list[str]) -> str:
    text = question
    for r in remove:
        text = re.sub(re.escape(r), " ", text, flags=re.I)
    words = [w for w in re.findall(r"[\w'-]+", text) if w.lower() not in STOPWORDS]
    return " ".join(words)


def _names(question: str) -> list[str]:
    """The entities the question names (longer than 3 characters), none inside another."""
    found = [e for e in entities(question) if len(e) > 3]
    return [e for e in found if not any(e != o and e.lower() in o.lower() for o in found)]


def comparison(question: str) -> list[SubQuery]:
    names = [e for e in entities(question) if " and " not in e]
    if len(names) < 2 or not (_COMPARE.search(question) or " or " in question):
        return []
    rest = _residual(question, names)
    return [SubQuery(f"{name} {rest}".strip(), 0.8, "comparison", (name,))
            for name in names[:4]]


def clauses(question: str) -> list[SubQuery]:
    parts = [p.strip(" ?") for p in _CLAUSE.split(question) if len(p.split()) >= 4]
    if len(parts) < 2:
        return []
    return [SubQuery(p, 0.7, "clause", tuple(_names(p))) for p in parts]


def entity_branches(question: str) -> list[SubQuery]:
    """The first and the last named entity, each with the question's content terms (the other
    names left out); only when the question names two or more (a lone entity branch restates
    the question, whose own branch already searches every entity it names)."""
    names = _names(question)
    if len(names) < 2:
        return []
    rest = _residual(question, names)
    return [SubQuery(f"{names[0]} {rest}".strip(), 0.5, "entity", (names[0],)),
            SubQuery(f"{names[-1]} {rest}".strip(), 0.5, "entity_last", (names[-1],))]


def residual(question: str) -> list[SubQuery]:
    """The question's content terms without the names it gives (what it asks *about* them)."""
    names = _names(question)
    rest = _residual(question, names)
    return [SubQuery(rest, 0.5, "residual")] if names and len(rest.split()) >= 3 else []


def relative(question: str) -> list[SubQuery]:
    """One sub-query per relative clause, when the question has two or more."""
    parts = [_residual(p, []) for p in _RELATIVE.split(question.strip(" ?"))]
    parts = [p for p in parts if len(p.split()) >= 2]
    if len(parts) < 2:
        return []
    return [SubQuery(p, 0.5, "relative") for p in parts]


def candidates(question: str) -> list[SubQuery]:
    """The original question first, then every candidate sub-query, de-duplicated."""
    question = " ".join(question.split())
    subs = [SubQuery(question, 1.0, "original")]
    subs += comparison(question) + clauses(question) + entity_branches(question)
    subs += residual(question) + relative(question)
    return _dedup(subs)


def select(cands: list[SubQuery], rule: str, max_branches: int) -> list[SubQuery]:
    """The branches a rule launches from `candidates(question)` (original first)."""
    original, rest = cands[:1], cands[1:]
    by = {k: [s for s in rest if s.kind == k] for k in {s.kind for s in rest}}
    chosen: list[SubQuery]
    if rule == "candidates":
        chosen = rest
    elif rule == "v2":
        chosen = by.get("comparison") or by.get("clause", [])
    elif rule == "v1":
        chosen = by.get("comparison") or by.get("clause") or by.get("entity", [])
    elif rule.startswith("kinds:"):
        wanted = [kind.strip() for kind in rule[6:].split(",")]
        unknown = [kind for kind in wanted if kind not in KINDS]
        if unknown:
            raise ValueError(f"unknown sub-query kind {unknown[0]!r} in planner rule {rule!r} "
                             f"(kinds: {', '.join(KINDS)})")
        chosen = [s for kind in wanted for s in by.get(kind, [])]
    else:
        raise ValueError(f"unknown planner rule {rule!r} (one of {', '.join(RULES)}, "
                         "kinds:<kind>,...)")
    return _dedup(original + chosen)[:max_branches]


def _dedup(subs: list[SubQuery]) -> list[SubQuery]:
    seen, out = set(), []
    for sub in subs:
        key = sub.text.lower()
        if key and key not in seen:
            seen.add(key)
            out.append(sub)
    return out


class HeuristicPlanner:
    def __init__(self, rule: str = "v2"):
        select([SubQuery("q")], rule, 1)  # an unknown rule fails here, not at the first search
        self.rule = rule

    def plan(self, question: str, max_branches: int = 3) -> list[SubQuery]:
        return select(candidates(question), self.rule, max_branches)


PLAN_PROMPT = """Split the question into at most {n} search sub-queries that together find all
the evidence needed (one per entity, hop or compared item). Keep each short. Weight each from
0 to 1 by importance. Answer only with JSON: {{"subqueries": [{{"text": ..., "weight": ...}}]}}.
Question: {question}"""


class LLMPlanner:
    """Decomposition by a model (structured output), falling back to the heuristic planner on
    any failure; `last_fallback` says why (the driver records it on the plan span)."""

    def __init__(self, engine, fallback: HeuristicPlanner | None = None):
        self.engine = engine
        self.fallback = fallback or HeuristicPlanner()
        self.last_fallback = ""

    def plan(self, question: str, max_branches: int = 3) -> list[SubQuery]:
        import json

        question = " ".join(question.split())
        self.last_fallback = ""
        if max_branches <= 1:
            return [SubQuery(question, 1.0, "original")]
        schema = {"type": "object", "required": ["subqueries"], "properties": {"subqueries": {
            "type": "array", "minItems": 1, "maxItems": max_branches - 1, "items": {
                "type": "object", "required": ["text", "weight"], "properties": {
                    "text": {"type": "string", "minLength": 3, "maxLength": 300},
                    "weight": {"type": "number", "minimum": 0, "maximum": 1}}}}}}
        try:
            raw = self.engine.chat([{"role": "user", "content": PLAN_PROMPT.format(
                n=max_branches - 1, question=question)}], schema=schema, max_tokens=200)
            items = json.loads(raw)["subqueries"]
            texts = [(" ".join(str(i.get("text", "")).split()), i) for i in items]
            subs = [SubQuery(question, 1.0, "original")] + [
                SubQuery(text, float(i["weight"]), "llm", tuple(_names(text)))
                for text, i in texts if text]
        except Exception as exc:  # the model, the endpoint or the JSON failed
            self.last_fallback = f"{type(exc).__name__}: {exc}"[:300]
            return self.fallback.plan(question, max_branches)
        seen, out = set(), []
        for sub in subs:
            if sub.text.lower() not in seen and sub.weight > 0:
                seen.add(sub.text.lower())
                out.append(sub)
        return out[:max_branches]
