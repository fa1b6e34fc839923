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
Sampling, scoring, the policy and its reference, the step's figures, checkpoints and the saved model are built from
the same parts as GRPO's loop (grpo.training.policy), so the two are measured on the same code; the step loop is
PPO's own, written out here. Packed rows (`memory.packing`, `memory.max_tokens_per_microbatch`) are
GRPO's: the policy, pi_old, reference and critic passes each run a micro-batch as one row without padding, and a
budgeted micro-batch's loss is read in the row-count parts its rows come from. The critic is not saved with the
model (the next stage needs the policy only); it is in the resumable checkpoints.

Across processes (`distributed`, ddp or fsdp) the critic is held as the policy is: the strategy prepares it after the
policy, with its own optimizer, and its checkpoints hold both. Each process samples its share of the step's
prompts; GAE is per row, so only the whitening of the advantages is made global (the batch's token mean and
variance summed over the processes), and the loss is weighted as GRPO's is (`process_weight`), so two processes
train as one does at the same global batch.

Must not depend on Prefect or MLflow: metrics go to callbacks.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Mapping, NamedTuple

import pandas as pd
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo.configs.distributed import DistributedConfig
from grpo.configs.ppo import PPOConfig, PPOTrainingConfig, check_ppo_settings
from grpo.configs.sampling import GenerationConfig
from grpo.configs.training import GRPOConfig
from grpo.kernels.attention import attending_packed, cpu_attention
from grpo.kernels.gemm import fp32_gemm
from grpo.kernels.mlp import compact_mlp
from grpo.models import activation_checkpointing
from grpo.sampling.engines import Engine, Rollout, build_engine, sampling_dtype
from grpo.training.batches import prompt_order
from grpo.training.checkpoints import load_newest_checkpoint
from grpo.training.distributed import matched_chunks, process_weight, sampling_seed
from grpo.training.logprobs import token_logps
from grpo.training.loss import k3_kl
from grpo.training.optimizers import optimizer_step
from grpo.training.packing import loss_parts, micro_batch_rows
from grpo.training.policy import (MetricsCallback, SamplesCallback, prepared, report_step, rollout_metrics,
                                  samples_table, trainable)
from grpo.training.ppo import explained_variance, gae_advantages, masked_mean, masked_whiten, ppo_loss, token_rewards
from grpo.training.runtime import OnRuntime, PolicyRuntime
from grpo.training.sources import EngineSource
from grpo.training.value import ValueModel

SYNC_CHECK_ROWS = 2  # rows a step on which the sampler's gathered copy is compared with the sharded policy


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


class PPOResult(NamedTuple):
    model_dir: Path  # final policy, loadable with from_pretrained
    steps: int  # optimizer steps taken in total


class PPOTrainer(OnRuntime):
    """Holds the policy, the reference, the critic, their optimizers and the data; `train()` runs the loop.

    `cfg` is PPO's own config (`PPOTrainingConfig`), or a stage's `GRPOConfig` with its `ppo` settings beside it,
    read into one as `PPOTrainingConfig.from_grpo` reads them."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: pd.DataFrame,
                 cfg: PPOTrainingConfig | GRPOConfig, output_dir: str | Path, *, ppo: PPOConfig | None = None,
                 engine: Engine | None = None, generation: GenerationConfig | None = None,
                 on_metrics: MetricsCallback | None = None, on_samples: SamplesCallback | None = None,
                 reward_functions: Mapping[str, Callable] | None = None, progress: bool = True,
                 distributed: DistributedConfig | None = None):
        if isinstance(cfg, GRPOConfig):  # a stage's grpo section, with its ppo section (`ppo`) beside it
            cfg = PPOTrainingConfig.from_grpo(cfg, ppo)
        elif ppo is not None:
            raise TypeError("PPOTrainer: PPO's settings are the config's own (cfg.ppo); pass ppo only beside a "
                            "GRPOConfig")
        check_ppo_settings(cfg, len(prompts), "the data")  # enough prompts for one completion each a step
        # copied before the policy is moved or cast: the critic starts from the checkpoint's full-precision weights
        critic = ValueModel.from_policy(model, cfg.seed)
        # the policy, its reference, accelerator, strategy (which holds the critic too) and grading watch, as GRPO's
        self.runtime = rt = PolicyRuntime(model, tokenizer, prompts, cfg, output_dir, who="PPO",
                                          reward_functions=reward_functions, distributed=distributed)
        self.on_metrics, self.on_samples, self.progress = on_metrics, on_samples, progress
        # one completion of each of the step's prompts_per_step x num_generations prompts, from the stage's engine on
        # the policy's whole weights, sampling in the loop's precision
        dtype = sampling_dtype(rt.acc.mixed_precision)

        def order(step: int, draw: int = 0) -> list[int]:
            return prompt_order(len(rt.prompts), step, cfg.prompts_per_step * cfg.num_generations, cfg.seed)

        self.source = EngineSource(rt, engine or build_engine(generation or GenerationConfig(),
                                                              rt.strategy.sampler_model(dtype), tokenizer,
                                                              dtype=dtype, who="PPO",
                                                              fp32_gemm=cfg.memory.fp32_gemm),
                                   order, 1, who="PPO", scheduled=False)
        # the critic with its own optimizer, prepared after the policy as the policy is (DDP or sharded): the
        # checkpoints hold both, in this order
        critic, optimizer = trainable(critic, cfg, rt.acc.device,
                                      self.ppo.value_learning_rate or cfg.optimizer.learning_rate)
        self.critic, self.critic_optimizer, self.critic_scheduler = prepared(rt.strategy, critic, optimizer, cfg)

    @property
    def ppo(self) -> PPOConfig:  # PPO's own settings, in the loop's config
        return self.cfg.ppo

    @property
    def engine(self) -> Engine:
        return self.source.engine

    @engine.setter
    def engine(self, engine: Engine) -> None:
        self.source.engine = engine

    # -- one step ----------------------------------------------------------------------------------------------

    def sample(self, idx: list[int]) -> Rollout:
        return self.source.sample(idx)

    def score(self, rollout: Rollout, idx: list[int]):
        return self.source.score(rollout, idx)

    def collect(self, step: int) -> tuple[Rollout, list[int], object, dict[str, float]]:
        """Sample and score one completion for each of the step's prompts_per_step x num_generations prompts (this
        process's share of them)."""
        return self.source.collect(step)

    def build_batch(self, rollout: Rollout, rewards: list[float], graded: list[bool] | None = None) -> PPOBatch:
        """The step's batch: per-token rewards (the outcome at the last token, the KL on each), the critic's values,
        GAE advantages whitened over the global batch's tokens, and the critic's targets. Rows not `graded` (no
        reward could be had: `grpo.rewards.outcomes`) have no loss token, for the policy or the critic, and are in no
        statistic: not the whitening's, nor the step's value, return, advantage or KL figures."""
        cfg, ppo = self.cfg, self.ppo
        input_ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1).to(self.acc.device)  # [N, P+C]
        attention_mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1).to(self.acc.device)
        N, C = input_ids.size(0), rollout.completion_ids.size(1)
        kl_reward = cfg.loss.beta != 0 and ppo.kl_in == "reward"

        ref_logps = old_logps = None
        if cfg.loss.beta != 0:
            ref_logps = self.runtime.scored(self.ref_model, input_ids, attention_mask, C)  # [N, C] (no LoRA in PPO)
        # pi_old's log-probs: the KL reward's logp, and the ratio's denominator when mu > 1 (recomputed, not the
        # sampler's, as GRPO does: top-p, bf16 or another engine would bias them)
        if kl_reward or cfg.num_iterations > 1:
            old_logps = self.runtime.scored(self.model, input_ids, attention_mask, C)  # [N, C]
        parts = []
        with torch.no_grad(), self.acc.autocast():  # as many passes on every process: a sharded forward is a collective
            for s, counts in matched_chunks(self.acc, self._micro_batches(attention_mask)):
                values = self.critic(input_ids[s], attention_mask[s], C, packed=self.packed)  # [n, C]
                if counts:
                    parts.append(values)
        old_values = torch.cat(parts)  # [N, C] the micro-batches are runs of rows in order
        token_mask = rollout.completion_mask.float().to(self.acc.device)  # [N, C] every sampled token
        loss_mask = token_mask
        if cfg.loss.mask_truncated_completions:  # in the returns, but no gradient of their own
            loss_mask = token_mask * (~rollout.truncated).float().to(self.acc.device)[:, None]
        rows = torch.ones(N, device=self.acc.device)  # [N] 1 on a graded row
        if graded is not None and not all(graded):
            rows = torch.tensor(graded, dtype=torch.float32, device=self.acc.device)
            loss_mask = loss_mask * rows[:, None]
        graded_tokens = token_mask * rows[:, None]  # [N, C] the tokens the step's figures are over
        scores = torch.tensor(rewards, dtype=torch.float32, device=self.acc.device) * rows  # [N] no reward: none
        per_token = token_rewards(scores, token_mask, old_logps, ref_logps,
                                  cfg.loss.beta if kl_reward else 0.0)  # [N, C]
        # per row: an ungraded row's GAE is its own, in no other row's and in no statistic below
        advantages, returns = gae_advantages(per_token, old_values, token_mask, ppo.gamma, ppo.lam)  # [N, C]
        total = self._total  # the figures of the global batch's tokens, on every process
        stats = {
            "value/explained_variance": explained_variance(old_values, returns, graded_tokens, total),
            "value/mean": masked_mean(old_values, graded_tokens, total).item(),
            "value/returns_mean": masked_mean(returns, graded_tokens, total).item(),
            "advantages/raw_std": masked_mean((advantages - masked_mean(advantages, graded_tokens, total)) ** 2,
                                              graded_tokens, total).sqrt().item(),
        }
        if kl_reward:  # the loss has no KL term: say how far pi_old is from the reference, as GRPO's `kl` does (k3)
            stats["kl"] = masked_mean(k3_kl(old_logps, ref_logps), graded_tokens, total).item()
            # the KL part of a (graded) completion's return, on average
            stats["reward/kl_penalty"] = (-cfg.loss.beta * ((old_logps - ref_logps) * graded_tokens).sum().item()
                                          / max(rows.sum().item(), 1.0))
        return PPOBatch(input_ids, attention_mask, loss_mask, old_logps if cfg.num_iterations > 1 else None,
                        ref_logps if ppo.kl_in == "loss" else None,
                        masked_whiten(advantages, loss_mask, total=total),  # over the global batch's tokens
                        returns, old_values, stats)

    def _micro_batches(self, attention_mask: torch.Tensor) -> list[slice] | list[list[int]]:
        """`micro_batch_size` rows each, or whole rows in order to the token budget."""
        memory = self.cfg.memory
        return micro_batch_rows(attention_mask, memory.micro_batch_size, memory.max_tokens_per_microbatch)

    def _total(self, x: torch.Tensor) -> torch.Tensor:
        """`x` summed over the processes (itself in one process)."""
        return x if self.acc.num_processes == 1 else self.acc.reduce(x, "sum")

    def optimise(self, batch: PPOBatch) -> dict[str, float]:
        """One optimizer step of the policy and one of the critic, over the batch in micro-batches."""
        cfg, C = self.cfg, batch.completion_mask.size(1)
        sums: dict[str, float] = {}
        self.model.train()
        self.critic.train()
        # this process's loss as a share of the global batch's (1.0 in one process), as GRPO's
        weight = process_weight(self.acc, cfg.loss.loss_type, batch.completion_mask)
        chunks = matched_chunks(self.acc, self._micro_batches(batch.attention_mask))
        for i, (s, counts) in enumerate(chunks):
            last = i == len(chunks) - 1  # both models' gradients sync in the last micro-batch only
            with self.strategy.no_sync(self.model, last), self.strategy.no_sync(self.critic, last):
                sums = self._micro_batch(batch, s, C, weight * float(counts), sums)
        sums["grad_norm"] = float(optimizer_step(self.acc, self.model, self.optimizer, self.scheduler,
                                                 cfg.optimizer.max_grad_norm))
        self.sync_sampler()  # the next rollout samples the stepped weights
        sums["value/grad_norm"] = float(optimizer_step(self.acc, self.critic, self.critic_optimizer,
                                                       self.critic_scheduler, cfg.optimizer.max_grad_norm))
        return {**sums, **batch.stats}  # with the KL in the rewards, the rollout's kl, not the loss's 0

    def _micro_batch(self, batch: PPOBatch, rows: slice | list[int], C: int, weight: float,
                     sums: dict[str, float]) -> dict[str, float]:
        """One micro-batch's forward and backward through both models; its stats added to `sums`, weighted by
        their share of the global batch. A micro-batch filled to a token budget is read in the row-count parts its
        rows come from (`loss_parts`), so every loss_type keeps its value."""
        cfg, ppo = self.cfg, self.ppo
        with self.acc.autocast():
            logps, entropy = token_logps(self.model, batch.input_ids[rows], batch.attention_mask[rows], C,
                                         cfg.sampling.temperature, with_entropy=True, packed=self.packed)
            values = self.critic(batch.input_ids[rows], batch.attention_mask[rows], C, packed=self.packed)  # [n, C]
        total = 0.0
        for local, share in loss_parts(cfg.loss.loss_type, batch.completion_mask, rows, cfg.memory.micro_batch_size,
                                       weight):
            part = rows if local is None else [rows[j] for j in local]  # the batch's rows of this part
            lp, ent, vals = (logps, entropy, values) if local is None else (logps[local], entropy[local],
                                                                            values[local])  # [b, C]
            mask = batch.completion_mask[part]
            loss, stats = ppo_loss(
                lp, None if batch.old_logps is None else batch.old_logps[part],
                None if batch.ref_logps is None else batch.ref_logps[part], batch.advantages[part], vals,
                batch.old_values[part], batch.returns[part], mask, epsilon=cfg.loss.epsilon,
                epsilon_high=cfg.loss.epsilon_high,
                cliprange_value=ppo.cliprange_value, vf_coef=ppo.vf_coef,
                beta=cfg.loss.beta if ppo.kl_in == "loss" else 0.0, loss_type=cfg.loss.loss_type)
            total = total + loss * share
            stats["train/loss"] = loss.item()
            stats["entropy"] = float((ent * mask).sum() / mask.sum().clamp(min=1))
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v * share
        self.acc.backward(total)  # one backward through both models' graphs
        return sums

    def sync_sampler(self) -> None:
        """Make the next rollout sample the policy's current weights (see GRPOTrainer.sync_sampler)."""
        self.source.sync(0)

    # -- the loop ----------------------------------------------------------------------------------------------

    def train(self) -> PPOResult:
        cfg = self.cfg
        ckpt_root = self.output_dir / "checkpoints"
        start = self._resume(ckpt_root)
        bar = tqdm(total=cfg.max_steps, initial=start, desc="ppo", mininterval=2.0,
                   disable=not self.progress or not self.acc.is_main_process)
        critic = self.acc.unwrap_model(self.critic)
        with (self.runtime.fast_paths(),  # the critic on the same fast paths as the policy
              cpu_attention(critic.trunk), compact_mlp(critic.trunk), fp32_gemm(critic, self.gemm),
              activation_checkpointing(critic.trunk, self.checkpointing), attending_packed(critic.trunk, self.packed)):
            self._loop(start, bar, ckpt_root)
        bar.close()
        return PPOResult(self.runtime.save_policy(), cfg.max_steps)

    def _loop(self, start: int, bar, ckpt_root: Path) -> None:
        cfg = self.cfg
        for step in range(start, cfg.max_steps):
            # a resumed run samples what it would have sampled; each process draws its own completions
            torch.manual_seed(sampling_seed(cfg.seed, step, self.acc.process_index))
            t0 = time.perf_counter()
            rollout, idx, scores, metrics = self.collect(step)
            self.watch_grading(step, scores, ckpt_root, start)  # may stop the run here, its steps kept
            t_gen = time.perf_counter() - t0
            batch = self.build_batch(rollout, scores.total, scores.graded_rows)
            # the sampler's copy against the policy on a few of the rows it sampled
            k = min(SYNC_CHECK_ROWS, batch.input_ids.size(0))
            metrics.update(self.strategy.check_sampler(batch.input_ids[:k], batch.attention_mask[:k],
                                                       rollout.completion_mask[:k].to(self.acc.device),
                                                       cfg.sampling.temperature))
            t_ref = time.perf_counter() - t0 - t_gen
            for _ in range(cfg.num_iterations):
                opt_stats = self.optimise(batch)
            elapsed = time.perf_counter() - t0
            done = step + 1
            metrics.update(self._step_metrics(rollout, scores, opt_stats, elapsed, t_gen, t_ref))
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['reward/total']:.3f}")
            report_step(self.acc, cfg, done, metrics, lambda: samples_table(self.cells, rollout, idx, scores, 1),
                        self.on_metrics, self.on_samples)
            if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < cfg.max_steps:
                self._save(ckpt_root, done)

    def _save(self, root: Path, step: int) -> None:
        self.runtime.save(root, step, lambda folder: self.strategy.save_state(Path(folder)))

    def watch_grading(self, step: int, scores, ckpt_root: Path, start: int) -> None:
        """Hand the step's grading to the watch, as GRPO's loop does; PPO has no groups (a critic is its baseline),
        so each process's rows are one, carrying a signal when their graded rewards differ. When the watch stops
        the run, the steps done so far are saved first (unless a checkpoint of them is there), so the same command
        resumes here."""
        def save() -> None:
            every_n = self.cfg.checkpoint_every
            if step > start and not (every_n and step % every_n == 0):  # decided alike on every process
                self._save(ckpt_root, step)

        graded = [t for t, g in zip(scores.total, scores.graded_rows) if g]
        spread = int(len(graded) >= 2 and max(graded) > min(graded))
        self.runtime.observe(step, scores, 1, spread, save)

    def _step_metrics(self, rollout: Rollout, scores, opt: dict[str, float], elapsed: float, t_gen: float,
                      t_ref: float) -> dict[str, float]:
        m = rollout_metrics(rollout, scores, elapsed, t_gen, t_ref, self.scheduler.get_last_lr()[0])
        total = torch.tensor([t if g else float("nan") for t, g in zip(scores.total, scores.graded_rows)],
                             device=self.acc.device)  # [N] NaN: an ungraded row, no reward
        if self.acc.num_processes > 1:  # every process's rows (each calls this once a step)
            total = self.acc.gather(total)
        total = total[~total.isnan()]  # the graded rows'
        m["reward/std"] = total.std().item() if total.numel() > 1 else 0.0  # over the global batch
        m.update(opt)
        return m

    def _resume(self, root: Path) -> int:
        step = load_newest_checkpoint(self.acc, root, lambda f: self.strategy.load_state(Path(f)))
        if step:
            self.sync_sampler()  # loaded in place: the sampler's copies (if any) must see the checkpoint's weights
        return step
