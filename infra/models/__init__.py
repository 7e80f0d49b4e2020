"""The models branchsearch runs: the embedder (and its cache and exported fast backends), the
tokenizer, LLM engines and the bundled weights."""
