"""Every user-caused error is one `error:` line on stderr and exit status 2, never a traceback.

Each case runs the real CLI as a subprocess (`python -m branchsearch.orchestrator.cli …`); the
cases start together, so the whole table costs about one CLI start per core.
"""

from __future__ import annotations

import json
import os
import re
import stat
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

from branchsearch.infra.stores.protocols import MAX_K, check_k, check_pattern
from branchsearch.infra.errors import BadQuery, CorpusError
from branchsearch.infra.terminal import one_line, visible

from service_fixtures import KEPT_IDS, LOOKALIKE_IDS
from store_copy import copy_store

CLI = [sys.executable, "-m", "branchsearch.orchestrator.cli"]


def run(args, env=None, timeout=300):
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def run_all(cases: dict) -> dict:
    with ThreadPoolExecutor(max_workers=max(os.cpu_count() or 2, 2)) as pool:
        futures = {name: pool.submit(run, args) for name, args in cases.items()}
        return {name: f.result() for name, f in futures.items()}


def assert_one_error_line(done, expect: str, name: str = ""):
    assert done.returncode == 2, (name, done.returncode, done.stderr[-800:])
    assert "Traceback" not in done.stderr and "Traceback" not in done.stdout, name
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), (name, done.stderr[-800:])
    assert expect.lower() in lines[0].lower(), (name, lines[0])


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-errors")
    (root / "a-file").write_text("not a folder\n")
    (root / "outdir").mkdir()
    (root / "questions.jsonl").write_text(json.dumps({"id": "q", "question": "x"}) + "\n")
    (root / "empty.jsonl").write_text("\n")
    (root / "questions.txt").write_text("Who directed Ed Wood?\n\nWhere is Tokyo?\n3\n")
    (root / "notes.jsonl").write_text('{"id": "zz", "note": "my notes"}\nplain text\n')
    (root / "latin1-questions.jsonl").write_bytes(b'{"id": "q", "question": "caf\xe9"}\n')
    (root / "latin1-corpus.jsonl").write_bytes(
        b'{"_id": "d", "title": "T", "text": "ok"}\n{"_id": "e", "text": "caf\xe9"}\n')
    texts = root / "latin1-texts"  # a folder of .txt, two of them not UTF-8
    texts.mkdir()
    (texts / "a.txt").write_bytes(b"caf\xe9\n")
    (texts / "b.txt").write_text("fine\n")
    (texts / "c.txt").write_bytes(b"line one\nna\xefve\n")
    beir = root / "dev-only"  # a BEIR folder whose qrels are only dev.tsv
    (beir / "qrels").mkdir(parents=True)
    (beir / "queries.jsonl").write_text(json.dumps({"_id": "q1", "text": "what?"}) + "\n")
    (beir / "corpus.jsonl").write_text(json.dumps({"_id": "d1", "text": "x"}) + "\n")
    (beir / "qrels" / "dev.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\n")
    return root


def test_usage_errors(inputs, tmp_path):
    home = ["--home", tmp_path / "home"]
    cases = {  # name: (args, what the error line must say)
        "k 0": (["retrieve", "q", "--k", "0", *home], "--k"),
        "k -1": (["retrieve", "q", "--k", "-1", *home], "--k"),
        "k 100000 (Milvus)": (["retrieve", "q", "--k", "100000", *home], "1000"),  # the limit
        "k 1e11 (tantivy)": (["retrieve", "q", "--k", "100000000000", *home], "--k"),
        "unknown option": (["retrieve", "q", "--bogus"], "no such option: --bogus"),
        "missing argument": (["retrieve"], "missing argument 'query'"),
        "branches 0": (["search", "q", "--branches", "0", *home], "--branches"),
        "limit 0": (["eval", inputs / "dev-only", "--limit", "0", *home], "--limit"),
        "synth docs 3": (["synth", tmp_path / "s", "--docs", "3"], "--docs"),
        "synth docs 10M": (["synth", tmp_path / "s", "--docs", "10000000"], "--docs"),
        "unknown executor": (["search", "q", "--executor", "spark", *home], "--executor"),
        "unknown mode": (["retrieve", "q", "--mode", "fuzzy", *home], "--mode"),
        "unknown split": (["eval", inputs / "dev-only", "--split", "val", *home], "--split"),
        "empty question": (["search", "  ", *home], "empty question"),
        "empty query": (["retrieve", "", *home], "empty query"),
        "punctuation question": (["search", "?! …", *home], "question has no words"),
        "punctuation query": (["retrieve", "...", *home], "query has no words"),
        "batch -o folder": (["batch", inputs / "questions.jsonl", "-o", inputs / "outdir",
                             *home], "is a folder"),
        "synth into a file": (["synth", inputs / "a-file"], "is a file"),
        "synth under a file": (["synth", inputs / "a-file" / "sub"], "not a folder"),
        "synth unwritable": (["synth", "/proc/branchsearch-synth"], "synth:"),
        "non-UTF-8 batch input": (["batch", inputs / "latin1-questions.jsonl", "-o",
                                   tmp_path / "out.jsonl", *home], "latin1-questions.jsonl:1: "
                                  "not UTF-8 text (byte b'\\xe9' at offset 28)"),
        "non-UTF-8 corpus": (["ingest", inputs / "latin1-corpus.jsonl", *home],
                             "latin1-corpus.jsonl:2: not UTF-8"),
        "non-UTF-8 text files, all named": (
            ["ingest", inputs / "latin1-texts", *home],
            f"not UTF-8 text: {inputs / 'latin1-texts' / 'a.txt'}:1 (byte b'\\xe9' at offset 3); "
            f"{inputs / 'latin1-texts' / 'c.txt'}:2 (byte b'\\xef' at offset 11)"),
        "split missing": (["eval", inputs / "dev-only", *home], "use --split dev"),
        "acl * is reserved": (["retrieve", "q", "--acl", "*", *home], "reserved"),
        "acl __public__ is reserved": (["retrieve", "q", "--acl", "__public__", *home],
                                       "'__public__' is reserved"),
        "acl empty": (["search", "q", "--acl", "", *home], "may not be empty"),
        "empty batch input": (["batch", inputs / "empty.jsonl", "-o", tmp_path / "e.jsonl",
                               *home], "no questions"),
        "batch input of plain text": (["batch", inputs / "questions.txt", "-o",
                                       tmp_path / "t.jsonl", *home],
                                      "no questions (one JSON object a line, {\"id\": …, "
                                      "\"question\": …}); 3 malformed line(s), the first "
                                      f"{inputs / 'questions.txt'}:1: not JSON"),
        "batch -o the input": (["batch", inputs / "questions.jsonl", "-o",
                                inputs / "." / "questions.jsonl", *home], "is the input file"),
        "batch -o a foreign file": (["batch", inputs / "questions.jsonl", "-o",
                                     inputs / "notes.jsonl", *home],
                                    "notes.jsonl:1 is not a batch result line"),
        "settings k": (["search", "q", "--config", inputs / "k.toml", *home], "search_k"),
        "batch -o a pipe": (["batch", inputs / "questions.jsonl", "-o", inputs / "fifo",
                             *home], "is not a regular file"),
        "eval --report a pipe": (["eval", inputs / "dev-only", "--split", "dev", "--report",
                                  inputs / "fifo", *home], "is not a regular file"),
        "batch -o where nothing can be written": (["batch", inputs / "questions.jsonl", "-o",
                                                   "/proc/bs-out.jsonl", *home],
                                                  "cannot write in /proc (no files can be "
                                                  "made there)"),
        "eval --plots a file": (["eval", inputs / "dev-only", "--split", "dev", "--plots",
                                 inputs / "a-file", *home], "is not a folder"),
        "loadtest --report where nothing can be written": (
            ["loadtest", "--queries", inputs / "questions.jsonl", "--rate", "1", "--duration",
             "1", "--report", "/proc/bs-lt.json", *home], "cannot write in /proc"),
        "eval --report OUT.md": (["eval", inputs / "dev-only", "--split", "dev", "--report",
                                  tmp_path / "ev.md", *home], "give OUT.json"),
        "loadtest --report OUT.md": (  # the Markdown summary was written over the JSON
            ["loadtest", "--queries", inputs / "questions.jsonl", "--rate", "1", "--duration",
             "1", "--report", tmp_path / "lt.md", *home], "give OUT.json"),
        "loadtest --report OUT.MD": (  # the same file on a file system that folds case
            ["loadtest", "--queries", inputs / "questions.jsonl", "--rate", "1", "--duration",
             "1", "--report", tmp_path / "LT.MD", *home], "give OUT.json"),
        "loadtest --report /dev/null": (  # refused after the whole ramp, as root
            ["loadtest", "--queries", inputs / "questions.jsonl", "--rate", "1", "--duration",
             "1", "--report", "/dev/null", *home], "not a regular file"),
        "loadtest --plots under a file": (
            ["loadtest", "--queries", inputs / "questions.jsonl", "--rate", "1", "--duration",
             "1", "--plots", inputs / "a-file" / "plots", *home], "not a folder"),
    }
    (inputs / "k.toml").write_text("search_k = 5000\n")
    if not (inputs / "fifo").exists():  # a device such as /dev/null is not ours to replace
        os.mkfifo(inputs / "fifo")
    results = run_all({name: args for name, (args, _) in cases.items()})
    for name, (_, expect) in cases.items():
        assert_one_error_line(results[name], expect, name)
    assert not (tmp_path / "s").exists()  # nothing written by the refused synth runs
    assert not (tmp_path / "ev.md").exists() and not (tmp_path / "lt.md").exists()
    assert not (tmp_path / "e.jsonl").exists()  # nor by the empty batch
    assert not (tmp_path / "t.jsonl").exists()  # nor by the plain text one
    assert (inputs / "questions.jsonl").read_text().count("\n") == 1  # input untouched
    assert "plain text" in (inputs / "notes.jsonl").read_text()  # nor the foreign file
    assert stat.S_ISFIFO((inputs / "fifo").stat().st_mode)  # still a pipe, not a file


def test_bad_home_index_name_and_settings_file(inputs, tmp_path):
    """A `--home` that is a file, an index name no folder can have, a settings file that is not
    UTF-8 or not TOML: one line, exit 2, nothing written (were tracebacks, exit 1)."""
    a_file = inputs / "a-file"
    long_name = "a" * 300
    home = ["--home", tmp_path / "home"]
    (tmp_path / "latin1.toml").write_bytes(b"budget_tokens = 4096 # caf\xe9\n")
    (tmp_path / "broken.toml").write_text("budget_tokens = = 3\n")
    (tmp_path / "latin1-home").mkdir()
    (tmp_path / "latin1-home" / "branchsearch.toml").write_bytes(b"# caf\xe9\n")
    questions = inputs / "questions.jsonl"
    file_home = "is a file, not a folder"
    cases = {
        "ingest --home file": (["ingest", questions, "--home", a_file], file_home),
        "retrieve --home file": (["retrieve", "q", "--home", a_file], file_home),
        "search --home file": (["search", "q", "--executor", "local", "--home", a_file],
                               file_home),
        "batch --home file": (["batch", questions, "-o", tmp_path / "o.jsonl", "--executor",
                               "local", "--home", a_file], file_home),
        "indexes --home file": (["indexes", "--home", a_file], file_home),
        "eval --home file": (["eval", inputs / "dev-only", "--split", "dev", "--home", a_file],
                             file_home),
        "--home under a file": (["retrieve", "q", "--home", a_file / "sub"],
                                f"{a_file} is a file"),
        "ingest long index": (["ingest", questions, "--index", long_name, *home], "too long"),
        "retrieve long index": (["retrieve", "q", "--index", long_name, *home], "too long"),
        "search long index": (["search", "q", "--index", long_name, *home], "too long"),
        "batch long index": (["batch", questions, "-o", tmp_path / "o.jsonl", "--index",
                              long_name, *home], "1-100 letters"),
        "index 101 characters": (["retrieve", "q", "--index", "b" * 101, *home], "too long"),
        "index with a slash": (["retrieve", "q", "--index", "../x", *home], "not allowed"),
        "config not UTF-8": (["retrieve", "q", "--config", tmp_path / "latin1.toml", *home],
                             "latin1.toml:1: not UTF-8"),
        "home's config not UTF-8": (["retrieve", "q", "--home", tmp_path / "latin1-home"],
                                    "branchsearch.toml:1: not UTF-8"),
        "config not TOML": (["search", "q", "--config", tmp_path / "broken.toml", *home],
                            "not valid TOML"),
        "config a folder": (["ingest", questions, "--config", tmp_path, *home], "is a folder"),
    }
    results = run_all({name: args for name, (args, _) in cases.items()})
    for name, (_, expect) in cases.items():
        assert_one_error_line(results[name], expect, name)
    assert a_file.read_text() == "not a folder\n"
    assert not (tmp_path / "home").exists() and not (tmp_path / "o.jsonl").exists()
    assert list((tmp_path / "latin1-home").iterdir()) == [tmp_path / "latin1-home" /
                                                           "branchsearch.toml"]


def test_an_encoding_or_elasticsearch_url_we_cannot_use_is_one_line(inputs, tmp_path):
    """An encoding not shipped (tiktoken would download it) and an es_url the Elasticsearch
    client refuses: one line before anything is written (were 100+ line tracebacks). A URL's
    password never appears, even where it did not parse as one."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"_id": "d", "title": "T", "text": "some text"}) + "\n")
    cases = {}
    for name, line, expect in [
            ("encoding p50k", 'encoding = "p50k_base"', "'p50k_base' is not a tiktoken"),
            ("encoding bogus", 'encoding = "bogus"', "use cl100k_base, o200k_base"),
            ("es_url no scheme", 'es_url = "127.0.0.1:9200"', "needs a scheme and a host"),
            ("es_url password, no scheme", 'es_url = "elastic:hunter2@es:9200"', "scheme"),
            ("es_url no port", 'es_url = "http://localhost"', "needs its port"),
            ("es_url bad port", 'es_url = "http://u:hunter2@es:x"', "port is not a number"),
            ("es_url port out of range", 'es_url = "http://es:99999"', "from 0 to 65535"),
            ("es_url raw slash in password", 'es_url = "http://u:hun/ter2@es:9200"',
             "percent-encode them"),
            ("es_url raw ? in password", 'es_url = "http://u:hunter2?x@es:9200"',
             "percent-encode them"),
            ("es_url digits then raw slash", 'es_url = "http://u:12/hunter2@es:9200"',
             "percent-encode them"),  # parses as host u, port 12: the wrong host
            ("es_url leading space", 'es_url = " http://elastic:hunter2@es:9200"', "a space"),
            ("es_url space in host", 'es_url = "http://e s:9200"', "a space"),
            ("es_url ipv6 bracket not closed", 'es_url = "http://u:hunter2@[::1:9200"',
             "IPv6 host goes in brackets"),
            ("es_url ipv6 without brackets", 'es_url = "http://u:hunter2@::1:9200"',
             "IPv6 host goes in brackets"),
            ("es_url ipv6 zone", 'es_url = "http://[fe80::1%eth0]:9200"', "cannot read it"),
            ("external index es_url", '[indexes.corp]\nlexical = "elasticsearch"\n'
             'es_index = "corp-docs"\nes_url = " http://elastic:hunter2@127.0.0.1:9"',
             "[indexes.corp] es_url: has a space")]:
        config = tmp_path / f"{name.replace(' ', '-').replace(',', '')}.toml"
        config.write_text(line + "\n")
        home = tmp_path / f"home-{config.stem}"
        # a mistake in one [indexes.NAME] table stops that index only
        index = ["--index", "corp"] if name.startswith("external") else []
        cases[f"ingest {name}"] = (["ingest", corpus, "--home", home, "--config", config,
                                    *index], "is external (misconfigured)" if index else expect)
        cases[f"search {name}"] = (["search", "q", "--home", home, "--config", config, *index],
                                   expect)
    results = run_all({name: args for name, (args, _) in cases.items()})
    for name, (_, expect) in cases.items():
        assert_one_error_line(results[name], expect, name)
        assert "hunter2" not in results[name].stderr + results[name].stdout, name
    assert not list(tmp_path.glob("home-*"))


def test_index_names_any_script_up_to_100_characters(tmp_path):
    """The rule (infra/config/settings.py, one place): 1-100 letters, digits, '-', '_' of any script,
    at most 200 bytes in UTF-8, so the name is one folder on every file system."""
    from branchsearch.infra.errors import SettingsError
    from branchsearch.infra.config.settings import index_name_problem, load_settings

    for good in ("default", "a" * 100, "é" * 100, "财务-2024_q1", "x"):
        assert index_name_problem(good) == "", good
    for bad in ("", "a" * 101, "😀" * 51, "../x", "a b", "a.b", "a/b", "-", "__", None, 5):
        assert index_name_problem(bad), bad
    with pytest.raises(SettingsError, match="too long"):
        load_settings(overrides={"index": "a" * 300}, read_env=False, read_file=False)
    with pytest.raises(SettingsError, match="too long"):  # from a settings file too
        (tmp_path / "s.toml").write_text(f'index = "{"a" * 300}"\n')
        load_settings(tmp_path / "s.toml", read_env=False)
    name = "é" * 100  # 200 bytes: the longest name in the widest letters still ingests
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"_id": "d1", "title": "T", "text": "Falcon plan"}) + "\n")
    home = ["--home", tmp_path / "home", "--index", name]
    done = run(["ingest", corpus, "--no-dense", *home])
    assert done.returncode == 0, done.stderr[-800:]
    shown = run(["retrieve", "Falcon", "--mode", "bm25", *home])
    assert shown.returncode == 0 and "d1#p0" in shown.stdout, shown.stderr[-800:]


def test_keys_with_a_home_that_is_a_file(inputs):
    """`keys` reads `--home`/keys.json without settings: a file there is one line too."""
    for args in (["keys", "list"], ["keys", "add", "bob", "--groups", "g"]):
        done = run([*args, "--home", inputs / "a-file"])
        assert_one_error_line(done, f"{inputs / 'a-file'} is a file, not a folder", args[1])
    assert (inputs / "a-file").read_text() == "not a folder\n"


def test_keys_in_a_home_that_cannot_be_written(tmp_path):
    """`keys add` / `keys revoke` with a read-only home were a Rich traceback; now one line,
    the keys file unchanged."""
    from conftest import read_only_folder

    home = tmp_path / "home"
    assert run(["keys", "add", "alice", "--groups", "g", "--home", home]).returncode == 0
    before = (home / "keys.json").read_text()
    with read_only_folder(home):
        for args in (["keys", "add", "bob", "--groups", "g"], ["keys", "revoke", "alice"]):
            done = run([*args, "--home", home])
            assert_one_error_line(done, "keys.json cannot be written", args[1])
    assert (home / "keys.json").read_text() == before


def test_keys_that_could_never_work_are_made_with_a_note(tmp_path):
    """An index list naming an index the home lacks (a typo) and an admin key without groups
    (it can write no document): both keys are made, each with a note."""
    home = tmp_path / "home"
    typo = run(["keys", "add", "t", "--indexes", "hotpt", "--home", home])
    assert typo.returncode == 0 and "note: no index 'hotpt' in" in typo.stderr, typo.stderr
    admin = run(["keys", "add", "a", "--admin", "--home", home])
    assert admin.returncode == 0 and "admin key without groups writes no document" in \
        admin.stderr, admin.stderr
    quiet = run(["keys", "add", "g", "--admin", "--groups", "hr", "--home", home])
    assert "note:" not in quiet.stderr, quiet.stderr


def test_keys_for_an_index_named_in_another_unicode_form_get_no_note(tmp_path):
    """`keys add --indexes café` typed decomposed (NFD, as macOS types it) for an index 'café'
    the home holds: the key was stored in NFC and works, but the command said "note: no index
    'café' in HOME now" — the note compared the name as typed with the folder's."""
    import unicodedata

    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.ingest.pipeline import ingest

    from service_fixtures import write_corpus

    home = tmp_path / "home"
    home.mkdir()
    ingest(write_corpus(tmp_path / "corpus.jsonl"), load_settings(
        overrides={"home": home, "index": "café"}, read_env=False, read_file=False), dense=False)
    done = run(["keys", "add", "k", "--indexes", unicodedata.normalize("NFD", "café"),
                "--home", home])
    assert done.returncode == 0 and "note:" not in done.stderr, done.stderr


def test_an_option_given_before_its_command_says_where_it_goes(tmp_path):
    """`branchsearch --home X search …` (other CLIs take such options first): one line saying
    where the option goes, not click's "No such option: --home (Possible options: --help)"."""
    done = run(["--home", tmp_path, "search", "q", "--index", "x"])
    assert_one_error_line(done, "--home goes after the command: `branchsearch search … --home …`")
    done = run(["keys", "--home", tmp_path, "list"])
    assert_one_error_line(done, "--home goes after the command: `branchsearch keys list … --home")
    done = run(["--acl", "hr", "synth", tmp_path / "s"])  # synth takes no --acl: who does
    assert_one_error_line(done, "--acl goes after a command that takes it: retrieve, search,")
    assert_one_error_line(run(["--bogus", "search", "q"]), "no such option: --bogus")
    assert not (tmp_path / "s").exists() and not (tmp_path / "indexes").exists()


def test_no_arguments_prints_help_and_exits_2():
    done = run([])
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "Usage: branchsearch" in done.stdout + done.stderr
    assert run(["--help"]).returncode == 0


def test_help_shows_a_flag_as_taking_no_value():
    """`search --help`: a flag (`--json`, `--acl-admin`) is shown bare. typer 0.29 showed
    `--json <bool>`, and a user who then typed `--json true` got "unexpected extra
    argument"."""
    done = run(["search", "--help"], env={"COLUMNS": "200"})
    shown = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout)
    flags = [line for line in shown.splitlines() if "--json" in line or "--acl-admin" in line]
    assert len(flags) == 2 and not any("<" in line for line in flags), flags


def test_the_command_list_says_each_command_in_one_line():
    """`branchsearch --help` on a wide terminal: each command's summary whole on its own line,
    not broken where its docstring's lines end."""
    from branchsearch.orchestrator.cli.main import app

    done = run(["--help"], env={"COLUMNS": "400"})
    rows = [line.strip("│ ").split(None, 1) for line in done.stdout.splitlines()
            if line.startswith("│ ") and not line.startswith("│ --")]
    assert {row[0] for row in rows} == {c.name or c.callback.__name__
                                        for c in app.registered_commands} | {"keys"}
    for name, summary in rows:
        assert len(summary.split()) >= 3 and summary.rstrip().endswith((".", ")")), (name, summary)


def test_every_option_says_in_its_help_what_it_does():
    """`branchsearch CMD --help` describes each option (serve's --home and --port, eval's
    --limit, every --json once showed a bare type)."""
    import typer

    from branchsearch.orchestrator.cli.main import app

    def bare(command, path):
        for name, sub in getattr(command, "commands", {}).items():
            yield from bare(sub, f"{path} {name}")
        for param in command.params:
            if param.param_type_name == "option" and not param.help:
                yield f"{path} {'/'.join(param.opts)}"

    assert list(bare(typer.main.get_command(app), "branchsearch")) == []


def test_eval_split_reads_dev_qrels(inputs):
    from branchsearch.infra.datasets.beir import read_queries

    assert [q.id for q in read_queries(inputs / "dev-only", "dev")] == ["q1"]
    with pytest.raises(Exception, match="use --split dev"):
        read_queries(inputs / "dev-only")


def test_eval_refuses_questions_it_cannot_score_and_says_when_gold_is_missing(tmp_path):
    """A question that is a number, null, or has no words is the dataset's line, named, in
    every mode; a blank line closing qrels is skipped; gold documents the index lacks are said
    to count as misses, and an index holding none of them (another corpus's) is refused
    rather than scored 0."""
    from conftest import HOTPOT

    data = tmp_path / "set"
    (data / "qrels").mkdir(parents=True)
    (data / "corpus.jsonl").write_text(
        '{"_id": "keep", "title": "Keep", "text": "stable doc about beavers"}\n'
        '{"_id": "ocelot", "title": "Ocelot", "text": "a page about ocelots"}\n')
    (data / "qrels" / "test.tsv").write_text("q1\tkeep\t1\nq2\tocelot\t1\n\n")
    home = ["--home", tmp_path / "home", "--index", "set"]
    for text, says in (("5", "'text' must be a string, not 5"),
                       ("null", "'text' must be a string, not null"),
                       ('"???"', "queries.jsonl:1: query 'q1': the question has no words")):
        (data / "queries.jsonl").write_text(
            f'{{"_id": "q1", "text": {text}}}\n{{"_id": "q2", "text": "ocelots?"}}\n')
        for mode in (["--mode", "bm25"], ["--policy", "heuristic"]):
            assert_one_error_line(run(["eval", data, *home, *mode]), says, f"{text} {mode}")
    (data / "queries.jsonl").write_text('{"_id": "q1", "text": "beavers"}\n'
                                        '{"_id": "q2", "text": "ocelots?"}\n'
                                        '{"_id": "q1", "text": "again"}\n')
    assert_one_error_line(run(["eval", data, *home, "--mode", "bm25"]),
                          "queries.jsonl:3: duplicate query id 'q1'")
    (data / "queries.jsonl").write_text('{"_id": "q1", "text": "beavers"}\n'
                                        '{"_id": "q2", "text": "ocelots?"}\n')
    (data / "qrels" / "test.tsv").write_text("q1\tkeep\t1\nq2\tocelot\t1\nq2\tgone\t1\n\n")
    done = run(["eval", data, *home, "--mode", "bm25"])
    assert done.returncode == 0, done.stderr[-800:]
    assert "warning: 1 of 3 of the gold documents are not in index 'set'" in done.stderr
    other = run(["eval", HOTPOT, *home, "--mode", "bm25"])
    assert_one_error_line(other, "none of the 24 gold documents is in index 'set'")


def test_a_qrels_pair_scored_twice_differently_is_one_error_line(tmp_path):
    """A (query-id, corpus-id) pair on two qrels lines with different scores kept the last one
    silently (a grade 2 made 1, a gold document made not gold by a later 0); it is one error
    line naming the file and line, and the line it contradicts, before anything is ingested.
    The same score twice says the same thing: read once, without a word."""
    from branchsearch.infra.datasets.beir import read_queries

    data = tmp_path / "set"
    (data / "qrels").mkdir(parents=True)
    (data / "corpus.jsonl").write_text('{"_id": "d1", "text": "beavers build dams"}\n'
                                       '{"_id": "d2", "text": "otters eat clams"}\n')
    (data / "queries.jsonl").write_text('{"_id": "q1", "text": "beavers"}\n')
    home = ["--home", tmp_path / "home", "--index", "set", "--mode", "bm25"]
    qrels = data / "qrels" / "test.tsv"
    for rows, says in ((["q1\td1\t2", "q1\td2\t1", "q1\td1\t1"],
                        "test.tsv:4: query 'q1', document 'd1' is scored 1 here and 2 on line 2"),
                       (["q1\td1\t1", "q1\td1\t0"],
                        "test.tsv:3: query 'q1', document 'd1' is scored 0 here and 1 on line 2"),
                       (["q1\t0\td1\t1", "q1\t0\td1\t2"],  # TREC's four columns
                        "test.tsv:3: query 'q1', document 'd1' is scored 2 here and 1 on line 2")):
        qrels.write_text("query-id\tcorpus-id\tscore\n" + "\n".join(rows) + "\n")
        assert_one_error_line(run(["eval", data, *home]), says, rows)
        assert not (tmp_path / "home" / "indexes").exists()  # nothing ingested
    qrels.write_text("q1\td1\t2\nq1\td2\t1\nq1\td1\t2\n")
    assert read_queries(data)[0].gold == {"d1": 2, "d2": 1}
    import unicodedata  # one id in two Unicode forms is one document (as the index holds it)

    qrels.write_text(f"q1\t{unicodedata.normalize('NFD', 'café')}\t1\nq1\tcafé\t2\n")
    with pytest.raises(CorpusError, match="test.tsv:2: query 'q1', document 'café' is scored 2"):
        read_queries(data)


def test_bounds_and_patterns_below_the_cli():
    assert check_k(MAX_K) == MAX_K and check_k(0) == 0
    for bad in (MAX_K + 1, 100_000_000_000, -1, 2.5, True):
        with pytest.raises(BadQuery):
            check_k(bad)
    assert check_pattern("[^a]pple") == "[^a]pple"  # a negated class, not an anchor
    assert check_pattern("[a$]") == "[a$]" and check_pattern("a\\$") == "a\\$"
    for bad, says in (("^acme", "anchors"), ("acme$", "anchors"), ("a\\d", "[0-9]"),
                      ("(?i)a", "lookaround"), ("(a)\\1", "backreferences")):
        with pytest.raises(BadQuery, match=says.replace("[", r"\[").replace("]", r"\]")):
            check_pattern(bad)


def test_terminal_text_shows_control_characters_as_escapes():
    hostile = ("T\x1b]0;pwned\x07i\x1b]52;c;aGk=\x1b\\t\x1b[2J\x1b[31ml\x1b[0me"
               "\x9b31m\u202e\x00\x7f")
    shown = visible(hostile)
    assert shown == ("T\\x1b]0;pwned\\x07i\\x1b]52;c;aGk=\\x1b\\t\\x1b[2J\\x1b[31ml"
                     "\\x1b[0me\\x9b31m\\u202e\\x00\\x7f")
    assert shown.isprintable() and shown.isascii()
    assert visible("a\tb\nc\rd\x0ce") == "a\tb\nc\\rd\\x0ce"  # a text keeps its lines
    assert one_line("a\n\tb \x1b[Kc", 4) == "a b "
    assert one_line("a\r\nb\x0cc\x0bd \x1b[Kc") == "a b c d \\x1b[Kc"  # breaks: a space


def test_retrieve_prints_escapes_as_text_but_json_keeps_them(tmp_path):
    corpus = tmp_path / "c.jsonl"
    title, text = "Falcon \x1b]0;pwned\x07 plan\x1b[2J", "Falcon \x1b[31mred\x1b[0m text"
    corpus.write_text(json.dumps({"_id": "d1", "title": title, "text": text}) + "\n")
    home = ["--home", tmp_path / "home"]
    assert run(["ingest", corpus, "--no-dense", *home]).returncode == 0
    shown = run(["retrieve", "Falcon", "--mode", "bm25", *home])
    assert shown.returncode == 0, shown.stderr[-800:]
    assert "\x1b" not in shown.stdout and "\x07" not in shown.stdout
    assert r"Falcon \x1b]0;pwned\x07 plan\x1b[2J" in shown.stdout
    assert r"Falcon \x1b[31mred\x1b[0m text" in shown.stdout
    raw = run(["retrieve", "Falcon", "--mode", "bm25", "--json", *home])
    assert json.loads(raw.stdout)[0]["title"] == title  # --json keeps the text as it is
    assert "note:" not in shown.stderr  # asked for BM25, got BM25: nothing to say
    hybrid = run(["retrieve", "Falcon", *home])  # the default mode on a BM25-only index
    assert hybrid.returncode == 0 and r"\x07 plan" in hybrid.stdout
    assert "has only its bm25 side" in hybrid.stderr and "--no-dense" in hybrid.stderr


@pytest.mark.ray
@pytest.mark.es
@pytest.mark.ray
def test_backend_down_on_the_ray_executor(tmp_path, es_url):
    """A retriever actor that cannot reach its backend (the Elasticsearch its index was
    ingested into, now named at a dead port): the error it died of, as one line, not Ray's
    ActorDiedError with its traceback."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"_id": "d1", "title": "Falcon", "text": "Falcon plan"}) + "\n")
    home = ["--home", tmp_path / "home", "--index", f"down-{os.getpid()}"]
    ingested = run(["ingest", corpus, "--no-dense", *home], env={"BRANCHSEARCH_ES_URL": es_url})
    assert ingested.returncode == 0, ingested.stderr[-1500:]
    done = run(["search", "Falcon", "--branches", "2", "--executor", "ray", *home],
               env={"BRANCHSEARCH_ES_URL": "http://127.0.0.1:9", "RAY_ADDRESS": ""},
               timeout=600)
    assert done.returncode == 2, done.stderr[-1500:]
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    if len(errors) == 1 and "cannot start a local cluster" in errors[0]:
        pytest.skip(f"this machine could not start Ray (not the case under test): {errors[0]}")
    assert len(errors) == 1 and "127.0.0.1:9" in errors[0], done.stderr[-1500:]


def test_synth_bounds_in_the_library(tmp_path):
    from branchsearch.infra.datasets.synth import MAX_DOCS, SynthError, synth

    with pytest.raises(SynthError, match="at most"):
        synth(tmp_path / "big", docs=MAX_DOCS + 1, tasks=1)
    with pytest.raises(SynthError, match="free space"):  # /proc has none: checked before writing
        synth(Path("/proc") / "x", docs=1000, tasks=10)
    assert not (tmp_path / "big").exists()


def test_synth_tasks_past_the_name_pool_is_one_error_not_a_hang(tmp_path):
    """Each task's project name is drawn without repeats from ADJ x NOUN: asking for more
    tasks than there are names looped forever (`--docs 16000 --tasks 2000` never returned)."""
    from branchsearch.infra.datasets.synth import MAX_TASKS, SynthError, synth

    counts = synth(tmp_path / "most", docs=8 * MAX_TASKS, tasks=MAX_TASKS)
    assert counts["tasks"] == MAX_TASKS
    with pytest.raises(SynthError, match=f"at most {MAX_TASKS:,} tasks"):
        synth(tmp_path / "more", docs=8 * (MAX_TASKS + 1), tasks=MAX_TASKS + 1)
    assert not (tmp_path / "more").exists()


@pytest.mark.parametrize("args", [["--docs", "5000", "--tasks", "3000"],
                                  ["--hard", "--docs", "800", "--tasks", "300"]],
                         ids=["synth", "hard"])
def test_synth_asked_for_too_many_tasks_says_the_cap_first(tmp_path, args):
    """`synth DIR --docs 5000 --tasks 3000` said "need docs >= 8 * tasks"; given 24,000
    documents it then said "at most 1,260 tasks" (hostile pass): the cap, which no number of
    documents lifts, is said at once."""
    done = subprocess.run([*CLI, "synth", str(tmp_path / "out"), *args], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "at most" in done.stderr and "8 ×" not in \
        done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


def test_output_cut_by_its_reader_exits_141_not_failed(tmp_path):
    """`retrieve … | head -1`: the reader closing the pipe ends the command as SIGPIPE ends
    a Unix tool (141, no traceback), not with 1, which says a search failed."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"_id": f"d{i}", "title": f"Falcon {i}",
                                          "text": "Falcon plan " * 40}) + "\n"
                              for i in range(400)))
    home = ["--home", tmp_path / "home", "--index", "ix"]
    assert run(["ingest", corpus, "--no-dense", *home]).returncode == 0
    # 400 hits print ~100 KB, more than a pipe holds (64 KB): the command is still writing
    # when the reader goes (with 50 hits it could finish first on a loaded machine: exit 0)
    proc = subprocess.Popen([*CLI, "retrieve", "Falcon plan", "--k", "400", *map(str, home)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()  # the reader goes away with 399 hits unread
    assert proc.wait(timeout=120) == 141
    err = proc.stderr.read().decode()
    assert "Traceback" not in err and "Broken pipe" not in err and "error" not in err, err
    # the help text too (rich, not click, writes it), and a reader that is /dev/null from
    # the start is not a reader gone: a usage error there still exits 2
    for args in (["--help"], ["search", "--help"]):
        proc = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        proc.stdout.close()
        assert proc.wait(timeout=120) == 141, args
        assert "Traceback" not in proc.stderr.read().decode()
    assert subprocess.run([*CLI, "--help"], stdout=subprocess.DEVNULL).returncode == 0
    assert subprocess.run([*CLI, "search"], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode == 2


def test_synth_writes_over_its_own_folder_only(tmp_path):
    """A folder synth wrote can be written again (the same seed, the same files); a user's
    BEIR folder is refused with one line, and left as it was."""
    from conftest import HOTPOT

    ours = tmp_path / "ours"
    for _ in range(2):
        done = run(["synth", ours, "--docs", "16", "--tasks", "2"])
        assert done.returncode == 0, done.stderr[-800:]
    theirs = tmp_path / "theirs"
    shutil.copytree(HOTPOT, theirs)
    before = {p: p.read_bytes() for p in theirs.rglob("*") if p.is_file()}
    done = run(["synth", theirs, "--docs", "16", "--tasks", "2"])
    assert_one_error_line(done, "already holds files synth did not write (corpus.jsonl")
    assert {p: p.read_bytes() for p in theirs.rglob("*") if p.is_file()} == before
    forced = run(["synth", theirs, "--docs", "16", "--tasks", "2", "--force"])
    assert forced.returncode == 0 and (theirs / "synth.json").exists(), forced.stderr[-800:]
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / ".gitkeep").write_text("")  # hidden files are no one's data
    assert run(["synth", tmp_path / "kept", "--docs", "16", "--tasks", "2"]).returncode == 0


def test_actor_died_of_a_user_error_is_that_error():
    """An actor that dies in its constructor of a user error: the execution room raises that
    error itself (Ray's ActorDiedError carries the creation task's error, which holds it), so
    the CLI shows one line; an unrelated actor death is not the user's and keeps its
    traceback."""
    import traceback

    from ray.exceptions import ActorDiedError, RayTaskError

    from branchsearch.infra.errors import BackendUnavailable
    from branchsearch.orchestrator.cli import user_error
    from branchsearch.orchestrator.execution.pool import start_error

    try:
        raise BackendUnavailable("elasticsearch at http://127.0.0.1:9 is not reachable")
    except BackendUnavailable as exc:
        died = ActorDiedError(RayTaskError("RetrieverService.__init__",
                                           "".join(traceback.format_exception(exc)), exc))
    cause = start_error(died)
    assert isinstance(cause, BackendUnavailable)
    assert user_error(cause) == "elasticsearch at http://127.0.0.1:9 is not reachable"
    assert start_error(ActorDiedError()) is None  # a crash, not the user's
    assert user_error(ActorDiedError()) is None  # keeps its traceback
    try:
        raise KeyError("x")
    except KeyError as exc:
        bug = ActorDiedError(RayTaskError("f", "".join(traceback.format_exception(exc)), exc))
    assert start_error(bug) is None and user_error(bug) is None


@pytest.fixture
def one_cpu_ray():
    """A local Ray cluster of one CPU for the test (or the one this process is connected to),
    shut down after it when the test started it."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


@pytest.mark.ray
def test_an_actor_killed_while_starting_is_a_backend_to_retry(tmp_path, one_cpu_ray):
    """An actor whose process is killed before it answers (a retriever started again by the
    service, killed once more): BackendUnavailable, a 503 to retry, not Ray's ActorDiedError
    (a 500 in the service)."""
    import signal
    import time

    import ray

    from branchsearch.infra.errors import BackendUnavailable
    from branchsearch.orchestrator.execution.pool import wait_started

    pidfile = tmp_path / "pid"

    @ray.remote(max_restarts=0, num_cpus=0)
    class Slow:
        def __init__(self, path):
            open(path, "w").write(str(os.getpid()))
            time.sleep(60)

        def ping(self):
            return os.getpid()

    ref = Slow.remote(str(pidfile)).ping.remote()
    waited = time.monotonic()
    while not (pidfile.exists() and pidfile.read_text()):
        assert time.monotonic() - waited < 60, "the actor never started"
        time.sleep(0.1)
    os.kill(int(pidfile.read_text()), signal.SIGKILL)
    with pytest.raises(BackendUnavailable, match=r"1 retriever actor\(s\) died while "
                       r"starting .*; retry$"):
        wait_started([ref], "1 retriever actor(s)", 60, {"CPU": 1}, {})


_OOM_SCRIPT = r"""
import json, time
import ray
from branchsearch.infra.errors import BackendUnavailable
from branchsearch.orchestrator.execution.balancer import Placement
from branchsearch.orchestrator.execution.pool import wait_started
from branchsearch.orchestrator.execution.ray import RayExecutor
from branchsearch.workers.branch import BranchTask

# every worker running a task is over this threshold: Ray's memory monitor kills it
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
         _system_config={"memory_usage_threshold": 0.001, "memory_monitor_refresh_ms": 200})

@ray.remote(max_restarts=0, num_cpus=0)
class Slow:
    def __init__(self, init_s):
        time.sleep(init_s)
    def ping(self):
        return 1
    def run(self, s):
        time.sleep(s)

out = {}
try:
    wait_started([Slow.remote(30).ping.remote()], "1 retriever actor(s)", 60, {"CPU": 1}, {})
except BackendUnavailable as exc:
    out["start"] = f"BackendUnavailable: {exc}"
except Exception as exc:
    out["start"] = f"{type(exc).__name__}"

class Pool:  # what the executor does with the lost actor
    replaced, released = [], []
    def replace(self, actor): self.replaced.append(actor)
    def release(self, actor): self.released.append(actor)

executor = object.__new__(RayExecutor)
executor.pool = Pool()
actor = Slow.remote(0)
try:
    report = executor._collect(BranchTask(1, "q"), Placement(actor.run.remote(30), 0, actor))
    out["branch"] = [report.status, report.error.split(":")[0], len(Pool.replaced)]
    hosted = executor._collect(BranchTask(0, "q"), Placement(Slow.remote(0).run.remote(30), 0))
    out["hosted"] = repr(hosted)
except Exception as exc:
    out["branch"] = f"{type(exc).__name__}"

# the service's call on an index's retriever (a document write, a readiness probe)
from types import SimpleNamespace
from branchsearch.orchestrator.service.errors import ApiError
from branchsearch.orchestrator.service.searcher import Searcher

ray_executor = object.__new__(RayExecutor)
ray_executor.retriever, ray_executor._starting = Slow.remote(0), {}
driver = SimpleNamespace(executor=ray_executor)
try:
    Searcher._in_retriever(object.__new__(Searcher), "idx", driver, None,
                           lambda actor, s: time.sleep(s), 30)
    out["service"] = "no error"
except ApiError as exc:
    out["service"] = [exc.status, exc.error]
except Exception as exc:
    out["service"] = f"{type(exc).__name__}"
print(json.dumps(out))
ray.shutdown()
"""


@pytest.mark.ray
def test_an_actor_killed_for_memory_is_a_backend_to_retry_or_a_lost_branch(tmp_path):
    """Ray's memory monitor kills actors when the node runs low on memory (a service that
    opened many indexes: each holds a retriever with its models). A retriever killed while
    starting is BackendUnavailable (a 503 to retry), and a branch whose actor was killed is
    that actor lost (replaced; a hosted branch runs elsewhere), not Ray's OutOfMemoryError
    raised through the search (a 500 internal_error in the service). So is the service's call
    on an index's retriever (a document write, a readiness probe): a 503 backend_unavailable
    to retry, not a 500. Its own cluster, whose memory threshold every worker passes, in a
    process of its own."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-c", _OOM_SCRIPT], capture_output=True, text=True,
                          env=env, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["start"].startswith("BackendUnavailable: ray: 1 retriever actor(s) killed while "
                                   "starting: the node ran low on memory"), out
    assert out["branch"] == ["error", "actor died", 1], out  # ACTOR_DIED: the question reruns
    assert out["hosted"] == "None", out  # run again on a pool actor (`_gather`'s rescue)
    assert out["service"] == [503, "backend_unavailable"], out


@pytest.mark.ray
def test_actors_the_cluster_cannot_place_yet_are_said_to_wait(caplog, one_cpu_ray):
    """A start that waits for CPUs other actors hold (a batch beside a running service) says
    so after WAIT_NOTE_S, once, with what it asks and what is free, instead of minutes of
    silence; then fails with one line at its timeout."""
    import logging

    import ray

    from branchsearch.infra.errors import BackendUnavailable
    from branchsearch.orchestrator.execution import pool


    @ray.remote(num_cpus=64)
    class Big:
        def ping(self):
            return 1

    actor = Big.remote()
    try:
        with caplog.at_level(logging.WARNING, logger="branchsearch.executors"), \
                pytest.raises(BackendUnavailable, match="did not start within 11 s"):
            pool.wait_started([actor.ping.remote()], "1 retriever actor(s)", 11,
                              {"CPU": 1}, {"CPU": 64})
        waits = [r.getMessage() for r in caplog.records if "waiting for" in r.getMessage()]
        assert len(waits) == 1 and "1 retriever actor(s)" in waits[0], waits
        assert "{'CPU': 64}" in waits[0]
    finally:
        ray.kill(actor)


@pytest.mark.ray
def test_actors_placed_but_still_loading_are_not_said_to_wait_for_room(caplog, monkeypatch,
                                                                      one_cpu_ray):
    """A retriever actor placed on the cluster but slow to load (the embedder on a loaded
    machine) is starting, not waiting for CPUs: the free CPUs already exclude what the plan's
    placed actors hold, so comparing them with the plan's demand said "waiting … this plan
    asks {'CPU': 2.0}, the cluster has {'CPU': 0.38} free" on every fresh local cluster
    (`demo --executor ray`, `loadtest`)."""
    import logging
    import time

    import ray

    from branchsearch.orchestrator.execution import pool


    @ray.remote(num_cpus=1)
    class Loading:
        def __init__(self):
            time.sleep(6)

        def ping(self):
            return 1

    monkeypatch.setattr(pool, "WAIT_NOTE_S", 2.0)
    actor = Loading.remote()
    try:
        with caplog.at_level(logging.INFO, logger="branchsearch.executors"):
            pool.wait_started([actor.ping.remote()], "1 retriever actor(s)", 60, {"CPU": 1},
                              {"CPU": 1})
        said = [r.getMessage() for r in caplog.records if r.name == "branchsearch.executors"]
        assert said == ["ray: 1 retriever actor(s) still starting (loading; up to 60 s)"], said
    finally:
        ray.kill(actor)


@pytest.mark.ray
def test_a_failed_search_exits_1(tmp_path):
    """`status: failed` is exit status 1 (typer hands a command's exit code back to `main`,
    which once dropped it: a failed search exited 0)."""
    from conftest import HOTPOT

    home = ["--home", tmp_path / "home", "--index", "wiki"]
    assert run(["ingest", HOTPOT, "--no-dense", *home]).returncode == 0
    done = run(["search", "Were Scott Derrickson and Ed Wood of the same nationality?",
                "--branches", "3", *home],
               env={"BRANCHSEARCH_SEARCH_MODE": "bm25", "BRANCHSEARCH_BRANCH_TIMEOUT_S": "0.0001",
                    "RAY_ADDRESS": ""}, timeout=600)
    assert "status: failed" in done.stdout, (done.stdout[-800:], done.stderr[-800:])
    assert done.returncode == 1 and "Traceback" not in done.stderr


@pytest.mark.parametrize("name, status, said", [("SIGINT", 130, "interrupted"),
                                                 ("SIGTERM", 143, "terminated")])
def test_ctrl_c_or_sigterm_on_a_batch_says_so_and_writes_what_ran(tmp_path, name, status, said):
    """^C, or a scheduler's SIGTERM sent to the batch's whole process group (its worker
    processes too): the questions running finish and their rows are written, nothing more
    starts, one line says so, and the exit status is 128 + the signal's number."""
    import signal
    import time

    from conftest import HOTPOT, prepared

    home = ["--home", tmp_path / "home", "--index", "wiki"]
    assert run(["ingest", HOTPOT, "--no-dense", *home]).returncode == 0
    queries = [json.loads(line)["text"] for line in
               (HOTPOT / "queries.jsonl").read_text().splitlines()]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": f"{i}", "question": queries[i % len(queries)]})
                           + "\n" for i in range(2000)))
    parent = (signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, []))
    # ^C handled by default, not ignored nor blocked, as a terminal starts it
    proc = subprocess.Popen(prepared([*CLI, "batch", inp, "-o", out, "--executor", "local",
                                      "--branches", "1", "--concurrency", "2", *home],
                                     sigint_default=True),
                            env={**os.environ, "BRANCHSEARCH_SEARCH_MODE": "bm25"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and (not out.exists() or out.read_text().count("\n") < 3):
        time.sleep(0.1)
    os.killpg(proc.pid, getattr(signal, name))  # what ^C (or a scheduler) sends: the group
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == status, (proc.returncode, parent, stderr[:1500])
    assert said in stderr and "Traceback" not in stderr and "Warning" not in stderr, stderr
    assert ", done" not in stderr  # the last progress line does not say it finished
    lines = out.read_text().splitlines()
    assert 3 <= len(lines) < 2000 and all(json.loads(line)["status"] == "ok" for line in lines)


@pytest.mark.parametrize("executor, starting", [
    ("local", "forkserver"),  # its worker processes import
    pytest.param("ray", "raylet", marks=pytest.mark.ray)])  # its local cluster starts
def test_sigterm_as_a_batch_starts_ends_as_terminated(tmp_path, executor, starting):
    """A scheduler's SIGTERM while the batch still starts: the same stop as later — nothing
    starts, `terminated`, exit status 143, no process of it left. Before, the signal's default
    killed it without a word (worker processes starting), or Ray's handler, put in place as
    its cluster started, exited 15 (or 1, after its core printed a stack), leaving Ray's
    agents running for a minute."""
    import signal

    import psutil

    from conftest import HOTPOT

    home = ["--home", tmp_path / "home", "--index", "wiki"]
    assert run(["ingest", HOTPOT, "--no-dense", *home]).returncode == 0
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": f"{i}", "question": "Who directed Ed Wood?"})
                           + "\n" for i in range(50)))  # more than one: worker processes
    proc = subprocess.Popen([*CLI, "batch", inp, "-o", out, "--executor", executor,
                             "--concurrency", "2", *home],
                            env={**os.environ, "BRANCHSEARCH_SEARCH_MODE": "bm25"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def mid_start() -> list:  # the batch's processes, once one of them shows it is starting
        try:
            children = psutil.Process(proc.pid).children(recursive=True)
            return children if any(starting in " ".join(c.cmdline()) for c in children) else []
        except psutil.Error:
            return []

    try:
        children, deadline = [], time.monotonic() + 120
        while not children and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
            children = mid_start()
        assert proc.poll() is None and children, "the batch ended before it was stopped"
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 143, (proc.returncode, stderr[-1500:])
    assert stderr.splitlines()[-1].startswith("terminated"), stderr[-1500:]
    assert "Traceback" not in stderr and "SIGTERM received" not in stderr, stderr[-1500:]
    _, alive = psutil.wait_procs([c for c in children if c.is_running()], timeout=30)
    assert not alive, [" ".join(p.cmdline())[:80] for p in alive]


def _batch_under_way(tmp_path, name: str, n: int, backup: Path | None = None):
    """A BM25 index `name` of hotpot-mini (copied by `cp -a` to `backup` when given) and a
    local batch of `n` questions on it, started and 3 rows in: (its folder, its version then,
    the output, the command, its environment, the running process)."""
    from conftest import HOTPOT

    home = ["--home", tmp_path / "home", "--index", name]
    folder = tmp_path / "home" / "indexes" / name
    assert run(["ingest", HOTPOT, "--no-dense", *home]).returncode == 0
    if backup is not None:
        subprocess.run(["cp", "-a", folder, backup], check=True)
    began = json.loads((folder / "manifest.json").read_text())["version"]
    queries = [json.loads(line)["text"] for line in
               (HOTPOT / "queries.jsonl").read_text().splitlines()]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": f"{i}", "question": queries[i % len(queries)]})
                           + "\n" for i in range(n)))
    command = [*CLI, "batch", inp, "-o", out, "--executor", "local", "--branches", "1",
               "--concurrency", "2", *home]
    env = {**os.environ, "BRANCHSEARCH_SEARCH_MODE": "bm25"}
    proc = subprocess.Popen(list(map(str, command)), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and (not out.exists() or out.read_text().count("\n") < 3):
        time.sleep(0.1)
    return folder, began, out, command, env, proc


def test_an_index_removed_under_a_batch_stops_it_and_the_resume_asks_again(tmp_path):
    """The index's folder removed while a batch reads it: before, the batch answered every
    question from the files still open (and its worker processes, finding no index, fell
    back to the main process), ending `ok` on an index no longer there. Now it stops with one
    `error:` line once the index is not the one it began with; every row written was
    answered on that index (its version), and once the index is there again (made anew:
    another version) the same command asks the rest and again those answered before."""
    from conftest import HOTPOT

    folder, began, out, command, env, proc = _batch_under_way(tmp_path, "wiki", 2000)
    stderr = _stopped(proc, lambda: shutil.rmtree(folder), out, began,
                      "index 'wiki' was removed")
    assert ", done" not in stderr, stderr[-1500:]  # the last progress line: stopped, not done

    home = ["--home", tmp_path / "home", "--index", "wiki"]
    assert run(["ingest", HOTPOT, "--no-dense", *home]).returncode == 0  # made anew
    now = json.loads((folder / "manifest.json").read_text())["version"]
    rows = _resumed(command, env, out)
    assert all(r["status"] == "ok" and r["index_version"] == now != began for r in rows)


def _stopped(proc, change, out, began: str, says: str) -> str:
    """`change` the index under the batch `proc`: it stops, exit 2, with one `error:` line
    holding `says` and no traceback, every row it wrote answered on the index as it began
    (version `began`); its stderr."""
    try:
        change()
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 2, (proc.returncode, stderr[-1500:])
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and says in errors[0], stderr[-1500:]
    assert "Traceback" not in stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert 3 <= len(rows) < 2000, len(rows)
    assert all(r["status"] == "ok" and r["index_version"] == began for r in rows)
    return stderr


def _resumed(command, env, out) -> list[dict]:
    """The same batch command run again: exit 0, one row per id of its 2,000; the rows."""
    done = subprocess.run(list(map(str, command)), env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-1500:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [str(i) for i in range(2000)]
    return rows


@pytest.mark.parametrize("restore", ["folder", "in place"])
def test_an_index_restored_under_a_batch_stops_it_and_the_resume_runs(tmp_path, restore):
    """The index restored by `cp -a` under a batch, the same layout: `folder`, its folder
    removed and made again at once from a backup of it made before the batch (ext4 and
    overlayfs may give the new folder the freed inode); `in place`, the folder kept and its
    files replaced by those of another ingest of the same corpus, manifest last. Before, the
    same folder inode and layout passed for the same index: the batch went on reading the
    removed files and ended `ok`, exit 0. Now the batch holds its index's folder open (so its
    inode is not reused) and the manifest names the index by its `index_id`: the batch stops
    with one `error:` line, exit 2, and the same command then answers the rest on the index
    as restored (and again those answered on another version). `in place` fails on the old
    code every time; `folder` only when the batch misses the moment the folder is gone and
    the restore gets the freed inode (1 run in 3 here): it guards the held folder."""
    from conftest import HOTPOT

    backup = tmp_path / "backup"
    if restore == "in place":  # another index of the same corpus, the same layout
        assert run(["ingest", HOTPOT, "--no-dense", "--home", tmp_path / "other", "--index",
                    "wiki"]).returncode == 0
        subprocess.run(["cp", "-a", tmp_path / "other" / "indexes" / "wiki", backup],
                       check=True)
    folder, began, out, command, env, proc = _batch_under_way(
        tmp_path, "wiki", 2000, backup if restore == "folder" else None)

    def restored():
        if restore == "folder":
            shutil.rmtree(folder)
            subprocess.run(["cp", "-a", backup, folder], check=True)
            return
        inode = folder.stat().st_ino
        for path in folder.iterdir():
            if path.name != "manifest.json":
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        for path in backup.iterdir():
            subprocess.run(["cp", "-a", path, folder / f".{path.name}"], check=True)
        for path in sorted(folder.glob(".*"), key=lambda p: p.name == ".manifest.json"):
            path.rename(folder / path.name[1:])
        assert folder.stat().st_ino == inode

    _stopped(proc, restored, out, began, "index 'wiki' was")
    now = json.loads((folder / "manifest.json").read_text())["version"]
    assert (now == began) == (restore == "folder")
    rows = _resumed(command, env, out)
    assert all(r["status"] == "ok" and r["index_version"] == now for r in rows)


def test_documents_changed_under_a_batch_do_not_stop_it_and_a_resume_asks_again(tmp_path):
    """A batch over a live index: a write through the service changes its documents in place
    (a new manifest `version`, as the service's `renew_version` makes it) while the
    batch runs. The batch goes on to the end (a batch stopped at each write could never end
    on an index callers write to); every row carries the version the batch began with, and
    the same command then asks every question again on the index as it is now."""
    from branchsearch.infra.index.manifest import renew_version

    n = 300
    folder, began, out, command, env, proc = _batch_under_way(tmp_path, "live", n)
    try:
        renew_version(folder)  # (the service's write does it so, its ingest lock held)
        written = out.read_text().count("\n")
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert written < n, "the batch ended before the write: the test shows nothing"
    assert proc.returncode == 0, (proc.returncode, stderr[-1500:])
    now = json.loads((folder / "manifest.json").read_text())["version"]
    assert now != began
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [str(i) for i in range(n)]
    assert all(r["status"] == "ok" and r["index_version"] == began for r in rows)
    again = subprocess.run(list(map(str, command)), env=env, capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0, again.stderr[-1500:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [str(i) for i in range(n)]
    assert all(r["index_version"] == now for r in rows)


@pytest.mark.ray
def test_ctrl_c_as_a_ray_batch_starts_is_answered_at_once(tmp_path):
    """^C while a batch's Ray cluster starts: the stop waits for the start (seconds, up to
    ~18 s on a loaded machine), and before, nothing said so until then: the ^C looked lost.
    Now one line answers it at once (while Ray's start holds fd 2), saying what it waits for
    and how to stop at once; then the stop ends as before, `interrupted`, exit status 130."""
    import signal
    import threading

    import psutil

    from conftest import HOTPOT, prepared

    home = ["--home", tmp_path / "home", "--index", "wiki"]
    assert run(["ingest", HOTPOT, "--no-dense", *home]).returncode == 0
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": f"{i}", "question": "Who directed Ed Wood?"})
                           + "\n" for i in range(20)))
    proc = subprocess.Popen(prepared([*CLI, "batch", inp, "-o", out, "--executor", "ray",
                                      *home], sigint_default=True),
                            env={**os.environ, "BRANCHSEARCH_SEARCH_MODE": "bm25"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), line.rstrip())
                                                          for line in proc.stderr))
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if any("raylet" in " ".join(c.cmdline())
                       for c in psutil.Process(proc.pid).children(recursive=True)):
                    break  # its cluster is starting
            except psutil.Error:
                pass
            time.sleep(0.02)
        assert proc.poll() is None, "the batch ended before it was stopped"
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # what ^C sends: the group
        proc.wait(timeout=120)
        ended = time.monotonic()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        reader.join(30)
    said = [(when, line) for when, line in lines if line.startswith("stopping")]
    assert said, [line for _, line in lines][-10:]
    when, line = said[0]
    assert line == "stopping once Ray has started; ^C again to stop at once", line
    assert when - sent < 2.0 and when < ended, (when - sent, ended - sent)
    assert proc.returncode == 130, (proc.returncode, lines[-5:])
    assert lines[-1][1] == "interrupted" and not any("Traceback" in l for _, l in lines)


def test_ctrl_c_on_eval_does_not_say_done(tmp_path):
    """^C during `eval`: its last progress line said ", done" (the bar closed as if the
    questions had all run), then `interrupted`. It says where it stopped, and not done. The
    hotpot-mini questions, repeated so the run outlasts the bar's first line (5 s)."""
    import signal

    from conftest import HOTPOT, prepared

    data = tmp_path / "wiki"
    (data / "qrels").mkdir(parents=True)
    shutil.copy(HOTPOT / "corpus.jsonl", data / "corpus.jsonl")
    queries = [json.loads(line) for line in (HOTPOT / "queries.jsonl").read_text().splitlines()]
    qrels = (HOTPOT / "qrels" / "test.tsv").read_text().splitlines()
    with (data / "queries.jsonl").open("w") as q, (data / "qrels" / "test.tsv").open("w") as t:
        t.write(qrels[0] + "\n")
        for n in range(400):
            for query in queries:
                q.write(json.dumps({**query, "_id": f"{query['_id']}-{n}"}) + "\n")
            for row in qrels[1:]:
                qid, rest = row.split("\t", 1)
                t.write(f"{qid}-{n}\t{rest}\n")
    home = ["--home", tmp_path / "home", "--index", "wiki"]
    assert run(["ingest", data, "--no-dense", *home]).returncode == 0
    proc = subprocess.Popen(prepared([*CLI, "eval", data, "--policy", "heuristic",
                                      "--executor", "local", *home], sigint_default=True),
                            env={**os.environ, "BRANCHSEARCH_SEARCH_MODE": "bm25"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        first = proc.stderr.readline()  # the bar's first line: questions under way
        assert first.startswith("eval heuristic: ") and " q, " in first, first
        os.killpg(proc.pid, signal.SIGINT)  # what ^C sends: the group
        stdout, rest = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = first + rest
    assert proc.returncode == 130, (proc.returncode, stderr[-1500:])
    lines = stderr.splitlines()
    assert lines[-1] == "interrupted" and "Traceback" not in stderr, stderr[-1500:]
    last = lines[-2]  # where it stopped: fewer than all, and not done
    assert last.startswith("eval heuristic: ") and "/4800 q" in last, stderr[-1500:]
    assert ", done" not in stderr, stderr[-1500:]


def test_a_stopped_batch_starts_nothing_more_and_writes_what_ran(tmp_path):
    """`run_batch(stop=…)`, what the CLI's ^C sets: the questions running finish and their rows
    are written whole, nothing more starts, and it ends with KeyboardInterrupt."""
    import threading

    from branchsearch.orchestrator.batch import run_batch

    stop, seen = threading.Event(), []

    def search(question: str) -> dict:
        seen.append(question)
        if len(seen) == 3:
            stop.set()
        return {"status": "ok", "answer": question}

    out = tmp_path / "out.jsonl"
    with pytest.raises(KeyboardInterrupt):
        run_batch([(f"q{i}", f"question {i}") for i in range(100)], out, search,
                  concurrency=2, stop=stop)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert 3 <= len(rows) == len(seen) <= 4 and all(r["status"] == "ok" for r in rows)


def test_an_index_name_typed_decomposed_is_the_composed_one(tmp_path):
    """`café` typed on macOS arrives decomposed (NFD: 'e' + U+0301, no letter on its own): it
    names the index `café`, in the CLI and the service's requests alike."""
    import unicodedata

    from branchsearch.orchestrator.service.protocol import Limits, parse_search

    nfc, nfd = "café", unicodedata.normalize("NFD", "café")
    assert nfc != nfd
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"_id": "d1", "title": "T", "text": "Falcon plan"}) + "\n")
    done = run(["ingest", corpus, "--no-dense", "--home", tmp_path / "home", "--index", nfd])
    assert done.returncode == 0, done.stderr[-800:]
    assert [p.name for p in (tmp_path / "home" / "indexes").iterdir()] == [nfc]
    for name in (nfc, nfd):
        found = run(["retrieve", "Falcon", "--home", tmp_path / "home", "--index", name])
        assert found.returncode == 0 and "d1" in found.stdout, found.stderr[-800:]
    assert parse_search({"question": "Falcon?", "index": nfd}, Limits()).index == nfc


def test_indexes_keeps_its_columns_for_wide_names(tmp_path):
    """`indexes` with Chinese, accented, Hindi and Thai names beside an ASCII one: each row's
    kind column starts at the same terminal column. The columns a name takes are the C
    library's `wcwidth` (what a terminal lays its grid by): a wide character takes two, a mark
    on the letter before none — the anusvara of 'हिंदी' and the Thai vowels of 'ที่ดิน' too, whose
    combining class is 0 (they were counted one column each, and the row ran past the rest)."""
    import ctypes
    import ctypes.util
    import locale

    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.ingest.pipeline import ingest

    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"_id": "d1", "title": "T", "text": "Falcon plan"}) + "\n")
    # columns: the C library's reading, and ours as written out here (should it be absent)
    names = {"plain": 5, "检索索引": 8, "café-ü": 6, "東京": 4, "हिन्दी": 5, "हिंदी": 4,
             "ที่ดิน": 3}
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    saved = locale.setlocale(locale.LC_CTYPE)
    try:
        locale.setlocale(locale.LC_CTYPE, "C.UTF-8")
        assert {n: sum(libc.wcwidth(ctypes.c_wchar(c)) for c in n) for n in names} == names
    except locale.Error:
        pass
    finally:
        locale.setlocale(locale.LC_CTYPE, saved)
    for name in names:
        ingest(corpus, load_settings(overrides={"home": tmp_path / "home", "index": name},
                                     read_env=False, read_file=False), dense=False)
    listed = run(["indexes", "--home", tmp_path / "home"])
    assert listed.returncode == 0, listed.stderr[-800:]
    rows = {line.split()[0]: line for line in listed.stdout.splitlines()}
    assert set(rows) == set(names), listed.stdout
    starts = {name: names[name] + len(row[len(name):row.index(" owned")])
              for name, row in rows.items()}
    assert set(starts.values()) == {24}, (starts, listed.stdout)


def test_indexes_shows_where_a_copied_index_reads_its_vectors(tmp_path):
    """An index folder copied to another home read its vectors from its own dense.db, while
    `indexes` showed the Milvus Lite path its ingest recorded, in the home it came from. It
    shows the file the index reads, which is still there when the first home is gone."""
    import shutil

    first, second = tmp_path / "first", tmp_path / "second"
    (tmp_path / "c.jsonl").write_text(
        '{"_id": "otter", "title": "Otter", "text": "Sea otters float on kelp beds."}\n'
        '{"_id": "heron", "title": "Heron", "text": "Herons wade in shallow marshes."}\n')
    made = run(["ingest", tmp_path / "c.jsonl", "--index", "wiki", "--home", first])
    assert made.returncode == 0, made.stderr[-800:]
    copy_store(first / "indexes" / "wiki", second / "indexes" / "wiki")
    shutil.rmtree(first)
    listed = run(["indexes", "--home", second, "--json"])
    assert listed.returncode == 0, listed.stderr[-800:]
    [info] = json.loads(listed.stdout)
    assert info["health"] == "ok" and str(first) not in info["backends"], info
    assert f"dense: milvus-lite {second / 'indexes' / 'wiki' / 'dense.db'} (FLAT)" in \
        info["backends"], info
    found = run(["retrieve", "sea otters", "--mode", "dense", "--home", second, "--json"])
    assert found.returncode == 0, found.stderr[-800:]
    assert json.loads(found.stdout)[0]["doc_id"] == "otter"


def test_indexes_shows_the_elasticsearch_its_searches_use_without_its_password(tmp_path,
                                                                               es_url):
    """An index ingested into Elasticsearch at one address, listed with `es_url` naming it
    otherwise (another name for the server, with a user and password): `indexes` showed the
    address its manifest recorded, while its health was asked at the settings' and its
    searches go there. It shows the settings' address, its password masked."""
    from urllib.parse import urlsplit

    (tmp_path / "c.jsonl").write_text(
        '{"_id": "otter", "title": "Otter", "text": "Sea otters float on kelp beds."}\n')
    home = ["--home", tmp_path / "home", "--index", f"addr{os.getpid()}"]
    made = run(["ingest", tmp_path / "c.jsonl", "--no-dense", *home],
               env={"BRANCHSEARCH_ES_URL": es_url})
    assert made.returncode == 0, made.stderr[-800:]
    parts = urlsplit(es_url)
    other = {"127.0.0.1": "localhost", "localhost": "127.0.0.1"}.get(parts.hostname,
                                                                     parts.hostname)
    user = parts.netloc.rpartition("@")[0] or "elastic:hunter2"  # (a real cluster's own)
    now = f"{parts.scheme}://{user}@{other}:{parts.port}"
    listed = run(["indexes", "--home", tmp_path / "home", "--json"],
                 env={"BRANCHSEARCH_ES_URL": now})
    assert listed.returncode == 0, (listed.stdout, listed.stderr[-800:])
    [info] = json.loads(listed.stdout)
    assert info["health"] == "ok", info
    assert info["backends"] == f"lexical: elasticsearch {parts.scheme}://***@{other}:" \
                               f"{parts.port}", info
    assert (parts.password or "hunter2") not in listed.stdout + listed.stderr

def test_ray_serve_with_an_index_it_cannot_serve_is_one_line_before_any_cluster(hotpot_settings,
                                                                                  tmp_path):
    """`serve` (Ray Serve, the default) checks the default index in the command's process: a
    renamed or missing index is the one line `serve --standalone` gives, not the traceback of
    a Searcher replica that failed to start."""

    home = tmp_path / "home"
    copy_store(hotpot_settings.index_dir, home / "indexes" / "renamed")
    renamed = run(["serve", "--home", home, "--index", "renamed", "--port", 0], timeout=120)
    assert_one_error_line(renamed, "")
    assert "was ingested as 'hotpot'" in renamed.stderr and "ray" not in renamed.stderr.lower()
    missing = run(["serve", "--home", home, "--index", "nosuch", "--port", 0], timeout=120)
    assert_one_error_line(missing, "")
    assert "this data home has 'renamed'" in missing.stderr


def test_ray_serve_on_a_port_in_use_is_one_line_before_any_cluster(hotpot_settings):
    """`serve` (Ray Serve, the default) on a port something holds (a second `serve`, another
    server on 8000): the one line `serve --standalone` gives, at once, not the 120-line
    traceback of Serve's proxy that failed to bind, after a local cluster started."""
    import socket

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        done = run(["serve", "--home", hotpot_settings.home, "--index", "hotpot", "--port",
                    port], timeout=120)
    finally:
        holder.close()
    assert_one_error_line(done, f"cannot listen on 127.0.0.1:{port} (address already in use); "
                                "pick another --port or stop what holds it")
    assert "ray" not in done.stderr.lower()


@pytest.mark.ray
def test_ray_serve_joining_a_cluster_on_a_port_in_use_is_one_line_before_serve_starts(
        hotpot_settings):
    """`serve --address HEAD` (Ray Serve on a cluster already running) on a port something
    holds on the head: Serve's 120-line traceback of its proxy that failed to bind, exit 1,
    and Serve's controller and proxy left on the cluster. Now the one line of a local `serve`,
    exit 2, asked on the head before Serve starts there: nothing of Serve is left."""
    import socket

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        with _head_node(cpus=1) as (address, env, _):
            done = run(["serve", "--home", hotpot_settings.home, "--index", "hotpot",
                        "--address", address, "--port", port], env=env, timeout=180)
            named = subprocess.run([sys.executable, "-c", (
                "import ray, sys\nray.init(address=sys.argv[1], log_to_driver=False)\n"
                "print(sorted(a['name'] for a in ray.util.list_named_actors(all_namespaces=True)))"
            ), address], env={**os.environ, **env}, capture_output=True, text=True, timeout=180)
    finally:
        holder.close()
    assert_one_error_line(done, f"cannot listen on 127.0.0.1:{port} (address already in use); "
                                "pick another --port or stop what holds it")
    assert named.returncode == 0 and named.stdout.strip() == "[]", (named.stdout,
                                                                     named.stderr[-800:])


@pytest.mark.ray
@pytest.mark.parametrize("killed", [("gcs_server", "raylet"), ("gcs_server",)])
def test_a_batch_whose_ray_head_node_dies_stops_with_one_line_and_its_summary(hotpot_settings,
                                                                               tmp_path, killed):
    """A batch on a named cluster whose head node dies mid-run (its GCS and raylet killed):
    its branches' actors went "unavailable", the batch sat silent for 60 s, then Ray's core
    ended it with one C++ line of its own ("Failed to connect to GCS within 60 seconds"), exit
    1, no summary. Its GCS alone killed, the branches ran on until Ray's core ended it the
    same way 60 s later (the raylets with it). Now, within seconds, the summary of what was
    done, one error line saying the cluster is lost and how to resume, exit 2; the rows
    written are whole and ok."""
    import psutil

    from conftest import HOTPOT, ingest_copy

    settings = ingest_copy(hotpot_settings, "hotpot-lost")
    queries = [json.loads(line) for line in (HOTPOT / "queries.jsonl").read_text().splitlines()]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    total = 200 * len(queries)  # minutes of work: Ray's core would end it before they are done
    inp.write_text("".join(json.dumps({"id": f"{q['_id']}-{n}", "question": q["text"]}) + "\n"
                           for n in range(total // len(queries)) for q in queries))
    with _head_node(cpus=2) as (address, env, temp):
        proc = subprocess.Popen([*CLI, "batch", str(inp), "-o", str(out), "--home",
                                 str(settings.home), "--index", settings.index, "--address",
                                 address, "--concurrency", "2"], env={**os.environ, **env},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and proc.poll() is None and (
                    not out.exists() or out.read_bytes().count(b"\n") < 2):
                time.sleep(0.2)
            head = [p for p in psutil.process_iter(["name", "cmdline"])
                    if p.info["name"] in killed
                    and any(temp in part for part in p.info["cmdline"] or ())]
            assert proc.poll() is None and len(head) == len(killed), (head, proc.poll())
            for p in head:
                p.kill()
            lost = time.monotonic()
            stdout, stderr = proc.communicate(timeout=120)
            took = time.monotonic() - lost
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 2, (proc.returncode, stderr[-1500:])
    assert "Traceback" not in stderr and "Failed to connect to GCS" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "the Ray cluster is lost" in errors[0], stderr[-1500:]
    assert "run the same command: it resumes" in errors[0] and str(out) in errors[0]
    assert took < 45, took  # Ray's core alone ends it after 60 s
    rows = [json.loads(line) for line in out.read_text().splitlines()]  # every one whole
    assert rows and all(r["status"] == "ok" and r["evidence"] for r in rows)
    assert len({r["id"] for r in rows}) == len(rows) < total
    assert f"batch: {len(rows)} ok, 0 partial, 0 failed" in stdout, stdout
    assert f"{total - len(rows)} question(s) not run" in errors[0]


@contextmanager
def _head_node(cpus: int):
    """A Ray head node of this test's own (token authentication, its own ports and temp
    folder): (its address, the environment that joins it, the temp folder); its processes
    are stopped by PID on leaving."""
    import secrets
    import socket
    import tempfile

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    temp = tempfile.mkdtemp(prefix="rs", dir="/tmp")  # Ray's socket paths must stay short
    gcs = free_port()
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16), "RAY_ADDRESS": ""}
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    try:
        subprocess.run([ray_cli, "start", "--head", "--port", str(gcs), "--temp-dir", temp,
                        "--num-cpus", str(cpus), "--include-dashboard", "false",
                        "--disable-usage-stats", "--ray-client-server-port", str(free_port()),
                        "--dashboard-agent-listen-port", str(free_port())],
                       env={**os.environ, **env}, check=True, capture_output=True, timeout=180)
        yield f"127.0.0.1:{gcs}", env, temp
    finally:
        _stop_processes_of(temp)


def _stop_processes_of(temp: str) -> None:
    """Stop, by PID, the processes of the cluster started with `--temp-dir temp` and theirs
    (never `ray stop`, which stops every cluster on the machine)."""
    import psutil

    mine = [p for p in psutil.process_iter(["cmdline"])
            if p.pid != os.getpid() and any(temp in part for part in p.info["cmdline"] or ())]
    for p in list(mine):
        try:
            mine += p.children(recursive=True)
        except psutil.NoSuchProcess:
            pass
    for p in mine:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    for p in psutil.wait_procs(mine, timeout=10)[1]:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    shutil.rmtree(temp, ignore_errors=True)


def test_serve_with_the_home_s_keys_file_and_a_mistake_is_still_one_line(tmp_path):
    """`serve` finds HOME/keys.json and says so, once it is going to serve: a mistake found
    after (an index that is not there, a port in use) is the one error line, not that note
    and the error."""
    home = tmp_path / "home"
    assert run(["keys", "add", "a", "--groups", "g", "--home", home]).returncode == 0
    assert_one_error_line(run(["serve", "--home", home, "--index", "nosuch", "--port", 0]),
                          "index 'nosuch' not found")


def test_a_reading_command_with_no_index_named_uses_the_home_s_only_one_or_names_them(
        hotpot_settings, tmp_path):
    """`search`, `retrieve`, `batch` and `serve` without --index wanted an index called
    'default' even when the data home held one index of another name (`serve` serves every
    index; the default only answers requests that name none). The only index is now the one,
    said in a line; with two, one error line names both (`serve` serves both, with no default:
    test_service.py); a named index is never replaced."""

    home = tmp_path / "home"
    copy_store(hotpot_settings.index_dir, home / "indexes" / "hotpot")
    (tmp_path / "q.jsonl").write_text(json.dumps({"id": "q", "question": "Ed Wood"}) + "\n")
    done = {name: run(args) for name, args in {  # one at a time: one Milvus Lite file
        "search": ["search", "Who directed Ed Wood?", "--home", home, "--json"],
        "retrieve": ["retrieve", "Ed Wood", "--home", home, "--mode", "bm25", "--json"],
        "batch": ["batch", tmp_path / "q.jsonl", "-o", tmp_path / "out.jsonl", "--home", home],
        "named": ["search", "Ed Wood", "--home", home, "--index", "default"]}.items()}
    said = "index 'hotpot' (the only one in"
    assert done["search"].returncode == 0 and said in done["search"].stderr
    assert json.loads(done["search"].stdout)["evidence"]
    assert done["retrieve"].returncode == 0 and said in done["retrieve"].stderr
    assert json.loads(done["retrieve"].stdout)[0]["doc_id"].startswith("ed-wood")
    assert done["batch"].returncode == 0, done["batch"].stderr[-800:]
    assert json.loads((tmp_path / "out.jsonl").read_text())["status"] == "ok"
    assert_one_error_line(done["named"], "index 'default' not found")
    copy_store(hotpot_settings.index_dir, home / "indexes" / "Zürich")
    assert_one_error_line(run(["search", "Ed Wood", "--home", home], timeout=120),
                          "this data home (%s) has 'Zürich', 'hotpot'; pick one with "
                          "--index NAME" % home)


def test_a_batch_output_through_a_symlink_writes_its_target(tmp_path):
    """`-o link.jsonl` pointing at real/res.jsonl: the run (which rewrites its output
    atomically) updates the target and leaves the link a link."""
    from conftest import HOTPOT

    home = ["--home", tmp_path / "home", "--index", "wiki"]
    assert run(["ingest", HOTPOT, "--no-dense", *home]).returncode == 0
    (tmp_path / "real").mkdir()
    link = tmp_path / "link.jsonl"
    link.symlink_to(Path("real") / "res.jsonl")
    queries = [json.loads(line) for line in (HOTPOT / "queries.jsonl").read_text().splitlines()]
    for n in (2, 4):
        inp = tmp_path / f"q{n}.jsonl"
        inp.write_text("".join(json.dumps({"id": q["_id"], "question": q["text"]}) + "\n"
                               for q in queries[:n]))
        done = run(["batch", inp, "-o", link, "--branches", "1", *home])
        assert done.returncode == 0, done.stderr[-800:]
        assert link.is_symlink()
        assert (tmp_path / "real" / "res.jsonl").read_text().count("\n") == n


def test_an_empty_config_variable_is_no_config(tmp_path):
    """BRANCHSEARCH_CONFIG set but empty (a shell's `export BRANCHSEARCH_CONFIG=`) is unset,
    not the current folder read as a settings file ("settings file . is a folder")."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"_id": "d", "title": "T", "text": "Falcon plan"}) + "\n")
    done = run(["ingest", corpus, "--no-dense", "--home", tmp_path / "home"],
               env={"BRANCHSEARCH_CONFIG": ""})
    assert done.returncode == 0, done.stderr


def test_search_trace_appends_spans_and_episodes_joined_by_trace_id(tmp_path):
    """`search --trace t.jsonl`, twice: both searches' spans and both searches' episode lines
    are kept, and each episode line names the trace id of
    its search's spans."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"_id": f"d{i}", "title": f"Falcon {i}",
                                          "text": f"Falcon plan {i} harbor " * 20}) + "\n"
                              for i in range(20)))
    home = ["--home", tmp_path / "home", "--index", "ix"]
    assert run(["ingest", corpus, "--no-dense", *home]).returncode == 0
    trace = tmp_path / "t.jsonl"
    ids = []
    for question in ("Falcon plan harbor", "Falcon 7"):
        done = run(["search", question, "--json", "--trace", trace, *home])
        assert done.returncode == 0, done.stderr
        ids.append(json.loads(done.stdout)["trace_id"])
    spans = [json.loads(line) for line in trace.read_text().splitlines()]
    episodes = [json.loads(line) for line in
                (tmp_path / "t.episodes.jsonl").read_text().splitlines()]
    assert {s["trace_id"] for s in spans} == set(ids) and len(set(ids)) == 2
    assert {e["trace_id"] for e in episodes} == set(ids)
    assert all("branch" in e and "kind" in e for e in episodes)


def test_search_branches_carry_the_questions_trace_id_traced_or_not(tmp_path):
    """`search --json` with tracing off (no --trace) and on: each branch line carries the
    question's trace id, the one the result names (with tracing on, the id its spans share),
    never an id of zeros that joins nothing."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"_id": f"d{i}", "title": f"Falcon {i}",
                                          "text": f"Falcon plan {i} harbor " * 20}) + "\n"
                              for i in range(20)))
    home = ["--home", tmp_path / "home", "--index", "ix"]
    assert run(["ingest", corpus, "--no-dense", *home]).returncode == 0
    for traced in ([], ["--trace", tmp_path / "t.jsonl"]):
        done = run(["search", "Were Falcon 3 and Falcon 7 in the same harbor?", "--json",
                    *traced, *home])
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert len(result["trace_id"]) == 32 and result["trace_id"].strip("0"), result
        assert result["branches"], result
        assert [b["trace_id"] for b in result["branches"]] == \
            [result["trace_id"]] * len(result["branches"]), (traced, result["branches"])


def test_search_trace_to_a_path_that_can_hold_no_file_is_one_error_line(tmp_path):
    """`search --trace PATH` where no file can be: under a file, under a folder that cannot be
    made, or a folder itself. One line naming the path, exit 2, before the search: not
    a traceback, and not a search whose spans are all dropped."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"_id": "d", "title": "T", "text": "Falcon plan"}) + "\n")
    home = ["--home", tmp_path / "home", "--index", "ix"]
    assert run(["ingest", corpus, "--no-dense", *home]).returncode == 0
    for trace, expect in ((corpus / "t.jsonl", "a file holds a name on its path"),
                          ("/proc/no-such-folder/t.jsonl", "cannot be made"),
                          (tmp_path, "is a folder: give a file path")):
        done = run(["search", "Falcon plan", "--trace", trace, *home])
        assert_one_error_line(done, expect, str(trace))
        assert "question:" not in done.stdout, done.stdout
    assert not tmp_path.with_name(tmp_path.name + ".episodes.jsonl").exists()


def test_an_ingest_whose_backend_is_down_leaves_no_half_made_index(tmp_path):
    """A new index whose Elasticsearch (a URL with a password) cannot be reached: one line, no
    password, and no folder left behind that `indexes` would then call incomplete."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"_id": "d", "title": "T", "text": "Falcon plan"}) + "\n")
    home = tmp_path / "home"
    done = run(["ingest", corpus, "--no-dense", "--home", home, "--index", "esx"],
               env={"BRANCHSEARCH_ES_URL": "http://u:pa%2Fss@127.0.0.1:1"})
    assert_one_error_line(done, "not reachable")
    assert "pa%2Fss" not in done.stderr and "pa/ss" not in done.stderr
    assert not (home / "indexes" / "esx").exists()


def test_a_refused_resume_names_settings_as_people_write_them():
    from branchsearch.orchestrator.cli.jobs import shown

    assert [shown(v) for v in (None, True, False, ["hr", "finance"], [], {"b", "a"}, 0.5,
                               "hybrid")] == ["none", "true", "false", "hr, finance", "none",
                                              "a, b", "0.5", "hybrid"]


def test_a_ray_address_where_nothing_answers_is_one_line_at_once(hotpot_settings, tmp_path):
    """`search`, `batch` and `serve` with `--address` naming no cluster: one `error:` line
    naming the address, exit 2, within seconds. Ray's own connect retried for about 14 minutes
    (20 tries of ~40 s) and printed three gcs_client/rpc_client warnings a try."""
    import socket
    import time

    from branchsearch.orchestrator.service.auth import KeyStore

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    home = ["--home", hotpot_settings.home, "--index", "hotpot"]
    (tmp_path / "q.jsonl").write_text(json.dumps({"id": "q", "question": "Ed Wood"}) + "\n")
    KeyStore(tmp_path / "keys.json").add("k", ())  # (a keys file: no development-mode banner)
    for name, args in {
            "search": ["search", "Who directed Ed Wood?", "--executor", "ray"],
            "batch": ["batch", tmp_path / "q.jsonl", "-o", tmp_path / "out.jsonl"],
            "serve": ["serve", "--standalone", "--executor", "ray", "--port", 0,
                      "--keys", tmp_path / "keys.json"]}.items():
        started = time.monotonic()
        done = run([*args, *home, "--address", address], env={"RAY_ADDRESS": ""}, timeout=90)
        assert_one_error_line(done, f"ray: cannot connect to {address}", name)
        assert time.monotonic() - started < 60, name
        assert "gcs" not in done.stderr.lower(), (name, done.stderr)
    assert not (tmp_path / "out.jsonl").exists()  # nothing half-written
    done = run(["search", "Who directed Ed Wood?", "--executor", "ray", *home,
                "--address", f"ray://{address}"], env={"RAY_ADDRESS": ""}, timeout=90)
    assert_one_error_line(done, f"ray: cannot connect to ray://{address}: nothing answers")


def test_a_ray_address_where_no_gcs_answers_is_one_line_at_once(hotpot_settings, tmp_path):
    """`search` and `batch` with `--address` naming a port where something that is no Ray GCS
    takes TCP connections — an HTTP/1.1 server (`python -m http.server`, as Ray's dashboard at
    8265 is) or a gRPC server without the GCS's services: one `error:` line, exit 2, within
    seconds. A TCP check alone let Ray's connect retry there for about 14 minutes, silent
    (its stderr held) and deaf to Ctrl-C, then print gcs_client warnings."""
    import socket
    import time
    from concurrent import futures

    import grpc

    with socket.socket() as s:  # a free port for the HTTP server
        s.bind(("", 0))
        port = s.getsockname()[1]
    http = subprocess.Popen([sys.executable, "-m", "http.server", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            cwd=tmp_path)
    rpc = grpc.server(futures.ThreadPoolExecutor(max_workers=1))  # no services
    rpc_port = rpc.add_insecure_port("[::]:0")
    rpc.start()
    try:
        for _ in range(100):  # until the HTTP server listens
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        home = ["--home", hotpot_settings.home, "--index", "hotpot"]
        (tmp_path / "q.jsonl").write_text(json.dumps({"id": "q", "question": "Ed Wood"}) + "\n")
        for name, (args, at, says) in {
                "search": (["search", "Who directed Ed Wood?", "--executor", "ray"], port,
                           "no gRPC server"),
                "batch": (["batch", tmp_path / "q.jsonl", "-o", tmp_path / "out.jsonl",
                           "--executor", "ray"], port, "no gRPC server"),
                "search on gRPC": (["search", "Who directed Ed Wood?", "--executor", "ray"],
                                   rpc_port, "without the GCS's services")}.items():
            address = f"127.0.0.1:{at}"
            started = time.monotonic()
            done = run([*args, *home, "--address", address], env={"RAY_ADDRESS": ""},
                       timeout=60)
            assert_one_error_line(done, f"ray: cannot connect to {address}", name)
            assert "not a Ray cluster's GCS" in done.stderr and says in done.stderr, name
            assert time.monotonic() - started < 30, name
            assert "gcs_client" not in done.stderr.lower(), (name, done.stderr)
        assert not (tmp_path / "out.jsonl").exists()  # nothing half-written
    finally:
        rpc.stop(None)
        http.terminate()
        http.wait(timeout=10)


def test_retrieve_with_no_hit_it_may_see_says_so_as_search_does(tmp_path):
    """`retrieve` that finds nothing the caller may see says what `search`'s note says — no
    document this search may see matched — and the same words whether nothing matched or only
    documents of groups the caller lacks did: a difference would tell a caller that hidden
    documents match its query."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"_id": "memo", "title": "Memo", "acl": ["research"],
                                  "text": "The heliotrope project ships in March."}) + "\n"
                      + json.dumps({"_id": "pub", "title": "T", "text": "Falcon plan"}) + "\n")
    home = ["--home", tmp_path / "home", "--index", "acl"]
    assert run(["ingest", corpus, "--no-dense", *home]).returncode == 0
    hidden = run(["retrieve", "heliotrope", "--mode", "bm25", *home])
    nothing = run(["retrieve", "zxqvbnm", "--mode", "bm25", *home])
    said = ("no hits: no document this search may see matched the query (bm25 search of index "
            "'acl')\n")
    assert hidden.returncode == nothing.returncode == 0, hidden.stderr[-800:]
    assert hidden.stdout == nothing.stdout == said, (hidden.stdout, nothing.stdout)
    assert hidden.stderr == nothing.stderr
    seen = run(["retrieve", "heliotrope", "--mode", "bm25", "--acl", "research", *home])
    assert "memo#p0" in seen.stdout, seen.stderr[-800:]


def test_a_document_id_that_reads_as_another_is_one_error_line_and_nothing_is_written(
        tmp_path):
    """A corpus line whose id holds a zero-width space, a byte-order mark, a word joiner, a
    soft hyphen or a full-width letter (an id that looks like another's) is one error line
    naming the file, the line and the character, exit 2, and no index. CJK, RTL, emoji and
    NFD ids ingest."""
    home = ["--home", tmp_path / "home", "--index", "ids", "--no-dense"]
    corpus = tmp_path / "c.jsonl"
    for doc_id, says in LOOKALIKE_IDS:
        corpus.write_text(json.dumps({"id": "fine", "text": "a good note"}) + "\n"
                          + json.dumps({"id": doc_id, "text": "a look-alike"}) + "\n")
        assert_one_error_line(run(["ingest", corpus, *home]), f"c.jsonl:2: document id "
                              f"{doc_id!r} holds the {says}", doc_id)
        assert not (tmp_path / "home" / "indexes").exists(), doc_id  # nothing written
    corpus.write_text("".join(json.dumps({"id": d, "text": f"note {i}"}) + "\n"
                              for i, d in enumerate(KEPT_IDS)))
    done = run(["ingest", corpus, *home])
    assert done.returncode == 0, done.stderr[-800:]


def test_a_corpus_text_holding_a_nul_is_one_error_line_and_nothing_is_written(tmp_path):
    """A corpus line whose text holds U+0000 is one error line naming the file, the line, the
    document and the field, exit 2, and no index."""
    home = ["--home", tmp_path / "home", "--index", "nul", "--no-dense"]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "fine", "text": "a good note"}) + "\n\n"
                      + json.dumps({"id": "memo", "text": "a\u0000note"}) + "\n")
    assert_one_error_line(run(["ingest", corpus, *home]), "c.jsonl:3: document 'memo': 'text' "
                          "holds a NUL character (U+0000) at character 2; remove it")
    assert not (tmp_path / "home" / "indexes").exists()


def test_serve_standalone_refuses_the_options_of_ray_serve_s_deployments(tmp_path):
    """`serve --standalone --max-queued N` (or --max-searches, --replicas: they size Ray
    Serve's searcher queue and replicas, which a standalone server does not have) is one line
    naming the option and the setting that bounds a standalone server's searches, exit 2,
    before anything starts; `--help` says so too."""
    home = ["--home", tmp_path / "home", "--port", 0]
    cases = {"queued": ["--max-queued", "4"], "searches": ["--max-searches=2"],
             "replicas": ["--replicas", "2"],
             "all": ["--replicas", "2", "--max-queued", "4", "--max-searches", "2"]}
    done = run_all({name: ["serve", "--standalone", *args, *home]
                    for name, args in cases.items()})
    said = {"queued": "--max-queued sizes", "searches": "--max-searches sizes",
            "replicas": "--replicas sizes",
            "all": "--replicas, --max-queued and --max-searches size"}
    for name in cases:
        assert_one_error_line(done[name], said[name] + " Ray Serve's deployments, which serve "
                              "--standalone does not use", name)
        assert "max_in_flight" in done[name].stderr and "serving on" not in done[name].stderr
    assert not (tmp_path / "home").exists()  # nothing started
    helped = run(["serve", "--help"], env={"COLUMNS": "200"}).stdout
    shown = " ".join(re.sub(r"\x1b\[[0-9;]*m", "", helped).split())  # rich's styles, if any
    assert shown.count("Ray Serve only") >= 3, shown


def test_serve_s_mistakes_on_a_home_of_one_index_are_one_line(hotpot_settings, tmp_path):
    """`serve` with no --index on a home of one index (the demo's) said "index 'hotpot' (the
    only one in …)" before the error of `--searcher-replicas 2` or of a port in use: two lines
    where a mistake is one. That line (and the one a home of several gets) is said once the
    checks have passed, before `serving on`, as the keys file's is."""
    import socket

    home = tmp_path / "home"
    copy_store(hotpot_settings.index_dir, home / "indexes" / "hotpot")
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    try:
        done = run_all({
            "replicas": ["serve", "--searcher-replicas", "2", "--home", home, "--port", 0],
            "port": ["serve", "--standalone", "--home", home, "--port", port]})
    finally:
        held.close()
    assert_one_error_line(done["replicas"], "searcher_replicas = 2: index 'hotpot'", "replicas")
    assert "serve with one searcher replica" in done["replicas"].stderr
    assert_one_error_line(done["port"], f"127.0.0.1:{port}", "port")


def test_reading_commands_mistakes_on_a_home_of_one_index_are_one_line(hotpot_settings,
                                                                        tmp_path):
    """`search`, `retrieve`, `batch` and `loadtest` with no --index on a home of one index
    said "index 'hotpot' (the only one in …)" before their own checks, so a mistake found
    after (a trace file that cannot be made, a batch input that is not there) was two lines.
    The line is said once the checks have passed, right before the work; a good run still
    says it, once."""
    home = tmp_path / "home"
    copy_store(hotpot_settings.index_dir, home / "indexes" / "hotpot")
    trace = Path("/proc/nope/t.jsonl")  # a folder no one can make
    assert_one_error_line(run(["search", "Ed Wood", "--home", home, "--trace", trace]),
                          f"trace file {trace}", "trace")
    assert_one_error_line(run(["batch", tmp_path / "none.jsonl", "-o", tmp_path / "out.jsonl",
                               "--home", home]), "batch input not found", "batch")
    assert_one_error_line(run(["loadtest", "--home", home, "--executor", "local"]),
                          "give --rate", "loadtest")
    good = run(["search", "Who directed Ed Wood?", "--home", home, "--branches", "1",
                "--trace", tmp_path / "t.jsonl", "--json"])
    assert good.returncode == 0, good.stderr[-800:]
    assert good.stderr.count("index 'hotpot' (the only one in") == 1, good.stderr[-800:]
    assert json.loads(good.stdout)["evidence"]


def test_serve_searcher_replicas_is_checked_before_anything_starts(hotpot_settings, tmp_path):
    """`serve --searcher-replicas N` asks Ray Serve for N searcher replicas, as a Serve
    config's `searcher_replicas` does (before, the CLI had no way to). Each replica opens every
    index of the home, so more than one over an index whose vectors are a Milvus Lite file
    (one owning process) is one line naming the index and the fix, exit 2, before Ray or Serve
    starts; 0 is refused as any out-of-range option is, and --standalone (no replicas) refuses
    it as it does --replicas."""
    from conftest import ingest_copy

    settings = ingest_copy(hotpot_settings, "hotpot-replicas")
    home = ["--home", settings.home, "--index", "hotpot-replicas", "--port", 0]
    done = run_all({"lite": ["serve", "--searcher-replicas", "2", *home],
                    "zero": ["serve", "--searcher-replicas", "0", *home],
                    "standalone": ["serve", "--standalone", "--searcher-replicas", "2", *home]})
    # (the first Lite index of the home: the shared home holds other tests' copies too)
    assert_one_error_line(done["lite"], "searcher_replicas = 2: index '", "lite")
    assert "keeps its vectors in a Milvus Lite file" in done["lite"].stderr
    assert "server backends" in done["lite"].stderr
    assert_one_error_line(done["zero"], "--searcher-replicas", "zero")
    assert_one_error_line(done["standalone"], "--searcher-replicas sizes Ray Serve's "
                          "deployments", "standalone")
    for name, answer in done.items():
        assert "serving on" not in answer.stderr, name
