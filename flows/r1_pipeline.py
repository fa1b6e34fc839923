"""The R1 recipe as one flow: each stage is a subflow, each hands the next its MLflow URIs.

    base model -> 1 cold-start SFT -> 2 reasoning GRPO -> 3 rejection sampling -> 4 SFT -> 5 alignment GRPO

One MLflow parent run per pipeline run (tagged with the Prefect flow run), one child run per stage. A stage that is
left out of `stages` takes its input from `from_uris` (for example an earlier run's cold-start checkpoint).

Run:  r1 run --recipe tiny
"""

from __future__ import annotations

from prefect import flow, get_run_logger

from flows.cold_start_sft import cold_start_sft
from flows.reasoning_grpo import reasoning_grpo
from grpo.config import load_recipe
from tasks import tracking
from tasks.stage import PipelineResult, StageResult, prefect_tags

AVAILABLE_STAGES = ("cold_start_sft", "reasoning_grpo")


@flow(name="r1_pipeline", log_prints=True)
def r1_pipeline(recipe: str = "tiny", stages: list[str] | None = None,
                from_uris: dict[str, str] | None = None) -> PipelineResult:
    """Run the recipe's stages in order under one MLflow parent run; return each stage's result."""
    cfg = load_recipe(recipe)  # a bad recipe fails here, before any run is created
    stages = list(stages or AVAILABLE_STAGES)
    unknown = [s for s in stages if s not in AVAILABLE_STAGES]
    if unknown:
        raise ValueError(f"unknown or not yet available stage(s) {unknown}; available: {list(AVAILABLE_STAGES)}")
    uris = dict(from_uris or {})  # e.g. {"cold_start_checkpoint": "runs:/<id>/checkpoint"}
    if "reasoning_grpo" in stages and "cold_start_sft" not in stages and "cold_start_checkpoint" not in uris:
        raise ValueError("reasoning_grpo without cold_start_sft needs from_uris['cold_start_checkpoint']")

    parent = tracking.start_run(f"r1_pipeline:{cfg.name}", tags={"recipe": cfg.name, "stages": ",".join(stages),
                                                                  **prefect_tags()})
    tracking.log_params(parent, {"recipe": cfg.name, "stages": ",".join(stages),
                                 **{f"from.{k}": v for k, v in uris.items()}})
    results: dict[str, StageResult] = {}
    try:
        if "cold_start_sft" in stages:
            results["cold_start_sft"] = cold_start_sft(cfg.cold_start_sft, parent_run_id=parent)
            uris["cold_start_checkpoint"] = results["cold_start_sft"].uris["checkpoint"]
        if "reasoning_grpo" in stages:
            results["reasoning_grpo"] = reasoning_grpo(uris["cold_start_checkpoint"], cfg.reasoning_grpo,
                                                       parent_run_id=parent)
            uris["reasoning_checkpoint"] = results["reasoning_grpo"].uris["checkpoint"]
    except BaseException:
        tracking.end_run(parent, "FAILED")
        raise
    for name, r in results.items():  # the headline numbers of every stage on the parent, for comparing runs
        tracking.MetricsLogger(parent)(0, {f"{name}/{k}": v for k, v in r.metrics.items()})
    tracking.end_run(parent, "FINISHED")
    get_run_logger().info("MLflow pipeline run %s finished", parent)
    return PipelineResult(run_id=parent, stages=results)
