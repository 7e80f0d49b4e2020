"""One branch: the self-editing search agent — stores, harness, tools, policies, actor."""
