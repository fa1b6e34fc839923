"""What `r1 run` and `r1 stage` print when they end: a table of the stages that fits 120 columns, and the command that
prints every figure.

One row a stage: its key figure before -> after (held-out accuracy; the keep rate for rejection sampling), the rows
it kept where it keeps rows, its MLflow run. Under the table, wrapped to the same width, what a cell cannot hold: a
paired change's interval, what rejection sampling dropped and why, a registered model. Every other figure a stage
logged is one command away: `r1 show <run id>` (flows/cli/compare.py).
"""

from __future__ import annotations

import math
import textwrap

from runtime.stage import StageResult

WIDTH = 120  # a terminal's columns the summary fits in
KEY = "eval/accuracy"  # a stage's key figure: its held-out accuracy (before and after where it logs both)
HEADER = ("stage", "figure", "before -> after", "kept rows", "MLflow run")


def _number(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.3f}"


def change(metrics: dict[str, float], key: str) -> str:
    """`key`'s cell: after alone, or before -> after with the difference (and p where a paired test logged one).

    >>> change({"eval/accuracy_before": 0.49, "eval/accuracy": 0.63}, "eval/accuracy")
    '0.490 -> 0.630 (+0.140)'
    >>> change({"eval/accuracy": 0.49}, "eval/accuracy")
    '0.490'
    """
    after, before = metrics.get(key), metrics.get(f"{key}_before")
    if before is None or after is None:
        return _number(after)
    p = metrics.get(f"{key}_p")
    return f"{before:.3f} -> {after:.3f} ({after - before:+.3f}" + (f", p {p:.2g})" if p is not None else ")")


def row(name: str, result: StageResult) -> tuple[str, str, str, str, str]:
    """The stage's row: stage, figure, before -> after, kept rows, run id."""
    m = result.metrics
    if "rejection/keep_rate" in m or "rejection/kept" in m:
        kept = m.get("rejection/kept")
        return (name, "keep rate", _number(m.get("rejection/keep_rate")), "-" if kept is None else str(int(kept)),
                result.run_id)
    return name, KEY if KEY in m else "-", change(m, KEY), "", result.run_id


def notes(name: str, result: StageResult) -> list[str]:
    """What a cell cannot hold: rejection sampling's counts, each paired change with its interval, a registered model
    (a URI outside the stage's own run)."""
    from grpo.rejection.filters import summary_line
    from grpo.stats import logged_changes

    m = result.metrics
    found = [summary_line(m)] if "rejection/kept" in m else []
    found += [f"{key}: {line}" for key, line in logged_changes(m).items()]
    found += [f"{key}: {uri}" for key, uri in result.uris.items() if not uri.startswith("runs:/")]
    return [f"{name}: {text}" for text in found]


def table(results: dict[str, StageResult], show_run: str) -> str:
    """The stages as a table, the notes under it, and the `r1 show` command for `show_run`'s every figure."""
    from runtime.ui_links import tool_command

    rows = [HEADER, *(row(name, r) for name, r in results.items())]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER) - 1)]
    lines = ["  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths)) + "  " + r[-1] for r in rows]
    for name, r in results.items():
        for text in notes(name, r):
            lines += textwrap.wrap(text, WIDTH, initial_indent="  ", subsequent_indent="      ")
    lines.append(f"  every figure each stage logged: {tool_command('r1')} show {show_run}")
    return "\n".join(lines)
