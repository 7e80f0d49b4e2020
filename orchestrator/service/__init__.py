"""The search service (`branchsearch serve`).

    protocol   what a caller sends (the search request, validated once)
    errors     the one error shape ({error, detail}) and the mapping of every exception to it
    auth       API keys bound to ACL groups, indexes and an admin scope
    admission  limits: body size, per-key and total concurrency
    searcher   what the service does, as one plain async class (Serve deploys it as is)
    documents  document writes (PUT, DELETE): parsed, upserted by id, deleted, in store order
    events     the search's events, SSE framing and the ACL guard
    metrics    Prometheus metrics
    app        the FastAPI app in front of the searcher
    deploy     standalone (uvicorn) and Ray Serve (the builder)
    web/       the page at / that draws a search's branches live
"""
