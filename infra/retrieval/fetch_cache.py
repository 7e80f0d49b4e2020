"""What the branches of one question fetched, shared so that they do not all redo it.

The branches of a question search the same named entities and bridges (issue 15: a third of a
multi-branch question's searches repeat one of another branch). A `QuestionCache` lives for one
question and keeps what the backends answered; `FetchCaches` holds the live questions of a
retriever process (a `RetrieverActor`, or the local executor's retriever) by question id.

Results must be exactly those of an uncached search, and a branch excludes what *it* has seen
(`exclude_ids`, different per branch), so a ranked list is cached by (backend, query, groups)
*without* the exclusion: `ranked` asks the backend for `k + |exclude|` (+ a margin) hits, then
drops the excluded ones here and keeps `k`. That equals the backend's own excluded top k when
the backend's ranking is one total order whatever the depth and exclusion only removes
entries from it (tantivy, exact Milvus); `Retriever._prefix_exact` says which backends qualify — the others
are cached by their whole request (`once`), exclusion included (Milvus on an approximate
index, HNSW or IVF: its list depends on the limit).
When the cached depth is too shallow for a caller's exclusion, the list is fetched again,
deeper. Exclusion is applied per backend list, before any fusion (hybrid fuses the two lists
afterwards, in the retriever, as before).

The chunk rows that hydrate hits (text, title, counts) are read from the docstore once per
question too (`rows`).

Concurrent misses: the first caller of a key fetches; the others wait on its future (a failure
reaches every waiter, who retries through the harness as for any backend error). Memory is
bounded (`max_items` hits/values per question, least recently used evicted first; at most
`max_questions` live questions per process). A question's cache dies with it: `end(question)`;
a request for a question already ended is served uncached (a straggler never revives it).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from branchsearch.infra.stores.hits import Hit

MAX_ITEMS = 20_000  # cached hits (and values, chunk rows) per question
MAX_QUESTIONS = 64  # live question caches per retriever process


@dataclass
class _Entry:
    hits: tuple[Hit, ...] = ()  # `ranked`: the backend's unexcluded top `depth`
    depth: int = 0
    complete: bool = False  # the backend had fewer than `depth` hits: this is all of them
    value: object = None  # `once`: the value
    done: bool = False
    size: int = 0
    inflight: Future | None = field(default=None, repr=False)


def copy_hit(hit: Hit, rank: int) -> Hit:
    """A hit of its own for the caller (the retriever hydrates and renumbers hits in place)."""
    return replace(hit, rank=rank, ranks=dict(hit.ranks))


class QuestionCache:
    """One question's fetches. Thread-safe; every value handed out is the caller's own copy
    (or, for `once`, a value the caller must not change)."""

    def __init__(self, max_items: int = MAX_ITEMS, margin: float = 1.0):
        self.max_items = max_items
        self.margin = margin  # over-fetch this many times k beyond k + |exclude|
        self._queries: list[str] = []  # the branches' queries, not yet embedded (`expect`)
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()
        self.stats = Counter()  # hits, misses (backend fetches), waits, deeper, evicted,
        # rows_cached, rows_read (chunk rows: from the cache, from the docstore)

    def __len__(self) -> int:
        return len(self._entries)

    def expect(self, queries: Sequence[str]) -> None:
        """The question's branch queries, to embed together before the first is searched."""
        with self._lock:
            self._queries.extend(queries)

    def take_queries(self) -> list[str]:
        """The queries expected and not yet taken (each handed out once)."""
        with self._lock:
            queries, self._queries = self._queries, []
        return queries

    # --- ranked lists: prefix-exact backends -----------------------------------------------

    def ranked(self, key: Hashable, k: int, exclude: Sequence[str],
               fetch: Callable[[int], list[Hit]], max_depth: int) -> list[Hit] | None:
        """The top `k` of the backend's ranking for `key` without the ids in `exclude`,
        ranks 1..k. `fetch(depth)` asks the backend for its top `depth`, unexcluded. None when
        even `max_depth` cannot answer (the caller then asks the backend directly)."""
        excluded = set(exclude)
        need = k + len(excluded)
        if need > max_depth:
            return None
        depth = min(max_depth, need + int(self.margin * k))
        while True:
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None and entry.depth:
                    answer = _answer(entry, k, excluded)
                    if answer is not None:
                        self._entries.move_to_end(key)
                        self.stats["hits"] += 1
                        return answer
                if entry is not None and entry.inflight is not None:
                    future, mine = entry.inflight, False
                else:
                    if entry is None:
                        entry = self._entries[key] = _Entry()
                    elif entry.depth:
                        self.stats["deeper"] += 1
                        depth = max(depth, min(max_depth, 2 * entry.depth))
                    future = entry.inflight = Future()
                    mine = True
                self.stats["misses" if mine else "waits"] += 1
            if not mine:
                future.result()  # the fetcher's failure is ours too
                continue
            try:
                hits = fetch(depth)
            except BaseException as exc:
                with self._lock:
                    entry.inflight = None
                    if not entry.depth and self._entries.get(key) is entry:
                        del self._entries[key]
                future.set_exception(exc)
                raise
            with self._lock:
                entry.inflight = None
                if depth > entry.depth:
                    self._resize(entry, len(hits))
                    entry.hits = tuple(hits)
                    entry.depth, entry.complete = depth, len(hits) < depth
                self._keep(key, entry)
                answer = _answer(entry, k, excluded)
            future.set_result(None)
            if answer is not None:
                return answer
            # (only when a concurrent deeper fetch raced ours: ask again)

    # --- whole requests ---------------------------------------------------------------------

    def once(self, key: Hashable, fetch: Callable[[], object],
             size: int | Callable[[object], int] = 1) -> object:
        """`fetch()`'s value for `key`, fetched once per question (concurrent callers wait for
        the first). A raised exception is not kept. `size`: what the value counts against the
        cache's room, or how to count it from the value."""
        while True:
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None and entry.done:
                    self._entries.move_to_end(key)
                    self.stats["hits"] += 1
                    return entry.value
                if entry is not None and entry.inflight is not None:
                    future, mine = entry.inflight, False
                else:
                    entry = self._entries[key] = _Entry()
                    future = entry.inflight = Future()
                    mine = True
                self.stats["misses" if mine else "waits"] += 1
            if not mine:
                future.result()
                continue
            try:
                value = fetch()
            except BaseException as exc:
                with self._lock:
                    entry.inflight = None
                    if self._entries.get(key) is entry:
                        del self._entries[key]
                future.set_exception(exc)
                raise
            with self._lock:
                entry.inflight, entry.value, entry.done = None, value, True
                self._resize(entry, size(value) if callable(size) else size)
                self._keep(key, entry)
            future.set_result(None)
            return value

    # --- chunk rows ---------------------------------------------------------------------------

    def rows(self, ids: Sequence[str], fetch: Callable[[list[str]], dict[str, dict]]
             ) -> dict[str, dict]:
        """chunk id -> its docstore row, for the `ids` that have one; `fetch(ids)` reads the
        ones this question has not read yet, in one request. Rows are shared: not to change."""
        key = ("rows",)
        with self._lock:
            entry = self._entries.get(key)
            known = entry.value if entry is not None else {}
            missing = [i for i in dict.fromkeys(ids) if i not in known]
        found = fetch(missing) if missing else {}
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:  # (new, or evicted meanwhile)
                entry = self._entries[key] = _Entry(value={}, done=True)
            entry.value.update(found)
            self.stats["rows_cached"] += len(ids) - len(missing)
            self.stats["rows_read"] += len(missing)
            self._resize(entry, len(entry.value))
            self._keep(key, entry)
            known = entry.value
            return {i: known[i] for i in ids if i in known}

    # --- the bound --------------------------------------------------------------------------

    def _resize(self, entry: _Entry, size: int) -> None:
        self._size += size - entry.size
        entry.size = size

    def _keep(self, key: Hashable, entry: _Entry) -> None:
        """Under the lock: `key` is the newest; the oldest finished entries go while the
        question holds more than `max_items`."""
        if self._entries.get(key) is entry:
            self._entries.move_to_end(key)
        for old in list(self._entries):
            if self._size <= self.max_items:
                break
            victim = self._entries[old]
            if old == key or victim.inflight is not None:
                continue
            del self._entries[old]
            self._size -= victim.size
            self.stats["evicted"] += 1


def _answer(entry: _Entry, k: int, excluded: set[str]) -> list[Hit] | None:
    """The top k of a cached prefix once `excluded` is dropped, or None when the prefix is too
    short to be sure (fewer than k left and the backend may have more)."""
    kept = []
    for hit in entry.hits:
        if hit.chunk_id not in excluded:
            kept.append(hit)
            if len(kept) == k:
                break
    if len(kept) < k and not entry.complete:
        return None
    return [copy_hit(h, rank) for rank, h in enumerate(kept, start=1)]


class FetchCaches:
    """The live questions' caches in one retriever process, by question id."""

    def __init__(self, max_questions: int = MAX_QUESTIONS, max_items: int = MAX_ITEMS):
        self.max_questions, self.max_items = max_questions, max_items
        self._caches: OrderedDict[str, QuestionCache] = OrderedDict()
        self._ended: deque[str] = deque(maxlen=1024)
        self._lock = threading.Lock()
        self.stats = Counter()  # the ended questions' counters, summed

    def get(self, question: str | None) -> QuestionCache | None:
        """The question's cache (made on its first request); None for no question or one
        already ended."""
        if not question:
            return None
        with self._lock:
            cache = self._caches.get(question)
            if cache is None:
                if question in self._ended:
                    return None
                cache = self._caches[question] = QuestionCache(self.max_items)
                while len(self._caches) > self.max_questions:  # the longest unused question
                    self._caches.popitem(last=False)
            else:
                self._caches.move_to_end(question)  # in use: the last to be dropped
            return cache

    def end(self, question: str) -> dict:
        """Drop the question's cache; its counters (hits, misses, waits, ...)."""
        with self._lock:
            self._ended.append(question)
            cache = self._caches.pop(question, None)
            if cache is None:
                return {}
            self.stats.update(cache.stats)
            return dict(cache.stats)

    def __len__(self) -> int:
        return len(self._caches)
