"""Does `fp32_gemm: auto` choose the same plan on a busy machine as on a quiet one?

Measures oneDNN's rate over MKL's for each GEMM of the tiny recipe's linear layers `--runs` times, with `--busy N`
CPU-bound processes beside it (0: quiet), and prints the range of each ratio and the plans chosen. A plan that is the
same in every run is what the margin (grpo.kernels.gemm.ONEDNN_MARGIN) is for.

    .venv/bin/python benchmarks/gemm_plan_stability.py --runs 8 --busy 0
    .venv/bin/python benchmarks/gemm_plan_stability.py --runs 8 --busy 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from grpo.configs.model import ModelConfig
from grpo.kernels.gemm import KINDS, ONEDNN_MARGIN, cpu_model, linear_shapes, measure
from grpo.models import load_model_and_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--busy", type=int, default=0, help="CPU-bound processes run beside the measurement")
    ap.add_argument("--tokens", type=int, default=512, help="rows a micro-batch (the GEMMs' M)")
    args = ap.parse_args()
    model, _ = load_model_and_tokenizer(ModelConfig())
    shapes = linear_shapes(model, args.tokens)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        ratios = {kind: [] for kind in KINDS}
        plans = []
        for _ in range(args.runs):
            rates = measure(shapes)
            for kind in KINDS:
                ratios[kind].append(rates[f"{kind}/onednn"] / rates[f"{kind}/mkl"])
            plans.append(tuple("onednn" if ratios[k][-1] >= ONEDNN_MARGIN else "mkl" for k in KINDS))
    finally:
        for p in spinners:
            p.kill()
    print(json.dumps({"cpu": cpu_model(), "busy": args.busy, "runs": args.runs, "margin": ONEDNN_MARGIN,
                      "onednn_over_mkl": {k: [round(min(v), 3), round(max(v), 3)] for k, v in ratios.items()},
                      "plans": sorted({"/".join(p) for p in plans})}))


if __name__ == "__main__":
    main()
