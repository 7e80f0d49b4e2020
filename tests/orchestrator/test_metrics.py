import math

from branchsearch.orchestrator.evaluation.measures import (all_recall_at, doc_ranking, ndcg_at, percentile, recall_at,
                                  single_shot_metrics)


def test_doc_ranking_collapses_to_best_chunk():
    assert doc_ranking(["b#p1", "a#p0", "b#p0", "c#p2"]) == ["b", "a", "c"]


def test_recall_and_all_recall_by_hand():
    ranking = ["x", "g1", "y", "z", "g2", "w"]
    gold = {"g1": 1, "g2": 1}
    assert recall_at(ranking, gold, 2) == 0.5
    assert recall_at(ranking, gold, 5) == 1.0
    assert all_recall_at(ranking, gold, 2) == 0.0
    assert all_recall_at(ranking, gold, 5) == 1.0


def test_ndcg_by_hand():
    # gains at positions 2 and 5: 1/log2(3) + 1/log2(6); ideal 1 + 1/log2(3)
    ranking = ["x", "g1", "y", "z", "g2"]
    expected = (1 / math.log2(3) + 1 / math.log2(6)) / (1 + 1 / math.log2(3))
    assert abs(ndcg_at(ranking, {"g1": 1, "g2": 1}) - expected) < 1e-12
    assert ndcg_at(["g1"], {"g1": 2}) == 1.0
    m = single_shot_metrics(["g1"], {"g1": 1, "g2": 1})
    assert m["recall@2"] == 0.5 and m["all_recall@10"] == 0.0


def test_percentile():
    assert percentile([3, 1, 2], 50) == 2
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([], 50) == 0.0
