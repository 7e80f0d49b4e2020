"""The commands as a person types them: on a terminal, where long work shows a tqdm bar rather
than the plain lines a pipe gets (the rest of the suite runs the CLI on pipes), and fed by a
pipe."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shlex
import subprocess
import sys
import time
from pathlib import Path

CLI = [sys.executable, "-m", "branchsearch.orchestrator.cli"]
HOTPOT = Path(__file__).parents[1] / "fixtures" / "hotpot-mini"


def on_terminal(args, timeout: float = 300) -> tuple[int, str]:
    """Run the CLI with a pseudo-terminal 120 columns wide as stdin, stdout and stderr; (exit
    status, what the terminal showed)."""
    import fcntl
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen([*CLI, *map(str, args)], stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    shown, end, quiet_since = [], time.monotonic() + timeout, None
    try:
        while time.monotonic() < end:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # every holder of the terminal has closed it
                    break
                if not data:
                    break
                shown.append(data)
                quiet_since = None
            elif proc.poll() is not None:  # exited; what it left may still be in transit
                quiet_since = quiet_since or time.monotonic()
                if time.monotonic() - quiet_since > 1.0:
                    break
        else:
            proc.kill()
            raise AssertionError(f"{args[0]} ran past {timeout} s")
        return proc.wait(30), b"".join(shown).decode("utf-8", "replace")
    finally:
        os.close(master)


def test_progress_shows_on_a_terminal_that_gives_no_width(monkeypatch):
    """A pseudo-terminal given no size (`script`, a CI runner's, `pty.openpty`: 0 columns)
    showed nothing of a long run's progress (tqdm draws no bar 0 columns wide); it gets the
    plain lines a pipe gets."""
    from branchsearch.orchestrator.cli.options import progress_bar

    master, slave = pty.openpty()
    assert os.get_terminal_size(slave).columns == 0
    shown = b""
    try:
        with os.fdopen(slave, "w") as terminal:
            monkeypatch.setattr(sys, "stderr", terminal)
            bar = progress_bar(3, "q", "batch")
            bar.update(3)
            bar.close()
            terminal.flush()
            while select.select([master], [], [], 0.5)[0]:
                shown += os.read(master, 65536)
    finally:
        os.close(master)
    assert b"batch: 3/3 q, " in shown and shown.rstrip().endswith(b", done"), shown


def test_ingest_batch_and_eval_end_cleanly_on_a_terminal(hotpot_settings, tmp_path):
    home, index = hotpot_settings.home, "on-a-terminal"  # the home's embedding cache is warm
    rc, shown = on_terminal(["ingest", HOTPOT, "--home", home, "--index", index])
    assert rc == 0 and "Traceback" not in shown, shown[-2000:]
    assert "ingested 74 documents" in shown
    rc, shown = on_terminal(["ingest", HOTPOT, "--home", home, "--index", index])  # again
    assert rc == 0 and "already held every document, unchanged" in shown, shown[-2000:]

    questions = tmp_path / "q.jsonl"
    with open(HOTPOT / "queries.jsonl", encoding="utf-8") as f:
        questions.write_text("".join(list(f)[:4]), encoding="utf-8")
    out = tmp_path / "out.jsonl"
    rc, shown = on_terminal(["batch", questions, "-o", out, "--home", home, "--index", index])
    assert rc == 0 and "Traceback" not in shown, shown[-2000:]
    assert "batch: 100%|" in shown and "4/4" in shown, shown[-2000:]  # tqdm's bar
    assert "batch: 4 ok, 0 partial, 0 failed" in shown  # the summary after the bar
    assert [json.loads(line)["status"] for line in out.read_text().splitlines()] == ["ok"] * 4

    rc, shown = on_terminal(["eval", HOTPOT, "--home", home, "--index", index, "--no-ingest",
                             "--mode", "bm25"])
    assert rc == 0 and "Traceback" not in shown, shown[-2000:]
    assert "all_recall@5" in shown or "AR@5" in shown, shown[-2000:]


def test_the_readmes_first_command_on_a_terminal(tmp_path):
    """`branchsearch demo`, as a newcomer first runs it: our own lines, no library noise."""
    rc, shown = on_terminal(["demo", "--home", tmp_path / "home"])
    assert rc == 0 and "Traceback" not in shown, shown[-2000:]
    lines = [line.strip() for line in shown.replace("\r", "\n").splitlines() if line.strip()]
    assert any(line.startswith("3. question") for line in lines), lines
    noise = [line for line in lines if any(w in line for w in ("Warning", "WARNING", "warn("))]
    assert not noise, noise
    # its last line says what to run next on the index it made, and that command runs
    assert lines[-1].startswith("next: "), lines[-3:]
    told = re.search(r"(branchsearch search .*?);", lines[-1]).group(1)
    args = shlex.split(told.replace("QUESTION", "Who chaired the review of the contract?"))
    done = subprocess.run([*CLI, *args[1:]], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "status: ok" in done.stdout, done.stderr[-2000:]


def test_batch_reads_its_questions_from_a_pipe(hotpot_settings, tmp_path):
    """`... | branchsearch batch - -o out.jsonl`: `-` is standard input; a malformed line is
    named as `<stdin>:N`."""
    from conftest import ingest_copy

    settings = ingest_copy(hotpot_settings, "from-a-pipe")  # its Milvus Lite file the batch's own
    lines = (HOTPOT / "queries.jsonl").read_text(encoding="utf-8").splitlines()[:2]
    out = tmp_path / "out.jsonl"
    done = subprocess.run([*CLI, "batch", "-", "-o", out, "--home", settings.home,
                           "--index", settings.index],
                          input="\n".join([*lines, "{not json"]) + "\n", capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]  # a malformed line: exit 1, as from a file
    assert "skipped <stdin>:3: not JSON" in done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [json.loads(line)["_id"] for line in lines]
    assert all(r["status"] == "ok" for r in rows)


def test_progress_lines_on_a_pipe_say_how_long_is_left():
    """A batch of thousands of questions runs under nohup or a scheduler, its progress a log
    of plain lines: on a terminal the bar shows an ETA, but the lines said only the count, the
    rate and the seconds so far (hostile pass: 3,000 questions, 80 lines without one). Each
    line but the last now says about how long is left at the rate so far."""
    import io

    from branchsearch.orchestrator.cli.options import ProgressLines

    stream = io.StringIO()
    bar = ProgressLines(3000, "q", "batch", every=60, stream=stream)
    bar._start -= 100  # 700 questions in 100 s: 2,300 left at 7 a second
    bar.update(700)
    bar._say()
    bar._start -= 3000
    bar._say()  # 700 in 3,100 s: 2,300 left take 2 h 50 min
    bar.update(2300)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "batch: 700/3000 q, 7.0 q/s, 100 s, about 5 min left", lines
    assert lines[1] == "batch: 700/3000 q, 0.2 q/s, 3100 s, about 2 h 50 min left", lines
    assert lines[2] == "batch: 3000/3000 q, 1.0 q/s, 3100 s, done", lines


def test_progress_lines_reckon_the_time_left_without_the_start_up():
    """A batch that spends a minute starting (a model load, a Ray cluster) and then answers a
    question a second has 89 of 100 left after 11: about a minute and a half, not the nine
    minutes the whole run's rate (11 in 70 s) would say. The line's rate stays the run's."""
    import io

    from branchsearch.orchestrator.cli.options import ProgressLines

    stream = io.StringIO()
    bar = ProgressLines(100, "q", "batch", every=60, stream=stream)
    bar._start -= 70  # started 70 s ago; the first answer came 10 s ago
    bar.update(1)
    bar._first = (bar._first[0] - 10, 1)
    bar.update(10)
    bar._say()
    bar.close(done=False)
    line = stream.getvalue().splitlines()[0]
    assert line == "batch: 11/100 q, 0.2 q/s, 70 s, about 1 min left", line


def test_control_characters_in_documents_show_as_escapes_not_as_what_they_do(tmp_path):
    """A document whose title and text hold an escape sequence that clears the screen and
    turns it red, a bell, a backspace, a carriage return and a form feed (as PDF extraction
    leaves them): `retrieve` and `search` on a terminal show each as its escape (`\\x1b[2J`)
    and the terminal receives none of them; a line break or a page break in a one-line
    snippet is a space. `--json` keeps the text exactly. An error line and a skipped file's
    line naming a file of a corpus folder show its name's control characters alike."""
    hostile = "\x1b[2J\x1b[31mHACKED"
    title = f"Falcon {hostile}\x07"
    docs = [{"_id": "falcon", "title": title,
             "text": f"Falcon plan {hostile} bell\x07 back\x08space\r\nnew page\x0cend"},
            {"_id": "osprey", "title": "Osprey", "text": "Osprey plan, the rival of Falcon."}]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    home = ["--home", tmp_path / "home"]
    rc, shown = on_terminal(["ingest", corpus, "--no-dense", *home])
    assert rc == 0, shown[-2000:]
    drives = set("\x1b\x07\x08\x0c\x9b")  # what moves, clears, colours or rings a terminal
    for args in (["retrieve", "Falcon plan", "--mode", "bm25"],
                 ["search", "Falcon plan", "--branches", "2"]):
        rc, shown = on_terminal([*args, *home])
        assert rc == 0 and "Traceback" not in shown, shown[-2000:]
        assert not drives & set(shown), (args[0], shown[-2000:])
        assert r"Falcon \x1b[2J\x1b[31mHACKED\x07" in shown, (args[0], shown[-2000:])
        assert r"HACKED bell\x07 back\x08space new page end" in shown, (args[0], shown[-2000:])

    def cli(*args):
        return subprocess.run([*CLI, *map(str, args), *home], capture_output=True, text=True,
                              timeout=300)

    piped = cli("retrieve", "Falcon plan", "--mode", "bm25")
    assert piped.returncode == 0 and not (drives | {"\r"}) & set(piped.stdout), piped.stdout
    raw = cli("retrieve", "Falcon plan", "--mode", "bm25", "--json")
    assert raw.returncode == 0 and not drives & set(raw.stdout)  # JSON escapes them itself
    assert {h["title"] for h in json.loads(raw.stdout)} == {title, "Osprey"}
    raw = cli("search", "Falcon plan", "--branches", "2", "--json")
    assert raw.returncode == 0 and not drives & set(raw.stdout)
    evidence = json.loads(raw.stdout)["evidence"]
    assert {d["title"] for d in evidence} == {title, "Osprey"}
    assert docs[0]["text"] in [c["text"] for d in evidence for c in d["chunks"]]

    folder = tmp_path / "notes"  # a folder of .txt files: each file's name makes its id
    folder.mkdir()
    (folder / "\x1b[31m.txt").write_text("\n")  # nothing to search: skipped, with a line
    (folder / "plan.txt").write_text("The Falcon plan.\n")
    done = cli("ingest", folder, "--no-dense", "--index", "notes")
    assert done.returncode == 0, done.stderr[-2000:]
    assert not drives & set(done.stderr) and r"\x1b[31m.txt: nothing to search" in done.stderr
    (folder / f"memo{hostile}.txt").write_text("A memo.\n")  # an id output cannot show
    done = cli("ingest", folder, "--no-dense", "--index", "notes")
    assert done.returncode == 2 and not drives & set(done.stderr), done.stderr
    error = done.stderr.splitlines()[-1]
    assert error.startswith(f"error: {folder}/memo\\x1b[2J\\x1b[31mHACKED.txt: document id "
                            "'memo\\x1b[2J\\x1b[31mHACKED' holds the control character "
                            "U+001B"), done.stderr
