"""`branchsearch` command line. It only parses, merges settings, builds and runs."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Optional

import typer

from branchsearch.infra.backends import MAX_K
from branchsearch.infra.choices import EXECUTORS, MODES, POLICIES, SPLITS
from branchsearch.infra.errors import BadQuery, BranchsearchError, redact
from branchsearch.infra.settings import Settings, load_settings
from branchsearch.infra.synth import MAX_DOCS
from branchsearch.orchestrator.batch import STOP_AFTER
from branchsearch.orchestrator.terminal import one_line

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Parallel-branch evidence search over Milvus + BM25 (see README).")

HomeOpt = typer.Option(None, "--home", help="data home (default ./.branchsearch)")
IndexOpt = typer.Option(None, "--index", help="index name (default 'default')")
ConfigOpt = typer.Option(None, "--config", help="settings TOML file")


def _choice(*allowed: str):
    def check(value):
        if value is not None and value not in allowed:
            raise typer.BadParameter(f"{value!r} is not one of {', '.join(allowed)}")
        return value
    return check


ExecutorOpt = typer.Option("ray", "--executor", callback=_choice(*EXECUTORS),
                           help="ray (actors) | local (in-process); one branch runs in-process "
                                "unless a Ray address is set")
PolicyOpt = typer.Option(None, "--policy", callback=_choice(*POLICIES),
                         help=" | ".join(POLICIES))
AclOpt = typer.Option(None, "--acl", help="a group the caller holds (repeat for several); "
                                          "without --acl: public documents only")
AclAdminOpt = typer.Option(False, "--acl-admin", help="see every document, restricted or not "
                                                      "(also: acl_admin = true in settings)")
KOpt = typer.Option(10, "--k", min=1, max=MAX_K, help=f"hits to return (1..{MAX_K})")
AddressOpt = typer.Option(None, "--address", help="Ray cluster address (default RAY_ADDRESS, "
                                                   "else a local cluster)")


def _settings(home, index, config, **flags) -> Settings:
    return load_settings(config, {"home": home, "index": index, **flags})


def _acl(settings: Settings, groups: list[str] | None, admin: bool) -> list[str] | None:
    """The caller's `acl_groups`: None (public only), its groups, or ACL_ALL for an admin."""
    from branchsearch.infra.backends import caller_groups

    return caller_groups(groups, admin or settings.acl_admin)


def _writable_file(path: Path, what: str) -> None:
    """Stop with one line when `path` cannot be written as a file (a folder, no permission)."""
    import os

    if path.is_dir():
        raise BranchsearchError(f"{what} {path} is a folder: give a file name")
    folder = path.parent if str(path.parent) else Path(".")
    while not folder.exists() and folder != folder.parent:  # created on write
        folder = folder.parent
    if not folder.is_dir():
        raise BranchsearchError(f"{what} {path}: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists()
                                                     and not os.access(path, os.W_OK)):
        raise BranchsearchError(f"{what} {path}: no permission to write there")


def _question(text: str, what: str = "question") -> str:
    from branchsearch.workers.tools import has_words

    if not text.strip():
        raise BadQuery(f"empty {what}: give the words to search for")
    if not has_words(text):
        raise BadQuery(f"{what} has no words to search for (only punctuation or symbols)")
    return text


def _progress(total: int | None, unit: str, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, desc=desc, file=sys.stderr, dynamic_ncols=True,
                disable=None)


@app.command()
def ingest(path: Path = typer.Argument(..., help="BEIR folder, JSONL file or folder of .txt/.md"),
           home: Optional[Path] = HomeOpt, index: Optional[str] = IndexOpt,
           config: Optional[Path] = ConfigOpt,
           dense: bool = typer.Option(True, help="embed and index vectors (--no-dense: BM25 only)"),
           workers: int = typer.Option(1, min=1, max=256, help="embed on a Ray Data actor pool "
                                       "of N workers (GPUs when the cluster has them)"),
           embed_batch: Optional[int] = typer.Option(None, min=1, max=4096,
                                                     help="texts per model call (--workers)"),
           address: Optional[str] = AddressOpt,
           as_json: bool = typer.Option(False, "--json")):
    """Chunk, embed and index a corpus; re-running resumes a stopped ingest (re-ingesting a
    changed document replaces its chunks)."""
    from branchsearch.infra.ingest import ingest as run_ingest

    settings = _settings(home, index, config, ray_address=address)
    bar = _progress(None, "doc", f"ingest {settings.index}")
    chunks = 0

    def tick(docs: int, new_chunks: int) -> None:
        nonlocal chunks
        chunks += new_chunks
        bar.update(docs)
        rate = chunks / max(bar.format_dict["elapsed"], 1e-9)
        bar.set_postfix(chunks=chunks, chunks_per_s=f"{rate:.0f}")

    report = run_ingest(path, settings, dense=dense, progress=tick, workers=workers,
                        embed_batch=embed_batch)
    bar.close()
    if report.stale_lock:
        print(f"resumed the ingest that stopped unfinished ({report.stale_lock})", file=sys.stderr)
    if as_json:
        print(json.dumps(report.to_dict()))
    else:
        s, rate = report.seconds, report.chunks_per_s
        rate = f"{rate:.0f}" if rate >= 10 else f"{rate:.2g}"  # a tiny corpus: not "0"
        print(f"ingested {report.documents} documents, {report.chunks} chunks into "
              f"{settings.index!r} ({settings.index_dir}); {report.resumed} documents were "
              f"already committed; {rate} chunks/s with {workers} "
              f"worker(s), embedding {s.get('embed', 0):.1f} s")


@app.command()
def retrieve(query: str, mode: str = typer.Option("hybrid", callback=_choice(*MODES),
                                                 help=" | ".join(MODES)),
             k: int = KOpt, home: Optional[Path] = HomeOpt,
             index: Optional[str] = IndexOpt, config: Optional[Path] = ConfigOpt,
             acl: Optional[list[str]] = AclOpt, acl_admin: bool = AclAdminOpt,
             as_json: bool = typer.Option(False, "--json")):
    """Single-shot retrieval (no agent)."""
    from branchsearch.infra.retriever import one_side, open_retriever

    _question(query, "query")
    settings = _settings(home, index, config)
    groups = _acl(settings, acl, acl_admin)
    retriever = open_retriever(settings, need_dense=mode != "bm25")
    side = one_side(settings) if mode == "hybrid" else ""
    if side:  # the results would say `source: bm25` and nothing else: say why, once
        why = ("its config maps no " + ("dense" if side == "bm25" else "lexical") + " store"
               if settings.external is not None else "ingested --no-dense")
        print(f"note: index {settings.index!r} has only its {side} side ({why}): this hybrid "
              f"search is a {side} search", file=sys.stderr)
    hits = retriever.search(query, mode=mode, k=k, acl_groups=groups)
    if as_json:
        print(json.dumps([h.to_dict() for h in hits]))
        return
    if not hits:
        print(f"no hits ({mode} search of index {settings.index!r})")
    for h in hits:
        print(f"{h.rank:>3}. {one_line(h.chunk_id)}  {h.score:.4f}  {one_line(h.title)}\n"
              f"     {one_line(h.text, 160)}")


@app.command("eval")
def evaluate(dataset: Path = typer.Argument(..., help="BEIR folder"),
             mode: str = typer.Option("hybrid", help=f"{' | '.join(MODES)} (single-shot, when "
                                                     "no --policy)"),
             policy: Optional[str] = typer.Option(
                 None, callback=_choice(*POLICIES), help="evaluate the branch agent with this "
                 f"policy ({' | '.join(POLICIES)})"),
             baseline: Optional[str] = typer.Option(
                 None, help=f"also run a baseline: {' | '.join(MODES)} (single-shot), no-prune "
                            "(the same agent without pruning), heuristic (the heuristic policy)"),
             compare: bool = typer.Option(False, "--compare", help="paired comparison of the "
                                          "agent against the baseline (default hybrid)"),
             prune: bool = typer.Option(True, "--prune/--no-prune", help="agent may prune"),
             branches: int = typer.Option(1, min=1, help="branches per question (agent)"),
             executor: str = ExecutorOpt,
             limit: Optional[int] = typer.Option(None, min=1),
             split: str = typer.Option("test", callback=_choice(*SPLITS),
                                       help=f"qrels split: qrels/{{{','.join(SPLITS)}}}.tsv"),
             acl: Optional[list[str]] = AclOpt, acl_admin: bool = AclAdminOpt,
             report: Optional[Path] = typer.Option(None, help="JSON report (+ .md beside it)"),
             plots: Optional[Path] = typer.Option(None, help="write PNG plots to this folder"),
             home: Optional[Path] = HomeOpt, index: Optional[str] = IndexOpt,
             config: Optional[Path] = ConfigOpt, ingest_first: bool = typer.Option(
                 True, "--ingest/--no-ingest", help="ingest the corpus if the index is missing"),
             as_json: bool = typer.Option(False, "--json")):
    """Evaluate single-shot retrieval or the branch agent on a BEIR folder."""
    from branchsearch.orchestrator.evaluate import EvalOptions, dataset_index, run_evaluation

    options = EvalOptions(dataset, mode=mode, policy=policy, baseline=baseline, compare=compare,
                          executor=executor, limit=limit, split=split, ingest_first=ingest_first,
                          report=report, plots=plots)
    settings = _settings(home, index or dataset_index(dataset), config, prune=prune,
                         policy=policy, branches=branches)
    result = run_evaluation(settings, options, acl_groups=_acl(settings, acl, acl_admin),
                            progress=_progress, say=lambda line: print(line, file=sys.stderr))
    if as_json:
        print(json.dumps(_eval_brief(result), default=str))
    else:
        print_evaluation(result)


def _eval_brief(result: dict) -> dict:
    """The report without its per-query rows (what `eval --json` prints)."""
    brief = lambda d: {k: v for k, v in d.items() if k != "per_query"}  # noqa: E731
    return ({k: v for k, v in result.items() if k not in ("runs", "comparisons")}
            | {"runs": [brief(r) for r in result["runs"]],
               "comparisons": [brief(c) for c in result.get("comparisons", [])]})


def print_evaluation(result: dict) -> None:
    """The report as a table: one column per run, then attribution and comparisons."""
    from branchsearch.orchestrator.report import SUMMARY_METRICS

    runs = result["runs"]
    print(f"{Path(result['dataset']).name} ({result['split']}): {runs[0]['queries']} queries")
    names = [m for m in SUMMARY_METRICS if any(m in r["metrics"] for r in runs)]
    print("  " + "metric".ljust(22) + "".join(r["config"][:22].rjust(24) for r in runs))
    for m in names:
        print("  " + m.ljust(22) + "".join(
            (f"{r['metrics'][m]:.4g}" if m in r["metrics"] else "-").rjust(24) for r in runs))
    if "attribution" in runs[0]:
        print("  attribution: " + ", ".join(f"{k} {v}" for k, v in
                                             runs[0]["attribution"].items()))
    for c in result.get("comparisons", []):
        print(f"  paired vs {c['baseline']} on {c['measure']}: {c['wins']} wins, "
              f"{c['losses']} losses, {c['ties']} ties")


@app.command()
def search(question: str, branches: Optional[int] = typer.Option(None, min=1,
                                                                  help="at most N branches"),
           policy: Optional[str] = PolicyOpt,
           trace: Optional[Path] = typer.Option(
               None, help="append spans (JSONL) here; episode traces go to *.episodes.jsonl"),
           executor: str = ExecutorOpt, address: Optional[str] = AddressOpt,
           acl: Optional[list[str]] = AclOpt, acl_admin: bool = AclAdminOpt,
           home: Optional[Path] = HomeOpt, index: Optional[str] = IndexOpt,
           config: Optional[Path] = ConfigOpt, as_json: bool = typer.Option(False, "--json")):
    """Search with parallel branch agents; prints the fused evidence."""
    from branchsearch.orchestrator.driver import open_driver
    from branchsearch.orchestrator.executors import pick_executor

    _question(question)
    flags = {"branches": branches, "policy": policy, "ray_address": address}
    if trace:
        flags |= {"trace_exporter": "jsonl", "trace_file": str(trace)}
    settings = _settings(home, index, config, **flags)
    groups = _acl(settings, acl, acl_admin)
    driver = open_driver(settings, pick_executor(settings, executor))
    try:
        result = driver.search(question, acl_groups=groups)
    finally:
        driver.close()
    if trace:  # the branches' episode traces (the fourth store) beside the spans
        episodes = trace.with_name(trace.stem + ".episodes.jsonl")
        episodes.write_text("".join(json.dumps({"branch": b.index, **r}, default=str) + "\n"
                                    for b in result.branches for r in b.trace))
        print(f"spans: {trace}; episode traces: {episodes}", file=sys.stderr)
    if as_json:
        print(json.dumps(result.to_dict(), default=str))
    else:
        print_result(result)
    if result.status == "failed":  # no branch finished: the evidence is not an answer
        raise typer.Exit(1)


def print_result(result) -> None:
    """The result for a terminal: every text from the corpus or the caller goes through
    `terminal.one_line` (no escape sequence reaches the terminal)."""
    question = one_line(result.question)
    print(f"question: {question[:300]}{' …' if len(question) > 300 else ''}\n"
          f"status: {result.status}\ntrace_id: {result.trace_id}")
    for note in getattr(result, "notes", None) or []:
        print(f"note: {one_line(note)}")
    for b in result.branches:
        extra = (f"{b.termination}, {b.turns} turns, {b.tool_calls} calls, "
                 f"{b.context_tokens_final} ctx tokens, pruned {len(b.pruned_ids)}"
                 if b.status == "ok" else b.error)
        print(f"  branch {b.index} [{b.status}] w={b.weight:g} {b.subquery!r}: {one_line(extra)}")
    print("evidence:")
    for doc in result.evidence:
        by = ", ".join(f"b{f['branch']}#{f['rank']}" for f in doc["found_by"])
        print(f"  {doc['score']:.4f}  {one_line(doc['doc_id'])}  ({one_line(doc['title'])})  "
              f"[{by}]")
        for c in doc["chunks"]:
            found = ", ".join(f"b{f['branch']}#{f['rank']}" for f in c["found_by"])
            print(f"      {one_line(c['chunk_id'])}  found by {found}: {one_line(c['text'], 110)}")


@app.command()
def batch(input: Path = typer.Argument(..., help="JSONL of {id, question}"),
          output: Path = typer.Option(..., "-o", "--output", help="results JSONL (one line per id; re-runs resume)"),
          concurrency: Optional[int] = typer.Option(None, min=1),
          branches: Optional[int] = typer.Option(None, min=1),
          executor: str = ExecutorOpt, address: Optional[str] = AddressOpt,
          acl: Optional[list[str]] = AclOpt, acl_admin: bool = AclAdminOpt,
          stop_after: int = typer.Option(
              STOP_AFTER, "--stop-after", min=0,
              help="stop starting questions after this many failed in a row (0: never)"),
          home: Optional[Path] = HomeOpt, index: Optional[str] = IndexOpt,
          config: Optional[Path] = ConfigOpt):
    """Many questions, resumable: re-running runs again every id whose latest line is not ok;
    the output ends with one line per id."""
    from branchsearch.orchestrator.batch import check_output, read_questions, run_batch
    from branchsearch.orchestrator.driver import open_driver

    _writable_file(output, "batch output")
    check_output(output, input)
    settings = _settings(home, index, config, batch_concurrency=concurrency, branches=branches,
                         ray_address=address)
    groups = _acl(settings, acl, acl_admin)
    data = read_questions(input)
    if not data.items and not data.bad_lines:
        raise BranchsearchError(f"{input}: no questions (one JSON object a line, "
                                '{"id": …, "question": …})')
    for bad in data.bad_lines:
        print(f"skipped {bad}", file=sys.stderr)
    driver = open_driver(settings, executor)  # questions run at once: the executor as asked
    bar = _progress(len(data.items), "q", "batch")
    seen = {"partial": 0, "failed": 0}

    def tick(status: str) -> None:
        if status in seen:
            seen[status] += 1
        bar.update(1)
        bar.set_postfix(seen)

    try:
        counts = run_batch(data.items, output,
                           lambda q: driver.search(q, acl_groups=groups).to_dict(),
                           concurrency=settings.batch_concurrency, on_done=tick,
                           stop_after=stop_after)
    finally:
        bar.close()
        driver.close()
    print(f"batch: {counts['ok']} ok, {counts['partial']} partial, {counts['failed']} failed; "
          f"{counts['skipped']} already ok in {output}, {len(data.bad_lines)} malformed input "
          "lines skipped")
    if counts["failed_ids"]:
        ids = counts["failed_ids"]
        more = f" and {len(ids) - 10} more" if len(ids) > 10 else ""
        print(f"failed: {', '.join(ids[:10])}{more} (each row's error is in {output}; run the "
              "same command again to retry them)", file=sys.stderr)
    if counts["stopped"]:
        print(f"batch stopped: {counts['stopped']}; {counts['not_run']} questions not run. "
              "Fix the cause and run the same command again: it resumes", file=sys.stderr)
    if counts["failed"] or counts["not_run"] or data.bad_lines:  # nobody answered these
        sys.exit(1)


@app.command()
def synth(out_dir: Path = typer.Argument(..., help="folder to write (BEIR format)"),
          docs: int = typer.Option(2000, min=8, max=MAX_DOCS,
                                   help=f"documents to write (8..{MAX_DOCS:,})"),
          tasks: int = typer.Option(100, min=1),
          seed: int = typer.Option(7)):
    """Write a synthetic enterprise corpus with multi-hop clue chains and gold labels."""
    from branchsearch.infra.synth import synth as make

    try:
        counts = make(out_dir, docs=docs, tasks=tasks, seed=seed)
    except ValueError as exc:
        raise BranchsearchError(str(exc)) from None
    except OSError as exc:  # a disk that filled up meanwhile, a folder removed under us
        raise BranchsearchError(f"synth: cannot write {out_dir}: {exc.strerror or exc}") from None
    print(f"wrote {counts['documents']} documents and {counts['tasks']} multi-hop questions "
          f"to {out_dir}")


@app.command()
def demo(home: Optional[Path] = HomeOpt, branches: int = typer.Option(3, min=1),
         executor: str = ExecutorOpt):
    """The main job on embedded defaults: build a small synthetic corpus, ingest it, run one
    multi-hop question through parallel branches and explain what each branch did."""
    from branchsearch.infra.dataset import read_queries
    from branchsearch.infra.ingest import ingest as run_ingest
    from branchsearch.infra.synth import synth as make
    from branchsearch.orchestrator.driver import open_driver
    from branchsearch.orchestrator.evaluate import index_complete
    from branchsearch.orchestrator.executors import pick_executor

    settings = _settings(home, "demo", None, branches=branches)
    corpus = Path(settings.home) / "demo-corpus"
    if not index_complete(settings):  # missing, or a stopped ingest: (re)build and resume
        make(corpus, docs=240, tasks=12, seed=11)
        print(f"1. wrote a synthetic corpus to {corpus} (240 documents, 12 multi-hop tasks)")
        bar = _progress(240, "doc", "2. ingest (chunk, embed, index)")
        report = run_ingest(corpus, settings, progress=lambda d, c: bar.update(d))
        bar.close()
        print(f"2. ingested {report.chunks} chunks into Milvus Lite + tantivy under "
              f"{settings.index_dir}")
    else:
        print(f"1-2. reusing the demo index under {settings.index_dir}")
    task = read_queries(corpus)[1]  # a multi-hop question and its gold documents
    print(f"3. question ({task.meta['hops']} hops): {task.text}")
    driver = open_driver(settings, pick_executor(settings, executor))
    try:
        result = driver.search(task.text)
    finally:
        driver.close()
    _print_demo_branches(result)
    _print_demo_evidence(result, task)


def _print_demo_branches(result) -> None:
    print("4. what each branch did:")
    for b in result.branches:
        print(f"   branch {b.index} [{b.status}] {b.kind} w={b.weight:g}: {b.subquery!r}")
        if b.status != "ok":
            print(f"      {one_line(b.error)}")
            continue
        searched = [r["args"].get("query") or r["args"].get("doc_id") for r in b.trace
                    if r["kind"] == "call" and r["tool"] in ("search_corpus", "read_document")]
        print(f"      searched {len(searched)}x: " + "; ".join(map(one_line, searched[:6]))
              + (" …" if len(searched) > 6 else ""))
        for p in [r for r in b.trace if r["kind"] == "prune"][:2]:
            print(f"      pruned {len(p['applied'])} at turn {p['turn']} "
                  f"({p['tokens_before']}→{p['tokens_after']} tokens): "
                  f"{one_line(p['reason'], 90)}")
        print(f"      kept {len(b.final_context_ids)} chunks ({b.context_tokens_final} tokens), "
              f"stopped by {b.termination} after {b.turns} turn{'' if b.turns == 1 else 's'}")


def _print_demo_evidence(result, task) -> None:
    gold = list(task.gold)
    print("5. fused evidence (reciprocal rank fusion over branches):")
    for doc in result.evidence[:6]:
        mark = "*" if doc["doc_id"] in gold else " "
        found = [f["branch"] for f in doc["found_by"]]
        print(f"   {mark} {doc['score']:.4f} {one_line(doc['title'])}  [branches {found}]")
        print(f"       {one_line(doc['chunks'][0]['text'], 120)}")
    top = {d["doc_id"] for d in result.evidence[:len(gold) + 1]}
    print(f"   (* = gold; {len(set(gold) & top)}/{len(gold)} gold documents in the top "
          f"{len(gold) + 1}; answer: {task.answer!r}; trace id {result.trace_id})")


@app.command("indexes")
def indexes(home: Optional[Path] = HomeOpt, config: Optional[Path] = ConfigOpt,
            check: bool = typer.Option(True, "--check/--no-check",
                                       help="ask external backends for counts (health)"),
            as_json: bool = typer.Option(False, "--json")):
    """List owned and external indexes with their backends, document counts and health."""
    from branchsearch.infra.catalog import list_indexes
    from branchsearch.orchestrator.terminal import clean

    infos = list_indexes(_settings(home, None, config), check=check)
    if as_json:
        print(json.dumps([i.to_dict() for i in infos]))
        return
    if not infos:
        print("no indexes (run `branchsearch ingest PATH --index NAME`, or declare "
              "[indexes.NAME] in the settings file)")
    for i in infos:
        count = "-" if i.documents is None else f"{i.documents:,} docs"
        print(clean(f"{i.name:<24} {i.kind:<8} {count:>12}  {i.health}  {i.backends}"))


# `branchsearch loadtest` lives in orchestrator/loadtest/command.py (options, run, print)
from branchsearch.orchestrator.loadtest.command import loadtest  # noqa: E402

app.command("loadtest")(loadtest)

# `branchsearch serve` and `branchsearch keys …` live in orchestrator/service_cli.py
from branchsearch.orchestrator.service_cli import keys_app, serve  # noqa: E402

app.command("serve")(serve)
app.add_typer(keys_app, name="keys")


def main() -> None:
    """Run the app; every user-caused error ends as one `error:` line and exit status 2."""
    try:
        # not standalone, typer *returns* a command's `typer.Exit(code)` and Ctrl-C (130)
        code = app(prog_name="branchsearch", standalone_mode=False)
    except KeyboardInterrupt:
        code = 130
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(1)
    except Exception as exc:
        message = user_error(exc)
        if message is None:
            raise
        if message:
            print(f"error: {redact(message)}", file=sys.stderr)  # no password, key or token
        else:  # no arguments: the help text is the answer
            exc.show()
        sys.exit(2)
    if code == 130:
        print("interrupted", file=sys.stderr)
    if isinstance(code, int) and code:
        sys.exit(code)


def user_error(exc: BaseException) -> str | None:
    """The one line to show for a user-caused error ("" = show the exception's own text),
    or None for a bug (which keeps its traceback)."""
    cause = getattr(exc, "cause", None)  # a Ray task error: the original exception
    if isinstance(cause, BranchsearchError):
        return _one_line(str(cause))
    if isinstance(exc, BranchsearchError):
        return _one_line(str(exc))
    if isinstance(exc, typer.TyperException) or _is_click_error(exc):  # usage errors
        message = exc.format_message()
        ctx = getattr(exc, "ctx", None)
        if not message:
            return ""
        where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        return _one_line(message) + where
    cause = _user_cause(exc)
    if cause is not None:
        return _one_line(str(cause))
    if isinstance(exc, OSError):
        line = _path_error(exc)
        if line is not None:
            return line
    return _actor_init_error(exc)


def _path_error(exc: OSError) -> str | None:
    """A file the user named where a folder must be (`--home FILE` for `keys`), or a full disk,
    when no command turned it into its own line. Other OS errors keep their traceback."""
    import errno

    name = exc.filename
    if exc.errno == errno.ENOTDIR and name is not None:
        path = Path(name)
        while path != path.parent and not path.exists():
            path = path.parent
        if path.exists() and not path.is_dir():
            return _one_line(f"{name}: {path} is a file, not a folder")
        return _one_line(f"{name}: a part of this path is not a folder")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        where = f" writing {name}" if name is not None else ""
        return _one_line(f"the disk is full{where} ({exc.strerror}): free space and run the "
                         "command again")
    return None


_OUR_ERROR = re.compile(r"branchsearch\.infra\.errors\.(\w+): (.*)\Z", re.S)


def _actor_init_error(exc: BaseException) -> str | None:
    """The user error an actor died of in its constructor. Ray's ActorDiedError keeps only the
    text of the creation task's traceback (not the exception), whose last entry is ours."""
    if not getattr(exc, "actor_init_failed", False):
        return None
    match = _OUR_ERROR.search(str(exc).rstrip())
    if match is None:
        return None
    from branchsearch.infra import errors

    kind = getattr(errors, match[1], None)
    if not (isinstance(kind, type) and issubclass(kind, BranchsearchError)):
        return None
    return _one_line(match[2])


def _is_click_error(exc: BaseException) -> bool:
    click = sys.modules.get("click")  # a plain click, if anything imported one
    return click is not None and isinstance(exc, click.ClickException)


def _user_cause(exc: BaseException) -> BaseException | None:
    """A BranchsearchError behind a wrapper (a Ray actor that died of it, a chained error)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, BranchsearchError):
            return exc
        exc = getattr(exc, "cause", None) or exc.__cause__
    return None


def _one_line(text: str) -> str:
    return " ".join(text.split())


if __name__ == "__main__":
    main()
