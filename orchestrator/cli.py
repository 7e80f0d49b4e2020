"""`branchsearch` command line. It only parses, merges settings, builds and runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from infra.errors import BranchsearchError
from infra.settings import Settings, load_settings

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Parallel-branch evidence search over Milvus + BM25 (see README).")

HomeOpt = typer.Option(None, "--home", help="data home (default ./.branchsearch)")
IndexOpt = typer.Option(None, "--index", help="index name (default 'default')")
ConfigOpt = typer.Option(None, "--config", help="settings TOML file")
ExecutorOpt = typer.Option("ray", "--executor", help="ray (actors) | local (in-process)")
AddressOpt = typer.Option(None, "--address", help="Ray cluster address (default RAY_ADDRESS, "
                                                   "else a local cluster)")


def _settings(home, index, config, **flags) -> Settings:
    return load_settings(config, {"home": home, "index": index, **flags})


def _progress(total: int | None, unit: str, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, desc=desc, file=sys.stderr, dynamic_ncols=True,
                disable=None)


def _write_json(path: Path, data) -> None:
    """Write atomically: a crash never leaves a half-written report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


@app.command()
def ingest(path: Path = typer.Argument(..., help="BEIR folder, JSONL file or folder of .txt/.md"),
           home: Optional[Path] = HomeOpt, index: Optional[str] = IndexOpt,
           config: Optional[Path] = ConfigOpt,
           dense: bool = typer.Option(True, help="embed and index vectors (--no-dense: BM25 only)"),
           as_json: bool = typer.Option(False, "--json")):
    """Chunk, embed and index a corpus (re-ingesting a document replaces its chunks)."""
    from infra.ingest import ingest as run_ingest

    settings = _settings(home, index, config)
    bar = _progress(None, "doc", f"ingest {settings.index}")
    chunks = 0

    def tick(docs: int, new_chunks: int) -> None:
        nonlocal chunks
        chunks += new_chunks
        bar.update(docs)
        rate = chunks / max(bar.format_dict["elapsed"], 1e-9)
        bar.set_postfix(chunks=chunks, chunks_per_s=f"{rate:.0f}")

    report = run_ingest(path, settings, dense=dense, progress=tick)
    bar.close()
    if as_json:
        print(json.dumps(report.to_dict()))
    else:
        s = report.seconds
        print(f"ingested {report.documents} documents, {report.chunks} chunks into "
              f"{settings.index!r} ({settings.index_dir}); "
              f"{report.chunks_per_s_without_embedding:.0f} chunks/s without embedding, "
              f"embedding {s.get('embed', 0):.1f} s")


@app.command()
def retrieve(query: str, mode: str = typer.Option("hybrid", help="bm25 | dense | hybrid"),
             k: int = typer.Option(10, min=1), home: Optional[Path] = HomeOpt,
             index: Optional[str] = IndexOpt, config: Optional[Path] = ConfigOpt,
             acl: Optional[list[str]] = typer.Option(None, help="caller's ACL groups"),
             as_json: bool = typer.Option(False, "--json")):
    """Single-shot retrieval (no agent)."""
    from infra.retriever import open_retriever

    settings = _settings(home, index, config)
    retriever = open_retriever(settings, need_dense=mode != "bm25")
    hits = retriever.search(query, mode=mode, k=k, acl_groups=acl)
    if as_json:
        print(json.dumps([h.to_dict() for h in hits]))
        return
    for h in hits:
        text = " ".join(h.text.split())[:160]
        print(f"{h.rank:>3}. {h.chunk_id}  {h.score:.4f}  {h.title}\n     {text}")


@app.command("eval")
def evaluate(dataset: Path = typer.Argument(..., help="BEIR folder"),
             mode: str = typer.Option("hybrid", help="bm25 | dense | hybrid (single-shot)"),
             policy: Optional[str] = typer.Option(
                 None, help="run the branch agent with this policy (heuristic | llm) instead "
                            "of single-shot retrieval"),
             prune: bool = typer.Option(True, "--prune/--no-prune", help="agent may prune"),
             branches: int = typer.Option(1, min=1, help="branches per question (agent)"),
             executor: str = ExecutorOpt,
             limit: Optional[int] = typer.Option(None, min=1),
             report: Optional[Path] = typer.Option(None, help="write the JSON report here"),
             home: Optional[Path] = HomeOpt, index: Optional[str] = IndexOpt,
             config: Optional[Path] = ConfigOpt, ingest_first: bool = typer.Option(
                 True, "--ingest/--no-ingest", help="ingest the corpus if the index is missing"),
             as_json: bool = typer.Option(False, "--json")):
    """Evaluate single-shot retrieval on a BEIR folder."""
    from infra.dataset import read_queries
    from infra.ingest import ingest as run_ingest
    from infra.retriever import open_retriever, MODES
    from orchestrator.evaluate import eval_single_shot

    if mode not in MODES:
        raise BranchsearchError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
    settings = _settings(home, index or _slug(dataset), config, prune=prune,
                         policy=policy, branches=branches)
    queries = read_queries(dataset)[:limit]
    if ingest_first and not (settings.index_dir / "docs.sqlite").exists():
        print(f"index {settings.index!r} missing: ingesting {dataset}", file=sys.stderr)
        bar = _progress(None, "doc", "ingest")
        run_ingest(dataset, settings, progress=lambda d, c: bar.update(d))
        bar.close()
    bar = _progress(len(queries), "q", f"eval {policy or mode}")
    if policy:
        from orchestrator.evaluate import eval_agent

        driver = _driver(settings, "local" if settings.branches == 1 else executor)
        try:
            result = eval_agent(driver, queries, progress=lambda: bar.update(1))
        finally:
            driver.close()
    else:
        retriever = open_retriever(settings, need_dense=mode != "bm25")
        result = eval_single_shot(retriever, queries, mode, progress=lambda: bar.update(1))
        retriever.close()
    bar.close()
    result["dataset"] = str(dataset)
    if report:
        _write_json(report, result)
    if as_json:
        print(json.dumps({k: v for k, v in result.items() if k != "per_query"}))
    else:
        what = f"policy={policy} prune={prune}" if policy else f"mode={mode}"
        print(f"{dataset.name} {what} queries={result['queries']}")
        for name, value in result["metrics"].items():
            print(f"  {name:<16} {value}")


def _driver(settings: Settings, executor: str):
    from orchestrator.driver import Driver

    return Driver(settings, mode=executor)




@app.command()
def search(question: str, branches: Optional[int] = typer.Option(None, min=1,
                                                                  help="at most N branches"),
           policy: Optional[str] = typer.Option(None, help="heuristic | llm"),
           trace: Optional[Path] = typer.Option(None, help="write spans (JSONL) here"),
           executor: str = ExecutorOpt, address: Optional[str] = AddressOpt,
           acl: Optional[list[str]] = typer.Option(None, help="caller's ACL groups"),
           home: Optional[Path] = HomeOpt, index: Optional[str] = IndexOpt,
           config: Optional[Path] = ConfigOpt, as_json: bool = typer.Option(False, "--json")):
    """Search with parallel branch agents; prints the fused evidence."""
    flags = {"branches": branches, "policy": policy, "ray_address": address}
    if trace:
        flags |= {"trace_exporter": "jsonl", "trace_file": str(trace)}
    settings = _settings(home, index, config, **flags)
    if branches == 1 and executor == "ray" and not address:
        executor = "local"  # one branch needs no cluster
    driver = _driver(settings, executor)
    try:
        result = driver.search(question, acl_groups=acl)
    finally:
        driver.close()
    if as_json:
        print(json.dumps(result.to_dict(), default=str))
        return
    print_result(result)


def print_result(result) -> None:
    print(f"question: {result.question}\ntrace_id: {result.trace_id}")
    for b in result.branches:
        extra = (f"{b.termination}, {b.turns} turns, {b.tool_calls} calls, "
                 f"{b.context_tokens_final} ctx tokens, pruned {len(b.pruned_ids)}"
                 if b.status == "ok" else b.error)
        print(f"  branch {b.index} [{b.status}] w={b.weight:g} {b.subquery!r}: {extra}")
    print("evidence:")
    for doc in result.evidence:
        print(f"  {doc['score']:.4f}  {doc['doc_id']}  ({doc['title']})")
        for c in doc["chunks"]:
            found = ", ".join(f"b{f['branch']}#{f['rank']}" for f in c["found_by"])
            print(f"      {c['chunk_id']}  found by {found}: {' '.join(c['text'].split())[:110]}")


@app.command()
def batch(input: Path = typer.Argument(..., help="JSONL of {id, question}"),
          output: Path = typer.Option(..., "-o", "--output", help="results JSONL (appended)"),
          concurrency: Optional[int] = typer.Option(None, min=1),
          branches: Optional[int] = typer.Option(None, min=1),
          executor: str = ExecutorOpt, address: Optional[str] = AddressOpt,
          home: Optional[Path] = HomeOpt, index: Optional[str] = IndexOpt,
          config: Optional[Path] = ConfigOpt):
    """Many questions, resumable: re-running skips ids already in the output."""
    from orchestrator.batch import read_questions, run_batch

    settings = _settings(home, index, config, batch_concurrency=concurrency, branches=branches,
                         ray_address=address)
    data = read_questions(input)
    for bad in data.bad_lines:
        print(f"skipped {bad}", file=sys.stderr)
    driver = _driver(settings, executor)
    bar = _progress(len(data.items), "q", "batch")
    failures = 0

    def tick(ok: bool) -> None:
        nonlocal failures
        failures += not ok
        bar.update(1)
        bar.set_postfix(failures=failures)

    try:
        counts = run_batch(data.items, output, lambda q: driver.search(q).to_dict(),
                           concurrency=settings.batch_concurrency, on_done=tick)
    finally:
        bar.close()
        driver.close()
    print(f"batch: {counts['done']} done, {counts['failed']} failed, {counts['skipped']} already "
          f"in {output}, {len(data.bad_lines)} malformed input lines skipped")
    if counts["failed"]:
        sys.exit(1)


def _slug(path: Path) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in path.resolve().name)


def main() -> None:
    try:
        app(standalone_mode=False)
    except BranchsearchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except Exception as exc:  # click usage errors
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        raise


if __name__ == "__main__":
    main()
