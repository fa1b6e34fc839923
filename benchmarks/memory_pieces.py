"""Memory of four pieces of the GPU path, measured on CPU at a real model's size: one JSON line on stdout.

    python benchmarks/memory_pieces.py [--preset qwen2.5-0.5b|small] [--layers N] [--batch 128] [--repeats 10]

The model is a `Qwen2ForCausalLM` with random weights in Qwen2.5-0.5B's shape by default (hidden 896, MLP 4864,
24 layers, 14 heads, 2 KV heads, vocabulary 151,936, tied embeddings); the whole run takes a few minutes on 2 cores
and about 10 GB at its peak (the optimizer's fp32 masters and moments). `--preset small` keeps the vocabulary but
shrinks the rest (hidden 256, 4 layers) for a quick run; `--layers N` cuts the layer count of either.

1. `sampler_copy`: the bytes made while `StaticSampler(model, dtype=bfloat16)` makes its bf16 copy of an fp32
   model, against the old way (`copy.deepcopy(model)`, then each parameter cast to bf16), and the model's bf16
   size (a tied weight once) and its buffers' bytes for reference.
2. `master_weights`: the most extra bytes alive during a `MasterWeights` step of bf16 weights with fp32 masters
   and fused AdamW (the second step: the first makes the optimizer's state), sliced at `STEP_SLICE_BYTES` against
   all at once (a slice budget larger than the model), with one further step's seconds for each.
3. `inverse_cdf`: the two-level inverse CDF `choose_tokens` uses against a float64 cumsum over the whole vocabulary
   (what it replaced), at batch x vocabulary: milliseconds a call (best of `--repeats` rounds after a warm-up) on one
   thread and on all, the largest single tensor each makes and the most bytes alive at once.

4. `head_backward`: the most bytes alive during the backward of the chunked log-probs (`selective_logps`) under
   bf16 autocast at the preset's head ([vocabulary, hidden] fp32 weight, 512 tokens), with the weight gradient
   accumulated a `WGRAD_BLOCK_BYTES` block of the vocabulary at a time against the whole [V, H] bf16 product and
   its fp32 copy per chunk (what it replaced); the two gradients must be equal.

Bytes come from `BytesAlive` (every op's new storages, followed until freed), so they are exact on CPU and say
nothing of an allocator's caching; times are wall-clock and swing with whatever else the machine runs.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from benchmarks.bytes_alive import BytesAlive  # noqa: E402
from grpo.kernels import logprobs  # noqa: E402
from grpo.sampling.local.static_sampler import StaticSampler, inverse_cdf  # noqa: E402
from grpo.training.optimizers import STEP_SLICE_BYTES, MasterWeights, cast_parameters, make_adamw  # noqa: E402

QWEN = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
            num_key_value_heads=2, vocab_size=151_936, tie_word_embeddings=True, max_position_embeddings=32_768,
            rope_theta=1_000_000.0, rms_norm_eps=1e-6)
PRESETS = {
    "qwen2.5-0.5b": QWEN,
    # the vocabulary stays: it is what the inverse CDF and the tied embedding are about
    "small": {**QWEN, "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2},
}
MB = 2**20


def cpu() -> dict:
    info = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    flags = info.get("flags", "").split()
    return {"model_name": info.get("model name"), "family": info.get("cpu family"), "model": info.get("model"),
            "threads": torch.get_num_threads(), "avx512_bf16": "avx512_bf16" in flags}


def make_model(preset: str, layers: int | None) -> Qwen2ForCausalLM:
    cfg = dict(PRESETS[preset])
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**cfg)).eval()


def sampler_copy(model: Qwen2ForCausalLM) -> dict:
    bf16 = sum(p.numel() * 2 for p in model.parameters())  # parameters() yields a tied weight once
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    sampler = StaticSampler(model, dtype=torch.bfloat16)
    with BytesAlive() as new:
        half = sampler._sampling_model()
    assert half.lm_head.weight is half.model.embed_tokens.weight  # still tied: counted once above too
    del half, sampler
    gc.collect()
    with torch.no_grad(), BytesAlive() as old:
        twin = copy.deepcopy(model)
        for p in twin.parameters():
            p.data = p.data.to(torch.bfloat16)
    del twin
    gc.collect()
    return {"bf16_model_bytes": bf16, "buffer_bytes": buffers, "peak_bytes": new.peak, "old_peak_bytes": old.peak}


def master_step(model: Qwen2ForCausalLM, slice_bytes: int) -> dict:
    """The bytes a MasterWeights step makes over bf16 weights whose bf16 gradients are already there."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = MasterWeights(params, lambda ps: make_adamw(ps, 1e-6, 0.0), slice_bytes=slice_bytes)
    for p in params:
        p.grad = torch.full_like(p, 1e-3)  # [*p.shape] bf16, as a bf16 backward leaves it; the step keeps it
    opt.step()  # makes the two fp32 moments of every master: state, not the step's working memory
    with BytesAlive() as alive:
        opt.step()
    start = time.perf_counter()
    opt.step()
    seconds = time.perf_counter() - start
    out = {"slices": len(opt.slices), "peak_extra_bytes": alive.peak, "step_s": round(seconds, 3)}
    del opt
    gc.collect()
    return out


def master_weights(model: Qwen2ForCausalLM) -> dict:
    cast_parameters(model, torch.bfloat16)
    masters = sum(p.numel() * 4 for p in model.parameters())
    sliced = master_step(model, STEP_SLICE_BYTES)
    whole = master_step(model, 2**62)  # every gradient in one slice: the step before slicing
    for p in model.parameters():
        p.grad = None
    return {"slice_bytes": STEP_SLICE_BYTES, "fp32_master_bytes": masters,
            "largest_parameter_fp32_bytes": max(p.numel() * 4 for p in model.parameters()),
            "sliced": sliced, "all_at_once": whole}


def full_cumsum(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """What `choose_tokens` did before `inverse_cdf`: a float64 cumsum of the whole vocabulary."""
    cdf = probs.double().cumsum(-1)  # [B, V]
    target = (1 - u.double())[:, None] * cdf[:, -1:]  # [B, 1]
    return torch.searchsorted(cdf, target).squeeze(-1).clamp(max=probs.size(-1) - 1)  # [B]


def best_ms(fns: dict, repeats: int) -> dict:
    """Each function's best milliseconds a call over `repeats` rounds, the functions alternating within a round so
    that a busy moment on a shared machine falls on both."""
    for fn in fns.values():
        fn(), fn()  # warm-up
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: round(t * 1e3, 2) for name, t in best.items()}


def cdf_pieces(batch: int, vocab: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    probs = (torch.randn(batch, vocab, generator=g) * 4).softmax(-1)  # [B, V] peaky, as sampling sees them
    u = torch.rand(batch, generator=g)  # [B] float32, as the sampler's uniform table
    assert torch.equal(inverse_cdf(probs, u), full_cumsum(probs, u))
    fns = {"two_level": lambda: inverse_cdf(probs, u), "full_cumsum": lambda: full_cumsum(probs, u)}
    out = {"batch": batch, "vocab": vocab}
    for name, fn in fns.items():
        with BytesAlive() as alive:
            fn()
        out[name] = {"largest_tensor_bytes": alive.largest, "peak_bytes": alive.peak}
    every = torch.get_num_threads()
    for threads in sorted({1, every}):
        torch.set_num_threads(threads)
        for name, ms in best_ms(fns, repeats).items():
            out[name][f"ms_{threads}_thread" + ("s" if threads > 1 else "")] = ms
    torch.set_num_threads(every)
    return out


def head_backward(vocab: int, hidden: int, tokens: int = 512) -> dict:
    """Peak bytes of the chunked head's backward under bf16 autocast: blocked weight gradient against whole."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(vocab, hidden) * 0.02)  # [V, H]
    states = torch.randn(1, tokens, hidden)  # [1, T, H]
    targets = torch.randint(0, vocab, (1, tokens))  # [1, T]
    out, grads = {"weight_fp32_bytes": weight.numel() * 4, "tokens": tokens}, {}
    whole = vocab * hidden * 4  # a block this large is the whole product: the old way
    for name, block in (("blocked", logprobs.WGRAD_BLOCK_BYTES), ("whole", whole)):
        saved, logprobs.WGRAD_BLOCK_BYTES = logprobs.WGRAD_BLOCK_BYTES, block
        try:
            weight.grad = None
            h = states.clone().requires_grad_(True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logps, _ = logprobs.selective_logps(h, weight, None, targets, 1.0)
            start = time.perf_counter()
            with BytesAlive() as alive:
                logps.sum().backward()
            out[name] = {"block_bytes": block, "peak_bytes": alive.peak,
                         "seconds": round(time.perf_counter() - start, 2)}
            grads[name] = weight.grad
        finally:
            logprobs.WGRAD_BLOCK_BYTES = saved
    out["equal_gradients"] = torch.equal(grads["blocked"], grads["whole"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen2.5-0.5b")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's)")
    ap.add_argument("--batch", type=int, default=128, help="rows of the inverse CDF")
    ap.add_argument("--repeats", type=int, default=10, help="timed rounds of the inverse CDF (the best kept)")
    args = ap.parse_args()

    model = make_model(args.preset, args.layers)
    cfg = model.config
    result = {"preset": args.preset, "layers": cfg.num_hidden_layers, "parameters": sum(p.numel() for p in
              model.parameters()), "torch": torch.__version__, "cpu": cpu()}
    result["sampler_copy"] = s = sampler_copy(model)
    print(f"sampler copy: {s['peak_bytes'] / MB:.0f} MiB made (old way {s['old_peak_bytes'] / MB:.0f} MiB); "
          f"bf16 model {s['bf16_model_bytes'] / MB:.0f} MiB", file=sys.stderr)
    result["master_weights"] = m = master_weights(model)
    print(f"master weights step: {m['sliced']['peak_extra_bytes'] / MB:.0f} MiB extra sliced, "
          f"{m['all_at_once']['peak_extra_bytes'] / MB:.0f} MiB all at once "
          f"({m['sliced']['step_s']} s against {m['all_at_once']['step_s']} s)", file=sys.stderr)
    result["head_backward"] = h = head_backward(cfg.vocab_size, cfg.hidden_size)
    print(f"head backward under bf16 autocast: {h['blocked']['peak_bytes'] / MB:.0f} MiB at its peak, against "
          f"{h['whole']['peak_bytes'] / MB:.0f} MiB with the whole [V, H] product (equal gradients: "
          f"{h['equal_gradients']})", file=sys.stderr)
    del model
    gc.collect()
    result["inverse_cdf"] = c = cdf_pieces(args.batch, cfg.vocab_size, args.repeats)
    two, full = c["two_level"], c["full_cumsum"]
    print(f"inverse CDF at {args.batch} x {cfg.vocab_size}: {two['ms_1_thread']} ms against "
          f"{full['ms_1_thread']} ms on 1 thread; largest tensor {two['largest_tensor_bytes'] / MB:.1f} MiB "
          f"against {full['largest_tensor_bytes'] / MB:.1f} MiB", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
