"""How long asynchronous GRPO's sampler processes take to start: forked from a fork server against spawned.

Each measurement is a fresh process (as a stage is) that trains a few asynchronous GRPO steps on the tiny model with
two sampler processes, and prints the seconds from `train()` to its first step's metrics (the workers' start is in
them), the whole run's, and a replaced worker's: the first worker is killed after step 2, and the longest wait
between two steps after it is timed (the trainer waits there for the replacement to deliver the step it owed). The two start methods run in turns.

    .venv/bin/python benchmarks/rollout_worker_start.py --pairs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, signal, sys, tempfile, time
import multiprocessing as mp
import pandas as pd
import torch
sys.path[:0] = [{root!r}, {helpers!r}]
import grpo.training.rollouts.processes as rw
if {method!r} == "spawn":
    rw.worker_context = lambda: mp.get_context("spawn")
from grpo.configs.rollout import RolloutConfig
from grpo.configs.sampling import SamplingConfig
from grpo.configs.training import GRPOConfig
from grpo.models import load_model_and_tokenizer
from grpo.training.loops.grpo_trainer import GRPOTrainer
from rollout_runs import PROMPTS, digits
from tiny_configs import SMALL

if __name__ == "__main__":
    torch.manual_seed(0)
    model, tok = load_model_and_tokenizer(SMALL)
    cfg = GRPOConfig(max_steps=6, prompts_per_step=2, num_generations=4, checkpoint_every=0,
                     sampling=SamplingConfig(max_new_tokens=12), rewards={{"digits": 1.0}}, mixed_precision="no",
                     fp32_gemm="mkl", rollout=RolloutConfig(mode="async", workers=2, max_staleness=2, threads=1,
                                                              timeout_s=60))
    marks = {{}}
    t0 = time.perf_counter()

    def on_metrics(step, m):
        marks[step] = time.perf_counter() - t0
        if step == 2:  # a worker lost: killed now, its replacement must deliver before the trainer goes on
            [victim] = [p for p in mp.active_children() if p.name.endswith("-0")]
            marks["killed"] = time.perf_counter() - t0
            os.kill(victim.pid, signal.SIGKILL)

    trainer = GRPOTrainer(model, tok, PROMPTS, cfg, tempfile.mkdtemp(), reward_functions={{"digits": digits}},
                          progress=False, on_metrics=on_metrics)
    trainer.train()
    print(json.dumps({{"first_step_s": marks[1], "run_s": time.perf_counter() - t0,
                      "after_kill_s": max(marks[s] - marks[s - 1] for s in range(3, cfg.max_steps + 1))}}))
"""


def measure(method: str) -> dict:
    code = CHILD.format(root=str(ROOT), helpers=str(ROOT / "tests" / "helpers"), method=method)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise SystemExit(f"{method}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {"forkserver": [], "spawn": []}
    for i in range(args.pairs):
        for method in ("spawn", "forkserver") if i % 2 else ("forkserver", "spawn"):
            r = measure(method)
            results[method].append(r)
            print(f"pair {i + 1} {method:10s} first step {r['first_step_s']:6.2f} s  whole run {r['run_s']:6.2f} s  "
                  f"longest step after a worker was killed {r['after_kill_s']:6.2f} s", flush=True)
    print("\nmedians:")
    for method, rs in results.items():
        print(f"  {method:10s} " + "  ".join(f"{k} {statistics.median(r[k] for r in rs):6.2f}"
                                             for k in ("first_step_s", "run_s", "after_kill_s")))


if __name__ == "__main__":
    main()
