from hypothesis import given
from hypothesis import strategies as st

from branchsearch.fusion import rrf
from branchsearch.fusion.admission import admit


def _ids(items):
    return [i.id for i in items]


def test_an_unadmitted_fresh_item_moves_below_the_window_and_the_rest_keep_their_order():
    fused = rrf([["a", "b", "c", "d"], ["x", "y", "a"]])
    assert _ids(fused) == ["a", "x", "b", "y", "c", "d"]
    # x and y are fresh (not the anchor's); y is admitted, x is not: x leaves the first 4
    out = admit(fused, own={"a", "b", "c", "d"}, admitted=lambda i: i == "y", window=4)
    assert _ids(out) == ["a", "b", "y", "c", "x", "d"]
    # admitted, it keeps its place
    assert _ids(admit(fused, {"a", "b", "c", "d"}, lambda i: True, window=4)) == _ids(fused)


def test_fresh_items_still_fill_places_the_anchor_left_empty():
    fused = rrf([["a"], ["x", "y"]], weights=[1.0, 0.5])
    assert _ids(admit(fused, {"a"}, lambda i: False, window=10)) == ["a", "x", "y"]


def test_admit_takes_any_key():
    pairs = [("d1", 1), ("f1", 2), ("d2", 3)]
    out = admit(pairs, {"d1", "d2"}, lambda i: False, window=2, key=lambda p: p[0])
    assert out == [("d1", 1), ("d2", 3), ("f1", 2)]


lists = st.lists(st.sampled_from("abcdefghijkl"), unique=True, max_size=12)


@given(lists, lists, st.integers(0, 12), st.sets(st.sampled_from("abcdefghijkl")))
def test_admission_is_a_permutation_that_keeps_the_own_items_order_and_bounds_fresh_ones(
        anchor, other, window, admitted):
    fused = rrf([anchor, other], weights=[1.0, 0.5])
    own = set(anchor)
    out = admit(fused, own, admitted.__contains__, window=window)
    assert sorted(_ids(out)) == sorted(_ids(fused))
    assert [i for i in _ids(out) if i in own] == [i for i in _ids(fused) if i in own]
    top = _ids(out)[:window]
    # an unadmitted fresh item is in the first `window` only where the own and admitted items
    # ran out
    if any(i not in own and i not in admitted for i in top):
        assert len([i for i in _ids(fused) if i in own or i in admitted]) < window
