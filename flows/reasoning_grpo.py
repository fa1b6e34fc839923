"""Stage 2, reasoning GRPO: reinforce what the cold-start model sometimes gets right, with rule rewards only.

R1 runs GRPO from the cold-start checkpoint on reasoning prompts with verifiable answers, rewarding answer
correctness and format (and language consistency, to keep the chain of thought readable); no value model, no
neural reward model. Here the prompts are the synthetic task's, or a user dataset's such as GSM8K (its columns and
answer format named in `data`), and the held-out split is scored before and after, so the change RL made is visible
in one MLflow run.

With `algorithm: ppo` the stage runs PPO instead (`grpo.training.loops.ppo_trainer`): the critic-based method GRPO was
made to replace, on the same rewards, sampling and KL, so the two can be compared on one task
(benchmarks/ppo_vs_grpo.py measures their memory and step time). With `algorithm: online_rft` it runs online
rejection-sampling fine-tuning (`grpo.training.rft`): GRPO's sampler, rewards, KL and metrics, each sample trained
with coefficient 1 when correct (`online_rft.correct_reward` at `online_rft.threshold`) and 0 otherwise.

Run alone:  r1 stage reasoning_grpo --checkpoint runs:/<cold-start run id>/checkpoint
"""

from __future__ import annotations

from prefect import flow

from flows.stages import Stage, run_name
from grpo.configs.recipe import ReasoningGRPOConfig
from runtime.report import publish_stage_report
from runtime.stage import StageResult, stage_run
from tasks.data import prepare_data
from tasks.evaluate import evaluate_model
from tasks.grpo import train_grpo_model

NAME = "reasoning_grpo"


# flow runs are named after the stage (`<stage>:<recipe name>` when the pipeline or `r1 stage` runs it)
@flow(name=NAME, flow_run_name=run_name(NAME), log_prints=True)
def reasoning_grpo(checkpoint_uri: str, config: ReasoningGRPOConfig = ReasoningGRPOConfig(),
                   parent_run_id: str | None = None) -> StageResult:
    """GRPO from `checkpoint_uri` (the cold-start model); return the new checkpoint URI and held-out metrics."""
    with stage_run(NAME, config, parent_run_id, inputs={"checkpoint_uri": checkpoint_uri}) as run_id:
        data = prepare_data(run_id, config.data, "rl")
        metrics = {}
        if data.heldout and config.eval_before:
            before = evaluate_model(run_id, checkpoint_uri, config.model, data.heldout, config.eval, step=0,
                                    code=config.grpo.grading.code, generation=config.generation)
            metrics.update({f"{k}_before": v for k, v in before.items()})
        checkpoint = train_grpo_model(run_id, NAME, config.model, checkpoint_uri, data.train, config.grpo,
                                      ppo=config.ppo if config.algorithm == "ppo" else None,
                                      online_rft=config.online_rft if config.algorithm == "online_rft" else None,
                                      distributed=config.distributed,
                                      generation=config.generation)
        if data.heldout:
            metrics.update(evaluate_model(run_id, checkpoint, config.model, data.heldout, config.eval,
                                          step=config.grpo.max_steps, code=config.grpo.grading.code,
                                          generation=config.generation))
    result = StageResult(stage=NAME, run_id=run_id, uris={"checkpoint": checkpoint, "dataset": data.train},
                         metrics=metrics)
    publish_stage_report(result)
    return result


STAGE = Stage(flow=reasoning_grpo,
              inputs={"checkpoint_uri": "cold_start_checkpoint"},
              outputs={"reasoning_checkpoint": "checkpoint"})
