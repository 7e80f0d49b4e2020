"""Tool-call argument checks: the fast path never lets through what jsonschema refuses, and
the calls policies really make take it; token counts are the same with and without a cache."""

import itertools

import jsonschema

from branchsearch.infra.models.tokenizer import TokenCounter
from branchsearch.workers.policy import ToolCall
from branchsearch.workers.tools import TOOLS, Rejected, _surely_fits, fit_query, validate_args

VALUES = [None, True, False, 0, 1, -1, 3, 3.0, 2.5, 10 ** 6, "", "x", "café", "a" * 600,
          [], ["c1"], ["c1", 2], ["c"] * 201, [["c"]], {}, {"a": 1}]
KEYS = ["query", "k", "mode", "named", "from_ids", "pattern", "doc_id", "start", "count",
        "ids", "reason", "chunk_ids", "extra"]


GOOD = {"query": "q", "pattern": "p", "doc_id": "d", "ids": ["c"], "reason": "r",
        "chunk_ids": ["c"]}


def _cases():
    """Every tool with one of its keys (or a stranger) set to each value kind, alone and on
    top of its required arguments, plus the right enum values."""
    for name, tool in TOOLS.items():
        base = {k: GOOD[k] for k in tool.parameters["required"]}
        yield name, {}
        yield name, base
        for key, value in itertools.product(KEYS, VALUES + ["hybrid", "bm25", "HYBRID"]):
            yield name, {key: value}
            yield name, {**base, key: value}


def test_the_fast_path_never_accepts_what_jsonschema_refuses():
    accepted = refused = 0
    for name, args in _cases():
        schema = TOOLS[name].parameters
        valid = jsonschema.Draft7Validator(schema).is_valid(args)
        if _surely_fits(schema, args):
            assert valid, (name, args)
            accepted += 1
        elif not valid:
            refused += 1
            try:
                validate_args(ToolCall(name, args))
            except Rejected as exc:
                assert str(exc).startswith(f"{name}: invalid ")
            else:
                raise AssertionError(f"{name} {args} passed validate_args")
    assert accepted > 60 and refused > 1000  # both paths were exercised


def test_the_calls_policies_make_take_the_fast_path():
    calls = [("search_corpus", {"query": "Kiss and Tell 1945", "k": 8, "mode": "hybrid",
                                "named": True, "from_ids": ["d#p0"]}),
             ("grep_corpus", {"pattern": "19[0-9]{2}", "k": 5}),
             ("read_document", {"doc_id": "Zürich", "start": 0, "count": 3}),
             ("prune_chunks", {"ids": ["a#p0", "b#p1"], "reason": "off topic"}),
             ("recall_chunks", {"ids": ["a#p0"]}),
             ("finish", {"ids": [], "reason": "done"})]
    for name, args in calls:
        assert _surely_fits(TOOLS[name].parameters, args), name


def test_a_cached_counter_counts_and_cuts_as_an_uncached_one():
    plain, cached = TokenCounter("o200k_base"), TokenCounter("o200k_base", cache_size=4)
    texts = ["Kiss and Tell is a 1945 film.", "Zürich — Ελληνικά 日本語 text", "", "a " * 300]
    for text in texts * 3:  # the second and third rounds come from the cache (and evict)
        assert cached.count(text) == plain.count(text)
        assert cached.encode(text) == plain.encode(text)
        for cap in (0, 1, 5, 1000):
            assert cached.cut(text, cap) == plain.cut(text, cap)
            assert cached.truncate(text, cap) == plain.truncate(text, cap)


def test_a_cut_text_ends_at_a_whole_character_never_u_fffd():
    """A token may hold part of a Han character, a Thai letter or an emoji: a text cut to n
    tokens (a snippet the agent reads and a caller is shown, a sub-query) ends before a
    character its last token holds only part of, never with U+FFFD in its place."""
    counter = TokenCounter("o200k_base")
    texts = ["東京都の北区にある図書館の蔵書目録は" * 6, "ภาษาไทยไม่มีการเว้นวรรคระหว่างคำ" * 4,
             "🦜🦩🪿🐦‍🔥" * 12]
    for text in texts:
        for cap in range(1, 40):
            cut, _, _ = counter.cut(text, cap)
            short = counter.truncate(text, cap)
            query, _ = fit_query(text, counter, cap)
            for piece in (cut, short):
                assert "\ufffd" not in piece and text.startswith(piece.removesuffix("…"))
            assert "\ufffd" not in query and text.startswith(query)
