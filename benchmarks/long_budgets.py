"""What a budget the rows never reach costs the sampler: the same rows at budgets 512, 4096 and 16384, with the
paged KV cache (the engine now) and with the static cache it replaced (P + budget positions a slot: stepped eagerly
on a CPU, captured on CUDA), run from `STATIC_REV`, the last commit that had it, checked out in a worktree.

usage: python benchmarks/long_budgets.py [--budgets 512,4096,16384] [--ways paged,static] [--prompts 64]
                                         [--samples 4] [--slots 64] [--threads 1] [--clock cpu|wall]
                                         [--mix short|r1|tail]

The workload, the same at every budget: the embedded recipe's model shape (Qwen2, hidden 256, 4 layers, 2 KV heads
of 64: 4 KiB of fp32 keys and values a position) with a context of the budget + 128, `--prompts` prompts of 19 to
24 tokens, `--samples` rows each, every row stopped at its own length (`SlotBatch.submit`'s limit) drawn from a
long-tailed mix (seeded: log-normal around 60 tokens, capped at 500: p50 ~60, p90 ~220, a few at 500), its random
stream seeded, so every budget samples the same tokens. `--slots` rows decode together. `--mix tail`: the first row
runs to the budget and every other ends within 1 to 4 tokens (one long row among short ones: what the K/V rows by
length are for); its tokens differ from budget to budget only by the long row's length.

Each (way, budget) runs in a process of its own (after a warm-up call) and prints one JSON line: tokens per second
(CPU time of the process with `--clock cpu`), the K/V bytes allocated (the largest cache a call held: the paged
pool and the dense rows attention reads, or the static S x (P + budget) rows), the K/V bytes attention read per
generated token, and the process's peak RSS. The last line: each way's tokens/s at the largest budget over its own
at the smallest, and paged over static at each budget.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import statistics
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from worktrees import STATIC_REV, worktree

ROOT = Path(__file__).resolve().parent.parent
LONGEST = 500  # the longest row: under the smallest budget
R1_LONGEST = 16384  # `--mix r1`'s longest row (open-r1's cap)


def load(args):
    """The model and tokenizer: the embedded recipe's shape (a context of the largest budget + 128), or a folder
    (`--model`, a preset that the shared bench's gpu/make_model.py built) on `--device`."""
    import torch

    if args.model:
        from grpo.configs.model import ModelConfig
        from grpo.models import load_model_and_tokenizer

        model, tok = load_model_and_tokenizer(ModelConfig(name_or_path=args.model, dtype=args.dtype))
        longest = max(int(b) for b in str(args.budget).split(","))
        model.config.max_position_embeddings = max(model.config.max_position_embeddings, longest + 128)  # rotary
        return model.to(args.device).eval(), tok
    from grpo.configs.model import TinyModelConfig
    from grpo.tiny import build_tiny_model, build_tokenizer

    tok = build_tokenizer()
    longest = max(int(b) for b in str(args.budget).split(","))
    model = build_tiny_model(TinyModelConfig(max_position_embeddings=longest + 128), tok).eval()
    return model.to(getattr(torch, args.dtype)), tok


def run(args) -> list[dict]:
    """One way at each budget of `args.budget` (comma-separated), in this process: a fresh sampler each."""
    import gc
    import resource

    import torch

    from grpo.configs.sampling import SamplingConfig
    from grpo.sampling.draws import draw_streams
    from grpo.sampling.local.slots import SlotBatch
    from grpo.sampling.local.static_sampler import StaticSampler

    torch.set_num_threads(args.threads)
    model, tok = load(args)
    cuda = model.device.type == "cuda"
    g = torch.Generator().manual_seed(0)
    prompts = [torch.tensor(tok(f"Question {i}: what is {10 + i % 90} plus {20 + (7 * i) % 70}? Think first.")
                            ["input_ids"]) for i in range(args.prompts)]
    rows = args.prompts * args.samples
    if args.mix == "r1":  # R1-like traces: median 3,000, a long tail to 16k (mean ~4.6k, ~84% within 8k)
        limits = (torch.randn(rows, generator=g) + math.log(3000.0)).exp().ceil().clamp(1, R1_LONGEST)
    elif args.mix == "tail":  # one row to the budget, every other within a few tokens (1 to 4)
        limits = torch.randint(1, 5, (rows,), generator=g).float()
        limits[0] = 10**9  # (cut at the budget)
    else:  # short rows: median 60, a few at 500 (under the smallest budget)
        limits = (torch.randn(rows, generator=g) + math.log(60.0)).exp().ceil().clamp(1, LONGEST)
    streams = draw_streams(rows, generator=g)  # [rows] each row's random stream
    P = max(len(p) for p in prompts)
    budget_bytes = None if args.kv_gib is None else int(args.kv_gib * 2**30)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out = []
    for budget in [int(b) for b in str(args.budget).split(",")]:
        if args.way == "static" and not cuda:  # (at STATIC_REV) the static cache, stepped eagerly over the
            # positions written so far
            kw = dict(keep_captures=True, full_cache_attention=False, buckets=False, kv_layout="static")
        elif args.way == "static":  # (at STATIC_REV) the static cache as CUDA captured it: P + C positions a slot
            kw = dict(kv_layout="static")
        else:  # the engine as it is: eager steps over dense rows on a CPU, captured steps over the pages on CUDA
            kw = {}
        sampler = StaticSampler(model, memory_budget=budget_bytes, **kw)
        s = SamplingConfig(max_new_tokens=budget, temperature=1.0)

        digests = []  # the sampled tokens' digest, the same at every budget its rows do not reach
        live: list[int] = []  # rows decoding after each `step` of the timed call

        def call(n_prompts: int, seconds: float | None = None, cap: int | None = None) -> int:
            batch = SlotBatch(sampler, args.slots, P, s, [], tok.pad_token_id)  # no end token: rows stop at limits
            for i in range(n_prompts):
                for j in range(args.samples):
                    row = i * args.samples + j
                    batch.submit(prompts[i], streams=streams[row:row + 1], limit=min(budget, int(limits[row]), cap or budget))
            tokens, digest = 0, hashlib.sha256()
            got = {}
            live.clear()
            until = None if seconds is None else time.perf_counter() + seconds
            while batch.busy:
                for e in batch.step():
                    tokens += int(e.alive.sum())
                    got[e.key] = e.ids[e.alive].tolist()
                live.append(batch.live)
                if until is not None and time.perf_counter() > until:  # cut: the live rows' tokens so far count
                    taken = [i for i, key in enumerate(batch.slot_row) if key is not None]
                    tokens += int(batch.state.n[taken].sum()) if taken else 0
                    break
            for key in sorted(got):
                digest.update(repr(got[key]).encode())
            digests.append(digest.hexdigest()[:12])
            return tokens

        with torch.inference_mode():
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            # warm-up (on CUDA: the captures), its rows cut at 64 tokens: R1's rows run to 16k, minutes on a 7B
            call(min(4, args.prompts), cap=64)
            if cuda and not out and args.max_seconds is None:
                call(args.prompts)  # the process's first budget: every kernel and allocation warm, as for the next
            sampler.counts = type(sampler.counts)()
            clock = time.process_time if args.clock == "cpu" else time.perf_counter
            sync()
            t = clock()
            tokens = call(args.prompts, args.max_seconds)
            sync()
            took = clock() - t
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        position = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * sampler.dtype.itemsize
        c = sampler.counts
        row = {"way": args.way, "budget": budget, "device": torch.cuda.get_device_name() if cuda else "cpu",
               "dtype": str(sampler.dtype).removeprefix("torch."), "clock": args.clock, "threads": args.threads,
               "tokens": tokens, "tokens_digest": digests[-1], "seconds": round(took, 2),
               "tokens_per_s": round(tokens / took, 1),
               "kv_mb_allocated": round(c.kv_bytes_allocated / 2**20, 1),
               "kv_mb_written": round(c.pages_high_water * 16 * position / 2**20, 1) if c.pages_high_water else None,
               "kv_read_kb_per_token": round(c.kv_positions_read * position / tokens / 1024, 1),
               "pages_high_water": c.pages_high_water, "preemptions": c.preemptions,
               "live_rows_max": max(live, default=0),
               # what the static cache it replaced held in the same budget: P + budget positions a row
               "static_rows_in_budget": None if budget_bytes is None else budget_bytes // ((P + budget) * position),
               "live_rows_median_second_half": statistics.median(live[len(live) // 2:]) if live else 0,
               "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
        if cuda:
            row["peak_cuda_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        print(json.dumps(row), flush=True)
        out.append(row)
        del sampler
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return out


def _one(args, way: str, group: list[str], code: Path, got: dict) -> None:
    """One way at the budgets of `group`, in a process of its own, run from the code at `code`."""
    cmd = [sys.executable, str(code / "benchmarks" / "long_budgets.py"), "--way", way, "--budget", ",".join(group),
           "--prompts", str(args.prompts), "--samples", str(args.samples), "--slots", str(args.slots),
           "--threads", str(args.threads), "--clock", args.clock, "--device", args.device,
           "--dtype", args.dtype]
    cmd += (["--model", args.model] if args.model else []) + (
        ["--kv-gib", str(args.kv_gib)] if args.kv_gib is not None else [])
    cmd += (["--mix", args.mix] if args.mix != "short" else []) + (
        ["--max-seconds", str(args.max_seconds)] if args.max_seconds is not None else [])
    out = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                         [str(code)] + [x for x in [os.environ.get("PYTHONPATH")] if x])), cwd=code, check=True,
                         stdout=subprocess.PIPE, text=True)
    for line in out.stdout.strip().splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            print(json.dumps(row), flush=True)
            got[way, row["budget"]] = row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budgets", default="512,4096,16384")
    ap.add_argument("--ways", default="paged,static")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    ap.add_argument("--model", help="a model folder (gpu/make_model.py's presets) instead of the embedded shape")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="float32", help="the weights' and the cache's dtype (bfloat16 on a GPU)")
    ap.add_argument("--kv-gib", type=float, default=None, help="the KV cache's budget (default: the engine's)")
    ap.add_argument("--mix", choices=["short", "r1", "tail"], default="short",
                    help="the rows' lengths: short (median 60, capped at 500), r1 (median 3,000, capped at 16k) or "
                         "tail (the first row to the budget, the others 1 to 4 tokens)")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="stop the timed call after this long (its rows' tokens so far count): for long mixes")
    ap.add_argument("--way", help=argparse.SUPPRESS)
    ap.add_argument("--budget", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.way:
        run(args)
        return
    got = {}
    # each (way, budget) in a process of its own on a CPU (its peak RSS is the figure); on a GPU a way's budgets
    # share one (the peak is reset for each, the model loads once)
    budgets = args.budgets.split(",")
    groups = [[b] for b in budgets] if args.device == "cpu" else [budgets]
    ways = args.ways.split(",")
    with contextlib.ExitStack() as stack:
        static_tree = stack.enter_context(worktree(STATIC_REV)) if "static" in ways else None
        for group in groups:
            for way in ways:
                _one(args, way, group, static_tree if way == "static" else ROOT, got)
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
