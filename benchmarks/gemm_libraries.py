"""MKL against oneDNN on this CPU, at the GRPO benchmark's fp32 GEMM shapes: what `fp32_gemm: auto` would choose.

usage: python benchmarks/gemm_libraries.py [--workload PATH] [--threads 1 2] [--reps 5]

Times each of a linear layer's three GEMMs (forward `x W^T`, input gradient `g W`, weight gradient `g^T x`) on both
libraries with `grpo.kernels.gemm.measure` (the loops' own measurement), at the training shapes of
benchmarks/peers/workload.json's model (a micro-batch of 32 rows x 65 positions) and at decode's (32 rows), on each
thread count asked. Prints the CPU (`grpo.kernels.gemm.cpu_model`), then one JSON line per thread count and shape
class: GFLOP/s by "<kind>/<library>", oneDNN's rate over MKL's per kind, and the plan `auto` would make from them
(oneDNN where at least `ONEDNN_MARGIN` times MKL's rate).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from grpo.kernels.gemm import KINDS, ONEDNN_MARGIN, cpu_model, measure, onednn_problem

DEFAULT_WORKLOAD = Path(__file__).resolve().parents[2] / "shared" / "bench" / "workload.json"


def shapes(spec: dict, rows: int) -> list[tuple[int, int, int]]:
    """(M, K, N) of the model's linears at `rows` rows: q, k/v, o, gate/up, down (the tied head left out)."""
    m = spec["model"]
    H, I, heads, kv = m["hidden_size"], m["intermediate_size"], m["num_attention_heads"], m["num_key_value_heads"]
    D = H // heads
    return sorted({(rows, H, heads * D), (rows, H, kv * D), (rows, heads * D, H), (rows, H, I), (rows, I, H)})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default=str(DEFAULT_WORKLOAD))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if problem := onednn_problem():
        raise SystemExit(f"oneDNN's linear cannot be timed here: {problem}")
    spec = json.loads(Path(args.workload).read_text())
    g = spec["grpo"]
    n = g["prompts_per_step"] * g["num_generations"]
    classes = {"training": shapes(spec, n * (1 + g["max_completion_length"])), "decode": shapes(spec, n)}
    print(json.dumps({"cpu": cpu_model(), "torch": torch.__version__}))
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, shape_list in classes.items():
            rates = measure(shape_list, reps=args.reps)
            ratio = {k: round(rates[f"{k}/onednn"] / rates[f"{k}/mkl"], 2) for k in KINDS}
            print(json.dumps({"threads": threads, "shapes": name, "gflop_per_s": {k: round(v, 1) for k, v in
                                                                              rates.items()},
                              "onednn_over_mkl": ratio,
                              "auto_picks": {k: "onednn" if r >= ONEDNN_MARGIN else "mkl" for k, r in ratio.items()}}))


if __name__ == "__main__":
    main()
