"""Packed against padded GRPO training passes on a long-tailed workload: non-padding tokens/s and peak memory.

The workload: 8 prompts x G=4 completions (N=32 rows) on a Qwen2-architecture model built from a config (hidden 256,
4 layers, 4 query / 2 K/V heads, vocabulary 4,096, fp32). Prompt lengths uniform in [24, 64] tokens; completion
lengths log-uniform between 4 and the budget C=512 tokens (seeded): most stop far short of the budget, a few reach
it, as reasoning traces do. The script prints the completion lengths' percentiles.

Timed: one optimizer step's forward and backward of GRPO's loss (loss_type dapo, beta 0.04 with reference
log-probs given) over the 32 rows, three ways: padded in micro-batches of 8 rows (today), packed in the same
micro-batches, and packed to a 4,096-token budget. Each is run `REPEATS` times after a warm-up; the median is
printed, with non-padding tokens/s (real prompt + completion tokens per second), the loss (equal across the
three, to fp32 rounding) and the peak bytes of tensors alive in one timed pass (`BytesAlive`, a separate
untimed pass). A script that prints figures, never a test.

    .venv/bin/python benchmarks/packing.py [--threads N] [--clock wall|cpu]

`--clock cpu` times with the process's CPU time: on a machine shared with other jobs, with `--threads 1`, it is what
the work costs whatever else runs.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bytes_alive import BytesAlive  # noqa: E402
from grpo.kernels.attention import attending_packed, cpu_attention  # noqa: E402
from grpo.training.logprobs import token_logps  # noqa: E402
from grpo.training.loss import batch_share, grpo_loss, part_share  # noqa: E402
from grpo.training.packing import micro_batch_rows, reference_parts  # noqa: E402

V, PAD, PROMPTS, G, C, MICRO, BUDGET, REPEATS = 4096, 0, 8, 4, 512, 8, 4096, 3


def workload(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(24, 65, (PROMPTS,), generator=g).tolist()
    u = torch.rand(PROMPTS * G, generator=g)
    completion_lens = [int(math.exp(math.log(4) + float(x) * (math.log(C) - math.log(4)))) for x in u]
    N, P = PROMPTS * G, max(prompt_lens)
    ids = torch.full((N, P + C), PAD)
    mask = torch.zeros(N, P + C, dtype=torch.long)
    for r, c in enumerate(completion_lens):
        p = prompt_lens[r // G]
        if r % G == 0:
            prompt = torch.randint(1, V, (p,), generator=g)
        ids[r, P - p:P], mask[r, P - p:P] = prompt, 1
        ids[r, P:P + c], mask[r, P:P + c] = torch.randint(1, V, (c,), generator=g), 1
    return ids, mask, completion_lens


def step(model, ids, mask, ref, adv, packed: bool, budget: int | None) -> float:
    """One step's forward and backward over the batch; returns the step's loss."""
    completion_mask = mask[:, -C:].float()  # [N, C]
    total = 0.0
    for rows in micro_batch_rows(mask, MICRO, budget):
        logps, _ = token_logps(model, ids[rows], mask[rows], C, 1.0, with_entropy=True, packed=packed)  # [b, C]
        parts = [(None, rows)] if isinstance(rows, slice) else reference_parts(rows, MICRO)
        loss_sum = 0.0
        for local, ref_rows in parts:
            part = rows if local is None else [rows[j] for j in local]
            lp = logps if local is None else logps[local]
            loss, _ = grpo_loss(lp, None, ref[part], adv[part], completion_mask[part], loss_type="dapo")
            share = batch_share("dapo", completion_mask[ref_rows if local is not None else rows], completion_mask)
            if local is not None:
                share *= part_share("dapo", completion_mask[part], completion_mask[ref_rows])
            loss_sum = loss_sum + loss * share
        loss_sum.backward()
        total += float(loss_sum.detach())
    return total


def main(clock) -> None:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=V, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                         pad_token_id=PAD, tie_word_embeddings=False)).float().train()
    ids, mask, lens = workload()
    q = statistics.quantiles(lens, n=100, method="inclusive")
    real = int(mask.sum())
    print(f"completion lengths (N={len(lens)}, budget {C}): min {min(lens)} p25 {q[24]:.0f} p50 {q[49]:.0f} "
          f"p75 {q[74]:.0f} p90 {q[89]:.0f} p99 {q[98]:.0f} max {max(lens)}; real tokens {real} of "
          f"{mask.numel()} padded positions ({real / mask.numel():.0%})")
    with torch.no_grad():
        ref, _ = token_logps(model, ids, mask, C, 1.0)  # [N, C]
    adv = torch.randn(ids.size(0), generator=torch.Generator().manual_seed(1))  # [N]
    ways = {"padded, 8 rows a micro-batch": (False, None), "packed, 8 rows a micro-batch": (True, None),
            f"packed, {BUDGET} tokens a micro-batch": (True, BUDGET)}
    results = {}
    with cpu_attention(model):
        for name, (packed, budget) in ways.items():
            with attending_packed(model, packed):
                model.zero_grad()
                loss = step(model, ids, mask, ref, adv, packed, budget)  # warm-up
                times = []
                for _ in range(REPEATS):
                    model.zero_grad()
                    t0 = clock()
                    step(model, ids, mask, ref, adv, packed, budget)
                    times.append(clock() - t0)
                model.zero_grad()
                with BytesAlive() as alive:
                    step(model, ids, mask, ref, adv, packed, budget)
            t = statistics.median(times)
            results[name] = t
            print(f"{name:36s} {t:7.3f} s  {real / t:9.0f} real tokens/s  loss {loss:+.7f}  "
                  f"peak tensors {alive.peak / 2**20:8.1f} MiB")
    base = results["padded, 8 rows a micro-batch"]
    for name, t in results.items():
        print(f"{name:36s} {base / t:5.2f}x padded tokens/s")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = ap.parse_args()
    torch.set_num_threads(max(1, args.threads))
    print(f"threads {torch.get_num_threads()}, clock {args.clock}")
    main(time.perf_counter if args.clock == "wall" else time.process_time)
