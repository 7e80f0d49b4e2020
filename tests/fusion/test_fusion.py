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


# --- exact ties -------------------------------------------------------------------------------

def _reference(lists, weights, k):
    """A second implementation, sorting every item by its exact score and the documented
    tie-break (best rank, first list reaching it, id)."""
    from fractions import Fraction

    scores, ranks = {}, {}
    for li, (lst, w) in enumerate(zip(lists, weights)):
        for r, item in enumerate(lst, start=1):
            if li in ranks.setdefault(item, {}):
                continue
            ranks[item][li] = r
            scores[item] = scores.get(item, 0) + Fraction(repr(w)) / (Fraction(repr(k)) + r)

    def key(item):
        best = min(ranks[item].values())
        return (-scores[item], best, min(li for li, r in ranks[item].items() if r == best),
                str(item))

    return sorted(scores, key=key), scores


def test_k5_ranks_5_and_10_tie_with_rank_1():
    # 1/(5+5) + 1/(5+10) = 1/10 + 1/15 = 1/6 = 1/(5+1); as floats the sum is one step above 1/6
    assert 1 / 10 + 1 / 15 > 1 / 6
    a_lists = [[f"p{i}" for i in range(4)] + ["a"],  # a at rank 5
               [f"q{i}" for i in range(9)] + ["a"]]  # and at rank 10
    fused = rrf([*a_lists, ["b"]], k=5)
    # four items score exactly 1/6: p0, q0 and b at rank 1, a at ranks 5 + 10. Tie-break: best
    # rank (1 beats 5, so a is last of the four), then the first list reaching it
    assert [f.id for f in fused[:4]] == ["p0", "q0", "b", "a"]
    assert {f.score for f in fused[:4]} == {1 / 6} and fused[4].score < 1 / 6
    assert [f.id for f in rrf([["b"], *a_lists], k=5)[:4]] == ["b", "p0", "q0", "a"]


def test_decimal_weights_tie_exactly():
    # 0.1 + 0.2 != 0.3 in floats, but weights are read as the decimals they print as
    fused = rrf([["x"], ["x"], ["y"]], weights=[0.1, 0.2, 0.3], k=1)
    assert [f.id for f in fused] == ["x", "y"]  # tie; both rank 1; x's first list is 0
    assert fused[0].score == fused[1].score


@given(st.lists(st.lists(st.sampled_from("abcdefghijkl"), unique=True, min_size=1, max_size=12),
                min_size=1, max_size=5),
       st.data())
def test_order_matches_exact_reference(lists, data):
    k = data.draw(st.sampled_from([1, 2, 3, 5, 6, 10, 60]))
    weights = data.draw(st.lists(st.sampled_from([1, 2, 3, 0.5, 0.1, 0.2, 0.3, 1.5]),
                                 min_size=len(lists), max_size=len(lists)))
    expected, scores = _reference(lists, weights, k)
    fused = rrf(lists, weights=weights, k=k)
    assert [f.id for f in fused] == expected
    assert all(abs(f.score - float(scores[f.id])) <= 1e-15 * f.score for f in fused)
    for a, b in zip(fused, fused[1:]):  # exactly equal scores are reported as equal floats
        assert (a.score == b.score) == (scores[a.id] == scores[b.id])
    assert all(a.score >= b.score for a, b in zip(fused, fused[1:]))
    limit = data.draw(st.integers(min_value=0, max_value=len(fused) + 1))
    assert rrf(lists, weights=weights, k=k, limit=limit) == fused[:limit]  # stops early, same


def test_every_two_rank_tie_uses_the_tie_break():
    """Every item at ranks r1, r2 whose score equals one rank r exactly (k 1..12, ranks 1..40):
    equal reported scores, and the rank-r item first (its best rank r is below r1 and r2)."""
    from fractions import Fraction

    ties = 0
    for k in range(1, 13):
        for r1 in range(1, 41):
            for r2 in range(r1, 41):
                total = Fraction(1, k + r1) + Fraction(1, k + r2)
                if total.numerator != 1 or total.denominator <= k:
                    continue  # no single rank scores the same
                r = total.denominator - k
                lists = [[f"p{i}" for i in range(r1 - 1)] + ["two"],
                         [f"q{i}" for i in range(r2 - 1)] + ["two"],
                         [f"s{i}" for i in range(r - 1)] + ["one"]]
                fused = rrf(lists, k=k)
                order = [f.id for f in fused]
                by_id = {f.id: f for f in fused}
                assert by_id["one"].score == by_id["two"].score, (k, r1, r2)
                assert order.index("one") < order.index("two"), (k, r1, r2)
                ties += 1
    assert ties > 50  # the loop really met ties (k = 5, ranks 5 and 10 among them)
