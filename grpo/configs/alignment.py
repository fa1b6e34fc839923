"""The alignment stage's evaluation settings: which general prompts measure it, before and after, and the watch on
its true score while it trains.

Plain pydantic: must not import torch (a recipe is checked without it).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class AlignmentEvalConfig(BaseModel):
    """Harmful refused, benign helpful, borderline over-refusal and the share handled right, before -> after on the
    same prompts with a paired 95% interval over distinct requests (grpo.evaluate.evaluate_alignment,
    grpo.stats.paired_change)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # "synthetic": the generator's held-out phrasings (the headline) and held-out subjects (reported apart); or a
    # file of the user's (JSONL, JSON, Parquet, CSV: prompt, category harmful/benign/borderline, optional reference
    # and request: rows sharing one count once in the intervals)
    source: str = "synthetic"
    per_category: int = Field(20, ge=0)  # synthetic: prompts of each category (0: the whole split)
    heldout_subjects: bool = True  # synthetic: also measure subjects never trained on (alignment_subjects/...)
    # synthetic: also measure 50 requests written unlike the training ones, other kinds of harm and other lengths
    # (grpo.data.unlike_requests: alignment_unlike/...)
    unlike_training: bool = True
    max_new_tokens: int | None = Field(None, ge=1)  # greedy completion budget; None: the stage's eval section's
    enabled: bool = True  # false: no alignment evaluation


class AlignmentWatchConfig(BaseModel):
    """The true score of the general prompts' samples beside the reward models' score while GRPO runs, and a line
    when one falls while the other rises (grpo.training.alignment_watch): needs the prompts' `category`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True  # on where the general prompts carry a category (the synthetic ones do)
    every: int = Field(5, ge=1)  # steps a window: its means are logged as watch/true_score and watch/rm_score
    windows: int = Field(3, ge=1)  # windows in a row of a falling true score under a rising reward: over-optimisation
    stop: bool = False  # also stop the stage there (its steps kept)
