"""What the CLI hands to the library: the shared choices, the one-branch executor rule, the eval
options' checks and `run_evaluation` end to end in-process (no subprocess, no Ray)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from branchsearch.infra.config.choices import (BASELINES, EXECUTORS, MILVUS_CONSISTENCIES, MODES,
                                        PLANNERS, POLICIES, SPLITS, TRACE_EXPORTERS, one_of)
from branchsearch.infra.errors import BranchsearchError, SettingsError
from branchsearch.infra.config.settings import load_settings
from branchsearch.orchestrator.evaluation.run import EvalOptions, dataset_index, run_evaluation
from branchsearch.orchestrator.execution import pick_executor


def settings(**overrides):
    return load_settings(overrides=overrides, read_env=False, read_file=False)


def test_settings_accept_exactly_the_shared_choices():
    for name, allowed in (("search_mode", MODES), ("policy", POLICIES), ("planner", PLANNERS),
                          ("trace_exporter", TRACE_EXPORTERS),
                          ("milvus_consistency", MILVUS_CONSISTENCIES)):
        for value in allowed:
            extra = {"trace_file": "t.jsonl"} if value == "jsonl" else {}
            assert getattr(settings(**{name: value}, **extra), name) == value
        with pytest.raises(SettingsError, match=f"{name} must be {one_of(allowed)}"):
            settings(**{name: "other"})
    assert one_of(MODES) == "bm25, dense or hybrid" and one_of(("x",)) == "x"
    assert set(BASELINES) == {*MODES, "no-prune", "heuristic", "one-branch"}
    assert SPLITS == ("test", "dev", "train") and EXECUTORS == ("ray", "local")


def test_hybrid_candidates_bounded():
    assert settings(hybrid_candidates=1).hybrid_candidates == 1
    assert settings(hybrid_candidates=1000).hybrid_candidates == 1000
    for bad in (0, -5, 1001):
        with pytest.raises(SettingsError, match=r"hybrid_candidates must be in 1\.\.1000"):
            settings(hybrid_candidates=bad)


def test_one_branch_runs_in_process_unless_a_cluster_is_named():
    assert pick_executor(settings(branches=1), "ray") == "local"
    assert pick_executor(settings(branches=1, ray_address="ray://head:10001"), "ray") == "ray"
    assert pick_executor(settings(branches=3), "ray") == "ray"
    assert pick_executor(settings(branches=3), "local") == "local"
    with pytest.raises(BranchsearchError, match="unknown executor 'spark'; use ray or local"):
        pick_executor(settings(), "spark")


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "fuzzy"}, "unknown mode 'fuzzy'; use one of bm25, dense, hybrid"),
    ({"compare": True}, "--compare needs --policy"),
    ({"baseline": "bm99", "policy": "heuristic"},
     "unknown baseline 'bm99': bm25, dense, hybrid, no-prune, heuristic, one-branch"),
    ({"baseline": "no-prune"}, "--baseline no-prune needs --policy"),
    ({"baseline": "one-branch"}, "--baseline one-branch needs --policy"),
])
def test_eval_options_refuse_wrong_combinations(kwargs, message):
    with pytest.raises(BranchsearchError, match=message.replace("-", r"\-")):
        EvalOptions(Path("x"), **kwargs)


def test_a_one_branch_baseline_needs_an_agent_of_more_branches(tmp_path):
    s = settings(home=tmp_path, policy="heuristic", branches=1)
    with pytest.raises(BranchsearchError, match="the agent runs one branch already"):
        run_evaluation(s, EvalOptions(tmp_path / "missing", policy="heuristic",
                                      baseline="one-branch"))


def test_eval_options_compare_means_a_hybrid_baseline():
    assert EvalOptions(Path("x"), policy="heuristic", compare=True).baseline == "hybrid"
    assert EvalOptions(Path("x"), policy="heuristic", compare=True,
                       baseline="no-prune").baseline == "no-prune"
    assert EvalOptions(Path("x")).baseline is None
    assert dataset_index(Path("/data/hotpot qa.v2")) == "hotpot-qa-v2"


class Bars:
    """A `progress` factory of real tqdm bars (as the CLI passes on a terminal: closed with
    `done`), written to a buffer and recorded: `made` lists (description, total, count,
    closed) of each."""

    def __init__(self):
        self.bars = []

    def __call__(self, total, unit, desc):
        from tqdm import tqdm

        class Bar(tqdm):
            def close(self, done=True):
                assert done  # (these runs end)
                super().close()

        self.bars.append(Bar(total=total, unit=unit, desc=desc, file=io.StringIO()))
        return self.bars[-1]

    @property
    def made(self):
        return [(b.desc, b.total, b.n, b.disable) for b in self.bars]  # closed: disabled


def test_run_evaluation_single_shot_with_baseline_and_report(hotpot_settings, tmp_path):
    from conftest import HOTPOT, ingest_copy

    # its own copy: closing a retriever stops the Milvus Lite server of its file, which the
    # session's `hotpot_retriever` still uses
    settings = ingest_copy(hotpot_settings, "orch-eval")
    bars, said = Bars(), []
    report = tmp_path / "out" / "r.json"
    result = run_evaluation(settings, EvalOptions(HOTPOT, mode="bm25", baseline="hybrid",
                                                         limit=3, report=report),
                            progress=bars, say=said.append)
    assert said == []  # the index is complete: nothing ingested
    assert [r["config"] for r in result["runs"]] == ["bm25 single-shot", "hybrid single-shot"]
    assert bars.made == [("eval bm25", 3, 3, True), ("eval hybrid", 3, 3, True)]
    c = result["comparisons"][0]
    assert (c["agent"], c["baseline"]) == ("bm25 single-shot", "hybrid single-shot")
    assert c["wins"] + c["losses"] + c["ties"] == 3
    assert json.loads(report.read_text())["metrics"] == result["runs"][0]["metrics"]
    assert report.with_suffix(".md").read_text().startswith("# Evaluation: ")
    # a figure is comparable only with one of the same embedding: the report says which
    assert (result["index"], result["embedding"]) == ("orch-eval", "all-MiniLM-L6-v2")
    assert "Index orch-eval, embedding: all-MiniLM-L6-v2." in report.with_suffix(
        ".md").read_text()


def test_run_evaluation_ingests_a_missing_index_first(tmp_path):
    folder = tmp_path / "tiny"
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in (
        {"_id": "d1", "title": "Falcon", "text": "The Falcon plan was approved in 1999."},
        {"_id": "d2", "title": "Heron", "text": "Heron is a different project entirely."})))
    (folder / "queries.jsonl").write_text(json.dumps({"_id": "q1", "text": "Falcon plan"}) + "\n")
    (folder / "qrels" / "dev.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\n")
    s = settings(home=tmp_path / "home", index=dataset_index(folder), policy="heuristic",
                 branches=1)
    bars, said = Bars(), []
    result = run_evaluation(s, EvalOptions(folder, policy="heuristic", split="dev"),
                            progress=bars, say=said.append)
    assert said == [f"index 'tiny' missing or incomplete: ingesting {folder}"]
    assert bars.made == [("ingest", None, 2, True), ("eval heuristic", 1, 1, True)]  # 2 docs
    assert result["runs"][0]["config"] == "heuristic x1" and result["split"] == "dev"
    assert result["metrics"]["recall@10"] == 1.0 and "comparisons" not in result
    assert result["embedding"] == s.embed_model  # the model it was ingested with


def test_demo_reads_its_task_through_the_dataset_reader(tmp_path):
    from branchsearch.infra.datasets.beir import read_queries
    from branchsearch.infra.datasets.synth import synth

    synth(tmp_path / "c", docs=40, tasks=3, seed=11)
    task = read_queries(tmp_path / "c")[1]
    raw = json.loads((tmp_path / "c" / "queries.jsonl").read_text().splitlines()[1])
    qrels = (tmp_path / "c" / "qrels" / "test.tsv").read_text().splitlines()[1:]
    assert (task.id, task.text, task.meta["hops"]) == (raw["_id"], raw["text"],
                                                      raw["metadata"]["hops"])
    assert task.answer == raw["metadata"]["answer"]
    assert list(task.gold) == [r.split("\t")[1] for r in qrels if r.startswith(task.id + "\t")]


def test_unasked_the_executor_is_in_process_on_one_machine(monkeypatch):
    """Unasked, one machine runs its branches in-process (a local cluster costs seconds to start
    for milliseconds of work); a named cluster or a model in engine actors still gets Ray."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert pick_executor(settings(branches=3)) == "local"
    assert pick_executor(settings(branches=3, ray_address="ray://head:10001")) == "ray"
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert pick_executor(settings(branches=3)) == "ray"
    monkeypatch.delenv("RAY_ADDRESS")
    assert pick_executor(settings(branches=3, policy="llm")) == "ray"  # engine actors
    assert pick_executor(settings(branches=3, policy="llm", llm_url="http://llm:8000/v1")
                         ) == "local"  # a model behind an endpoint needs no cluster
    assert pick_executor(settings(branches=3), "ray") == "ray"  # asked for: as asked
