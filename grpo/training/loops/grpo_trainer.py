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
Under `accelerate launch --num_processes N` each process samples and trains on prompts_per_step / N of the step's
prompts, whole groups each (`grpo.training.distributed` says what is split and what is reduced).

Must not depend on Prefect or MLflow: metrics and sample tables go to callbacks.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Mapping, NamedTuple, Protocol, Sequence

import pandas as pd
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo import cores
from grpo.configs.checks import check_fsdp_settings
from grpo.configs.core import GenerationConfig, GRPOConfig
from grpo.configs.distributed import COLLECTIVE_TIMEOUT, DistributedConfig
from grpo.kernels.attention import attending_packed, cpu_attention
from grpo.kernels.gemm import fp32_gemm
from grpo.kernels.mlp import compact_mlp
from grpo.models import activation_checkpointing
from grpo.rewards.steps import STEP_VERIFIER_FUNCTIONS, StepVerifier
from grpo.sampling.engines import Engine, Rollout, build_engine, sampling_dtype
from grpo.sampling.rollout import decode_figures
from grpo.training.accelerator import make_accelerator
from grpo.training.advantages import group_advantages, trained_rows
from grpo.training.batches import prompt_mix_order
from grpo.training.checkpoints import load_newest_checkpoint, save_checkpoint
from grpo.training.distributed import (check_split, gather_table, local_processes, matched_chunks, process_share,
                                       process_weight, sampling_seed)
from grpo.training.dynamic import concat_groups, spread_groups
from grpo.training.grading import GradingStop, signal_groups
from grpo.training.logprobs import packing_on, token_logps
from grpo.training.lora import adapters_off, causal_lm, require_peft
from grpo.training.loss import AGGREGATORS, grpo_loss
from grpo.training.optimizers import MasterWeights, optimizer_step, require_bitsandbytes
from grpo.training.packing import loss_parts, micro_batch_rows
from grpo.training.policy import (check_prompts, check_token_budget, checkpointing_on, frozen_reference, gemm_plan,
                                  grading_watch, observe_grading, prepared, report_step, reward_registry,
                                  rollout_metrics, row_columns, sample_rollout, samples_table, save_policy,
                                  score_rollout, scored_logps, trainable)
from grpo.training.process import (StepRewards, graded_by_steps, process_advantages, score_steps, step_metrics,
                                   token_char_ends)
from grpo.training.rollouts import Plan, Rollouts, start_rollouts
from grpo.training.strategy import make_strategy

REFERENCE_FILE = "reference.pt"  # a checkpoint's refreshed reference (grpo.schedule.reference_every)
SYNC_CHECK_ROWS = 2  # rows a step on which the sampler's gathered copy is compared with the sharded policy

MetricsCallback = Callable[[int, dict[str, float]], None]
SamplesCallback = Callable[[int, pd.DataFrame], None]


class StepHook(Protocol):
    """Work the loop does after every step with that step's samples (the iterative reward model's refresh,
    grpo.training.loops.rm_refresh), whose state travels in the loop's checkpoints."""

    def after_step(self, step: int, table: pd.DataFrame) -> dict[str, float]:
        """The step's samples, every process's (`prompt`, `completion`, `reward`, `reward/<name>`, in groups of
        G rows); returns figures to log with the step's. Called on every process, with the same table."""

    def save(self, folder: Path) -> None:
        """Its state into a checkpoint folder (the main process calls it)."""

    def load(self, folder: Path) -> None:
        """Its state back from a checkpoint folder (every process calls it)."""

    def finish(self, output_dir: Path) -> None:
        """What it leaves beside the trained model when the loop ends (the main process calls it)."""


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

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: pd.DataFrame,
                 cfg: GRPOConfig, output_dir: str | Path, *, engine: Engine | None = None,
                 generation: GenerationConfig | None = None,
                 on_metrics: MetricsCallback | None = None, on_samples: SamplesCallback | None = None,
                 reward_functions: Mapping[str, Callable] | None = None, progress: bool = True,
                 step_verifiers: Mapping[str, StepVerifier] | None = None,
                 distributed: DistributedConfig | None = None, hooks: Sequence[StepHook] = (),
                 coefficients: Callable[[object], torch.Tensor] | None = None):
        check_prompts(prompts, cfg.prompts_per_step, "GRPO")
        check_token_budget(cfg, tokenizer, prompts, "GRPO")  # the longest row a step can make fits the budget
        self.reward_functions = reward_registry(cfg, prompts, reward_functions, "GRPO")
        # process supervision: the step verifier by name, or one the caller brings (a process reward model)
        self.step_verifier = None
        if cfg.supervision == "process":
            verifiers = {**STEP_VERIFIER_FUNCTIONS, **(step_verifiers or {})}
            if cfg.step_verifier not in verifiers:
                raise ValueError(f"step_verifier {cfg.step_verifier!r} is not available here (known: "
                                 f"{sorted(verifiers)}); 'prm' needs a process reward model passed in "
                                 f"step_verifiers (grpo.training.loops.prm.prm_step_verifier)")
            self.step_verifier = verifiers[cfg.step_verifier]
        if cfg.loss_type not in AGGREGATORS:
            raise ValueError(f"unknown loss_type {cfg.loss_type!r}; expected one of {sorted(AGGREGATORS)}")
        if cfg.optimizer == "adamw_8bit":  # optional extras: say what is missing before any work
            require_bitsandbytes()
        if cfg.lora is not None:
            require_peft()
        distributed = distributed or DistributedConfig()
        check_fsdp_settings(distributed, weights_dtype=cfg.weights_dtype, optimizer=cfg.optimizer)
        self.cfg, self.tokenizer, self.prompts = cfg, tokenizer, prompts.reset_index(drop=True)
        self.output_dir = Path(output_dir)
        self.on_metrics, self.on_samples, self.progress = on_metrics, on_samples, progress
        self.hooks = list(hooks)
        self.acc = make_accelerator(cfg.mixed_precision)
        self.strategy = make_strategy(self.acc, distributed)  # how the processes hold the policy
        check_split("prompts_per_step", cfg.prompts_per_step, self.acc.num_processes)  # whole groups per process
        model, optimizer = trainable(model, cfg, self.acc.device, cfg.learning_rate, lora=cfg.lora is not None)
        self.master_weights = optimizer if isinstance(optimizer, MasterWeights) else None
        self.ref_model = frozen_reference(model, cfg, self.acc)  # None with beta = 0, or with LoRA (adapters off)
        self.checkpointing = checkpointing_on(cfg, self.acc)
        self.model, self.optimizer, self.scheduler = prepared(self.strategy, model, optimizer, cfg)
        # micro-batches as rows without padding (policy, pi_old and reference passes alike), where it is exact
        self.packed = packing_on(cfg.packing, self.acc.unwrap_model(self.model))
        # the stage's engine (grpo.sampling.engines) on the policy's whole weights (the policy itself, or under fsdp
        # a copy gathered after every step), sampling in the loop's precision; none with asynchronous rollouts, whose
        # sampler processes build their own
        dtype = sampling_dtype(self.acc.mixed_precision)
        self.engine = engine or (None if cfg.rollout.asynchronous else build_engine(
            generation or GenerationConfig(), self.strategy.sampler_model(dtype), tokenizer, dtype=dtype, who="GRPO"))
        self.cells = self.prompts["prompt"].tolist()
        self.columns = {c: self.prompts[c].tolist() for c in self.prompts.columns if c != "prompt"}
        # which prompts each step takes: all rows alike, or `prompt_mix`'s share of each kind every step
        self.order = prompt_mix_order(self.prompts, cfg)
        self.gemm = gemm_plan(self.acc, cfg, tokenizer, self.prompts, self.acc.unwrap_model(self.model),
                              self.output_dir)
        # each sample's coefficient [N] from the step's scores in place of group advantages (grpo.training.rft)
        self.coefficients = coefficients
        # rollout.mode async: sampler processes (started by `train`), the behaviour weight's cap, the weights' version
        self.rollouts: Rollouts | None = None
        self.tis_cap = cfg.tis_cap
        if cfg.rollout.asynchronous:
            self.tis_cap = cfg.tis_cap or cfg.rollout.behaviour_cap  # decoupled PPO: pi_prox / pi_behave, capped
        self.version = 0  # optimizer steps taken: the version of the weights pushed to the samplers
        self.generation = generation or GenerationConfig()
        self.push_s = 0.0
        # the run's grading: a stop when graders keep failing, a line when groups stop carrying signal
        self.grading = grading_watch(cfg, "GRPO")

    # -- one step, in the paper's order ------------------------------------------------------------------------

    def sample(self, idx: list[int]) -> Rollout:
        # the sampler's log-probs only where the loss reads them (truncated importance sampling)
        return sample_rollout(self.engine, [self.cells[i] for i in idx], self.cfg.num_generations, self.cfg.sampling,
                              logprobs=self.tis_cap is not None, who="GRPO")

    def score(self, rollout: Rollout, idx: list[int], step: int = 0):
        """The rewards that count at `step` (`grpo.schedule.rewards_from`) of the rollout's completions."""
        cfg = self.cfg
        columns = row_columns(self.columns, self.cells, idx, cfg.num_generations)
        return score_rollout(rollout, columns, cfg, self.reward_functions,
                             cfg.schedule.rewards_at(cfg.rewards, step, cfg.max_steps))

    def collect(self, step: int) -> tuple[Rollout, list[int], object, dict[str, float]]:
        """Sample and score one step's groups (refilling dropped ones when dynamic sampling is on)."""
        G, want = self.cfg.num_generations, self.cfg.prompts_per_step // self.acc.num_processes
        # this process's share of the step's prompts (all of them in one process)
        idx = process_share(self.acc, self.order(step))
        if self.rollouts is not None:  # sampled by a worker, up to max_staleness optimizer steps ago
            unit = self.rollouts.take(step)
            scores = self.score(unit.rollout, idx, step)
            stats = {**self.rollouts.figures(unit), "async/push_s": self.push_s}
            self.push_s = 0.0
            return unit.rollout, idx, scores, stats
        rollout = self.sample(idx)
        scores = self.score(rollout, idx, step)
        stats = {"dynamic/refill_rounds": 0.0}
        if not self.cfg.dynamic_sampling:
            return rollout, idx, scores, {**stats, **decode_figures(self.engine)}
        parts = [(rollout, scores, idx, spread_groups(scores.total, G, scores.graded_rows))]
        # the kept batch is filtered, so its reward figures read high: record the unfiltered first draw too (its
        # graded rows: an ungraded row's total is no reward)
        first = [t for t, g in zip(scores.total, scores.graded_rows) if g]
        stats["dynamic/first_draw_reward"] = sum(first) / len(first) if first else float("nan")
        stats["dynamic/first_draw_ungraded_share"] = 1 - len(first) / len(scores.total)
        stats["dynamic/first_draw_zero_std_groups"] = 1 - len(parts[0][3]) / len(idx)
        for draw in range(1, self.cfg.max_refill_rounds + 1):
            if sum(len(p[3]) for p in parts) >= want:
                break
            more = process_share(self.acc, self.order(step, draw))
            r = self.sample(more)
            s = self.score(r, more, step)
            parts.append((r, s, more, spread_groups(s.total, G, s.graded_rows)))
            stats["dynamic/refill_rounds"] = float(draw)
        rollout, idx, scores = concat_groups(parts, G, want, self.tokenizer.pad_token_id)
        stats["dynamic/groups"] = float(len(idx))
        return rollout, idx, scores, {**stats, **decode_figures(self.engine)}  # the refills' steps too

    def score_steps(self, rollout: Rollout, idx: list[int], outcome: list[float],
                    metrics: dict[str, float] | None = None, first: bool = False) -> StepRewards:
        """Process supervision: every completion's checked steps, then its answer step rewarded with `outcome`.

        On the run's `first` step a verifier that finds no step in any completion does not fit the data: an error
        then, rather than a run of outcome GRPO under another name.
        """
        chars = token_char_ends(self.tokenizer, rollout.completion_ids, rollout.completion_mask, rollout.texts)
        columns = row_columns(self.columns, self.cells, idx, self.cfg.num_generations)
        steps = score_steps(self.step_verifier, rollout.texts, columns, outcome, chars, name=self.cfg.step_verifier)
        if first and not any(steps.checked) and not all(steps.ungraded or []):  # all ungraded: the watch's to say
            raise ValueError(f"step_verifier {self.cfg.step_verifier!r} found no step in any of the first "
                             f"{len(rollout.texts)} completions (one reads {rollout.texts[0][:200]!r}); choose a "
                             f"step verifier that reads this data's reasoning")
        if metrics is not None:
            metrics.update(step_metrics(steps))
        return steps

    def build_batch(self, rollout: Rollout, rewards: list[float], steps: StepRewards | None = None,
                    graded: list[bool] | None = None) -> Batch:
        """The step's batch. `graded` (per row): rows whose reward could be had (`RewardScores.graded`); the others
        are left out of their group's statistics and train nothing, nor does a group with fewer than two graded
        rows."""
        cfg = self.cfg
        C = rollout.completion_ids.size(1)
        trains = None  # [N] the rows that train
        if graded is not None and not all(graded):
            # a coefficient needs no group to be compared against: a graded sample trains whatever its group's others
            trains = (torch.tensor(graded) if self.coefficients is not None
                      else trained_rows(graded, cfg.num_generations))
        if self.coefficients is not None:  # `rewards` are already each sample's coefficient: no baseline, no scale
            advantages = torch.tensor(rewards, dtype=torch.float32)  # [N]
        elif steps is None:
            advantages = group_advantages(torch.tensor(rewards, dtype=torch.float32), cfg.num_generations,
                                          scale=cfg.scale_rewards,
                                          graded=None if trains is None else torch.tensor(graded))  # [N]
        else:
            advantages = process_advantages(steps.rewards, steps.ends, cfg.num_generations, C,
                                            scale=cfg.scale_rewards,
                                            graded=None if trains is None else trains.tolist())  # [N, C]
        input_ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1).to(self.acc.device)  # [N, P+C]
        attention_mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1).to(self.acc.device)
        ref_logps = None
        if cfg.beta != 0 and rollout.ref_logprobs is not None:  # scored by the worker that sampled it
            ref_logps = rollout.ref_logprobs.to(self.acc.device)
        elif cfg.beta != 0:
            if cfg.rollout.reference == "sampler":
                raise RuntimeError("rollout.reference sampler: a step's groups came without their reference "
                                   "log-probs")
            reference = self.ref_model if self.ref_model is not None else self.acc.unwrap_model(self.model)
            with adapters_off(reference):
                ref_logps = self._scored(reference, input_ids, attention_mask, C)  # [N, C]
        old_logps = None  # mu = 1: pi_old is the policy being optimised, so the ratio is exactly 1
        if cfg.num_iterations > 1:
            # Recomputed rather than taken from the sampler: sampling may use top-p/top-k, bf16 or another
            # engine (vLLM), whose log-probs differ from this forward pass and would bias the ratio.
            old_logps = self._scored(self.model, input_ids, attention_mask, C)  # [N, C]
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

    def _scored(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor, C: int) -> torch.Tensor:
        return scored_logps(self.acc, model, input_ids, attention_mask, C, self.cfg.micro_batch_size,
                            self.cfg.sampling.temperature, packed=self.packed,
                            max_tokens=self.cfg.max_tokens_per_microbatch)  # [N, C]

    def sync_sampler(self) -> None:
        """Make the next rollout sample the policy's current weights: gather them into the sampler's copy where
        the strategy keeps one, then let the engine refresh what it holds (a bf16 copy, captured steps). With
        asynchronous rollouts, every `rollout.sync_every` optimizer steps, push them to the sampler processes."""
        if self.rollouts is None:
            self.strategy.sync_sampler()
            if self.engine is not None:  # None: asynchronous, before its workers start (a resume loads weights)
                self.engine.sync_weights()
        elif self.version % self.cfg.rollout.sync_every == 0:
            t0 = time.perf_counter()
            self.strategy.sync_sampler()  # under fsdp: the whole weights gathered, unit by unit (a collective)
            self.rollouts.push(self.strategy.sampler_model(), self.version)
            self.push_s += time.perf_counter() - t0

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
        policy = self.acc.unwrap_model(self.model)
        core = causal_lm(policy)  # the transformers model (inside LoRA's wrapper)
        threads = torch.get_num_threads()
        if cfg.rollout.asynchronous:  # before the loop's patches: each worker makes the same ones to its copy
            self.rollouts = self._start_workers(start)
            if self.rollouts.local and all(d == "cpu" for d in self.rollouts.devices):  # the cores the workers leave
                here = cores.cpu_cores() // local_processes(self.acc)
                torch.set_num_threads(min(threads, max(1, here - cfg.rollout.workers * self.rollouts.threads)))
        try:
            with (cpu_attention(core, self.ref_model), compact_mlp(core), fp32_gemm(core, self.gemm),
                  fp32_gemm(self.ref_model, self.gemm), attending_packed(core, self.packed),
                  attending_packed(self.ref_model, self.packed), activation_checkpointing(core, self.checkpointing)):
                self._loop(start, bar, ckpt_root)
        finally:  # ended, failed or stopped: no sampler process outlives the loop
            if self.rollouts is not None:
                self.rollouts.close()
                self.rollouts = None
                torch.set_num_threads(threads)
        bar.close()
        model_dir = save_policy(self.acc, self.strategy, self.model, self.master_weights, self.tokenizer,
                                self.output_dir, also=self._finish_hooks)
        return GRPOResult(model_dir, cfg.max_steps)

    def _start_workers(self, start: int) -> Rollouts:
        cfg = self.cfg
        plan = Plan(self.cells, cfg.prompts_per_step, cfg.num_generations, cfg.sampling, self.generation, cfg.seed,
                    cfg.num_iterations, cfg.rollout.max_staleness, cfg.max_steps,
                    sampling_dtype(self.acc.mixed_precision), self.gemm, self.packed,
                    process_index=self.acc.process_index, num_processes=self.acc.num_processes,
                    policy_kernels=self.strategy.sampler_model() is self.acc.unwrap_model(self.model),
                    grad_params=frozenset(n for n, p in self.strategy.sampler_model().named_parameters()
                                          if p.requires_grad), order=self.order)
        if cfg.rollout.reference == "sampler":  # the workers score the KL term's reference; the trainer keeps none
            plan = plan._replace(reference=self.ref_model.to("cpu"),  # moved off the trainer's device
                                 micro_batch_size=cfg.micro_batch_size, max_tokens=cfg.max_tokens_per_microbatch,
                                 autocast={"bf16": torch.bfloat16, "fp16": torch.float16}.get(
                                     str(self.acc.mixed_precision)))
            self.ref_model = None
        timeout = cfg.rollout.timeout_s or float(os.environ.get(COLLECTIVE_TIMEOUT, "1800"))
        self.version = start * cfg.num_iterations  # a resumed run's weights are the checkpoint's step's
        return start_rollouts(cfg.rollout, plan, self.strategy.sampler_model(), self.tokenizer, first_step=start,
                              version=self.version, timeout_s=timeout, device=self.acc.device,
                              local_processes=local_processes(self.acc), local_index=self.acc.local_process_index)

    def _finish_hooks(self) -> None:
        for hook in self.hooks:
            hook.finish(self.output_dir)

    def _loop(self, start: int, bar, ckpt_root: Path) -> None:
        cfg = self.cfg
        for step in range(start, cfg.max_steps):
            # a resumed run samples what it would have sampled; each process draws its own completions
            torch.manual_seed(sampling_seed(cfg.seed, step, self.acc.process_index))
            t0 = time.perf_counter()
            rollout, idx, scores, metrics = self.collect(step)
            steps = self.score_steps(rollout, idx, scores.total, metrics, step == 0) if self.step_verifier else None
            if steps is not None:  # a completion the step verifier could not check is ungraded, as a reward's
                scores = graded_by_steps(scores, steps)
            rewards = scores.total if self.coefficients is None else self.coefficients(scores).tolist()  # [N]
            graded = scores.graded_rows
            # may stop the run here, its steps kept
            spread = signal_groups(rewards, graded, cfg.num_generations, steps and steps.rewards,
                                   baseline=self.coefficients is None)  # RFT's coefficients have none
            self.watch_grading(step, scores, ckpt_root, start, spread)
            t_gen = time.perf_counter() - t0
            if self.coefficients is not None:  # online RFT: 1.0 for a correct sample, 0.0 otherwise (graded ones)
                correct = [c for c, g in zip(rewards, graded) if g]
                metrics["rft/correct"] = sum(correct) / len(correct) if correct else float("nan")
            batch = self.build_batch(rollout, rewards, steps, graded)
            # the sampler's copy against the policy on a few of the rows it sampled (a strategy that samples from
            # the policy itself has nothing to compare)
            k = min(SYNC_CHECK_ROWS, batch.input_ids.size(0))
            if self.rollouts is None or self.version % cfg.rollout.sync_every == 0:  # async: at each push
                metrics.update(self.strategy.check_sampler(batch.input_ids[:k], batch.attention_mask[:k],
                                                           rollout.completion_mask[:k].to(self.acc.device),
                                                           cfg.sampling.temperature))
            t_ref = time.perf_counter() - t0 - t_gen
            for _ in range(cfg.num_iterations):
                opt_stats = self.optimise(batch)
            elapsed = time.perf_counter() - t0
            done = step + 1
            if cfg.schedule.reference_every and done % cfg.schedule.reference_every == 0:
                self.refresh_reference()
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

        groups = len(scores.graded_rows) // self.cfg.num_generations
        observe_grading(self.acc, self.grading, step, scores, groups, spread, save)

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
        # two: a damaged newest one falls back to the one before
        save_checkpoint(self.acc, root, step, keep=2, save_state=self._save_state)

    def refresh_reference(self) -> None:
        """The KL term's reference becomes the policy as it is now (`grpo.schedule.reference_every`): the whole
        weights the sampler reads (under fsdp the gathered copy, in the sampler's precision), cast to the
        reference's dtype."""
        with torch.no_grad():
            self.ref_model.load_state_dict(self.strategy.sampler_model().state_dict())

    def _save_state(self, folder: str) -> None:
        self.strategy.save_state(Path(folder))
        if self.acc.is_main_process:
            for hook in self.hooks:
                hook.save(Path(folder))
            if self.cfg.schedule.reference_every:  # a refreshed reference is no longer the starting checkpoint
                torch.save(self.ref_model.state_dict(), Path(folder) / REFERENCE_FILE)

    def _load_state(self, folder: str) -> None:
        self.strategy.load_state(Path(folder))
        if self.cfg.schedule.reference_every:
            self.ref_model.load_state_dict(torch.load(Path(folder) / REFERENCE_FILE, weights_only=True))
        for hook in self.hooks:
            hook.load(Path(folder))

    def _resume(self, root: Path) -> int:
        step = load_newest_checkpoint(self.acc, root, self._load_state)
        if step:
            self.sync_sampler()  # loaded in place: the sampler's copies (if any) must see the checkpoint's weights
        return step
