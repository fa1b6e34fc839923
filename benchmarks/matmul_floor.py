"""What the GRPO benchmark's step costs in matmul arithmetic, and how fast this machine's fp32 matmuls run.

usage: python benchmarks/matmul_floor.py [--workload PATH] [--prompt-tokens 16] [--vocab 258]

Counts the multiply-adds of one GRPO step on benchmarks/peers/workload.json's model and batch (decoding, the
reference forward, the policy forward and backward, with each prompt run once), times `a @ b` at the step's
shapes on one thread and on all of them, and prints one JSON line: GFLOP per part, GFLOP/s per shape, and the
seconds the step's matmuls take at those rates. That is a floor for the step in fp32: the rest of the step's time
is elementwise work, sampling and Python.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

DEFAULT_WORKLOAD = Path(__file__).resolve().parents[2] / "shared" / "bench" / "workload.json"


def gflops_per_s(m: int, k: int, n: int, threads: int, repeats: int = 30) -> float:
    torch.set_num_threads(threads)
    a, b = torch.randn(m, k), torch.randn(k, n)
    for _ in range(3):
        a @ b
    t = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * m * k * n * repeats / (time.perf_counter() - t) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default=str(DEFAULT_WORKLOAD))
    ap.add_argument("--prompt-tokens", type=int, default=16, help="tokens of one rendered prompt")
    ap.add_argument("--vocab", type=int, default=258, help="vocabulary: 256 byte symbols + 2 specials")
    args = ap.parse_args()
    spec = json.loads(Path(args.workload).read_text())
    m, g = spec["model"], spec["grpo"]
    H, I, L = m["hidden_size"], m["intermediate_size"], m["num_hidden_layers"]
    D = H // m["num_attention_heads"]
    kv = m["num_key_value_heads"] * D
    macs_per_token = L * (H * H + 2 * H * kv + H * H + 3 * H * I) + H * args.vocab  # q, k, v, o, gate/up/down; head
    rows, C, P = g["prompts_per_step"] * g["num_generations"], g["max_completion_length"], args.prompt_tokens
    tokens = g["prompts_per_step"] * P + rows * (C - 1)  # each prompt once, then every completion position
    attention = L * 2 * 2 * rows * m["num_attention_heads"] * (C - 1) * (P + C - 1) * D  # q k^T and p v
    forward = 2 * macs_per_token * tokens + attention
    decode = 2 * macs_per_token * rows * (C - 1)
    flop = {"decode": decode, "reference_forward": forward, "policy_forward": forward, "policy_backward": 2 * forward}
    threads = torch.get_num_threads()
    shapes = {"train_mlp_up": (tokens, H, I), "train_mlp_down": (tokens, I, H), "train_qkv": (tokens, H, H + 2 * kv),
              "decode_gate_up": (rows, H, 2 * I), "decode_down": (rows, I, H)}
    rates = {name: {f"threads_{t}": round(gflops_per_s(*shape, t), 1) for t in sorted({1, threads})}
             for name, shape in shapes.items()}
    torch.set_num_threads(threads)
    train_rate = rates["train_mlp_up"][f"threads_{threads}"]
    decode_rate = rates["decode_gate_up"][f"threads_{threads}"]
    train_flop = flop["reference_forward"] + flop["policy_forward"] + flop["policy_backward"]
    print(json.dumps({
        "gflop": {k: round(v / 1e9, 2) for k, v in flop.items()},
        "gflop_per_s": rates,
        "matmul_floor_s": {"training": round(train_flop / train_rate / 1e9, 3),
                           "decode": round(decode / decode_rate / 1e9, 3),
                           "step": round(train_flop / train_rate / 1e9 + decode / decode_rate / 1e9, 3)},
    }))


if __name__ == "__main__":
    main()
