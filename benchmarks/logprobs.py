"""Peak memory and time of completion log-probs + entropy, forward and backward: the plain [N, C, V] path against
the chunked head (`grpo.kernels.logprobs.selective_logps`).

usage: python benchmarks/logprobs.py [--rows 32] [--tokens 64] [--hidden 256] [--vocab 151936] [--chunks 220,441]
                                     [--reps 2] [--device cpu|cuda] [--dtype float32|bfloat16-autocast]
Defaults: the wide-vocabulary CPU workload's shape (4 prompts x 8 completions, 64 tokens, Qwen2.5's vocabulary,
hidden 256, temperature 1.0), float32, entropy on (as the training step asks), a tied head (weight gradient on).
Each variant runs in a fresh subprocess, so its peak memory is its own: on CPU `peak_mib` is the process's peak
RSS and `extra_mib` the peak minus the RSS once the inputs exist; on CUDA both come from
`torch.cuda.max_memory_allocated`. Prints one JSON line per variant, after one line naming the machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _peak_mib(device: str) -> float:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run_variant(args) -> dict:
    import contextlib

    import torch

    from grpo.kernels.logprobs import plain_logps, selective_logps

    torch.manual_seed(0)
    dev = torch.device(args.device)
    N, C, H, V = args.rows, args.tokens, args.hidden, args.vocab
    hidden = torch.randn(N, C, H, device=dev, requires_grad=True)  # [N, C, H]
    weight = torch.randn(V, H, device=dev).div_(H**0.5).requires_grad_()  # [V, H] a tied head in the real model
    targets = torch.randint(0, V, (N, C), device=dev)  # [N, C]
    mask = (torch.rand(N, C, device=dev) > 0.2).float()  # [N, C] some tokens masked, as padding would be
    amp = (torch.autocast(dev.type, dtype=torch.bfloat16) if args.dtype == "bfloat16-autocast"
           else contextlib.nullcontext())
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = _peak_mib(args.device)
    fwd, total = [], []
    for _ in range(args.reps + 1):  # the first is a warm-up
        hidden.grad = weight.grad = None
        sync()
        t0 = time.perf_counter()
        with amp:
            if args.variant == "plain":
                logps, entropy = plain_logps(hidden, weight, None, targets, 1.0, with_entropy=True)
            else:
                logps, entropy = selective_logps(hidden, weight, None, targets, 1.0,
                                                 chunk_tokens=int(args.variant), with_entropy=True)
        sync()
        t1 = time.perf_counter()
        (logps * mask).sum().backward()
        sync()
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        total.append(t2 - t0)
        del logps, entropy
    peak = _peak_mib(args.device)
    chunk = None if args.variant == "plain" else int(args.variant)
    return {
        "variant": "plain" if chunk is None else "chunked",
        "chunk_tokens": chunk,
        "shape": {"N": N, "C": C, "H": H, "V": V, "dtype": args.dtype, "device": args.device},
        "full_logits_mib": round(N * C * V * 4 / 2**20, 1),
        "fwd_s": round(statistics.median(fwd[1:]), 4),
        "fwd_bwd_s": round(statistics.median(total[1:]), 4),
        "peak_mib": round(peak, 1),
        "extra_mib": round(peak - base, 1),
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--chunks", default="220,441", help="chunk_tokens to try (128 and 256 MiB at V=151,936)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16-autocast"])
    ap.add_argument("--variant", help="internal: run one variant in this process")
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args)))
        return
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    print(json.dumps({"cpu": cpu, "python": platform.python_version()}), flush=True)
    common = [f"--rows={args.rows}", f"--tokens={args.tokens}", f"--hidden={args.hidden}", f"--vocab={args.vocab}",
              f"--reps={args.reps}", f"--device={args.device}", f"--dtype={args.dtype}"]
    for variant in ["plain", *args.chunks.split(",")]:
        out = subprocess.run([sys.executable, __file__, *common, f"--variant={variant}"], check=True,
                             capture_output=True, text=True)
        print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
