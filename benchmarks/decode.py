"""Generation alone with the sampler the GRPO trainer uses (the engine `grpo.sampling.engines` builds), for the GPU
workload's batch: the twin of the shared bench's gpu/decode_peer.py (transformers' `generate`, dynamic and static
cache).

usage: python benchmarks/decode.py MODEL_DIR [--batch 128 512] [--new-tokens 256] [--weights bf16|fp32|fp32-autocast]
                                   [--device auto|cpu|cuda]
MODEL_DIR comes from gpu/make_model.py. The prompts are the peer's (`What is {a} + {b}?`, left-padded), sampled at
temperature 1 with no top-k/top-p; no row is allowed to end early (the end token is not a stop here), so every row
decodes `--new-tokens` tokens, as the peer's `min_new_tokens` makes it. Weights in bf16 as the peer's (the GRPO
trainer samples this way with `weights_dtype: bfloat16`), or fp32 under bf16 autocast (how it samples with
`mixed_precision: bf16`), or fp32 throughout (how it samples on a CPU without native bf16). Prints one JSON line per batch size, after one warm-up call: completion tokens per second,
milliseconds per decode step, and on CUDA the peak memory of the call.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--batch", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--weights", choices=["bf16", "fp32", "fp32-autocast"], default="bf16")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""

    import torch

    from grpo.configs.model import ModelConfig
    from grpo.configs.sampling import GenerationConfig, SamplingConfig
    from grpo.models import load_model_and_tokenizer
    from grpo.sampling.engines import build_engine, sampling_dtype

    cuda = torch.cuda.is_available()
    if args.device == "cuda" and not cuda:
        sys.exit("--device cuda: torch sees no CUDA device here")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = "bfloat16" if args.weights == "bf16" else "float32"
    model, tok = load_model_and_tokenizer(ModelConfig(name_or_path=args.model_dir, dtype=dtype))
    model.to(device).eval()
    tok.padding_side = "left"
    prompts = [f"What is {10 + i % 90} + {20 + i % 70}?" for i in range(max(args.batch))]  # the peer's
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, temperature=1.0)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # the trainer's sampler: the engine it builds (static-cache sampler for this model, a bf16 copy of fp32 weights
    # where the loop computes in bf16), with logprobs off as GRPO asks without truncated importance sampling
    precision = "bf16" if args.weights == "fp32-autocast" else "no"
    backend = build_engine(GenerationConfig(), model, tok, dtype=sampling_dtype(precision))

    def run(batch: int) -> tuple[float, int]:
        enc = tok(prompts[:batch], return_tensors="pt", padding=True, add_special_tokens=False)
        sync()
        t = time.perf_counter()
        ids, _, _, _ = backend.sample_ids(enc["input_ids"], enc["attention_mask"], sampling, eos_ids=[],
                                          logprobs=False)
        sync()
        return time.perf_counter() - t, ids.size(1)

    for batch in args.batch:
        run(batch)  # warm-up
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        s, new = run(batch)
        row = {"way": f"r1-pipeline-{args.weights}", "device": torch.cuda.get_device_name() if cuda else "cpu",
               "batch": batch, "new_tokens": new, "tokens_per_s": round(batch * new / s),
               "ms_per_step": round(1000 * s / new, 2)}
        if cuda:
            row["peak_cuda_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
