"""PPO with a critic for the reasoning stage: the baseline GRPO was made to replace, run on the same footing.

One step, as InstructGPT's third step (and TRL's PPOTrainer, OpenRLHF) run it:
  1. sample one completion for each of prompts_per_step x num_generations prompts: as many completions a step as
     GRPO samples, each of its own prompt (a critic, not a group, is the baseline);
  2. score them with the same reward functions as GRPO;
  3. per-token rewards: the score at the last token, and (kl_in "reward", the default) -beta x (logp - ref) on
     every token, so the critic learns the KL-shaped return as InstructGPT's does;
  4. values of every completion token from the critic, a separate model initialised from the policy's checkpoint;
     GAE (gamma, lambda) gives advantages and returns; advantages are whitened over the batch's tokens;
  5. `num_iterations` passes of the clipped policy loss plus vf_coef x the clipped value loss, each one optimizer
     step of the policy and one of the critic.
Sampling, scoring, the loop, metrics, checkpoints and the saved model are GRPOTrainer's: this class inherits them
and replaces what PPO does differently (collect, build_batch, optimise), so the two are measured on the same code.
The critic is not saved with the model (the next stage needs the policy only); it is in the resumable checkpoints.

Across processes (`distributed`, ddp or fsdp) the critic is held as the policy is: the strategy prepares it after the
policy, with its own optimizer, and its checkpoints hold both. Each process samples its share of the step's
prompts; GAE is per row, so only the whitening of the advantages is made global (the batch's token mean and
variance summed over the processes), and the loss is weighted as GRPO's is (`process_weight`), so two processes
train as one does at the same global batch.

Must not depend on Prefect or MLflow: metrics go to callbacks.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pandas as pd
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo.config import GRPOConfig
from grpo.kernels.attention import cpu_attention
from grpo.kernels.gemm import fp32_gemm
from grpo.kernels.mlp import compact_mlp
from grpo.models import activation_checkpointing
from grpo.ppo_config import PPOConfig, check_ppo_settings
from grpo.sampling.engines import Rollout
from grpo.training.optimizers import cast_parameters, make_optimizer, optimizer_step
from grpo.training.distributed import matched_chunks, process_share, process_weight
from grpo.training.batches import prompt_order
from grpo.training.grpo_trainer import GRPOTrainer, checkpointing_on
from grpo.training.logprobs import token_logps
from grpo.training.loss import batch_share, k3_kl
from grpo.training.ppo import explained_variance, gae_advantages, masked_mean, masked_whiten, ppo_loss, token_rewards
from grpo.training.schedules import make_scheduler
from grpo.training.value import ValueModel


class PPOBatch(NamedTuple):
    """One step's scored samples, ready for PPO's loss (N = prompts_per_step x num_generations rows, one a prompt)."""

    input_ids: torch.Tensor  # [N, P+C] prompt (left-padded) then completion (right-padded)
    attention_mask: torch.Tensor  # [N, P+C]
    completion_mask: torch.Tensor  # [N, C] float: the tokens the loss counts (none of a masked truncated row)
    old_logps: torch.Tensor | None  # [N, C] pi_old log-probs; None when mu = 1 (the ratio is exactly 1)
    ref_logps: torch.Tensor | None  # [N, C] reference log-probs, only when the KL is a loss term
    advantages: torch.Tensor  # [N, C] GAE, whitened over the batch's tokens
    returns: torch.Tensor  # [N, C] GAE advantages + the rollout's values: the critic's targets
    old_values: torch.Tensor  # [N, C] the critic's values at rollout time
    stats: dict[str, float]  # rollout figures (kl, value/explained_variance, ...), logged with the step's


class PPOTrainer(GRPOTrainer):
    """GRPOTrainer's policy, reference, sampling and loop, with a critic and its own optimizer beside them."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: pd.DataFrame,
                 cfg: GRPOConfig, output_dir: str | Path, *, ppo: PPOConfig | None = None, **kwargs):
        self.ppo = ppo or PPOConfig()
        check_ppo_settings(cfg, len(prompts), "the data")
        # copied before the policy is moved or cast: the critic starts from the checkpoint's full-precision weights
        critic = ValueModel.from_policy(model, cfg.seed)
        super().__init__(model, tokenizer, prompts, cfg, output_dir, **kwargs)
        self.completions_per_prompt = 1
        critic = critic.to(self.acc.device)
        if cfg.weights_dtype == "float32":
            cast_parameters(critic, torch.float32)
        optimizer = make_optimizer(critic, self.ppo.value_learning_rate or cfg.learning_rate, cfg.weight_decay,
                                   eight_bit=cfg.optimizer == "adamw_8bit",
                                   master_weights=cfg.weights_dtype == "bfloat16")
        if cfg.weights_dtype == "bfloat16":
            cast_parameters(critic, torch.bfloat16)
        scheduler = make_scheduler(cfg.lr_scheduler, optimizer, num_warmup_steps=cfg.warmup_steps,
                                   num_training_steps=cfg.max_steps * cfg.num_iterations)
        # prepared after the policy, as the policy is (DDP or sharded): the checkpoints hold both, in this order
        self.critic, self.critic_optimizer, self.critic_scheduler = self.strategy.prepare(critic, optimizer, scheduler)

    # -- one step ----------------------------------------------------------------------------------------------

    def collect(self, step: int) -> tuple[Rollout, list[int], object, dict[str, float]]:
        """Sample and score one completion for each of the step's prompts_per_step x num_generations prompts (this
        process's share of them)."""
        cfg = self.cfg
        idx = process_share(self.acc, prompt_order(len(self.prompts), step, cfg.prompts_per_step * cfg.num_generations,
                                                   cfg.seed))
        rollout = self.sample(idx)
        return rollout, idx, self.score(rollout, idx), {}

    def build_batch(self, rollout: Rollout, rewards: list[float], steps=None) -> PPOBatch:
        # `steps` (process supervision's step rewards) is never given: the recipe refuses `supervision: process`
        # with ppo, whose reward is the outcome at each completion's last token
        cfg, ppo = self.cfg, self.ppo
        input_ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1).to(self.acc.device)  # [N, P+C]
        attention_mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1).to(self.acc.device)
        N, C = input_ids.size(0), rollout.completion_ids.size(1)
        kl_reward = cfg.beta != 0 and ppo.kl_in == "reward"

        ref_logps = old_logps = None
        if cfg.beta != 0:
            ref_logps = self._scored(self.ref_model, input_ids, attention_mask, C)  # [N, C] (no LoRA in PPO)
        # pi_old's log-probs: the KL reward's logp, and the ratio's denominator when mu > 1 (recomputed, not the
        # sampler's, as GRPO does: top-p, bf16 or another engine would bias them)
        if kl_reward or cfg.num_iterations > 1:
            old_logps = self._scored(self.model, input_ids, attention_mask, C)  # [N, C]
        parts = []
        with torch.no_grad(), self.acc.autocast():  # as many passes on every process: a sharded forward is a collective
            for s, counts in matched_chunks(self.acc, _chunks(N, cfg.micro_batch_size)):
                values = self.critic(input_ids[s], attention_mask[s], C)  # [n, C]
                if counts:
                    parts.append(values)
        old_values = torch.cat(parts)  # [N, C]
        token_mask = rollout.completion_mask.float().to(self.acc.device)  # [N, C] every sampled token
        loss_mask = token_mask
        if cfg.mask_truncated_completions:  # in the returns, but no gradient of their own
            loss_mask = token_mask * (~rollout.truncated).float().to(self.acc.device)[:, None]
        scores = torch.tensor(rewards, dtype=torch.float32, device=self.acc.device)  # [N]
        per_token = token_rewards(scores, token_mask, old_logps, ref_logps, cfg.beta if kl_reward else 0.0)  # [N, C]
        advantages, returns = gae_advantages(per_token, old_values, token_mask, ppo.gamma, ppo.lam)  # [N, C]
        total = self._total  # the figures of the global batch's tokens, on every process
        stats = {
            "value/explained_variance": explained_variance(old_values, returns, token_mask, total),
            "value/mean": masked_mean(old_values, token_mask, total).item(),
            "value/returns_mean": masked_mean(returns, token_mask, total).item(),
            "advantages/raw_std": masked_mean((advantages - masked_mean(advantages, token_mask, total)) ** 2,
                                              token_mask, total).sqrt().item(),
        }
        if kl_reward:  # the loss has no KL term: say how far pi_old is from the reference, as GRPO's `kl` does (k3)
            stats["kl"] = masked_mean(k3_kl(old_logps, ref_logps), token_mask, total).item()
            # the KL part of a completion's return, on average
            stats["reward/kl_penalty"] = -cfg.beta * ((old_logps - ref_logps) * token_mask).sum().item() / N
        return PPOBatch(input_ids, attention_mask, loss_mask, old_logps if cfg.num_iterations > 1 else None,
                        ref_logps if ppo.kl_in == "loss" else None,
                        masked_whiten(advantages, loss_mask, total=total),  # over the global batch's tokens
                        returns, old_values, stats)

    def _total(self, x: torch.Tensor) -> torch.Tensor:
        """`x` summed over the processes (itself in one process)."""
        return x if self.acc.num_processes == 1 else self.acc.reduce(x, "sum")

    def optimise(self, batch: PPOBatch) -> dict[str, float]:
        """One optimizer step of the policy and one of the critic, over the batch in micro-batches."""
        cfg, N = self.cfg, batch.input_ids.size(0)
        C = batch.completion_mask.size(1)
        sums: dict[str, float] = {}
        self.model.train()
        self.critic.train()
        # this process's loss as a share of the global batch's (1.0 in one process), as GRPO's
        weight = process_weight(self.acc, cfg.loss_type, batch.completion_mask)
        chunks = matched_chunks(self.acc, _chunks(N, cfg.micro_batch_size))
        for i, (s, counts) in enumerate(chunks):
            last = i == len(chunks) - 1  # both models' gradients sync in the last micro-batch only
            with self.strategy.no_sync(self.model, last), self.strategy.no_sync(self.critic, last):
                sums = self._micro_batch(batch, s, C, weight * float(counts), sums)
        sums["grad_norm"] = float(optimizer_step(self.acc, self.model, self.optimizer, self.scheduler,
                                                 cfg.max_grad_norm))
        self.sync_sampler()  # the next rollout samples the stepped weights
        sums["value/grad_norm"] = float(optimizer_step(self.acc, self.critic, self.critic_optimizer,
                                                       self.critic_scheduler, cfg.max_grad_norm))
        return {**sums, **batch.stats}  # with the KL in the rewards, the rollout's kl, not the loss's 0

    def _micro_batch(self, batch: PPOBatch, s: slice, C: int, weight: float,
                     sums: dict[str, float]) -> dict[str, float]:
        """One micro-batch's forward and backward through both models; its stats added to `sums`, weighted by
        their share of the global batch."""
        cfg, ppo = self.cfg, self.ppo
        with self.acc.autocast():
            logps, entropy = token_logps(self.model, batch.input_ids[s], batch.attention_mask[s], C,
                                         cfg.sampling.temperature, with_entropy=True)
            values = self.critic(batch.input_ids[s], batch.attention_mask[s], C)  # [n, C]
        mask = batch.completion_mask[s]
        loss, stats = ppo_loss(
            logps, None if batch.old_logps is None else batch.old_logps[s],
            None if batch.ref_logps is None else batch.ref_logps[s], batch.advantages[s], values,
            batch.old_values[s], batch.returns[s], mask, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high,
            cliprange_value=ppo.cliprange_value, vf_coef=ppo.vf_coef,
            beta=cfg.beta if ppo.kl_in == "loss" else 0.0, loss_type=cfg.loss_type)
        share = batch_share(cfg.loss_type, mask, batch.completion_mask) * weight
        self.acc.backward(loss * share)  # one backward through both models' graphs
        stats["train/loss"] = loss.item()
        stats["entropy"] = float((entropy * mask).sum() / mask.sum().clamp(min=1))
        for k, v in stats.items():
            sums[k] = sums.get(k, 0.0) + v * share
        return sums

    # -- the loop: GRPOTrainer's, with the critic on the same fast paths as the policy ---------------------------

    def _loop(self, start: int, bar, ckpt_root: Path) -> None:
        trunk = self.acc.unwrap_model(self.critic).trunk
        with (cpu_attention(trunk), compact_mlp(trunk), fp32_gemm(self.acc.unwrap_model(self.critic), self.gemm),
              activation_checkpointing(trunk, checkpointing_on(self.cfg, self.acc))):
            super()._loop(start, bar, ckpt_root)

    def _step_metrics(self, rollout: Rollout, scores, opt: dict[str, float], elapsed: float, t_gen: float,
                      t_ref: float) -> dict[str, float]:
        m = super()._step_metrics(rollout, scores, opt, elapsed, t_gen, t_ref)
        del m["reward/zero_std_groups"]  # no groups here: each prompt has one completion
        total = torch.tensor(scores.total, device=self.acc.device)  # [N]
        if self.acc.num_processes > 1:  # every process's rows (each calls this once a step)
            total = self.acc.gather(total)
        m["reward/std"] = total.std().item() if total.numel() > 1 else 0.0  # over the global batch
        return m


def _chunks(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]
