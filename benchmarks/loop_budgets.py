"""What a budget the rows never reach costs `sampler: loop` (the step-by-step decode loop, `backend.sample_batch`):
the same rows at each budget, the peak RSS of the process and the CPU time of the call.

usage: python benchmarks/loop_budgets.py [--budgets 512,16384] [--rows 32] [--threads 1]

The workload, the same at every budget: the embedded recipe's model shape (Qwen2, hidden 256, 4 layers, 2 KV heads
of 64: 4 KiB of fp32 keys and values a position), `--rows` prompts of the GPU peer's form (`What is {a} + {b}?`)
sampled at temperature 1 in one batch, with half the vocabulary as end tokens, so every row ends within a few
tokens; torch's seed is pinned, so every budget samples the same tokens (`digest`). Each budget runs in a process
of its own and prints one JSON line: the longest row, the tokens sampled, the process's peak RSS before and after
the call, its peak virtual size (VmPeak: what was allocated, touched or not) and the call's CPU seconds. The last
line: peak RSS and VmPeak at the largest budget over the smallest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def one(budget: int, rows: int, threads: int) -> dict:
    import time

    import torch

    from grpo.configs.model import TinyModelConfig
    from grpo.configs.sampling import GenerationConfig, SamplingConfig
    from grpo.sampling.engines import build_engine
    from grpo.tiny import build_tiny_model, build_tokenizer

    torch.set_num_threads(threads)
    tok = build_tokenizer()
    model = build_tiny_model(TinyModelConfig(max_position_embeddings=budget + 128), tok).eval()
    engine = build_engine(GenerationConfig(sampler="loop"), model, tok)
    tok.padding_side = "left"
    enc = tok([f"What is {10 + i % 90} + {20 + i % 70}?" for i in range(rows)], return_tensors="pt", padding=True,
              add_special_tokens=False)
    stop = list(range(0, len(tok), 2))  # half the vocabulary: a row ends at each token with p ~ 1/2
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    torch.manual_seed(0)
    t = time.process_time()
    ids, mask, _, _ = engine.sample_ids(enc["input_ids"], enc["attention_mask"],
                                        SamplingConfig(max_new_tokens=budget, temperature=1.0), eos_ids=stop)
    cpu = time.process_time() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with open("/proc/self/status") as f:
        vm_peak = next(int(line.split()[1]) for line in f if line.startswith("VmPeak"))
    return {"budget": budget, "rows": rows, "longest": ids.size(1), "tokens": int(mask.sum()),
            "rss_before_mib": round(before / 1024), "peak_rss_mib": round(peak / 1024),
            "vm_peak_mib": round(vm_peak / 1024), "cpu_s": round(cpu, 3),
            "digest": hashlib.sha256(repr(ids.tolist()).encode()).hexdigest()[:12]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budgets", default="512,16384")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a budget, in this process
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.one, args.rows, args.threads)), flush=True)
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": str(args.threads)}
    lines = []
    for budget in [int(b) for b in args.budgets.split(",")]:
        out = subprocess.run([sys.executable, __file__, "--one", str(budget), "--rows", str(args.rows),
                              "--threads", str(args.threads)], env=env, check=True, capture_output=True, text=True)
        lines.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(lines[-1]), flush=True)
    lo, hi = lines[0], lines[-1]
    print(json.dumps({f"peak_rss_{hi['budget']}_over_{lo['budget']}": round(hi["peak_rss_mib"] / lo["peak_rss_mib"], 3),
                      f"vm_peak_{hi['budget']}_over_{lo['budget']}": round(hi["vm_peak_mib"] / lo["vm_peak_mib"], 3),
                      "same_tokens": len({x["digest"] for x in lines}) == 1}))


if __name__ == "__main__":
    main()
