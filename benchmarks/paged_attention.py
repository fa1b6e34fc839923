"""One decode step's attention for one layer: the paged kernel (`grpo.sampling.local.paged_attention`, each slot's own
pages) against what the captured step ran before paging (SDPA over every slot's whole static row of P + budget
positions), and the kernel's numbers against the torch reference.

usage: python benchmarks/paged_attention.py [--shapes 0.5b,7b] [--budgets 512,2048,8192,16384] [--slots 128]
                                            [--device cuda]

Shapes: Qwen2.5-0.5B's attention (2 KV heads, 14 query heads, head size 64) and Qwen2.5-7B's (4, 28, 128), in bf16.
Each slot's length comes from the long-tailed mix of `long_budgets.py` (log-normal around 60 tokens, capped at 500,
seeded), plus a 24-token prompt; its pages are scattered over a shuffled pool. Per (shape, budget) one JSON line:
microseconds a call (CUDA events, the median of 50 after 10 warm-up calls) of the kernel and of the static SDPA,
and their ratio; and once per shape the kernel's largest gap to the reference, relative to the reference's largest
value, in bf16 and fp32. The kernel's time does not depend on the budget; the static SDPA's grows with it.
"""

from __future__ import annotations

import argparse
import json
import statistics

SHAPES = {"0.5b": (2, 14, 64), "7b": (4, 28, 128)}
PAGE = 16
PROMPT = 24


def timed(fn, device) -> float:
    import torch

    for _ in range(10):
        fn()
    if device.type != "cuda":
        import time

        times = []
        for _ in range(20):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
        return statistics.median(times)
    times = []
    for _ in range(50):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return statistics.median(times)


def case(shape: str, budget: int, slots: int, dtype, device, seed: int = 0):
    import torch

    Hkv, Hq, D = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    lengths = torch.distributions.LogNormal(torch.tensor(60.0).log(), 1.0).sample((slots,)).ceil().clamp(1, 500)
    lengths = lengths.long()  # [S] tokens each row wrote
    prompt_pages = -(-PROMPT // PAGE)
    own = -(-lengths // PAGE)  # [S]
    per_row = prompt_pages + -(-budget // PAGE) + 1
    used = int(own.sum()) + slots * prompt_pages
    order = (torch.randperm(used, generator=g) + 1).tolist()  # page 0 is the null page
    table = torch.zeros(slots, per_row, dtype=torch.long)
    for s in range(slots):
        n = prompt_pages + int(own[s])
        table[s, :n] = torch.tensor(order[:n])
        order = order[n:]
    k_pool = torch.randn(Hkv, (used + 1) * PAGE, D, generator=g).to(dtype)
    v_pool = torch.randn(Hkv, (used + 1) * PAGE, D, generator=g).to(dtype)
    q = torch.randn(slots, Hkv, Hq // Hkv, D, generator=g).to(dtype)
    plen = torch.full((slots,), PROMPT)
    start = torch.full((slots,), prompt_pages * PAGE)
    at = start + lengths - 1
    to = dict(device=device)
    return [t.to(**to) for t in (q, k_pool, v_pool, table, plen, start, at)], lengths


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="0.5b,7b")
    ap.add_argument("--budgets", default="512,2048,8192,16384")
    ap.add_argument("--slots", type=int, default=128)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()

    import torch

    from grpo.sampling.local.paged_attention import kernel_runs_on, paged_decode, reference

    device = torch.device(args.device)
    if not kernel_runs_on(device):
        raise SystemExit(f"the paged kernel does not run on {device} here (no Triton, or no TRITON_INTERPRET=1)")
    F = torch.nn.functional
    for shape in args.shapes.split(","):
        Hkv, Hq, D = SHAPES[shape]
        scale = D ** -0.5
        gaps = {}
        for dtype in (torch.float32, torch.bfloat16):
            (q, kp, vp, table, plen, start, at), _ = case(shape, 512, args.slots, dtype, device)
            got = paged_decode(q, kp, vp, table, plen, start, at, scale, PAGE, use_kernel=True).float()
            want = reference(q, kp, vp, table, plen, start, at, scale, PAGE).float()
            gaps[str(dtype).removeprefix("torch.")] = float((got - want).abs().max() / want.abs().max())
        print(json.dumps({"shape": shape, "kernel_gap_to_reference": gaps}), flush=True)
        for budget in [int(b) for b in args.budgets.split(",")]:
            (q, kp, vp, table, plen, start, at), lengths = case(shape, budget, args.slots, torch.bfloat16, device)
            kernel_us = timed(lambda: paged_decode(q, kp, vp, table, plen, start, at, scale, PAGE, use_kernel=True),
                              device)
            T = PROMPT + budget  # the static row: the prompt bucket and the budget
            ks = torch.randn(args.slots, Hkv, T, D, device=device, dtype=torch.bfloat16)
            vs = torch.randn_like(ks)
            bias = torch.zeros(args.slots, 1, 1, T, device=device, dtype=torch.bfloat16)
            static_us = timed(lambda: F.scaled_dot_product_attention(q, ks, vs, attn_mask=bias, scale=scale), device)
            del ks, vs
            print(json.dumps({"shape": shape, "budget": budget, "slots": args.slots,
                              "mean_row_positions": round(float(lengths.float().mean()) + PROMPT, 1),
                              "kernel_us": round(kernel_us, 1), "static_sdpa_us": round(static_us, 1),
                              "static_over_kernel": round(static_us / kernel_us, 2)}), flush=True)


if __name__ == "__main__":
    main()
