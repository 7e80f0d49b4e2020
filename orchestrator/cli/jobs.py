"""Jobs over many questions: `batch` (resumable), `eval` (a BEIR folder), `loadtest` (its
options, run and print live in `orchestrator/loadtest/command.py`) and `demo` (the main job on
embedded defaults, explained)."""

from __future__ import annotations

import json
import shlex
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer

from branchsearch.infra.config.choices import MODES, POLICIES, SPLITS
from branchsearch.infra.errors import BranchsearchError
from branchsearch.infra.ids import shown_id
from branchsearch.orchestrator.batch import STOP_AFTER
from branchsearch.orchestrator.cli.options import (AclAdminOpt, AclOpt, AddressOpt, ConfigOpt,
                                                   ExecutorOpt, HomeOpt, IndexOpt, JsonOpt,
                                                   caller_acl,
                                                   choice, progress_bar, say, settings_from,
                                                   settings_to_read, writable_file,
                                                   writable_folder, writable_report)
from branchsearch.orchestrator.cli.render import (one_line, print_demo_branches,
                                                  print_demo_evidence, print_evaluation)
from branchsearch.orchestrator.loadtest.command import loadtest


def register(app: typer.Typer) -> None:
    app.command()(batch)
    app.command("eval")(evaluate)
    app.command("loadtest")(loadtest)
    app.command()(demo)


def batch(input: Path = typer.Argument(..., help="JSONL of {id, question}; - reads "
                                       "standard input"),
          output: Path = typer.Option(..., "-o", "--output",
                                      help="results JSONL (one line per id; re-runs resume)"),
          concurrency: Optional[int] = typer.Option(
              None, min=1, help="questions in flight (setting batch_concurrency); on one "
              "machine one process a core answers them, up to this many"),
          branches: Optional[int] = typer.Option(
              None, min=1, help="most branches a question may be planned into (setting "
              "branches; 1: the single-context search)"),
          executor: str = ExecutorOpt, address: Optional[str] = AddressOpt,
          acl: Optional[list[str]] = AclOpt, acl_admin: bool = AclAdminOpt,
          stop_after: int = typer.Option(
              STOP_AFTER, "--stop-after", min=0,
              help="stop starting questions after this many failed in a row (0: never)"),
          home: Optional[Path] = HomeOpt, index: Optional[str] = IndexOpt,
          config: Optional[Path] = ConfigOpt):
    """Many questions, resumable: re-running runs again every id whose latest line is not ok,
    was cut short, or was answered for another question text, another index or before the
    index's documents changed; the output ends with one line per id."""
    from branchsearch.infra.textfile import output_path
    from branchsearch.orchestrator.batch import OutputLock

    output = output_path(output)  # through a link, its target; never a device (/dev/null)
    writable_file(output, "batch output")
    held = OutputLock(output).acquire()  # a second batch on this output stops here
    try:
        _batch(input, output, concurrency, branches, executor, address, acl, acl_admin,
               stop_after, home, index, config)
    finally:
        held.release()


def _batch(input, output, concurrency, branches, executor, address, acl, acl_admin, stop_after,
           home, index, config) -> None:
    from branchsearch.orchestrator.batch import (check_output, differing, made_with,
                                                 read_questions, resume_state, run_batch,
                                                 to_ask)

    check_output(output, input)
    settings, picked = settings_to_read(home, index, config, batch_concurrency=concurrency,
                                        branches=branches, ray_address=address)
    groups = caller_acl(settings, acl, acl_admin)
    data = read_questions(input)
    if not data.items:  # (a plain text file of questions: one line, not one a line)
        why = (f"; {len(data.bad_lines)} malformed line(s), the first {data.bad_lines[0]}"
               if data.bad_lines else "")
        raise BranchsearchError(f"{input}: no questions (one JSON object a line, "
                                '{"id": …, "question": …})' + why)
    from branchsearch.infra.index.profile import index_profile

    profile = index_profile(settings)
    profile.require_searchable()  # an unknown or unusable index: its one line, before any note
    from branchsearch.infra.index.fingerprint import index_version

    version, unseen = index_version(profile, settings)
    gone = _index_gone(settings, profile)  # the index as the batch begins, with its version
    how = ("a write in its Elasticsearch index" if profile.kind == "external" else
           "an ingest, or a write through the service")  # what changes a version
    from branchsearch.orchestrator.execution import pick_executor

    made = made_with(settings, groups)
    state = resume_state(output, settings.index, made, version)
    otherwise, elsewhere, earlier = state.other_made, state.other_index, state.earlier
    todo, changed = to_ask(data.items, state.done)
    asked = {qid for qid, _ in data.items}
    if otherwise:  # one output holds one configuration's evidence (a resume with a flag
        # changed by mistake would otherwise replace finished work, and rows of questions
        # this input does not ask would stay beside the new ones)
        then = next(iter(otherwise.values()))
        differ = [f"{n} {shown(then[n])} there, {shown(made[n])} now"
                  for n in differing(then, made)]
        raise BranchsearchError(
            f"batch output {output} holds {len(otherwise)} ok row(s) made with other settings "
            f"({'; '.join(differ[:3])}{' …' if len(differ) > 3 else ''}); run with those "
            "settings to resume, or give another -o")
    kept = sorted({name for qid, name in elsewhere.items() if qid not in asked})
    if kept:  # rows no question of this input replaces: one output, one index's evidence
        raise BranchsearchError(
            f"batch output {output} holds ok rows answered on another index "
            f"({', '.join(kept[:3])}) for questions this input does not ask; they would stay "
            f"beside {settings.index!r}'s: give another -o")
    if any(qid not in asked for qid in earlier):  # as `kept`: one output, one version's
        raise BranchsearchError(
            f"batch output {output} holds ok rows answered before the documents of "
            f"{settings.index!r} changed ({how}), for "
            "questions this input does not ask; "
            "they would stay beside the new rows: give another -o")
    say(picked)  # the checks passed: the notes, before the work
    for bad in data.bad_lines:
        print(f"skipped {bad}", file=sys.stderr)
    answered = len(data.items) - len(todo)
    unversioned = len(state.unversioned & (asked - {qid for qid, _ in todo}))
    if unseen and answered:  # an external index with no version: say what is not seen
        print(f"resumed: {answered} answered row(s) kept; index {settings.index!r} is external: "
              f"changes to {unseen} since they were answered are not detected — give "
              "another -o (or remove the output) to ask them again", file=sys.stderr)
    elif unversioned and profile.kind == "external":  # rows written before it had a version
        print(f"resumed: {unversioned} answered row(s) kept that carry no index_version "
              f"(written before index {settings.index!r} had one): changes to its cluster "
              "before this run are not detected for them — give another -o (or remove the "
              "output) to ask them again", file=sys.stderr)
    if earlier:  # their evidence quotes the documents as they were: asked again
        print(f"asking again {len(earlier)} question(s) whose ok row was answered before the "
              f"documents of {settings.index!r} changed ({how})", file=sys.stderr)
    if elsewhere:  # their rows hold another index's evidence: asked again on this one
        named = ", ".join(sorted(set(elsewhere.values()))[:3])
        print(f"asking again {len(elsewhere)} question(s) whose ok row was answered on "
              f"another index ({named}), on {settings.index!r}", file=sys.stderr)
    if changed:  # a re-run asks what is left, and what was edited since its row was written
        more = f" and {len(changed) - 10} more" if len(changed) > 10 else ""
        print(f"asking again {len(changed)} question(s) whose text changed since their ok row "
              f"was written: {', '.join(map(shown_id, changed[:10]))}{more}", file=sys.stderr)
    bar, seen = None, {"partial": 0, "failed": 0}

    def tick(status: str) -> None:
        if status in seen:
            seen[status] += 1
        bar.update(1)
        bar.set_postfix(seen)

    stop, counts, first, driver = threading.Event(), None, {}, None
    picked = pick_executor(settings, executor)
    starting = "Ray has started" if picked == "ray" and todo else None
    # a stop from here on, also while workers or a Ray cluster start, writes what ran; it is
    # said at once (a Ray cluster may take many seconds more to start)
    said = {"now": f"stopping once {starting}" if starting else "stopping"}
    try:
        with first_stop_signal_sets(stop, first, said):
            driver, search = _searcher(settings, picked, todo, groups)
            said["now"] = "stopping: the questions under way finish and are written" + (
                " (a signal that reached the Ray cluster too ends them: they run again on the "
                "resume)" if picked == "ray" else "")
            bar = progress_bar(len(todo), "q", "batch")
            counts = run_batch(data.items, output, search, concurrency=settings.batch_concurrency,
                               index=settings.index, on_done=tick, stop_after=stop_after,
                               stop=stop, locked=True, made=made, version=version,
                               index_gone=gone)
    except KeyboardInterrupt:
        if first.get("signal") != "SIGTERM":
            raise  # ^C: `main` says "interrupted", exit status 130
        terminated = True
    else:
        terminated = False
    finally:
        if bar is not None:
            bar.close(done=counts is not None and not counts["not_run"])  # (not: stopped)
        if driver is not None:
            driver.close()
    if terminated:  # a scheduler's stop (or `kill PID`), as ^C: 128 + SIGTERM's number
        print("terminated: the lines written so far stay; the same command resumes",
              file=sys.stderr)
        sys.exit(143)
    print(f"batch: {counts['ok']} ok, {counts['partial']} partial, {counts['failed']} failed; "
          f"{counts['skipped']} already ok in {output}, {len(data.bad_lines)} malformed input "
          "lines skipped")
    if counts["cut_short"]:  # ok, but not the whole search: not done
        print(f"{counts['cut_short']} ok row(s) were cut short: a later wave (forks, chains, "
              "bridges) had no time left to start within branch_timeout_s "
              f"({settings.branch_timeout_s:g} s); a re-run asks them again (give it more time "
              "to search them whole)",
              file=sys.stderr)
    if counts["question_cut"]:
        cap = settings.query_max_tokens
        print(f"{counts['question_cut']} question(s) were longer than query_max_tokens ({cap}) "
              f"and were searched by their first {cap} tokens (their rows' notes say so); raise "
              "query_max_tokens to search them whole", file=sys.stderr)
    if counts["failed_ids"]:
        ids = counts["failed_ids"]
        more = f" and {len(ids) - 10} more" if len(ids) > 10 else ""
        print(f"failed: {', '.join(map(shown_id, ids[:10]))}{more} (each row's error is in "
              f"{output}; run the same command again to retry them)", file=sys.stderr)
    if counts["lost"]:  # the rows written stay; nothing more can run on that cluster
        raise BranchsearchError(
            f"{counts['lost']}; {counts['not_run']} question(s) not run, the rows written so "
            f"far stay in {output}; start the cluster again (or give another with --address) "
            "and run the same command: it resumes")
    if counts["gone"]:  # the rows written are the index's as it began; none after
        raise BranchsearchError(
            f"{counts['gone']}; {counts['not_run']} question(s) not run, the rows answered "
            f"before stay in {output}; run the same command once the index is there again: "
            "it asks the rest, and again those answered on another version")
    if counts["stopped"]:
        print(f"batch stopped: {counts['stopped']}; {counts['not_run']} questions not run. "
              "Fix the cause and run the same command again: it resumes", file=sys.stderr)
    if counts["failed"] or counts["not_run"] or data.bad_lines:  # nobody answered these
        sys.exit(1)


def _index_gone(settings, profile):
    """`index_gone` for `run_batch`: why the index is no longer the one the batch began with
    (removed, being ingested again, or made anew: `manifest.changed_since`), or ""; None for
    an external index (its cluster's own, not ours to watch). Taken before the searcher
    starts, next to the version the rows carry. Documents changed in place by the service
    (upserts, deletes) do not stop a batch: its rows carry the version it began with, so a
    resume asks them again; an `ingest` does (the index is incomplete while it runs)."""
    if profile.kind == "external":
        return None
    from branchsearch.infra.index.manifest import changed_since, hold, identity

    hold(settings.index_dir)  # open until the batch's process ends: its inode is not reused
    opened = identity(settings.index_dir)
    return lambda: changed_since(settings.index_dir, settings.index, opened)


def _searcher(settings, picked: str, todo: list, groups):
    """(what to close, `search(question) -> row`) for a batch's questions: worker processes
    on one machine, else the driver on `picked`; none when every id is answered."""
    from branchsearch.orchestrator.driver import open_driver
    from branchsearch.orchestrator.execution.processes import QuestionProcesses, worker_count

    if not todo:  # every id ok already: the output is rewritten; no driver, no worker starts
        def search(question: str) -> dict:  # another batch wrote the output since it was read
            raise BranchsearchError("the output changed as this batch started; run it again")

        return None, search
    if picked == "local" and settings.batch_concurrency > 1:  # past the GIL: processes
        workers = worker_count(min(settings.batch_concurrency, len(todo)))  # none idle
        driver = QuestionProcesses(settings, workers, groups)
        return driver, driver.search
    driver = open_driver(settings, picked)
    return driver, (lambda q: driver.search(q, acl_groups=groups).to_dict())


def shown(value) -> str:
    """A setting's value as a person writes it: none, true, a, b (a list), text unquoted."""
    if value is None:
        return "none"
    if isinstance(value, bool):  # as a flag or a settings file writes it
        return "true" if value else "false"
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(map(shown, value)) if isinstance(value, (set, frozenset)) else \
            [shown(v) for v in value]
        return ", ".join(items) or "none"
    return str(value)


@contextmanager
def first_stop_signal_sets(stop: threading.Event, first: dict, said: dict | None = None):
    """Meanwhile, a ^C (SIGINT) or a SIGTERM (a job scheduler's stop, `kill PID`) sets `stop`
    (the batch starts nothing more, writes the rows of the questions running, then stops with
    KeyboardInterrupt), and `first["signal"]` says which came first; a second one interrupts
    at once. A flag, not an exception raised wherever the main thread happens to be: one
    raised inside a finalizer is printed and dropped, and the batch would run on to its end.
    A signal the parent made this process ignore (^C for a background job) stays ignored.
    With `said`, the first signal is answered at once by one stderr line: `said["now"]` (what
    the stop waits for, as the caller last set it) and how to stop at once. It is written to
    the stderr of the start, not to fd 2, which Ray's start holds in a file until it is done
    (`infra.raycluster`), and with one `os.write`, which a handler may do whatever the main
    thread was writing."""
    import os
    import signal

    def handle(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        name = signal.Signals(signum).name
        first.setdefault("signal", name)
        stop.set()
        if said is not None and err is not None:
            again = "^C again" if name == "SIGINT" else f"a second {name}"
            line = f"{said['now']}; {again} to stop at once\n"
            try:  # on a terminal, below what the bar (or the ^C echo) left on its line
                os.write(err, (("\n" if os.isatty(err) else "") + line).encode())
            except OSError:
                pass

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    err = os.dup(2) if said is not None else None
    old = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)
           if signal.getsignal(sig) is not signal.SIG_IGN}
    for sig in old:
        signal.signal(sig, handle)
    try:
        yield
    finally:
        for sig, was in old.items():
            signal.signal(sig, was if was is not None else signal.SIG_DFL)
        if err is not None:
            os.close(err)


def evaluate(dataset: Path = typer.Argument(..., help="BEIR folder"),
             mode: str = typer.Option("hybrid", help=f"{' | '.join(MODES)} (single-shot, when "
                                                     "no --policy)"),
             policy: Optional[str] = typer.Option(
                 None, callback=choice(*POLICIES), help="evaluate the branch agent with this "
                 f"policy ({' | '.join(POLICIES)})"),
             baseline: Optional[str] = typer.Option(
                 None, help=f"also run a baseline: {' | '.join(MODES)} (single-shot), no-prune "
                            "(the same agent without pruning), heuristic (the heuristic policy), "
                            "one-branch (the same agent with one branch)"),
             compare: bool = typer.Option(False, "--compare", help="paired comparison of the "
                                          "agent against the baseline (default hybrid)"),
             prune: bool = typer.Option(True, "--prune/--no-prune", help="agent may prune"),
             branches: Optional[int] = typer.Option(
                 None, min=1, help="most branches a question may be planned into (setting "
                 "branches, default 3; 1: the single-context search)"),
             executor: str = ExecutorOpt,
             limit: Optional[int] = typer.Option(None, min=1, help="the first N questions only"),
             split: str = typer.Option("test", callback=choice(*SPLITS),
                                       help=f"qrels split: qrels/{{{','.join(SPLITS)}}}.tsv"),
             acl: Optional[list[str]] = AclOpt, acl_admin: bool = AclAdminOpt,
             report: Optional[Path] = typer.Option(None, help="JSON report (+ .md beside it)"),
             plots: Optional[Path] = typer.Option(None, help="write PNG plots to this folder"),
             home: Optional[Path] = HomeOpt,
             index: Optional[str] = typer.Option(
                 None, "--index", help="index name (default: the dataset folder's name)"),
             config: Optional[Path] = ConfigOpt, ingest_first: bool = typer.Option(
                 True, "--ingest/--no-ingest", help="ingest the corpus if the index is missing"),
             as_json: bool = JsonOpt):
    """Evaluate single-shot retrieval or the branch agent on a BEIR folder."""
    from branchsearch.infra.textfile import output_path
    from branchsearch.orchestrator.evaluation.run import EvalOptions, dataset_index, run_evaluation

    if report is not None:  # before the run: a report that cannot be written is said first
        writable_report(output_path(report), "report")
    if plots is not None:
        writable_folder(plots, "--plots")
    options = EvalOptions(dataset, mode=mode, policy=policy, baseline=baseline, compare=compare,
                          executor=executor, limit=limit, split=split, ingest_first=ingest_first,
                          report=report, plots=plots)
    settings = settings_from(home, index or dataset_index(dataset), config, prune=prune,
                         policy=policy, branches=branches)
    from branchsearch.infra.config.settings import Settings

    # a second wave the user asked for (not the default's), silently off under one branch
    second = [f"{name} = {getattr(settings, name)}" for name in ("forks", "chains", "bridges")
              if getattr(settings, name) and getattr(settings, name) != getattr(Settings(), name)]
    if second and settings.branches == 1 and policy is not None:
        print(f"note: {', '.join(second)} in the settings, but one branch never has a second "
              "wave: give --branches 2 or more to measure it", file=sys.stderr)
    result = run_evaluation(settings, options, acl_groups=caller_acl(settings, acl, acl_admin),
                            progress=progress_bar, say=lambda line: print(line, file=sys.stderr))
    if as_json:
        print(json.dumps(_eval_brief(result), default=str))
    else:
        print_evaluation(result)
        if report is not None:  # as `loadtest` says where its own went
            where = output_path(report)
            print(f"report: {where} and {where.with_suffix('.md')}")
        if plots is not None:
            print(f"plots: {', '.join(result.get('plots') or []) or plots}")


def _eval_brief(result: dict) -> dict:
    """The report without its per-query rows (what `eval --json` prints)."""
    brief = lambda d: {k: v for k, v in d.items() if k != "per_query"}  # noqa: E731
    return ({k: v for k, v in result.items() if k not in ("runs", "comparisons")}
            | {"runs": [brief(r) for r in result["runs"]],
               "comparisons": [brief(c) for c in result.get("comparisons", [])]})


def demo(home: Optional[Path] = HomeOpt,
         branches: int = typer.Option(3, min=1, help="most branches the question may be "
                                     "planned into"),
         executor: str = ExecutorOpt):
    """The main job on embedded defaults: build a small synthetic corpus, ingest it, run one
    multi-hop question through parallel branches and explain what each branch did."""
    from branchsearch.infra.datasets.beir import read_queries
    from branchsearch.infra.ingest.pipeline import ingest as run_ingest
    from branchsearch.infra.datasets.synth import synth as make
    from branchsearch.orchestrator.driver import open_driver
    from branchsearch.orchestrator.evaluation.run import index_complete
    from branchsearch.orchestrator.execution import pick_executor

    settings = settings_from(home, "demo", None, branches=branches)
    corpus = Path(settings.home) / "demo-corpus"
    if not index_complete(settings):  # missing, or a stopped ingest: (re)build and resume
        make(corpus, docs=240, tasks=12, seed=11)
        print(f"1. wrote a synthetic corpus to {corpus} (240 documents, 12 multi-hop tasks)")
        bar = progress_bar(240, "doc", "2. ingest (chunk, embed, index)")
        report = run_ingest(corpus, settings, progress=lambda d, c: bar.update(d))
        bar.close()
        print(f"2. ingested {report.chunks} chunks into Milvus Lite + tantivy under "
              f"{settings.index_dir}")
    else:
        print(f"1-2. reusing the demo index under {settings.index_dir}")
    task = read_queries(corpus)[1]  # a multi-hop question and its gold documents
    print(f"3. question ({task.meta['hops']} hops): {one_line(task.text)}")
    driver = open_driver(settings, pick_executor(settings, executor))
    try:
        result = driver.search(task.text)
    finally:
        driver.close()
    print_demo_branches(result)
    print_demo_evidence(result, task)
    where = f" --home {shlex.quote(str(settings.home))}" if home is not None else ""
    print(f"next: your own question on this index: branchsearch search \"QUESTION\" --index "
          f"demo{where}; over HTTP: branchsearch serve --index demo{where} (README: the tour)")
