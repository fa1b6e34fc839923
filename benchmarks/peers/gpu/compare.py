"""Run the GPU GRPO workload with TRL and with the project, in turns on one GPU, and print their ratio.

usage (from the project's root, on a machine with a CUDA GPU, trl==1.16.0 installed beside the project):
    python benchmarks/peers/gpu/compare.py [--pairs 2] [--preset qwen2.5-0.5b] [--ours "python benchmarks/grpo_step.py"]

The project's command gets `--workload PATH MODEL_DIR` appended and must print, as its last line, one JSON object
with at least median_step_s, completion_tokens_per_s and peak_cuda_gib, measured as trl_peer.py measures them.
Prints one JSON line per pair, then the median over pairs of ours/TRL for each figure.
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
ap.add_argument("--pairs", type=int, default=2)
ap.add_argument("--workload", default=str(here / "workload.json"))
ap.add_argument("--preset", default=None, help="model shape; default: the workload's")
ap.add_argument("--ours", default="python benchmarks/grpo_step.py")
args = ap.parse_args()
preset = args.preset or json.loads(Path(args.workload).read_text())["preset"]
env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def last_json(cmd):
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [l for l in out.stdout.splitlines() if l.strip().startswith("{")]
    if out.returncode != 0 or not lines:
        sys.exit(f"failed: {' '.join(cmd)}\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(lines[-1])


with tempfile.TemporaryDirectory() as tmp:
    subprocess.run([sys.executable, str(here / "make_model.py"), preset, tmp, "--workload", args.workload],
                   check=True, capture_output=True, env=env)
    keys = ("median_step_s", "completion_tokens_per_s", "peak_cuda_gib")
    ratios = {k: [] for k in keys}
    for _ in range(args.pairs):
        peer = last_json([sys.executable, str(here / "trl_peer.py"), tmp, "--workload", args.workload])
        ours = last_json(shlex.split(args.ours) + ["--workload", args.workload, tmp])
        print(json.dumps({"peer": peer, "ours": ours}), flush=True)
        for k in keys:
            ratios[k].append(ours[k] / peer[k])
    print(json.dumps({"preset": preset, **{f"ours_over_trl_{k}": round(statistics.median(v), 3)
                                           for k, v in ratios.items()}}))
