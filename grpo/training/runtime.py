"""The policy as a policy-gradient loop trains it, set up once for GRPO's loop and PPO's: the prompts and reward
functions checked, the accelerator and the strategy that holds the policy across processes, the trainable policy with
its optimizer and schedule, the frozen reference, the GEMM plan and the grading watch; with what both loops do with
them (score a rollout, log-probs without gradients, the fast paths held for a run, checkpoints, the saved policy).

A loop builds its own step from this (grpo.training.loops.grpo_trainer, grpo.training.loops.ppo_trainer); what
differs between loops (PPO's critic, GRPO's rollout source and advantages) is theirs.

Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable, Iterator, Mapping

import pandas as pd
import torch

from grpo.configs.checks import check_fsdp_settings
from grpo.configs.distributed import DistributedConfig
from grpo.configs.training import GRPOConfig
from grpo.kernels.attention import attending_packed, cpu_attention
from grpo.kernels.gemm import fp32_gemm
from grpo.kernels.mlp import compact_mlp
from grpo.models import activation_checkpointing
from grpo.sampling.engines import Rollout
from grpo.training.accelerator import make_accelerator
from grpo.training.checkpoints import save_checkpoint
from grpo.training.distributed import check_split
from grpo.training.grading import StepGrading
from grpo.training.logprobs import packing_on
from grpo.training.lora import adapters_off, causal_lm, require_peft
from grpo.training.loss import AGGREGATORS
from grpo.training.optimizers import MasterWeights, require_bitsandbytes
from grpo.training.policy import (check_prompts, check_token_budget, checkpointing_on, frozen_reference, gemm_plan,
                                  grading_watch, observe_grading, prepared, reward_registry, row_columns, save_policy,
                                  score_rollout, scored_logps, trainable)
from grpo.training.strategy import make_strategy

REFERENCE_FILE = "reference.pt"  # a checkpoint's refreshed reference (grpo.schedule.reference_every)


class OnRuntime:
    """A loop whose runtime's attributes (acc, cfg, model, packed, ...) read and set as its own: a value set on the
    loop is the runtime's, so every part holding the runtime sees it (a copy kept on the loop alone would leave the
    runtime's passes, the sources and the step's update reading the old one)."""

    def __getattr__(self, name: str):
        if name == "runtime":
            raise AttributeError(name)
        return getattr(self.runtime, name)

    def __setattr__(self, name: str, value) -> None:
        runtime = self.__dict__.get("runtime")
        own = name in self.__dict__ or isinstance(getattr(type(self), name, None), property)
        if runtime is not None and not own and hasattr(runtime, name):
            setattr(runtime, name, value)
        else:
            object.__setattr__(self, name, value)


class PolicyRuntime:
    """The policy, its reference, the accelerator and strategy, the prompts and the reward functions of one run."""

    def __init__(self, model: torch.nn.Module, tokenizer, prompts: pd.DataFrame, cfg: GRPOConfig,
                 output_dir: str | Path, *, who: str, reward_functions: Mapping[str, Callable] | None = None,
                 distributed: DistributedConfig | None = None):
        check_prompts(prompts, cfg.prompts_per_step, who)
        check_token_budget(cfg, tokenizer, prompts, who)  # the longest row a step can make fits the budget
        self.reward_functions = reward_registry(cfg, prompts, reward_functions, who)
        if cfg.loss.loss_type not in AGGREGATORS:
            raise ValueError(f"unknown loss_type {cfg.loss.loss_type!r}; expected one of {sorted(AGGREGATORS)}")
        if cfg.optimizer.name == "adamw_8bit":  # optional extras: say what is missing before any work
            require_bitsandbytes()
        if cfg.lora is not None:
            require_peft()
        distributed = distributed or DistributedConfig()
        check_fsdp_settings(distributed, weights_dtype=cfg.memory.weights_dtype, optimizer=cfg.optimizer.name)
        self.cfg, self.tokenizer, self.prompts = cfg, tokenizer, prompts.reset_index(drop=True)
        self.output_dir = Path(output_dir)
        self.acc = make_accelerator(cfg.memory.mixed_precision)
        self.strategy = make_strategy(self.acc, distributed)  # how the processes hold the policy
        check_split("prompts_per_step", cfg.prompts_per_step, self.acc.num_processes)  # whole prompts per process
        model, optimizer = trainable(model, cfg, self.acc.device, cfg.optimizer.learning_rate,
                                     lora=cfg.lora is not None)
        self.master_weights = optimizer if isinstance(optimizer, MasterWeights) else None
        self.ref_model = frozen_reference(model, cfg, self.acc)  # None with beta = 0, or with LoRA (adapters off)
        self.checkpointing = checkpointing_on(cfg, self.acc)
        self.model, self.optimizer, self.scheduler = prepared(self.strategy, model, optimizer, cfg)
        # micro-batches as rows without padding (policy, pi_old and reference passes alike), where it is exact
        self.packed = packing_on(cfg.memory.packing, self.acc.unwrap_model(self.model))
        self.cells = self.prompts["prompt"].tolist()
        self.columns = {c: self.prompts[c].tolist() for c in self.prompts.columns if c != "prompt"}
        self.gemm = gemm_plan(self.acc, cfg, tokenizer, self.prompts, self.acc.unwrap_model(self.model),
                              self.output_dir)
        # the run's grading: a stop when graders keep failing, a line when the rewards stop carrying signal
        self.grading = grading_watch(cfg, who)

    def score(self, rollout: Rollout, idx: list[int], n: int, rewards: Mapping[str, float] | None = None):
        """The rollout's rewards (`n` completions of each prompt of `idx`; `rewards` by name, else the config's)."""
        return score_rollout(rollout, row_columns(self.columns, self.cells, idx, n), self.cfg, self.reward_functions,
                             rewards)

    def scored(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor, C: int) -> torch.Tensor:
        """`model`'s log-probs of the completion tokens, without gradients, in the run's micro-batches."""
        return scored_logps(self.acc, model, input_ids, attention_mask, C, self.cfg.memory.micro_batch_size,
                            self.cfg.sampling.temperature, packed=self.packed,
                            max_tokens=self.cfg.memory.max_tokens_per_microbatch)  # [N, C]

    def reference_logps(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, C: int) -> torch.Tensor:
        """The KL term's reference log-probs [N, C]: the frozen copy's, or with LoRA the policy's with its adapters
        off."""
        reference = self.ref_model if self.ref_model is not None else self.acc.unwrap_model(self.model)
        with adapters_off(reference):
            return self.scored(reference, input_ids, attention_mask, C)  # [N, C]

    def refresh_reference(self) -> None:
        """The KL term's reference becomes the policy as it is now (`grpo.schedule.reference_every`): the whole
        weights the sampler reads (under fsdp the gathered copy, in the sampler's precision), cast to the
        reference's dtype."""
        with torch.no_grad():
            self.ref_model.load_state_dict(self.strategy.sampler_model().state_dict())

    def save_state(self, folder: Path) -> None:
        """The strategy's state into a checkpoint folder, and a refreshed reference (no longer the starting
        checkpoint's weights)."""
        self.strategy.save_state(folder)
        if self.acc.is_main_process and self.cfg.schedule.reference_every:
            torch.save(self.ref_model.state_dict(), folder / REFERENCE_FILE)

    def load_state(self, folder: Path) -> None:
        self.strategy.load_state(folder)
        if self.cfg.schedule.reference_every:
            self.ref_model.load_state_dict(torch.load(folder / REFERENCE_FILE, weights_only=True))

    @contextmanager
    def fast_paths(self) -> Iterator[None]:
        """The policy's and the reference's CPU attention, compact MLP, fp32 GEMMs, packed rows and activation
        checkpointing, held for the run (a recomputed layer finds them too)."""
        core = causal_lm(self.acc.unwrap_model(self.model))  # the transformers model (inside LoRA's wrapper)
        with ExitStack() as stack:
            for patch in (cpu_attention(core, self.ref_model), compact_mlp(core), fp32_gemm(core, self.gemm),
                          fp32_gemm(self.ref_model, self.gemm), attending_packed(core, self.packed),
                          attending_packed(self.ref_model, self.packed),
                          activation_checkpointing(core, self.checkpointing)):
                stack.enter_context(patch)
            yield

    def observe(self, step: int, scores, groups: int, spread: int, save: Callable[[], None],
                unseen: StepGrading | None = None) -> None:
        """Hand the step's grading to the watch (`spread`: this process's `groups` that carry a gradient; `unseen`:
        rows sampled and dropped, which the watch counts too)."""
        observe_grading(self.acc, self.grading, step, scores, groups, spread, save, unseen)

    def save(self, root: Path, step: int, save_state: Callable[[str], None]) -> None:
        """A resumable checkpoint of `step`; two kept: a damaged newest one falls back to the one before."""
        save_checkpoint(self.acc, root, step, keep=2, save_state=save_state)

    def save_policy(self, also: Callable[[], None] | None = None) -> Path:
        """The trained policy for the next stage (`grpo.training.policy.save_policy`); call on every process."""
        return save_policy(self.acc, self.strategy, self.model, self.master_weights, self.tokenizer,
                           self.output_dir, also=also)
