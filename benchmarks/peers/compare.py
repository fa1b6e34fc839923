"""Run the GRPO workload with TRL and with the project, in turns, and print their ratio.

usage (from the project's root, with the project installed and trl==1.16.0 beside it):
    python benchmarks/peers/compare.py [--pairs 3] [--workload PATH] [--ours "python benchmarks/grpo_step.py"]

The project's command gets `--workload PATH` and the model folder as its last arguments and must print, as its last line, one JSON
object with at least: median_step_s, completion_tokens_per_s, peak_rss_mib (see trl_grpo_peer.py).
Prints one JSON line per run, then a summary line: the median over pairs of ours/TRL for each figure.
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

here = Path(__file__).resolve().parent
ap = argparse.ArgumentParser()
ap.add_argument("--pairs", type=int, default=3)
ap.add_argument("--workload", default=str(here / "workload.json"))
ap.add_argument("--ours", default="python benchmarks/grpo_step.py")
args = ap.parse_args()

env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def last_json(cmd):
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [l for l in out.stdout.splitlines() if l.strip().startswith("{")]
    if out.returncode != 0 or not lines:
        sys.exit(f"failed: {' '.join(cmd)}\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(lines[-1])


with tempfile.TemporaryDirectory() as tmp:
    subprocess.run([sys.executable, str(here / "make_tiny_model.py"), tmp, "--workload", args.workload], check=True,
                   capture_output=True, env=env)
    ratios = {"median_step_s": [], "completion_tokens_per_s": [], "peak_rss_mib": []}
    for _ in range(args.pairs):
        peer = last_json([sys.executable, str(here / "trl_grpo_peer.py"), tmp, "--workload", args.workload])
        ours = last_json(shlex.split(args.ours) + ["--workload", args.workload, tmp])
        print(json.dumps({"peer": peer, "ours": ours}))
        for k in ratios:
            ratios[k].append(ours[k] / peer[k])
    summary = {f"ours_over_trl_{k}": round(statistics.median(v), 3) for k, v in ratios.items()}
    print(json.dumps(summary))
