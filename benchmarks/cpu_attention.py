"""Training attention on CPU: transformers' SDPA path against `grpo.kernels.attention.grouped_attention`.

usage: python benchmarks/cpu_attention.py [--batch 32] [--queries 63] [--keys 79] [--reps 20]
Times one layer's attention forward and forward + backward at the GRPO benchmark's shapes (4 query heads sharing
2 K/V heads of 64, a padding + causal mask), both functions called the way the model calls them, in alternating
rounds. Prints one JSON line: median milliseconds per call for each, their ratio, and the largest output difference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from grpo.kernels.attention import grouped_attention


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--queries", type=int, default=63)
    ap.add_argument("--keys", type=int, default=79)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    B, L, S, Hq, Hkv, D = args.batch, args.queries, args.keys, 4, 2, 64
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Hq, L, D, generator=g, requires_grad=True)
    k = torch.randn(B, Hkv, S, D, generator=g, requires_grad=True)
    v = torch.randn(B, Hkv, S, D, generator=g, requires_grad=True)
    keep = torch.ones(L, S, dtype=torch.bool).tril(S - L)[None, None].repeat(B, 1, 1, 1)  # [B, 1, L, S] causal
    keep[: B // 4, ..., : S // 8] = False  # left padding in a quarter of the rows
    additive = torch.zeros(B, 1, L, S).masked_fill(~keep, torch.finfo(torch.float32).min)
    module = SimpleNamespace(num_key_value_groups=Hq // Hkv, is_causal=True, training=True)
    grad = torch.randn(B, L, Hq, D, generator=g)
    sides = {
        "sdpa": lambda: sdpa_attention_forward(module, q, k, v, keep, scaling=D ** -0.5)[0],
        "grouped": lambda: grouped_attention(module, q, k, v, additive, scaling=D ** -0.5)[0],
    }
    diff = (sides["sdpa"]() - sides["grouped"]())[keep[:, 0].any(-1)].abs().max().item()
    fwd: dict[str, list[float]] = {name: [] for name in sides}
    both: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.reps + 2):  # two warm-up rounds, dropped below
        for name, f in sides.items():
            t0 = time.perf_counter()
            with torch.no_grad():
                f()
            t1 = time.perf_counter()
            f().backward(grad)
            t2 = time.perf_counter()
            fwd[name].append(t1 - t0)
            both[name].append(t2 - t1)
    med = {f"{kind}_{name}_ms": round(statistics.median(times[name][2:]) * 1e3, 3)
           for kind, times in (("forward", fwd), ("forward_backward", both)) for name in sides}
    print(json.dumps({**med,
                      "grouped_over_sdpa_forward_backward": round(med["forward_backward_grouped_ms"]
                                                                  / med["forward_backward_sdpa_ms"], 3),
                      "max_abs_difference": diff}))


if __name__ == "__main__":
    main()
