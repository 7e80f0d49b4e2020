"""Evaluation data: BEIR folders and the synthetic multi-hop corpus (`synth`)."""
