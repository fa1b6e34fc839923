"""The alignment stage's reward-model settings: training it on preference pairs (and refreshing it on the policy's
samples), and where the pairs come from.

Plain pydantic: must not import torch (a recipe is checked without it).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from grpo.configs.checks import Precision
from grpo.configs.grading import REWARD_MODEL
from grpo.configs.model import ModelConfig
from grpo.configs.training import LR_SCHEDULERS

# R1's two reward models: helpfulness scores benign and borderline prompts on the final answer only, harmlessness
# harmful ones on the whole response (grpo.training.reward_scorer.ROUTES); a recipe names REWARD_MODEL or these two
HELPFULNESS, HARMLESSNESS = "helpfulness", "harmlessness"
REWARD_MODELS = (REWARD_MODEL, HELPFULNESS, HARMLESSNESS)


class RewardModelConfig(BaseModel):
    """Training the reward model on (prompt, chosen, rejected) pairs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelConfig = Field(default_factory=ModelConfig)  # backbone: "tiny", or a folder (R1: the policy's)
    # the alignment stage's reward models start from the stage's own starting checkpoint (the SFT policy, as
    # InstructGPT and R1 start theirs) instead of `model`: a backbone that already knows the subjects can tell an
    # off-topic answer from the right one
    from_policy: bool = False
    # what the helpfulness reward model reads of a response, in training and in scoring: "answer", the final answer
    # alone (R1's "final summary"), or "response", the reasoning too (where the answer does not restate what was
    # asked, as the tiny recipe's do not, an off-topic answer is seen only there)
    helpfulness_reads: Literal["answer", "response"] = "answer"
    max_steps: int = Field(150, ge=1)  # optimizer steps
    batch_size: int = Field(16, ge=1)  # pairs per micro-batch (two sequences each)
    grad_accum_steps: int = Field(1, ge=1)  # micro-batches per optimizer step
    learning_rate: float = Field(1e-3, gt=0)  # peak rate (a from-scratch tiny model takes a large one; real ~1e-5)
    lr_scheduler: Literal[LR_SCHEDULERS] = "cosine"  # a transformers scheduler name
    warmup_steps: int = Field(10, ge=0)  # linear warmup
    weight_decay: float = Field(0.0, ge=0)  # AdamW weight decay
    max_grad_norm: float = Field(1.0, gt=0)  # gradient clipping
    max_seq_len: int = Field(256, ge=2)  # prompt + response tokens; a longer training pair fails before training
    eval_fraction: float = Field(0.1, ge=0, lt=1)  # share of prompts held out when no held-out pairs are given
    eval_batch_size: int = Field(64, ge=1)  # sequences per scoring batch
    mixed_precision: Precision = "auto"  # auto (bf16 where native, else fp32), bf16, fp16 (GPU) or no
    gradient_checkpointing: bool = False  # trade compute for memory on real models
    # each micro-batch's sequences as one row without padding (grpo.training.packing), the same scores, in the reward
    # model's loop, its refreshes and the PRM's: "auto" where the model's attention takes packed rows exactly
    # (Qwen2/Llama on SDPA or eager on CPU, any on flash)
    packing: bool | Literal["auto"] = "auto"
    log_every: int = Field(10, ge=1)  # steps between metric callbacks
    seed: int = 0  # head initialisation and data order
    # the iterative reward model (DeepSeekMath's iterative RL; off at 0): every `refresh_every` alignment GRPO steps
    # the reward model trains `refresh_steps` more steps on pairs from the policy's samples since the last refresh
    # (grpo.training.loops.rm_refresh says how they are ranked), `refresh_replay` of each batch drawn from the
    # preference pairs it was first trained on
    refresh_every: int = Field(0, ge=0)
    refresh_steps: int = Field(8, ge=1)  # optimizer steps a refresh, of `batch_size` pairs each
    refresh_replay: float = Field(0.1, ge=0, le=1)  # share of a refresh batch from the original pairs (paper: 10%)
    refresh_min_margin: float = Field(0.5, ge=0)  # a pair ranked by the reward model itself needs this score gap
    refresh_learning_rate: float | None = Field(None, gt=0)  # None: learning_rate


class PreferenceDataConfig(BaseModel):
    """Where the reward model's pairs come from: the synthetic set, or a user dataset."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: str = "synthetic"  # "synthetic", a .jsonl/.json/.parquet/.csv file, a saved `datasets` folder, or a hub name
    split: str = "train"  # split to read from a hub dataset or a DatasetDict folder
    num_train: int = Field(1000, ge=0)  # synthetic pairs to draw (or the most pairs to read from a user dataset; 0 = all)
    num_heldout: int = Field(200, ge=0)  # synthetic held-out pairs; a user dataset's are carved out by the trainer
    seed: int = 0  # the same seed draws the same training pairs (the held-out draw never changes)
