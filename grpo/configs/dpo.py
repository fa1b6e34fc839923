"""DPO's settings, for running the alignment stage by direct preference optimisation on its preference pairs instead
of a reward model and GRPO (`alignment_grpo.algorithm: dpo`).

DPO (Rafailov et al. 2023) trains the policy on (prompt, chosen, rejected) pairs directly, against a frozen
reference (the stage's starting checkpoint): no reward model, no sampling. The loss and the loop are
`grpo.training.loops.dpo`; the pairs are the stage's `preferences` section, the same ones the reward model would learn.

Plain pydantic: must not import torch (a recipe is checked without it).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from grpo.configs.checks import Precision
from grpo.configs.lora import LoRAConfig
from grpo.configs.training import LR_SCHEDULERS


class DPOConfig(BaseModel):
    """The DPO loop (names follow TRL's DPOConfig where they mean the same thing)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # how far from the reference the policy may go: the implicit reward is beta x log(pi / pi_ref) (DPO's beta; the
    # IPO loss's tau). Small: far; large: near
    beta: float = Field(0.1, gt=0)
    # "sigmoid": DPO's -log sigmoid(beta x margin); "ipo": IPO's (margin - 1/(2 beta))^2 (Azar et al. 2023), which
    # stops pushing once the margin reaches its target instead of driving it to infinity on pairs it already ranks
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    max_steps: int = Field(100, ge=1)  # optimizer steps
    batch_size: int = Field(16, ge=1)  # pairs per micro-batch (two sequences each), split across the processes
    grad_accum_steps: int = Field(1, ge=1)  # micro-batches per optimizer step
    learning_rate: float = Field(1e-4, gt=0)  # AdamW learning rate (real models ~5e-7 to 5e-6)
    lr_scheduler: Literal[LR_SCHEDULERS] = "cosine"  # a transformers scheduler name
    warmup_steps: int = Field(5, ge=0)  # linear warmup
    weight_decay: float = Field(0.0, ge=0)  # AdamW weight decay
    max_grad_norm: float = Field(1.0, gt=0)  # gradient clipping
    max_seq_len: int = Field(256, ge=2)  # prompt + response tokens; a longer pair fails before training
    mixed_precision: Precision = "auto"  # auto (bf16 where native, else fp32), bf16, fp16 (GPU) or no
    gradient_checkpointing: bool = False  # trade compute for memory on real models
    # each micro-batch's pairs as one row without padding (grpo.training.packing), the same numbers: "auto" where the
    # model's attention takes packed rows exactly (Qwen2/Llama on SDPA or eager on CPU, any model on flash attention)
    packing: bool | Literal["auto"] = "auto"
    lora: LoRAConfig | None = None  # train LoRA adapters (needs peft); the reference is then the adapters off
    eval_fraction: float = Field(0.1, ge=0, lt=1)  # share of prompts held out when the pairs come without held-out
    eval_batch_size: int = Field(32, ge=1)  # pairs per held-out scoring batch
    checkpoint_every: int = Field(50, ge=0)  # steps between resumable checkpoints (0 = only the final model)
    keep_checkpoints: int = Field(2, ge=1)  # resumable checkpoints kept on disk (two: a damaged newest falls back)
    log_every: int = Field(10, ge=1)  # steps between metric callbacks
    seed: int = 0  # pair order
