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
small next to thousands of decoded tokens.

The plan against the run: each shard task measures its sampling, curation and judging (`ShardTiming`, kept in the
shard's file), and `plan_against_run` sets each shard's measured sampling time beside the plan's prediction for it,
its tokens over `tokens_per_s`, so a run shows how far off the plan was, and which assumption. Must not depend on
Prefect or MLflow.
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple

from grpo.configs.rejection import RejectionConfig
from grpo.configs.sampling import SamplingConfig


class ShardTiming(NamedTuple):
    """What one shard task measured (seconds of wall time in the task)."""

    samples: int  # completions sampled
    completion_tokens: int  # their tokens
    sample_s: float  # generating them
    curate_s: float  # curating them: filters, rule check and judge (judge_s is part of it)
    judge_s: float  # waiting for the judge
    judge_calls: int  # requests sent to the judge, retries included (a local judge: items judged)

    def to_dict(self) -> dict:
        return self._asdict()

    @classmethod
    def from_dict(cls, d: dict) -> "ShardTiming":
        return cls(**{k: d[k] for k in cls._fields})


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
    mean_fraction_source: str = "assumed"  # "assumed", "given", or the probe it was measured by

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


ASSUMED_MEAN_FRACTION = 0.5  # the mean completion length over the budget, where neither given nor measured
PROBE_MAX_NEW_TOKENS = 128  # the throughput probe's completion budget: seconds, not minutes


def plan_budget(prompts: int, cfg: RejectionConfig, *, mean_fraction: float, keep_rate: float, tokens_per_s: float,
                generators: int = 1, tokens_per_s_source: str = "given",
                mean_fraction_source: str = "assumed") -> Budget:
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
                  tokens_per_s_source, mean_fraction_source)


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
        f"completion tokens    {_n(b.tokens)}   (mean {b.mean_fraction:.3g} x max_new_tokens {b.max_new_tokens:,}, "
        f"{b.mean_fraction_source}; at most {_n(b.samples * b.max_new_tokens)})",
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
                         max_new_tokens: int = PROBE_MAX_NEW_TOKENS) -> tuple[float, int, float]:
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


def plan_mean_fraction(given: float | None, sampling: SamplingConfig, probe: tuple[int, int] | None
                       ) -> tuple[float, str]:
    """The mean completion length over the budget the plan uses, and where it comes from: `given` (the recipe's);
    else what the probe's `(tokens, samples)` came to, where it sampled at the stage's own budget (a probe cut
    shorter says nothing of how long the rows run); else the assumption.

    >>> plan_mean_fraction(None, SamplingConfig(max_new_tokens=64), (3162, 64))  # 3162 / (64 x 64)
    (0.77197265625, "measured: the probe's 64 samples")
    >>> plan_mean_fraction(None, SamplingConfig(max_new_tokens=512), (3162, 64))  # the probe cut at 128: unknown
    (0.5, 'assumed')
    """
    if given is not None:
        return given, "given"
    if probe is not None and sampling.max_new_tokens <= PROBE_MAX_NEW_TOKENS:
        tokens, samples = probe
        return tokens / (samples * sampling.max_new_tokens), f"measured: the probe's {samples} samples"
    return ASSUMED_MEAN_FRACTION, "assumed"


def predicted_shard_s(b: Budget, prompts: int) -> float:
    """The plan's sampling time for a shard of `prompts` prompts: its expected completion tokens over one
    generator's `tokens_per_s` (a shard's samples go to one generator, or are spread over the endpoints: then
    over all of them).

    >>> b = Budget(10, 4, 40, 2, 100, 0.5, 2000.0, 0.5, 0, 20.0, 10, 0, 50.0, 1, "given")
    >>> predicted_shard_s(b, 5)  # 5 prompts x 4 samples x 100 tokens x 0.5 / 50 tokens/s
    20.0
    """
    return prompts * b.samples_per_prompt * b.max_new_tokens * b.mean_fraction / b.tokens_per_s


def plan_against_run(b: Budget, shard_prompts: list[int], timings: list[ShardTiming | None], kept: int,
                     spread_over_generators: bool = False) -> tuple[list[dict], dict[str, float]]:
    """Each shard's predicted against measured sampling time, as table rows, and the stage's summary figures.

    `shard_prompts[i]` and `timings[i]` are shard i's (a timing is None for a shard written before shards kept
    theirs: it is left out of the sums). `spread_over_generators`: a shard's samples go to every generator (the
    HTTP backend's endpoints), so its prediction is over all of them.
    """
    per = b.tokens_per_s * (b.generators if spread_over_generators else 1)
    rows, measured, predicted, tokens, seconds = [], 0.0, 0.0, 0, 0.0
    judge_calls, judge_s = 0, 0.0
    for index, (prompts, t) in enumerate(zip(shard_prompts, timings)):
        expect = prompts * b.samples_per_prompt * b.max_new_tokens * b.mean_fraction / per
        row = {"shard": index, "prompts": prompts, "predicted_tokens": expect * per, "predicted_s": expect}
        if t is not None:
            row.update(completion_tokens=t.completion_tokens, measured_s=t.sample_s, curate_s=t.curate_s,
                       judge_s=t.judge_s, judge_calls=t.judge_calls,
                       measured_over_predicted=t.sample_s / expect if expect else float("nan"))
            predicted, measured = predicted + expect, measured + t.sample_s
            tokens, seconds = tokens + t.completion_tokens, seconds + t.sample_s
            judge_calls, judge_s = judge_calls + t.judge_calls, judge_s + t.judge_s
        rows.append(row)
    timed = sum(t is not None for t in timings)
    summary = {"plan/predicted_kept": b.kept, "plan/kept": float(kept), "plan/shards_timed": float(timed)}
    if timed:
        summary.update({
            "plan/predicted_sampling_s": predicted,
            "plan/measured_sampling_s": measured,
            "plan/measured_over_predicted": measured / predicted if predicted else float("nan"),
            "plan/predicted_tokens_per_s": per,
            "plan/measured_tokens_per_s": tokens / seconds if seconds else 0.0,
            "plan/predicted_mean_fraction": b.mean_fraction,
            "plan/measured_mean_fraction": tokens / (sum(t.samples for t in timings if t) * b.max_new_tokens),
        })
    if judge_calls:
        summary.update(judge_metrics(judge_calls, judge_s, kept))
    return rows, summary


def judge_metrics(calls: int, seconds: float, kept: int) -> dict[str, float]:
    """The judge's load: calls (requests, retries included), calls per second of judging (summed over the shards,
    whose requests each ran `max_workers` at once) and calls per 1,000 kept rows.

    >>> judge_metrics(300, 60.0, 150)["judge/calls_per_1k_kept"]
    2000.0
    """
    return {"judge/calls": float(calls), "judge/seconds": seconds,
            "judge/calls_per_s": calls / seconds if seconds else 0.0,
            "judge/calls_per_1k_kept": 1000 * calls / kept if kept else float("nan")}


def format_plan_against_run(summary: dict[str, float]) -> str:
    """One line: the plan's sampling time and tokens/s against what the shards measured."""
    if "plan/measured_sampling_s" not in summary:
        return "no shard measured its time"
    return (f"sampling took {_duration(summary['plan/measured_sampling_s'] / 3600)} over "
            f"{summary['plan/shards_timed']:.0f} shard(s), the plan said "
            f"{_duration(summary['plan/predicted_sampling_s'] / 3600)} "
            f"(x{summary['plan/measured_over_predicted']:.2f}): {summary['plan/measured_tokens_per_s']:,.1f} tokens/s "
            f"against {summary['plan/predicted_tokens_per_s']:,.1f}, mean length "
            f"{summary['plan/measured_mean_fraction']:.2f} of max_new_tokens against "
            f"{summary['plan/predicted_mean_fraction']:g}; kept {summary['plan/kept']:,.0f} rows against "
            f"{summary['plan/predicted_kept']:,.0f}")
