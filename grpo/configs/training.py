"""The training loops' settings: supervised fine-tuning (`SFTConfig`) and GRPO (`GRPOConfig`), each a section of
its stage config in `grpo.configs.recipe`. PPO's own settings are in `grpo.configs.ppo`, online RFT's in
`grpo.configs.rft`.

Plain pydantic: imports nothing of torch or of the modules that do the work, so a recipe is read and checked
before anything heavy loads.
"""

from __future__ import annotations

import math
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from grpo.configs.checks import Precision
from grpo.configs.code import CodeConfig
from grpo.configs.grading import STEP_VERIFIERS, JudgeConfig
from grpo.configs.lora import LoRAConfig
from grpo.configs.rollout import RolloutConfig
from grpo.configs.sampling import SamplingConfig
from grpo.configs.schedule import ScheduleConfig

# transformers' schedulers that need nothing beyond the warmup and total steps (grpo.training.schedules has them)
LR_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                 "inverse_sqrt")


def budget_needs_packing(what: str, without: str):
    """The check SFT's and GRPO's memory settings share, as a model validator: a `max_tokens_per_microbatch` token
    budget (which `what`) needs `packing` true or auto; left out, a micro-batch is `without`."""

    def check(cfg):
        if cfg.max_tokens_per_microbatch is not None and cfg.packing is False:
            raise ValueError(f"max_tokens_per_microbatch {what}; it needs packing: true or auto (or leave it out: "
                             f"{without})")
        return cfg

    return model_validator(mode="after")(check)


class SFTConfig(BaseModel):
    """The supervised fine-tuning loop."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_steps: int = Field(500, ge=1)  # optimizer steps
    batch_size: int = Field(32, ge=1)  # rows per micro-batch
    grad_accum_steps: int = Field(1, ge=1)  # micro-batches per optimizer step
    learning_rate: float = Field(2e-3, gt=0)  # peak rate (a from-scratch tiny model takes a large one; real ~1e-5)
    lr_scheduler: Literal[LR_SCHEDULERS] = "cosine"  # a transformers scheduler name
    warmup_steps: int = Field(20, ge=0)  # linear warmup
    weight_decay: float = Field(0.0, ge=0)  # AdamW weight decay
    max_grad_norm: float = Field(1.0, gt=0)  # gradient clipping
    max_seq_len: int = Field(384, ge=2)  # prompt + response tokens; longer rows are cut at the end of the response
    mixed_precision: Precision = "auto"  # auto (bf16 where native, else fp32), bf16, fp16 (GPU) or no
    # fp32 linears on a CPU: "auto" times MKL (torch's default path) and oneDNN on the loop's shapes and keeps the
    # faster of each GEMM (grpo.kernels.gemm); "mkl" or "onednn" forces one
    fp32_gemm: Literal["auto", "mkl", "onednn"] = "auto"
    gradient_checkpointing: bool = False  # trade compute for memory on real models
    # each micro-batch's rows as one row without padding (grpo.training.packing), the same loss: "auto" where the
    # model's attention takes packed rows exactly (Qwen2/Llama on SDPA or eager, any model on flash attention)
    packing: bool | Literal["auto"] = "auto"
    # a memory bound: each micro-batch's rows go through the model in packed pieces of at most this many tokens
    # (whole rows in order), the loss still the token mean over the micro-batch; None = one forward a micro-batch
    max_tokens_per_microbatch: int | None = Field(None, ge=1)
    checkpoint_every: int = Field(100, ge=0)  # steps between resumable checkpoints (0 = only at the end)
    keep_checkpoints: int = Field(2, ge=1)  # resumable checkpoints kept on disk (two: a damaged newest falls back)
    log_every: int = Field(10, ge=1)  # steps between metric callbacks
    seed: int = 0  # data order and dropout

    _budget_needs_packing = budget_needs_packing("splits micro-batches into packed pieces", "one forward a micro-batch")


# the flat names GRPOConfig took before its sections, each with its place now: a recipe or an override that names one
# the old way is read as the new path (the before-validator below and grpo.configs.recipe share it), and a recipe
# file or an override that does gets one FutureWarning naming the new paths. For users' own recipes: the shipped
# ones and the docs name none (tests/grpo/configs/test_recipes.py)
MOVED_KEYS: dict[str, str] = {
    **{k: f"optimizer.{k}" for k in ("learning_rate", "lr_scheduler", "warmup_steps", "weight_decay", "max_grad_norm")},
    "optimizer": "optimizer.name",  # a string: the optimizer's name (a mapping is the section itself)
    **{k: f"loss.{k}" for k in ("beta", "epsilon", "epsilon_high", "loss_type", "importance_sampling_level", "tis_cap",
                                "scale_rewards", "mask_truncated_completions")},
    **{k: f"memory.{k}" for k in ("micro_batch_size", "packing", "max_tokens_per_microbatch", "gradient_checkpointing",
                                  "mixed_precision", "fp32_gemm", "reference_dtype", "weights_dtype")},
    **{k: f"grading.{k}" for k in ("supervision", "step_verifier", "prm_path", "code", "appeal", "max_ungraded_share",
                                   "ungraded_window", "no_signal_steps", "stop_without_signal")},
    **{k: f"rollout.{k}" for k in ("dynamic_sampling", "max_refill_rounds")},
}


def moved_path(key: str, value=None) -> str | None:
    """Where a flat GRPOConfig key lives now ("beta" -> "loss.beta"), None for a key that did not move; `optimizer`
    moves only when its value is a name (a mapping is the section)."""
    if key == "optimizer" and (value is None or isinstance(value, (dict, BaseModel))):
        return None
    return MOVED_KEYS.get(key)


class OptimizerConfig(BaseModel):
    """GRPO's optimizer and its learning-rate schedule."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Literal["adamw", "adamw_8bit"] = "adamw"  # adamw_8bit: bitsandbytes' AdamW8bit (8-bit moments)
    learning_rate: float = Field(1e-5, gt=0)  # AdamW learning rate; large ones destroy a tiny model's skills
    lr_scheduler: Literal[LR_SCHEDULERS] = "constant_with_warmup"  # a transformers scheduler name
    warmup_steps: int = Field(0, ge=0)  # linear warmup
    weight_decay: float = Field(0.0, ge=0)  # AdamW weight decay
    max_grad_norm: float = Field(1.0, gt=0)  # gradient clipping


class LossConfig(BaseModel):
    """GRPO's objective: the KL term, the clipped ratio, how tokens and rewards are weighed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    beta: float = Field(0.04, ge=0)  # KL coefficient (DeepSeekMath); 0 skips the reference model entirely
    epsilon: float = Field(0.2, gt=0)  # lower clip range of the ratio
    epsilon_high: float | None = Field(None, gt=0)  # upper clip range (DAPO's clip-higher); None = epsilon
    # grpo (mean of sequence means), bnpo (token mean per micro-batch), dapo (token mean over the whole batch, DAPO
    # arXiv:2503.14476, TRL's default) or dr_grpo (token sum / (rows x completion budget), Dr. GRPO arXiv:2503.20783)
    loss_type: Literal["grpo", "bnpo", "dapo", "dr_grpo"] = "grpo"
    # ratio per "token", or one per "sequence": exp(mean log-ratio), clipped per sequence (GSPO, arXiv:2507.18071;
    # the paper pairs it with loss_type grpo)
    importance_sampling_level: Literal["token", "sequence"] = "token"
    # truncated importance sampling (Yao et al. 2025): each token's policy term times min(pi_train/pi_sampler, cap),
    # correcting for a sampler whose numbers differ from the trainer's (bf16 copy, vLLM); None = off
    tis_cap: float | None = Field(None, gt=0)
    scale_rewards: Literal["group", "batch", "none"] = "group"  # advantage scaling (none: Dr. GRPO)
    mask_truncated_completions: bool = False  # DAPO's overlong filtering: completions cut off by the budget add no loss


class MemoryConfig(BaseModel):
    """How GRPO's batches go through the model: micro-batches, packing, precision, the weights' dtypes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    micro_batch_size: int = Field(32, ge=1)  # sequences per forward/backward (gradient accumulation inside a step)
    # each micro-batch's rows as one row without padding (grpo.training.packing), the same numbers: "auto" where the
    # model's attention takes packed rows exactly (Qwen2/Llama on SDPA or eager, any model on flash attention)
    packing: bool | Literal["auto"] = "auto"
    # packed micro-batches filled with whole rows to this many tokens (prompt + completion); None = micro_batch_size rows
    max_tokens_per_microbatch: int | None = Field(None, ge=1)
    # recompute each layer in the backward: less memory, one more forward; "auto": on a GPU, off on a CPU
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    mixed_precision: Precision = "auto"  # auto (bf16 where native, else fp32), bf16, fp16 (GPU) or no
    # fp32 linears on a CPU: "auto" times MKL (torch's default path) and oneDNN on the loop's shapes and keeps the
    # faster of each GEMM (grpo.kernels.gemm); "mkl" or "onednn" forces one
    fp32_gemm: Literal["auto", "mkl", "onednn"] = "auto"
    # the frozen reference's weights: "auto" is bf16 on a GPU whose loop runs in bf16 (half its memory), else the
    # policy's dtype
    reference_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # the policy's weights while training: "float32", or "bfloat16" (weights, gradients, reference and sampling in
    # bf16; the optimizer steps fp32 master copies with fp32 state, and the saved model is the fp32 masters)
    weights_dtype: Literal["float32", "bfloat16"] = "float32"

    _budget_needs_packing = budget_needs_packing("fills packed micro-batches", "micro_batch_size rows a micro-batch")


class GradingConfig(BaseModel):
    """How GRPO's completions are graded beyond the reward weights: outcome or process supervision, the code
    reward's settings, an appeal judge, and when the stage stops for rows it could not grade or groups that tie."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # outcome: one reward per completion; process: a reward at the end of every reasoning step, normalised over the
    # group's steps, a token's advantage the sum over the steps that end at or after it (DeepSeekMath 4.1.3)
    supervision: Literal["outcome", "process"] = "outcome"
    # process only: who checks the steps: "arithmetic" (the synthetic task's equations), "gsm8k" (calculator
    # annotations and plain equations, a line a step) or "prm" (a process reward model, at prm_path)
    step_verifier: Literal[STEP_VERIFIERS] | None = None
    prm_path: str | None = None  # step_verifier prm: the process reward model's folder or runs:/ URI
    code: CodeConfig = Field(default_factory=CodeConfig)  # the code reward's settings, read when rewards name code
    # a judge that looks again at the answers the accuracy rule scored 0.0 (grpo.training.appeal): it may only raise
    appeal: JudgeConfig | None = None
    # rows a grader could not grade (a timeout, a sandbox or judge failure, a reward that raised: they train
    # nothing). The stage stops in one line, its steps kept, once more than this share of the rows of the last
    # ungraded_window steps were ungraded (1.0: never stops for it)
    max_ungraded_share: float = Field(0.05, ge=0, le=1)
    ungraded_window: int = Field(10, ge=1)
    # steps in a row whose groups all tie (no reward spread: every advantage 0) before the stage says so in one
    # line; with stop_without_signal it also stops there, its steps kept
    no_signal_steps: int = Field(20, ge=1)
    stop_without_signal: bool = False


def nest_flat_keys(data, moved: dict[str, str] = MOVED_KEYS):
    """A config mapping with each flat key of `moved` put in its section ({"beta": 0} -> {"loss": {"beta": 0}}), so a
    recipe written before the sections loads as it did; anything not a mapping is returned as it is."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    # a name given for the optimizer first: its flat key is the section's own name, which the other keys fill
    for key, value in sorted(data.items(), key=lambda kv: kv[0] != "optimizer"):
        path = moved_path(key, value) if moved is MOVED_KEYS else moved.get(key)
        if path is None:
            continue
        section, field = path.split(".")
        del out[key]
        held = out.get(section)
        held = held.model_dump(exclude_unset=True) if isinstance(held, BaseModel) else dict(held or {})
        if field in held:
            raise ValueError(f"{key} is given twice: flat, and as {path}; keep one (the section: {path})")
        held[field] = value
        out[section] = held
    return out


def _flat_keys_in_schema(schema: dict) -> None:
    """The JSON schema takes the flat keys too (a deployment's saved parameters, a flow run started through the API
    or the UI with a config written before the sections): Prefect's server checks parameters against the schema
    before the model's own before-validator could move them."""
    properties = schema.setdefault("properties", {})
    for flat, path in MOVED_KEYS.items():
        if flat in properties:  # `optimizer`: the section, or the optimizer's name as before
            properties[flat] = {"anyOf": [properties[flat], {"type": "string"}], "title": properties[flat].get(
                "title", flat)}
        else:
            properties[flat] = {"title": flat, "description": f"moved to {path}; still read here", "deprecated": True}


class GRPOConfig(BaseModel):
    """The GRPO loop (names follow TRL's GRPOConfig where they mean the same thing), in sections: `optimizer`,
    `loss`, `memory`, `grading`, `rollout`, `sampling`, `schedule`, `lora`. A flat key of the layout before the
    sections (`beta`, `learning_rate`, `optimizer: adamw_8bit`, ...) is read into its section (MOVED_KEYS), from a
    recipe, `--set`, a sweep's grid or a flow run's parameters (the JSON schema lists them as deprecated)."""

    model_config = ConfigDict(frozen=True, extra="forbid", json_schema_extra=_flat_keys_in_schema)
    moved_keys: ClassVar[dict[str, str]] = MOVED_KEYS  # read by the checks that suggest a misspelt name's meaning

    max_steps: int = Field(200, ge=1)  # optimizer steps (times num_iterations)
    prompts_per_step: int = Field(4, ge=1)  # distinct prompts sampled per step
    num_generations: int = Field(8, ge=2)  # G: completions per prompt (a group of one has no advantage)
    num_iterations: int = Field(1, ge=1)  # mu: optimisation passes per batch of samples
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)  # temperature, completion budget
    rewards: dict[str, float] = Field(default_factory=lambda: {"accuracy": 1.0, "format": 0.5})  # name -> weight
    # each step's prompts by the rows' `kind`: {kind: share of prompts_per_step}, e.g. {general: 0.5} (alignment: R1
    # mixes general and reasoning prompts in every batch); other kinds share the rest. Empty: all rows alike
    prompt_mix: dict[str, Annotated[float, Field(gt=0, le=1)]] = Field(default_factory=dict)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)  # AdamW (or 8-bit) and its schedule
    loss: LossConfig = Field(default_factory=LossConfig)  # KL, clipping, token and reward weighing
    memory: MemoryConfig = Field(default_factory=MemoryConfig)  # micro-batches, packing, precision, dtypes
    grading: GradingConfig = Field(default_factory=GradingConfig)  # outcome or process, code, appeal, stops
    # sync, or async sampler workers (docs/sampling.md); DAPO's dynamic sampling
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    lora: LoRAConfig | None = None  # train LoRA adapters instead of every weight (needs peft); None = full model
    log_every: int = Field(1, ge=1)  # steps between metric callbacks
    samples_every: int = Field(25, ge=0)  # steps between sample-completion tables (0 = none)
    checkpoint_every: int = Field(50, ge=0)  # steps between resumable checkpoints (0 = only the final model)
    seed: int = 0  # prompt order and sampling
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)  # rewards that start late, a reference that moves

    @model_validator(mode="before")
    @classmethod
    def _flat_keys_into_sections(cls, data):
        return nest_flat_keys(data)

    @field_validator("rewards")
    @classmethod
    def _some_rewards(cls, rewards: dict[str, float]) -> dict[str, float]:
        if not rewards:
            raise ValueError("name at least one reward, e.g. {accuracy: 1.0}")
        bad = {k: w for k, w in rewards.items() if not math.isfinite(w)}
        if bad:
            raise ValueError(f"reward weights must be finite numbers, got {bad}")
        return rewards

    @model_validator(mode="after")
    def _process_needs_steps(self) -> "GRPOConfig":
        if sum(self.prompt_mix.values()) > 1 + 1e-9:
            raise ValueError(f"prompt_mix shares add up to more than 1: {self.prompt_mix}")
        if self.rollout.reference == "sampler" and (not self.rollout.asynchronous or self.loss.beta == 0 or self.lora):
            raise ValueError("rollout.reference sampler scores the reference log-probs in the asynchronous workers: "
                             "it needs rollout.mode async, beta > 0 (else there is no KL term to score) and no LoRA "
                             "(whose reference is the policy with its adapters off, which the trainer holds); set "
                             "rollout.reference trainer")
        if self.grading.supervision == "process" and "code" in self.rewards:
            raise ValueError("supervision 'process' cannot be used with the code reward (rewards names code): its "
                             "step verifiers check reasoning steps, and none checks code; set supervision: outcome, "
                             "or take code out of rewards")
        grading = self.grading
        if grading.supervision == "process":
            if grading.step_verifier is None:
                raise ValueError(f"supervision 'process' needs a step_verifier to score the steps: one of "
                                 f"{list(STEP_VERIFIERS)} (arithmetic for the synthetic task, gsm8k for GSM8K-style "
                                 f"solutions)")
            if self.loss.importance_sampling_level != "token":
                raise ValueError("supervision 'process' gives every token its own advantage; it needs "
                                 "importance_sampling_level 'token' (GSPO's one ratio a sequence goes with one "
                                 "advantage a sequence)")
        elif grading.step_verifier is not None or grading.prm_path is not None:
            raise ValueError("step_verifier and prm_path are used only with supervision 'process'; set "
                             "supervision: process, or remove them")
        self.schedule.check(self.rewards, self.max_steps, self.loss.beta,
                            self.lora is None and self.rollout.reference != "sampler")
        if (grading.step_verifier == "prm") != (grading.prm_path is not None):
            raise ValueError("step_verifier 'prm' and prm_path go together: prm_path names the process reward "
                             "model's folder or runs:/ URI")
        return self

    def updated(self, **changes) -> "GRPOConfig":
        """A copy with `changes` set, as `model_copy(update=...)` sets them (unchecked), a section's field by its
        flat name as a recipe gives it (`updated(beta=0.0, packing=True)`) or a top-level field or whole section by
        its own name."""
        top, sections = {}, {}
        for key, value in changes.items():
            path = moved_path(key, value)
            if path is None:
                top[key] = value
            else:
                section, field = path.split(".")
                sections.setdefault(section, {})[field] = value
        for section, fields in sections.items():
            top[section] = getattr(self, section).model_copy(update=fields)
        return self.model_copy(update=top)

    def check_rewards(self, known: set[str]) -> None:
        """Raise if a reward is not among the `known` names (the stage configs know which ones they offer)."""
        unknown = sorted(set(self.rewards) - known)
        if unknown:
            raise ValueError(f"unknown reward(s) {unknown} in grpo.rewards; known here: {sorted(known)}")
