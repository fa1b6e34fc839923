"""One decode step's attention on a CPU over rows of different lengths: the ways to read each row by its own length.

usage: python benchmarks/ragged_attention.py [--reps 50]

One layer, 64 slots of the embedded model's shape (2 KV heads of 64, 2 query heads each), fp32, one thread, at four
sets of lengths: a long-tailed mix (24 prompt positions and a log-normal around 60 tokens, capped at 500), all 128,
all 40, and one row of 4,096 among 63 of 30. Each way, median milliseconds a call over `--reps` calls:

- `widest`: one SDPA over rows kept from step to step, every slot as wide as the longest (masked);
- `per_slot`: one SDPA a slot over its own kept row;
- `gathered`: each slot's pages gathered from the pool every step, then one masked SDPA
  (`paged_attention.reference`, the kernel's torch twin);
- `by_length`: rows kept in groups of equal page count, one SDPA a group (`length_rows`, what the eager step runs).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from grpo.sampling.local.paged_attention import reference

F = torch.nn.functional
PAGE, HKV, G, D, PROMPT = 16, 2, 2, 64, 24


def timed(f, reps: int) -> float:
    f()
    times = []
    for _ in range(reps):
        t = time.process_time()
        f()
        times.append(time.process_time() - t)
    return round(statistics.median(times) * 1e3, 3)


def ways(lengths: list[int]) -> dict:
    S, g = len(lengths), torch.Generator().manual_seed(0)
    total = [PROMPT + n for n in lengths]  # positions each row holds
    q = torch.randn(S, HKV, G, D, generator=g)
    widest_k = torch.randn(S, HKV, max(total), D, generator=g)
    widest_v = torch.randn_like(widest_k)
    bias = torch.zeros(S, max(total)).masked_fill_(torch.arange(max(total))[None] >= torch.tensor(total)[:, None],
                                                   torch.finfo(torch.float32).min)[:, None, None]
    rows = [(widest_k[s, :, :n].clone(), widest_v[s, :, :n].clone()) for s, n in enumerate(total)]
    # the pool: each row's prompt pages, then its own from the next page boundary, pages in a shuffled order
    need = [-(-PROMPT // PAGE) + -(-n // PAGE) for n in lengths]
    order = torch.randperm(sum(need), generator=g) + 1
    table = torch.zeros(S, max(need), dtype=torch.long)
    at = 0
    for s, c in enumerate(need):
        table[s, :c] = order[at : at + c]
        at += c
    k_pool = torch.randn(HKV, (1 + sum(need)) * PAGE, D, generator=g)
    v_pool = torch.randn_like(k_pool)
    plen = torch.full((S,), PROMPT)
    start = torch.full((S,), -(-PROMPT // PAGE) * PAGE)
    last = start + torch.tensor(lengths) - 1
    groups = {}  # pages -> slots
    for s, n in enumerate(total):
        groups.setdefault(-(-n // PAGE), []).append(s)
    kept = {c: (torch.stack([F.pad(rows[s][0], (0, 0, 0, c * PAGE - total[s])) for s in members]),
                torch.stack([F.pad(rows[s][1], (0, 0, 0, c * PAGE - total[s])) for s in members]),
                torch.tensor(members)) for c, members in groups.items()}

    def by_length():
        out = q.new_zeros(q.shape)
        for c, (k, v, members) in kept.items():
            width = max(total[s] for s in members.tolist())
            mask = torch.zeros(len(members), width).masked_fill_(
                torch.arange(width)[None] >= torch.tensor([total[s] for s in members.tolist()])[:, None],
                torch.finfo(torch.float32).min)[:, None, None]
            out.index_copy_(0, members, F.scaled_dot_product_attention(q[members], k[:, :, :width], v[:, :, :width],
                                                                       attn_mask=mask))
        return out

    return {"widest": lambda: F.scaled_dot_product_attention(q, widest_k, widest_v, attn_mask=bias),
            "per_slot": lambda: torch.stack([F.scaled_dot_product_attention(q[s], k, v) for s, (k, v) in
                                             enumerate(rows)]),
            "gathered": lambda: reference(q, k_pool, v_pool, table, plen, start, last, D ** -0.5, PAGE),
            "by_length": by_length}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    mix = (torch.randn(64, generator=g) + math.log(60)).clamp(max=math.log(500)).exp().ceil().long().tolist()
    for name, lengths in [("long-tailed mix", mix), ("all 128", [128] * 64), ("all 40", [40] * 64),
                          ("one 4096 among 63 of 30", [4096] + [30] * 63)]:
        got = {way: timed(f, args.reps) for way, f in ways(lengths).items()}
        print(json.dumps({"lengths": name, "groups": len({-(-(PROMPT + n) // PAGE) for n in lengths}), **got}))


if __name__ == "__main__":
    main()
