"""The retrieval API the agent and the evaluation use (`Retriever`), and the per-question cache
the branches of one question share."""
