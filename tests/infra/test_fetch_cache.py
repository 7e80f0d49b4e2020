"""The per-question fetch cache (infra/retrieval/fetch_cache.py) on real backends (tantivy + Milvus Lite +
docstore over the hotpot-mini fixture): a cached search equals the uncached one whatever the
exclusion, branches of one question searching the same thing cause one backend request, and the
cache dies with its question — in-process and on a real local Ray cluster."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from branchsearch.infra.errors import BadQuery
from branchsearch.infra.retrieval.fetch_cache import FetchCaches, QuestionCache
from branchsearch.infra.stores.hits import Hit

from conftest import ingest_copy

QUERIES = ["Corliss Archer", "Kiss and Tell film", "Scott Derrickson", "Ed Wood director",
           "American magazine", "government position"]
Q3 = "Were Scott Derrickson and Ed Wood of the same nationality?"


def search(retriever, query, mode, k, exclude, cache=None, groups=None):
    [value] = retriever.call_many([("search", (query,), {
        "mode": mode, "k": k, "exclude_ids": exclude, "acl_groups": groups})], cache=cache)
    if isinstance(value, Exception):
        raise value
    return value


def rows(hits: list[Hit]) -> list[tuple]:
    return [(h.chunk_id, h.doc_id, h.score, h.rank, h.source, h.text, h.title, h.ranks)
            for h in hits]


def delta(retriever, before) -> dict:
    return {k: v - before.get(k, 0) for k, v in retriever.backend_requests.items()
            if v - before.get(k, 0)}


@pytest.fixture(scope="module")
def universe(hotpot_retriever):
    """Ids worth excluding: every query's unexcluded top 60, each mode."""
    ids = set()
    for q in QUERIES:
        for mode in ("bm25", "dense"):
            ids |= {h.chunk_id for h in search(hotpot_retriever, q, mode, 60, [])}
    return sorted(ids)


def test_tantivy_and_exact_milvus_are_cached_by_prefix(hotpot_retriever, monkeypatch):
    assert hotpot_retriever._prefix_exact("bm25") and hotpot_retriever._prefix_exact("grep")
    assert hotpot_retriever.dense.index_kind == "FLAT"  # Milvus Lite: exact search
    assert hotpot_retriever._prefix_exact("dense")
    # an approximate index's list depends on the limit: cached by the whole request
    monkeypatch.setattr(hotpot_retriever.dense, "index_kind", "HNSW")
    assert not hotpot_retriever._prefix_exact("dense")


def test_tied_dense_scores_cached_equal_uncached(tmp_path):
    """Duplicate chunks score alike on Milvus Lite; a list cached unexcluded and filtered here
    equals the backend's own excluded top k for every k and exclusion (settled ties: score,
    then chunk id)."""
    import itertools
    import json

    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.infra.index.open import open_retriever
    from branchsearch.infra.config.settings import load_settings

    docs = [{"_id": f"dup-{i}", "title": "Acme", "text": "The Acme merger plan."}
            for i in range(7)] + [{"_id": "other", "title": "Other", "text": "A river."}]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    settings = load_settings(overrides={"home": str(tmp_path / "home"), "index": "ties"},
                             read_env=False, read_file=False)
    ingest(tmp_path / "corpus.jsonl", settings)
    r = open_retriever(settings)
    try:
        ids = [f"dup-{i}#p0" for i in range(7)]
        for k, n in itertools.product((1, 2, 3, 5), (0, 1, 3, 6)):
            for exclude in (ids[:n], ids[-n:] if n else [], ids[1:1 + n]):
                cache = QuestionCache(margin=0.0)
                search(r, "Acme merger", "dense", 2, [], cache)  # a shallow list first
                got = search(r, "Acme merger", "dense", k, exclude, cache)
                assert rows(got) == rows(search(r, "Acme merger", "dense", k, exclude)), \
                    (k, exclude)
    finally:
        r.close()


def test_groups_written_two_ways_are_one_key_and_different_groups_are_not(tmp_path):
    """'ab' (one group) and ['a', 'b'] (two) must not share a cached list: the first sees a
    document restricted to 'ab', the second must not."""
    import json

    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.infra.index.open import open_retriever
    from branchsearch.infra.config.settings import load_settings

    docs = [{"_id": "secret", "title": "Secret plan", "text": "The merger plan with Acme.",
             "acl": ["ab"]},
            {"_id": "pub", "title": "Public plan", "text": "A public plan about Acme.",
             "acl": []}]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    settings = load_settings(overrides={"home": str(tmp_path / "home"), "index": "a",
                                        "search_mode": "bm25"}, read_env=False, read_file=False)
    ingest(tmp_path / "corpus.jsonl", settings, dense=False)
    r = open_retriever(settings, need_dense=False)
    try:
        cache = QuestionCache()
        ids = lambda **kw: [h.chunk_id for h in r.search("Acme plan", "bm25", 5, **kw)]
        assert "secret#p0" in ids(acl_groups="ab", cache=cache)
        assert ids(acl_groups=["a", "b"], cache=cache) == ids(acl_groups=["a", "b"]) \
            == ["pub#p0"]
        before = dict(r.backend_requests)
        assert ids(acl_groups=["b", "a", "a"], cache=cache) == ["pub#p0"]  # the same groups
        assert delta(r, before) == {}
    finally:
        r.close()


@hsettings(max_examples=60, deadline=None,
           suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_cached_search_equals_uncached_for_any_exclusion(hotpot_retriever, universe, data):
    """Branches of one question exclude different ids; each gets exactly what an uncached
    search (the backends' own exclusion, before RRF) gives it, hybrid included."""
    cache = QuestionCache(margin=data.draw(st.sampled_from([0.0, 1.0])))
    for _ in range(data.draw(st.integers(1, 4))):  # several branches, one cache
        query = data.draw(st.sampled_from(QUERIES))
        mode = data.draw(st.sampled_from(["bm25", "dense", "hybrid"]))
        k = data.draw(st.integers(1, 20))
        exclude = data.draw(st.lists(st.sampled_from(universe), max_size=40, unique=True))
        exclude += data.draw(st.lists(st.just("no-such-chunk"), max_size=1))
        want = search(hotpot_retriever, query, mode, k, exclude)
        got = search(hotpot_retriever, query, mode, k, exclude, cache)
        assert rows(got) == rows(want), (query, mode, k, len(exclude))


@hsettings(max_examples=25, deadline=None,
           suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pattern=st.sampled_from(["corliss.*", "wood", "19[0-9]{2}", "magazin.*"]),
       k=st.integers(1, 15), cut=st.integers(0, 30))
def test_cached_grep_equals_uncached(hotpot_retriever, pattern, k, cut):
    everything = hotpot_retriever.grep(pattern, 60)
    exclude = [h.chunk_id for h in everything[::2]][:cut]
    cache = QuestionCache(margin=0.0)
    hotpot_retriever.call_many([("grep", (pattern,), {"k": 3})], cache=cache)  # shallow first
    [got] = hotpot_retriever.call_many([("grep", (pattern,), {"k": k, "exclude_ids": exclude})],
                                       cache=cache)
    assert rows(got) == rows(hotpot_retriever.grep(pattern, k, exclude))


def test_two_branches_searching_one_entity_make_one_backend_request(hotpot_retriever):
    cache = QuestionCache()
    before = dict(hotpot_retriever.backend_requests)
    first = search(hotpot_retriever, "Scott Derrickson", "hybrid", 8, [], cache)
    seen = [h.chunk_id for h in first[:3]]  # the second branch has already seen some of them
    second = search(hotpot_retriever, "Scott Derrickson", "hybrid", 8, seen, cache)
    # each backend asked once for both (their lists cached unexcluded)
    assert delta(hotpot_retriever, before) == {"bm25": 1, "dense": 1}
    assert cache.stats["hits"] == 2 and cache.stats["misses"] == 2
    before = dict(hotpot_retriever.backend_requests)
    assert rows(second) == rows(search(hotpot_retriever, "Scott Derrickson", "hybrid", 8, seen))
    assert delta(hotpot_retriever, before) == {"bm25": 1, "dense": 1}  # uncached: asks again
    before = dict(hotpot_retriever.backend_requests)
    assert rows(search(hotpot_retriever, "Scott Derrickson", "hybrid", 8, seen, cache)) \
        == rows(second)
    assert delta(hotpot_retriever, before) == {}  # the same request again: all from the cache


def test_a_questions_chunk_rows_are_read_once(hotpot_retriever):
    cache = QuestionCache()
    asked: list[str] = []
    read = hotpot_retriever.docstore.get_chunks

    def counting(ids):
        asked.extend(ids)
        return read(ids)
    hotpot_retriever.docstore.get_chunks = counting
    try:
        first = search(hotpot_retriever, "Scott Derrickson", "hybrid", 8, [], cache)
        again = search(hotpot_retriever, "Scott Derrickson", "hybrid", 8,
                       [h.chunk_id for h in first[:3]], cache)
        other = search(hotpot_retriever, "Ed Wood", "bm25", 8, [], cache)
    finally:
        hotpot_retriever.docstore.get_chunks = read
    assert len(asked) == len(set(asked))  # no row read twice
    assert set(asked) == {h.chunk_id for h in first + again + other}
    assert cache.stats["rows_cached"] > 0 and cache.stats["rows_read"] == len(asked)
    for hits, args in ((again, ("Scott Derrickson", "hybrid", 8, [h.chunk_id for h in first[:3]])),
                       (other, ("Ed Wood", "bm25", 8, []))):  # as uncached
        assert [(h.chunk_id, h.text, h.title, h.text_tokens, h.label_tokens, h.head)
                for h in hits] == [(h.chunk_id, h.text, h.title, h.text_tokens, h.label_tokens,
                                    h.head) for h in search(hotpot_retriever, *args)]


def test_a_deeper_exclusion_fetches_again_deeper_and_stays_exact(hotpot_retriever):
    cache = QuestionCache(margin=0.0)
    top = search(hotpot_retriever, "Ed Wood director film", "bm25", 30, [])
    assert len(top) >= 15
    search(hotpot_retriever, "Ed Wood director film", "bm25", 5, [], cache)  # depth 5 cached
    before = dict(hotpot_retriever.backend_requests)
    seen = [h.chunk_id for h in top[:10]]
    got = search(hotpot_retriever, "Ed Wood director film", "bm25", 5, seen, cache)
    assert delta(hotpot_retriever, before) == {"bm25": 1} and cache.stats["deeper"] == 1
    assert [h.chunk_id for h in got] == [h.chunk_id for h in top[10:15]]
    assert [h.rank for h in got] == [1, 2, 3, 4, 5]


def test_concurrent_misses_fetch_once(hotpot_retriever):
    cache, n = QuestionCache(), 6
    barrier, out = threading.Barrier(n), [None] * n
    before = dict(hotpot_retriever.backend_requests)

    def branch(i):
        barrier.wait()
        out[i] = search(hotpot_retriever, "American magazine", "bm25", 8, [], cache)

    threads = [threading.Thread(target=branch, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert delta(hotpot_retriever, before) == {"bm25": 1}
    assert cache.stats["misses"] == 1 and cache.stats["hits"] == n - 1  # the rest waited
    assert all(rows(o) == rows(out[0]) for o in out)
    out[0][0].text = "changed by one branch"  # every caller got its own hits
    assert out[1][0].text != "changed by one branch"


def test_acl_groups_are_part_of_the_key(hotpot_retriever):
    cache = QuestionCache()
    before = dict(hotpot_retriever.backend_requests)
    a = search(hotpot_retriever, "Corliss Archer", "bm25", 8, [], cache, groups=["*"])
    b = search(hotpot_retriever, "Corliss Archer", "bm25", 8, [], cache, groups=None)
    c = search(hotpot_retriever, "Corliss Archer", "bm25", 8, [], cache, groups=["team-x"])
    assert delta(hotpot_retriever, before) == {"bm25": 3}
    for got, groups in ((a, ["*"]), (b, None), (c, ["team-x"])):
        assert rows(got) == rows(search(hotpot_retriever, "Corliss Archer", "bm25", 8, [],
                                        groups=groups))


def test_read_document_is_read_once_per_question_and_keeps_its_acl(hotpot_retriever):
    cache = QuestionCache()
    before = dict(hotpot_retriever.backend_requests)
    reqs = [("read_document", ("ed-wood", 0, 2), {"acl_groups": None}),
            ("read_document", ("ed-wood", 1, 3), {"acl_groups": None})]
    got = hotpot_retriever.call_many(reqs, cache=cache)
    got += hotpot_retriever.call_many(reqs[:1], cache=cache)
    assert delta(hotpot_retriever, before) == {"doc": 1}  # the document with its chunks
    want = hotpot_retriever.call_many(reqs + reqs[:1])
    assert got == want and got[0]["chunks"] and got[0] is not got[2]
    got[0]["chunks"].clear()  # the caller's copy; the cached rows stay as read
    assert hotpot_retriever.call_many(reqs[:1], cache=cache)[0] == want[0]
    [missing] = hotpot_retriever.call_many([("read_document", ("no-such-doc",), {})],
                                           cache=cache)
    assert isinstance(missing, BadQuery)


def test_a_failed_fetch_reaches_the_waiters_and_is_not_kept():
    cache, started, release = QuestionCache(), threading.Event(), threading.Event()
    errors = []

    def failing(depth):
        started.set()
        release.wait(10)
        raise ConnectionError("backend down")

    def unexpected(depth):
        raise AssertionError("a waiter fetched while the first fetch was in flight")

    def branch(fetch):
        try:
            cache.ranked("key", 3, [], fetch, 100)
        except ConnectionError as exc:
            errors.append(exc)

    first = threading.Thread(target=branch, args=(failing,))
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=branch, args=(unexpected,))
    second.start()
    for _ in range(1000):
        if cache.stats["waits"]:
            break
        threading.Event().wait(0.01)
    release.set()
    first.join(10)
    second.join(10)
    assert len(errors) == 2 and cache.stats["misses"] == 1  # both saw the one failure
    assert len(cache) == 0  # nothing kept: the next call fetches again
    hit = Hit("c1", "d1", 1.0, 1, "bm25")
    assert [h.chunk_id for h in cache.ranked("key", 3, [], lambda d: [hit], 100)] == ["c1"]
    assert cache.stats["misses"] == 2


def test_memory_is_bounded_oldest_first():
    cache = QuestionCache(max_items=10, margin=0.0)
    for q in range(5):
        cache.ranked(("bm25", q), 4, [], lambda d, q=q: [Hit(f"{q}-{i}", "d", 1.0 / (i + 1))
                                                          for i in range(d)], 1000)
    assert len(cache) == 2 and cache.stats["evicted"] == 3 and cache._size <= 10
    assert list(cache._entries) == [("bm25", 3), ("bm25", 4)]
    # a list the backend had no more of is complete: a deep exclusion needs no refetch
    cache.ranked("short", 5, [], lambda d: [Hit("x", "d", 1.0)], 1000)
    assert [h.chunk_id for h in cache.ranked("short", 5, ["y", "z"], None, 1000)] == ["x"]


def test_question_caches_die_with_their_question():
    caches = FetchCaches(max_questions=2)
    a = caches.get("q1")
    assert caches.get("q1") is a and caches.get(None) is None
    a.once("k", lambda: 1)
    assert caches.end("q1") == {"misses": 1} and len(caches) == 0
    assert caches.get("q1") is None  # a straggler of an ended question is served uncached
    for q in ("q2", "q3", "q4"):  # abandoned questions: the oldest goes
        caches.get(q)
    assert len(caches) == 2 and caches.end("q2") == {}


def test_local_driver_same_result_fewer_backend_requests(hotpot_settings):
    """The question's branches share one cache in-process; nothing outlives the question."""
    from branchsearch.orchestrator.driver import Driver

    out = {}
    for on in (False, True):
        driver = Driver(hotpot_settings.replace(fetch_cache=on, branches=3, skip_covered=False),
                        mode="local")
        try:
            r = driver.search(Q3)
            out[on] = (r, dict(driver.executor.retriever.backend_requests),
                       driver.executor.last_cache_stats)
        finally:
            driver.close()
    (off, off_requests, off_stats), (on, on_requests, on_stats) = out[False], out[True]
    assert len(on.branches) >= 2 and on.status == "ok"
    assert on.ranked_chunk_ids == off.ranked_chunk_ids and on.evidence == off.evidence
    assert [b.ranked_chunk_ids for b in on.branches] == [b.ranked_chunk_ids
                                                          for b in off.branches]
    assert off_stats == {} and on_stats["hits"] > 0
    assert sum(on_requests.values()) < sum(off_requests.values()), (on_requests, off_requests)


@pytest.mark.ray
def test_ray_branches_share_one_replica_cache(hotpot_settings):
    """On a real local Ray cluster: same evidence with the cache on and off; on, the question's
    branches share the replica's cache (hits), and the cache is gone once the question is."""
    import ray

    from branchsearch.orchestrator.driver import Driver

    settings = ingest_copy(hotpot_settings, "hotpot-fetchcache").replace(
        branches=3, branch_timeout_s=120, search_mode="bm25", skip_covered=False)
    got = {}
    try:
        for on in (False, True):
            driver = Driver(settings.replace(fetch_cache=on), mode="ray", pool_size=3)
            try:
                r = driver.search(Q3)
                assert r.status == "ok", [b.error for b in r.branches]
                # the question's end is sent, not awaited, to a threaded actor: a stats call
                # right after can run first (a CI failure); wait until the question is gone
                deadline = time.time() + 30
                while True:
                    stats = ray.get(driver.executor.retrievers[0].fetch_stats.remote())
                    if stats["live_questions"] == 0 or time.time() > deadline:
                        break
                    time.sleep(0.1)
                got[on] = (r.ranked_chunk_ids, [b.ranked_chunk_ids for b in r.branches], stats)
                assert driver.executor.balancer.load == [0]
            finally:
                driver.close()
    finally:
        ray.shutdown()
    assert got[True][:2] == got[False][:2] and len(got[True][1]) >= 2
    on, off = got[True][2], got[False][2]
    assert off["cache"] == {} and on["cache"]["hits"] > 0 and on["live_questions"] == 0
    assert sum(on["backend_requests"].values()) < sum(off["backend_requests"].values())


# one branch in the first wave, then a bridge, then a bridge of the bridge (the defaults)
CHAINED = ("What government position was held by the woman who portrayed Corliss Archer in the "
           "film Kiss and Tell?")


def _waves_on_and_off(settings, mode: str) -> dict:
    """The chained question with the fetch cache on and off: the rankings, each branch's kind,
    and the backend requests (on Ray, the replica's counters once the question is gone)."""
    import ray

    from branchsearch.orchestrator.driver import Driver

    got = {}
    for on in (False, True):
        driver = Driver(settings.replace(fetch_cache=on), mode=mode, pool_size=3)
        try:
            r = driver.search(CHAINED)
            assert r.status == "ok", [b.error for b in r.branches]
            if mode == "ray":
                deadline = time.time() + 30  # the question's end is sent, not awaited
                while True:
                    stats = ray.get(driver.executor.retrievers[0].fetch_stats.remote())
                    if stats["live_questions"] == 0 or time.time() > deadline:
                        break
                    time.sleep(0.1)
                requests, hits = stats["backend_requests"], stats["cache"].get("hits", 0)
                assert stats["live_questions"] == 0 and driver.executor.balancer.load == [0]
            else:
                requests = dict(driver.executor.retriever.backend_requests)
                hits = driver.executor.last_cache_stats.get("hits", 0)
            got[on] = (r.ranked_chunk_ids, [b.ranked_chunk_ids for b in r.branches],
                       [b.kind for b in r.branches], sum(requests.values()), hits)
        finally:
            driver.close()
    return got


def test_a_later_wave_reads_what_the_first_wave_fetched(hotpot_settings):
    """One cache for all of a question's waves: the bridge and the bridge of the bridge, each a
    wave of one branch, read what the question's branch fetched instead of fetching it again.
    Same results, fewer backend requests."""
    got = _waves_on_and_off(hotpot_settings, "local")
    (off_ranked, off_lists, kinds, off_requests, _), on = got[False], got[True]
    assert kinds == ["original", "bridge", "bridge"] == on[2]
    assert on[:2] == (off_ranked, off_lists)
    assert on[4] > 0 and on[3] < off_requests, (on[3:], off_requests)


def test_a_question_of_one_branch_reads_its_own_repeats_from_the_cache(hotpot_settings):
    """A lone branch has a question cache too: it searches a name again on a later turn and
    reads the same chunk rows turn after turn. Same ranking, fewer backend requests."""
    from branchsearch.orchestrator.driver import Driver

    got = {}
    for on in (False, True):
        driver = Driver(hotpot_settings.replace(fetch_cache=on), mode="local")
        try:
            r = driver.search(CHAINED, max_branches=1)
            got[on] = (r.ranked_chunk_ids, sum(driver.executor.retriever.backend_requests.values()),
                       driver.executor.last_cache_stats)
        finally:
            driver.close()
    assert len(r.branches) == 1 and got[True][0] == got[False][0]
    assert got[False][2] == {} and got[True][2]["rows_cached"] > 0
    assert got[True][1] < got[False][1], (got[True][1], got[False][1])


@pytest.mark.ray
def test_on_ray_a_later_wave_reads_the_first_waves_cache_on_its_replica(hotpot_settings):
    """The same on a real local Ray cluster: every wave's branches run on the replica that
    holds the question's cache, its load is released after each wave, and the cache is gone
    once the question is."""
    import ray

    settings = ingest_copy(hotpot_settings, "hotpot-waves").replace(branch_timeout_s=120)
    try:
        got = _waves_on_and_off(settings, "ray")
    finally:
        ray.shutdown()
    (off_ranked, off_lists, kinds, off_requests, _), on = got[False], got[True]
    assert kinds == ["original", "bridge", "bridge"] == on[2]
    assert on[:2] == (off_ranked, off_lists)
    assert on[4] > 0 and on[3] < off_requests, (on[3:], off_requests)


def test_a_question_takes_one_replica_weighted_by_its_branches():
    from branchsearch.orchestrator.execution.balancer import ReplicaBalancer

    b = ReplicaBalancer(2)
    first = b.take(3)  # a 3-branch question on one replica counts 3
    second = b.take()  # the next branch goes to the other
    third = b.take()
    assert second != first and third != first and b.load[first] == 3
    b.done(first, 3)
    assert b.load[first] == 0


def test_a_question_in_use_is_not_the_one_evicted():
    caches = FetchCaches(max_questions=2)
    a = caches.get("A")
    caches.get("B")
    assert caches.get("A") is a  # A asks again: it is in use
    caches.get("C")  # one too many: the least recently used (B) goes, not A
    assert caches.get("A") is a and len(caches) == 2


def test_hybrid_on_an_index_ingested_without_vectors_is_its_bm25_side(tmp_path):
    """The default mode (hybrid) on a --no-dense index: BM25's hits, not an error that leaves a
    branch 'ok' with no evidence; an explicit dense search still says what is missing."""
    from conftest import HOTPOT

    from branchsearch.infra.errors import BadQuery
    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.infra.index.open import open_retriever
    from branchsearch.infra.config.settings import load_settings

    settings = load_settings(overrides={"home": str(tmp_path), "index": "lex"},
                             read_env=False, read_file=False)
    ingest(HOTPOT, settings, dense=False)
    r = open_retriever(settings)
    try:
        hybrid = r.search("Scott Derrickson director", "hybrid", 5)
        assert hybrid and rows(hybrid) == rows(r.search("Scott Derrickson director", "bm25", 5))
        with pytest.raises(BadQuery, match="dense search needs"):
            r.search("Scott Derrickson director", "dense", 5)
    finally:
        r.close()


def test_a_questions_branch_queries_are_embedded_in_one_model_call(hotpot_settings, tmp_path,
                                                                    monkeypatch):
    """A question's branches embed their queries in one model call, not one call each; the
    rankings equal those of branches embedding one by one (no fetch cache)."""
    from branchsearch.orchestrator.driver import Driver

    def search(settings, cache_file: str) -> tuple[list[list[str]], object]:
        driver = Driver(settings, mode="local")
        try:
            embedder = driver.executor.retriever.embedder
            embedder.cache_at(tmp_path / cache_file)  # the queries are new to it
            model = embedder._load()
            calls: list[list[str]] = []
            encode = model.encode
            monkeypatch.setattr(model, "encode", lambda texts, *a, **k: (
                calls.append(list(texts)), encode(texts, *a, **k))[1])
            return calls, driver.search(Q3, max_branches=3).to_dict()
        finally:
            monkeypatch.undo()
            driver.close()

    every = hotpot_settings.replace(skip_covered=False)  # all three branches run
    calls, together = search(every, "together.sqlite")
    subqueries = [b["subquery"] for b in together["branches"]]
    assert len(subqueries) == 3 and calls[0] == subqueries, calls
    assert not [c for c in calls[1:] if set(c) & set(subqueries)], calls  # none asked again
    calls, alone = search(every.replace(fetch_cache=False), "alone.sqlite")
    assert [c for c in calls if set(c) & set(subqueries)] == [[q] for q in subqueries], calls
    assert together["ranked_chunk_ids"] == alone["ranked_chunk_ids"]
