"""The `branchsearch loadtest` command (registered by cli/jobs.py): parse, run, print."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from branchsearch.infra.config.choices import EXECUTORS
from branchsearch.orchestrator.cli.options import (settings_from, settings_to_read, writable_folder,
                                                 writable_report)


def _printer():
    """Progress to stderr: one rewritten line on a terminal, a line every 10 s otherwise."""
    tty = sys.stderr.isatty()
    last = [0.0]

    def show(text: str) -> None:
        if text.endswith("\n"):  # a finished step: always its own line
            print(("\r\033[K" if tty else "") + text.rstrip("\n"), file=sys.stderr, flush=True)
        elif tty:
            print("\r\033[K" + text, end="", file=sys.stderr, flush=True)
        elif time.monotonic() - last[0] >= 10:
            last[0] = time.monotonic()
            print(text, file=sys.stderr, flush=True)

    return show


def loadtest(
        url: Optional[str] = typer.Option(None, "--url", help="a running service "
                                          "(branchsearch serve), e.g. http://127.0.0.1:8000; "
                                          "default: the driver in this process"),
        key_file: Optional[Path] = typer.Option(None, "--key-file", help="a file holding the "
                                                "service's API key (Bearer), or several, one a "
                                                "line, each request taking the least busy (each "
                                                "key has its own concurrency limit); default: "
                                                "$BRANCHSEARCH_API_KEY. Never written to the "
                                                "report or the output"),
        key: Optional[str] = typer.Option(None, "--key", hidden=True, help="the key itself: "
                                          "visible to other users in the process list, so "
                                          "prefer --key-file or BRANCHSEARCH_API_KEY"),
        queries: Optional[Path] = typer.Option(None, "--queries", help="JSONL of questions or a "
                                               "BEIR folder / queries.jsonl"),
        synth: Optional[int] = typer.Option(None, "--synth", help="N generated multi-hop "
                                            "questions over a synth corpus (ingested into "
                                            "--index if missing)"),
        rate: Optional[float] = typer.Option(None, "--rate", help="open loop: requests/s"),
        users: Optional[int] = typer.Option(None, "--users", help="closed loop: concurrent "
                                            "users"),
        ramp: Optional[str] = typer.Option(None, "--ramp", help="START:STOP:STEP rates (or users "
                                           "with --loop closed), one step each"),
        loop: Optional[str] = typer.Option(None, "--loop", help="open | closed (default: closed "
                                           "with --users, else open)"),
        arrivals: Optional[str] = typer.Option(None, "--arrivals", help="open loop: poisson "
                                               "(default) | constant"),
        duration: Optional[float] = typer.Option(None, "--duration", help="seconds of load "
                                                 "(default 30; with --ramp: a cap on all steps)"),
        step_duration: float = typer.Option(20.0, "--step-duration", help="seconds per ramp "
                                            "step"),
        drain: float = typer.Option(10.0, "--drain", help="after a step, wait at most this long "
                                    "for running requests (then: unfinished)"),
        max_inflight: int = typer.Option(256, "--max-inflight", help="open loop: arrivals past "
                                         "this many running requests are dropped (errors)"),
        think: float = typer.Option(0.0, "--think", help="closed loop: seconds between answer "
                                    "and next question"),
        warmup: int = typer.Option(2, "--warmup", min=0, help="requests before measuring"),
        seed: int = typer.Option(0, "--seed", help="the questions' order and the Poisson "
                                "arrivals (the same seed, the same run)"),
        slo_p99_ms: Optional[float] = typer.Option(None, "--slo-p99-ms", help="report the "
                                                   "highest load holding p99 <= X, errors <= 1%"),
        stop_at_knee: bool = typer.Option(True, "--stop-at-knee/--full-ramp", help="stop the "
                                          "ramp after the first step past the knee (and SLO)"),
        branches: Optional[int] = typer.Option(None, "--branches", min=1, help="most "
                                                "branches a question may be planned into"),
        policy: Optional[str] = typer.Option(None, "--policy", help="heuristic | llm (driver)"),
        k: Optional[int] = typer.Option(None, "--k", min=1, help="service: evidence size"),
        deadline_s: Optional[float] = typer.Option(None, "--deadline-s",
                                                   help="per-request deadline"),
        executor: str = typer.Option("ray", "--executor", help="driver: ray | local"),
        address: Optional[str] = typer.Option(None, "--address", help="Ray cluster address"),
        concurrency: Optional[int] = typer.Option(None, "--concurrency", min=1, help="driver: "
                                                  "questions run at once (actor pool = branches "
                                                  "x this; default batch_concurrency)"),
        timeout_s: float = typer.Option(120.0, "--timeout-s", help="service: HTTP timeout"),
        report: Optional[Path] = typer.Option(None, "--report", help="OUT.json (+ OUT.md)"),
        plots: Optional[Path] = typer.Option(None, "--plots", help="folder for PNG plots"),
        home: Optional[Path] = typer.Option(None, "--home", help="data home"),
        index: Optional[str] = typer.Option(None, "--index", help="index name"),
        config: Optional[Path] = typer.Option(None, "--config", help="settings TOML file"),
        as_json: bool = typer.Option(False, "--json", help="print the report as JSON")):
    """Load test the driver or a running service: open or closed loop, bounded in time; reports
    latency percentiles, achieved rate, the saturation knee, per-stage time, engine/GPU/Ray use."""
    from branchsearch.orchestrator.loadtest import report as rep
    from branchsearch.orchestrator.loadtest.run import Options, loadtest as run, read_keys

    if executor not in EXECUTORS:
        raise typer.BadParameter(f"{executor!r} is not one of {', '.join(EXECUTORS)}",
                                 param_hint="'--executor'")
    if report:  # checked before any load is sent: a ramp's results are not lost at its end
        from branchsearch.infra.textfile import output_path

        writable_report(output_path(report), "--report")  # (never a device: /dev/null)
    if plots:
        writable_folder(plots, "--plots")
    flags = {"branches": branches, "policy": policy, "ray_address": address}
    # against a URL the index is the service's to name; in-process, the home's only one serves
    settings, picked = (settings_from(home, index, config, **flags), None) if url else \
        settings_to_read(home, index, config, **flags)
    keys, source = read_keys(key_file, key)
    if key is not None:
        print("warning: --key shows the key in the process list and shell history; use "
              "--key-file FILE or BRANCHSEARCH_API_KEY (the key is not written anywhere)",
              file=sys.stderr)
    options = Options(url=url, keys=keys, key_source=source, queries=queries, synth=synth,
                      rate=rate, users=users, ramp=ramp, loop=loop, arrivals=arrivals,
                      duration_s=duration, step_duration_s=step_duration, drain_s=drain,
                      max_inflight=max_inflight, think_s=think, warmup=warmup, seed=seed,
                      slo_p99_ms=slo_p99_ms, stop_at_knee=stop_at_knee, branches=branches, k=k,
                      deadline_s=deadline_s, executor=executor, concurrency=concurrency,
                      timeout_s=timeout_s, report=report, plots=plots)
    out = run(options, settings, progress=None if as_json else _printer(),
              argv=["branchsearch", *sys.argv[1:]], note=picked)
    if as_json:
        print(json.dumps(out | {"steps": [
            {k_: v for k_, v in s.items() if k_ != "latencies_ms"} for s in out["steps"]]},
            default=str))
        if out["interrupted"]:
            raise typer.Exit(143 if out.get("terminated") else 130)
        _exit_if_not_load(out)
        return
    print(rep.markdown(out).split("\n## Server-side")[0].rstrip())
    if report:
        print(f"report: {report} and {report.with_suffix('.md')}")
    if plots:
        print(f"plots: {', '.join(out.get('plots', []))}")
    if out["interrupted"]:  # the report holds what was measured; the status says it stopped
        raise typer.Exit(143 if out.get("terminated") else 130)  # 128 + SIGTERM or SIGINT
    _exit_if_not_load(out)


def _exit_if_not_load(out: dict) -> None:
    """Exit 1 when a step says nothing of saturation (the service went away, its backend did,
    or it rejected requests: a key revoked, a question it will not take): the report is kept,
    but what it measured is not the service's capacity, and a script must not read it as
    such."""
    from branchsearch.orchestrator.loadtest.stats import not_load

    if any(not_load(step, i + 1) for i, step in enumerate(out["steps"])):
        print(f"loadtest: {out['knee']['reason']}; the report keeps what was measured",
              file=sys.stderr)
        raise typer.Exit(1)
