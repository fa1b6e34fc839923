"""Stage 4, SFT on curated data: fine-tune the base model again, now on what rejection sampling kept.

R1 fine-tunes DeepSeek-V3-Base (not the RL model) for two epochs on about 800k rows: reasoning samples kept by
rejection sampling plus non-reasoning data. Here the rows are the curated dataset of stage 3; a recipe whose
curated set is small can also mix the cold-start rows back in (`include_cold_start`).

Run alone:  r1 stage sft --dataset runs:/<rejection_sampling run id>/dataset/curated
"""

from __future__ import annotations

from prefect import flow

from flows.stages import Stage, run_name
from grpo.configs.recipe import SFTStageConfig
from runtime.report import publish_stage_report
from runtime.stage import StageResult, stage_run
from tasks.evaluate import evaluate_model
from tasks.sft import prepare_sft_mix, train_sft_model

NAME = "sft"


# flow runs are named after the stage (`<stage>:<recipe name>` when the pipeline or `r1 stage` runs it)
@flow(name=NAME, flow_run_name=run_name(NAME), log_prints=True)
def sft(dataset_uri: str, config: SFTStageConfig = SFTStageConfig(), heldout_uri: str | None = None,
        cold_start_dataset_uri: str | None = None, parent_run_id: str | None = None) -> StageResult:
    """Fine-tune the base model on `dataset_uri`; return the checkpoint URI and held-out metrics."""
    if config.include_cold_start and not cold_start_dataset_uri:
        raise ValueError("sft: include_cold_start is set but no cold_start_dataset_uri was given")
    inputs = {"dataset_uri": dataset_uri, **({"heldout_uri": heldout_uri} if heldout_uri else {}),
              **({"cold_start_dataset_uri": cold_start_dataset_uri} if config.include_cold_start else {})}
    with stage_run(NAME, config, parent_run_id, inputs=inputs) as run_id:
        train = prepare_sft_mix(run_id, dataset_uri, cold_start_dataset_uri if config.include_cold_start else None)
        checkpoint = train_sft_model(run_id, NAME, config.model, train, config.train, config.distributed)
        metrics = {}
        if heldout_uri:
            metrics = evaluate_model(run_id, checkpoint, config.model, heldout_uri, config.eval,
                                     step=config.train.max_steps, generation=config.generation)
    # the rows it trained on, read where the earlier stages logged them (no copy of the curated dataset)
    uris = {"checkpoint": checkpoint, "dataset": train[0],
            **({"cold_start_dataset": train[1]} if len(train) > 1 else {}),
            **({"heldout": heldout_uri} if heldout_uri else {})}
    result = StageResult(stage=NAME, run_id=run_id, uris=uris, metrics=metrics)
    publish_stage_report(result)
    return result


STAGE = Stage(flow=sft,
              inputs={"dataset_uri": "curated_dataset", "heldout_uri": "heldout",
                      "cold_start_dataset_uri": "cold_start_dataset"},
              outputs={"sft_checkpoint": "checkpoint"},
              optional=frozenset({"heldout", "cold_start_dataset"}),
              needed_when={"cold_start_dataset": "include_cold_start"})
