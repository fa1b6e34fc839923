"""GRPO: sample G completions per prompt, score them with rule rewards, and push each toward its group's best.

One step, as in the DeepSeekMath/R1 papers:
  1. sample G completions for each of `prompts_per_step` prompts from the current policy (pi_old);
  2. score them: a weighted sum of reward functions;
  3. advantages relative to the group: (r - group mean) / group std; no value model (with process supervision,
     grpo.training.process: a reward at the end of every reasoning step, and each token's advantage the sum of
     the normalised rewards of the steps that end at or after it);
  4. `num_iterations` (mu) passes of the clipped objective with a k3 KL penalty to a frozen reference model
     (no reference at all when beta = 0; with LoRA, the policy with its adapters off), one optimizer step per pass.
With mu = 1 pi_old is the policy being optimised, so the ratio is exactly 1 and nothing is recomputed; with
mu > 1 pi_old's log-probs are computed once, before the first update. Optional dynamic sampling (DAPO)
drops groups whose rewards all agree, which carry no gradient, and samples more prompts to refill the batch.
The loop is handed its parts (grpo.training.parts, built by the job runner): the policy runtime, a rollout source
(the engine in the loop, dynamic sampling's refill, asynchronous samplers) and an advantage function (group outcome,
process supervision, RFT's coefficients); a variant is a part, not a branch of the step.
Under `accelerate launch --num_processes N` each process samples and trains on prompts_per_step / N of the step's
prompts, whole groups each (`grpo.training.distributed` says what is split and what is reduced).

Must not depend on Prefect or MLflow: metrics and sample tables go to callbacks.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, NamedTuple, Protocol, Sequence

import pandas as pd
import torch
from tqdm.auto import tqdm

from grpo.sampling.engines import Engine, Rollout
from grpo.training.checkpoints import load_newest_checkpoint
from grpo.training.distributed import gather_table, matched_chunks, process_weight, sampling_seed
from grpo.training.dynamic import spread_groups
from grpo.training.grading import GradingStop
from grpo.training.logprobs import token_logps
from grpo.training.loss import grpo_loss
from grpo.training.optimizers import optimizer_step
from grpo.training.packing import loss_parts, micro_batch_rows
from grpo.training.parts import LoopParts, grpo_parts
from grpo.training.hooks import StepHook
from grpo.training.policy import MetricsCallback, SamplesCallback, report_step, rollout_metrics, samples_table
from grpo.training.process import StepRewards

SYNC_CHECK_ROWS = 2  # rows a step on which the sampler's gathered copy is compared with the sharded policy


class Batch(NamedTuple):
    """One step's scored samples, ready for the loss (N = prompts x G sequences, grouped by prompt)."""

    input_ids: torch.Tensor  # [N, P+C] prompt (left-padded) then completion (right-padded)
    attention_mask: torch.Tensor  # [N, P+C]
    completion_mask: torch.Tensor  # [N, C] float: the tokens the loss counts (none of a masked truncated row)
    old_logps: torch.Tensor | None  # [N, C] pi_old log-probs before the first update; None when mu = 1
    ref_logps: torch.Tensor | None  # [N, C] reference log-probs, None when beta = 0
    advantages: torch.Tensor  # [N], or [N, C] one a token (process supervision)
    sampler_logps: torch.Tensor | None = None  # [N, C] the sampler's log-probs of the chosen tokens, when it gives them


class GRPOResult(NamedTuple):
    model_dir: Path  # final policy, loadable with from_pretrained
    steps: int  # optimizer steps taken in total


class GRPOTrainer:
    """Holds the policy, the reference model, the optimizer and the data; `train()` runs the loop."""

    def __init__(self, model, tokenizer, prompts: pd.DataFrame, cfg, output_dir: str | Path, *,
                 on_metrics: MetricsCallback | None = None, on_samples: SamplesCallback | None = None,
                 progress: bool = True, hooks: Sequence[StepHook] = (), **parts):
        """The loop of a model and a config, its parts built as the job runner builds them (`parts` are
        `grpo.training.parts.grpo_parts`' keywords: engine, generation, reward_functions, step_verifiers,
        distributed, coefficients)."""
        self.take(grpo_parts(model, tokenizer, prompts, cfg, output_dir, **parts), on_metrics, on_samples, progress,
                  hooks)

    @classmethod
    def from_parts(cls, parts: LoopParts, on_metrics: MetricsCallback | None = None,
                   on_samples: SamplesCallback | None = None, progress: bool = True,
                   hooks: Sequence[StepHook] = ()) -> GRPOTrainer:
        """The loop of parts built elsewhere (the job runner's)."""
        trainer = cls.__new__(cls)
        trainer.take(parts, on_metrics, on_samples, progress, hooks)
        return trainer

    def take(self, parts: LoopParts, on_metrics, on_samples, progress: bool, hooks: Sequence[StepHook]) -> None:
        self.runtime, self.source, self.advantage = parts
        self.on_metrics, self.on_samples, self.progress, self.hooks = on_metrics, on_samples, progress, list(hooks)
        self.tis_cap = self.cfg.tis_cap or self.source.behaviour_cap  # asynchronous: pi_prox / pi_behave, capped
        self.version = 0  # optimizer steps taken: the version of the weights the sampler holds

    def __getattr__(self, name: str):  # the runtime's (acc, cfg, model, strategy, ref_model, ...) read as the loop's
        if name == "runtime":
            raise AttributeError(name)
        return getattr(self.runtime, name)

    @property
    def engine(self) -> Engine | None:
        """The in-loop source's engine (None with asynchronous rollouts: the samplers build their own)."""
        return self.source.engine

    @engine.setter
    def engine(self, engine: Engine) -> None:
        self.source.engine = engine

    # -- one step, in the paper's order ------------------------------------------------------------------------

    def sample(self, idx: list[int]) -> Rollout:
        return self.source.sample(idx)

    def score(self, rollout: Rollout, idx: list[int], step: int = 0):
        """The rewards that count at `step` (`grpo.schedule.rewards_from`) of the rollout's completions."""
        return self.source.score(rollout, idx, step)

    def collect(self, step: int) -> tuple[Rollout, list[int], object, dict[str, float]]:
        """Sample (or take) and score one step's groups."""
        return self.source.collect(step)

    def build_batch(self, rollout: Rollout, rewards: list[float], steps: StepRewards | None = None,
                    graded: list[bool] | None = None) -> Batch:
        """The step's batch. `graded` (per row): rows whose reward could be had (`RewardScores.graded`); the others
        are left out of their group's statistics and train nothing, nor does a group with fewer than two graded
        rows."""
        cfg = self.cfg
        C = rollout.completion_ids.size(1)
        # [N] or [N, C] (process supervision); trains: [N] the rows that train, None when all do
        advantages, trains = self.advantage.advantages(rewards, graded, steps, C)
        input_ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1).to(self.acc.device)  # [N, P+C]
        attention_mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1).to(self.acc.device)
        ref_logps = None
        if cfg.beta != 0 and rollout.ref_logprobs is not None:  # scored by the worker that sampled it
            ref_logps = rollout.ref_logprobs.to(self.acc.device)
        elif cfg.beta != 0:
            if cfg.rollout.reference == "sampler":
                raise RuntimeError("rollout.reference sampler: a step's groups came without their reference "
                                   "log-probs")
            ref_logps = self.runtime.reference_logps(input_ids, attention_mask, C)  # [N, C]
        old_logps = None  # mu = 1: pi_old is the policy being optimised, so the ratio is exactly 1
        if cfg.num_iterations > 1:
            # Recomputed rather than taken from the sampler: sampling may use top-p/top-k, bf16 or another
            # engine (vLLM), whose log-probs differ from this forward pass and would bias the ratio.
            old_logps = self.runtime.scored(self.model, input_ids, attention_mask, C)  # [N, C]
        completion_mask = rollout.completion_mask.float()  # [N, C]
        if cfg.mask_truncated_completions:  # still in the group statistics above, but no gradient of their own
            completion_mask = completion_mask * (~rollout.truncated).float()[:, None]
        if trains is not None:  # ungraded rows, and groups with fewer than two graded: no loss, no KL
            completion_mask = completion_mask * trains.float()[:, None]
            advantages = advantages * (trains.float() if advantages.dim() == 1 else trains.float()[:, None])
        sampler_logps = getattr(rollout, "logprobs", None)  # for truncated importance sampling and its metrics
        if sampler_logps is not None:
            sampler_logps = sampler_logps.to(self.acc.device)  # [N, C]
        return Batch(input_ids, attention_mask, completion_mask.to(self.acc.device), old_logps, ref_logps,
                     advantages.to(self.acc.device), sampler_logps)

    def sync_sampler(self) -> None:
        """Make the next rollout sample the policy's current weights (the source's `sync`: the engine's copy, or a
        push to asynchronous samplers every `rollout.sync_every` optimizer steps)."""
        self.source.sync(self.version)

    def optimise(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of the clipped objective over the batch, in micro-batches."""
        cfg, C = self.cfg, batch.completion_mask.size(1)
        sums: dict[str, float] = {}
        self.model.train()
        # this process's loss as a share of the global batch's (1.0 in one process); DDP averages the gradients
        weight = process_weight(self.acc, cfg.loss_type, batch.completion_mask)
        chunks = matched_chunks(self.acc, micro_batch_rows(batch.attention_mask, cfg.micro_batch_size,
                                                           cfg.max_tokens_per_microbatch))
        for i, (rows, counts) in enumerate(chunks):
            with self.strategy.no_sync(self.model, last=i == len(chunks) - 1):
                with self.acc.autocast():
                    logps, entropy = token_logps(self.model, batch.input_ids[rows], batch.attention_mask[rows], C,
                                                 cfg.sampling.temperature, with_entropy=True, packed=self.packed)
                total = 0.0
                # each part weighted in the step's loss as its rows are in the row-count micro-batches
                parts = loss_parts(cfg.loss_type, batch.completion_mask, rows, cfg.micro_batch_size,
                                   weight * float(counts))
                for local, share in parts:
                    part = rows if local is None else [rows[j] for j in local]  # the batch's rows of this part
                    lp, ent = (logps, entropy) if local is None else (logps[local], entropy[local])  # [b, C]
                    loss, stats = grpo_loss(lp, None if batch.old_logps is None else batch.old_logps[part],
                                            None if batch.ref_logps is None else batch.ref_logps[part],
                                            batch.advantages[part], batch.completion_mask[part], epsilon=cfg.epsilon,
                                            epsilon_high=cfg.epsilon_high, beta=cfg.beta, loss_type=cfg.loss_type,
                                            importance_sampling_level=cfg.importance_sampling_level,
                                            sampler_logps=None if batch.sampler_logps is None
                                            else batch.sampler_logps[part], tis_cap=self.tis_cap)
                    total = total + loss * share
                    mask = batch.completion_mask[part]
                    stats["train/loss"] = loss.item()
                    stats["entropy"] = float((ent * mask).sum() / mask.sum().clamp(min=1))
                    for k, v in stats.items():  # a share-weighted mean over micro-batches; a maximum stays one
                        sums[k] = max(sums.get(k, v), v) if k.endswith("_max") else sums.get(k, 0.0) + v * share
                self.acc.backward(total)
        grad_norm = optimizer_step(self.acc, self.model, self.optimizer, self.scheduler, cfg.max_grad_norm)
        self.version += 1
        self.sync_sampler()  # the next rollout samples the stepped weights
        sums["grad_norm"] = float(grad_norm)
        return sums

    # -- the loop ----------------------------------------------------------------------------------------------

    def train(self) -> GRPOResult:
        cfg = self.cfg
        ckpt_root = self.output_dir / "checkpoints"
        start = self._resume(ckpt_root)
        bar = tqdm(total=cfg.max_steps, initial=start, desc="grpo", mininterval=2.0,
                   disable=not self.progress or not self.acc.is_main_process)
        self.version = start * cfg.num_iterations  # a resumed run's weights are the checkpoint's step's
        try:
            self.source.start(start)  # before the loop's patches: an asynchronous sampler makes the same ones
            with self.runtime.fast_paths():
                self._loop(start, bar, ckpt_root)
        finally:  # ended, failed or stopped: no sampler process outlives the loop
            self.source.close()
        bar.close()
        return GRPOResult(self.runtime.save_policy(also=self._finish_hooks), cfg.max_steps)

    def _finish_hooks(self) -> None:
        for hook in self.hooks:
            hook.finish(self.output_dir)

    def _loop(self, start: int, bar, ckpt_root: Path) -> None:
        cfg = self.cfg
        for step in range(start, cfg.max_steps):
            # a resumed run samples what it would have sampled; each process draws its own completions
            torch.manual_seed(sampling_seed(cfg.seed, step, self.acc.process_index))
            t0 = time.perf_counter()
            rollout, idx, scores, metrics = self.source.collect(step)
            judged = self.advantage.judge(rollout, idx, scores, metrics, step == 0)
            scores = judged.scores
            self.watch_grading(step, scores, ckpt_root, start, judged.spread)  # may stop the run, its steps kept
            t_gen = time.perf_counter() - t0
            batch = self.build_batch(rollout, judged.rewards, judged.steps, scores.graded_rows)
            # the sampler's copy against the policy on a few of the rows it sampled (at each push; a strategy that
            # samples from the policy itself has nothing to compare)
            k = min(SYNC_CHECK_ROWS, batch.input_ids.size(0))
            if self.source.pushes_at(self.version):
                metrics.update(self.strategy.check_sampler(batch.input_ids[:k], batch.attention_mask[:k],
                                                           rollout.completion_mask[:k].to(self.acc.device),
                                                           cfg.sampling.temperature))
            t_ref = time.perf_counter() - t0 - t_gen
            for _ in range(cfg.num_iterations):
                opt_stats = self.optimise(batch)
            elapsed = time.perf_counter() - t0
            done = step + 1
            if cfg.schedule.reference_every and done % cfg.schedule.reference_every == 0:
                self.runtime.refresh_reference()
            metrics.update(self._step_metrics(rollout, scores, opt_stats, elapsed, t_gen, t_ref))
            if self.hooks:  # every process's samples (a collective: each process calls it every step)
                table = gather_table(self.acc, self._samples_table(rollout, idx, scores))
                try:
                    for hook in self.hooks:
                        metrics.update(hook.after_step(done, table))
                except GradingStop:  # a hook that stops the run (the same verdict on every process): steps kept
                    self._save(ckpt_root, done)
                    raise
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['reward/total']:.3f}")
            report_step(self.acc, cfg, done, metrics, lambda: self._samples_table(rollout, idx, scores),
                        self.on_metrics, self.on_samples)
            if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < cfg.max_steps:
                self._save(ckpt_root, done)

    def watch_grading(self, step: int, scores, ckpt_root: Path, start: int, spread: int) -> None:
        """Hand the step's grading (`spread`: this process's groups that carry a gradient) to the watch; when it
        stops the run, the steps done so far are saved first (unless a checkpoint of them is there: the one this run
        resumed from, or the loop's own), so the same command resumes here."""
        def save() -> None:
            every_n = self.cfg.checkpoint_every
            if step > start and not (every_n and step % every_n == 0):  # decided alike on every process
                self._save(ckpt_root, step)

        self.runtime.observe(step, scores, len(scores.graded_rows) // self.cfg.num_generations, spread, save)

    def _step_metrics(self, rollout: Rollout, scores, opt: dict[str, float], elapsed: float, t_gen: float,
                      t_ref: float) -> dict[str, float]:
        G = self.cfg.num_generations
        m = rollout_metrics(rollout, scores, elapsed, t_gen, t_ref, self.scheduler.get_last_lr()[0])
        graded = scores.graded_rows
        groups = [[scores.total[i] for i in range(g * G, (g + 1) * G) if graded[i]] for g in range(len(graded) // G)]
        stds = [torch.tensor(v).std().item() for v in groups if len(v) >= 2]  # over each group's graded rows
        m["reward/std"] = sum(stds) / len(stds) if stds else 0.0
        m["reward/zero_std_groups"] = 1 - len(spread_groups(scores.total, G, graded)) / max(len(groups), 1)
        m.update(opt)
        return m

    def _samples_table(self, rollout: Rollout, idx: list[int], scores) -> pd.DataFrame:
        return samples_table(self.cells, rollout, idx, scores, self.cfg.num_generations)

    def _save(self, root: Path, step: int) -> None:
        self.runtime.save(root, step, self._save_state)

    def _save_state(self, folder: str) -> None:
        self.runtime.save_state(Path(folder))
        if self.acc.is_main_process:
            for hook in self.hooks:
                hook.save(Path(folder))

    def _load_state(self, folder: str) -> None:
        self.runtime.load_state(Path(folder))
        for hook in self.hooks:
            hook.load(Path(folder))

    def _resume(self, root: Path) -> int:
        step = load_newest_checkpoint(self.acc, root, self._load_state)
        if step:
            self.sync_sampler()  # loaded in place: the sampler's copies (if any) must see the checkpoint's weights
        return step
