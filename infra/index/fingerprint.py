"""The version of an external index: what a batch writes as `index_version` for one, so a
resume asks again the questions answered before its documents changed, as it does for an owned
index (whose version is its manifest's).

An external index has no manifest; its Elasticsearch side is versioned from the cluster's own
index stats (`GET /<index>/_stats?level=shards`): each index's uuid (a recreated index, or an
alias moved to another, is another) and, for each primary shard, its `max_seq_no` (every index,
update in place and delete of a document takes the next sequence number of its shard; numbers
are per shard, so two shards' writes can leave one maximum unchanged) and its document count.
The fingerprint is a short hash of those. A write it counts that no document shows (a refresh
not yet made, a primary that failed over) moves it too: the resume then asks again, never keeps
a stale row.

A Milvus collection has no such number (a delete and an insert of the same count leave every
statistic as it was), so an index with a Milvus side has no fingerprint, nor one whose cluster
refuses its stats (they need the `monitor` privilege): `external_version` then says why, and
the caller says that changes are not detected.
"""

from __future__ import annotations

import hashlib
import json


def es_fingerprint(stats: dict) -> str:
    """The fingerprint of an Elasticsearch `indices.stats(level="shards")` answer, or "" when
    it does not hold, for every index, its uuid and each primary shard's `max_seq_no` (a shard
    that did not answer: nothing is guessed)."""
    if not isinstance(stats, dict) or stats.get("_shards", {}).get("failed"):
        return ""
    parts = []
    for name, index in sorted((stats.get("indices") or {}).items()):
        uuid, shards = index.get("uuid"), index.get("shards") or {}
        if not uuid or not shards:
            return ""
        for shard, copies in sorted(shards.items(), key=lambda item: int(item[0])):
            primary = [c for c in copies if (c.get("routing") or {}).get("primary")]
            if len(primary) != 1:
                return ""
            seq = (primary[0].get("seq_no") or {}).get("max_seq_no")
            docs = (primary[0].get("docs") or {}).get("count")
            if not isinstance(seq, int) or not isinstance(docs, int):
                return ""
            parts.append([uuid, int(shard), seq, docs])
    if not parts:
        return ""
    digest = hashlib.sha256(json.dumps(parts).encode()).hexdigest()
    return f"es-{digest[:16]}"


def index_version(profile, settings) -> tuple[str | None, str]:
    """The version a batch's rows carry for the index `profile` describes, and "" or why it
    has none (`external_version`): an owned index's manifest `version` (None before indexes
    had one), an external one's fingerprint."""
    if profile.kind != "external":
        return getattr(profile.manifest, "version", "") or None, ""
    version, unseen = external_version(settings.external, settings)
    return version or None, unseen


def external_version(spec, settings) -> tuple[str, str]:
    """(the version of the external index `spec`, "") or ("", why it has none: the end of the
    sentence "changes to … since they were answered are not detected"). An Elasticsearch index
    that cannot be opened raises the error a search on it would."""
    if spec.dense == "milvus":
        side = "its Milvus side" if spec.lexical == "elasticsearch" else "its cluster"
        return "", f"{side} (collection {spec.milvus_collection!r})"
    from branchsearch.infra.stores.external import ExternalElastic

    es = ExternalElastic(spec, spec.es_url or settings.es_url,
                         api_key=settings.es_api_key or None,
                         timeout_s=settings.backend_timeout_s)
    try:
        stats = es.shard_stats()
    finally:
        es.close()
    if isinstance(stats, int):
        why = ("which need the monitor privilege" if stats in (401, 403)
               else "the cluster does not serve them")
        return "", (f"its cluster (Elasticsearch answered HTTP {stats} for the index stats of "
                    f"{spec.es_index!r}: {why})")
    version = es_fingerprint(stats)
    if not version:
        return "", (f"its cluster (the index stats of {spec.es_index!r} do not give one "
                    "sequence number for each primary shard: a shard failed or is moving)")
    return version, ""
