"""Dense store on Milvus through pymilvus: an embedded Milvus Lite file, or a server by URI.

One collection per index: chunk id (primary key), doc id, ACL groups (array), vector. Exclusion
of seen chunks and the ACL filter are pushed into Milvus's boolean filter, so `k` results come
back even when many candidates are filtered out. Milvus Lite allows one process per file: the
retriever actor that owns this store is its only user.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from branchsearch.infra.errors import BackendUnavailable
from branchsearch.infra.hits import Hit
from branchsearch.infra.backends import IndexedChunk, acl_terms

COLLECTION = "chunks"


def _quote(values: Sequence[str]) -> str:
    return json.dumps(list(values))  # JSON string literals are valid Milvus filter literals


class MilvusStore:
    def __init__(self, uri: str | Path, dim: int, *, token: str = "", collection: str = COLLECTION):
        from pymilvus import MilvusClient

        self.uri = str(uri)
        self.dim = dim
        self.collection = collection
        if not self.uri.startswith(("http://", "https://", "tcp://")):
            Path(self.uri).parent.mkdir(parents=True, exist_ok=True)
        try:
            self._client = MilvusClient(uri=self.uri, token=token)
        except Exception as exc:
            raise BackendUnavailable(
                f"milvus: cannot open {self.uri} ({type(exc).__name__}: {exc}); "
                "start Milvus there or unset milvus_uri for the embedded file") from None
        if not self._client.has_collection(collection):
            self._create()

    def _create(self) -> None:
        from pymilvus import DataType

        schema = self._client.create_schema(auto_id=False, enable_dynamic_field=False)
        schema.add_field("chunk_id", DataType.VARCHAR, is_primary=True, max_length=1024)
        schema.add_field("doc_id", DataType.VARCHAR, max_length=1024)
        schema.add_field("acl", DataType.ARRAY, element_type=DataType.VARCHAR, max_capacity=64,
                         max_length=256)
        schema.add_field("vector", DataType.FLOAT_VECTOR, dim=self.dim)
        index = self._client.prepare_index_params()
        index.add_index(field_name="vector", index_type="FLAT", metric_type="IP")
        self._client.create_collection(self.collection, schema=schema, index_params=index)

    def write(self, chunks: Sequence[IndexedChunk], vectors, delete_doc_ids: Sequence[str]) -> None:
        for i in range(0, len(delete_doc_ids), 500):
            batch = list(delete_doc_ids[i:i + 500])
            self._client.delete(self.collection, filter=f"doc_id in {_quote(batch)}")
        rows = [{"chunk_id": c.chunk_id, "doc_id": c.doc_id, "acl": c.acl_terms,
                 "vector": v.tolist()} for c, v in zip(chunks, vectors)]
        for i in range(0, len(rows), 1000):
            self._client.insert(self.collection, rows[i:i + 1000])

    def search(self, vector, k: int, exclude_ids: Sequence[str] = (),
               acl_groups: Sequence[str] | None = None) -> list[Hit]:
        filters = []
        groups = acl_terms(acl_groups)
        if groups is not None:
            filters.append(f"array_contains_any(acl, {_quote(groups)})")
        if exclude_ids:
            filters.append(f"chunk_id not in {_quote(exclude_ids)}")
        result = self._client.search(
            self.collection, data=[vector.tolist()], limit=k,
            filter=" and ".join(filters), output_fields=["doc_id"],
            search_params={"metric_type": "IP"})
        return [Hit(r["id"], r["entity"]["doc_id"], float(r["distance"]), rank, "dense")
                for rank, r in enumerate(result[0], start=1)]

    def count(self) -> int:
        stats = self._client.get_collection_stats(self.collection)
        return int(stats.get("row_count", 0))

    def close(self) -> None:
        """Close the client and, for an embedded file, stop its Milvus Lite server so another
        process can open the file (Milvus Lite allows one process per file)."""
        self._client.close()
        if not self.uri.startswith(("http://", "https://", "tcp://")):
            try:
                from milvus_lite.server_manager import server_manager_instance

                server_manager_instance.release_server(self.uri)
            except ImportError:
                pass
