"""The world outside the agent: corpus, embedder, stores, tokenizer, telemetry, settings.

Importing this package loads nothing heavy; each module imports its backend where it is used.
"""
