"""The backends behind one retriever: their protocols, the ACL rule, the docstore, tantivy,
Elasticsearch, Milvus (Lite or server) and external indexes read in place."""
