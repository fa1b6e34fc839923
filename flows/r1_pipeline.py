"""The R1 recipe as one flow: each stage is a subflow, each hands the next its MLflow URIs.

    base model -> 1 cold-start SFT -> 2 reasoning GRPO -> 3 rejection sampling -> 4 SFT -> 5 alignment GRPO

One MLflow parent run per pipeline run (tagged with the Prefect flow run), one child run per stage.
Stages not yet built are listed in `grpo.config.STAGES` and skipped here.

Run:  r1 run --recipe tiny
"""

from __future__ import annotations

from prefect import flow, get_run_logger

from flows.cold_start_sft import cold_start_sft
from grpo.config import load_recipe
from tasks import tracking
from tasks.stage import PipelineResult, StageResult, prefect_tags

AVAILABLE_STAGES = ("cold_start_sft",)


@flow(name="r1_pipeline", log_prints=True)
def r1_pipeline(recipe: str = "tiny", stages: list[str] | None = None) -> PipelineResult:
    """Run the recipe's stages in order under one MLflow parent run; return each stage's result."""
    cfg = load_recipe(recipe)  # a bad recipe fails here, before any run is created
    stages = list(stages or AVAILABLE_STAGES)
    unknown = [s for s in stages if s not in AVAILABLE_STAGES]
    if unknown:
        raise ValueError(f"unknown or not yet available stage(s) {unknown}; available: {list(AVAILABLE_STAGES)}")
    parent = tracking.start_run(f"r1_pipeline:{cfg.name}", tags={"recipe": cfg.name, "stages": ",".join(stages),
                                                                  **prefect_tags()})
    tracking.log_params(parent, {"recipe": cfg.name, "stages": ",".join(stages)})
    results: dict[str, StageResult] = {}
    try:
        if "cold_start_sft" in stages:
            results["cold_start_sft"] = cold_start_sft(cfg.cold_start_sft, parent_run_id=parent)
    except BaseException:
        tracking.end_run(parent, "FAILED")
        raise
    tracking.end_run(parent, "FINISHED")
    get_run_logger().info("MLflow pipeline run %s finished: %s", parent,
                          {name: r.metrics for name, r in results.items()})
    return PipelineResult(run_id=parent, stages=results)
