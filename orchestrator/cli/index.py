"""Indexes: `ingest` (chunk, embed, index a corpus), `indexes` (list them with their health) and
`synth` (write a synthetic corpus)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from branchsearch.infra.errors import BranchsearchError
from branchsearch.infra.datasets.synth import MAX_DOCS
from branchsearch.orchestrator.cli.options import (AddressOpt, ConfigOpt, HomeOpt, IndexOpt,
                                                   JsonOpt, per_second, progress_bar, settings_from)


def register(app: typer.Typer) -> None:
    app.command()(ingest)
    app.command("indexes")(indexes)
    app.command()(synth)


def ingest(path: Path = typer.Argument(..., help="BEIR folder, JSONL file or folder of .txt/.md"),
           home: Optional[Path] = HomeOpt, index: Optional[str] = IndexOpt,
           config: Optional[Path] = ConfigOpt,
           dense: Optional[bool] = typer.Option(
               None, "--dense/--no-dense", help="embed and index vectors (--no-dense: BM25 "
               "only); default: as the index was made, vectors for a new one"),
           workers: int = typer.Option(1, min=1, max=256, help="embed on a Ray Data actor pool "
                                       "of N workers (GPUs when the cluster has them)"),
           embed_batch: Optional[int] = typer.Option(None, min=1, max=4096,
                                                     help="texts per model call (--workers)"),
           embed_model: Optional[str] = typer.Option(
               None, "--embed-model", help="all-MiniLM-L6-v2 (default), static-minilm (a static "
               "embedding distilled from it and fitted to the corpus: fast ingest, a little less "
               "recall; MiniLM embeds its queries) or a local model folder; recorded in the "
               "index, whose searches embed with it"),
           address: Optional[str] = AddressOpt,
           as_json: bool = JsonOpt):
    """Chunk, embed and index a corpus; re-running resumes a stopped ingest (re-ingesting a
    changed document replaces its chunks)."""
    from branchsearch.infra.ingest.pipeline import ingest as run_ingest

    settings = settings_from(home, index, config, ray_address=address, embed_model=embed_model)
    bar = progress_bar(None, "doc", f"ingest {settings.index}")
    chunks = 0

    def tick(docs: int, new_chunks: int) -> None:
        nonlocal chunks
        chunks += new_chunks
        bar.update(docs)
        rate = chunks / max(bar.format_dict["elapsed"], 1e-9)
        bar.set_postfix(chunks=chunks, chunks_per_s=per_second(rate))

    def embedding(done: int, total: int) -> None:  # a long batch (a book) as it embeds
        bar.set_postfix(chunks=chunks, embedding=f"{done}/{total} chunks of the next documents")

    report = run_ingest(path, settings, dense=dense, progress=tick, workers=workers,
                        embed_batch=embed_batch, embedded=embedding)
    bar.close()
    if report.stale_lock:
        print(f"resumed the ingest that stopped unfinished ({report.stale_lock})", file=sys.stderr)
    if as_json:
        print(json.dumps(report.to_dict()))
    else:
        s, rate = report.seconds, per_second(report.chunks_per_s)
        n = report.documents
        done = what_happened(report)
        if report.resumed < n:
            done += (f"; {rate} chunks/s with {workers} worker(s), embedding "
                     f"{s.get('embed', 0):.1f} s")
            if report.embedded or report.cached:
                done += (f" ({_chunks(report.embedded)} embedded, {report.cached} from the "
                         "embedding cache)")
        print(f"ingested {_docs(n)}, {report.chunks} chunks into "
              f"{settings.index!r} ({settings.index_dir}); {done}")
        if report.fitted:
            before, after = report.fitted["held_out_cosine"]
            queries = "MiniLM its queries onto the fitted axes" \
                if settings.static_queries == "minilm" else "it its queries (static_queries)"
            print(f"fitted static-minilm to the corpus in {s.get('fit', 0):.0f} s (held-out "
                  f"texts' cosine to MiniLM {before:.2f} -> {after:.2f}); it embeds this "
                  f"index's chunks, and {queries}")
        if report.recounted:
            print(f"counted the tokens of {report.recounted} chunks committed without them "
                  f"({s.get('count', 0):.1f} s): searches no longer encode them")
        if report.uncounted:
            print(f"note: chunks committed without token counts keep none ({report.uncounted}): "
                  "searches count them as they show them", file=sys.stderr)


def _chunks(n: int) -> str:
    return f"{n} chunk{'s' if n != 1 else ''}"


def _docs(n: int) -> str:
    return f"{n} document{'s' if n != 1 else ''}"


def what_happened(report) -> str:
    """What an ingest did to its index, in words: made it, resumed a stopped ingest of it,
    updated a complete one, or found every document already there, unchanged."""
    absent = report.absent
    held = (f"; {_docs(absent)} the index holds {'are' if absent != 1 else 'is'} not in this "
            "corpus: kept (ingest adds and updates, it never deletes)") if absent else ""
    return _made(report) + held


def _made(report) -> str:
    kept, now = report.resumed, report.documents - report.resumed
    if report.before == "new":
        return f"a new index: all {_docs(now)} committed now"
    if report.before == "stopped":
        if not now:
            return (f"resumed a stopped ingest: it had committed all {_docs(kept)}, unchanged: "
                    "nothing committed now, the index is complete")
        if not kept:
            return f"resumed a stopped ingest that had committed none of them: all {now} " \
                   "committed now"
        return (f"resumed a stopped ingest: {_docs(kept)} it had committed kept, {now} "
                "committed now")
    if not now:
        return ("the index was complete and already held every document, unchanged: nothing "
                "committed")
    return f"updated the complete index: {_docs(kept)} unchanged kept, {now} new or changed " \
           "committed now"


def indexes(home: Optional[Path] = HomeOpt, config: Optional[Path] = ConfigOpt,
            check: bool = typer.Option(True, "--check/--no-check",
                                       help="ask external backends for counts (health)"),
            as_json: bool = JsonOpt):
    """List owned and external indexes with their backends, document counts and health; exit
    1 when any cannot be searched now (a backend down, an index incomplete); an index being
    ingested is listed as such and does not make it exit 1."""
    from branchsearch.infra.index.catalog import list_indexes
    from branchsearch.orchestrator.cli.render import pad, visible

    infos = list_indexes(settings_from(home, None, config), check=check)
    if as_json:
        print(json.dumps([i.to_dict() for i in infos]))
    elif not infos:
        print("no indexes (run `branchsearch ingest PATH --index NAME`, or declare "
              "[indexes.NAME] in the settings file)")
    else:
        for i in infos:
            count = "-" if i.documents is None else f"{i.documents:,} docs"
            embedded = f"  (embedding: {i.embedding})" if i.embedding else ""
            print(visible(f"{pad(i.name, 24)} {i.kind:<8} {count:>12}  {i.health}  "
                          f"{i.backends}{embedded}"))
    broken = [i.name for i in infos if i.health not in ("ok", "not checked")
              and not i.health.startswith("ingesting")]
    if broken:  # for scripts and health checks: listed, and not all searchable
        print(visible(f"indexes: {len(broken)} not searchable now: {', '.join(broken)}"),
              file=sys.stderr)
        sys.exit(1)


def synth(out_dir: Path = typer.Argument(..., help="folder to write (BEIR format)"),
          docs: int = typer.Option(2000, min=8, max=MAX_DOCS,
                                   help=f"documents to write (8..{MAX_DOCS:,})"),
          tasks: int = typer.Option(100, min=1, help="multi-hop questions with gold labels "
                                    "(--docs must be at least 8 x this)"),
          seed: int = typer.Option(7, help="the same seed writes the same corpus"),
          hard: bool = typer.Option(False, "--hard", help="3-4 hop composed questions over "
                                    "ambiguous bridges (look-alike bands, decoy albums)"),
          force: bool = typer.Option(False, "--force", help="write into a folder that holds "
                                     "files synth did not write (its corpus.jsonl, "
                                     "queries.jsonl and qrels/test.tsv are replaced)")):
    """Write a synthetic enterprise corpus with multi-hop clue chains and gold labels."""
    from branchsearch.infra.datasets.synth import synth, synth_hard

    make = synth_hard if hard else synth

    try:
        counts = make(out_dir, docs=docs, tasks=tasks, seed=seed, force=force)
    except ValueError as exc:
        raise BranchsearchError(str(exc)) from None
    except OSError as exc:  # a disk that filled up meanwhile, a folder removed under us
        raise BranchsearchError(f"synth: cannot write {out_dir}: {exc.strerror or exc}") from None
    print(f"wrote {counts['documents']} documents and {counts['tasks']} multi-hop questions "
          f"to {out_dir}")
