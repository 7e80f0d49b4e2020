"""Evaluation reports: one JSON, a Markdown summary beside it, and PNG plots (matplotlib)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from branchsearch.infra.ids import shown_id
from branchsearch.orchestrator.evaluation.measures import mean, recall_at

SUMMARY_METRICS = ("recall@2", "recall@5", "all_recall@5", "recall@10", "all_recall@10",
                   "ndcg@10", "trajectory_recall", "precision", "f1", "prune_accuracy",
                   "bridge_preserved", "answer_found", "context_tokens_final", "tokens_read",
                   "turns", "tool_calls", "tool_calls_per_turn", "branches", "forks", "chains",
                   "bridges", "covered", "latency_ms_p50", "latency_ms_p90")


def write_json(path: Path, data) -> None:
    write_report(path, json.dumps(data, indent=2, default=str))


def write_report(path: Path, text: str) -> None:
    """Atomic: a crash or a full disk never leaves a half-written report, nor its partial
    temporary copy beside it."""
    from branchsearch.infra.textfile import output_path

    path.parent.mkdir(parents=True, exist_ok=True)
    path = output_path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# what Markdown reads as markup in the middle of a line or a table cell (an underscore only at
# a word's edge: `not_in_corpus` is no emphasis); a backslash before each makes it literal
_MARKUP = re.compile(r"[\\`*\[\]<&|~]|(?<!\w)_|_(?!\w)")


def _escaped(text: str) -> str:
    return _MARKUP.sub(lambda m: "\\" + m.group(0), text)


def md_id(qid: str) -> str:
    """An id (a query's, a document's) for Markdown text or a table cell: as the terminal shows
    it (`shown_id`: quoted with Python's escapes when a character does not show, so a line
    separator is `\\u2028`, not a line break), with Markdown's markup characters escaped, so
    that a '|' stays in its cell, '<b>' shows as written and a backtick opens no code span."""
    return _escaped(shown_id(qid))


def md_text(text: str) -> str:
    """Text (a question, a note) for one Markdown line: what does not print becomes a space,
    whitespace runs one space, markup characters escaped."""
    return _escaped(" ".join("".join(c if c.isprintable() else " " for c in str(text)).split()))


def _md_ids(ids) -> str:
    return "[" + ", ".join(map(md_id, ids)) + "]"


def markdown(report: dict) -> str:
    """The report for a reader: the summary table, attribution with examples, the paired
    comparisons. The dataset path, index and embedding names, ids, questions and notes are
    escaped (`md_id`, `md_text`): the title is one line and one table row is one query
    whatever a path or an id holds; the JSON keeps them exactly."""
    runs = report["runs"]
    lines = [f"# Evaluation: {md_id(str(report['dataset']))}", "",
             f"{runs[0]['queries']} queries, split {report.get('split', '?')}. Document-level "
             "metrics (a document ranks by its best chunk).", "",
             f"Index {md_id(str(report.get('index', '?')))}, embedding: "
             f"{md_id(str(report.get('embedding') or 'none'))}.", ""]
    notes = report.get("notes", [])
    lines += [f"* {md_text(n)}" for n in notes] + [""] * bool(notes)
    lines += ["| metric | " + " | ".join(r["config"] for r in runs) + " |",
              "|---|" + "---|" * len(runs)]
    for m in SUMMARY_METRICS:
        if any(m in r["metrics"] for r in runs):
            cells = [f"{r['metrics'][m]:.4g}" if m in r["metrics"] else "–" for r in runs]
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
    attributed = [r for r in runs if "attribution" in r]
    if attributed:
        lines += ["", "## Failure attribution", "", "| class | " +
                  " | ".join(r["config"] for r in attributed) + " |",
                  "|---|" + "---|" * len(attributed)]
        for c in attributed[0]["attribution"]:
            lines.append(f"| {c} | " + " | ".join(str(r["attribution"][c]) for r in attributed)
                         + " |")
        lines += ["", "Examples (two per failure class, first run):", ""]
        for c in attributed[0]["attribution"]:
            if c == "ok":
                continue
            for p in [p for p in attributed[0]["per_query"] if p["attribution"] == c][:2]:
                lines.append(f"* **{c}** {md_id(p['id'])} — {md_text(p['question'])} gold "
                             f"{_md_ids(p['gold'])}, culprits {_md_ids(p['culprits'])}, "
                             f"top-5 {_md_ids(p['ranking'][:5])}")
    for cmp in report.get("comparisons", []):
        lines += ["", f"## Paired: {cmp['agent']} vs {cmp['baseline']} ({cmp['measure']})", "",
                  f"wins {cmp['wins']}, losses {cmp['losses']}, ties {cmp['ties']}", ""]
        if cmp.get("note"):
            lines += [f"Note: {cmp['note']}.", ""]
        lines += ["| measure | difference (agent − baseline) |", "|---|---|"]
        lines += [f"| {m} | {d:+.4g} |" for m, d in cmp["difference"].items()]
        changed = [row for row in cmp["per_query"] if row["outcome"] != "tie"]
        if changed:
            lines += ["", "| query | agent | baseline | outcome |", "|---|---|---|---|"]
            lines += [f"| {md_id(r['id'])} | {r['agent']:.3g} | {r['baseline']:.3g} | "
                      f"{r['outcome']} |" for r in changed[:40]]
    if report.get("plots"):
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})"
                                         for p in report["plots"]]
    return "\n".join(lines) + "\n"


def plots(report: dict, gold: dict[str, dict], out_dir: Path) -> list[str]:
    """recall@k curves per configuration, context tokens per turn, attribution bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    fig, ax = plt.subplots(figsize=(6, 4))
    ks = range(1, 11)
    for run in report["runs"]:
        curve = [mean([recall_at(p["ranking"], gold[p["id"]], k) for p in run["per_query"]])
                 for k in ks]
        ax.plot(list(ks), curve, marker="o", label=run["config"])
    ax.set(xlabel="k (documents)", ylabel="recall@k", title=report["dataset"])
    ax.grid(alpha=0.3)
    ax.legend()
    written.append(_save(fig, out_dir / "recall_at_k.png", plt))

    agent_runs = [r for r in report["runs"] if r["per_query"] and
                  "context_tokens_per_turn" in r["per_query"][0]]
    if agent_runs:
        fig, ax = plt.subplots(figsize=(6, 4))
        for run in agent_runs:
            series = [t for p in run["per_query"] for t in p["context_tokens_per_turn"]]
            longest = max((len(t) for t in series), default=0)
            curve = [mean([t[i] for t in series if len(t) > i]) for i in range(longest)]
            ax.plot(range(1, longest + 1), curve, marker="o", label=run["config"])
        ax.set(xlabel="turn", ylabel="context tokens (mean over branches)",
               title="Context tokens per turn")
        ax.grid(alpha=0.3)
        ax.legend()
        written.append(_save(fig, out_dir / "context_tokens_per_turn.png", plt))
        fig, ax = plt.subplots(figsize=(7, 4))
        classes = list(agent_runs[0]["attribution"])
        width = 0.8 / len(agent_runs)
        for i, run in enumerate(agent_runs):
            ax.bar([x + i * width for x in range(len(classes))],
                   [run["attribution"][c] for c in classes], width, label=run["config"])
        ax.set_xticks([x + width * (len(agent_runs) - 1) / 2 for x in range(len(classes))],
                      classes)
        ax.set(ylabel="queries", title="Failure attribution")
        ax.legend()
        written.append(_save(fig, out_dir / "attribution.png", plt))
    return written


def _save(fig, path: Path, plt) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
