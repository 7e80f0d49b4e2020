"""The load test's report: JSON (everything), a Markdown summary, and plots (latency vs offered
load, throughput vs offered load, latency CDF per step)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from branchsearch.infra.errors import BranchsearchError
from branchsearch.orchestrator.evaluation.report import write_report


def _ms(v) -> str:
    return "-" if v is None else f"{v:.0f}"


def load_label(report: dict) -> str:
    return "target rate (req/s)" if report["arrivals"]["loop"] == "open" else "users"


def _x(step: dict) -> float:
    """The step's nominal load (the rate asked for, or users); `offered_rate` is what the
    arrival process really sent in the step."""
    return step["load"]


def markdown(report: dict, md_dir: str | Path | None = None) -> str:
    """The summary; plot links are relative to `md_dir` (where the .md is written)."""
    steps, arr = report["steps"], report["arrivals"]
    target, wl, m = report["target"], report["workload"], report["machine"]
    lines = [f"# Load test: {target.get('kind')} "
             f"{target.get('url') or target.get('executor', '')}".rstrip(), "",
             f"* command: `{report['command']}`",
             f"* started {report['started']}; machine: {m['cpus']} CPUs, {m['platform']}, load "
             f"average at start {m['load_average']}",
             "* target: " + ", ".join(f"{k} {v}" for k, v in target.items()),
             f"* workload: {wl['source']} ({wl['questions']} questions, seed {wl['seed']})",
             f"* arrivals: {arr['loop']} loop" + (f", {arr['process']}" if arr['loop'] == "open"
                                                  else f", think {arr['think_s']} s")
             + f", {len(steps)} step(s) of {arr['step_duration_s']} s, drain ≤ "
               f"{arr['drain_s']} s, max in flight {arr['max_inflight']}", ""]
    for note in report.get("notes", []):
        lines.append(f"> {note}")
    if report.get("notes"):
        lines.append("")
    lines += ["| " + " | ".join([load_label(report), "offered/s", "achieved/s", "sent", "p50 ms",
                                 "p90 ms", "p99 ms", "max ms", "refused (429, 503 overloaded)",
                                 "other errors", "tokens read/s"]) + " |",
              "|" + "---:|" * 11]
    for s in steps:
        lat = s["latency_ms"]
        refusals = s.get("refusals", {})
        errs = ", ".join(f"{k} {v}" for k, v in s["errors"].items() if k not in refusals) or "0"
        refused = (f"{s['refused']} ({s['refusal_rate']:.1%}): "
                   + ", ".join(f"{k} {v}" for k, v in refusals.items())) if refusals else "0"
        slow = s.get("refusal_latency_ms") or {}
        if refusals and slow.get("max") is not None:  # a 503 after a long hold: an outage
            refused += f"; answered in p99 {_ms(slow['p99'])} / max {_ms(slow['max'])} ms"
        offered = f"{s['offered_rate']:.3g}" if s["offered_rate"] is not None else "-"
        bound = "≥" if s["latency_lower_bound"] else ""  # unfinished requests at their bound
        part = " (partial)" if s.get("partial") else ""  # a step cut by ^C
        lines.append(f"| {_x(s):.3g}{part} | {offered} | {s['achieved_rate']:.3g} | {s['sent']} "
                     f"| {_ms(lat['p50'])} "
                     f"| {_ms(lat['p90'])} | {_ms(lat['p99'])}{bound} "
                     f"| {_ms(lat['max'])} | {refused} | {errs} | {s['tokens_read_per_s']:.0f} |")
    lines += ["", "Latency percentiles are over the requests the service took on; refusals "
              "(HTTP 429, 503 overloaded), 503s saying it cannot search (backend_unavailable, "
              "not_ready, …), rejections (any other HTTP 4xx) and requests that reached no "
              "service (connection refused or broken) are counted apart and enter the error "
              "rate, not the percentiles; how long "
              "the refusals took is beside their count (a 503 after a long hold is an outage, "
              "not a quick 'retry later')."]
    knee = report["knee"]
    lines += ["", f"**Knee**: {knee['knee'] if knee['knee'] is not None else 'none'}"
              + (f" (saturated at {knee['saturated_at']:g}: {knee['reason']})"
                 if knee["saturated_at"] is not None else f" ({knee['reason']})")]
    if "slo" in report:
        held, broken = report["slo"]["holds_up_to"], report["slo"].get("broken_at")
        open_loop = arr["loop"] == "open"
        lines.append(f"**SLO p99 ≤ {report['slo']['p99_ms']:g} ms, errors ≤ 1 %"
                     + (", achieved ≥ 90 % of offered" if open_loop else "") + "**: "
                     + (f"holds up to {held['load']:g} ({held['achieved_rate']:.3g}/s achieved, "
                        f"p99 {held['p99_ms']:.0f} ms)" if held else "not held at any step")
                     + (f"; broken at {broken['load']:g}: {broken['reason']}" if broken else ""))
    if report.get("stopped"):
        lines.append(f"({report['stopped']})")
    stage_names = sorted({k for s in steps for k in s["stages_ms"]})
    if stage_names:
        lines += ["", "## Server-side time per stage (p50 / p99 ms)", "",
                  "| " + " | ".join([load_label(report)] + stage_names) + " |",
                  "|" + "---:|" * (len(stage_names) + 1)]
        for s in steps:
            cells = [f"{_ms(s['stages_ms'][n]['p50'])} / {_ms(s['stages_ms'][n]['p99'])}"
                     if n in s["stages_ms"] else "-" for n in stage_names]
            lines.append(f"| {_x(s):.3g} | " + " | ".join(cells) + " |")
    branch_errors = [(s, s["branch_errors"]) for s in steps if s["branch_errors"]]
    if branch_errors:
        lines += ["", "Branch errors: " + "; ".join(
            f"{_x(s):.3g}: " + ", ".join(f"{k} {v}" for k, v in b.items())
            for s, b in branch_errors)]
    lines += ["", "## Deployment during each step", ""]
    for s in steps:
        p = s.get("probes", {})
        gpu = p.get("gpu", "-")
        gpu_text = gpu if isinstance(gpu, str) else "; ".join(
            f"GPU{i} {d['name']}: util {d['util_pct_mean']}% mean / {d['util_pct_max']}% max, "
            f"mem {d['mem_used_mib_max']}/{d['mem_total_mib']} MiB" for i, d in gpu.items())
        ray = p.get("ray", "-")
        ray_text = ray if isinstance(ray, str) else ", ".join(
            f"{k} {v.get('used_mean', v.get('used_gib_mean'))}"
            f"/{v.get('total', v.get('total_gib'))}" for k, v in ray.items())
        parts = [f"* {_x(s):.3g}: GPU: {gpu_text}; Ray in use (mean/total): {ray_text}"]
        for name, e in (p.get("engines") or {}).items():
            parts.append(f"  * engine {name}: {e['requests']} requests, "
                         f"{e['completion_tokens_per_s']} completion tokens/s, busy "
                         f"{e['busy_share']:.0%}" + (f", mean batch {e['mean_batch']}"
                                                     if "mean_batch" in e else ""))
        if isinstance(p.get("service_metrics"), dict):
            picked = {k: v for k, v in p["service_metrics"].items()
                      if "vllm" in k or "in_flight" in k or "searches_total" in k}
            if picked:
                parts.append("  * service: " + ", ".join(f"{k} {v}" for k, v in picked.items()))
        lines += parts
    if report.get("plots"):
        lines += ["", "## Plots", ""] + [
            f"![{Path(p).stem}]({os.path.relpath(p, md_dir) if md_dir else p})"
            for p in report["plots"]]
    return "\n".join(lines) + "\n"


def write(report: dict, path: str | Path) -> Path:
    """OUT.json and OUT.md beside it, each whole or not at all."""
    path = Path(path)
    write_report(path, json.dumps(report, indent=1, default=str) + "\n")
    md = path.with_suffix(".md")
    write_report(md, markdown(report, path.parent))
    return md


def plots(report: dict, out_dir: str | Path) -> list[str]:
    """latency.png (p50/p90/p99 vs load, the SLO line), throughput.png (achieved vs offered),
    cdf.png (latency CDF per step). Needs matplotlib (branchsearch[plots])."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BranchsearchError("--plots needs matplotlib: pip install 'branchsearch[plots]'") \
            from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    steps = [s for s in report["steps"] if s["latency_ms"]["p50"] is not None]
    if not steps:
        return []
    xs = [_x(s) for s in steps]
    target = report["target"]
    title = (f"{target.get('kind')} {target.get('executor') or target.get('url', '')} — "
             f"{Path(report['workload']['source']).name[:40]}")
    paths = []

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for q, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^-")):
        ax.plot(xs, [s["latency_ms"][q] for s in steps], style, label=q)
    if "slo" in report:
        ax.axhline(report["slo"]["p99_ms"], color="red", lw=0.8, ls=":", label="SLO p99")
    if report["knee"]["knee"] is not None:
        ax.axvline(report["knee"]["knee"], color="grey", lw=0.8, ls="--", label="knee")
    ax.set(xlabel=load_label(report), ylabel="client latency (ms)", yscale="log", title=title)
    ax.legend(fontsize=8)
    paths.append(_save(fig, out / "latency.png"))

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(xs, [s["achieved_rate"] for s in steps], "o-", label="achieved (ok answers/s)")
    if report["arrivals"]["loop"] == "open":
        ax.plot(xs, [s["offered_rate"] for s in steps], "x:", color="grey",
                label="offered (sent/s)")
    ax.set(xlabel=load_label(report), ylabel="answers per second", title=title)
    ax.legend(fontsize=8)
    paths.append(_save(fig, out / "throughput.png"))

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for s in steps:
        lat = s["latencies_ms"]
        if lat:
            ax.plot(lat, [(i + 1) / len(lat) for i in range(len(lat))], drawstyle="steps-post",
                    label=f"{_x(s):.3g}")
    ax.set(xlabel="client latency (ms)", ylabel="share of requests", xscale="log",
           title="latency CDF per step")
    ax.legend(title=load_label(report), fontsize=7)
    paths.append(_save(fig, out / "cdf.png"))
    return paths


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return str(path)
