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
from typing import NamedTuple, Sequence

import pandas as pd
import torch
from tqdm.auto import tqdm

from grpo.sampling.engines import Engine, Rollout
from grpo.training.checkpoints import load_newest_checkpoint
from grpo.training.distributed import gather_table, sampling_seed
from grpo.training.dynamic import spread_groups
from grpo.training.grading import GradingStop
from grpo.training.parts import LoopParts, grpo_parts
from grpo.training.hooks import StepHook
from grpo.training.policy import MetricsCallback, SamplesCallback, report_step, rollout_metrics, samples_table
from grpo.training.process import StepRewards
from grpo.training.runtime import OnRuntime
from grpo.training.step_batch import Batch, build_batch, clipped_update

SYNC_CHECK_ROWS = 2  # rows a step on which the sampler's gathered copy is compared with the sharded policy


class GRPOResult(NamedTuple):
    model_dir: Path  # final policy, loadable with from_pretrained
    steps: int  # optimizer steps taken in total


class GRPOTrainer(OnRuntime):
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
        self.tis_cap = self.cfg.loss.tis_cap or self.source.behaviour_cap  # asynchronous: pi_prox / pi_behave, capped
        self.version = 0  # optimizer steps taken: the version of the weights the sampler holds

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
        """The step's batch (`grpo.training.step_batch.build_batch`)."""
        return build_batch(self.runtime, self.advantage, rollout, rewards, steps, graded)

    def sync_sampler(self) -> None:
        """Make the next rollout sample the policy's current weights (the source's `sync`: the engine's copy, or a
        push to asynchronous samplers every `rollout.sync_every` optimizer steps)."""
        self.source.sync(self.version)

    def optimise(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of the clipped objective over the batch, in micro-batches; the sampler then synced."""
        sums = clipped_update(self.runtime, batch, self.tis_cap)
        self.version += 1
        self.sync_sampler()  # the next rollout samples the stepped weights
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

        self.runtime.observe(step, scores, len(scores.graded_rows) // self.cfg.num_generations, spread, save,
                             self.source.unseen)

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
