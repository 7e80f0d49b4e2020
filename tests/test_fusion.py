from hypothesis import given
from hypothesis import strategies as st

from branchsearch.fusion import rrf

ids = st.lists(st.sampled_from("abcdefghij"), unique=True, max_size=10)


def test_hand_computed_case():
    # a: 1/(60+1) + 1/(60+3) ; b: 1/(60+2) + 1/(60+1) ; c: 1/(60+3) ; d: 1/(60+2)
    fused = rrf([["a", "b", "c"], ["b", "d", "a"]])
    assert [f.id for f in fused] == ["b", "a", "d", "c"]
    assert abs(fused[0].score - (1 / 62 + 1 / 61)) < 1e-12
    assert fused[0].ranks == {0: 2, 1: 1}


def test_weights_and_k():
    fused = rrf([["a"], ["b"]], weights=[1.0, 2.0], k=1)
    assert [f.id for f in fused] == ["b", "a"]
    assert fused[0].score == 1.0 and fused[1].score == 0.5


def test_ties_break_by_best_rank_then_list_then_id():
    # x and y tie on score; both reach rank 1, x in list 0 -> x first
    assert [f.id for f in rrf([["x", "y"], ["y", "x"]])] == ["x", "y"]
    # single list entries with equal scores across lists: list order decides
    assert [f.id for f in rrf([["q"], ["p"]])] == ["q", "p"]


def test_duplicates_in_one_list_count_once():
    fused = rrf([["a", "a", "b"]])
    assert fused[0].score == 1 / 61 and fused[1].ranks == {0: 3}


def test_bad_arguments():
    import pytest

    with pytest.raises(ValueError):
        rrf([["a"]], k=0)
    with pytest.raises(ValueError):
        rrf([["a"]], weights=[1, 2])


@given(st.lists(ids, min_size=1, max_size=5), st.sampled_from("abcdefghij"))
def test_first_everywhere_stays_first(lists, top):
    lists = [[top] + [x for x in lst if x != top] for lst in lists]
    assert rrf(lists)[0].id == top


@given(st.lists(ids, min_size=1, max_size=5))
def test_union_sorted_and_deterministic(lists):
    fused = rrf(lists)
    assert {f.id for f in fused} == {x for lst in lists for x in lst}
    assert all(a.score >= b.score for a, b in zip(fused, fused[1:]))
    assert [f.id for f in fused] == [f.id for f in rrf([list(x) for x in lists])]


@given(st.lists(ids, min_size=2, max_size=5))
def test_list_order_does_not_change_scores(lists):
    a = {f.id: f.score for f in rrf(lists)}
    b = {f.id: f.score for f in rrf(list(reversed(lists)))}
    assert a.keys() == b.keys() and all(abs(a[x] - b[x]) < 1e-12 for x in a)
