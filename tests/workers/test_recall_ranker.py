"""The learned final ranker (workers/heuristic/ranker.py): the shipped weights load, the
features are computed from a policy's state at the end of an episode, and the ranker reorders
in the direction its weights say (it never adds or drops a chunk)."""

import json

import pytest

from branchsearch.workers.heuristic import HeuristicPolicy, Origin as _Origin
from branchsearch.workers.policy import VisibleChunk
from branchsearch.workers.rank import final_ranking
from branchsearch.workers.text import terms
from branchsearch.infra.config.settings import load_settings
from branchsearch.workers.factory import make_policy
from branchsearch.workers.heuristic.ranker import (FEATURES, HYBRID_WEIGHTS_PATH, WEIGHTS_PATH,
                                                   LinearRanker, episode_features, load_ranker)


@pytest.mark.parametrize("path", [WEIGHTS_PATH, HYBRID_WEIGHTS_PATH])
def test_the_shipped_ranker_loads_and_corrects_the_heuristic_score(path):
    ranker = load_ranker(str(path))
    assert ranker.features == FEATURES
    w = dict(zip(ranker.features, ranker.weights))
    assert w["score"] == 1.0  # a correction to the heuristic's score, not a replacement
    assert all(abs(v) <= 0.6 for k, v in w.items() if k != "score")
    assert ranker.meta.get("fit_on"), "the weights say which data sets they were fit on"


def test_each_search_mode_finishes_with_the_ranker_fit_on_it():
    for mode, path in (("bm25", WEIGHTS_PATH), ("hybrid", HYBRID_WEIGHTS_PATH),
                       ("dense", WEIGHTS_PATH)):  # dense-only has no fit of its own
        policy = make_policy(load_settings(overrides={"search_mode": mode}, read_env=False,
                                           read_file=False))
        assert policy.ranker_path == str(path)
        assert load_ranker(policy.ranker_path).meta["search_mode"] == {"dense": "bm25"}.get(
            mode, mode)
    hybrid = load_ranker(str(HYBRID_WEIGHTS_PATH))
    assert hybrid.weights != load_ranker().weights
    p = _episode()
    p.ranker_path = str(HYBRID_WEIGHTS_PATH)
    call = p._finish(set(p.chunks))
    assert call.args["ids"] == final_ranking(hybrid.scores(p.final_features), p.final_k)
    # it computed what hybrid weighs and BM25's ranker does not (BM25's finish leaves it 0.0)
    only = FEATURES.index("novel_terms")
    assert "novel_terms" in hybrid.used - load_ranker().used
    assert any(x[only] for x in p.final_features.values())


def test_a_hybrid_search_of_a_bm25_only_index_finishes_with_bm25_weights(tmp_path):
    """An index ingested --no-dense is searched BM25 under the default hybrid mode; the ranker
    must be the one fit on BM25 episodes (found by a review: it took hybrid's)."""
    from conftest import HOTPOT

    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.infra.retrieval.retriever import searched_mode

    settings = load_settings(overrides={"home": tmp_path, "index": "bm25-only"},
                             read_env=False, read_file=False)
    ingest(HOTPOT, settings, dense=False)
    assert settings.search_mode == "hybrid" and searched_mode(settings) == "bm25"
    assert make_policy(settings).ranker_path == str(WEIGHTS_PATH)
    assert searched_mode(settings.replace(index="never-ingested")) == "hybrid"


def test_a_policy_sees_the_index_change_under_a_running_process(tmp_path):
    """`make_policy` keeps what it read of an index's files while they are unchanged: a manifest
    rewritten (a re-ingest with a dense side, here as its manifest) is seen by the next policy."""
    from dataclasses import replace

    from conftest import HOTPOT

    from branchsearch.infra.index.manifest import read_manifest, write_manifest
    from branchsearch.infra.ingest.pipeline import ingest

    settings = load_settings(overrides={"home": tmp_path, "index": "changes"},
                             read_env=False, read_file=False)
    ingest(HOTPOT, settings, dense=False)
    assert make_policy(settings).ranker_path == str(WEIGHTS_PATH)
    assert make_policy(settings).ranker_path == str(WEIGHTS_PATH)  # kept: the same answer
    manifest = read_manifest(settings.index_dir)
    write_manifest(settings.index_dir, replace(manifest, embedding={"model": "m", "dim": 8}))
    policy = make_policy(settings)
    assert policy.ranker_path == str(HYBRID_WEIGHTS_PATH) and policy.hop_mode == "bm25"


def test_weights_for_other_features_are_refused(tmp_path):
    data = json.loads(WEIGHTS_PATH.read_text())
    data["features"] = data["features"][:-1]
    path = tmp_path / "w.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="retrain"):
        load_ranker(str(path))


def _episode() -> HeuristicPolicy:
    """A finished episode in miniature: the sub-query names 'Ed Wood'; the question search
    returned 'Tim Burton' first (rank 1) and the 'Ed Wood' page second; the entity search for
    'Ed Wood' found the page too (first come: the question search); 'Plan 9' came from a bridge
    of the Ed Wood page."""
    p = HeuristicPolicy()
    p.subquery = "Which film did Ed Wood direct in 1957?"
    from branchsearch.workers.text import entities, terms

    p.q_terms, p.q_entities = terms(p.subquery), entities(p.subquery)
    chunks = [VisibleChunk("tb#p0", "tb", "Tim Burton", "Tim Burton directed the film Ed Wood "
                           "in 1994.", 20),
              VisibleChunk("ew#p0", "ew", "Ed Wood", "Ed Wood was a director. In 1957 he made "
                           "Plan 9 from Outer Space.", 20),
              VisibleChunk("p9#p0", "p9", "Plan 9 from Outer Space", "Plan 9 from Outer Space "
                           "is a 1957 film directed by Ed Wood.", 20),
              VisibleChunk("bl#p0", "bl", "Bela Lugosi", "Bela Lugosi starred in Plan 9.", 20)]
    p.chunks = {c.id: c for c in chunks}
    p.origins = {"tb#p0": _Origin(p.subquery, 1, "question"),
                 "ew#p0": _Origin(p.subquery, 2, "question"),
                 "p9#p0": _Origin("Plan 9 from Outer Space", 1, "bridge",
                                  "Plan 9 from Outer Space", "ew#p0"),
                 "bl#p0": _Origin("Bela Lugosi", 1, "bridge", "Bela Lugosi", "ew#p0")}
    p.depth = {"tb#p0": 0, "ew#p0": 0, "p9#p0": 1, "bl#p0": 1}
    p.links = {"ed wood": ("", 1.0), "plan 9 from outer space": ("ew#p0", 0.9),
               "bela lugosi": ("ew#p0", 0.6)}
    p.expanded = {"tb#p0", "ew#p0"}
    p.pruned = {"bl#p0"}
    for cid in p.origins:  # parents before children, as the policy scores them
        p.scores[cid] = p._score(cid)
    return p


def test_episode_features_read_the_policy_state():
    p = _episode()
    feats = episode_features(p)
    assert set(feats) == set(p.scores) and all(len(x) == len(FEATURES) for x in feats.values())
    f = {cid: dict(zip(FEATURES, x)) for cid, x in feats.items()}
    assert f["tb#p0"]["question_support"] == 1.0 and f["ew#p0"]["question_support"] == 1 / 1.6
    assert f["ew#p0"]["names_q_entity"] == 1.0 and f["tb#p0"]["names_q_entity"] == 0.0
    assert f["p9#p0"]["from_bridge"] == 1.0 and f["p9#p0"]["depth"] == 1.0
    assert f["p9#p0"]["parent_score"] == pytest.approx(p.scores["ew#p0"])
    assert f["p9#p0"]["names_bridge"] == 1.0  # the Ed Wood page's bridge entity names it
    assert f["ew#p0"]["mentioned_by"] > 0  # Tim Burton and Plan 9 mention 'Ed Wood'
    assert f["ew#p0"]["children_inv"] == pytest.approx(1 - 1 / 3)  # it led to two chunks
    assert f["bl#p0"]["pruned"] == 1.0 and f["ew#p0"]["pruned"] == 0.0
    assert f["tb#p0"]["rank_inv"] == 1.0 / (sorted(p.scores, key=lambda c: (-p.scores[c], c))
                                             .index("tb#p0") + 1)


def test_the_ranker_moves_chunks_the_way_its_weights_say():
    p = _episode()
    feats = episode_features(p)
    heuristic = final_ranking(p.scores, 10)
    n = len(FEATURES)

    def ranker(**weights):
        w = [weights.get(name, 0.0) for name in FEATURES]
        w[FEATURES.index("score")] = 1.0
        return LinearRanker(FEATURES, tuple(w), (0.0,) * n, (1.0,) * n, {})

    # weight 0 everywhere but the score: exactly the heuristic's own order
    assert final_ranking(ranker().scores(feats), 10) == heuristic
    # the question's rank-1 hit (Tim Burton) is above the page the question names (Ed Wood);
    # weighting 'the title names an entity of the sub-query' turns them round
    assert heuristic.index("tb#p0") < heuristic.index("ew#p0")
    lifted = final_ranking(ranker(names_q_entity=0.1).scores(feats), 10)
    assert lifted.index("ew#p0") < lifted.index("tb#p0")
    assert sorted(lifted) == sorted(heuristic)  # reordered, nothing added or dropped

    # the shipped ranker discounts the question search's own rank a little: the gap between
    # the rank-1 hit and the named page narrows by exactly its weights times their features
    ranker_ = load_ranker()
    s = ranker_.scores(feats)
    w = dict(zip(FEATURES, ranker_.weights))
    fe, ft = dict(zip(FEATURES, feats["ew#p0"])), dict(zip(FEATURES, feats["tb#p0"]))
    expected = sum(w[k] * (fe[k] - ft[k]) for k in FEATURES if k != "score")
    gain = (s["ew#p0"] - s["tb#p0"]) - (p.scores["ew#p0"] - p.scores["tb#p0"])
    assert gain == pytest.approx(expected) and gain > 0
    assert sorted(final_ranking(s, 10)) == sorted(heuristic)


def test_computing_only_the_weighted_features_gives_the_same_scores():
    p = _episode()
    ranker = load_ranker()
    full, part = episode_features(p), episode_features(p, ranker.used)
    assert ranker.scores(part) == ranker.scores(full)
    # the costly ones it does not weigh are skipped (0.0), not left out of the vector
    costly = [FEATURES.index(f) for f in ("names_bridge", "mentioned_by", "coverage")
              if f not in ranker.used]
    assert costly and all(x[i] == 0.0 for x in part.values() for i in costly)
    assert any(full[c][i] != 0.0 for c in full for i in costly)


def test_the_policy_finishes_with_the_ranker_and_keeps_the_features():
    p = _episode()
    call = p._finish(set(p.chunks))
    assert call.args["ids"] == final_ranking(load_ranker().scores(p.final_features), p.final_k)
    off = _episode()
    off.learned_rank = False
    assert off._finish(set(off.chunks)).args["ids"] == final_ranking(off.scores, off.final_k)


# --- set-level features (Session 3): the chain, restating, what a page adds to those above it --

@pytest.fixture(scope="module")
def publix_episode(tmp_path_factory):
    """A real episode: musique-mini as a BM25-only index, the heuristic policy (ranker off) on
    the 4-hop question whose gold is the chain Hello Love (song) -> Hank Snow -> Tennessee ->
    Publix; musique-mini holds two 'Publix' pages (two paragraphs of one article)."""
    from conftest import MUSIQUE

    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.infra.index.open import open_retriever
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.workers.harness import Episode

    settings = load_settings(overrides={"home": tmp_path_factory.mktemp("rk"), "index": "m",
                                        "search_mode": "bm25"}, read_env=False, read_file=False)
    ingest(MUSIQUE, settings, dense=False)
    retriever = open_retriever(settings, need_dense=False)
    policy = HeuristicPolicy(learned_rank=False)
    Episode("How many Publix stores are in the state that borders the east of the state where "
            "Hello Love's performer lived in when he died?", retriever, policy, settings).run()
    retriever.close()
    return policy


def _by_doc(policy, feats):
    order = final_ranking(policy.scores, len(policy.scores))
    first = {}
    for cid in order:
        first.setdefault(policy.chunks[cid].doc_id, cid)
    place = {d: i for i, d in enumerate(first, start=1)}
    return first, place, {d: dict(zip(FEATURES, feats[c])) for d, c in first.items()}


def test_the_chain_credits_a_page_named_by_a_stronger_page(publix_episode):
    p = publix_episode
    first, place, f = _by_doc(p, episode_features(p))
    assert {"hello-love-song", "hank-snow", "tennessee"} <= set(first)
    # Hello Love (song) names its performer, Hank Snow: his page is a link of the chain, credited
    # with the place and the relative score of the first (best) page that names it
    namer = min((d for d in first if d != "hank-snow" and "hank snow" in " ".join(
        p.chunks[c].text.lower() for c in p.scores if p.chunks[c].doc_id == d)),
        key=place.get)
    assert f["hank-snow"]["chain_rank_inv"] == pytest.approx(1 / place[namer])
    assert f["hank-snow"]["chain_support"] == pytest.approx(
        p.scores[first[namer]] / max(p.scores.values()))
    assert place[namer] <= place["hello-love-song"]
    assert f["tennessee"]["chain_support"] > 0  # Hank Snow's page names Tennessee
    # a page named by nothing scored has no chain credit, and the best page has no doc above it
    top = next(iter(first))
    assert f[top]["doc_rank_inv"] == 1.0
    assert f[top]["novel_terms"] == pytest.approx(f[top]["coverage"])  # nothing above it


def test_every_chain_credit_is_the_first_other_page_holding_the_title(publix_episode):
    """The chain features of every page against their definition, written out plainly: the
    first page in document order, with another title core, whose words hold the page's title
    core as a phrase (the ranker finds it through word sets, then the phrase)."""
    import re

    from branchsearch.workers.text import folded, norm_title

    p = publix_episode
    first, place, f = _by_doc(p, episode_features(p))
    best = max(p.scores.values())
    words = {d: " " + " ".join(re.findall(r"\w+", " ".join(
        folded(f"{c.title} {c.text}") for cid, c in p.chunks.items()
        if cid in p.scores and c.doc_id == d))) + " " for d in first}
    core = {d: norm_title(p.chunks[first[d]].title) for d in first}
    credited = 0
    for d in first:
        needle = " " + " ".join(re.findall(r"\w+", core[d])) + " "
        namer = next((o for o in first if core[o] != core[d] and needle in words[o]), None) \
            if len(needle) > 5 else None
        want = (p.scores[first[namer]] / best, 1 / place[namer]) if namer else (0.0, 0.0)
        assert (f[d]["chain_support"], f[d]["chain_rank_inv"]) == pytest.approx(want), d
        credited += namer is not None
    assert credited >= 2  # the episode has chains to find


def test_a_second_page_with_the_same_title_restates_and_is_no_chain_link(publix_episode):
    p = publix_episode
    first, place, f = _by_doc(p, episode_features(p))
    publix = sorted((d for d in first if p.chunks[first[d]].title == "Publix"), key=place.get)
    assert len(publix) == 2, "both Publix paragraphs are scored in this episode"
    assert f[publix[0]]["restates"] == 0.0 and f[publix[1]]["restates"] == 1.0
    # the second Publix page mentions 'Publix' but is not a page that names the first: the
    # chain credit comes from a page with another title, or there is none
    credit = f[publix[0]]["chain_rank_inv"]
    if credit:
        namer = [d for d in first if place[d] == round(1 / credit)]
        assert namer and p.chunks[first[namer[0]]].title != "Publix"


def test_novel_terms_count_only_what_the_pages_above_leave_uncovered():
    p = _episode()
    feats = episode_features(p)
    first, place, f = _by_doc(p, feats)
    q = len(p.q_terms)
    covered = set()
    for d in list(first)[:5]:
        c = first[d]
        words = p.q_terms & terms(f"{p.chunks[c].title} {p.chunks[c].text}")
        assert f[d]["novel_terms"] == pytest.approx(len(words - covered) / q)
        covered |= words
    # computed only when asked for: the ranker's `used` set without them leaves them 0
    part = episode_features(p, frozenset({"score"}))
    assert all(x[FEATURES.index("novel_terms")] == 0.0 for x in part.values())
    assert any(x[FEATURES.index("novel_terms")] > 0.0 for x in feats.values())
