"""A stage alone against the same stage beside CPU-bound jobs: what sharing the machine costs it.

Runs `r1 stage cold_start_sft` on a short cold start (the tiny recipe's, `--steps` steps, a small evaluation) on a
fresh home each time, in turns: alone, then beside `--busy` processes that spin on a core each (`while True: pass`),
`--pairs` times, and prints each run's wall time and the busy/alone ratio. `--env K=V` sets a variable for the stage
(e.g. `OMP_WAIT_POLICY=PASSIVE`, `OMP_NUM_THREADS=1`) to see what it changes; a fair share of 2 cores beside one
spinning job is 1.5x (the stage's 2 threads get 2 of 3 runnable threads' time), beside two 2x.

    .venv/bin/python benchmarks/stage_beside_jobs.py --busy 1 --pairs 2
    .venv/bin/python benchmarks/stage_beside_jobs.py --busy 1 --pairs 2 --env OMP_WAIT_POLICY=PASSIVE
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def recipe(folder: Path, steps: int, precision: str) -> Path:
    tiny = yaml.safe_load((ROOT / "recipes" / "tiny.yaml").read_text())
    cold = tiny["cold_start_sft"]
    cold["data"].update(num_train=steps * cold["train"]["batch_size"], num_heldout=20)
    cold["train"].update(max_steps=steps, checkpoint_every=steps, mixed_precision=precision)
    cold["eval"].update(num_prompts=20, num_samples=1)
    path = folder / "cold.yaml"
    path.write_text(yaml.safe_dump({"name": "beside", "cold_start_sft": cold}))
    return path


def run_stage(path: Path, busy: int, env: dict[str, str]) -> float:
    home = Path(tempfile.mkdtemp(prefix="r1-beside-"))
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        start = time.monotonic()
        subprocess.run([sys.executable, "-m", "flows.cli", "stage", "cold_start_sft", "--recipe", str(path)],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env={**{k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL",
                                                                                 "MLFLOW_TRACKING_URI")},
                            "R1_HOME": str(home), "PREFECT_HOME": str(home / "prefect"), **env})
        return time.monotonic() - start
    finally:
        for p in spinners:
            p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--busy", type=int, default=1)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--precision", default="no", help="the stage's mixed_precision (no: fp32 on any CPU)")
    ap.add_argument("--env", action="append", default=[], help="K=V for the stage's process")
    args = ap.parse_args()
    env = dict(kv.split("=", 1) for kv in args.env)
    with tempfile.TemporaryDirectory() as d:
        path = recipe(Path(d), args.steps, args.precision)
        alone, beside = [], []
        for _ in range(args.pairs):
            alone.append(run_stage(path, 0, env))
            beside.append(run_stage(path, args.busy, env))
            print(json.dumps({"alone_s": round(alone[-1], 1), "beside_s": round(beside[-1], 1)}), flush=True)
    print(json.dumps({"busy": args.busy, "env": env, "steps": args.steps, "alone_median_s": statistics.median(alone),
                      "beside_median_s": statistics.median(beside),
                      "ratio": round(statistics.median(b / a for a, b in zip(alone, beside)), 2)}))


if __name__ == "__main__":
    main()
