"""Whether an index that is not open could open now, asked without opening it.

Opening an index starts its retriever (on Ray, an actor with its models: hundreds of MB) and,
for a Milvus Lite index, takes its file's one owner; a readiness probe may do neither for an
index no request has asked for. So the probe reads what opening would read first — the index's
profile (complete, not being ingested, its files in place, its settings) — and asks each server
backend it needs whether it answers: Elasticsearch its root, Milvus a TCP connection. Embedded
stores (tantivy, a Lite file) are files, which the profile has checked.
"""

from __future__ import annotations

from branchsearch.infra.errors import BackendUnavailable, redact


def check_unopened(settings, profile, timeout_s: float) -> None:
    """Raise what a request for the index would meet at its start: the profile's problem
    (`IndexIncomplete`, `SettingsError`, `IndexBusy`…) or `BackendUnavailable` for a server
    backend that does not answer within `timeout_s`."""
    profile.require_searchable()
    ext = settings.external
    if profile.lexical == "elasticsearch":
        url = (ext.es_url if ext is not None and ext.es_url else "") or settings.es_url
        _elastic_answers(url, settings.es_api_key or None, timeout_s)
    # an external index opens its collection for a bm25 search too (a hybrid one's groups)
    if profile.dense == "milvus" and (settings.search_mode != "bm25" or ext is not None):
        if ext is not None:
            uri = ext.milvus_uri or settings.milvus_uri
        else:
            from branchsearch.infra.index.open import dense_uri

            uri = dense_uri(settings)
        from branchsearch.infra.stores.milvus import server_answers

        server_answers(str(uri), timeout_s)


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
