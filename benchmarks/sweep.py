"""What a sweep saves: a 4-point sweep over an alignment setting against the same 4 pipeline runs one by one, --fresh.

usage: python benchmarks/sweep.py [--recipe tiny] [--scale 0.1] [--values 0,0.02,0.04,0.08] [--work DIR]
       python benchmarks/sweep.py --parallel 2 [--scale 0.1] [--grid cold_start_sft.train.seed=1,2,3,4]
                                  [--stages cold_start_sft,reasoning_grpo]

Both ways run the whole recipe (five stages) four times, once per value of `alignment_grpo.grpo.loss.beta`:
  sweep   `r1 sweep --grid alignment_grpo.grpo.loss.beta=<values>` in a fresh R1_HOME: the four points share cold start,
          reasoning GRPO, rejection sampling and SFT (trained once), and run alignment four times;
  fresh   `r1 run --fresh --set alignment_grpo.grpo.loss.beta=<value>` four times, one after another, in another fresh
          R1_HOME: every stage trained four times.
With `--parallel N`: the same sweep (`--grid`, points that share no stage) run by `r1 sweep --parallel 1` and by
`r1 sweep --parallel N`, each in a fresh R1_HOME, one after the other; printed: each one's wall time and points an
hour, and N's over 1's (the goal on a 2-core machine: N = 2 at least as many points an hour as 1).
`--scale` multiplies every stage's step and data counts of the recipe (0.1: a tenth of the tiny recipe's, minutes
rather than an hour; 1: the recipe as written). Printed: the CPU, each way's wall time and the machine's other load
in the same window (`other_cores`: busy CPU seconds of every other process / wall, /proc/stat), the stage runs each
way trained (not reused), and fresh/sweep. Quote the CPU line with the figures, and compare runs with other_cores
near 0.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
COUNTS = ("max_steps", "num_train", "num_heldout", "num_prompts", "target_samples", "warmup_steps",
          "non_reasoning_rows")


def busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (every core, every process): /proc/stat's first line."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def children_seconds() -> float:
    usage = os.times()
    return usage.children_user + usage.children_system


def cpu_line() -> str:
    model = ""
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("Flags:"):
                flags = line.split()
                model += ", avx512_bf16" if "avx512_bf16" in flags else ", no avx512_bf16"
                model += ", avx512f" if "avx512f" in flags else ", AVX2 only"
    except (OSError, subprocess.CalledProcessError):
        pass
    return f"cpu {model or '?'}; {os.cpu_count()} cores; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"


def scaled(data, scale: float):
    """The recipe with every count in COUNTS scaled (at least 1; warm-up at least 0)."""
    if isinstance(data, dict):
        return {k: (max(0 if k == "warmup_steps" else 1, round(v * scale)) if k in COUNTS and isinstance(v, int)
                    else scaled(v, scale)) for k, v in data.items()}
    if isinstance(data, list):
        return [scaled(v, scale) for v in data]
    return data


def env_for(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_", "R1_"))}
    env.update({"R1_HOME": str(home), "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)})
    return env


def timed(commands: list[list[str]], home: Path, log: Path) -> dict:
    busy, own, start = busy_seconds(), children_seconds(), time.monotonic()
    with open(log, "w") as out:
        for argv in commands:
            subprocess.run([sys.executable, "-m", "flows.cli", *argv], cwd=ROOT, env=env_for(home), check=True,
                           stdout=out, stderr=subprocess.STDOUT)
    wall = time.monotonic() - start
    own = children_seconds() - own
    others = max(0.0, busy_seconds() - busy - own)
    return {"wall_s": round(wall, 1), "other_cores": round(others / wall, 2), "trained": trained(home)}


def trained(home: Path) -> dict[str, int]:
    """Stage runs that trained (not reused), by stage, in the home's MLflow store."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    counts: dict[str, int] = {}
    experiments = [e.experiment_id for e in client.search_experiments()]
    for run in client.search_runs(experiments, "attributes.status = 'FINISHED'", max_results=5000):
        stage = run.data.tags.get("stage")
        if stage and "r1.reused_from" not in run.data.tags:
            counts[stage] = counts.get(stage, 0) + 1
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="tiny")
    ap.add_argument("--scale", type=float, default=0.1)
    ap.add_argument("--values", default="0,0.02,0.04,0.08", help="alignment_grpo.grpo.loss.beta's values")
    ap.add_argument("--work", default=None, help="a folder for the two homes and the logs (default: a temporary one)")
    ap.add_argument("--parallel", type=int, default=0, help="compare `r1 sweep --parallel 1` with this many at once")
    ap.add_argument("--grid", default="cold_start_sft.train.seed=1,2,3,4", help="the sweep's axis (with --parallel)")
    ap.add_argument("--stages", default="cold_start_sft,reasoning_grpo", help="the stages (with --parallel)")
    args = ap.parse_args()
    from grpo.configs.recipe import load_recipe

    work = Path(args.work or tempfile.mkdtemp(prefix="sweep-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    recipe = scaled(load_recipe(args.recipe).model_dump(mode="json", exclude={"sweep"}), args.scale)
    recipe["name"] = f"{recipe['name']}-x{args.scale:g}"
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    values = [v.strip() for v in args.values.split(",")]
    print(cpu_line(), flush=True)
    if args.parallel:
        points = len(args.grid.split("=", 1)[1].split(","))
        print(f"recipe {args.recipe} scaled by {args.scale:g}; {points} points ({args.grid}); stages {args.stages}")
        rates = {}
        for n in (1, args.parallel):
            home = work / f"parallel-{n}"
            shutil.rmtree(home, ignore_errors=True)
            run = timed([["sweep", "--recipe", str(path), "--grid", args.grid, "--stages", args.stages,
                          "--parallel", str(n)]], home, work / f"parallel-{n}.log")
            rates[n] = points * 3600 / run["wall_s"]
            print(f"--parallel {n}: {run}, {rates[n]:.1f} points an hour", flush=True)
        print(f"--parallel {args.parallel} / --parallel 1, points an hour: {rates[args.parallel] / rates[1]:.2f}x; "
              f"{cpu_line()}")
        return
    print(f"recipe {args.recipe} scaled by {args.scale:g}; alignment_grpo.grpo.loss.beta in {values}", flush=True)
    for home in ("sweep", "fresh"):
        shutil.rmtree(work / home, ignore_errors=True)
    sweep = timed([["sweep", "--recipe", str(path), "--grid", f"alignment_grpo.grpo.loss.beta={','.join(values)}"]],
                  work / "sweep", work / "sweep.log")
    print(f"sweep: {sweep}", flush=True)
    fresh = timed([["run", "--recipe", str(path), "--fresh", "--set", f"alignment_grpo.grpo.loss.beta={v}"]
                   for v in values], work / "fresh", work / "fresh.log")
    print(f"fresh: {fresh}", flush=True)
    print(f"fresh/sweep wall time: {fresh['wall_s'] / sweep['wall_s']:.2f}x; {cpu_line()}")


if __name__ == "__main__":
    main()
