"""Evaluation (`branchsearch eval`): how well the search finds the gold documents of a BEIR set.

    run          the whole of `eval`: single-shot retrieval, the branch agent, baselines and
                 paired comparisons over a BEIR folder
    measures     retrieval measures over document rankings (recall@k, nDCG, percentiles):
                 pure functions
    attribution  the agent's own measures and why a query failed, from what its branches did
    report       the JSON report, a Markdown summary beside it, and plots
"""
