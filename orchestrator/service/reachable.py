"""Whether an index that is not open could open now, asked without opening it.

Opening an index starts its retriever (on Ray, an actor with its models: hundreds of MB) and,
for a Milvus Lite index, takes its file's one owner; a readiness probe may do neither for an
index no request has asked for. So the probe reads what opening would read first — the index's
profile (complete, not being ingested, its files in place, its settings) — and asks each server
backend it needs whether it answers: Elasticsearch its root, Milvus a TCP connection. Embedded
stores (tantivy, a Lite file) are files, which the profile has checked.

Many indexes usually live on a few servers (one Elasticsearch cluster, one Milvus): a server
is asked once for all of them (`Servers`), not once an index.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from branchsearch.infra.errors import BackendUnavailable, redact


class Servers:
    """Whether each server backend answers, asked once for every index that lives on it: a
    probe that comes within `fresh_s` seconds of a question to the same server starting is
    given that question's answer (waiting for it if it is under way); a success is given again
    for `fresh_s` after it ended. An error is never given to a probe that came later than
    that, so a server that is back is seen back by the next probe."""

    def __init__(self, fresh_s: float):
        self.fresh_s = fresh_s
        self._lock = threading.Lock()
        # key -> (its last question's outcome: the exception raised, or None; when it began;
        # when it ended, None while under way)
        self._asked: dict[tuple, tuple[Future, float, float | None]] = {}

    def check(self, key: tuple, ask: Callable[[], None]) -> None:
        """`ask()` (which raises when the server does not answer), or the outcome of a question
        for the same `key` that began within `fresh_s`, or succeeded within `fresh_s`, raised
        as it was."""
        now = time.monotonic()
        with self._lock:
            outcome, began, ended = self._asked.get(key, (None, 0.0, None))
            shared = outcome is not None and (
                now - began < self.fresh_s
                or (ended is not None and now - ended < self.fresh_s
                    and outcome.result() is None))  # (ended: its result is set)
            if not shared:
                outcome = Future()
                self._asked[key] = (outcome, now, None)
        if not shared:
            error = None
            try:
                ask()
            except BaseException as exc:  # noqa: BLE001 — the server's answer, for every index
                error = exc  # on it (and never a Future left unset for those waiting)
            finally:
                with self._lock:
                    if self._asked.get(key, (None,))[0] is outcome:
                        self._asked[key] = (outcome, now, time.monotonic())
                outcome.set_result(error)
        error = outcome.result()
        if error is not None:
            raise error.with_traceback(None)


def check_unopened(settings, profile, timeout_s: float, servers: Servers) -> None:
    """Raise what a request for the index would meet at its start: the profile's problem
    (`IndexIncomplete`, `SettingsError`, `IndexBusy`…) or `BackendUnavailable` for a server
    backend that does not answer within `timeout_s` (asked through `servers`)."""
    profile.require_searchable()
    ext = settings.external
    if profile.lexical == "elasticsearch":
        url = (ext.es_url if ext is not None and ext.es_url else "") or settings.es_url
        api_key = settings.es_api_key or None
        servers.check(("elasticsearch", url, api_key),
                      lambda: _elastic_answers(url, api_key, timeout_s))
    # an external index opens its collection for a bm25 search too (a hybrid one's groups)
    if profile.dense == "milvus" and (settings.search_mode != "bm25" or ext is not None):
        if ext is not None:
            uri = ext.milvus_uri or settings.milvus_uri
        else:
            from branchsearch.infra.index.open import dense_uri

            uri = dense_uri(settings, profile.manifest.backends or {})  # (read once)
        from branchsearch.infra.stores.milvus import server_answers

        servers.check(("milvus", str(uri)), lambda: server_answers(str(uri), timeout_s))


def _elastic_answers(url: str, api_key: str | None, timeout_s: float) -> None:
    from elasticsearch import Elasticsearch

    try:
        client = Elasticsearch(url, api_key=api_key, request_timeout=timeout_s,
                               max_retries=0)
        try:
            client.info()
        finally:
            client.close()
    except Exception as exc:  # noqa: BLE001 — refused, timed out, refused our credentials
        raise BackendUnavailable(f"elasticsearch at {redact(url)} is not answering "
                                 f"({type(exc).__name__})") from None
