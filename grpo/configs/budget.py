"""The rejection-sampling stage's plan: the assumptions it sizes the stage with (grpo.rejection.budget)."""

from pydantic import BaseModel, ConfigDict, Field


class BudgetConfig(BaseModel):
    """The plan the stage prints before sampling and logs against the measured time of each shard (`r1 plan`'s
    assumptions; grpo.rejection.budget has the arithmetic)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # completion tokens a second per generator; None: measured before sampling by a short real generation (the
    # checkpoint in this process, or the recipe's endpoints); on a Ray cluster sampling locally, give it or the plan
    # has no times
    tokens_per_s: float | None = Field(None, gt=0)
    # mean completion length over max_new_tokens; None: what the throughput probe's completions came to where it
    # sampled at the stage's own budget, else 0.5 (a model's lengths differ by far more than any default guesses)
    mean_fraction: float | None = Field(None, gt=0, le=1)
    keep_rate: float = Field(0.5, ge=0, le=1)  # assumed share of samples that pass every check
    generators: int | None = Field(None, ge=1)  # servers or GPUs sampling at once; None: the endpoints, else 1
