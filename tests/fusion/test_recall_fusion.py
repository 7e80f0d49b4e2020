"""Anchored branch fusion (fusion/anchored.py), on hand-computed cases. Pure, fast."""

import pytest

from branchsearch.fusion.anchored import anchored_rrf
from branchsearch.fusion.rrf import rrf


def ids(fused):
    return [f.id for f in fused]


def test_an_entity_branch_cannot_push_the_anchor_out_of_the_top_by_rank_alone():
    anchor = ["a", "b", "c"]
    entity = ["x", "c"]
    # plain RRF, k=5: x 1/6=.1667, a 1/6 (ties: best rank 1, a's list first), b 1/7=.1429,
    # c 1/8 + 1/7 = .2679 -> c, a, x, b
    assert ids(rrf([anchor, entity], k=5)) == ["c", "a", "x", "b"]
    # anchored, share .3: a .1667, b .1429, c .125 + .3/7 = .1679, x .3/6 = .05 -> c, a, b, x
    fused = anchored_rrf([anchor, entity], k=5, share=0.3)
    assert ids(fused) == ["c", "a", "b", "x"]
    assert fused[0].score == pytest.approx(1 / 8 + 0.3 / 7)
    assert fused[-1].score == pytest.approx(0.3 / 6) and fused[-1].ranks == {1: 1}


def test_the_anchor_is_any_list_and_weights_multiply_the_share():
    lists = [["x", "y"], ["y", "z"]]
    # anchor 1 with planner weights (0.5, 1.0), share .5: x .5*.5/6 = .04167, y .5*.5/7 +
    # 1/6 = .2024, z 1/7 = .1429
    fused = anchored_rrf(lists, weights=[0.5, 1.0], anchor=1, k=5, share=0.5)
    assert ids(fused) == ["y", "z", "x"]
    assert fused[2].score == pytest.approx(0.5 * 0.5 / 6)


def test_without_an_anchor_it_is_weighted_rrf():
    lists = [["x", "y"], ["y", "z"], ["q"]]
    weights = [1.0, 0.5, 0.2]
    for anchor in (None, 7):  # none planned, or the question's branch failed
        got = anchored_rrf(lists, weights=weights, anchor=anchor, k=60, share=0.1)
        want = rrf(lists, weights=weights, k=60)
        assert [(f.id, round(f.score, 12)) for f in got] == [(f.id, round(f.score, 12))
                                                            for f in want]


def test_agreement_adds_per_extra_list_and_ties_keep_the_rrf_order():
    lists = [["a", "b"], ["b", "c"], ["c"]]
    # k=5, share 1 (plain), agreement .6 -> bonus .6/6 = .1 per extra list holding the id:
    # a 1/6 = .1667; b 1/7 + 1/6 + .1 = .4095; c 1/7 + 1/6 + .1 = .4095 (tie: best rank 1 for
    # both; b reached it first in list 1, c in list 2) -> b, c, a
    fused = anchored_rrf(lists, k=5, share=1.0, agreement=0.6)
    assert ids(fused) == ["b", "c", "a"]
    assert fused[0].score == pytest.approx(1 / 7 + 1 / 6 + 0.1)
    assert anchored_rrf(lists, k=5, share=1.0, agreement=0.6, limit=1)[0].id == "b"


@pytest.mark.parametrize("kw", [{"share": 1.5}, {"share": -0.1}, {"agreement": -1},
                                {"weights": [1.0]}])
def test_bad_parameters_are_refused(kw):
    with pytest.raises(ValueError):
        anchored_rrf([["a"], ["b"]], **kw)


def test_the_head_is_anchored_and_the_tail_follows_plain_rrf():
    anchor, entity = ["a", "b", "c"], ["x", "y"]
    # anchored (k=5, share .2): a .1667, b .1429, c .125, x .0333, y .0286 -> head a, b
    # plain RRF: a 1/6, x 1/6 (tie: a's list first), b 1/7, y 1/7 (b's list first), c 1/8
    # -> the tail is x, y, c (the entity branch's finds before the anchor's third chunk)
    assert ids(anchored_rrf([anchor, entity], k=5, share=0.2, head=2)) == ["a", "b", "x", "y", "c"]
    assert ids(anchored_rrf([anchor, entity], k=5, share=0.2, head=None)) == [
        "a", "b", "c", "x", "y"]
    assert ids(anchored_rrf([anchor, entity], k=5, share=0.2, head=2, limit=3)) == ["a", "b", "x"]


def test_the_planner_launches_an_entity_branch_only_where_it_adds_one():
    from branchsearch.orchestrator.plan import HeuristicPlanner

    planner = HeuristicPlanner("v1")  # the default (v2) launches no entity branch at all
    two = planner.plan("What government position was held by the woman who portrayed Corliss "
                       "Archer in the film Kiss and Tell?", 3)
    assert [s.kind for s in two] == ["original", "entity"]  # one branch, not one per entity
    assert two[1].text.startswith("Corliss Archer")
    one = planner.plan("Who was the first president of the association which published Journal "
                       "of Psychotherapy Integration?", 3)
    assert [s.kind for s in one] == ["original"]  # a lone entity branch restates the question
    compared = planner.plan("Were Scott Derrickson and Ed Wood of the same nationality?", 3)
    assert [s.kind for s in compared] == ["original", "comparison", "comparison"]


# --- properties (hypothesis) ------------------------------------------------------------------

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_lists = st.lists(st.lists(st.sampled_from("abcdefghijkl"), unique=True, max_size=10),
                  min_size=1, max_size=4)


@given(_lists, st.sampled_from([0.0, 0.2, 0.5, 1.0]), st.sampled_from([None, 3, 5]))
def test_fusion_reorders_the_union_and_never_adds_or_loses_an_item(lists, share, head):
    fused = ids(anchored_rrf(lists, share=share, head=head))
    assert sorted(fused) == sorted({x for lst in lists for x in lst})
    assert fused == ids(anchored_rrf([list(x) for x in lists], share=share, head=head))


@given(_lists, st.sampled_from([3, 5]))
def test_with_share_0_the_head_is_the_anchor_s_own_top(lists, head):
    # other branches cannot reach the head at all; they only fill it when the anchor is short
    fused = ids(anchored_rrf(lists, share=0.0, head=head))
    own = lists[0][:head]
    assert fused[:len(own)] == own


@given(_lists)
def test_share_1_without_agreement_is_plain_weighted_rrf(lists):
    assert ids(anchored_rrf(lists, share=1.0, k=5)) == ids(rrf(lists, k=5))
