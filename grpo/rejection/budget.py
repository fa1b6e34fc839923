"""Sizing rejection sampling before spending on it: prompts, samples, shards, tokens, rows kept, and time.

For a recipe's `RejectionConfig` and its number of prompts:

    samples     = prompts x samples_per_prompt
    shards      = ceil(prompts / shard_size)
    tokens      = samples x mean completion length, taken as `mean_fraction` x max_new_tokens (the budget alone is
                  the upper bound; reasoning traces stop well short of it on average)
    kept rows   = prompts x E[min(X, max_kept_per_prompt)], X ~ Binomial(samples_per_prompt, keep_rate): each
                  sample passes the filters and the correctness check with probability `keep_rate`, independently
                  of the prompt's other samples (optimistic: hard prompts fail together); then at most the target's
                  reasoning rows
    time        = tokens / (tokens_per_s x generators), tokens_per_s per generator (one server, or one GPU)

Prompt tokens are left out: a server prefills a prompt once per sample (or once, with prefix caching), which is
small next to thousands of decoded tokens. Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple

from grpo.configs.core import RejectionConfig, SamplingConfig


class Budget(NamedTuple):
    prompts: int
    samples_per_prompt: int
    samples: int
    shards: int
    max_new_tokens: int
    mean_fraction: float  # assumed mean completion length / max_new_tokens
    tokens: float  # expected completion tokens
    keep_rate: float  # assumed share of samples that pass every check
    max_kept_per_prompt: int  # 0 = no cap
    kept: float  # expected rows kept by the per-sample checks and the per-prompt cap
    reasoning_target: int  # target_samples - non_reasoning_rows
    non_reasoning_rows: int
    tokens_per_s: float  # per generator
    generators: int  # servers (or GPUs) sampling at once
    tokens_per_s_source: str  # "given" or how it was measured

    @property
    def reasoning_rows(self) -> float:
        return min(self.kept, self.reasoning_target)

    @property
    def generator_hours(self) -> float:
        return self.tokens / self.tokens_per_s / 3600

    @property
    def wall_hours(self) -> float:
        return self.generator_hours / self.generators


def expected_kept_per_prompt(k: int, keep_rate: float, cap: int) -> float:
    """E[min(X, cap)] for X ~ Binomial(k, keep_rate); cap 0 means no cap.

    >>> expected_kept_per_prompt(4, 0.5, 0)
    2.0
    >>> expected_kept_per_prompt(2, 0.5, 1)  # P(X >= 1) = 3/4
    0.75
    """
    cap = cap or k
    return sum(min(x, cap) * math.comb(k, x) * keep_rate**x * (1 - keep_rate) ** (k - x) for x in range(k + 1))


def plan_budget(prompts: int, cfg: RejectionConfig, *, mean_fraction: float, keep_rate: float, tokens_per_s: float,
                generators: int = 1, tokens_per_s_source: str = "given") -> Budget:
    """The budget of sampling `prompts` prompts under `cfg`; see the module docstring for each figure."""
    if not 0 < mean_fraction <= 1:
        raise ValueError(f"mean_fraction is the mean completion length over max_new_tokens, in (0, 1]; got "
                         f"{mean_fraction}")
    if not 0 <= keep_rate <= 1:
        raise ValueError(f"keep_rate is the share of samples kept, in [0, 1]; got {keep_rate}")
    if tokens_per_s <= 0 or generators < 1:
        raise ValueError(f"tokens_per_s must be positive and generators at least 1; got {tokens_per_s}, "
                         f"{generators}")
    k = cfg.samples_per_prompt
    samples = prompts * k
    max_tokens = cfg.sampling.max_new_tokens
    kept = prompts * expected_kept_per_prompt(k, keep_rate, cfg.max_kept_per_prompt)
    return Budget(prompts, k, samples, math.ceil(prompts / cfg.shard_size), max_tokens, mean_fraction,
                  samples * max_tokens * mean_fraction, keep_rate, cfg.max_kept_per_prompt, kept,
                  cfg.target_samples - cfg.non_reasoning_rows, cfg.non_reasoning_rows, tokens_per_s, generators,
                  tokens_per_s_source)


def _n(x: float) -> str:
    return f"{x:,.0f}"


def _duration(hours: float, days: bool = True) -> str:
    if hours < 1 / 60:
        return f"{hours * 3600:.1f} s"
    if hours < 1:
        return f"{hours * 60:.1f} min"
    return f"{hours:,.1f} h" + (f" ({hours / 24:,.1f} days)" if days and hours >= 48 else "")


def format_budget(b: Budget, prompts_source: str = "") -> str:
    """The budget as the lines `r1 plan` prints, each assumption next to the figure it drives."""
    cap = f"at most {b.max_kept_per_prompt} per prompt" if b.max_kept_per_prompt else "no per-prompt cap"
    short = b.reasoning_target - b.kept
    reach = (f"short of the target by {_n(short)}: more prompts, more samples per prompt, or a higher keep rate"
             if short > 0 else f"the target is reached; {_n(-short)} more are dropped by the cap to the target")
    lines = [
        f"prompts              {_n(b.prompts)}" + (f"   ({prompts_source})" if prompts_source else ""),
        f"samples              {_n(b.samples)}   ({b.samples_per_prompt} per prompt)",
        f"shards               {_n(b.shards)}",
        f"completion tokens    {_n(b.tokens)}   (mean {b.mean_fraction:g} x max_new_tokens {b.max_new_tokens:,}, "
        f"assumed; at most {_n(b.samples * b.max_new_tokens)})",
        f"rows kept            {_n(b.kept)}   (keep rate {b.keep_rate:g} per sample, assumed; {cap})",
        f"reasoning rows       {_n(b.reasoning_rows)} of the target's {_n(b.reasoning_target)}: {reach}",
        f"non-reasoning rows   {_n(b.non_reasoning_rows)}   (from non_reasoning_source, not sampled)",
        f"throughput           {b.tokens_per_s:,.1f} tokens/s per generator ({b.tokens_per_s_source})",
    ]
    if b.generators == 1:
        lines.append(f"generation time      {_duration(b.wall_hours)}   (one generator)")
    else:
        lines.append(f"generation time      {_duration(b.wall_hours)} with {b.generators} generators; "
                     f"{_duration(b.generator_hours, days=False)} of one (GPU-hours where a generator is one GPU)")
    return "\n".join(lines)


def measure_tokens_per_s(backend, prompts: list, n: int, sampling: SamplingConfig,
                         max_new_tokens: int = 128) -> tuple[float, int, float]:
    """Completion tokens per second of one real generation: (tokens/s, tokens, seconds).

    `n` samples of each prompt with the recipe's sampling, the budget cut to `max_new_tokens` so it takes seconds
    (a longer budget decodes at longer context, a little slower per token). One short warm-up call goes first,
    so loading and first-call costs are not counted.
    """
    short = sampling.model_copy(update={"max_new_tokens": min(sampling.max_new_tokens, max_new_tokens)})
    backend.generate(prompts[:1], 1, short.model_copy(update={"max_new_tokens": 2}))
    start = time.perf_counter()
    out = backend.generate(prompts, n, short)
    seconds = time.perf_counter() - start
    tokens = int(out.completion_tokens.sum())
    return tokens / seconds, tokens, seconds
