"""Agent measures and failure attribution computed by hand on small trajectories; the synthetic
corpus; the eval report end to end on the fixture."""

import json
import subprocess
import sys

import pytest
from conftest import HOTPOT

from branchsearch.infra.datasets.synth import synth
from branchsearch.orchestrator.evaluation.attribution import (Trajectory, agent_measures,
                                                              answer_in, attribute)
from branchsearch.orchestrator.evaluation.run import compare

GOLD = {"a": 1, "b": 1}
TITLES = {"a": "Alpha Works", "b": "Beta Holdings (company)"}


def test_measures_by_hand():
    t = Trajectory(final_ranking=["a#p0", "x#p0", "b#p1", "y#p0", "z#p0", "w#p0"],
                   retrieved=["a#p0", "x#p0", "b#p1", "y#p0", "z#p0", "w#p0", "q#p0"],
                   pruned=["q#p0", "x#p1", "a#p3"], final_context=["a#p0", "b#p1"],
                   evidence_text="Alpha Works was founded in 1901 by Ada Chen.")
    m = agent_measures(t, GOLD, k=5, answer="Ada Chen")
    assert m["trajectory_recall"] == 1.0
    assert m["precision"] == 2 / 5 and abs(m["f1"] - 2 * 0.4 * 1 / 1.4) < 1e-12
    assert m["prune_accuracy"] == 2 / 3  # a#p3 belongs to gold document a
    assert m["bridge_preserved"] == 1.0 and m["answer_found"] == 1.0
    assert agent_measures(Trajectory(["x#p0"], ["x#p0"], [], ["x#p0"]), GOLD)[
        "trajectory_recall"] == 0.0
    assert "bridge_preserved" not in agent_measures(Trajectory(["a#p0"], ["a#p0"], [], []), GOLD)
    assert answer_in("1901", "in 1901.") and not answer_in("190", "in 1901")


@pytest.mark.parametrize("t, text, expected", [
    (Trajectory(["a#p0", "b#p0"], ["a#p0", "b#p0"], [], ["a#p0", "b#p0"]), "", ("ok", [])),
    (Trajectory(["a#p0", "x#p0"], ["a#p0", "x#p0"], [], ["a#p0"]), "nothing here",
     ("retrieval_miss", ["b"])),
    (Trajectory(["a#p0", "x#p0"], ["a#p0", "x#p0"], [], ["a#p0"]),
     "Alpha Works bought Beta Holdings in 1990.", ("early_stop", ["b"])),
    (Trajectory(["a#p0", "x#p0"], ["a#p0", "x#p0", "b#p0"], ["b#p0"], ["a#p0", "x#p0"]), "",
     ("premature_prune", ["b"])),
    (Trajectory(["a#p0", "x#p0", "y#p0"], ["a#p0", "x#p0", "y#p0", "b#p0"], [],
                ["a#p0", "x#p0", "y#p0", "b#p0"]), "", ("overload", ["b"])),
])
def test_each_attribution_class(t, text, expected):
    assert attribute(t, GOLD, TITLES, text, k=2) == expected


def test_paired_comparison_by_hand():
    agent = {"metrics": {"all_recall@5": 0.5, "turns": 3},
             "per_query": [{"id": "1", "metrics": {"all_recall@5": 1.0}},
                           {"id": "2", "metrics": {"all_recall@5": 0.0}}]}
    base = {"metrics": {"all_recall@5": 0.25},
            "per_query": [{"id": "1", "metrics": {"all_recall@5": 0.0}},
                          {"id": "2", "metrics": {"all_recall@5": 0.0}}]}
    c = compare(agent, base)
    assert c["difference"] == {"all_recall@5": 0.25}
    assert (c["wins"], c["losses"], c["ties"]) == (1, 0, 1)


def test_synth_is_deterministic_and_well_formed(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert synth(a, docs=120, tasks=10, seed=3)["documents"] == 120
    synth(b, docs=120, tasks=10, seed=3)
    for name in ("corpus.jsonl", "queries.jsonl", "qrels/test.tsv"):
        assert (a / name).read_text() == (b / name).read_text()
    assert (a / "corpus.jsonl").read_text() != synth(tmp_path / "c", 120, 10, seed=4) and \
        (tmp_path / "c" / "corpus.jsonl").read_text() != (a / "corpus.jsonl").read_text()
    docs = {json.loads(line)["_id"]: json.loads(line) for line in open(a / "corpus.jsonl")}
    queries = [json.loads(line) for line in open(a / "queries.jsonl")]
    qrels = [line.split("\t") for line in (a / "qrels/test.tsv").read_text().splitlines()[1:]]
    assert len(queries) == 10 and all(d in docs for _, d, _ in qrels)
    # the chain: plan names the vendor, whose profile names the contract, which names the review
    plan, vendor, contract = docs["t1-plan"], docs["t1-vendor"], docs["t1-contract"]
    assert vendor["title"] in plan["text"] and contract["title"] in vendor["text"]
    assert queries[1]["metadata"]["answer"] in docs["t1-review"]["text"]
    # look-alikes share names with the gold chain
    assert docs["t1-plan-old"]["title"].split(" (")[0] == plan["title"].split(" (")[0]
    with pytest.raises(ValueError):
        synth(tmp_path / "d", docs=10, tasks=5)


def run_cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "branchsearch.orchestrator.cli", *args],
                          capture_output=True, text=True, timeout=300, **kw)


def test_eval_report_with_attribution_plots_and_comparison(hotpot_settings, tmp_path):
    from conftest import HOTPOT

    report = tmp_path / "r.json"
    done = run_cli("eval", str(HOTPOT), "--policy", "heuristic", "--compare", "--report",
                   str(report), "--plots", str(tmp_path / "plots"), "--limit", "6",
                   "--home", str(hotpot_settings.home), "--index", "hotpot-eval")
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(report.read_text())
    m = data["metrics"]
    for name in ("recall@5", "all_recall@5", "ndcg@10", "trajectory_recall", "precision", "f1",
                 "prune_accuracy", "context_tokens_final", "tokens_read", "turns",
                 "tool_calls", "tool_calls_per_turn", "latency_ms_p50", "answer_found"):
        assert name in m, name
    assert sum(data["attribution"].values()) == 6
    assert data["comparisons"][0]["wins"] + data["comparisons"][0]["losses"] + \
        data["comparisons"][0]["ties"] == 6
    assert all(p["attribution"] in data["attribution"] for p in data["runs"][0]["per_query"])
    pngs = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert pngs == ["attribution.png", "context_tokens_per_turn.png", "recall_at_k.png"]
    md = report.with_suffix(".md").read_text()
    assert "## Failure attribution" in md
    # where the report and the plots went is said, as `loadtest` says it
    assert f"report: {report} and {report.with_suffix('.md')}" in done.stdout.splitlines()
    assert any(line.startswith("plots: ") and "recall_at_k.png" in line
               for line in done.stdout.splitlines()), done.stdout[-2000:]
    # the agent's latency and the baseline's in one row, both in ms (the agent's was a
    # latency_s_p50 row of its own, the baseline's cell of it "-")
    printed = [line.split() for line in done.stdout.splitlines() if "latency" in line]
    assert [row[0] for row in printed] == ["latency_ms_p50", "latency_ms_p90"], done.stdout
    assert all(len(row) == 3 and all(float(cell) > 0 for cell in row[1:]) for row in printed)
    rows = [line.strip("|").split("|") for line in md.splitlines()
            if line.startswith("| latency")]
    table = [row for row in rows if len(row) == 3]  # the summary (the paired differences: 2)
    assert [row[0].strip() for row in table] == ["latency_ms_p50", "latency_ms_p90"], rows
    assert all(float(c) > 0 for row in table for c in row[1:])
    assert "latency_s_" not in md


@pytest.mark.parametrize("args, message", [
    (["ingest", "/nonexistent/corpus"], "corpus not found"),
    (["retrieve", "x", "--index", "nope"], "index 'nope' not found"),
    (["eval", "/nonexistent", "--mode", "bm25"], "dataset not found: /nonexistent"),
    (["eval", ".", "--mode", "bm25"], "not a BEIR folder"),
    (["eval", str(HOTPOT / "queries.jsonl"), "--mode", "bm25"],  # its file, not its folder
     f"{HOTPOT / 'queries.jsonl'} is a file; give the BEIR folder that holds it ({HOTPOT})"),
    (["eval", ".", "--mode", "fuzzy"], "unknown mode"),
    (["synth", "out", "--docs", "10", "--tasks", "5"],
     "synth: --docs must be at least 8 × --tasks, 40 for --tasks 5 (got --docs 10)"),
])
def test_cli_errors_are_one_line_and_nonzero(tmp_path, args, message):
    done = run_cli(*args, "--home", str(tmp_path)) if args[0] != "synth" else \
        run_cli(*[str(tmp_path / a) if a == "out" else a for a in args])
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], done.stderr[-1000:]


def test_a_corpus_line_naming_a_key_twice_is_one_clear_line_and_writes_nothing(tmp_path):
    """`{"_id": "a", "_id": "b"}` was ingested as document "b" (Python keeps the last value):
    which one the line meant is not known, so the ingest stops at its line."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"_id": "a", "text": "x"}\n{"_id": "b", "_id": "c", "text": "y"}\n')
    done = run_cli("ingest", str(bad), "--home", str(tmp_path))
    assert done.returncode == 2, done.stderr[-1000:]
    assert done.stderr.strip().splitlines() == [
        "error: bad.jsonl:2: the key '_id' is given twice in one object: give it once"
        .replace("bad.jsonl", str(bad))]
    assert not (tmp_path / "indexes" / "default" / "docs.sqlite").exists()  # nothing written


def test_queries_naming_a_key_twice_are_refused_with_their_line(tmp_path):
    """An eval's queries.jsonl line giving `_id` (or `text`) twice was read with the last one:
    another query's gold, or another question, scored as this one."""
    from branchsearch.infra.datasets.beir import read_queries
    from branchsearch.infra.errors import CorpusError

    (tmp_path / "qrels").mkdir()
    (tmp_path / "qrels" / "test.tsv").write_text("q1\td1\t1\nq2\td2\t1\n")
    queries = tmp_path / "queries.jsonl"
    queries.write_text('{"_id": "q1", "text": "Who?"}\n{"_id": "q1", "_id": "q2", "text": "W?"}\n')
    with pytest.raises(CorpusError, match=r"queries.jsonl:2: the key '_id' is given twice"):
        read_queries(tmp_path)


def test_malformed_corpus_is_one_clear_line_and_writes_nothing(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "text": "x"}\n{oops\n')
    done = run_cli("ingest", str(bad), "--home", str(tmp_path))
    assert done.returncode == 2 and "bad.jsonl:2: not valid JSON" in done.stderr
    assert not (tmp_path / "indexes" / "default" / "docs.sqlite").exists()  # nothing written


def test_a_query_id_in_its_other_unicode_form_than_its_qrels_is_scored(tmp_path):
    """A query whose id queries.jsonl writes in NFD and the qrels in NFC was dropped without a
    word (two queries in, one scored): query ids are read in NFC, as document ids are."""
    import unicodedata

    from branchsearch.infra.datasets.beir import read_queries

    nfc = "q-\u00fc1"
    (tmp_path / "qrels").mkdir()
    (tmp_path / "qrels" / "test.tsv").write_text(f"{nfc}\td1\t1\nq2\td2\t1\n", encoding="utf-8")
    (tmp_path / "queries.jsonl").write_text(
        json.dumps({"_id": unicodedata.normalize("NFD", nfc), "text": "Who?"}) + "\n"
        + json.dumps({"_id": "q2", "text": "Where?"}) + "\n", encoding="utf-8")
    assert [(q.id, q.gold) for q in read_queries(tmp_path)] == [(nfc, {"d1": 1}),
                                                                ("q2", {"d2": 1})]


def test_a_report_the_disk_cannot_hold_leaves_the_old_one_and_no_partial_copy(tmp_path):
    """`eval --report` on a full disk (here the kernel's file size limit) said so, and left
    `r.json.tmp`, a partial copy, beside the report; its `.md` was written in place, so a full
    disk cut it short. Both are written whole or not at all."""
    from conftest import prepared

    report = tmp_path / "r.json"
    report.write_text("{}\n")
    report.with_suffix(".md").write_text("# old\n")
    script = ("import sys; from pathlib import Path\n"
              "from branchsearch.orchestrator.evaluation.report import write_json, write_report\n"
              "for write in (lambda: write_json(Path(sys.argv[1]), {'rows': ['x' * 9000]}),\n"
              "              lambda: write_report(Path(sys.argv[1]).with_suffix('.md'), 'y' * 9000)):\n"
              "    try:\n        write()\n    except OSError as exc:\n        print(exc.errno)\n")
    done = subprocess.run(prepared([sys.executable, "-c", script, report], file_size=4096),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["27", "27"]  # EFBIG, each
    assert report.read_text() == "{}\n" and report.with_suffix(".md").read_text() == "# old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.md"]


def test_an_agent_eval_whose_backend_dies_stops_rather_than_score_its_failures(tmp_path):
    """Elasticsearch killed after the first question of an agent eval: the questions after it
    ended with every branch in error, and were scored as the agent's misses — a report of
    recall@5 0.25 where the same run with the backend up gives 1.0 (hotpot-mini on Milvus +
    Elasticsearch, killed mid-run), `retrieval_miss` 9, exit 0,
    nothing saying so. Now the eval stops with one line naming the question and the backend,
    and writes no report (single-shot eval already stopped so)."""
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.errors import BranchsearchError
    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.orchestrator.evaluation.run import EvalOptions, run_evaluation

    from conftest import HOTPOT
    from es_emulator import start_es_emulator

    es = start_es_emulator(tmp_path / "es")
    try:
        settings = load_settings(overrides={
            "home": tmp_path / "home", "index": "hotpot-es", "backend_retries": 0,
            "es_url": es.url.replace("://", "://elastic:hunter2@"), "branches": 2},
            read_env=False, read_file=False)
        ingest(HOTPOT, settings)

        class KillAfterFirst:  # a progress bar: ES dies once the first question is scored
            def __init__(self, total, unit, desc):
                pass

            def update(self, n=1):
                es.stop()

            def close(self, done=True):
                assert not done  # the run failed: not done

        report = tmp_path / "r.json"
        with pytest.raises(BranchsearchError) as raised:
            run_evaluation(settings, EvalOptions(HOTPOT, policy="heuristic", limit=4,
                                                 executor="local", report=report),
                           progress=KillAfterFirst)
        line = str(raised.value)
        assert "elasticsearch" in line and "not reachable" in line, line
        assert "5a8c7595554299585d9e36b6" in line, line  # the second question, by its id
        assert "hunter2" not in line
        assert not report.exists() and not report.with_suffix(".md").exists()
    finally:
        es.stop()


def _beir(folder, corpus, queries, qrels):
    """A BEIR folder: corpus rows, (id, text) queries, qrels/test.tsv text."""
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in corpus))
    (folder / "queries.jsonl").write_text(
        "".join(json.dumps({"_id": i, "text": t}) + "\n" for i, t in queries))
    (folder / "qrels" / "test.tsv").write_text(qrels)
    return folder


def test_a_document_of_many_chunks_does_not_cut_the_ranking_short(tmp_path):
    """A long document whose 80 chunks all match the query filled the 50 chunks single-shot
    eval fetched: the document ranking was that one document, so the gold town page, second
    by its best chunk, was scored a miss (recall@10 0.5, nDCG@10 0.61 where the documents'
    ranking gives 1.0 and 1.0). The chunks are fetched deeper until ten documents are ranked
    (or the index has no more)."""
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.orchestrator.evaluation.run import EvalOptions, run_evaluation

    filler = "river stone field cloud market bridge garden winter summer harbor".split()
    big = "\n\n".join(f"Part {j}. " + " ".join(["volcano lava eruption"] * 40 + filler * 6)
                      for j in range(80))
    corpus = [{"_id": "almanac", "title": "The volcano almanac", "text": big}] + [
        {"_id": f"town{i}", "title": f"Town {i}", "text": f"Town {i} lies near a volcano"
         + (" with lava eruption. " if i == 3 else ". ") + " ".join(filler * 15)}
        for i in range(12)]
    data = _beir(tmp_path / "deep", corpus, [("q1", "volcano lava eruption")],
                 "q1\talmanac\t1\nq1\ttown3\t1\n")
    settings = load_settings(overrides={"home": tmp_path / "home", "index": "deep"},
                             read_env=False, read_file=False)
    ingest(data, settings, dense=False)
    result = run_evaluation(settings, EvalOptions(data, mode="bm25", ingest_first=False))
    ranking = result["runs"][0]["per_query"][0]["ranking"]
    assert ranking[:2] == ["almanac", "town3"] and len(ranking) == 10, ranking
    assert result["metrics"]["recall@10"] == 1.0 and result["metrics"]["ndcg@10"] == 1.0


def test_questions_and_gold_left_out_of_the_scores_are_said_and_kept_in_the_report(tmp_path):
    """An eval scored 2 of the 5 questions its files name and said nothing of the others:
    a qrels query missing from queries.jsonl (there `7`, in the qrels `07`), a query judged
    only non-relevant (grade 0), one without qrels; the gold document the corpus lacks was a
    line on stderr only, and the Markdown report did not name the split. Each is now a note,
    said and kept in the report (JSON and Markdown)."""
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.orchestrator.evaluation.run import EvalOptions, run_evaluation

    corpus = [{"_id": f"d{i}", "title": f"Town {i}", "text": f"Town {i} lies by a {w}."}
              for i, w in enumerate(["volcano", "lake", "river", "glacier"])]
    data = _beir(tmp_path / "odd", corpus,
                 [("q1", "volcano town"), ("q2", "lake town"), (7, "river town"),
                  ("q-zero", "glacier town"), ("q-none", "which town")],
                 "query-id\tcorpus-id\tscore\nq1\td0\t2\nq1\td1\t0\nq2\td1\t1\nq2\tghost\t1\n"
                 "07\td2\t1\nq-zero\td3\t0\n")
    settings = load_settings(overrides={"home": tmp_path / "home", "index": "odd"},
                             read_env=False, read_file=False)
    ingest(data, settings, dense=False)
    said, report = [], tmp_path / "r.json"
    result = run_evaluation(settings, EvalOptions(data, mode="bm25", ingest_first=False,
                                                  report=report), say=said.append)
    assert [p["id"] for p in result["runs"][0]["per_query"]] == ["q1", "q2"]
    notes = json.loads(report.read_text())["notes"]
    assert said == notes
    assert len(notes) == 4, notes
    assert notes[:3] == [
        "warning: 1 query of qrels/test.tsv missing from queries.jsonl, not scored: '07'",
        "warning: 1 query of queries.jsonl judged in qrels/test.tsv with no relevant document "
        "(score > 0), not scored: 'q-zero' (BEIR's evaluate would score each 0)",
        "note: 2 queries of queries.jsonl without qrels in qrels/test.tsv, not scored: '7', "
        "'q-none'"]
    assert "warning: 1 of 3 of the gold documents are not in index 'odd'" in notes[3]
    md = report.with_suffix(".md").read_text()
    assert "split test" in md and all(n in md for n in notes), md


@pytest.mark.parametrize("t, gold, expected", [
    # the only gold the final top k lacks is not in the corpus: the data's miss, not the search's
    (Trajectory(["a#p0", "x#p0"], ["a#p0", "x#p0"], [], ["a#p0"]), {"a": 1, "ghost": 1},
     ("not_in_corpus", ["ghost"])),
    # a gold document the corpus holds was missed too: that is the search's, and named alone
    (Trajectory(["x#p0", "y#p0"], ["x#p0", "y#p0"], [], ["x#p0"]), {"a": 1, "ghost": 1},
     ("retrieval_miss", ["a"])),
    (Trajectory(["a#p0", "x#p0"], ["a#p0", "x#p0", "b#p0"], ["b#p0"], ["a#p0", "x#p0"]),
     {"a": 1, "b": 1, "ghost": 1}, ("premature_prune", ["b"])),
])
def test_gold_the_corpus_lacks_is_attributed_to_the_data(t, gold, expected):
    assert attribute(t, gold, TITLES, "", k=2, absent={"ghost"}) == expected


def _ghost_index(tmp_path):
    """A four-town bm25 index and its BEIR folder, whose qrels give q1 a gold document
    (`ghost`) the corpus lacks: (data folder, settings)."""
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.ingest.pipeline import ingest

    corpus = [{"_id": f"d{i}", "title": f"Town {i}", "text": f"Town {i} lies by a {w}."}
              for i, w in enumerate(["volcano", "lake", "river", "glacier"])]
    data = _beir(tmp_path / "ghosts", corpus, [("q1", "volcano town"), ("q2", "lake town")],
                 "q1\td0\t1\nq1\tghost\t1\nq2\td1\t1\n")
    settings = load_settings(overrides={"home": tmp_path / "home", "index": "ghosts",
                                        "search_mode": "bm25", "branches": 1},
                             read_env=False, read_file=False)
    ingest(data, settings, dense=False)
    return data, settings


def test_an_agent_eval_attributes_gold_the_corpus_lacks_to_the_data_not_the_search(tmp_path):
    """A qrels line naming a document corpus.jsonl lacks made its query a `retrieval_miss`:
    the search blamed for the data. The query whose only miss is such a document is now
    `not_in_corpus` (its culprits that document), said once in the notes; recall still counts
    it missed, as BEIR's evaluate scores the qrels as given."""
    from branchsearch.orchestrator.evaluation.run import EvalOptions, run_evaluation

    data, settings = _ghost_index(tmp_path)
    said, report = [], tmp_path / "r.json"
    result = run_evaluation(settings, EvalOptions(data, policy="heuristic", executor="local",
                                                  ingest_first=False, report=report),
                            say=said.append)
    by_id = {p["id"]: p for p in result["runs"][0]["per_query"]}
    assert (by_id["q1"]["attribution"], by_id["q1"]["culprits"]) == ("not_in_corpus", ["ghost"])
    assert by_id["q2"]["attribution"] == "ok"
    assert result["attribution"]["retrieval_miss"] == 0
    assert result["attribution"]["not_in_corpus"] == 1
    assert by_id["q1"]["metrics"]["recall@5"] == 0.5  # as BEIR scores it
    ghosts = [n for n in said if "not in index" in n]
    assert len(ghosts) == 1 and "not_in_corpus" in ghosts[0], said
    assert json.loads(report.read_text())["notes"] == said
    assert "| not_in_corpus | 1 |" in report.with_suffix(".md").read_text()


@pytest.mark.parametrize("qrels", [
    "q1 0 d0 1\nq2 0 d1 1\n",  # TREC's qrels, as trec_eval reads them
    "q1 d0 1\nq2  d1   1\n",  # BEIR's columns, spaces in place of tabs
    "query-id corpus-id score\r\nq1 d0 1\r\nq2 d1 1\r\n",
    "q1\td0\t1\nq2 0 d1 1\n",  # one line each way
    "q1\td0\t1 \r\nq2\td1\t 1\n",  # a score padded with spaces, as BEIR's int() reads it
])
def test_qrels_separated_by_spaces_are_read_as_with_tabs(tmp_path, qrels):
    """Qrels written with spaces were one field a line: the first line was taken for a header
    and skipped, the next stopped eval with "expected query-id, corpus-id, score" (a file of
    one line: "no query has a positive qrel"). A line without a tab is now split at its
    spaces, as trec_eval reads qrels."""
    from branchsearch.infra.datasets.beir import read_queries

    data = _beir(tmp_path / "spaced", [], [("q1", "volcano town"), ("q2", "lake town")], qrels)
    assert {q.id: q.gold for q in read_queries(data)} == {"q1": {"d0": 1}, "q2": {"d1": 1}}


@pytest.mark.parametrize("qrels, line, message", [
    ("q1 d0\n", 1, "expected query-id, corpus-id, score"),
    ("q1 0 d0 1 extra\n", 1, "expected query-id, corpus-id, score"),
    ("q1\td0\t1.0\nq2\td1\t1\n", 1, "score '1.0' is not a whole number"),  # not a header
    ("q1\td0\t1\tx\nq2\td1\t1\n", 1, "score 'x' is not a whole number"),  # not a header
])
def test_a_qrels_line_that_cannot_be_read_is_one_line_naming_it(tmp_path, qrels, line, message):
    from branchsearch.infra.datasets.beir import read_queries
    from branchsearch.infra.errors import CorpusError

    data = _beir(tmp_path / "bad", [], [("q1", "volcano town"), ("q2", "lake town")], qrels)
    with pytest.raises(CorpusError) as raised:
        read_queries(data)
    assert str(raised.value).startswith(f"{data / 'qrels' / 'test.tsv'}:{line}: ")
    assert message in str(raised.value), raised.value


def test_a_query_id_that_differs_from_its_qrels_only_by_an_invisible_character_is_named(
        tmp_path):
    """'q1' in the qrels and 'q1' followed by a Hangul filler in queries.jsonl are two ids
    (as BEIR compares them): the query is not scored, and the two notes named them apart, with
    nothing saying they look alike. A note now says which ids differ only by characters
    that do not show (those the id rule lets through: a zero-width space is refused)."""
    from branchsearch.infra.datasets.beir import read_queries

    data = _beir(tmp_path / "zw", [], [("q1\u3164", "volcano town"), ("q2", "lake town"),
                                       ("q\u00a03", "river town")],
                 "q1\td0\t1\nq2\td1\t1\nq3\td2\t1\n")
    notes = []
    assert [q.id for q in read_queries(data, notes=notes)] == ["q2"]
    assert ("warning: 2 queries of queries.jsonl differ from ids of qrels/test.tsv only by "
            "characters that do not show (ids compare exactly), not scored: 'q1\u3164' "
            "(qrels/test.tsv: 'q1'), 'q\\xa03' (qrels/test.tsv: 'q3')") in notes, notes


def _hostile_copy(folder, ids: dict[int, str], ghost: tuple[int, str] | None = None):
    """hotpot-mini with the queries at `ids`' positions renamed, every document id's first '-'
    made a '|', and, when `ghost` is given, a gold document the corpus lacks for the query at
    that position. Returns the folder and the query ids in file order."""
    queries = [json.loads(line) for line in (HOTPOT / "queries.jsonl").read_text().splitlines()]
    renamed = {row["_id"]: ids.get(i, f"q{i}") for i, row in enumerate(queries)}
    corpus = [json.loads(line) for line in (HOTPOT / "corpus.jsonl").read_text().splitlines()]
    header, *qrels = (HOTPOT / "qrels" / "test.tsv").read_text().splitlines()
    lines = [line.split("\t") for line in qrels]
    qrels = "".join(f"{renamed[q]}\t{d.replace('-', '|', 1)}\t{s}\n" for q, d, s in lines)
    if ghost is not None:
        qrels += f"{ids[ghost[0]]}\t{ghost[1]}\t1\n"
    _beir(folder, [{**d, "_id": d["_id"].replace("-", "|", 1)} for d in corpus],
          [(renamed[q["_id"]], q["text"]) for q in queries], f"{header}\n{qrels}")
    return folder, list(renamed.values())


def _markdown_cells(line: str) -> list[str]:
    """A Markdown table row's cells, split at the '|' that no backslash escapes."""
    import re

    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def _unescaped(text: str) -> str:
    """A cell or code-free Markdown text as it renders: a backslash before punctuation dropped;
    an id shown quoted (it holds a character that does not show) read back as Python reads
    it."""
    import ast
    import re

    text = re.sub(r"\\([!-/:-@\[-`{-~])", r"\1", text)
    return ast.literal_eval(text) if text[:1] in "'\"" else text


def test_the_markdown_report_keeps_one_row_per_query_whatever_its_id_holds(tmp_path):
    """Ids with '|', a backtick, '<b>', a backslash or a line separator were written into the
    Markdown report as they are: '|' split a row of the paired table into more cells than its
    header, '<b>q7</b>' rendered bold (the tags gone), a backtick opened a code span. Each
    cell now shows its id escaped (Markdown's backslash escapes; an id holding a character
    that does not show quoted with Python's escapes, as the terminal shows it), one row a
    query; the JSON keeps the ids exactly."""
    import re

    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.orchestrator.evaluation.run import EvalOptions, run_evaluation

    hostile = {1: "q|1", 2: "<i>q2</i>", 4: "q\u20284", 7: "<b>q7</b>", 9: "q`9\\"}
    data, qids = _hostile_copy(tmp_path / "hostile", hostile, ghost=(2, "ghost|`<x>"))
    settings = load_settings(overrides={"home": tmp_path / "home", "index": "hostile",
                                        "search_mode": "bm25"}, read_env=False, read_file=False)
    ingest(data, settings, dense=False)
    report = tmp_path / "r.json"
    result = run_evaluation(settings, EvalOptions(data, policy="heuristic", baseline="bm25",
                                                  executor="local", ingest_first=False,
                                                  report=report))
    assert [p["id"] for p in json.loads(report.read_text())["runs"][0]["per_query"]] == qids
    md = report.with_suffix(".md").read_text()
    lines = md.splitlines()
    start = lines.index("| query | agent | baseline | outcome |")
    rows = [_markdown_cells(line) for line in lines[start + 2:] if line.startswith("|")]
    changed = [r for r in result["comparisons"][0]["per_query"] if r["outcome"] != "tie"]
    assert {r["id"] for r in changed} >= {"q|1", "q\u20284", "<b>q7</b>", "q`9\\"}, changed
    assert all(len(row) == 4 for row in rows), rows
    assert [_unescaped(row[0]) for row in rows] == [r["id"] for r in changed]
    tables = md[md.index("## Failure attribution"):]
    assert not re.search(r"(?<!\\)[<`]", tables) and "\u2028" not in md  # no tag or code
    example = next(line for line in lines if line.startswith("* **not_in_corpus**"))
    assert "\\<i>q2\\</i>" in example and "ghost\\|\\`\\<x>" in example, example


@pytest.mark.parametrize("queries, qrels, where, message", [
    ([("q1", "volcano town"), ("\u200b", "lake town")], "q1\td0\t1\n", "queries.jsonl:2",
     "'_id' '\\u200b' has no character that shows"),
    ([("q1", "volcano town"), ("\ufeff", "lake town")], "q1\td0\t1\n", "queries.jsonl:2",
     "'_id' '\\ufeff' has no character that shows"),
    ([("q1", "volcano town")], "q1\td0\t1\n\u200b\td1\t1\n", "qrels/test.tsv:2",
     "query-id '\\u200b' has no character that shows"),
    ([("q1", "volcano town")], "q1\t\u2060\t1\n", "qrels/test.tsv:1",
     "corpus-id '\\u2060' has no character that shows"),
    ([("q1", "volcano town")], "q1\td0\t1\n\td1\t1\n", "qrels/test.tsv:2", "query-id is empty"),
    ([("q1", "volcano town"), ("q\u200b2", "lake town")], "q1\td0\t1\n", "queries.jsonl:2",
     "'_id' 'q\\u200b2' holds the format character U+200B (ZERO WIDTH SPACE), which output "
     "would not show"),
    ([("q1", "volcano town")], "q1\td0\t1\nq\u200b1\td1\t1\n", "qrels/test.tsv:2",
     "query-id 'q\\u200b1' holds the format character U+200B (ZERO WIDTH SPACE)"),
    ([("q1", "volcano town")], "q1\tdoc\x001\t1\n", "qrels/test.tsv:1",
     "corpus-id 'doc\\x001' holds the control character U+0000"),
    ([("q1", "volcano town")], "q1\t\uff44oc1\t1\n", "qrels/test.tsv:1",
     "corpus-id '\uff44oc1' holds the full-width 'd' (U+FF44), which reads as the ASCII 'd'"),
    ([("q1", "volcano town")], "q1\t\t1\n", "qrels/test.tsv:1", "corpus-id is empty"),
])
def test_an_id_that_shows_nothing_is_refused_with_its_line(tmp_path, queries, qrels, where,
                                                           message):
    """A query id of a zero-width space or a byte-order mark was accepted as an id that no
    report could show apart from an empty one (which was refused), and a qrels line with an
    empty or invisible query or document id was read as gold no query could match. Each is
    now one line naming the file and line, the id escaped."""
    from branchsearch.infra.datasets.beir import read_queries
    from branchsearch.infra.errors import CorpusError

    data = _beir(tmp_path / "blank", [], queries, qrels)
    with pytest.raises(CorpusError) as raised:
        read_queries(data)
    assert str(raised.value).startswith(f"{data / where}: {message}"), raised.value


def test_eval_refuses_a_qrels_id_no_document_id_could_be_with_one_line(tmp_path):
    """A qrels row naming `doc\\u200b1` (no document id: ingest refuses it) would be gold that
    matches nothing: `eval` stops with one line naming the file, the line and the character,
    exit 2, and writes no report."""
    data = _beir(tmp_path / "d", [{"_id": "d0", "text": "volcano town"}],
                 [("q1", "volcano town")], "q1\td0\t1\nq1\tdoc\u200b1\t1\n")
    report = tmp_path / "r.json"
    done = run_cli("eval", str(data), "--home", str(tmp_path / "home"), "--report", str(report))
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        f"error: {data / 'qrels' / 'test.tsv'}:2: corpus-id 'doc\\u200b1' holds the format "
        "character U+200B (ZERO WIDTH SPACE), which output would not show"], done.stderr
    assert not report.exists() and not report.with_suffix(".md").exists()


@pytest.mark.parametrize("qrels", [
    "q1\td0\t1\rq2\td1\t1\r",  # classic Mac line ends
    "query-id\tcorpus-id\tscore\rq1\td0\t1\r\nq2\td1\t1\n",  # mixed
])
def test_qrels_lines_ended_by_a_carriage_return_are_read_as_beir_reads_them(tmp_path, qrels):
    """A qrels file whose lines end with a lone carriage return stopped eval with Python's
    csv error and its traceback ("new-line character seen in unquoted field - do you need to
    open the file in universal-newline mode?"). BEIR's loader opens the file in text mode,
    where a carriage return ends a line: so does eval now."""
    from branchsearch.infra.datasets.beir import read_queries

    data = _beir(tmp_path / "cr", [], [("q1", "volcano town"), ("q2", "lake town")], qrels)
    assert {q.id: q.gold for q in read_queries(data)} == {"q1": {"d0": 1}, "q2": {"d1": 1}}


def test_a_carriage_return_line_is_named_by_its_number_as_an_editor_counts(tmp_path):
    from branchsearch.infra.datasets.beir import read_queries
    from branchsearch.infra.errors import CorpusError

    data = _beir(tmp_path / "cr", [], [("q1", "volcano town")], "q1\td0\t1\rq1\td0\tx\r")
    with pytest.raises(CorpusError, match=r"test.tsv:2: score 'x' is not a whole number"):
        read_queries(data)


def test_the_agent_diagnostics_leave_out_gold_the_corpus_lacks():
    """By hand: gold the corpus lacks ('ghost') is out of every diagnostic's denominator, as
    the attribution sets it apart; a query whose gold the corpus wholly lacks has no
    gold-based diagnostic (left out of the means, not a 0)."""
    t = Trajectory(["a#p0", "x#p0"], ["a#p0", "x#p0"], [], ["a#p0"])
    m = agent_measures(t, {"a": 1, "ghost": 1}, k=2, absent={"ghost"})
    assert m["trajectory_recall"] == 1.0 and m["bridge_preserved"] == 1.0
    assert m["precision"] == 0.5 and abs(m["f1"] - 2 * 0.5 * 1 / 1.5) < 1e-12
    only = agent_measures(t, {"ghost": 1}, k=2, absent={"ghost"})
    assert not {"trajectory_recall", "precision", "f1", "bridge_preserved"} & set(only), only
    assert only["prune_accuracy"] == 1.0


def test_an_agent_eval_scores_its_diagnostics_on_the_gold_the_corpus_holds(tmp_path):
    """A query whose only miss was a gold document the corpus lacks was attributed
    `not_in_corpus`, yet its trajectory_recall counted that document never retrieved (0.5),
    its bridge_preserved was left out (not all gold retrieved) and its f1 took recall 0.5. The
    diagnostics now leave such gold out (1.0, 1.0, f1 of recall 1.0), the notes say so, and
    the BEIR scores (recall, all-recall) still count it missed."""
    from branchsearch.orchestrator.evaluation.run import EvalOptions, run_evaluation

    data, settings = _ghost_index(tmp_path)
    said = []
    result = run_evaluation(settings, EvalOptions(data, policy="heuristic", executor="local",
                                                  ingest_first=False), say=said.append)
    by_id = {p["id"]: p["metrics"] for p in result["runs"][0]["per_query"]}
    q1, q2 = by_id["q1"], by_id["q2"]
    assert q1["trajectory_recall"] == 1.0 and q1["bridge_preserved"] == 1.0, q1
    assert q1["f1"] == q2["f1"], (q1, q2)  # the same precision, recall 1.0 over what is there
    assert q1["recall@5"] == 0.5 and q1["all_recall@5"] == 0.0  # BEIR's scores as given
    note = next(n for n in said if "not in index" in n)
    assert "trajectory_recall" in note and "bridge_preserved" in note, note


def test_the_markdown_header_shows_a_dataset_path_and_index_name_as_written(tmp_path):
    """The report's header wrote the dataset path and the index name raw: a folder named
    "my|set*v2`x" with a newline in it split the title over two lines, its '*' and backtick
    read as markup, and an index `_hp_` sat in a code span a backtick would end. Each is now
    one line, escaped as ids are (`md_id`), and the JSON keeps them exactly."""
    import shutil

    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.orchestrator.evaluation.run import EvalOptions, run_evaluation

    data = tmp_path / "my|set*v2`x\nnext"
    shutil.copytree(HOTPOT, data)
    settings = load_settings(overrides={"home": tmp_path / "home", "index": "_hp_"},
                             read_env=False, read_file=False)
    ingest(data, settings, dense=False)
    report = tmp_path / "r.json"
    run_evaluation(settings, EvalOptions(data, mode="bm25", ingest_first=False, report=report))
    assert json.loads(report.read_text())["dataset"] == str(data)
    title, blank, _, _, index_line = report.with_suffix(".md").read_text().splitlines()[:5]
    assert title.startswith("# Evaluation: ") and blank == "", title
    shown = title.removeprefix("# Evaluation: ")
    assert "\n" not in shown and _unescaped(shown) == str(data), shown
    assert "\\|set\\*v2\\`x" in shown, shown
    assert index_line.startswith("Index \\_hp\\_, embedding: "), index_line
