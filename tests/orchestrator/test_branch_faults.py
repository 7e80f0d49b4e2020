"""Backend faults end branches honestly: a dead backend is an `error` branch and a `failed`
result, never an empty `ok`; batch retries what is not ok and ends with one line per id.
Real components: the Elasticsearch emulator as the lexical backend, stopped mid-batch."""

import json

import pytest

from branchsearch.orchestrator.batch import (check_output, compact, done_ids, read_questions,
                                             resume_state, run_batch, to_ask)

from conftest import HOTPOT
from store_copy import copy_store


def _items():
    rows = [json.loads(line) for line in (HOTPOT / "queries.jsonl").read_text().splitlines()]
    return [(r["_id"], r["text"]) for r in rows]


def test_batch_retries_what_is_not_ok_and_keeps_one_line_per_id(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text(
        json.dumps({"id": "a", "status": "ok", "evidence": [1]}) + "\n"
        + json.dumps({"id": "b", "status": "partial"}) + "\n"
        + json.dumps({"id": "c", "error": "BackendUnavailable: down"}) + "\n"
        + json.dumps({"id": "d", "evidence": []}) + "\n"  # an old row without status
        + '{"id": "e", "sta')  # torn by a crash
    assert done_ids(out) == {"a": None}  # (a row written without its question)
    check_output(out, tmp_path / "in.jsonl")  # every line is one a batch wrote (or torn)
    asked = []

    def search(question):
        asked.append(question)
        if question == "qd":
            raise RuntimeError("still broken")
        return {"status": "ok", "evidence": [question]}

    items = [(x, f"q{x}") for x in "abcde"]
    counts = run_batch(items, out, search, concurrency=2)
    assert sorted(asked) == ["qb", "qc", "qd", "qe"]
    assert counts == {"skipped": 1, "ok": 3, "partial": 0, "failed": 1, "cut_short": 0,
                      "question_cut": 0, "not_run": 0, "stopped": "", "lost": "", "gone": "",
                      "changed": [], "failed_ids": ["d"]}
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == list("abcde")  # one line each, input order
    assert rows[3]["status"] == "failed" and "still broken" in rows[3]["error"]
    # a crash after appending a newer attempt: the latest line wins when compacted
    with out.open("a") as f:
        f.write(json.dumps({"id": "d", "status": "ok", "evidence": ["late"]}) + "\n")
    assert compact(out, list("abcde")) == 5 and set(done_ids(out)) == set("abcde")
    assert json.loads(out.read_text().splitlines()[3])["evidence"] == ["late"]


def test_a_question_edited_under_the_same_id_is_asked_again(tmp_path):
    """A resume asks what is not done, and an id whose ok row answered another question (the
    input edited: a typo fixed) is not done: it is asked again, and its row replaced."""
    out = tmp_path / "out.jsonl"
    items = [("a", "Who reviews the master contract?"), ("b", "Who owns the archive?")]
    run_batch(items, out, lambda q: {"status": "ok", "evidence": [q]}, concurrency=1)
    edited = [("a", "Who signed the master contract?"), items[1]]
    asked = []
    counts = run_batch(edited, out, lambda q: asked.append(q) or
                       {"status": "ok", "evidence": [q]}, concurrency=1)
    assert asked == ["Who signed the master contract?"]
    assert counts["skipped"] == 1 and counts["ok"] == 1 and counts["changed"] == ["a"]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], r["question"]) for r in rows] == edited  # one row each, the new answer
    assert run_batch(edited, out, lambda q: pytest.fail("asked"), concurrency=1)["skipped"] == 2


def test_a_line_whose_two_spellings_of_a_field_differ_is_refused(tmp_path):
    """`{"id": "x1", "_id": "x2"}`, or `question` beside a different `text`, is a malformed
    line, skipped with its line number (as ingest refuses the same conflict); the same value
    twice is fine."""
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in [
        {"id": "x1", "_id": "x2", "question": "q one"},
        {"id": "y", "question": "q two", "text": "another"},
        {"id": "z", "_id": "z", "question": "same", "text": "same"},
        ]) + '\n{"id": "w", "question": "a\tb"}\n', encoding="utf-8")  # a raw tab
    data = read_questions(path)
    assert data.items == [("z", "same")]
    assert data.bad_lines[:2] == [
        f"{path}:1: gives both 'id' and '_id', and they differ: keep one",
        f"{path}:2: gives both 'question' and 'text', and they differ: keep one"]
    assert data.bad_lines[2] == (f"{path}:4: not JSON (Invalid control character at character "
                                 "27 of the line)")


def test_a_line_cut_short_says_where_its_string_began(tmp_path):
    """A questions line cut inside a string (a file copied with `head -c`, a writer killed):
    its newline read as a control character inside that string ("Invalid control character
    at character 33"), which names neither the cut nor a character the line shows."""
    path = tmp_path / "q.jsonl"
    path.write_text('{"id": "a", "question": "Who is Ed Wood?"}\n{"id": "trunc", "question": '
                    '"Who\r\n', encoding="utf-8")
    data = read_questions(path)
    assert data.items == [("a", "Who is Ed Wood?")]
    assert data.bad_lines == [f"{path}:2: not JSON (Unterminated string starting at character "
                              "29 of the line)"]
    # a request body is bytes in any encoding JSON allows: dropping its newline as bytes cut a
    # UTF-16 one in half (the review's case: 422 'body is not JSON' for a valid body)
    from branchsearch.infra.textfile import json_once

    for encoding in ("utf-8", "utf-16-be", "utf-16-le", "utf-32", "utf-8-sig"):
        body = '{"question": "Qui a réalisé Ed Wood ?"}\r\n'.encode(encoding)
        assert json_once(body) == {"question": "Qui a réalisé Ed Wood ?"}, encoding


@pytest.fixture
def es_index(tmp_path):
    """hotpot-mini with its lexical index in the emulator (BM25 only: no embedding needed)."""
    from es_emulator import start_es_emulator

    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.infra.config.settings import load_settings

    es = start_es_emulator(tmp_path / "es")
    settings = load_settings(overrides={
        "home": tmp_path / "home", "index": "hotpot-es", "es_url": es.url, "branches": 1,
        "search_mode": "bm25", "backend_retries": 1, "backend_backoff_s": 0.05},
        read_env=False, read_file=False)
    ingest(HOTPOT, settings, dense=False)
    state = {"es": es}
    yield settings, state
    state["es"].stop()


def test_backend_stopped_mid_batch_then_rerun(es_index, tmp_path):
    from es_emulator import start_es_emulator

    from branchsearch.orchestrator.driver import Driver

    settings, state = es_index
    items, out = _items(), tmp_path / "out.jsonl"
    driver = Driver(settings, mode="local")
    asked = 0

    def search(question):
        nonlocal asked
        asked += 1
        if asked == 4:
            state["es"].stop()  # the outage: the lexical backend is gone mid-batch
        return driver.search(question).to_dict()

    try:  # 3 failures in a row stop it: the outage does not mark every later question failed
        counts = run_batch(items, out, search, concurrency=1, stop_after=3)
    finally:
        driver.close()
    assert len(items) > 6 and counts["not_run"] == len(items) - 6
    assert counts["stopped"].startswith("3 questions failed in a row (the last: ")
    assert "BackendUnavailable" in counts["stopped"]
    assert (counts["ok"], counts["failed"], counts["skipped"]) == (3, 3, 0)
    assert counts["failed_ids"] == [qid for qid, _ in items[3:6]]  # named, in input order
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [qid for qid, _ in items[:6]]  # nothing for the rest
    for row in rows[3:]:
        assert row["status"] == "failed" and row["evidence"] == []
        branch = row["branches"][0]
        assert branch["status"] == "error" and branch["termination"] == "backend_error"
        assert "BackendUnavailable" in branch["error"] and "after 1 retries" in branch["error"]
    assert all(r["status"] == "ok" and r["evidence"] for r in rows[:3])

    state["es"] = start_es_emulator(tmp_path / "es", port=state["es"].port)  # same data
    driver = Driver(settings, mode="local")
    try:
        again = run_batch(items, out, lambda q: driver.search(q).to_dict(), concurrency=2)
    finally:
        driver.close()
    assert again == {"skipped": 3, "ok": len(items) - 3, "partial": 0, "failed": 0,
                     "cut_short": 0, "question_cut": 0, "not_run": 0, "stopped": "", "lost": "",
                     "gone": "", "changed": [],
                     "failed_ids": []}
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [qid for qid, _ in items]  # one line per id
    assert all(r["status"] == "ok" and r["evidence"] for r in rows)


def test_an_index_whose_store_files_are_gone_or_garbage_is_damaged_not_empty(tmp_path):
    """Deleting docs.sqlite or tantivy/ used to make every search 'ok' with no evidence (and a
    fresh empty store file appear); a garbage docs.sqlite a traceback. Both are one error,
    and nothing is created in the index."""
    from branchsearch.infra.errors import IndexIncomplete
    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.infra.index.open import open_retriever
    from branchsearch.infra.config.settings import load_settings

    settings = load_settings(overrides={"home": tmp_path, "index": "hm", "search_mode": "bm25"},
                             read_env=False, read_file=False)
    ingest(HOTPOT, settings, dense=False)
    docs = settings.index_dir / "docs.sqlite"
    saved = docs.read_bytes()
    docs.unlink()
    with pytest.raises(IndexIncomplete, match="damaged.*docs.sqlite missing"):
        open_retriever(settings, need_dense=False)
    assert not docs.exists()
    docs.write_bytes(b"not a database" * 600)
    with pytest.raises(IndexIncomplete, match="damaged.*not a database"):
        open_retriever(settings, need_dense=False)
    from branchsearch.infra.index.catalog import owned_indexes  # `indexes` says so too (said "ok")

    assert [i.health for i in owned_indexes(settings)] == [
        "damaged: docs.sqlite is not a database; remove the folder and ingest it again"]
    docs.write_bytes(saved)
    meta = settings.index_dir / "tantivy" / "meta.json"
    meta.rename(meta.with_suffix(".bak"))
    with pytest.raises(IndexIncomplete, match="tantivy"):
        open_retriever(settings, need_dense=False)
    meta.with_suffix(".bak").rename(meta)
    terms = {p: p.read_bytes() for p in (settings.index_dir / "tantivy").glob("*.term")}
    assert terms
    for path in terms:  # a segment file emptied: tantivy refuses the index; before, a traceback
        path.write_bytes(b"")
    with pytest.raises(IndexIncomplete, match="damaged.*tantivy.*ingest it again"):
        open_retriever(settings, need_dense=False)
    with pytest.raises(IndexIncomplete, match="damaged"):
        ingest(HOTPOT, settings, dense=False)
    for path, data in terms.items():
        path.write_bytes(data)
    r = open_retriever(settings, need_dense=False)
    try:
        assert r.search("Ed Wood", "bm25", 3)
    finally:
        r.close()


def test_a_batch_line_with_no_words_is_malformed_input_not_a_failure_streak(tmp_path):
    from branchsearch.orchestrator.batch import read_questions

    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"id": i, "question": "..."}) + "\n" for i in range(3))
                    + json.dumps({"id": "ok", "question": "Who is Ed Wood?"}) + "\n")
    data = read_questions(path)
    assert data.items == [("ok", "Who is Ed Wood?")]
    assert len(data.bad_lines) == 3 and "no words" in data.bad_lines[0]
    path.write_text(json.dumps({"id": "e", "question": " "}) + "\n"
                    + json.dumps({"question": "Who?"}) + "\n"
                    + json.dumps({"id": "n", "question": 5}) + "\n"
                    + json.dumps({"id": "l", "text": ["a"]}) + "\n")
    assert read_questions(path).bad_lines == [  # each says what is wrong with it
        f"{path}:1: empty question: give the words to search for",
        f"{path}:2: needs 'id' (or '_id') and 'question' (or 'text')",
        f"{path}:3: question must be text, not a number",
        f"{path}:4: question must be text, not an array"]
    from branchsearch.infra.errors import CorpusError

    with pytest.raises(CorpusError, match="is a folder; give the questions file"):
        read_questions(tmp_path)


def test_a_batch_line_naming_a_key_twice_is_malformed(tmp_path):
    """`{"id": "q1", "id": "q2", ...}` was asked as q2: its row would answer for an id the line
    may not have meant. It is a malformed line, named, and the others are asked."""
    from branchsearch.orchestrator.batch import read_questions

    path = tmp_path / "q.jsonl"
    path.write_text('{"id": "q1", "id": "q2", "question": "Who is Ed Wood?"}\n'
                    '{"id": "q3", "question": "Who?", "question": "Where?"}\n'
                    '{"id": "ok", "question": "Who is Ed Wood?"}\n')
    data = read_questions(path)
    assert data.items == [("ok", "Who is Ed Wood?")]
    assert data.bad_lines == [
        f"{path}:1: the key 'id' is given twice in one object: give it once",
        f"{path}:2: the key 'question' is given twice in one object: give it once"]


def test_a_batch_id_holding_a_character_that_does_not_show_is_malformed(tmp_path):
    """`q\\u200b1` was asked and written as an id that reads `q1`: a question id follows the
    document ids' rule (`ids.hidden_character`), so such a line is malformed, named with the
    character, and the others are asked; a joiner inside an emoji is part of the id."""
    from branchsearch.orchestrator.batch import read_questions

    path = tmp_path / "q.jsonl"
    ids = ["q\u200b1", "q\x002", "\uff31\uff13", "\U0001f469\u200d\U0001f4bb", "q1"]
    path.write_text("".join(json.dumps({"id": i, "question": "Who is Ed Wood?"}) + "\n"
                            for i in ids))
    data = read_questions(path)
    assert [qid for qid, _ in data.items] == ["\U0001f469\u200d\U0001f4bb", "q1"]
    assert data.bad_lines == [
        f"{path}:1: 'id' 'q\\u200b1' holds the format character U+200B (ZERO WIDTH SPACE), "
        "which output would not show",
        f"{path}:2: 'id' 'q\\x002' holds the control character U+0000, which output would not "
        "show",
        f"{path}:3: 'id' '\uff31\uff13' holds the full-width 'Q' (U+FF31), which reads as the "
        "ASCII 'Q'; write 'Q'"]


def test_a_batch_line_that_is_not_a_json_object_names_its_line(tmp_path):
    from branchsearch.orchestrator.batch import read_questions

    path = tmp_path / "q.jsonl"
    path.write_text('[{"id": 1, "question": "Who is Ed Wood?"}]\n"Who?"\nnull\n7\n'
                    '{"id": "ok", "question": "Who is Ed Wood?"}\n')
    data = read_questions(path)
    assert data.items == [("ok", "Who is Ed Wood?")]
    assert data.bad_lines == [f"{path}:{n}: a line is one JSON object per question, not {kind}"
                              for n, kind in ((1, "an array"), (2, "a string"), (3, "null"),
                                              (4, "a number"))]


def test_an_error_inside_a_ray_task_is_one_line_by_its_cause():
    """A branch's error (and a batch's stop line) names what failed, not Ray's coloured
    traceback: before, 'RayTaskError(ValueError): ray::RetrieverActor.call_many() (pid=…)'
    and a traceback fragment with escape codes."""
    import ray.exceptions

    from branchsearch.infra.errors import error_line

    cause = ValueError("tantivy: index directory\nis gone")
    exc = ray.exceptions.RayTaskError(
        "RetrieverActor.call_many", "Traceback (most recent call last):\n  \x1b[36mFile x\x1b[0m",
        cause, proctitle="ray::RetrieverActor", pid=4242, ip="10.0.0.1")
    assert error_line(exc) == "ValueError: tantivy: index directory is gone"
    assert error_line(RuntimeError("\x1b[31mred\x1b[0m\nline two"), 12) == "RuntimeError"[:12]
    assert error_line(RuntimeError("\x1b[31mred\x1b[0m\nline two")) == "RuntimeError: red line two"
    outer = ray.exceptions.RayTaskError("BranchActor.run", "Traceback …", exc, pid=1)
    assert error_line(outer) == "ValueError: tantivy: index directory is gone"


def test_a_dense_store_gone_from_a_complete_index_is_damaged_not_empty(hotpot_settings):
    """A deleted dense.db used to be recreated empty by Milvus Lite: dense search answered `[]`
    with rc 0 and a hybrid search 'ok' on BM25 alone. Now it is one error line, and nothing is
    created; a collection dropped from the file likewise."""
    import subprocess
    import sys

    from conftest import ingest_copy

    from branchsearch.infra.errors import IndexIncomplete
    from branchsearch.infra.index.open import dense_store, open_retriever

    settings = ingest_copy(hotpot_settings, "dense-gone")
    db = settings.index_dir / "dense.db"
    db.rename(db.with_suffix(".bak"))
    with pytest.raises(IndexIncomplete, match=r"damaged: .*dense\.db missing; remove .* again"):
        open_retriever(settings)
    done = subprocess.run(
        [sys.executable, "-m", "branchsearch.orchestrator.cli", "retrieve", "Ed Wood", "--home",
         str(settings.home), "--index", settings.index, "--mode", "dense", "--json"],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == "", (done.returncode, done.stdout[-300:])
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "damaged" in lines[0] and "dense.db missing" in lines[0], lines
    assert not db.exists()  # nothing recreated
    from branchsearch.infra.index.catalog import owned_indexes

    health = {i.name: i.health for i in owned_indexes(settings)}
    assert health[settings.index].startswith("damaged: dense.db missing"), health
    assert health[hotpot_settings.index] == "ok"
    bm25 = open_retriever(settings.replace(search_mode="bm25"), need_dense=False)
    try:  # the lexical side is intact and still answers
        assert bm25.search("Ed Wood", "bm25", 3)
    finally:
        bm25.close()

    db.with_suffix(".bak").rename(db)
    r = open_retriever(settings)
    try:
        assert r.search("Ed Wood", "dense", 3)  # the file back: dense search answers again
    finally:
        r.close()
    store = dense_store(settings, 384)
    store.drop()
    store.close()
    with pytest.raises(IndexIncomplete, match=r"damaged: .*collection 'chunks_dense_gone'"):
        open_retriever(settings)
    with pytest.raises(IndexIncomplete):  # the refused open released the file: still refused
        open_retriever(settings)


def test_a_dense_backend_that_stops_answering_ends_the_branch_and_a_dead_one_comes_back(
        hotpot_settings):
    """A stopped Milvus Lite process (SIGSTOP) must not hang a search: every Milvus request has
    `backend_timeout_s`, past which it raises BackendUnavailable. A killed one is started again
    on the same file by the next request (a service used to answer 503 until restarted): the
    question is answered as before the kill, by a new process, and so are later ones."""
    import os
    import signal
    import threading

    from milvus_lite.server_manager import server_manager_instance

    from conftest import ingest_copy

    from branchsearch.infra.errors import BackendUnavailable
    from branchsearch.orchestrator.driver import Driver

    import time

    # a deadline a loaded CI machine meets on every live search, short enough to wait out
    settings = ingest_copy(hotpot_settings, "dense-killed").replace(
        backend_timeout_s=8.0, backend_retries=0, branches=1, search_mode="dense")
    driver = Driver(settings, mode="local")
    key = str((settings.index_dir / "dense.db").absolute().resolve())
    try:
        before = driver.search("Who directed Ed Wood?").to_dict()
        assert before["status"] == "ok" and before["evidence"]
        server = server_manager_instance._servers[key]
        retriever = driver.executor.retriever
        os.kill(server._p.pid, signal.SIGSTOP)  # alive but not answering: the deadline ends it
        for _ in range(100):  # the stop takes effect asynchronously: a search sent before it
            if open(f"/proc/{server._p.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "T":
                break  # is answered (seen: the test's one flaky failure)
            time.sleep(0.05)
        try:
            with pytest.raises(BackendUnavailable, match="search failed .*DEADLINE_EXCEEDED"):
                retriever.search("Ed Wood", "dense", 3)
        finally:
            os.kill(server._p.pid, signal.SIGCONT)
        for attempt in range(10):  # answering again (a resumed server may first catch up)
            try:
                assert retriever.search("Ed Wood", "dense", 3)
                break
            except BackendUnavailable:
                if attempt == 9:
                    raise
                time.sleep(1)
        hits = [h.chunk_id for h in retriever.search("Ed Wood", "dense", 3)]
        os.kill(server._p.pid, signal.SIGKILL)  # the Lite process dies under the retriever
        server._p.wait()
        outcome = {}

        def question():
            try:
                outcome["result"] = driver.search("Who directed Ed Wood?").to_dict()
            except Exception as exc:  # noqa: BLE001 — reported below
                outcome["error"] = exc

        worker = threading.Thread(target=question, daemon=True)
        worker.start()
        worker.join(120)  # far above the 8 s timeout: only a hang reaches it
        assert not worker.is_alive(), "a question on a dead Milvus Lite hangs"
        result = outcome.get("result")
        assert result is not None, outcome
        assert result["status"] == "ok", [b.get("error") for b in result["branches"]]
        assert result["evidence"] == before["evidence"]
        revived = server_manager_instance._servers[key]
        assert revived is not server and revived._p.poll() is None
        assert [h.chunk_id for h in retriever.search("Ed Wood", "dense", 3)] == hits
    finally:
        driver.close()


def test_a_copied_or_renamed_index_folder_says_so_and_an_ingest_leaves_it_whole(hotpot_settings):
    """Its Milvus Lite collection is named for the index it was ingested as: under a new folder
    name a search called it damaged ("remove it and ingest again") and an ingest filled a
    second, empty collection, then failed and left the copy without a manifest. Now both say
    what happened, before anything is touched; renamed back, it answers."""
    from pathlib import Path

    from branchsearch.infra.index.catalog import owned_indexes
    from branchsearch.infra.errors import IndexIncomplete
    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.infra.index.open import open_retriever

    from conftest import ingest_copy

    # an index of its own: copying a folder whose Lite file a process has open (the session's
    # hotpot index) closes that process's lock handle, and Milvus Lite stops its server
    source = ingest_copy(hotpot_settings, "copy-source")
    copy = hotpot_settings.replace(index="hotpot-copy")
    copy_store(source.index_dir, copy.index_dir)
    manifest = (copy.index_dir / "manifest.json").read_bytes()
    said = r"ingested as 'copy-source' and its folder copied .*rename the folder back"
    with pytest.raises(IndexIncomplete, match=said):
        open_retriever(copy)
    with pytest.raises(IndexIncomplete, match=said):
        ingest(HOTPOT, copy)
    assert (copy.index_dir / "manifest.json").read_bytes() == manifest  # untouched
    health = {i.name: i.health for i in owned_indexes(copy)}
    assert health["hotpot-copy"].startswith("copied or renamed from 'copy-source'"), health
    assert health["copy-source"] == "ok"
    # the same folder under its own name in another home (a moved home) is fine
    moved = source.replace(home=Path(copy.home).parent / "moved-home")
    copy_store(copy.index_dir, moved.index_dir)
    retriever = open_retriever(moved)
    try:
        assert retriever.search("Ed Wood", "hybrid", 3)
    finally:
        retriever.close()


def test_ingested_as_reads_only_a_folder_s_own_lite_file(tmp_path):
    from branchsearch.infra.index.manifest import Manifest, ingested_as

    def manifest(dense: str) -> Manifest:
        fields = {f: None for f in Manifest.__dataclass_fields__}
        return Manifest(**(fields | {"backends": {"dense": dense, "lexical": "tantivy"}}))

    folder = tmp_path / "indexes" / "new-name"
    folder.mkdir(parents=True)
    # no dense.db here: its vectors are in a file milvus_uri names (another index's): no guess
    assert ingested_as(folder, manifest("milvus-lite /old/indexes/old/dense.db (FLAT)")) is None
    (folder / "dense.db").write_bytes(b"")  # a copied folder carries its own Lite file
    assert ingested_as(folder, manifest("milvus-lite /old/indexes/old/dense.db (FLAT)")) == "old"
    assert ingested_as(folder, manifest("milvus-lite /h (1)/indexes/old/dense.db (HNSW)")) == "old"
    assert ingested_as(folder, manifest("milvus-lite /h/indexes/new_name/dense.db (HNSW)")) is None
    assert ingested_as(folder, manifest("milvus-lite /data/vectors.db (FLAT)")) is None
    assert ingested_as(folder, manifest("milvus http://milvus:19530 (HNSW)")) is None
    assert ingested_as(folder, manifest("")) is None


def test_a_resume_asks_again_an_edited_question_not_a_respaced_one():
    done = {"a": "Who directed Big Eyes?", "b": "Where is Knott?", "c": None}
    items = [("a", "  Who directed  Big Eyes?\n"), ("b", "Where is Knott, UK?"), ("c", "x"),
             ("d", "new")]
    todo, changed = to_ask(items, done)
    assert [qid for qid, _ in todo] == ["b", "d"] and changed == ["b"]


def test_reading_an_output_changes_nothing_and_a_whole_last_row_without_newline_is_kept(
        tmp_path):
    out = tmp_path / "out.jsonl"
    whole = (json.dumps({"id": "a", "question": "qa", "status": "ok", "evidence": [1]}) + "\n"
             + json.dumps({"id": "b", "question": "qb", "status": "ok", "evidence": [2]}))
    out.write_text(whole)
    check_output(out, tmp_path / "in.jsonl")
    assert done_ids(out) == {"a": "qa", "b": "qb"} and resume_state(out).done == done_ids(out)
    assert out.read_text() == whole  # reads only: a refused resume leaves it as it was
    asked = []
    counts = run_batch([("a", "qa"), ("b", "qb"), ("c", "qc")], out,
                       lambda q: asked.append(q) or {"status": "ok", "evidence": [q]},
                       concurrency=1)
    assert asked == ["qc"] and counts["skipped"] == 2
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a", "b", "c"]
    # torn (a crash mid-write): still left alone by a read, cut by the run that appends
    out.write_text(whole + '\n{"id": "c", "sta')
    assert done_ids(out) == {"a": "qa", "b": "qb"} and out.read_text().endswith('"sta')
    run_batch([("c", "qc")], out, lambda q: {"status": "ok", "evidence": [q]}, concurrency=1)
    assert sorted(json.loads(line)["id"] for line in out.read_text().splitlines()) == \
        ["a", "b", "c"]


def test_batch_and_search_refuse_a_question_holding_a_control_character(tmp_path):
    from branchsearch.workers.query import question_problem

    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(json.dumps({"id": i, "question": q}) for i, q in (
        ("a", "mayor of Marton\u0000"), ("b", "Marton\u009b[31m mayor"),
        ("c", "mayor\tof\nMarton"))) + "\n")
    read = read_questions(inp)
    assert read.items == [("c", "mayor\tof\nMarton")]
    assert [line.split(": ", 1)[1] for line in read.bad_lines] == [
        "question holds the control character U+0000; send text (tab, newline and carriage "
        "return are fine)",
        "question holds the control character U+009B; send text (tab, newline and carriage "
        "return are fine)"]
    assert "U+007F" in question_problem("a\x7fb", "query")


def test_a_question_id_in_its_other_unicode_form_is_the_same_question(tmp_path):
    """An id typed on macOS is NFD. An output whose row holds "q-ü" in one form, resumed with
    an input holding it in the other, was asked again and ended with two rows that look alike:
    ids are read in NFC, the input's and the output's rows alike."""
    import unicodedata

    nfc, nfd = "q-\u00fc", unicodedata.normalize("NFD", "q-\u00fc")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"id": nfc, "question": "Where is Knott?"}) + "\n"
                   + json.dumps({"id": nfd, "question": "Where is Knott?"}) + "\n")
    read = read_questions(inp)
    assert [qid for qid, _ in read.items] == [nfc]  # one question, given twice
    assert read.bad_lines == [f"{inp}:2: duplicate id {nfc!r}"]
    out.write_text(json.dumps({"id": nfd, "question": "Where is Knott?", "status": "ok",
                               "evidence": [1]}) + "\n")  # written before ids were NFC
    assert done_ids(out) == {nfc: "Where is Knott?"}
    asked = []
    counts = run_batch(read.items, out, lambda q: asked.append(q) or {"status": "ok"},
                       concurrency=1)
    assert asked == [] and counts["skipped"] == 1
    assert len(out.read_text().splitlines()) == 1


_FULL_DISK_RUN = """import json, sys
from pathlib import Path
from branchsearch.orchestrator.batch import append_row, run_batch
out, step = Path(sys.argv[1]), sys.argv[2]
try:
    if step == "append":
        append_row(out, {"id": "c", "status": "ok", "evidence": ["x" * 4000]})
    else:
        run_batch([("a", "qa"), ("b", "qb"), ("c", "qc")], out,
                  lambda q: {"status": "ok", "evidence": [q * 2000]}, concurrency=1)
except OSError as exc:
    print(exc.errno)
"""


def test_a_full_disk_leaves_whole_rows_and_no_partial_copy(tmp_path):
    """A write refused for want of room (here the kernel's file size limit, EFBIG; a full disk
    is ENOSPC) goes on as an error, and leaves the output in whole rows: a row the disk took
    part of is undone, and the rewrite that ends every run, refused as well, left its partial
    copy `.out.jsonl.PID.tmp` beside the output (one more on each try, on a disk already
    full)."""
    import errno
    import subprocess
    import sys

    from conftest import prepared

    out, script = tmp_path / "out.jsonl", tmp_path / "run.py"
    script.write_text(_FULL_DISK_RUN)
    rows = [{"id": i, "question": f"q{i}", "status": "ok", "evidence": ["e" * 3000]}
            for i in "ab"]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = out.read_bytes()

    def run(step: str, limit: int) -> str:
        done = subprocess.run(prepared([sys.executable, script, out, step], file_size=limit),
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip()

    # room for part of the row: what was written of it is taken back
    assert run("append", len(before) + 100) == str(errno.EFBIG)
    assert out.read_bytes() == before
    # no room at all (a limit below the output's size): the row and the rewrite both refused
    assert run("batch", len(before) // 2) == str(errno.EFBIG)
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "run.py"]


def test_rows_longer_than_a_read_block_mend_resume_and_compact_as_written(tmp_path):
    """The output is read line by line and its last line from the end a block (64 KB) at a
    time: rows of 200 KB, a torn one and a whole one without its newline, mend, resume and
    compact exactly as short rows do, and the rewrite copies each latest row byte for byte."""
    from branchsearch.orchestrator.batch import mend_tail

    out = tmp_path / "out.jsonl"
    big = lambda qid, status: json.dumps(  # noqa: E731
        {"id": qid, "question": f"q{qid}", "status": status, "evidence": ["x" * 200_000]},
        ensure_ascii=False)
    rows = [big("a", "failed"), big("b", "ok"), big("a", "ok"), big("東京", "ok")]
    out.write_text("\n".join(rows[:3]) + "\n" + rows[3][:150_000])  # torn: half of 東京's
    assert done_ids(out) == {"a": "qa", "b": "qb"}
    mend_tail(out)
    assert out.read_text(encoding="utf-8") == "\n".join(rows[:3]) + "\n"
    out.write_text("\n".join(rows))  # whole, its newline lost: kept, and given one
    mend_tail(out)
    assert out.read_text(encoding="utf-8") == "\n".join(rows) + "\n"
    assert compact(out, ["東京", "a"]) == 3
    assert out.read_text(encoding="utf-8").splitlines() == [rows[3], rows[2], rows[1]]


def test_a_run_removes_the_partial_copy_a_killed_rewrite_left(tmp_path):
    """A batch killed (kill -9, a scheduler's grace period spent) while it rewrote its output
    left `.out.jsonl.<pid>.tmp`, a partial copy as large as the output, and every later run
    kept it: a 341 MB output killed so left 52 MB behind, for good. The next run of that
    output (which holds its lock) removes it, and only it."""
    out = tmp_path / "out.jsonl"
    run_batch([("a", "qa")], out, lambda q: {"status": "ok", "evidence": [q]}, concurrency=1)
    torn = tmp_path / ".out.jsonl.4242.tmp"  # as the killed rewrite left it: half a row last
    torn.write_bytes(out.read_bytes() + b'{"id": "b", "stat')
    others = [tmp_path / ".other.jsonl.4242.tmp", tmp_path / ".out.jsonl.notes.tmp",
              tmp_path / "out.jsonl.4242.tmp"]
    for path in others:
        path.write_text("not ours\n")
    counts = run_batch([("a", "qa"), ("b", "qb")], out,
                       lambda q: {"status": "ok", "evidence": [q]}, concurrency=1)
    assert counts["ok"] == 1 and counts["skipped"] == 1
    assert not torn.exists() and all(path.exists() for path in others)
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a", "b"]
