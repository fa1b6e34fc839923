"""The reward model of the alignment stage (R1 stage 5): a scalar score of how helpful and harmless a response is.

R1 scores its general (non-reasoning) prompts with reward models trained on human preference pairs; this module
trains one and hands it to GRPO as an ordinary reward function. The model is a causal LM backbone with a one-output
linear head (`AutoModelForSequenceClassification`, num_labels=1) that reads the hidden state of the last token of
prompt + response. It is trained with the Bradley-Terry loss `-log sigmoid(r_chosen - r_rejected)`, which makes
`sigmoid(r_a - r_b)` the modelled probability that a person prefers response a to b (InstructGPT, Ouyang et al.
2022, eq. 1). Only differences of scores mean anything; GRPO's group normalisation discards the offset anyway.

How this differs from the paper: R1 scores helpfulness on the final summary only and harmlessness on the whole
response, with two models; here one model reads the whole response (`<think>` included), which is what the
synthetic pairs in grpo.data.preferences teach. The loop has no resumable checkpoints: it is short next to SFT and GRPO.

A micro-batch's 2B sequences go through the model as one row without padding where `packing` allows
(grpo.training.reward_scorer.sequence_scores: each scored at its own last token), the padded batch's scores to
float rounding.

Run it alone:
    from grpo.configs.reward import RewardModelConfig
    from grpo.data.preferences import preference_pairs
    from grpo.training.loops.reward_model import train_reward_model
    result = train_reward_model(preference_pairs(1000), RewardModelConfig(), "out/rm",
                                heldout=preference_pairs(200, split="heldout"))

Must not depend on Prefect or MLflow: metrics go to a callback.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import Callable, NamedTuple

import pandas as pd
import torch
from tqdm.auto import tqdm

from grpo.configs.distributed import DistributedConfig
from grpo.configs.reward import RewardModelConfig
from grpo.data.preferences import split_by_prompt
from grpo.data.tables import DataError
from grpo.kernels.attention import attending_packed
from grpo.models import activation_checkpointing
from grpo.training.accelerator import make_accelerator
from grpo.training.batches import batch_indices
from grpo.training.distributed import check_split, main_only, process_share, reduce_metrics
from grpo.training.optimizers import make_adamw, optimizer_step
from grpo.training.reward_scorer import (RewardModelScorer, bradley_terry_loss, build_reward_model, encode_pairs,
                                         evaluate_pairs, pair_metrics, packs, sequence_scores)
from grpo.training.schedules import make_scheduler
from grpo.training.strategy import make_strategy

MetricsCallback = Callable[[int, dict[str, float]], None]


class RewardModelResult(NamedTuple):
    model_dir: Path  # the trained reward model and its tokenizer, loadable with from_pretrained
    steps: int  # optimizer steps taken
    final_loss: float  # mean Bradley-Terry loss over the last logging window
    heldout_accuracy: float  # share of held-out pairs scored chosen > rejected after training (nan: no held-out)
    heldout_accuracy_before: float  # the same before training: the untrained model's baseline
    heldout_metrics: dict[str, float]  # rm/heldout_accuracy, rm/heldout_margin and, with a `flaw` column, per flaw
    seconds: float  # wall time of the training loop


def train_reward_model(
    pairs: pd.DataFrame,
    cfg: RewardModelConfig,
    output_dir: str | Path,
    on_metrics: MetricsCallback | None = None,
    *,
    heldout: pd.DataFrame | None = None,
    source: str = "pairs",
    progress: bool = True,
    distributed: DistributedConfig | None = None,
) -> RewardModelResult:
    """Train a reward model on `pairs` (prompt, chosen, rejected) and save it with its tokenizer to `output_dir/model`.

    Held-out pairs are `heldout` when given, else `cfg.eval_fraction` of the prompts carved out of `pairs`.
    """
    model, tok = build_reward_model(cfg.model, cfg.seed)
    if heldout is None and cfg.eval_fraction > 0:
        pairs, heldout = split_by_prompt(pairs, cfg.eval_fraction)
    if len(pairs) == 0:
        raise DataError(f"{source}: no training pairs left after holding out eval_fraction={cfg.eval_fraction}")
    examples = encode_pairs(pairs, tok, cfg.max_seq_len, source)  # fails before any training
    if heldout is not None and len(heldout) == 0:
        heldout = None
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    acc = make_accelerator(cfg.mixed_precision, cfg.grad_accum_steps)
    strategy = make_strategy(acc, distributed)  # how the processes hold the model (ddp or fsdp)
    check_split("batch_size", cfg.batch_size, acc.num_processes)  # pairs per global micro-batch
    model.config.use_cache = False  # one forward per batch: a KV cache would only cost memory
    checkpointing = activation_checkpointing(model, cfg.gradient_checkpointing)  # on for the training loop only
    optimizer = make_adamw(model, cfg.learning_rate, cfg.weight_decay)
    scheduler = make_scheduler(cfg.lr_scheduler, optimizer, num_warmup_steps=cfg.warmup_steps,
                               num_training_steps=cfg.max_steps)
    model, optimizer, scheduler = strategy.prepare(model, optimizer, scheduler)
    unwrapped = acc.unwrap_model(model)
    # each micro-batch's sequences as one row without padding, where the model's attention takes it exactly
    packed = packs(cfg.packing, unwrapped)

    def evaluate() -> dict[str, float]:
        if heldout is None:
            return {"rm/heldout_accuracy": math.nan, "rm/heldout_margin": math.nan}
        # every process scores all the held-out pairs, in the same batches: under fsdp each forward is a
        # collective; under ddp the others would only wait for the main one
        model.eval()  # the mode a scorer loaded from the saved folder runs in: the same figures
        with acc.autocast():
            metrics = evaluate_pairs(RewardModelScorer(unwrapped, tok, cfg.eval_batch_size, packing=packed), heldout)
        model.train()
        return metrics

    before = evaluate()["rm/heldout_accuracy"]
    # packed rows attend sequence by sequence, held for the run (a recomputed layer finds it too)
    with checkpointing, attending_packed(unwrapped, packed):
        model.train()
        window: dict[str, list[float]] = {"rm/loss": [], "rm/accuracy": [], "rm/margin": []}
        last_loss = math.nan
        start_time = time.perf_counter()
        bar = tqdm(total=cfg.max_steps, desc="reward model", disable=not progress or not acc.is_main_process,
                   mininterval=2.0)
        for step in range(cfg.max_steps):
            for micro in range(cfg.grad_accum_steps):
                idx = batch_indices(len(examples), cfg.batch_size, step * cfg.grad_accum_steps + micro, cfg.seed)
                batch = [examples[i] for i in process_share(acc, idx)]  # pairs are equal shares: DDP's mean is exact
                B = len(batch)
                # chosen and rejected in one forward: rows [0, B) are chosen, [B, 2B) their rejected partners
                seqs = [e.chosen_ids for e in batch] + [e.rejected_ids for e in batch]
                with strategy.accumulate(model):
                    rewards = sequence_scores(model, seqs, tok.pad_token_id, acc.device,
                                              packed_for=unwrapped if packed else None)  # [2B]
                    loss = bradley_terry_loss(rewards[:B], rewards[B:])
                    acc.backward(loss)
                    grad_norm = optimizer_step(acc, model, optimizer, scheduler, cfg.max_grad_norm)
                m = pair_metrics(rewards[:B], rewards[B:])
                window["rm/loss"].append(loss.item())
                window["rm/accuracy"].append(m["accuracy"])
                window["rm/margin"].append(m["margin"])
            bar.update(1)
            done = step + 1
            if done % cfg.log_every == 0 or done == cfg.max_steps:
                means = reduce_metrics(acc, {k: sum(v) / len(v) for k, v in window.items()})  # over processes
                for v in window.values():
                    v.clear()
                last_loss = means["rm/loss"]
                bar.set_postfix(loss=f"{last_loss:.3f}", acc=f"{means['rm/accuracy']:.2f}")
                if on_metrics and acc.is_main_process:
                    on_metrics(done, {**means, "rm/learning_rate": scheduler.get_last_lr()[0],
                                      "rm/grad_norm": float(grad_norm) if grad_norm is not None else math.nan})
        bar.close()
    seconds = time.perf_counter() - start_time

    heldout_metrics = evaluate()
    if on_metrics and heldout is not None and acc.is_main_process:
        on_metrics(cfg.max_steps, heldout_metrics)
    model_dir = Path(output_dir) / "model"
    whole = strategy.whole_model(model)  # the whole weights, on the main process
    with main_only(acc) as main:
        if main:
            whole.config.use_cache = True
            whole.save_pretrained(model_dir)
            tok.save_pretrained(model_dir)
    return RewardModelResult(model_dir, cfg.max_steps, last_loss, heldout_metrics["rm/heldout_accuracy"], before,
                             heldout_metrics, seconds)
