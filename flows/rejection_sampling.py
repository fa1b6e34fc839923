"""Stage 3, rejection sampling: many samples per prompt from the RL model; keep the correct, readable ones.

R1 samples several responses per prompt from the reasoning-RL checkpoint and keeps only correct ones: checked by
rule where the answer is verifiable, by a generative judge (DeepSeek-V3 shown the reference) where it is not; it
drops mixed-language, overlong or code-laden chains of thought, and adds non-reasoning rows (about 600k + 200k).
Here the prompts are cut into shards, one Prefect task each: threads of this process by default, or prefect-ray's
task runner on a Ray cluster (`cluster.ray_address` in the recipe), whose shard tasks read the checkpoint from
MLflow and write to a shared store (`cluster.shard_store`). Each shard writes one Parquet file, and a shard whose
file exists is not sampled again, so a killed run resumes without losing or duplicating a sample. Each shard task
also marks its rows' dedupe keys and which copy a held-out prompt; the merge dedupes across shards, drops the
contaminated rows and caps to the recipe's target from those marks. The plan (`r1 plan`'s figures, for the
recipe's `budget` assumptions) is printed before the first shard and logged after the merge against each shard's
measured time, with the judge's calls per second and per 1,000 kept rows.

Run alone:  r1 stage rejection_sampling --checkpoint runs:/<reasoning_grpo run id>/checkpoint
"""

from __future__ import annotations

from prefect import flow, unmapped
from prefect.logging import get_run_logger

from flows.stages import Stage, run_name
from grpo.configs.recipe import RejectionSamplingConfig
from runtime.cluster import ray_task_runner, shard_gpus
from runtime.report import publish_stage_report
from runtime.stage import StageResult, stage_run
from tasks.data import prepare_data
from tasks.rejection import RejectionPlan, merge_rejection_shards, plan_rejection_sampling, sample_shard

NAME = "rejection_sampling"


@flow(name="rejection_sampling_shards")
def sample_shards(plan: RejectionPlan, config: RejectionSamplingConfig) -> list[dict]:
    """Every shard of the plan on this flow's task runner (a Ray cluster), one shard per node before a second."""
    import ray
    from prefect_ray.context import remote_options

    gpus = shard_gpus(config, [n["Resources"].get("GPU", 0.0) for n in ray.nodes() if n["Alive"]])
    get_run_logger().info("shard tasks ask Ray for %g GPU(s) each", gpus)
    # the Parquet shard is the output: the small return value must not be written to the driver's result storage
    task = sample_shard.with_options(persist_result=False)
    with remote_options(scheduling_strategy="SPREAD", num_gpus=gpus):
        futures = task.map(unmapped(plan), plan.shards, unmapped(config))
    return futures.result()  # raises if any shard failed


# flow runs are named after the stage (`<stage>:<recipe name>` when the pipeline or `r1 stage` runs it)
@flow(name=NAME, flow_run_name=run_name(NAME), log_prints=True)
def rejection_sampling(checkpoint_uri: str, config: RejectionSamplingConfig = RejectionSamplingConfig(),
                       parent_run_id: str | None = None) -> StageResult:
    """Sample from `checkpoint_uri` (the reasoning-RL model); return the curated dataset's URI and the counts."""
    with stage_run(NAME, config, parent_run_id, inputs={"checkpoint_uri": checkpoint_uri}) as run_id:
        data = prepare_data(run_id, config.data, "rl")
        plan = plan_rejection_sampling(run_id, checkpoint_uri, config, data.train, data.heldout)
        if plan.ray_address:
            on_ray = sample_shards.with_options(task_runner=ray_task_runner(plan.ray_address))
            on_ray(plan, config)
        else:
            sample_shard.map(unmapped(plan), plan.shards, unmapped(config)).result()  # raises if any shard failed
        dataset, metrics = merge_rejection_shards(run_id, plan, config, data.heldout)
    uris = {"dataset": dataset, **({"heldout": data.heldout} if data.heldout else {})}
    result = StageResult(stage=NAME, run_id=run_id, uris=uris, metrics=metrics)
    publish_stage_report(result)
    return result


STAGE = Stage(flow=rejection_sampling,
              inputs={"checkpoint_uri": "reasoning_checkpoint"},
              outputs={"curated_dataset": "dataset", "heldout": "heldout"})
