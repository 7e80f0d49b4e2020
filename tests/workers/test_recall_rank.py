"""The final ranking stage (workers/rank.py) and what the heuristic policy returns with it."""

from branchsearch.workers.rank import crowd, doc_of, final_ranking, hold_back


def test_doc_of_splits_the_chunk_suffix_only():
    assert doc_of("d1#p0") == "d1"
    assert doc_of("a#pb#p12") == "a#pb"
    assert doc_of("plain") == "plain"


def test_final_ranking_orders_by_score_then_id():
    scores = {"b#p0": 0.5, "a#p0": 0.5, "c#p0": 0.9, "d#p0": 0.1}
    # 0.9 first; the two 0.5 ties by id (a before b); limit cuts d
    assert final_ranking(scores, 3) == ["c#p0", "a#p0", "b#p0"]


def test_final_ranking_spreads_documents_before_repeating_one():
    scores = {"x#p0": 0.9, "x#p1": 0.8, "y#p0": 0.3, "x#p2": 0.7, "z#p4": 0.2}
    # best chunk of each document by score (x 0.9, y 0.3, z 0.2), then x's other chunks
    assert final_ranking(scores, 10) == ["x#p0", "y#p0", "z#p4", "x#p1", "x#p2"]
    assert final_ranking(scores, 2) == ["x#p0", "y#p0"]
    assert final_ranking({}, 5) == []


def test_hold_back_keeps_late_chunks_out_of_the_head_only():
    ranked = ["t1#p0", "a#p0", "t2#p0", "b#p0", "c#p0", "a#p1", "t3#p0"]
    late = {"t1#p0", "t2#p0", "t3#p0"}
    # the first 2 documents that are not late, then the late ones in their order, then the rest
    assert hold_back(ranked, late, 2) == ["a#p0", "b#p0", "t1#p0", "t2#p0", "c#p0", "a#p1",
                                          "t3#p0"]
    assert hold_back(ranked, late, 0) == ranked
    assert hold_back(ranked, set(), 3) == ranked
    assert hold_back(["t1#p0", "a#p0"], late, 5) == ["a#p0", "t1#p0"]  # too few to fill a head


def test_crowd_moves_a_titles_documents_after_the_first_few_below_the_others():
    title = {"h1": "Hiroshima", "h2": "Hiroshima", "h3": "Hiroshima", "e": "Enola Gay",
             "w": "World War II", "h4": "Hiroshima"}
    ranked = ["h1#p0", "h2#p0", "h3#p0", "w#p0", "h4#p0", "e#p0", "h1#p1"]
    of = lambda cid: title[doc_of(cid)]  # noqa: E731
    # two Hiroshima passages, then the other pages in order, then the crowded-out ones in
    # theirs; a document's second chunk still after every document's first
    assert crowd(ranked, of, 2) == ["h1#p0", "h2#p0", "w#p0", "e#p0", "h3#p0", "h4#p0", "h1#p1"]
    assert crowd(ranked, of, 1) == ["h1#p0", "w#p0", "e#p0", "h2#p0", "h3#p0", "h4#p0", "h1#p1"]
    assert crowd(ranked, of, 4) == ranked  # never more than four of one title: unchanged
    assert crowd([], of, 2) == []


def test_the_heuristic_finish_crowds_one_titles_passages():
    from branchsearch.workers.heuristic import HeuristicPolicy
    from branchsearch.workers.policy import VisibleChunk

    def state(**kw):
        p = HeuristicPolicy(learned_rank=False, **({"final_k": 3} | kw))
        titles = {"a": "Atomic bombings (Hiroshima)", "b": "Atomic bombings", "c":
                  "Atomic bombings", "e": "Enola Gay"}
        p.chunks = {f"{d}#p0": VisibleChunk(f"{d}#p0", d, t, "text", 8) for d, t in titles.items()}
        p.scores = {"a#p0": 0.9, "b#p0": 0.8, "c#p0": 0.7, "e#p0": 0.6}
        return p

    # one title with its qualifier dropped: a and b are the two passages it may place first
    assert state()._finish(set()).args["ids"] == ["a#p0", "b#p0", "e#p0"]
    assert state(per_title=0)._finish(set()).args["ids"] == ["a#p0", "b#p0", "c#p0"]
    assert state(rank_all=False)._finish({"a#p0", "b#p0", "c#p0", "e#p0"}).args["ids"] == [
        "a#p0", "b#p0", "e#p0"]  # the visible-only ranking crowds before its cut too
    # a second chunk of e does not take the place of document c
    p = state(final_k=4)
    p.chunks["e#p1"] = VisibleChunk("e#p1", "e", "Enola Gay", "more", 8)
    p.scores["e#p1"] = 0.5
    assert p._finish(set()).args["ids"] == ["a#p0", "b#p0", "e#p0", "c#p0"]
    # a title that is only a qualifier is no title: such documents are not crowded together
    p = state()
    for cid in ("a#p0", "b#p0", "c#p0"):
        p.chunks[cid] = VisibleChunk(cid, cid[0], "(untitled)", "text", 8)
    assert p._finish(set()).args["ids"] == ["a#p0", "b#p0", "c#p0"]

# --- the heuristic policy's final ranking over everything it scored ------------------------------

import json  # noqa: E402
from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402
from store_copy import copy_store  # noqa: E402


@pytest.fixture(scope="module")
def bm25_hotpot(tmp_path_factory):
    """hotpot-mini as a BM25-only index (no embedding: fast), the agent searching by BM25."""
    from conftest import HOTPOT

    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.infra.index.open import open_retriever
    from branchsearch.infra.config.settings import load_settings

    settings = load_settings(overrides={"home": tmp_path_factory.mktemp("rc"), "index": "h",
                                        "search_mode": "bm25"}, read_env=False, read_file=False)
    ingest(HOTPOT, settings, dense=False)
    retriever = open_retriever(settings, need_dense=False)
    yield settings, retriever
    retriever.close()


Q = "What government position was held by the woman who portrayed Corliss Archer in the film Kiss and Tell?"


def test_finish_ranks_pruned_chunks_by_their_final_score(bm25_hotpot):
    from branchsearch.workers.harness import Episode
    from branchsearch.workers.heuristic import HeuristicPolicy

    settings, retriever = bm25_hotpot
    policy = HeuristicPolicy(keep=2, learned_rank=False)  # a tight context: most chunks get
    result = Episode(Q, retriever, policy, settings).run()  # pruned on the way
    assert result.termination == "finish" and result.pruned_ids
    # the ranking is over every scored chunk, by the score the policy holds at the end
    assert result.ranked_chunk_ids == final_ranking(policy.scores, settings.final_k)
    pruned = set(result.pruned_ids) - set(result.final_context_ids)
    assert pruned & set(result.ranked_chunk_ids), "a pruned chunk that scores well is returned"

    # the old behaviour (rank only what is still visible) can return nothing that was pruned
    old = Episode(Q, retriever, HeuristicPolicy(keep=2, rank_all=False, learned_rank=False),
                  settings).run()
    assert not (set(old.ranked_chunk_ids) - set(old.final_context_ids))


def test_a_pruned_chunk_is_recalled_once_and_then_kept_until_expanded():
    from branchsearch.workers.heuristic import HeuristicPolicy
    from branchsearch.workers.policy import AgentView, ToolCall, ToolResult, VisibleChunk

    p = HeuristicPolicy(keep=1)
    a = VisibleChunk("a#p0", "a", "Ed Wood", "Ed Wood was a director.", 8)
    b = VisibleChunk("b#p0", "b", "Tim Burton", "Tim Burton made Ed Wood.", 8)
    p.chunks = {"a#p0": a, "b#p0": b}
    p.scores = {"a#p0": 0.4, "b#p0": 0.9}
    p.pruned, p.bridges = {"a#p0"}, {"Ed Wood": "b#p0"}
    assert p._recalls() == ["a#p0"]  # a new bridge names the pruned chunk's document
    recall = ToolResult(ToolCall("recall_chunks", {"ids": ["a#p0"]}), True, "", ["a#p0"])
    p._absorb(AgentView("q", 3, [a, b], "", 16, 8192, [], [recall]))
    assert p._recalls() == []  # never twice: prune/recall must not cycle to max_turns
    # keep=1 would drop a#p0 (below b#p0), but it stays until it has been expanded
    assert p._prune_calls(None, {"a#p0", "b#p0"}) == []
    p.expanded.add("a#p0")
    assert p._prune_calls(None, {"a#p0", "b#p0"})[0].args["ids"] == ["a#p0"]


def test_a_word_capitalised_only_by_opening_its_sentence_is_not_a_bridge_entity():
    from branchsearch.workers.text import entities, sentences

    passage = ("Planning document for Project Orchid Eagle, approved in 2022. Budget owner: "
               "Carla Novak. Interestingly, DNA binds CD4. Rome was founded early. "
               "The walls of Rome are old.")
    found = [e for s in sentences(passage) for e in entities(s, passage)]
    # positional capitals (a common noun, a discourse adverb) are not names ...
    assert "Planning" not in found and "Budget" not in found and "Interestingly" not in found
    # ... a name keeps its capital elsewhere in the passage, or by its shape
    assert {"Project Orchid Eagle", "Carla Novak", "DNA", "CD4", "Rome"} <= set(found)
    # a question has no passage to check against: its opening word counts, unless a stopword
    assert entities("Planning of which city?") == ["Planning"]
    assert entities("There is a country where Trajan ruled.") == ["Trajan"]


def test_a_section_heading_is_not_part_of_a_bridge_entity():
    """Structured abstracts open sentences with headings: "RESULTS There were …" made the
    entity 'RESULTS There' (SciFact: searched in 105 of 300 episodes). The heading goes, and
    the word after it is judged as the sentence's opening word; a name after a heading stays,
    as do acronyms (too short to be headings) and names written in capitals elsewhere."""
    from branchsearch.workers.text import entities, sentences

    passage = ("BACKGROUND Whether calcium matters is unclear. RESULTS There were 40 subjects "
               "in Boston. METHODS Cervical samples came from the Mayo Clinic. PRINCIPAL "
               "FINDINGS We saw it. DESIGN Prospective cohort. SETTING hospitals in Ohio. "
               "NASA launched it. TARDBP mutations matter; we sequenced TARDBP.")
    found = [e for s in sentences(passage) for e in entities(s, passage)]
    assert not [e for e in found if e.split()[0] in ("BACKGROUND", "RESULTS", "METHODS",
                                                     "PRINCIPAL", "FINDINGS", "DESIGN",
                                                     "SETTING")]
    assert not {"Whether", "There", "Cervical", "We", "Prospective"} & set(found)
    assert {"Boston", "Mayo Clinic", "Ohio", "NASA", "TARDBP"} <= set(found)


def test_a_residual_search_asks_for_the_next_hop_and_credits_only_linked_hits():
    """An expanded chunk also searches what the question still needs (its uncovered words)
    with the entities it mentions; a hit of that search earns the residual credit only when it
    mentions one of those entities (it covers the leftover words by construction)."""
    from branchsearch.workers.heuristic import HeuristicPolicy, Origin as _Origin
    from branchsearch.workers.policy import VisibleChunk
    from branchsearch.workers.text import terms

    q = "What is the name of the waterfall in the country where the Bubye River is found?"
    p = HeuristicPolicy(learned_rank=False)
    p.subquery, p.q_terms = q, terms(q)
    bubye = VisibleChunk("bubye#p0", "bubye", "Bubye River",
                         "The Bubye River is a tributary of the Limpopo River in Zimbabwe.", 20)
    p.chunks["bubye#p0"] = bubye
    p.origins["bubye#p0"] = _Origin(q, 1, "question")
    p.scores["bubye#p0"] = p._score("bubye#p0")

    calls = p._expansions({"bubye#p0"})
    residual = [c for c in calls if p._pending[(c.args["query"], "bubye#p0")].kind == "residual"]
    assert len(residual) == 1
    words = residual[0].args["query"].split()
    assert "waterfall" in words and "Zimbabwe" in words  # what is left, and where it may be
    assert "Bubye" not in words and "River" not in words[:3]  # what the chunk already covers

    query = residual[0].args["query"]
    linked = VisibleChunk("vf#p0", "vf", "Victoria Falls",
                          "Victoria Falls is a waterfall on the border of Zambia and Zimbabwe.", 20)
    stray = VisibleChunk("af#p0", "af", "Angel Falls",
                         "Angel Falls is the highest waterfall of the country of Venezuela.", 20)
    inside = VisibleChunk("kf#p0", "kf", "Kariba Gorge",
                          "A waterfall of the country that Zimbabweans visit.", 20)
    for rank, chunk in enumerate((stray, linked, inside), start=1):  # the stray one ranks first
        p.chunks[chunk.id] = chunk
        p.origins[chunk.id] = _Origin(query, rank, "residual", "", "bubye#p0")
    # the stray page covers more of the leftover words and ranked first, yet the linked one wins
    assert p._score("vf#p0") > p._score("af#p0") + 0.1
    # an entity inside a longer word ("Zimbabweans") is no mention of it
    assert p._score("kf#p0") < p._score("vf#p0") - 0.1


def test_the_question_search_pages_on_until_it_covers_search_k_documents():
    """Long documents split into chunks: a first page of 4 hits from 2 documents asks the
    question once more (it excludes what it saw), and the new hits rank after the first page."""
    from branchsearch.workers.heuristic import HeuristicPolicy, Origin as _Origin

    q = "Statins decrease blood cholesterol."
    p = HeuristicPolicy(question_k=4, learned_rank=False)
    p.subquery = q
    for rank, cid in enumerate(["a#p0", "a#p1", "b#p0", "a#p2"], start=1):
        p.origins[cid] = _Origin(q, rank, "question")
    [call] = p._question_page()
    assert call.args == {"query": q, "k": 4}  # 2 documents missing, twice as many chunks asked
    assert p._pending[(q, "")].rank == 4  # its first hit will rank 5th
    p.origins["c#p0"] = _Origin(q, 5, "question")
    p.origins["d#p0"] = _Origin(q, 6, "question")
    assert p._question_page() == []  # 4 documents now
    wide = HeuristicPolicy(question_k=15)
    wide.subquery = q
    wide.origins = {f"a#p{i}": _Origin(q, i + 1, "question") for i in range(15)}  # 1 document
    assert wide._question_page()[0].args["k"] == 20  # the tool's cap, not 2 x 14
    short = HeuristicPolicy(question_k=4)
    short.origins = {"a#p0": _Origin(q, 1, "question")}  # fewer hits than asked: no more exist
    assert short._question_page() == []


def test_a_limit_that_stops_the_episode_still_returns_the_policys_ranking(bm25_hotpot):
    """max_tokens_read stops the episode before the policy finishes: the ranking is the one
    `finish` would have returned then (the harness asks the policy), not arrival order."""
    from branchsearch.workers.harness import Episode
    from branchsearch.workers.heuristic import HeuristicPolicy

    settings, retriever = bm25_hotpot
    tight = settings.replace(max_tokens_read=900)
    policy = HeuristicPolicy(learned_rank=False)
    result = Episode(Q, retriever, policy, tight).run()
    assert result.termination == "max_tokens_read"
    assert result.ranked_chunk_ids == final_ranking(policy.scores, settings.final_k)
    arrival = [c for c in result.retrieved_ids if c not in result.pruned_ids]
    assert result.ranked_chunk_ids != arrival[: settings.final_k]


def test_the_question_tail_is_the_last_search_and_never_takes_the_head(bm25_hotpot):
    """With nothing left to expand, the question's own search once more down to final_k
    documents; then the episode finishes (nothing found by it is expanded), and its hits rank
    only after the first question_k documents."""
    from branchsearch.workers.harness import Episode
    from branchsearch.workers.heuristic import HeuristicPolicy, Origin as _Origin
    from branchsearch.workers.rank import doc_of

    settings, retriever = bm25_hotpot
    policy = HeuristicPolicy(tail_page=True, question_k=3, final_k=8)
    result = Episode(Q, retriever, policy, settings).run()
    calls = [c for c in result.trace if c.get("kind") == "call"]
    assert [c["tool"] for c in calls[-2:]] in (["search_corpus", "finish"],
                                               ["prune_chunks", "finish"])
    tail = [c for c in calls if c["tool"] == "search_corpus" and c["args"]["query"] == Q][-1]
    assert calls.index(tail) >= len(calls) - 3 and policy.tail_ids
    assert not policy.tail_ids & policy.expanded
    docs = list(dict.fromkeys(doc_of(c) for c in result.ranked_chunk_ids))
    assert not {doc_of(c) for c in policy.tail_ids} & set(docs[:3])

    q = "Statins decrease blood cholesterol."
    p = HeuristicPolicy(question_k=4, final_k=7, tail_page=True)
    p.subquery = q
    for rank, cid in enumerate(["a#p0", "a#p1", "b#p0", "c#p0", "d#p0"], start=1):
        p.origins[cid] = _Origin(q, rank, "question")
    [call] = p._question_tail()
    assert call.args == {"query": q, "k": 6}  # 3 documents missing, twice as many chunks
    assert p._pending[(q, "")].rank == 5 and p._tail is p._pending[(q, "")]
    full = HeuristicPolicy(question_k=4, final_k=4, tail_page=True)
    full.origins = dict(p.origins)
    assert full._question_tail() == [] and full._tail is not None  # done: finish next


def test_a_one_word_title_is_named_by_the_question_only_as_a_name():
    """'hotel and casino' does not name the town 'Casino, New South Wales'; 'the Casino
    Richmond Valley' would. Longer titles are named by all their words, as before."""
    from branchsearch.workers.heuristic import HeuristicPolicy, Origin as _Origin
    from branchsearch.workers.policy import VisibleChunk
    from branchsearch.workers.text import terms

    def support(question: str, title: str) -> float:
        p = HeuristicPolicy(learned_rank=False, coverage_weight=0.0, residual_weight=0.0,
                            qualifier_weight=0.0)
        p.subquery, p.q_terms = question, terms(question)
        p.chunks["t#p0"] = VisibleChunk("t#p0", "t", title, "A town on a river.", 10)
        p.origins["t#p0"] = _Origin("x", 3, "entity")
        return p._score("t#p0")

    assert support("Which hotel and casino hosted the recording?", "Casino, New South Wales") \
        == pytest.approx(0.05)  # only its search rank (0.15 / 3)
    assert support("How big is Casino in Australia?", "Casino, New South Wales") == 0.6
    assert support("Who founded the Flamingo Las Vegas hotel?", "Flamingo Las Vegas") == 0.95


def test_a_concept_page_is_named_only_as_its_title_writes_it():
    """'What body of water is near …' asks for a body of water; it does not name the page
    'Body of water' (a concept, in sentence case), which used to get a named page's support and
    crowd the evidence. A proper name is named by its words however the question writes them."""
    from branchsearch.workers.heuristic import HeuristicPolicy, Origin as _Origin
    from branchsearch.workers.policy import VisibleChunk
    from branchsearch.workers.text import terms

    def support(question: str, title: str, **kw) -> float:
        p = HeuristicPolicy(learned_rank=False, coverage_weight=0.0, residual_weight=0.0,
                            qualifier_weight=0.0, **kw)
        p.subquery, p.q_terms = question, terms(question)
        p.chunks["t#p0"] = VisibleChunk("t#p0", "t", title, "Some text.", 10)
        p.origins["t#p0"] = _Origin("x", 3, "entity")
        return p._score("t#p0")

    q = "What body of water is near the location where the Siege of Cassel took place?"
    assert support(q, "Body water") == pytest.approx(0.05)  # only its search rank
    assert support(q, "Body water", common_titles_named=True) == 0.95  # the old rule
    assert support(q, "Siege of Cassel (1761)") == 0.95
    assert support(q.lower(), "Siege of Cassel (1761)") == 0.95  # a name, however written
    gila = "Where are Gila monsters found, in the country with the political party that …?"
    assert support(gila, "Political party") == pytest.approx(0.05)
    assert support(gila, "Gila monster") == 0.95  # built on a name the question writes
    assert support("What type of lamp was patented by Aimé Argand?", "Argand lamp") == 0.95
    assert support("who won the 2018 Kansas gubernatorial election?",
                   "2018 Kansas gubernatorial election") == 0.95
    assert support("Body water makes up what share of a body?", "Body water") == 0.95


def test_a_residual_query_stays_within_the_search_cap():
    from branchsearch.workers.heuristic import HeuristicPolicy, Origin as _Origin
    from branchsearch.workers.policy import VisibleChunk
    from branchsearch.workers.text import terms
    from branchsearch.workers.tools import QUERY_MAX_CHARS

    q = " ".join(f"unusualword{i} qualifier{i}" for i in range(24))  # a long question
    p = HeuristicPolicy(learned_rank=False)
    p.subquery, p.q_terms = q, terms(q)
    text = " ".join(f"It mentions Longish Entity Name Number{i} here." for i in range(30))
    p.chunks["c#p0"] = VisibleChunk("c#p0", "c", "Some Page", text, 300)
    p.origins["c#p0"] = _Origin(q, 1, "question")
    query = p._residual_query("c#p0", [f"Longish Entity Name Number{i}" for i in range(30)])
    assert query.startswith("unusualword0 qualifier0") and len(query) <= QUERY_MAX_CHARS


def test_a_leading_year_is_a_qualifier_among_the_pages_of_a_series():
    """'1974 Texas Tech Red Raiders football team' and its 2013 sibling are one series told
    apart by the year: the year the question gives agrees with one and not the other, however
    the season is written ('1992–93' in a title, '1992-93' in a question). A page with no
    sibling, or no year, gets nothing from it."""
    from branchsearch.workers.heuristic import HeuristicPolicy, Origin as _Origin, title_qualifier
    from branchsearch.workers.policy import VisibleChunk
    from branchsearch.workers.text import terms

    assert title_qualifier("1995–96 Manchester United F.C. season") == "1995–96"
    assert title_qualifier("2001: A Space Odyssey") == ""  # a year that is the name
    assert title_qualifier("Kiss and Tell (1945 film)") == "1945 film"

    def agreement(question: str, titles: list[str]) -> list[float]:
        p = HeuristicPolicy(learned_rank=False)
        p.subquery, p.q_terms = question, terms(question)
        for i, title in enumerate(titles):
            cid = f"d{i}#p0"
            p.chunks[cid] = VisibleChunk(cid, f"d{i}", title, "A season of a team.", 10)
            p.origins[cid] = _Origin(question, i + 1, "question")
        return [p._qualifier_agreement(f"d{i}#p0") for i in range(len(titles))]

    q = "The 1974 Texas Tech Raiders football team represented what university?"
    assert agreement(q, ["2013 Texas Tech Red Raiders football team",
                         "1974 Texas Tech Red Raiders football team"]) == [-0.5, 0.5]
    assert agreement("Who played for the Charlotte Hornets in their 1992-93 season?",
                     ["1993–94 Charlotte Hornets season", "1992–93 Charlotte Hornets season"]
                     ) == [-0.5, 0.5]
    assert agreement(q, ["1974 Texas Tech Red Raiders football team", "Texas Tech University"]
                     ) == [0.0, 0.0]  # no look-alike


def test_a_bridge_hit_that_mentions_a_pageless_entity_inherits_from_its_parent():
    """'Jump for Glory' names its director Raoul Walsh; the corpus has no Raoul Walsh page, so
    the hit of his search that mentions him ('Betrayed', a film of his) is where the next hop
    is: it inherits from the parent. A hit that does not mention him, an entity that has a page
    of its own, and an entity that turns up all over the episode ('California') do not."""
    from branchsearch.workers.heuristic import HeuristicPolicy, Origin as _Origin
    from branchsearch.workers.policy import VisibleChunk
    from branchsearch.workers.text import terms

    def policy(**kw) -> HeuristicPolicy:
        q = "Who is the spouse of the director of Jump for Glory?"
        p = HeuristicPolicy(learned_rank=False, coverage_weight=0.0, residual_weight=0.0,
                            qualifier_weight=0.0, **kw)
        p.subquery, p.q_terms = q, terms(q)
        parent = VisibleChunk("jfg#p0", "jfg", "Jump for Glory", "Jump for Glory is a 1937 film "
                              "directed by Raoul Walsh, shot in California.", 20)
        p.chunks[parent.id], p.origins[parent.id] = parent, _Origin(q, 1, "question")
        p.scores[parent.id] = 1.0
        p.links = {"raoul walsh": (parent.id, 0.9), "california": (parent.id, 0.9)}
        hits = [("bet", "Betrayed (1917 film)", "A 1917 film directed by Raoul Walsh and "
                 "starring his wife Miriam Cooper, shot in California.", "Raoul Walsh", 1),
                ("oth", "Other Film", "A film shot in California.", "Raoul Walsh", 2),
                ("cal", "Gold Rush", "A film about California.", "California", 1)]
        for doc, title, text, entity, rank in hits:
            p.chunks[f"{doc}#p0"] = VisibleChunk(f"{doc}#p0", doc, title, text, 20)
            p.origins[f"{doc}#p0"] = _Origin(entity, rank, "bridge", entity, parent.id)
        p._count_mentions()
        return p

    p = policy()
    assert p._score("bet#p0") == pytest.approx(0.6 * 0.85 * 0.9 * 1.0)  # inherits
    assert p._score("oth#p0") == pytest.approx(0.15 / 2)  # no mention: its search rank only
    # 'California' is mentioned in passing by two other chunks: its credit is a third
    assert p._score("cal#p0") == pytest.approx(max(0.15, 0.6 * 0.85 * 0.9 / 3))
    assert policy(mention_weight=0.0)._score("bet#p0") == pytest.approx(0.15)
    titled = policy()
    titled.chunks["rw#p0"] = VisibleChunk("rw#p0", "rw", "Raoul Walsh", "A director.", 5)
    titled.origins["rw#p0"] = _Origin("Raoul Walsh", 3, "bridge", "Raoul Walsh", "jfg#p0")
    assert titled._score("bet#p0") == pytest.approx(0.15)  # his own page is the next hop
    paper = policy()  # a paper titled by its claim is no page about a named thing
    paper.chunks["bet#p0"] = VisibleChunk("bet#p0", "bet", "Raoul Walsh films of 1917 show a "
                                          "marked shift in staging", "Raoul Walsh directed.", 9)
    assert paper._score("bet#p0") == pytest.approx(0.15)


def test_a_title_stored_with_html_entities_is_named_as_the_text_writes_it():
    """HotpotQA stores 'Will &amp; Grace'; the pages that link to it write 'Will & Grace'."""
    from branchsearch.workers.heuristic.titles import names as _names
    from branchsearch.workers.text import bare_title, norm_title

    assert norm_title("Will &amp; Grace") == "will & grace"
    assert bare_title("I&quot;s (manga)") == 'I"s'
    assert _names("Will &amp; Grace", "Will & Grace") == 1.0
    assert bare_title("AT&T Park") == "AT&T Park"  # an ampersand that is no entity stays
    assert bare_title("Barnes&not Sons") == "Barnes&not Sons"  # nor a name without its ';'


def test_an_entity_branch_searches_its_sub_query_once_as_the_question(bm25_hotpot):
    """A sub-query that is itself an entity ('Shirley Temple', a planner's entity branch): its
    search is the question's (first-page support, the question page and tail), not an entity
    search of 3 hits that overwrote it (same query, same key)."""
    from branchsearch.workers.harness import Episode
    from branchsearch.workers.heuristic import HeuristicPolicy

    settings, retriever = bm25_hotpot
    policy = HeuristicPolicy()
    result = Episode("Shirley Temple", retriever, policy, settings).run()
    kinds = {o.kind for o in policy.origins.values()}
    assert "question" in kinds
    first = [c for c in result.trace if c.get("kind") == "call" and c.get("turn") == 1]
    assert [c["args"]["query"] for c in first] == ["Shirley Temple"]


def test_accents_fold_in_every_comparison_of_names_and_terms():
    """A question typed without accents ('Aschenbrodel', 'Tekeze River') names the page
    'Aschenbrödel'; a page's 'Johann Strauß' links to the page 'Johann Strauss II'."""
    from branchsearch.workers.heuristic.titles import in_query as _in_query, named_in as _named_in
    from branchsearch.workers.heuristic.titles import names as _names, names_page as _names_page
    from branchsearch.workers.text import fold, folded, norm_title, terms

    assert fold("Aschenbrödel") == "Aschenbrodel" and fold("Øresund Æsir Strauß") == \
        "Oresund AEsir Strauss"
    assert folded("STRAẞE") == folded("Straße") == "strasse"
    from branchsearch.workers.text import entities
    assert entities("Was Émile Zola born near Łódź or the Øresund Bridge?") == [
        "Émile Zola", "Łódź", "Øresund Bridge"]  # an accented capital opens a name too
    assert fold("Ελλάδα") == "Ελλαδα" and fold("서울") == "서울"  # other scripts keep letters
    assert terms("Aschenbrödel on the Tekezé") == terms("aschenbrodel on the Tekeze")
    assert norm_title("Tekezé River") == "tekeze river"
    assert _names("Aschenbrödel", "Aschenbrodel") == 1.0
    assert _names("Johann Strauss II", "Johann Strauß II") == 1.0
    assert _named_in("Aschenbrödel", "Who composed Aschenbrodel?")
    assert _names_page("Tekezé River", "Which river does the Tekeze River join?")
    assert _in_query("Tekezé", "the Tekeze River")


def test_an_unaccented_question_finds_and_ranks_the_accented_pages(tmp_path):
    """End to end on a BM25 index: the question writes no accents, the pages do."""
    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.infra.index.open import open_retriever
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.workers.harness import Episode
    from branchsearch.workers.heuristic import HeuristicPolicy

    docs = [("aschenbrodel", "Aschenbrödel", "Aschenbrödel is a ballet written by Johann "
             "Strauß II, finished by Josef Bayer in 1900."),
            ("strauss", "Johann Strauss II", "Johann Strauss II was an Austrian composer of "
             "light music, born in St. Ulrich near Vienna."),
            ("bayer", "Josef Bayer", "Josef Bayer was an Austrian composer of ballets."),
            ("cinderella", "Cinderella", "Cinderella is a folk tale about a ballet of ashes.")]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": i, "title": t, "text": x}) + "\n"
                              for i, t, x in docs))
    settings = load_settings(overrides={"home": tmp_path / "home", "index": "a",
                                        "search_mode": "bm25"}, read_env=False, read_file=False)
    ingest(corpus, settings, dense=False)
    retriever = open_retriever(settings, need_dense=False)
    try:
        policy = HeuristicPolicy(learned_rank=False)
        result = Episode("Where was the composer of Aschenbrodel born?", retriever, policy,
                         settings).run()
    finally:
        retriever.close()
    ranking = [doc_of(c) for c in result.ranked_chunk_ids]
    assert {"aschenbrodel", "strauss"} <= set(ranking[:3]), ranking  # (old: never found)
    assert "johann strauss ii" in policy.links  # the page's 'Johann Strauß II', folded


def test_hops_are_searched_by_bm25_on_a_hybrid_index(hotpot_settings, hotpot_retriever):
    """On a hybrid index the question is searched hybrid and the hops the policy builds (the
    question's entities, bridge entities, residual words) by BM25: the embedding of a bare name
    or a bag of words is a weak signal, and hybrid pooled recall rose with it
    (reports/recall/README.md, session 9)."""
    from branchsearch.workers.factory import make_policy
    from branchsearch.workers.harness import Episode

    policy = make_policy(hotpot_settings)
    assert policy.hop_mode == "bm25"
    result = Episode("Were Scott Derrickson and Ed Wood of the same nationality?",
                     hotpot_retriever, policy, hotpot_settings).run()
    searches = [c for c in result.trace
                if c.get("kind") == "call" and c.get("tool") == "search_corpus"]
    kinds = {}
    for call in searches:
        origin = policy._pending[(call["args"]["query"],
                                  (call["args"].get("from_ids") or [""])[0])]
        kinds.setdefault(origin.kind, set()).add(call["args"].get("mode", "default"))
    assert kinds["question"] == {"default"}  # the settings' mode: hybrid
    assert kinds["entity"] == kinds["bridge"] == kinds["residual"] == {"bm25"}
    assert {"ed-wood", "scott-derrickson"} <= {doc_of(c) for c in result.ranked_chunk_ids[:5]}
    bm25 = replace(hotpot_settings, search_mode="bm25")
    assert make_policy(bm25).hop_mode == ""  # one mode for every search


def test_an_index_whose_bm25_does_not_fold_keeps_hybrid_hops(hotpot_settings, tmp_path):
    """A tantivy index made before accent folding: there the dense side is what matched a name
    written without its accents, so its hops stay hybrid (the settings' mode)."""
    import json

    from branchsearch.workers.factory import make_policy

    home = tmp_path / "home"  # what make_policy reads: the manifest and tantivy's schema (not
    # the whole folder: a copy of a Milvus Lite file in use breaks the process's own server)
    old = replace(hotpot_settings, home=home)
    copy_store(hotpot_settings.index_dir / "manifest.json", old.index_dir / "manifest.json")
    copy_store(hotpot_settings.index_dir / "tantivy" / "meta.json",
               old.index_dir / "tantivy" / "meta.json")
    assert make_policy(old).hop_mode == "bm25"
    meta = old.index_dir / "tantivy" / "meta.json"
    data = json.loads(meta.read_text())
    for field in data["schema"]:
        if field["name"] == "body":
            field["options"]["indexing"]["tokenizer"] = "en_stem"  # as the old code made it
    meta.write_text(json.dumps(data))
    assert make_policy(old).hop_mode == ""


def test_per_title_is_a_setting_the_policy_gets(bm25_hotpot):
    from branchsearch.workers.factory import make_policy

    settings, _ = bm25_hotpot
    assert make_policy(settings).per_title == 2
    assert make_policy(settings.replace(per_title=0)).per_title == 0


def test_a_named_search_opens_the_names_own_page_first(bm25_hotpot):
    """`named`: the page titled with the query comes first, even from below the cut (BM25
    ranks 'Ed Wood (film)' above 'Ed Wood'); a qualified title when there is no exact one; an
    excluded page stays excluded; no page by that name leaves the search as it was."""
    _, retriever = bm25_hotpot

    def ids(query, k, **kw):
        return [h.doc_id for h in retriever.search(query, mode="bm25", k=k, **kw)]

    assert ids("Ed Wood", 1) == ["ed-wood-film"]
    [page] = retriever.search("ed wood", mode="bm25", k=1, named=True)
    assert (page.doc_id, page.source, page.rank, page.title) == ("ed-wood", "title", 1, "Ed Wood")
    assert page.text.startswith("Edward Davis Wood Jr.")
    assert ids("Ed Wood", 3, named=True) == ["ed-wood", "ed-wood-film", "woodson-arkansas"]
    assert ids("Ed Wood", 2, named=True, exclude_ids=["ed-wood#p0"])[0] == "ed-wood-film"
    assert ids("Sinister", 2, named=True)[0] == "sinister-film"  # 'Sinister (film)'
    assert ids("Corliss Archer", 3, named=True) == ids("Corliss Archer", 3)


def test_the_heuristic_opens_the_pages_of_the_questions_names_only(bm25_hotpot):
    """The searches for the sub-query's own names are `named`; the question's search and the
    bridge searches are not (bridge pages are mostly hubs that crowd the top)."""
    from branchsearch.workers.harness import Episode
    from branchsearch.workers.heuristic import HeuristicPolicy

    settings, retriever = bm25_hotpot

    def searches(policy):
        result = Episode(Q, retriever, policy, settings).run()
        return [c["args"] for c in result.trace
                if c.get("kind") == "call" and c["tool"] == "search_corpus"]

    policy = HeuristicPolicy()
    calls = searches(policy)
    named = {a["query"] for a in calls if a.get("named")}
    assert named and named == set(policy.q_entities)  # 'Corliss Archer', 'Kiss and Tell'
    assert policy.bridges and not named & set(policy.bridges)
    assert not any(a.get("named") for a in searches(HeuristicPolicy(named_pages=False)))


def test_an_entity_branch_follows_one_hop_and_the_questions_branch_two(bm25_hotpot):
    """make_policy: the question's own branch expands to depth 2 (max_hops 3); an entity
    branch, whose sub-query starts at a name, expands only what its own searches found."""
    from branchsearch.workers.factory import make_policy
    from branchsearch.workers.harness import Episode

    settings, retriever = bm25_hotpot
    depths = {}
    for kind in ("original", "entity"):
        policy = make_policy(settings, "heuristic", kind=kind)
        Episode(Q, retriever, policy, settings).run()
        depths[kind] = max(policy.depth.values())
    assert depths == {"original": 2, "entity": 1}
