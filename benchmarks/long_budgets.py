"""What a budget the rows never reach costs the sampler: the same rows at budgets 512, 4096 and 16384, with the
paged KV cache (the engine now) and with the static cache (the captured layout, stepped eagerly, as before paging).

usage: python benchmarks/long_budgets.py [--budgets 512,4096,16384] [--ways paged,static] [--prompts 64]
                                         [--samples 4] [--slots 64] [--threads 1] [--clock cpu|wall]

The workload, the same at every budget: the embedded recipe's model shape (Qwen2, hidden 256, 4 layers, 2 KV heads
of 64: 4 KiB of fp32 keys and values a position) with a context of the budget + 128, `--prompts` prompts of 19 to
24 tokens, `--samples` rows each, every row stopped at its own length (`SlotBatch.submit`'s limit) drawn from a
long-tailed mix (seeded: log-normal around 60 tokens, capped at 500: p50 ~60, p90 ~220, a few at 500), its random
stream seeded, so every budget samples the same tokens. `--slots` rows decode together.

Each (way, budget) runs in a process of its own (after a warm-up call) and prints one JSON line: tokens per second
(CPU time of the process with `--clock cpu`), the K/V bytes allocated (the largest cache a call held: the paged
pool and the dense rows attention reads, or the static S x (P + budget) rows), the K/V bytes attention read per
generated token, and the process's peak RSS. The last line: each way's tokens/s at the largest budget over its own
at the smallest, and paged over static at each budget.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LONGEST = 500  # the longest row: under the smallest budget


def run(args) -> dict:
    import resource

    import torch

    from grpo.config import SamplingConfig, TinyModelConfig
    from grpo.sampling.draws import draw_streams
    from grpo.sampling.slots import SlotBatch
    from grpo.sampling.static_sampler import StaticSampler
    from grpo.tiny import build_tiny_model, build_tokenizer

    torch.set_num_threads(args.threads)
    tok = build_tokenizer()
    model = build_tiny_model(TinyModelConfig(max_position_embeddings=args.budget + 128), tok).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.tensor(tok(f"Question {i}: what is {10 + i % 90} plus {20 + (7 * i) % 70}? Think first.")
                            ["input_ids"]) for i in range(args.prompts)]
    rows = args.prompts * args.samples
    limits = torch.distributions.LogNormal(torch.tensor(60.0).log(), 1.0).sample((rows,)).ceil().clamp(1, LONGEST)
    streams = draw_streams(rows, generator=g)  # [rows] each row's random stream
    static = args.way == "static"
    sampler = StaticSampler(model, **(dict(keep_captures=True, full_cache_attention=False, buckets=False)
                                      if static else {}))
    s = SamplingConfig(max_new_tokens=args.budget, temperature=1.0)
    P = max(len(p) for p in prompts)

    def call(n_prompts: int) -> int:
        batch = SlotBatch(sampler, args.slots, P, s, [], tok.pad_token_id)  # no end token: rows stop at their limit
        for i in range(n_prompts):
            for j in range(args.samples):
                row = i * args.samples + j
                batch.submit(prompts[i], streams=streams[row:row + 1], limit=int(limits[row]))
        tokens = 0
        while batch.busy:
            tokens += sum(int(e.alive.sum()) for e in batch.step())
        return tokens

    with torch.inference_mode():
        call(4)  # warm-up
        sampler.counts = type(sampler.counts)()
        clock = time.process_time if args.clock == "cpu" else time.perf_counter
        t = clock()
        tokens = call(args.prompts)
        took = clock() - t
    cfg = model.config
    position = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    c = sampler.counts
    return {"way": args.way, "budget": args.budget, "clock": args.clock, "threads": args.threads, "tokens": tokens,
            "seconds": round(took, 2), "tokens_per_s": round(tokens / took, 1),
            "kv_mb_allocated": round(c.kv_bytes_allocated / 2**20, 1),
            "kv_read_kb_per_token": round(c.kv_positions_read * position / tokens / 1024, 1),
            "pages_high_water": c.pages_high_water, "preemptions": c.preemptions,
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budgets", default="512,4096,16384")
    ap.add_argument("--ways", default="paged,static")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    ap.add_argument("--way", help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.way:
        print(json.dumps(run(args)), flush=True)
        return
    got = {}
    for budget in [int(b) for b in args.budgets.split(",")]:
        for way in args.ways.split(","):
            out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--way", way, "--budget",
                                  str(budget), "--prompts", str(args.prompts), "--samples", str(args.samples),
                                  "--slots", str(args.slots), "--threads", str(args.threads), "--clock", args.clock],
                                 env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT, check=True,
                                 capture_output=True, text=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            print(json.dumps(row), flush=True)
            got[way, budget] = row
    budgets = sorted({b for _, b in got})
    ways = sorted({w for w, _ in got})
    summary = {f"{w}: {budgets[-1]} over {budgets[0]}": round(got[w, budgets[-1]]["tokens_per_s"]
                                                              / got[w, budgets[0]]["tokens_per_s"], 3) for w in ways}
    if {"paged", "static"} <= set(ways):
        summary.update({f"paged over static at {b}": round(got["paged", b]["tokens_per_s"]
                                                           / got["static", b]["tokens_per_s"], 3) for b in budgets})
    print(json.dumps({"tokens_per_s_ratio": summary}))


if __name__ == "__main__":
    main()
