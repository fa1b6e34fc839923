"""A recipe's `sweep:` section: what `r1 sweep` varies (grpo/sweep.py expands it into points).

    sweep:
      grid:
        reasoning_grpo.grpo.loss.beta: [0, 0.04]
        alignment_grpo.algorithm: [grpo, dpo]
      seeds: 3
      seed_stages: [reasoning_grpo, rejection_sampling, sft, alignment_grpo]   # default: every stage the sweep runs

or named variants, each a set of settings (and, with `stages:`, the stages it runs), crossed with any grid:

    sweep:
      variants:
        grpo: {}
        online_rft: {reasoning_grpo.algorithm: online_rft}
        ppo: {reasoning_grpo.algorithm: ppo, stages: [cold_start_sft, reasoning_grpo]}

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
    # name -> {dotted recipe path: value, ...; `stages`: the stages the variant's points run (default: `stages`)}
    variants: dict[str, dict[str, Any]] = Field(default_factory=dict)
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

    @field_validator("variants")
    @classmethod
    def _variant_stages(cls, variants: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for name, settings in variants.items():
            if not isinstance(settings, dict):
                raise ValueError(f"variant {name!r}: expected a mapping of recipe paths to values, got {settings!r}")
            stages = settings.get("stages")
            if stages is not None:
                if not isinstance(stages, list) or not stages:
                    raise ValueError(f"variant {name!r}: stages: expected a list of stages, got {stages!r}")
                cls._known_stages([str(s) for s in stages])
        return variants
