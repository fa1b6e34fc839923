"""Stage 1, cold-start SFT: teach the base model the `<think>...</think><answer>...</answer>` shape.

R1 fine-tunes DeepSeek-V3-Base on thousands of long, readable chain-of-thought examples before any RL, so that RL
starts from a model that already answers in a readable, parseable form. Here the rows are the synthetic task's
worked solutions (or a user dataset with `prompt` and `response` columns), and the held-out split measures what
the model learned.

Run alone:  r1 stage cold_start_sft   (or deploy `cold_start_sft` and start it from the Prefect UI)
"""

from __future__ import annotations

from prefect import flow

from flows.stages import Stage, run_name
from grpo.configs.recipe import ColdStartSFTConfig
from runtime.report import publish_stage_report
from runtime.stage import StageResult, stage_run
from tasks.data import prepare_data
from tasks.evaluate import evaluate_model
from tasks.sft import train_sft_model

NAME = "cold_start_sft"


# flow runs are named after the stage (`<stage>:<recipe name>` when the pipeline or `r1 stage` runs it)
@flow(name=NAME, flow_run_name=run_name(NAME), log_prints=True)
def cold_start_sft(config: ColdStartSFTConfig = ColdStartSFTConfig(), parent_run_id: str | None = None) -> StageResult:
    """Fine-tune the base model on chain-of-thought rows; return the checkpoint URI and held-out metrics."""
    with stage_run(NAME, config, parent_run_id) as run_id:
        data = prepare_data(run_id, config.data, "sft")
        checkpoint = train_sft_model(run_id, NAME, config.model, data.train, config.train,
                                     config.distributed)
        metrics = {}
        if data.heldout:
            metrics = evaluate_model(run_id, checkpoint, config.model, data.heldout, config.eval,
                                     step=config.train.max_steps, generation=config.generation)
    result = StageResult(stage=NAME, run_id=run_id, uris={"checkpoint": checkpoint, "dataset": data.train},
                         metrics=metrics)
    publish_stage_report(result)
    return result


STAGE = Stage(flow=cold_start_sft,
              inputs={},
              outputs={"cold_start_checkpoint": "checkpoint", "cold_start_dataset": "dataset"})
