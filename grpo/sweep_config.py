"""A recipe's `sweep:` section: what `r1 sweep` varies (grpo/sweep.py expands it into points).

    sweep:
      grid:
        reasoning_grpo.grpo.beta: [0, 0.04]
        alignment_grpo.algorithm: [grpo, dpo]
      seeds: 3
      seed_stages: [reasoning_grpo, rejection_sampling, sft, alignment_grpo]   # default: every stage the sweep runs

Must not depend on torch, Prefect or MLflow.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

STAGE_NAMES = ("cold_start_sft", "reasoning_grpo", "rejection_sampling", "sft", "alignment_grpo")


class SweepConfig(BaseModel):
    """A recipe's `sweep:` section (the flags of `r1 sweep` fill the same fields)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    grid: dict[str, list[Any]] = Field(default_factory=dict)  # dotted recipe path -> the values it takes
    seeds: int = Field(1, ge=1)  # seeds 0..seeds-1 per setting
    seed_stages: list[str] | None = None  # the stages whose training seeds a seed changes; None: all the sweep runs
    stages: list[str] | None = None  # the stages each point runs; None: all five

    @field_validator("seed_stages", "stages")
    @classmethod
    def _known_stages(cls, stages: list[str] | None) -> list[str] | None:
        unknown = [s for s in stages or [] if s not in STAGE_NAMES]
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown}; expected some of {list(STAGE_NAMES)}")
        return stages
