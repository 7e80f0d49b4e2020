"""Corpus reading, chunking, tokenizer, settings, docstore: plain functions, real files."""

import json
import os
import re

import pytest

from branchsearch.infra.ingest.chunking import chunk_text, split_chunk_id
from branchsearch.infra.ingest.corpus import read_corpus
from branchsearch.infra.errors import CorpusError, SettingsError
from branchsearch.infra.config.settings import load_settings
from branchsearch.infra.models.tokenizer import TokenCounter, get_encoding


def test_tokenizer_offline_matches_known_ids():
    assert get_encoding("cl100k_base").encode("hello world") == [15339, 1917]
    counter = TokenCounter("o200k_base")
    assert counter.count("hello world") == 2
    assert counter.truncate("one two three four five", 3).endswith("…")
    assert get_encoding("o200k_harmony").n_vocab > get_encoding("o200k_base").n_vocab


def test_chunks_have_stable_ids_and_cover_text():
    counter = TokenCounter()
    text = " ".join(f"word{i}" for i in range(600))
    chunks = chunk_text("doc-1", text, counter, size=100, overlap=20)
    assert [c.id for c in chunks] == [f"doc-1#p{i}" for i in range(len(chunks))]
    assert chunks == chunk_text("doc-1", text, counter, size=100, overlap=20)
    assert all(c.n_tokens <= 100 for c in chunks)
    assert "word0" in chunks[0].text and "word599" in chunks[-1].text
    assert all(not c.text.startswith(("ord", "rd")) for c in chunks)  # no mid-word starts
    assert split_chunk_id("a#b#p12") == ("a#b", 12)


def test_corpus_formats(tmp_path):
    (tmp_path / "c.jsonl").write_text(
        json.dumps({"id": "a", "title": "A", "text": "x", "acl": ["g"], "date": "2024"}) + "\n\n"
        + json.dumps({"_id": "b", "text": "y", "extra": 1}) + "\n")
    docs = read_corpus(tmp_path / "c.jsonl")
    assert [d.id for d in docs] == ["a", "b"] and docs[0].acl == ("g",)
    assert docs[1].meta == {"extra": 1}
    folder = tmp_path / "notes"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "one.md").write_text("# Title One\nbody")
    (folder / "two.txt").write_text("plain")
    (folder / "BOM.MD").write_bytes("\ufeff# BOM Heading\r\nabout armadillos\r\n".encode())
    (folder / "long.markdown").write_text("words")
    (folder / ".git").mkdir()
    (folder / ".git" / "notes.txt").write_text("hidden")
    (folder / ".draft.txt").write_text("hidden")
    docs = read_corpus(folder)
    assert {d.id: d.title for d in docs} == {"sub/one": "Title One", "two": "two",
                                             "BOM": "BOM Heading", "long": "long"}
    assert next(d for d in docs if d.id == "BOM").text.startswith("# BOM Heading")
    # a link to a folder is followed, a link back up read once
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "three.md").write_text("linked")
    (folder / "linked").symlink_to(tmp_path / "shared", target_is_directory=True)
    (folder / "sub" / "up").symlink_to(folder, target_is_directory=True)
    assert sorted(d.id for d in read_corpus(folder)) == ["BOM", "linked/three", "long",
                                                          "sub/one", "two"]
    (folder / "sub" / "up").unlink()
    (folder / "tw o.txt").write_text("y")
    (folder / "tw_o.txt").write_text("x")
    with pytest.raises(CorpusError, match=r"duplicate document id 'tw_o' \(tw o.txt and tw_o.txt\)"):
        read_corpus(folder)
    (tmp_path / "t.jsonl").write_text('{"id": 7, "title": "Only a title", "acl": null}\n')
    only = read_corpus(tmp_path / "t.jsonl")[0]  # a title alone is a document; null ACL: none
    assert (only.id, only.title, only.text, only.acl) == ("7", "Only a title", "", ())
    # the same value spelt twice is one; null is no value; metadata that only looks like an
    # ACL field stays metadata (the ACL Anthology's acl_id, a chemistry "groups" list)
    (tmp_path / "s.jsonl").write_text(json.dumps(
        {"_id": 7, "id": "7", "text": "x", "acl": "hr", "acl_groups": ["hr"], "date": 2020,
         "acl_id": "P19-1001", "groups": ["methyl", "ethyl"], "ACLs": 3}) + "\n"
        + json.dumps({"_id": None, "id": "b", "text": "y", "acl": None,
                      "acl_groups": ["hr"]}) + "\n")
    same, hidden = read_corpus(tmp_path / "s.jsonl")
    assert (same.id, same.acl, same.date) == ("7", ("hr",), "2020")
    assert same.meta == {"acl_id": "P19-1001", "groups": ["methyl", "ethyl"], "ACLs": 3}
    assert (hidden.id, hidden.acl) == ("b", ("hr",))  # acl null: the groups are acl_groups


def test_a_link_up_out_of_a_text_folder_is_not_read_and_a_link_to_nothing_is_named(
        tmp_path, capsys):
    """A link to the corpus folder's parent (`up -> ..`) was walked as a folder never seen:
    every text file beside the corpus became a document (`up/diary`), and `-> /` would walk
    the whole disk; a `.txt` link whose target is gone was left out without a word (hostile
    pass). Both are skipped, each with a line on stderr; a link to a folder elsewhere is
    still read."""
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "note.txt").write_text("about otters")
    (tmp_path / "diary.txt").write_text("private, beside the corpus")
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "lent.md").write_text("linked in on purpose")
    (corpus / "sub" / "up").symlink_to(tmp_path, target_is_directory=True)
    (corpus / "shared").symlink_to(tmp_path / "shared", target_is_directory=True)
    (corpus / "gone.txt").symlink_to(tmp_path / "deleted.txt")
    assert sorted(d.id for d in read_corpus(corpus)) == ["note", "shared/lent"]
    err = capsys.readouterr().err
    assert f"skipped {corpus / 'sub' / 'up'}: a link to a folder that holds the corpus" in err
    assert f"skipped {corpus / 'gone.txt'}: a link to nothing ({tmp_path / 'deleted.txt'})" \
        in err


def test_a_corpus_file_that_cannot_be_read_is_one_line(tmp_path):
    """A BEIR folder whose corpus.jsonl is a folder stopped `ingest` with a traceback
    (IsADirectoryError; hostile pass); so would any file it may not open."""
    beir = tmp_path / "beir"
    (beir / "corpus.jsonl").mkdir(parents=True)
    with pytest.raises(CorpusError, match=r"cannot read .*beir/corpus.jsonl: Is a directory"):
        read_corpus(beir)


def test_document_ids_are_read_in_nfc(tmp_path):
    """An id typed decomposed (NFD: macOS writes `ü` as `u` + U+0308) is read composed (NFC),
    from a JSONL line and from a text file's name, and a BEIR set's qrels name it so too: an
    index holds one id for one document however it was typed. Two files whose names differ
    only in form are named as such."""
    import unicodedata

    from branchsearch.infra.datasets.beir import read_queries

    nfc = "Zürich-ü"
    nfd = unicodedata.normalize("NFD", nfc)
    folder = tmp_path / "beir"
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl").write_text(json.dumps({"_id": nfd, "text": "x"}) + "\n")
    (folder / "queries.jsonl").write_text(json.dumps({"_id": "q", "text": "where?"}) + "\n")
    (folder / "qrels" / "test.tsv").write_text(f"query-id\tcorpus-id\tscore\nq\t{nfd}\t1\n")
    assert [d.id for d in read_corpus(folder)] == [nfc]
    assert read_queries(folder)[0].gold == {nfc: 1}
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / f"{nfd}.txt").write_text("harbor")
    assert [d.id for d in read_corpus(notes)] == [nfc]
    (notes / f"{nfc}.txt").write_text("festival")
    with pytest.raises(CorpusError, match=r"duplicate document id .* \(the same id in another "
                                          r"Unicode form"):
        read_corpus(notes)


def test_corpus_acl_names_are_stripped_as_a_callers_are(tmp_path):
    """' hr' in a document's ACL used to be stored as is: no caller (whose groups are stripped)
    could match it, so the document was silently admins-only."""
    path = tmp_path / "c.jsonl"
    path.write_text('{"id": "a", "text": "x", "acl": [" hr", "board "]}\n')
    assert read_corpus(path)[0].acl == ("hr", "board")


def test_a_text_file_with_nothing_to_search_is_skipped_and_named(tmp_path, capsys):
    """It became a document titled by its file's name, with no text; now it is left out, with
    one line naming it, and the other files are read. Nothing to search is no letter or digit:
    whitespace, a bare "# ", zero-width spaces, NUL bytes. An empty heading is no title."""
    folder = tmp_path / "notes"
    folder.mkdir()
    blanks = {"blank": "  \n\t\r\n", "empty": "", "hash": "# \n", "nul": "\x00\x00",
              "zwsp": "\u200b\u200b\n"}
    for name, text in blanks.items():
        (folder / f"{name}.txt").write_text(text)
    (folder / "kept.txt").write_text("harbor festival in June")
    (folder / "titled.md").write_text("# \nharbor festival in May")
    docs = read_corpus(folder)
    assert [(d.id, d.title) for d in docs] == [("kept", "kept"), ("titled", "titled")]
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"skipped {folder / f'{name}.txt'}: nothing to search (no letter or digit)"
                     for name in sorted(blanks)]
    for name in ("kept.txt", "titled.md"):
        (folder / name).write_text("\ufeff \n")  # a BOM is no text either
    with pytest.raises(CorpusError, match="no documents found"):
        read_corpus(folder)


@pytest.mark.parametrize("content, message", [
    ('{"id": "a", "text": "x"}\n{not json\n', ":2: not valid JSON"),
    ('{"text": "x"}\n', "missing document id"),
    ('{"id": "a"}\n', "has no text and no title"),
    ('{"id": "a", "text": 5}\n', ":1: 'text' must be a string, not 5"),
    ('{"id": "a", "text": "x", "title": ["x", "y"]}\n', "'title' must be a string"),
    ('{"id": "a", "text": "x", "date": {"y": 1}}\n', "'date' must be a string"),
    ('{"id": "a b", "text": "x"}\n', "may not contain whitespace"),
    ('{"id": "trail\\n", "text": "x"}\n', "may not contain whitespace"),
    ('{"id": true, "text": "x"}\n', "must be a string or a whole number, not true"),
    ('{"id": 1.0, "text": "x"}\n', "must be a string or a whole number, not 1.0"),
    ('{"id": NaN, "text": "x"}\n', "must be a string or a whole number, not NaN"),
    ('{"id": "a", "text": "x", "acl": [], "acl_groups": ["hr"]}\n',
     "both 'acl' and 'acl_groups' are given"),
    ('{"id": "a", "_id": "b", "text": "x"}\n', "both '_id' and 'id' are given"),
    ('{"_id": "a", "text": "x"}\n{"_id": "b", "_id": "c", "text": "y"}\n',
     r"bad.jsonl:2: the key '_id' is given twice in one object: give it once"),
    ('{"id": "a", "text": "x", "meta": {"lang": "en", "lang": "de"}}\n',
     r":1: the key 'lang' is given twice"),
    ('{"id": "a", "text": "x", "acl": null, "acl_groups": ["hr"], "Acl_Groups": "hr"}\n',
     "field 'Acl_Groups' is not read as the document's groups"),
    ('{"id": "a", "text": "x", "ACL": ["hr"]}\n', "field 'ACL' is not read"),
    ('{"id": 1' + "1" * 5000 + ', "text": "x"}\n', ":1: not valid JSON \\(a number has more than 4,300 digits\\)"),
    ('{"id": "a", "text": "x"}\n\n{"_id": "a", "text": "y"}\n',
     r"bad.jsonl:3: duplicate document id 'a' \(first on line 1\)"),
    ('', "no documents"),
    ('{"id": "..", "text": "x"}\n', r"document id '\.\.' is a path step"),
    ('{"id": "nul\\u0000x", "text": "x"}\n', "holds the control character U\\+0000"),
    ('{"id": "rlo\\u202egpj.exe", "text": "x"}\n',
     "holds the format character U\\+202E \\(RIGHT-TO-LEFT OVERRIDE\\)"),
    # an id of characters that do not show: no id a reader can see or type (as an empty one)
    ('{"id": "\\u200b", "text": "x"}\n',
     r"bad.jsonl:1: document id '\\u200b' has no character that shows"),
    ('{"_id": "a", "text": "x"}\n{"_id": "\\ufeff\\u2060", "text": "y"}\n',
     r"bad.jsonl:2: document id '\\ufeff\\u2060' has no character that shows"),
    ('{"id": "\\u3164", "text": "x"}\n', r"bad.jsonl:1: document id '\\u3164' has no character"),
    ('{"id": "caf\u00e9", "text": "x"}\n{"id": "cafe\u0301", "text": "y"}\n',
     r":2: duplicate document id .* \(first on line 1\) \(the same id in another Unicode form"),
    ('{"id": "a", "text": "x", "acl": ["*"]}\n', r":1: 'acl' may not name '\*'"),
    ('{"id": "a", "text": "x", "acl": ["team", "__public__"]}\n',
     r"may not name '__public__' \(reserved: the group of the documents without an ACL\)"),
    ('{"id": "a", "text": "x", "acl": [""]}\n', "group names may not be empty"),
    ('{"id": "a", "text": "x", "acl": ["human resources"]}\n', "holds a space"),
    ('{"id": "a", "text": "x", "acl": ["' + "g" * 129 + '"]}\n', "longer than 128"),
    # a .json file holding an array read "not valid JSON (Expecting value at character 3)"
    ('[\n  {"_id": "a", "text": "x"},\n  {"_id": "b", "text": "y"}\n]\n',
     r"bad.jsonl:1: a JSON array; write one JSON object a line \(JSONL\)"),
    ('[{"_id": "a", "text": "x"}]\n', r"bad.jsonl:1: a JSON array; write one JSON object"),
])
def test_corpus_errors_name_the_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(CorpusError, match=message):
        read_corpus(path)


def test_a_text_file_whose_name_is_not_utf8_is_named_as_such(tmp_path):
    """A file named in latin-1 (`café.txt` from an old archive) stopped the ingest with
    "'id' holds a lone surrogate (...); fix the text": the text was fine (hostile pass)."""
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "ok.txt").write_text("fine")
    with open(os.fsencode(folder) + b"/caf\xe9.txt", "wb") as f:
        f.write(b"about otters")
    with pytest.raises(CorpusError, match="caf\udce9.txt: the file's name is not UTF-8 .*"
                                          "rename it"):
        read_corpus(folder)


def test_a_utf16_corpus_is_told_to_convert_from_utf16_not_latin1(tmp_path):
    """A file Windows PowerShell's `>` wrote (UTF-16 with its byte-order mark) was told to run
    `iconv -f latin1 -t utf-8`, which turns it into text with a NUL between letters (a text
    folder would ingest that, found by no search; hostile pass)."""
    line = '{"_id": "a", "text": "written by PowerShell"}\n'
    (tmp_path / "c.jsonl").write_bytes(line.encode("utf-16"))
    with pytest.raises(CorpusError, match=r"c.jsonl:1: not UTF-8 text .* `iconv -f utf-16 -t "
                                          r"utf-8`"):
        read_corpus(tmp_path / "c.jsonl")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_bytes("about otters".encode("utf-16"))
    with pytest.raises(CorpusError, match=r"notes/a.txt:1 .* `iconv -f utf-16 -t utf-8`"):
        read_corpus(tmp_path / "notes")
    (tmp_path / "notes" / "a.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(CorpusError, match=r"`iconv -f latin1 -t utf-8`"):
        read_corpus(tmp_path / "notes")


def test_a_jsonl_file_is_read_whatever_the_case_of_its_suffix(tmp_path):
    """`CORPUS.JSONL` was refused ("expected a BEIR folder, a .jsonl file or ..."), while a
    folder's `.TXT` files are read (hostile pass)."""
    path = tmp_path / "CORPUS.JSONL"
    path.write_text('{"_id": "a", "text": "upper case suffix"}\n')
    assert [d.id for d in read_corpus(path)] == ["a"]


def test_settings_precedence(tmp_path, monkeypatch):
    toml = tmp_path / "s.toml"
    toml.write_text("budget_tokens = 2048\nrrf_k = 10\n")
    monkeypatch.setenv("BRANCHSEARCH_RRF_K", "20")
    s = load_settings(toml, {"budget_tokens": None, "max_turns": 3})
    assert (s.budget_tokens, s.rrf_k, s.max_turns) == (2048, 20, 3)
    assert load_settings(toml, {"rrf_k": 30}).rrf_k == 30
    monkeypatch.setenv("BRANCHSEARCH_PRUNE", "no")
    assert load_settings().prune is False
    with pytest.raises(SettingsError, match="unknown keys"):
        toml.write_text("nope = 1\n")
        load_settings(toml)
    with pytest.raises(SettingsError, match="soft_limit"):
        load_settings(overrides={"soft_limit": 0.95, "hard_limit": 0.9})


def test_every_setting_is_in_one_section_and_a_file_may_use_the_sections(tmp_path):
    """`SECTIONS` places each field exactly once; a settings file may write a field at the top or
    in its own `[section]` table, never in another's and never twice; external `[indexes.NAME]`
    tables still declare indexes."""
    from dataclasses import fields as dc_fields

    from branchsearch.infra.config.settings import SECTIONS, Settings

    placed = [name for names in SECTIONS.values() for name in names]
    assert sorted(placed) == sorted(f.name for f in dc_fields(Settings))
    toml = tmp_path / "s.toml"
    toml.write_text("rrf_k = 10\n[agent]\nbudget_tokens = 2048\nmax_turns = 4\n"
                    "[tracing]\ntrace_exporter = \"console\"\n")
    s = load_settings(toml, read_env=False)
    assert (s.rrf_k, s.budget_tokens, s.max_turns, s.trace_exporter) == (10, 2048, 4, "console")
    assert s.section("agent")["budget_tokens"] == 2048 and "rrf_k" not in s.section("agent")
    for text, message in [("[agent]\nrrf_k = 3\n", r"\[agent\] has no setting 'rrf_k'; it "
                                                      r"belongs in \[retrieval\]"),
                          ("[agent]\nnope = 3\n", r"\[agent\] has no setting 'nope'$"),
                          ("max_turns = 2\n[agent]\nmax_turns = 3\n", "max_turns is set twice")]:
        toml.write_text(text)
        with pytest.raises(SettingsError, match=message):
            load_settings(toml, read_env=False)
    with pytest.raises(SettingsError, match="no settings section 'nope'"):
        s.section("nope")


def test_every_setting_says_once_whether_it_changes_a_result():
    """A batch row records the settings that change a question's evidence (`made_with`), and a
    resume keeps only rows made with the same: every field is classified exactly once, so a
    new setting cannot be added without saying whether results made with two of its values
    may be mixed in one output."""
    from dataclasses import fields as dc_fields

    from branchsearch.infra.config.settings import (CHANGES_RESULT, CHANGES_RESULT_WITH_LLM,
                                                    NO_RESULT_CHANGE, Settings, load_settings)
    from branchsearch.orchestrator.batch import made_with

    classified = [*CHANGES_RESULT, *CHANGES_RESULT_WITH_LLM, *NO_RESULT_CHANGE]
    assert sorted(classified) == sorted(f.name for f in dc_fields(Settings))
    s = load_settings(read_env=False, read_file=False)
    assert set(made_with(s, None)) == {*CHANGES_RESULT, "acl"}
    assert set(made_with(s.replace(planner="llm"), None)) == {
        *CHANGES_RESULT, *CHANGES_RESULT_WITH_LLM, "acl"}


def test_a_toml_number_for_a_whole_number_setting_is_not_rounded(tmp_path):
    """`per_title = 1.5` or `backend_retries = true` in a config file read as 1 and ran on
    (hostile pass); the same value in an environment variable was refused."""
    toml = tmp_path / "s.toml"
    for line in ("per_title = 1.5", "backend_retries = true"):
        toml.write_text(line + "\n")
        with pytest.raises(SettingsError, match="cannot read .* as int"):
            load_settings(toml, read_env=False)
    toml.write_text("per_title = 3.0\nbackend_retries = 2\n")  # a whole number is one
    s = load_settings(toml, read_env=False)
    assert (s.per_title, s.backend_retries) == (3, 2)


def test_a_bad_setting_line_says_where_it_was_set(tmp_path, monkeypatch):
    """A bad value from the environment or a settings file said what was wrong but not where
    it came from; the line now ends with the variable or the file. A flag (an override) names
    itself in the command's own error, so it adds nothing."""
    toml = tmp_path / "s.toml"
    toml.write_text("[retrieval]\nsearch_mode = \"fuzzy\"\n")
    with pytest.raises(SettingsError, match=r"search_mode must be .* \(set by settings file "
                                            + re.escape(str(toml)) + r"\)$"):
        load_settings(toml, read_env=False)
    monkeypatch.setenv("BRANCHSEARCH_BRANCHES", "0")
    with pytest.raises(SettingsError, match=r"^bad settings: branches must be >= 1 \(set by "
                                            r"BRANCHSEARCH_BRANCHES\)$"):
        load_settings(read_file=False)
    monkeypatch.setenv("BRANCHSEARCH_BRANCHES", "two")
    with pytest.raises(SettingsError, match=r"cannot read 'two' as int \(set by "
                                            r"BRANCHSEARCH_BRANCHES\)$"):
        load_settings(read_file=False)
    with pytest.raises(SettingsError, match=r"branches must be >= 1$"):  # a flag's own value
        load_settings(overrides={"branches": 0}, read_file=False)
    monkeypatch.delenv("BRANCHSEARCH_BRANCHES")
    monkeypatch.setenv("BRANCHSEARCH_CHUNK_TOKENS", "64")  # named, not blamed: overlap is bad
    with pytest.raises(SettingsError, match=r"chunk_overlap must be .* \(set by "
                                            r"BRANCHSEARCH_CHUNK_OVERLAP, BRANCHSEARCH_CHUNK_TOKENS"):
        monkeypatch.setenv("BRANCHSEARCH_CHUNK_OVERLAP", "64")
        load_settings(read_file=False)
    monkeypatch.delenv("BRANCHSEARCH_CHUNK_TOKENS")
    monkeypatch.delenv("BRANCHSEARCH_CHUNK_OVERLAP")
    # the setting being read is the one blamed, not every setting whose name the line holds
    monkeypatch.setenv("BRANCHSEARCH_INDEX", "hotpot")
    toml.write_text('[indexes."bad name"]\nlexical = "elasticsearch"\n')
    with pytest.raises(SettingsError) as err:
        load_settings(toml)
    assert str(err.value).endswith(f"(set by settings file {toml})"), err.value
    monkeypatch.delenv("BRANCHSEARCH_INDEX")
    monkeypatch.setenv("BRANCHSEARCH_INDEXES", "abc")  # read as three names, one a letter
    with pytest.raises(SettingsError, match=r"as \[indexes.NAME\] tables in a settings file"):
        load_settings(read_file=False)
    monkeypatch.delenv("BRANCHSEARCH_INDEXES")
    monkeypatch.setenv("BRANCHSEARCH_OTLP_ENDPOINT", "http://u:s3cret@[::1:4317")  # a traceback
    with pytest.raises(SettingsError, match=r"'http://\*\*\*@\[::1:4317' is not a collector") \
            as err:
        load_settings(read_file=False)
    assert "s3cret" not in str(err.value)

def test_a_misspelt_setting_variable_is_refused_and_other_tools_variables_pass(monkeypatch):
    monkeypatch.setenv("BRANCHSEARCH_SEARCH_MOD", "bm25")  # would silently run hybrid
    with pytest.raises(SettingsError, match="BRANCHSEARCH_SEARCH_MOD is not a setting; did you "
                                            "mean BRANCHSEARCH_SEARCH_MODE"):
        load_settings(read_file=False)
    monkeypatch.delenv("BRANCHSEARCH_SEARCH_MOD")
    monkeypatch.setenv("BRANCHSEARCH_search_mode", "bm25")  # names are upper-case: read never
    with pytest.raises(SettingsError, match="did you mean BRANCHSEARCH_SEARCH_MODE"):
        load_settings(read_file=False)
    monkeypatch.delenv("BRANCHSEARCH_search_mode")
    monkeypatch.setenv("BRANCHSEARCH_API_KEY", "k")  # the load tester's: near es_api_key, allowed
    monkeypatch.setenv("BRANCHSEARCH_LOADTEST_SEED", "3")
    monkeypatch.setenv("BRANCHSEARCH_SOMETHING_ELSE", "1")  # nothing like a setting
    monkeypatch.setenv("BRANCHSEARCH_SEARCH_MODE", "bm25")
    assert load_settings(read_file=False).search_mode == "bm25"


def test_the_docstore_finds_a_page_by_its_title_key(tmp_path):
    """`named`: the title or the title with a qualifier, by `title_key` (case in any script,
    accents and spacing aside); '%', '_' and '\\' are characters, not patterns; exact titles
    first; the key index is there to answer it."""
    from branchsearch.infra.ingest.chunking import Chunk
    from branchsearch.infra.ingest.corpus import Document
    from branchsearch.infra.stores.docstore import DocStore

    store = DocStore(tmp_path / "docs.sqlite")
    titles = {"a": "A_B", "b": "AxB (band)", "c": "50% Off (film)", "d": "50% Off",
              "e": "505 Off", "f": "Kansas", "g": "Kansas City", "h": "  École  Normale ",
              "i": "Aschenbrödel", "j": "C:\\path"}
    docs = [Document(i, t, f"text of {t}") for i, t in titles.items()]
    store.replace_documents(docs, [Chunk(f"{i}#p0", i, 0, "x", 0, 1) for i in titles])

    def named(name, limit=5):
        return [p["doc_id"] for p in store.named(name, limit)]

    assert named("kansas") == ["f"]
    assert named("A_B") == ["a"] and named("AxB") == ["b"]
    assert named("50% Off") == ["d", "c"] and named("50% Off", 1) == ["d"]
    assert named("50_ Off") == [] and named("%") == [] and named(" ") == []
    assert named("école normale") == named("ECOLE NORMALE") == ["h"]
    assert named("Aschenbrodel") == named("ASCHENBRÖDEL") == ["i"]
    assert named("c:\\PATH") == ["j"] and named("c:") == []
    assert store.named("Kansas")[0] == {"doc_id": "f", "title": "Kansas", "acl": [],
                                        "chunk_id": "f#p0", "exact": True}
    assert [p["exact"] for p in store.named("50% Off")] == [True, False]
    assert store._db.execute("SELECT 1 FROM sqlite_master WHERE name = 'docs_title_key'"
                             ).fetchone()
    store.close()


def test_an_older_docstore_gets_its_title_keys_on_open_unless_it_cannot_wait(tmp_path,
                                                                             monkeypatch):
    """A docstore written before title keys gets them on open (its titles found by `named`);
    when another connection holds the write lock the open does not wait for it: `named` finds
    nothing there until a later open adds them."""
    import sqlite3
    import time

    from branchsearch.infra.stores import docstore
    from branchsearch.infra.stores.docstore import DocStore

    def old_docstore(path):
        db = sqlite3.connect(path)
        db.executescript("""
            CREATE TABLE docs (doc_id TEXT PRIMARY KEY, title TEXT, source TEXT, date TEXT,
                               acl TEXT, meta TEXT, n_chunks INTEGER, fingerprint TEXT);
            CREATE TABLE chunks (chunk_id TEXT PRIMARY KEY, doc_id TEXT NOT NULL,
                                 n INTEGER NOT NULL, text TEXT NOT NULL, start_token INTEGER,
                                 n_tokens INTEGER);
            CREATE INDEX chunks_doc ON chunks(doc_id, n);
            CREATE TABLE pending (doc_id TEXT PRIMARY KEY);
            INSERT INTO docs VALUES ('k', 'Kansas', '', '', '[]', '{}', 1, 'f');
            INSERT INTO chunks VALUES ('k#p0', 'k', 0, 'Kansas is a state.', 0, 4);""")
        db.commit()
        return db

    old_docstore(tmp_path / "a.sqlite").close()
    store = DocStore(tmp_path / "a.sqlite")
    assert [p["doc_id"] for p in store.named("KANSAS")] == ["k"]
    store.close()

    writer = old_docstore(tmp_path / "b.sqlite")
    writer.execute("BEGIN IMMEDIATE")
    writer.execute("UPDATE docs SET source = 'x'")
    started = time.perf_counter()
    store = DocStore(tmp_path / "b.sqlite")
    assert time.perf_counter() - started < 2 and store.named("Kansas") == []
    assert store.get_document("k")["title"] == "Kansas"  # reads as before
    writer.rollback()
    assert store.named("Kansas") == []  # tried again only after KEYS_RETRY_S
    monkeypatch.setattr(docstore, "KEYS_RETRY_S", 0.0)
    assert [p["doc_id"] for p in store.named("Kansas")] == ["k"]  # this process, once free
    writer.close()
    store.close()

    # a reader holding the file while the keys commit: all or nothing, not a column of NULLs
    reader = old_docstore(tmp_path / "c.sqlite")
    reader.execute("BEGIN")
    reader.execute("SELECT * FROM docs").fetchall()
    store = DocStore(tmp_path / "c.sqlite")  # its commit cannot wait for the reader
    assert not store.has_title_keys
    assert "title_key" not in {r[1] for r in reader.execute("PRAGMA table_info(docs)")}
    reader.rollback()
    reader.close()
    assert [p["doc_id"] for p in store.named("Kansas")] == ["k"]
    store.close()


def test_a_corpus_of_long_documents_commits_in_bounded_batches():
    """Batches close at `batch_docs` documents or once their text passes the bound: 256 books
    are not one batch held in memory and committed at the end. Order kept, nothing split."""
    from branchsearch.infra.ingest.corpus import Document
    from branchsearch.infra.ingest.batches import doc_batches

    docs = [Document(f"d{i}", "", "x" * (900 if i % 5 else 5_000)) for i in range(40)]
    batches = list(doc_batches(docs, batch_docs=16, batch_chars=10_000))
    assert [d.id for b in batches for d in b] == [d.id for d in docs]
    assert all(len(b) <= 16 for b in batches)
    assert all(sum(len(d.text) for d in b[:-1]) < 10_000 for b in batches)
    assert len(batches) > 40 // 16 + 1  # the text bound closed some early
    assert [len(b) for b in doc_batches(docs, batch_docs=16, batch_chars=10**9)] == [16, 16, 8]
