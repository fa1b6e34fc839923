"""DeepSeekMath's unified view, run as the user runs it: `r1 sweep --recipe unified_view`, then its tables.

usage: python benchmarks/unified_view.py [--recipe unified_view] [--seeds N] [--parallel K] [--work DIR]

The questions are the recipe's (recipes/unified_view.yaml, its `sweep:` variants): for reasoning, offline RFT (the
cold start's frozen samples, the correct ones trained on), online RFT, GRPO with outcome and with process
supervision, and PPO, each from the one cold start on the same prompts and budget; for alignment, the whole recipe
with its last stage as a reward model + GRPO, the reward model retrained on the policy's samples, and DPO. This
script runs that sweep with the command line in a home of its own (`--work`/home: the same command again goes on
where it stopped, skipping finished points), then reads the sweep's points.csv and MLflow store for the two tables:
means ± std (sample std, over seeds) of the held-out figures, the last 25 GRPO steps' batch accuracy, and each
row's minutes (the wall time of its last stage's run: the variant's own training and evaluation, wherever a point
that shares it trained it). CPU figures: quote `lscpu`'s model name and flags with them (printed first).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.sweep import cpu_line, env_for  # noqa: E402

REASONING = {"offline_rft": "offline RFT", "online_rft": "online RFT", "grpo_outcome": "GRPO, outcome",
             "grpo_process": "GRPO, process", "ppo": "PPO"}
ALIGNMENT = {"rm_grpo": "reward model + GRPO", "iterative_rm": "iterative reward model + GRPO", "dpo": "DPO"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="unified_view")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per variant (default: the recipe's)")
    ap.add_argument("--parallel", type=int, default=1, help="points at once (processes sharing the cores)")
    ap.add_argument("--work", default=None, help="folder for the sweep's home and log (default: a temporary one)")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="unified-view-"))
    work.mkdir(parents=True, exist_ok=True)
    home = work / "home"
    print(cpu_line(), flush=True)
    argv = [sys.executable, "-m", "flows.cli", "sweep", "--recipe", args.recipe,
            *(["--seeds", str(args.seeds)] if args.seeds else []), "--parallel", str(args.parallel)]
    points_csv = None
    with open(work / "sweep.log", "a") as log, subprocess.Popen(
            argv, cwd=ROOT, env=env_for(home), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            log.write(line)
            if line.startswith(("sweep of", "MLflow sweep run")) or " - point " in line:
                print(line.rstrip(), flush=True)
            if line.strip().startswith("points :"):
                points_csv = Path(line.split(":", 1)[1].strip())
    if proc.returncode != 0 or points_csv is None:
        sys.exit(f"the sweep stopped (exit {proc.returncode}); its log: {work / 'sweep.log'}")
    tables(pd.read_csv(points_csv), home)
    print(f"\npoints: {points_csv}\nlog: {work / 'sweep.log'}")


def tables(points: pd.DataFrame, home: Path) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    extra = {row.point: stage_figures(client, row.pipeline_run) for row in points.itertuples()}
    points = points.assign(batch_accuracy_last25=[extra[p]["batch_accuracy_last25"] for p in points["point"]],
                           minutes=[extra[p]["minutes"] for p in points["point"]])

    def cell(rows: pd.DataFrame, column: str) -> str:
        xs = [x for x in rows[column].tolist() if x == x] if column in rows else []
        if not xs:
            return "-"
        return f"{statistics.mean(xs):.3f}" + (f" ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else "")

    def minutes(rows: pd.DataFrame) -> str:
        return f"{rows['minutes'].mean():.1f}"

    first = points.iloc[0]
    r, a = "reasoning_grpo/eval/", "alignment_grpo/"
    print("\n| reasoning | seeds | held-out accuracy | step accuracy | batch accuracy (last 25 steps) | minutes |")
    print("|---|---|---|---|---|---|")
    print(f"| cold start (before) | | {first.get('cold_start_sft/eval/accuracy', float('nan')):.3f} | "
          f"{first.get('cold_start_sft/eval/step_accuracy', float('nan')):.3f} | | |")
    for variant, name in REASONING.items():
        rows = points[points["variant"] == variant]
        if len(rows):
            print(f"| {name} | {len(rows)} | {cell(rows, r + 'accuracy')} | {cell(rows, r + 'step_accuracy')} | "
                  f"{cell(rows, 'batch_accuracy_last25')} | {minutes(rows)} |")
    print("\n| alignment | seeds | held-out accuracy | pair accuracy | harmful refused | benign helpful | "
          "minutes |")
    print("|---|---|---|---|---|---|---|")
    rows = points[points["variant"] == "rm_grpo"]  # each seed's SFT start, once (every alignment row starts there)
    if len(rows):
        print(f"| SFT start (before) | {len(rows)} | {cell(rows, a + 'eval/accuracy_before')} | | "
              f"{cell(rows, a + 'alignment/harmful_refused_before')} | "
              f"{cell(rows, a + 'alignment/benign_helpful_before')} | |")
    for variant, name in ALIGNMENT.items():
        rows = points[points["variant"] == variant]
        if len(rows):
            pairs = rows.get(a + "dpo/heldout_accuracy") if variant == "dpo" else rows.get(a + "rm/heldout_accuracy")
            print(f"| {name} | {len(rows)} | {cell(rows, a + 'eval/accuracy')} | "
                  f"{cell(pd.DataFrame({'p': pairs if pairs is not None else []}), 'p')} | "
                  f"{cell(rows, a + 'alignment/harmful_refused')} | {cell(rows, a + 'alignment/benign_helpful')} | "
                  f"{minutes(rows)} |")


def stage_figures(client, pipeline_run: str) -> dict[str, float]:
    """A point's last stage: the mean batch accuracy of its last 25 GRPO steps (nan where it ran no GRPO), and the
    minutes its run took."""
    stages = client.search_runs([client.get_run(pipeline_run).info.experiment_id],
                                f"tags.mlflow.parentRunId = '{pipeline_run}' and attributes.status = 'FINISHED'")
    last = max(stages, key=lambda s: s.info.start_time)
    work = client.get_run(last.data.tags.get("r1.reused_from", last.info.run_id))  # the run that trained it
    minutes = (work.info.end_time - work.info.start_time) / 60000
    work = work.info.run_id
    history = sorted(client.get_metric_history(work, "reward/accuracy"), key=lambda m: m.step)[-25:]
    return {"batch_accuracy_last25": statistics.mean(m.value for m in history) if history else float("nan"),
            "minutes": minutes}


if __name__ == "__main__":
    main()
