"""Which engine generates, decided in one place for every stage (what they return: `grpo.sampling.rollout`).

Every stage that samples gets its engine from `build_engine`, out of its `generation` section (`GenerationConfig`,
one per stage in the recipe):

| who samples | engines it may use |
|---|---|
| GRPO and PPO rollouts (`grpo.training.loops.grpo_trainer`) | local: it needs token ids, and a weight sync after each step |
| held-out evaluation (`tasks.evaluate`) | local |
| rejection sampling (`tasks.rejection`, `r1 plan`) | local or http |
| the local LLM judge (`grpo.sampling.judge`) and PRM step labels (`grpo.training.loops.prm`) | local |
| `r1 serve` (`flows.cli.serve`) | local |

The engines:
- `local` (`grpo.sampling.local.backend.TransformersBackend`): the model in this process. With `sampler: auto`,
  Qwen2/Qwen3/Llama/Mistral-style decoders sample through the static-shape sampler (`local.static_sampler`:
  a KV cache allocated once, sampling inside the step, CUDA graphs on a GPU, a bf16 copy of fp32 weights where the
  stage computes in bf16); any other model, or one the static step cannot compute exactly, decodes through its own
  forward, step by step (logged once). `sampler: loop` always takes the latter.
- `http` (`grpo.sampling.http_backend.HTTPGenerationBackend`): OpenAI-compatible `/v1/completions` servers (vLLM,
  SGLang, `r1 serve`). Text only: a server hands back no token ids the trainer could score, and serves a fixed
  checkpoint, so only rejection sampling may use it.

An engine has two calls (`Engine`): `generate(prompts, n, sampling) -> Rollout`, and `sync_weights()`, which makes
the next `generate` sample from the model's current weights. A trainer calls it after every optimizer step: an
engine that holds its own copy of the weights (the static sampler's bf16 copy or captured steps; a vLLM server one
day) refreshes it there, and one that reads the model directly does nothing. Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo.configs.sampling import GenerationConfig
from grpo.sampling.http_backend import build_http_backend
from grpo.sampling.local import TransformersBackend
from grpo.sampling.rollout import Engine, Rollout, cat_padded, require_tokens

__all__ = ["Engine", "Rollout", "build_engine", "cat_padded", "local_generation", "require_tokens", "sampling_dtype"]


def sampling_dtype(precision: str) -> torch.dtype | None:
    """The weights' dtype to sample with, for a stage whose resolved precision is `precision` (`bf16`, `fp16` or
    `no`; `grpo.training.precision` resolves `auto`): bf16 weights where the stage computes in bf16 (a bf16 copy of
    fp32 weights, refreshed by `sync_weights`); otherwise the model's own (None)."""
    return torch.bfloat16 if precision == "bf16" else None


def build_engine(generation: GenerationConfig, model: PreTrainedModel | None = None,
                 tokenizer: PreTrainedTokenizerBase | None = None, *, dtype: torch.dtype | None = None,
                 who: str = "this stage", text_only_ok: bool = False, fp32_gemm: str = "auto") -> Engine:
    """The engine `generation` names, for `model` (local) or the recipe's servers (http).

    dtype: the weights the local engine samples with (None: the model's own); `sampling_dtype` gives it from a
    stage's precision. fp32_gemm: which library packs the local engine's fp32 weights on a CPU (a loop's
    `fp32_gemm`: `grpo.kernels.gemm.packed_library`). text_only_ok: whether the caller can do with text (rejection
    sampling); others are refused an http engine here, before any work, with `who` named.
    """
    if generation.backend == "http":
        if not text_only_ok:
            raise ValueError(f"{who} samples from the model it holds (it needs token ids, and its weights change or "
                             f"are not served): generation.backend must be local, not http")
        return build_http_backend(generation, tokenizer)
    if model is None or tokenizer is None:
        raise ValueError(f"{who}: the local engine needs the model and its tokenizer")
    budget = None if generation.kv_cache_mb is None else generation.kv_cache_mb * 2**20
    return TransformersBackend(model, tokenizer, dtype=dtype, static=generation.sampler == "auto",
                               kv_cache_bytes=budget, fp32_gemm=fp32_gemm)


def local_generation(generation: GenerationConfig | None) -> GenerationConfig:
    """`generation`'s settings for a model in this process (a local judge beside http generation, say)."""
    if generation is None:
        return GenerationConfig()
    return generation if generation.backend == "local" else GenerationConfig(sampler=generation.sampler,
                                                                             kv_cache_mb=generation.kv_cache_mb)
