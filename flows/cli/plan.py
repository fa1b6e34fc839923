"""`r1 plan`: what a recipe's rejection-sampling stage would make and cost, before it costs anything.

Counts the prompts the stage would sample (synthetic ones are generated, a file is read; a source that cannot be
read here counts as `num_train`, and says so), then prints samples, shards, completion tokens, rows kept and time
(`grpo.rejection.budget` has the arithmetic and its assumptions). The throughput is given (`--tokens-per-s`) or
measured by a short real generation: with the recipe's model in this process for the local backend, against the
recipe's endpoints for the HTTP backend. Starts no Prefect server and no MLflow run.
"""

from __future__ import annotations

import contextlib
import platform
from pathlib import Path

import pandas as pd

from grpo.configs.data import DataConfig
from grpo.configs.model import ModelConfig
from grpo.configs.recipe import RejectionSamplingConfig
from grpo.rejection.budget import format_budget, measure_tokens_per_s, plan_budget, plan_mean_fraction


def count_prompts(cfg: DataConfig) -> tuple[pd.DataFrame | None, int, str]:
    """(the prompt rows if they could be read, how many the stage would sample, where the count comes from)."""
    from grpo.data.tables import load_rl_data

    if cfg.source == "synthetic":
        rows = load_rl_data(cfg.model_copy(update={"num_heldout": 0}))[0]
        return rows, len(rows), "synthetic problems, num_train"
    try:
        rows = load_rl_data(cfg.model_copy(update={"num_heldout": 0}))[0]
    except (OSError, ValueError) as e:  # a missing file, a hub name out of reach, a file without the columns
        if not cfg.num_train:
            raise ValueError(f"cannot read the prompts from {cfg.source!r} ({e}) and num_train is 0 (all rows): "
                             f"no count to plan with") from None
        return None, cfg.num_train, f"num_train: {cfg.source} not read here ({str(e)[:120]}); it may hold fewer"
    return rows, len(rows), f"read from {cfg.source}"


def _device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return "CPU " + line.split(":", 1)[1].strip()
    return f"CPU {platform.processor()}"


def measure(cfg: RejectionSamplingConfig, prompts: list,
            checkpoint: str | None) -> tuple[float, str, tuple[int, int]]:
    """Tokens/s per generator from a short real generation, a line saying how it was measured, and the probe's
    (completion tokens, samples)."""
    import torch

    from grpo.models import load_model_and_tokenizer, load_tokenizer
    from grpo.sampling.engines import build_engine

    model_cfg: ModelConfig = cfg.model if checkpoint is None else cfg.model.model_copy(
        update={"name_or_path": checkpoint})
    rs = cfg.rejection
    k = rs.samples_per_prompt
    if cfg.generation.backend == "http":
        gen = cfg.generation
        backend = build_engine(gen, tokenizer=load_tokenizer(model_cfg), text_only_ok=True)
        try:
            backend.check_available(rs.sampling)
            batch = prompts[:max(1, gen.max_in_flight * len(gen.endpoints) // k)]
            rate, tokens, seconds = measure_tokens_per_s(backend, batch, k, rs.sampling)
        finally:
            backend.close()
        per = rate / len(gen.endpoints)
        return per, (f"measured: {tokens:,} tokens in {seconds:.1f} s from {len(gen.endpoints)} endpoint(s) serving "
                     f"{gen.model!r}, {len(batch) * k} requests, divided by the endpoints"), (tokens, len(batch) * k)
    model, tok = load_model_and_tokenizer(model_cfg)
    if torch.cuda.is_available():
        model = model.cuda()
    batch = prompts[:max(1, rs.sampling.batch_size // k)]
    engine = build_engine(cfg.generation, model, tok, who="r1 plan")
    rate, tokens, seconds = measure_tokens_per_s(engine, batch, k, rs.sampling)
    return rate, (f"measured: {tokens:,} tokens in {seconds:.1f} s, {len(batch) * k} sequences of "
                  f"{model_cfg.name_or_path!r} on {_device_name()}, local backend"), (tokens, len(batch) * k)


def plan_text(cfg: RejectionSamplingConfig, *, tokens_per_s: float | None = None, mean_fraction: float | None = None,
              keep_rate: float = 0.5, generators: int | None = None, checkpoint: str | None = None) -> str:
    """What `r1 plan` prints for a recipe's rejection-sampling section."""
    rows, prompts, source = count_prompts(cfg.data)
    if generators is None:
        generators = len(cfg.generation.endpoints) if cfg.generation.backend == "http" else 1
    how, probe = "given", None
    if tokens_per_s is None:
        stand_in = [f"Problem {i}: a stand-in prompt to time generation with." for i in range(64)]
        real = rows is not None and len(rows)
        texts = rows["prompt"].tolist()[:64] if real else stand_in
        tokens_per_s, how, measured = measure(cfg, texts, checkpoint)
        probe = measured if real else None  # a stand-in prompt's answers say nothing of the rows' lengths
    fraction, fraction_source = plan_mean_fraction(mean_fraction, cfg.rejection.sampling, probe)
    budget = plan_budget(prompts, cfg.rejection, mean_fraction=fraction, keep_rate=keep_rate,
                         tokens_per_s=tokens_per_s, generators=generators, tokens_per_s_source=how,
                         mean_fraction_source=fraction_source)
    return format_budget(budget, source)
