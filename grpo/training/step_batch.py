"""A GRPO step's batch and its update: the scored rollout made into what the clipped objective reads (advantages,
pi_old's and the reference's log-probs, the tokens that count), then one optimizer step over it in micro-batches.

The loop (grpo.training.loops.grpo_trainer) calls both with its parts: the policy runtime (grpo.training.runtime)
and the advantage function (grpo.training.credit). Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from grpo.sampling.engines import Rollout
from grpo.training.distributed import matched_chunks, process_weight
from grpo.training.logprobs import token_logps
from grpo.training.loss import grpo_loss
from grpo.training.optimizers import optimizer_step
from grpo.training.packing import loss_parts, micro_batch_rows
from grpo.training.process import StepRewards


class Batch(NamedTuple):
    """One step's scored samples, ready for the loss (N = prompts x G sequences, grouped by prompt)."""

    input_ids: torch.Tensor  # [N, P+C] prompt (left-padded) then completion (right-padded)
    attention_mask: torch.Tensor  # [N, P+C]
    completion_mask: torch.Tensor  # [N, C] float: the tokens the loss counts (none of a masked truncated row)
    old_logps: torch.Tensor | None  # [N, C] pi_old log-probs before the first update; None when mu = 1
    ref_logps: torch.Tensor | None  # [N, C] reference log-probs, None when beta = 0
    advantages: torch.Tensor  # [N], or [N, C] one a token (process supervision)
    sampler_logps: torch.Tensor | None = None  # [N, C] the sampler's log-probs of the chosen tokens, when it gives them


def build_batch(runtime, advantage, rollout: Rollout, rewards: list[float], steps: StepRewards | None = None,
                graded: list[bool] | None = None) -> Batch:
    """The step's batch. `graded` (per row): rows whose reward could be had (`RewardScores.graded`); the others are
    left out of their group's statistics and train nothing, nor does a group with fewer than two graded rows."""
    cfg, device = runtime.cfg, runtime.acc.device
    C = rollout.completion_ids.size(1)
    # [N] or [N, C] (process supervision); trains: [N] the rows that train, None when all do
    advantages, trains = advantage.advantages(rewards, graded, steps, C)
    input_ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1).to(device)  # [N, P+C]
    attention_mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1).to(device)
    ref_logps = None
    if cfg.loss.beta != 0 and rollout.ref_logprobs is not None:  # scored by the worker that sampled it
        ref_logps = rollout.ref_logprobs.to(device)
    elif cfg.loss.beta != 0:
        if cfg.rollout.reference == "sampler":
            raise RuntimeError("rollout.reference sampler: a step's groups came without their reference log-probs")
        ref_logps = runtime.reference_logps(input_ids, attention_mask, C)  # [N, C]
    old_logps = None  # mu = 1: pi_old is the policy being optimised, so the ratio is exactly 1
    if cfg.num_iterations > 1:
        # Recomputed rather than taken from the sampler: sampling may use top-p/top-k, bf16 or another engine
        # (vLLM), whose log-probs differ from this forward pass and would bias the ratio.
        old_logps = runtime.scored(runtime.model, input_ids, attention_mask, C)  # [N, C]
    completion_mask = rollout.completion_mask.float()  # [N, C]
    if cfg.loss.mask_truncated_completions:  # still in the group statistics above, but no gradient of their own
        completion_mask = completion_mask * (~rollout.truncated).float()[:, None]
    if trains is not None:  # ungraded rows, and groups with fewer than two graded: no loss, no KL
        completion_mask = completion_mask * trains.float()[:, None]
        advantages = advantages * (trains.float() if advantages.dim() == 1 else trains.float()[:, None])
    sampler_logps = getattr(rollout, "logprobs", None)  # for truncated importance sampling and its metrics
    if sampler_logps is not None:
        sampler_logps = sampler_logps.to(device)  # [N, C]
    return Batch(input_ids, attention_mask, completion_mask.to(device), old_logps, ref_logps, advantages.to(device),
                 sampler_logps)


def clipped_update(runtime, batch: Batch, tis_cap: float | None) -> dict[str, float]:
    """One optimizer step of the clipped objective over the batch, in micro-batches; the step's figures (each a
    share-weighted mean over the micro-batches, a maximum a maximum) and the gradient norm."""
    cfg, acc, model, C = runtime.cfg, runtime.acc, runtime.model, batch.completion_mask.size(1)
    sums: dict[str, float] = {}
    model.train()
    # this process's loss as a share of the global batch's (1.0 in one process); DDP averages the gradients
    weight = process_weight(acc, cfg.loss.loss_type, batch.completion_mask)
    chunks = matched_chunks(acc, micro_batch_rows(batch.attention_mask, cfg.memory.micro_batch_size,
                                                  cfg.memory.max_tokens_per_microbatch))
    for i, (rows, counts) in enumerate(chunks):
        with runtime.strategy.no_sync(model, last=i == len(chunks) - 1):
            with acc.autocast():
                logps, entropy = token_logps(model, batch.input_ids[rows], batch.attention_mask[rows], C,
                                             cfg.sampling.temperature, with_entropy=True, packed=runtime.packed)
            total = 0.0
            # each part weighted in the step's loss as its rows are in the row-count micro-batches
            parts = loss_parts(cfg.loss.loss_type, batch.completion_mask, rows, cfg.memory.micro_batch_size,
                               weight * float(counts))
            terms = cfg.loss  # the loss settings
            for local, share in parts:
                part = rows if local is None else [rows[j] for j in local]  # the batch's rows of this part
                lp, ent = (logps, entropy) if local is None else (logps[local], entropy[local])  # [b, C]
                loss, stats = grpo_loss(lp, None if batch.old_logps is None else batch.old_logps[part],
                                        None if batch.ref_logps is None else batch.ref_logps[part],
                                        batch.advantages[part], batch.completion_mask[part], epsilon=terms.epsilon,
                                        epsilon_high=terms.epsilon_high, beta=terms.beta, loss_type=terms.loss_type,
                                        importance_sampling_level=terms.importance_sampling_level,
                                        sampler_logps=None if batch.sampler_logps is None
                                        else batch.sampler_logps[part], tis_cap=tis_cap)
                total = total + loss * share
                mask = batch.completion_mask[part]
                stats["train/loss"] = loss.item()
                stats["entropy"] = float((ent * mask).sum() / mask.sum().clamp(min=1))
                for k, v in stats.items():  # a share-weighted mean over micro-batches; a maximum stays one
                    sums[k] = max(sums.get(k, v), v) if k.endswith("_max") else sums.get(k, 0.0) + v * share
            acc.backward(total)
    sums["grad_norm"] = float(optimizer_step(acc, model, runtime.optimizer, runtime.scheduler,
                                             cfg.optimizer.max_grad_norm))
    return sums
