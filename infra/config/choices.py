"""The closed sets of names a user chooses from, each one `Literal` written once.

Settings validation, CLI options and code all read these (`MODES`, `POLICIES`, … are the
`Literal`s' values as tuples), so adding a mode or an exporter is one edit here plus the code
that implements it.
"""

from __future__ import annotations

from typing import Literal, get_args

Mode = Literal["bm25", "dense", "hybrid"]  # single-shot retrieval and the agent's search_corpus
Policy = Literal["heuristic", "llm"]  # what a branch agent decides with
Planner = Literal["heuristic", "llm"]  # how the driver splits a question into sub-queries
Executor = Literal["ray", "local"]  # where branches run: Ray actors or this process
TraceExporter = Literal["none", "console", "jsonl", "otlp"]
OtlpProtocol = Literal["http", "grpc"]
MilvusIndex = Literal["auto", "FLAT", "HNSW", "IVF_FLAT"]  # compared upper-cased
MilvusConsistency = Literal["Bounded", "Strong", "Session", "Eventually"]  # server searches
# who embeds the queries of an index whose static model was fitted: MiniLM onto its axes, or it
StaticQueries = Literal["minilm", "static"]
Split = Literal["test", "dev", "train"]  # a BEIR folder's qrels/{split}.tsv
# what `eval --baseline` runs beside the agent: a single-shot mode, the same agent without
# pruning, or the heuristic policy
Baseline = Literal[Mode, "no-prune", "heuristic", "one-branch"]

MODES: tuple[Mode, ...] = get_args(Mode)
POLICIES: tuple[Policy, ...] = get_args(Policy)
PLANNERS: tuple[Planner, ...] = get_args(Planner)
EXECUTORS: tuple[Executor, ...] = get_args(Executor)
TRACE_EXPORTERS: tuple[TraceExporter, ...] = get_args(TraceExporter)
OTLP_PROTOCOLS: tuple[OtlpProtocol, ...] = get_args(OtlpProtocol)
MILVUS_INDEXES: tuple[MilvusIndex, ...] = get_args(MilvusIndex)
MILVUS_CONSISTENCIES: tuple[MilvusConsistency, ...] = get_args(MilvusConsistency)
STATIC_QUERIES: tuple[StaticQueries, ...] = get_args(StaticQueries)
SPLITS: tuple[Split, ...] = get_args(Split)
BASELINES: tuple[Baseline, ...] = get_args(Baseline)


def one_of(names: tuple[str, ...]) -> str:
    """`("a", "b", "c")` as `a, b or c` (for messages)."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
