"""One frozen config object per stage, and the recipe that holds them all.

Each stage config is at once the stage flow's Prefect parameter (the UI renders it as a form), a section of a
recipe YAML file, and the params logged on the stage's MLflow run. Defaults are the `tiny` recipe's values.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from grpo.data import DataConfig
from grpo.evaluate import EvalConfig
from grpo.judge import JudgeConfig
from grpo.models import ModelConfig
from grpo.preferences import PreferenceDataConfig
from grpo.rejection import RejectionConfig
from grpo.reward_model import RewardModelConfig
from grpo.sft import SFTConfig
from grpo.trainer import GRPOConfig

STAGES = ("cold_start_sft", "reasoning_grpo", "rejection_sampling", "sft", "alignment_grpo")


class ColdStartSFTConfig(BaseModel):
    """Stage 1: supervised fine-tuning of the base model on a few thousand chain-of-thought rows."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelConfig = Field(default_factory=ModelConfig)  # the base model
    data: DataConfig = Field(default_factory=DataConfig)  # the cold-start rows (prompt, response)
    train: SFTConfig = Field(default_factory=SFTConfig)  # the training loop
    eval: EvalConfig = Field(default_factory=EvalConfig)  # held-out evaluation after training


class ReasoningGRPOConfig(BaseModel):
    """Stage 2: GRPO from the cold-start checkpoint with rule rewards (accuracy, format, language)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelConfig = Field(default_factory=ModelConfig)  # loading options; the weights come from the checkpoint
    data: DataConfig = Field(default_factory=DataConfig)  # prompts with reference answers (prompt, answer)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)  # the GRPO loop and its rewards
    eval: EvalConfig = Field(default_factory=EvalConfig)  # held-out evaluation
    eval_before: bool = True  # also score the starting checkpoint (step 0), so the run shows what RL changed


class RejectionSamplingConfig(BaseModel):
    """Stage 3: many samples per prompt from the reasoning-RL checkpoint; keep the correct, readable ones."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelConfig = Field(default_factory=ModelConfig)  # loading options; the weights come from the checkpoint
    data: DataConfig = Field(default_factory=DataConfig)  # prompts (answer where verifiable); held-out for decontam.
    rejection: RejectionConfig = Field(default_factory=RejectionConfig)  # samples, filters, shards, target
    # who checks rows the rule cannot (and, with judge_when="always", every row); None = rule check only.
    # model "checkpoint" = the checkpoint being sampled, asked in the judge prompt
    judge: JudgeConfig | None = None
    non_reasoning_source: str = "synthetic"  # rows (prompt, response) added as non-reasoning data: "synthetic"
    #                                          (generated general requests) or a file/dataset read like `data`


class SFTStageConfig(BaseModel):
    """Stage 4: SFT of the base model (not the RL model) on the curated rows."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelConfig = Field(default_factory=ModelConfig)  # the base model, as in stage 1
    train: SFTConfig = Field(default_factory=SFTConfig)  # the training loop
    eval: EvalConfig = Field(default_factory=EvalConfig)  # held-out evaluation after training
    # also train on the cold-start rows (R1 reuses parts of DeepSeek-V3's SFT data; a recipe whose curated set is
    # small keeps what stage 1 taught this way)
    include_cold_start: bool = False


class AlignmentGRPOConfig(BaseModel):
    """Stage 5: GRPO for helpfulness and harmlessness (a reward model) on a mix that keeps reasoning prompts."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelConfig = Field(default_factory=ModelConfig)  # loading options; the weights come from the checkpoint
    data: DataConfig = Field(default_factory=DataConfig)  # reasoning prompts with answers: rule rewards
    general_prompts: int = 200  # general (non-reasoning) prompts mixed in: scored by the reward model
    general_source: str = "synthetic"  # "synthetic" (generated requests, some harmful) or a file with `prompt`
    preferences: PreferenceDataConfig = Field(default_factory=PreferenceDataConfig)  # pairs the reward model learns
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig)  # trained in this stage...
    reward_model_uri: str | None = None  # ...unless this names an existing one (folder, runs:/ URI or hub name)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)  # rewards by name; "reward_model" is the trained scorer
    eval: EvalConfig = Field(default_factory=EvalConfig)  # held-out reasoning evaluation
    eval_before: bool = True  # also score the starting checkpoint, so the run shows what alignment cost or gained
    registered_model: str = "r1-tiny"  # MLflow registry name the final model is registered under
    alias: str = "champion"  # registry alias pointed at the new version (models:/<name>@<alias>)


class Recipe(BaseModel):
    """A whole pipeline's settings: one section per stage."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = "tiny"  # shown in MLflow as the pipeline run's `recipe` tag
    description: str = ""  # one line for people
    cold_start_sft: ColdStartSFTConfig = Field(default_factory=ColdStartSFTConfig)
    reasoning_grpo: ReasoningGRPOConfig = Field(default_factory=ReasoningGRPOConfig)
    rejection_sampling: RejectionSamplingConfig = Field(default_factory=RejectionSamplingConfig)
    sft: SFTStageConfig = Field(default_factory=SFTStageConfig)
    alignment_grpo: AlignmentGRPOConfig = Field(default_factory=AlignmentGRPOConfig)


RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"


class RecipeError(ValueError):
    """A recipe file that cannot be used, naming the file and the field."""


def load_recipe(name_or_path: str | Path) -> Recipe:
    """A recipe by name (`recipes/<name>.yaml`) or by path; unknown or mistyped fields fail here, naming them."""
    path = Path(name_or_path)
    if not path.suffix:
        path = RECIPES_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
        raise RecipeError(f"no recipe {str(name_or_path)!r} (looked for {path}); known recipes: {known}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML: {e}") from None
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise RecipeError(f"{path}: {problems}") from None
