"""Sampling a long-tailed workload: the engine as it is, the engine at an earlier commit, and transformers' own
continuous batching (`generate_batch`), on the same model and prompts, one after another in one run.

usage: python benchmarks/continuous_batching.py [--before REV] [--static] [--no-peer] [--prompts 128]
                                                [--samples 4] [--slots 64] [--budget 256] [--eos-scale 10]
                                                [--repeats 1] [--threads 2] [--clock wall|cpu]
                                                [--model DIR --dtype bfloat16] [--peer-timeout S]

The workload (the same for every way):
- the embedded recipe's model shape (Qwen2, hidden 256, 4 layers, 2.97M parameters, its 1,024-entry BPE tokenizer),
  freshly initialised with seed 0 (`grpo.tiny.build_tiny_model`), with the end token's output row scaled by
  `--eos-scale` (10): the chance of ending then depends on the context, so completions end anywhere from the first
  token to the budget. At the defaults, measured on the engine (seeded, so the same each run): lengths 1 to 256,
  p10 4, p25 9, median ~37, p75 ~205, and about 22% reach the 256-token budget;
- `--prompts` prompts `What is {a} + {b}?` through the tokenizer's chat template, `--samples` completions each, at
  temperature 1, no top-k or top-p, at most `--budget` new tokens, `--slots` sequences decoded together (the
  engine's `sampling.batch_size`; the peer's `max_requests_per_batch`).

Each way runs in a process of its own (after one warm-up call on 8 prompts) and prints one JSON line: completion
tokens per second, the length percentiles it sampled, and for the engine the decode row-steps: rows the decode
steps computed, summed over the steps, and the share of them spent on rows that had already ended. A row's first
token comes from its prefill and each later one from one decode step, so the share is 1 - (tokens - rows) /
rows computed. `--before REV` (default: the commit before continuous batching) is checked out into a temporary
folder with `git worktree` and its engine run by the same code here. The last line compares them.

The engine's lines also say what its KV cache cost: `kv_mb_allocated` (the largest cache a call held: a paged
pool's pages, or the static cache's S rows of prompt + budget positions), `kv_read_bytes_per_token` (the cache
positions the decode steps' attention read, summed over slots and steps, times a position's bytes over every layer,
per completion token), `pages_high_water` and `preemptions` (paged), and `peak_rss_mb` (the process's, warm-up and
model included). `--static` adds the engine with the static cache (the captured layout, stepped eagerly over the
positions written so far, as before paging), from `STATIC_REV` (the last commit that had it) checked out in a
worktree. The model's context is the budget + 128 positions.

`--clock cpu` times with the process's CPU time instead of the wall clock: on a machine shared with other jobs,
with `--threads 1`, it is what the work costs whatever else runs (a wall clock there measures the neighbours).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from worktrees import STATIC_REV, worktree

ROOT = Path(__file__).resolve().parent.parent
BEFORE = "5fcd545"  # main before the sampler streamed rows through slots


def workload(args):
    import torch

    if args.model:  # a preset folder (gpu/make_model.py), on the GPU where there is one
        from grpo.configs.model import ModelConfig
        from grpo.models import load_model_and_tokenizer

        model, tok = load_model_and_tokenizer(ModelConfig(name_or_path=args.model, dtype=args.dtype or "float32"))
        model.config.max_position_embeddings = max(model.config.max_position_embeddings, args.budget + 128)
        model = model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
        if tok.chat_template is None:  # the presets' prompts are plain text
            tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    else:
        from grpo.configs.model import TinyModelConfig
        from grpo.tiny import build_tiny_model, build_tokenizer

        tok = build_tokenizer()
        model = build_tiny_model(TinyModelConfig(max_position_embeddings=args.budget + 128), tok).eval()
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] *= args.eos_scale  # tied: the embedding row too (never an input)
    prompts = [[{"role": "user", "content": f"What is {10 + i % 90} + {20 + (7 * i) % 70}?"}]
               for i in range(args.prompts)]
    return model, tok, prompts


def clock(args):
    """The clock the runs are timed by: the wall clock, or the CPU time of every thread of the process."""
    return time.perf_counter if args.clock == "wall" else time.process_time


def percentiles(lengths: list[int], budget: int) -> dict[str, float]:
    import torch

    q = torch.quantile(torch.tensor(lengths, dtype=torch.float64), torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9],
                                                                                dtype=torch.float64))
    out = {f"p{int(p * 100)}": round(float(v), 1) for p, v in zip((0.1, 0.25, 0.5, 0.75, 0.9), q)}
    out["at_budget"] = round(sum(n >= budget for n in lengths) / len(lengths), 3)
    return out


def run_engine(args, label: str) -> dict:
    """The project's local engine as the GRPO trainer builds it, decode steps counted where they are computed."""
    import torch

    from grpo.configs.sampling import GenerationConfig, SamplingConfig
    from grpo.sampling.engines import build_engine

    try:  # where the step lives (before continuous batching it was the sampler's own module)
        from grpo.sampling.local import decode_step as step_module
    except ImportError:
        from grpo.sampling.local import static_sampler as step_module

    model, tok, prompts = workload(args)
    rows_computed = [0]
    decode = step_module._decode

    def counted(st, *a):
        rows_computed[0] += st.tok.size(0)
        return decode(st, *a)

    step_module._decode = counted
    engine = build_engine(GenerationConfig(), model, tok)
    if label == "engine static":  # (at STATIC_REV) the static cache, stepped eagerly over the positions written
        engine.sampler.keep_captures, engine.sampler.full_cache_attention, engine.sampler.buckets = True, False, False
        engine.sampler.kv_layout = "static"
    sampling = SamplingConfig(max_new_tokens=args.budget, temperature=1.0, batch_size=args.slots)
    torch.manual_seed(1)
    engine.generate(prompts[:8], args.samples, sampling)  # warm-up
    sampler = getattr(engine, "sampler", None)
    if sampler is not None and hasattr(sampler, "counts"):
        sampler.counts = type(sampler.counts)()  # the timed calls' counts only
    best = None
    for _ in range(args.repeats):
        rows_computed[0] = 0
        torch.manual_seed(0)
        t = clock(args)()
        rollout = engine.generate(prompts, args.samples, sampling)
        wall = clock(args)() - t
        if best is None or wall < best[0]:
            best = wall, rollout, rows_computed[0]
    wall, rollout, computed = best
    lengths = rollout.completion_tokens.tolist()
    tokens, rows = sum(lengths), len(lengths)
    out = {"way": label, "clock": args.clock, "threads": args.threads, "tokens": tokens, "seconds": round(wall, 2),
           "tokens_per_s": round(tokens / wall, 1), "row_steps": computed,
           "finished_row_steps_share": round(1 - (tokens - rows) / computed, 4),
           "lengths": percentiles(lengths, args.budget)}
    return {**out, **kv_figures(engine, model, tokens, args.repeats)}


def kv_figures(engine, model, tokens: int, repeats: int) -> dict:
    """What the KV cache cost, from the sampler's counts (summed over the timed calls), and the process's peak
    RSS."""
    import resource

    counts = getattr(getattr(engine, "sampler", None), "counts", None)
    rss = {"peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    if counts is None or not hasattr(counts, "kv_positions_read"):
        return rss  # an engine from before the counts
    cfg = model.config
    position = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    return {**rss, "kv_mb_allocated": round(counts.kv_bytes_allocated / 2**20, 1),
            "kv_read_bytes_per_token": round(counts.kv_positions_read * position / (tokens * repeats)),
            "pages_high_water": counts.pages_high_water, "preemptions": counts.preemptions}


def run_peer(args) -> dict:
    """transformers' continuous batching on the same model (paged attention over SDPA), the same prompts."""
    import logging

    import torch
    from transformers import GenerationConfig as HFGenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    logging.getLogger("transformers").setLevel(logging.ERROR)
    model, tok, prompts = workload(args)
    model.set_attn_implementation("paged|sdpa")
    texts = tok.apply_chat_template(prompts, add_generation_prompt=True, tokenize=False)
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    inputs = [x for x in ids for _ in range(args.samples)]
    gen = HFGenerationConfig(max_new_tokens=args.budget, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cb = ContinuousBatchingConfig(max_requests_per_batch=args.slots)
    torch.manual_seed(1)
    model.generate_batch(inputs=inputs[:8 * args.samples], generation_config=gen, continuous_batching_config=cb)
    best = None
    for _ in range(args.repeats):
        torch.manual_seed(0)
        t = clock(args)()
        out = model.generate_batch(inputs=inputs, generation_config=gen, continuous_batching_config=cb)
        wall = clock(args)() - t
        if best is None or wall < best[0]:
            best = wall, out
    wall, out = best
    lengths = [len(o.generated_tokens) for o in out.values()]
    tokens = sum(lengths)
    return {"way": "transformers generate_batch", "clock": args.clock, "threads": args.threads, "tokens": tokens,
            "seconds": round(wall, 2),
            "tokens_per_s": round(tokens / wall, 1), "lengths": percentiles(lengths, args.budget)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default=BEFORE, help="the commit to compare against ('' to skip)")
    ap.add_argument("--no-peer", action="store_true", help="skip transformers' generate_batch")
    ap.add_argument("--static", action="store_true", help="also the engine with the static cache (at STATIC_REV)")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--eos-scale", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    ap.add_argument("--model", help="a model folder (the shared bench's gpu/make_model.py) instead of the embedded one")
    ap.add_argument("--dtype", default=None,
                    help="with --model: the weights' dtype (default float32; bfloat16 on a GPU)")
    ap.add_argument("--peer-timeout", type=float, default=None,
                    help="seconds the peer may take; past them it is stopped and its line says so")
    ap.add_argument("--way", choices=["engine", "peer"], help=argparse.SUPPRESS)  # one way, in this process
    ap.add_argument("--label", default="engine", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.way:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(run_engine(args, args.label) if args.way == "engine" else run_peer(args)), flush=True)
        return

    passed = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
              if k in ("prompts", "samples", "slots", "budget", "eos_scale", "repeats", "threads", "clock", "model",
                       "dtype") and v is not None]

    def one(way: str, label: str, code: Path) -> dict:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(code)] + [x for x in [os.environ.get("PYTHONPATH")]
                                                                         if x]))
        try:
            out = subprocess.run([sys.executable, str(code / "benchmarks" / "continuous_batching.py"), "--way", way,
                                  "--label", label, *passed], env=env, cwd=code, check=True, capture_output=True,
                                 text=True, timeout=args.peer_timeout if way == "peer" else None)
        except subprocess.TimeoutExpired:
            row = {"way": "transformers generate_batch", "finished": False, "seconds": args.peer_timeout,
                   "tokens_per_s": None}
            print(json.dumps(row), flush=True)
            return row
        row = json.loads(out.stdout.strip().splitlines()[-1])
        print(json.dumps(row), flush=True)
        return row

    rows = {}
    if args.before:
        with worktree(args.before) as tree:
            rows["before"] = one("engine", f"engine at {args.before}", tree)
    if args.static:
        with worktree(STATIC_REV) as tree:
            rows["static"] = one("engine", "engine static", tree)
    rows["now"] = one("engine", "engine now", ROOT)
    if not args.no_peer:
        rows["peer"] = one("peer", "peer", ROOT)
    now = rows["now"]["tokens_per_s"]
    summary = {f"now/{k}": round(now / r["tokens_per_s"], 2) for k, r in rows.items()
               if k != "now" and r["tokens_per_s"]}
    summary.update({f"now/{k}": f"> {round(now * r['seconds'] / rows['now']['tokens'], 2)} (did not finish)"
                    for k, r in rows.items() if k != "now" and not r["tokens_per_s"]})
    print(json.dumps({"tokens_per_s_ratio": summary}))


if __name__ == "__main__":
    main()
