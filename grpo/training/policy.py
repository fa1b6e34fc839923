"""What the policy-gradient loops share (GRPO's and PPO's), as functions each loop calls in its own order: the reward
functions checked against the data, a trainable model with its optimizer, the frozen reference, a step's rollout
sampled and scored, log-probs without gradients, the figures of a step and its samples table, and the trained
policy saved for the next stage.

Neither loop inherits from the other: each writes its own step loop from these (grpo.training.loops.grpo_trainer,
grpo.training.loops.ppo_trainer), so a change to one loop cannot change the other unseen.

Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import copy
import functools
import math
import shutil
from collections import Counter
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Mapping, Sequence

import pandas as pd
import torch
from accelerate.utils import gather_object

from grpo.configs.sampling import SamplingConfig
from grpo.configs.training import GRPOConfig
from grpo.rewards import REWARD_FUNCTIONS, check_reward_columns, code_reward, make_code_reward, score_completions
from grpo.rewards.code import code_limits
from grpo.rewards.sandbox import check_sandbox
from grpo.sampling.engines import Engine, Rollout, require_tokens
from grpo.sampling.local import render_prompts
from grpo.training.accelerator import shared_gemm_plan
from grpo.training.distributed import gather_table, main_only, matched_chunks, reduce_metrics
from grpo.training.grading import GradingStop, GradingWatch, StepGrading
from grpo.training.logprobs import token_logps
from grpo.training.lora import add_lora, save_merged
from grpo.training.optimizers import cast_parameters, make_optimizer
from grpo.training.packing import micro_batch_rows
from grpo.training.schedules import make_scheduler

MetricsCallback = Callable[[int, dict[str, float]], None]
SamplesCallback = Callable[[int, pd.DataFrame], None]


def check_prompts(prompts: pd.DataFrame, per_step: int, who: str) -> None:
    """Refuse prompts without a `prompt` column or too few to fill one step, before any model work."""
    if "prompt" not in prompts.columns:
        raise ValueError(f"{who} prompts need a 'prompt' column; found {list(prompts.columns)}")
    if len(prompts) < per_step:
        raise ValueError(f"{len(prompts)} prompts cannot fill a step of prompts_per_step={per_step}")


def reward_registry(cfg: GRPOConfig, prompts: pd.DataFrame, reward_functions: Mapping[str, Callable] | None,
                    who: str) -> dict[str, Callable]:
    """The reward functions by name (the rule rewards, plus any the caller brings: a reward model's scorer, say),
    each of `cfg.rewards` checked now, not after the first rollout: known, its columns present, the code reward's
    sandbox available."""
    registry = dict(REWARD_FUNCTIONS if reward_functions is None else reward_functions)
    unknown = sorted(set(cfg.rewards) - set(registry))
    if unknown:
        raise ValueError(f"unknown reward function(s) {unknown}; known: {sorted(registry)}")
    # the registry's own rewards read columns the rows must have (one the caller brings reads what it likes)
    own = [name for name in cfg.rewards if registry[name] is REWARD_FUNCTIONS.get(name)]
    check_reward_columns(own, prompts.columns, f"the {who} prompts")
    if registry.get("code") is code_reward and "code" in cfg.rewards:
        settings = cfg.grading.code.model_dump()
        check_sandbox(code_limits(settings))  # refuses here, before any sampling, where it cannot sandbox
        registry["code"] = make_code_reward(settings)
    # the rule's negatives to a judge (grpo.training.appeal)
    if cfg.grading.appeal is not None and "accuracy" in cfg.rewards:
        from grpo.sampling.judge import HTTPJudge, build_judge
        from grpo.training.appeal import appealed

        judge = build_judge(cfg.grading.appeal)
        if isinstance(judge, HTTPJudge):
            judge.check_available()  # an endpoint that is not there fails now, not at the first negative
        registry["accuracy"] = appealed(registry["accuracy"], judge)
    return registry


# -- the models --------------------------------------------------------------------------------------------------

def trainable(model: torch.nn.Module, cfg: GRPOConfig, device: torch.device, lr: float, *,
              lora: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model on `device` in the config's weights dtype, with its optimizer (and LoRA adapters, if asked).

    The optimizer is built before the cast to bf16, so fp32 master weights start from the weights' full precision.
    """
    model = model.to(device)
    if lora:  # only the adapters train; the reference is the base with them off
        model = add_lora(model, cfg.lora)
    if cfg.memory.weights_dtype == "float32":  # a model loaded in another dtype trains in fp32 all the same
        cast_parameters(model, torch.float32)
    optimizer = make_optimizer(model, lr, cfg.optimizer.weight_decay, eight_bit=cfg.optimizer.name == "adamw_8bit",
                               master_weights=cfg.memory.weights_dtype == "bfloat16")
    if cfg.memory.weights_dtype == "bfloat16":
        cast_parameters(model, torch.bfloat16)
    return model, optimizer


def prepared(strategy, model: torch.nn.Module, optimizer, cfg: GRPOConfig):
    """(model, optimizer, scheduler) in the strategy's distributed form, the schedule over every optimizer step."""
    scheduler = make_scheduler(cfg.optimizer.lr_scheduler, optimizer, num_warmup_steps=cfg.optimizer.warmup_steps,
                               num_training_steps=cfg.max_steps * cfg.num_iterations)
    return strategy.prepare(model, optimizer, scheduler)


def frozen_reference(model: torch.nn.Module, cfg: GRPOConfig, acc) -> torch.nn.Module | None:
    """A frozen copy of the starting policy, for the KL term; None with beta = 0 (never needed) or with LoRA (the
    policy with its adapters off is the reference).

    It stays whole under fsdp too: forward only, no gradients or optimizer state (2 bytes a parameter in bf16 on a
    GPU), and a whole model's forward needs no collective, so each process scores its own rows at its own pace.
    """
    if cfg.loss.beta == 0 or cfg.lora is not None:
        return None
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    if reference_dtype(cfg, acc) == torch.bfloat16:
        cast_parameters(reference, torch.bfloat16)
    return reference


def reference_dtype(cfg: GRPOConfig, acc) -> torch.dtype | None:
    """The frozen reference's dtype, when it differs from the policy's: bf16 on a GPU whose loop runs in bf16 under
    `auto` (it only ever runs forward, under the same autocast), or what the config names."""
    if cfg.memory.reference_dtype == "bfloat16" or (cfg.memory.reference_dtype == "auto" and acc.device.type == "cuda"
                                              and acc.mixed_precision == "bf16"):
        return torch.bfloat16
    return None


def checkpointing_on(cfg: GRPOConfig, acc) -> bool:
    """Activation checkpointing as configured; `auto` is on a GPU (memory is what it lacks) and off on a CPU (which
    has RAM to spare and no time for the extra forward)."""
    asked = cfg.memory.gradient_checkpointing
    return acc.device.type == "cuda" if asked == "auto" else asked


def gemm_plan(acc, cfg: GRPOConfig, tokenizer, prompts: pd.DataFrame, model: torch.nn.Module, output_dir: Path):
    """fp32 on a CPU: the faster GEMM library of each of a linear's GEMMs, measured at a micro-batch's tokens."""
    rendered = render_prompts(tokenizer, prompts["prompt"][:16].tolist())
    prompt_tokens = max(len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in rendered)
    tokens = cfg.memory.micro_batch_size * (prompt_tokens + cfg.sampling.max_new_tokens)  # a micro-batch's rows
    return shared_gemm_plan(acc, cfg.memory.fp32_gemm, model, tokens, output_dir)


# -- a step's rollout --------------------------------------------------------------------------------------------

def sample_rollout(engine: Engine, prompts: Sequence, n: int, sampling: SamplingConfig, *, logprobs: bool,
                   who: str) -> Rollout:
    """`n` completions of each prompt from the engine, with their token ids (`who` names the loop that needs them)."""
    return require_tokens(engine.generate(list(prompts), n, sampling, logprobs=logprobs), who)


def row_columns(columns: Mapping[str, list], cells: list, idx: list[int], n: int) -> dict[str, list]:
    """The dataset columns (`columns`, each a list; `cells` the prompts) of the prompts `idx`, one row a completion
    (`n` rows a prompt)."""
    rows = {k: [v[i] for i in idx for _ in range(n)] for k, v in columns.items()}
    # TRL's name for the prompts: a reward model reads the question, not only the answer
    rows["prompts"] = [cells[i] for i in idx for _ in range(n)]
    return rows


def score_rollout(rollout: Rollout, columns: dict[str, list], cfg: GRPOConfig, registry: Mapping[str, Callable],
                  rewards: Mapping[str, float] | None = None):
    """The rollout's rewards (`grpo.rewards.score_completions`; `rewards` by name and weight, else the config's),
    with each completion's length and the limit."""
    lengths = rollout.completion_mask.sum(-1).tolist()
    return score_completions(rollout.texts, cfg.rewards if rewards is None else rewards,
                             {**columns, "completion_lengths": lengths,
                              "max_completion_length": [cfg.sampling.max_new_tokens] * len(lengths)},
                             registry=registry)


def scored_logps(acc, model, input_ids: torch.Tensor, attention_mask: torch.Tensor, C: int, micro_batch_size: int,
                 temperature: float, *, packed: bool = False, max_tokens: int | None = None) -> torch.Tensor:
    """Log-probs [N, C] of the completions under `model`, without gradients, in micro-batches (`micro_batch_rows`;
    `packed`: each one row without padding). As many passes on every process (`matched_chunks`): a sharded model's
    forward is a collective. `acc` None: a process of its own (a sampler worker), under the caller's autocast."""
    parts = []
    rows = micro_batch_rows(attention_mask, micro_batch_size, max_tokens)
    with torch.no_grad(), (acc.autocast() if acc is not None else nullcontext()):  # None: alone, autocast outside
        for s, counts in (matched_chunks(acc, rows) if acc is not None else [(r, True) for r in rows]):
            logps = token_logps(model, input_ids[s], attention_mask[s], C, temperature, packed=packed)[0]
            if counts:
                parts.append(logps)
    return torch.cat(parts)  # [N, C] the micro-batches are runs of rows in order


def check_token_budget(cfg: GRPOConfig, tokenizer, prompts: pd.DataFrame, who: str) -> None:
    """A token budget must hold the longest row a step can make (its prompt and a whole completion): else an error
    naming the prompt, before any sampling."""
    budget = cfg.memory.max_tokens_per_microbatch
    if budget is None:
        return
    rendered = render_prompts(tokenizer, prompts["prompt"].tolist())
    lengths = [len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in rendered]
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    if lengths[longest] + cfg.sampling.max_new_tokens > budget:
        raise ValueError(f"{who}: max_tokens_per_microbatch={budget} cannot hold prompt row {longest} "
                         f"({lengths[longest]} tokens) with a whole completion (sampling.max_new_tokens="
                         f"{cfg.sampling.max_new_tokens}); raise it to at least "
                         f"{lengths[longest] + cfg.sampling.max_new_tokens}")


def grading_watch(cfg: GRPOConfig, stage: str) -> GradingWatch:
    """The run's grading watch (`grpo.training.grading`): a stop when graders keep failing, a line when the groups
    stop carrying signal."""
    grading = cfg.grading
    return GradingWatch(grading.max_ungraded_share, grading.ungraded_window, grading.no_signal_steps,
                        grading.stop_without_signal,
                        stage=stage)


def observe_grading(acc, watch: GradingWatch, step: int, scores, groups: int, spread: int,
                    save: Callable[[], None], unseen: StepGrading | None = None) -> None:
    """Hand the step's grading to the watch before the step trains: this process's rows (`scores`: their graded
    flags and ungraded reasons), `groups` and how many of them carry a gradient (`spread`), and the rows the step
    sampled but does not train on (`unseen`: dynamic sampling's dropped groups), summed over every process so each
    reaches the same verdict. When it stops the run, `save` runs first (on every process: a save is a collective)
    and the stop is raised."""
    graded = scores.graded_rows
    mine = StepGrading(len(graded), len(graded) - sum(graded), Counter(scores.ungraded_counts()), groups, spread)
    if unseen is not None:
        mine = mine.plus(unseen)
    every = mine
    if acc.num_processes > 1:
        every = functools.reduce(StepGrading.plus, [StepGrading(*g) for g in gather_object([tuple(mine)])])
    try:
        watch.observe(step, every)
    except GradingStop:
        save()
        raise


# -- what a step reports -----------------------------------------------------------------------------------------

def rollout_metrics(rollout: Rollout, scores, elapsed: float, t_gen: float, t_ref: float,
                    learning_rate: float) -> dict[str, float]:
    """A step's reward, length and time figures (the loop adds its own: group spread, the optimizer's stats)."""
    graded = getattr(scores, "graded_rows", None) or [True] * len(scores.total)
    # the reward of the rows that have one: an ungraded row's total is only what its other functions gave
    total = torch.tensor([t for t, g in zip(scores.total, graded) if g] or [math.nan])  # [graded rows]
    lengths = rollout.completion_mask.sum(-1).float()  # [N]
    m = {f"reward/{name}": _mean_scored(vals) for name, vals in scores.per_function.items()}
    m.update({f"reward_failures/{name}": float(n) for name, n in scores.failures.items()})
    # a reward that does not apply to some rows (accuracy without a reference, say): how many it sat out
    m.update({f"reward_skipped/{name}": float(n) for name, n in scores.skipped.items() if n})
    # rows a grader could not grade (grpo.rewards.outcomes): their share, and how many each function left, why
    m["reward/ungraded_share"] = 1 - sum(graded) / max(len(graded), 1)
    if hasattr(scores, "ungraded_counts"):
        m.update({f"reward_ungraded/{name}/{reason}": float(n)
                  for (name, reason), n in scores.ungraded_counts().items()})
    m.update({f"reward_figures/{key}": value for key, value in getattr(scores, "figures", {}).items()})
    m.update({
        "reward/total": total.mean().item(),
        "completion_length": lengths.mean().item(),
        "completion_truncated": rollout.truncated.float().mean().item(),
        "tokens_per_s": lengths.sum().item() / elapsed,
        "time/step_s": elapsed,
        "time/generation_s": t_gen,  # sampling and scoring
        "time/reference_s": t_ref,  # reference (and pi_old) log-probs
        "time/optimise_s": elapsed - t_gen - t_ref,  # policy forward, backward and optimizer step(s)
        "learning_rate": learning_rate,
    })
    return m


def samples_table(cells: list, rollout: Rollout, idx: list[int], scores, n: int) -> pd.DataFrame:
    """The step's completions with their prompts (`cells`, indexed by `idx`) and rewards (`n` completions a prompt)."""
    rows = {"prompt": [str(cells[idx[i // n]]) for i in range(len(rollout.texts))],
            "completion": rollout.texts, "reward": scores.total}
    for name, vals in scores.per_function.items():
        rows[f"reward/{name}"] = vals
    reasons = scores.reasons() if hasattr(scores, "reasons") else []
    if any(reasons):  # why a row has no reward: its total is not one
        rows["ungraded"] = reasons
        rows["reward"] = [None if why else t for t, why in zip(scores.total, reasons)]
    return pd.DataFrame(rows)


def report_step(acc, cfg: GRPOConfig, done: int, metrics: dict[str, float], table: Callable[[], pd.DataFrame],
                on_metrics: MetricsCallback | None, on_samples: SamplesCallback | None) -> None:
    """Hand a finished step's figures (every `log_every` steps and the last) and its samples table (the first and
    every `samples_every`) to the callbacks, from the main process. Call on every process: the others join the
    reductions (`table` makes this process's rows; they are gathered from every process)."""
    main = acc.is_main_process  # the one that reports; the others join the reductions
    if done % cfg.log_every == 0 or done == cfg.max_steps:
        metrics = reduce_metrics(acc, metrics)  # the global batch's figures
        if on_metrics and main:
            on_metrics(done, metrics)
    wants_samples = on_samples is not None or acc.num_processes > 1  # the same on every process
    if wants_samples and cfg.samples_every and (done % cfg.samples_every == 0 or done == 1):
        rows = gather_table(acc, table())
        if on_samples and main:
            on_samples(done, rows)


def save_policy(acc, strategy, model, master_weights, tokenizer, output_dir: Path,
                also: Callable[[], None] | None = None) -> Path:
    """The trained policy's whole weights and tokenizer in `output_dir/model` (with LoRA: merged, the adapter alone
    beside them), `also` run on the main process, and the resume checkpoints removed. Call on every process."""
    model_dir = output_dir / "model"
    if master_weights is not None:  # bf16 weights: save the fp32 masters the optimizer stepped
        master_weights.export_weights()
    whole = strategy.whole_model(model)  # the whole weights, on the main process
    with main_only(acc) as main:
        if main:
            save_merged(whole, model_dir, output_dir / "adapter")
            tokenizer.save_pretrained(model_dir)
            if also is not None:
                also()
            shutil.rmtree(output_dir / "checkpoints", ignore_errors=True)
    return model_dir


def _mean_scored(values: list[float | None]) -> float:
    scored = [v for v in values if v is not None]
    return sum(scored) / len(scored) if scored else math.nan
