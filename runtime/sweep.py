"""What a sweep shows in MLflow: its run, its points' pipeline runs nested under it, the table and the plots.

The sweep run is a parent run like a pipeline's (`r1_sweep:<recipe name>`), tagged `r1.sweep.key`, a digest of what
decides its points (the recipe, the grid, the seeds, the stages, the code), so the same command again finds it and
goes on in it. Each point's pipeline run is nested under it (`mlflow.parentRunId`, with `r1.sweep` and
`r1.sweep.point`): MLflow's runs table folds a sweep's pipeline runs under it, and theirs stage runs under each, so a
sweep is one row until opened; nesting rather than tags alone because the UI draws the tree from the parent tag.

Logged on the sweep run once the points are done:
- `sweep/points.csv` and the MLflow table `sweep/points.json`: one row per point, its settings, its seed, its
  pipeline run and every headline number its stages recorded (`<stage>/<metric>`);
- `sweep/summary.csv` and `sweep/summary.json`: one row per setting, the final held-out numbers' mean and spread
  (standard deviation over the seeds; 0 with one seed) and the seed count;
- `sweep/plots/<metric>--<setting>.png`: each final held-out number against each swept setting that takes two
  values or more, a line per value of the other settings, every seed a dot, the mean joined (a flat line on an axis
  of its own scale, not noise filling it); `sweep/plots/curves--<stage>.png`: the stage's training
  curve (GRPO's reward, SFT's loss) of every point overlaid, where the points' runs of it differ.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Any

import pandas as pd

from runtime import tracking

KEY = "r1.sweep.key"  # tag of the sweep run: what decides its points
SWEEP = "r1.sweep"  # tag of a point's pipeline run: its sweep run
POINT = "r1.sweep.point"  # tag of a point's pipeline run: its settings and seed (grpo.sweep.Point.key)
FIGSIZE, DPI = (6.4, 4.0), 100  # every plot is 640 x 400 pixels
# a stage's training curve, by the first of these its run logged over more than one step
CURVES = ("reward/total", "train/loss", "loss", "rm/loss", "dpo/loss")


def sweep_key(recipe, sweep, stages: list[str]) -> str:
    from runtime.reuse import code_version

    blob = json.dumps({"recipe": recipe.model_dump(mode="json", exclude={"sweep"}), "grid": sweep.grid,
                       **({"variants": sweep.variants} if sweep.variants else {}),
                       "seeds": sweep.seeds, "seed_stages": sweep.seed_stages, "stages": stages,
                       "code": code_version()}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def find_sweep_run(key: str):
    """The newest sweep run with this key (any status), or None."""
    return next(iter(tracking.find_runs(f"tags.`{KEY}` = '{key}'")), None)


def finished_points(sweep_run_id: str) -> dict[str, str]:
    """{point key: pipeline run id} of the sweep's points that finished."""
    runs = tracking.find_runs(f"tags.`{SWEEP}` = '{sweep_run_id}' and attributes.status = 'FINISHED'")
    found: dict[str, str] = {}
    for run in reversed(runs):  # the newest last, so it wins
        found[run.data.tags[POINT]] = run.info.run_id
    return found


def point_tags(sweep_run_id: str, point) -> dict[str, str]:
    return {"mlflow.parentRunId": sweep_run_id, SWEEP: sweep_run_id, POINT: point.key(),
            "r1.sweep.index": str(point.index), "r1.sweep.label": point.label()[:4000]}


def final_metrics(columns: list[str], stages: list[str]) -> list[str]:
    """The final held-out numbers: the last stage's held-out figures after training (its metrics named eval or
    heldout, and alignment's refusal shares on held-out prompts; not the `_before` ones), or all of the last stage's
    numbers where it names none such."""
    for stage in reversed(stages):
        mine = [c for c in columns if c.startswith(f"{stage}/") and not c.endswith("_before")]
        if mine:
            held = [c for c in mine if "eval" in c or "heldout" in c or  # and alignment's refusal shares
                    c.split("/", 1)[1].startswith("alignment/") and not c.endswith(("_prompts", "_requests",
                                                                                      "_ci_low", "_ci_high", "_p",
                                                                                      "_n"))]
            return held or mine
    return []


def points_table(points, runs: dict[int, str]) -> pd.DataFrame:
    """One row per point: its index, settings, seed, pipeline run and the headline numbers its parent run holds."""
    c = tracking.client()
    rows = []
    for point in points:
        run = c.get_run(runs[point.index])
        rows.append({"point": point.index, **{k: _cell(v) for k, v in point.settings.items()}, "seed": point.seed,
                     "pipeline_run": run.info.run_id, **dict(sorted(run.data.metrics.items()))})
    return pd.DataFrame(rows)


def _cell(value: Any) -> Any:
    return value if isinstance(value, (int, float, str, bool)) or value is None else json.dumps(value)


def summary_table(table: pd.DataFrame, settings: list[str], metrics: list[str]) -> pd.DataFrame:
    """One row per setting: each final number's mean and spread over the seeds (std, 0 with one seed), and n."""
    rows = []
    groups = table.groupby(settings, sort=False, dropna=False) if settings else [((), table)]
    for values, group in groups:
        values = values if isinstance(values, tuple) else (values,)
        row = dict(zip(settings, values))
        for m in metrics:
            column = group[m].dropna() if m in group else pd.Series(dtype=float)
            row[f"{m} mean"] = float(column.mean()) if len(column) else float("nan")
            row[f"{m} std"] = float(column.std(ddof=0)) if len(column) else float("nan")
        row["seeds"] = len(group)
        rows.append(row)
    return pd.DataFrame(rows)


def text_table(summary: pd.DataFrame, settings: list[str], metrics: list[str]) -> str:
    """The summary as the terminal shows it: each setting (by its last name), then `mean ± std` of each final
    number (without its stage where they share one)."""
    from grpo.sweep import short_names

    names = short_names(settings)
    stages = {m.split("/", 1)[0] for m in metrics}
    shown_metric = {m: m.split("/", 1)[1] if len(stages) == 1 and "/" in m else m for m in metrics}
    shown = pd.DataFrame({**{names[s]: summary[s].map(_short) for s in settings},
                          **{shown_metric[m]: [f"{a:.3f} ± {b:.3f}" if a == a else "-"
                                               for a, b in zip(summary[f"{m} mean"], summary[f"{m} std"])]
                             for m in metrics}, "seeds": summary["seeds"]})
    return shown.to_string(index=False)


def _short(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _figure():
    import matplotlib

    matplotlib.use("Agg")  # no display; safe from any thread
    from matplotlib.figure import Figure

    return Figure(figsize=FIGSIZE, dpi=DPI)


def _png(fig) -> bytes:
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=DPI)  # not bbox "tight": every plot keeps FIGSIZE x DPI pixels
    return out.getvalue()


def setting_plots(table: pd.DataFrame, settings: list[str], metrics: list[str]) -> dict[str, bytes]:
    """{file name: PNG} of each final number against each swept setting."""
    return {name: _png(fig) for name, fig in setting_figures(table, settings, metrics).items()}


def setting_figures(table: pd.DataFrame, settings: list[str], metrics: list[str]) -> dict:
    """{file name: matplotlib Figure} of each final number against each swept setting (`setting_plots`' figures)."""
    from grpo.sweep import short_names

    plots, short = {}, short_names(settings)
    for metric in metrics:
        for setting in settings:
            table_m = table[table[metric].notna()] if metric in table else table.iloc[:0]
            if table_m.empty or table_m[setting].nunique(dropna=False) < 2:  # nothing to set side by side
                continue
            fig = _figure()
            ax = fig.add_subplot()
            values = list(dict.fromkeys(table_m[setting]))  # in the sweep's order
            x = {v: i for i, v in enumerate(values)}
            others = [s for s in settings if s != setting]
            groups = table_m.groupby(others, sort=False, dropna=False) if others else [((), table_m)]
            for label, group in groups:
                label = label if isinstance(label, tuple) else (label,)
                name = ", ".join(f"{short[s]}={_short(v)}" for s, v in zip(others, label)) or metric
                means = group.groupby(setting, sort=False)[metric].mean()
                line = ax.plot([x[v] for v in means.index], means.values, marker="o", label=name)[0]
                ax.scatter([x[v] for v in group[setting]], group[metric], color=line.get_color(), alpha=0.4, s=14)
            ax.set_xticks(range(len(values)), [_short(v) for v in values])
            ax.set_xlabel(setting)
            ax.set_ylabel(metric)
            title = f"{metric} by {short[setting]} (dots: seeds, line: their mean)"
            low, high = float(table_m[metric].min()), float(table_m[metric].max())
            if high - low <= 1e-9 * max(1.0, abs(high)):  # all equal: a flat line, not noise magnified to fill the axis
                pad = max(abs(high) * 0.1, 0.05)
                ax.set_ylim(low - pad, high + pad)
                title += f": all {_short(high)}"
            ax.set_title(title, fontsize=10)
            if others:
                ax.legend(fontsize=8)
            fig.tight_layout()
            plots[f"{_file(metric)}--{_file(setting)}.png"] = fig
    return plots


def _file(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in name)


def curve_plots(points, runs: dict[int, str], stages: list[str]) -> dict[str, bytes]:
    """{file name: PNG} of each stage's training curve, the points overlaid, for stages the points ran apart."""
    from runtime.reuse import REUSED_FROM

    c = tracking.client()
    plots = {}
    by_stage: dict[str, dict[str, list[int]]] = {}  # stage -> the run that did the work -> points
    for point in points:
        children = tracking.find_runs(f"tags.mlflow.parentRunId = '{runs[point.index]}' and "
                                      "attributes.status = 'FINISHED'")
        for run in reversed(children):  # the newest of a stage last, so it wins
            stage = run.data.tags.get("stage")
            work = run.data.tags.get(REUSED_FROM, run.info.run_id)
            for other in by_stage.get(stage, {}).values():  # a stage run again within the point: the newest only
                if point.index in other:
                    other.remove(point.index)
            by_stage.setdefault(stage, {}).setdefault(work, []).append(point.index)
    for stage in stages:
        works = {work: indices for work, indices in by_stage.get(stage, {}).items() if indices}
        if len(works) < 2:  # one run shared by every point: nothing to compare
            continue
        curves = {}
        for work, indices in works.items():
            metrics = c.get_run(work).data.metrics
            name = next((m for m in CURVES if m in metrics and len(c.get_metric_history(work, m)) > 1), None)
            if name:
                history = sorted(c.get_metric_history(work, name), key=lambda m: m.step)
                curves[work] = (name, [m.step for m in history], [m.value for m in history], indices)
        if len(curves) < 2:
            continue
        fig = _figure()
        ax = fig.add_subplot()
        for name, steps, values, indices in curves.values():
            label = "; ".join(points[i].label(short=True) for i in indices)
            ax.plot(steps, values, label=label if len(label) < 70 else label[:67] + "...")
        ax.set_xlabel("step")
        ax.set_ylabel(next(iter(curves.values()))[0])
        ax.set_title(f"{stage}: one curve per run", fontsize=10)
        ax.legend(fontsize=6)
        fig.tight_layout()
        plots[f"curves--{stage}.png"] = _png(fig)
    return plots


def log_results(sweep_run_id: str, points, runs: dict[int, str], stages: list[str], work: Path) -> tuple[str, dict]:
    """Tables and plots onto the sweep run (and under `work`); returns the terminal's table and the files made."""
    table = points_table(points, runs)
    settings = list(points[0].settings) if points else []
    numbers = [c for c in table.columns if "/" in c]
    finals = {p.index: final_metrics([c for c in numbers if pd.notna(table.at[p.index, c])], list(p.stages))
              for p in points}  # each point's own last stage's figures
    metrics = list(dict.fromkeys(m for p in points for m in finals[p.index]))
    compared = table.copy()  # a point counts only in its own final figures (not in a stage it shares, reused)
    for p in points:
        compared.loc[p.index, [m for m in metrics if m not in finals[p.index]]] = float("nan")
    summary = summary_table(compared, settings, metrics)
    work.mkdir(parents=True, exist_ok=True)
    table.to_csv(work / "points.csv", index=False)
    summary.to_csv(work / "summary.csv", index=False)
    plots = {**setting_plots(compared, settings, metrics), **curve_plots(points, runs, stages)}
    (work / "plots").mkdir(exist_ok=True)
    for name, png in plots.items():
        (work / "plots" / name).write_bytes(png)
    tracking.log_dir(sweep_run_id, work, "sweep")
    tracking.log_table(sweep_run_id, table, "sweep/points.json")
    tracking.log_table(sweep_run_id, summary, "sweep/summary.json")
    return text_table(summary, settings, metrics), {"points": work / "points.csv", "summary": work / "summary.csv",
                                                    "plots": sorted(work.glob("plots/*.png"))}
