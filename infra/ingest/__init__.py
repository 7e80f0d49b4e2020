"""Documents in: reading a corpus, chunking, the ingest pipeline (one process) and its
distributed form on Ray Data."""
