"""The R1 recipe as one flow: each stage is a subflow, each hands the next its MLflow URIs.

    base model -> 1 cold-start SFT -> 2 reasoning GRPO -> 3 rejection sampling -> 4 SFT -> 5 alignment GRPO

One MLflow parent run per pipeline run (tagged with the Prefect flow run), one child run per stage. A stage that is
left out of `stages` takes its inputs from `from_uris` or from an earlier pipeline run (`from_run`), whose parent
run records every URI its stages produced as `uri.<name>` tags. When Prefect retries a failed pipeline run (its
`retries`, or *Retry* in the UI), the retry carries on in the same parent run and skips the stages it records.

Running the same pipeline again (after a crash, a kill, Ctrl-C, or just again) reuses every stage that already
finished with the same config and inputs (runtime/reuse.py), and the interrupted stage resumes from the last checkpoint
in its work folder, which is keyed by its config and inputs; `fresh=True` starts everything over. Runs that a dead
process left RUNNING are marked FAILED when a pipeline starts; Ctrl-C ends the current runs as KILLED.

A stage runs in this flow's process, or, where its recipe section names a work pool (`resources.pool`), as its own
deployment's flow run on that pool with the job variables the section asks for (flows/placement.py): this flow, on a
CPU pool, waits for it and reads its result from MLflow. Pools, workers and deployments are checked before any stage.
A stage that fails, or whose machine is lost, is run again as its `resources.retries` allow (flows/attempts.py).

`overrides` change any of the recipe's fields for this run without a new recipe file (dotted paths to values, such as
{"reasoning_grpo.grpo.optimizer.learning_rate": 2e-5}); they are checked like the recipe before anything starts and
recorded on the parent run as `override.<path>` params and tags. Flow runs are named after the recipe
(`r1-<recipe name>`) and each stage's after the stage and the recipe (`reasoning_grpo:<recipe name>`).

Run:  r1 run --recipe tiny [--set reasoning_grpo.grpo.optimizer.learning_rate=2e-5]
      (or: r1 run --stages sft,alignment_grpo --from-run <pipeline run id>)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from flows.attempts import run_stage
from flows.placement import check_placement
from flows.stages import Stage, declared, finished_stages, missing_inputs
from grpo import startup
from grpo.configs.recipe import STAGES, Recipe, RecipeError, apply_overrides, load_recipe
from grpo.configs.rejection import ClusterConfig
from grpo.interrupts import is_interrupt
from runtime import reuse, tracking
from runtime.stage import FRESH, PipelineResult, StageResult, earlier_attempt_run, prefect_tags
from tasks.reuse import reuse_stage


def with_cluster(cfg: Recipe, ray_address: str | None, shard_store: str | None) -> Recipe:
    """The recipe with rejection sampling's cluster settings replaced where given (checked like a recipe's)."""
    stage = cfg.rejection_sampling
    given = {k: v for k, v in {"ray_address": ray_address, "shard_store": shard_store}.items() if v}
    cluster = ClusterConfig.model_validate({**stage.cluster.model_dump(), **given})
    return cfg.model_copy(update={"rejection_sampling": stage.model_copy(update={"cluster": cluster})})


def recipe_name(recipe: str) -> str:
    """The `name` a recipe (by name or YAML path) gives itself; its file's stem if it cannot be read."""
    try:
        return load_recipe(recipe).name
    except RecipeError:  # the flow body reports the recipe's error; naming the flow run must not fail first
        return Path(recipe).stem


def pipeline_run_name() -> str:
    """`r1-<recipe name>`, the pipeline's flow run name (read from the run's own parameters)."""
    startup.imports_done()  # a flow-run process's start-up ends as its run starts (flows/__init__.py)
    return f"r1-{recipe_name(str(flow_run.parameters.get('recipe', 'tiny')))}"


@flow(name="r1_pipeline", flow_run_name=pipeline_run_name, log_prints=True)
def r1_pipeline(recipe: str = "tiny", stages: list[str] | None = None, from_uris: dict[str, str] | None = None,
                from_run: str | None = None, fresh: bool = False, ray_address: str | None = None,
                shard_store: str | None = None, overrides: dict[str, Any] | None = None,
                sweep: dict[str, str] | None = None) -> PipelineResult:
    """Run the recipe's stages in order under one MLflow parent run; return each stage's result.

    A stage that finished before with the same config and inputs is reused, not run again, unless `fresh`.
    `ray_address` and `shard_store` (a deployment's cluster) override the recipe's `rejection_sampling.cluster`.
    `overrides` set any of the recipe's fields by dotted path, e.g. {"cold_start_sft.train.max_steps": 50}.
    `sweep` is a sweep point's tags (flows/sweep.py): the parent run is nested under the sweep's run.
    """
    cfg = apply_overrides(load_recipe(recipe), overrides)  # a bad recipe or override fails here, before any run
    if ray_address or shard_store:
        cfg = with_cluster(cfg, ray_address, shard_store)
    unknown = sorted(set(stages or []) - set(STAGES))  # a misspelt stage must not be skipped silently
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; available: {list(STAGES)}")
    stages = [s for s in STAGES if s in (stages or STAGES)]  # always in the recipe's order
    uris = {**(tracking.pipeline_uris(from_run) if from_run else {}), **(from_uris or {})}
    missing = missing_inputs(stages, uris)
    if missing:
        raise ValueError("missing inputs: " + ", ".join(f"{s} needs {u}" for s, u in missing) +
                         "; run the stage that makes them, or pass from_run=<pipeline run id> or from_uris")
    check_placement(cfg, stages)  # placed stages: their pools, workers and deployments, before anything starts

    ended = tracking.end_dead_runs()  # what a killed earlier run left RUNNING
    if ended:
        get_run_logger().info("marked FAILED %d run(s) whose process had ended: %s", len(ended), ", ".join(ended))
    parent = earlier_attempt_run()  # a Prefect retry of this flow run carries on in its first attempt's run
    attempt = flow_run.run_count if parent else 1
    if parent:
        tracking.reopen_run(parent)
        if fresh:  # this run's own checkpoints are no earlier run's: a retry of a fresh run resumes from them
            tracking.set_tags(parent, {FRESH: "retried"})
    else:
        recorded = {f"override.{path}": str(value) for path, value in (overrides or {}).items()}
        parent = tracking.start_run(f"r1_pipeline:{cfg.name}", tags={"recipe": cfg.name, "stages": ",".join(stages),
                                                                      **({"from_run": from_run} if from_run else {}),
                                                                      **({FRESH: "true"} if fresh else {}),
                                                                      **recorded, **prefect_tags(), **(sweep or {})})
        tracking.log_params(parent, {"recipe": cfg.name, "stages": ",".join(stages),
                                     **({"from_run": from_run} if from_run else {}),
                                     **{f"from.{k}": v for k, v in uris.items()}, **recorded})
    results: dict[str, StageResult] = {}

    def done(result: StageResult, record: bool = True) -> None:  # record the stage on the parent once it finishes
        results[result.stage] = result
        new = {name: result.uris[key] for name, key in declared()[result.stage].outputs.items() if key in result.uris}
        uris.update(new)
        if record:  # its URIs, and its headline numbers for comparing runs
            tracking.set_tags(parent, {f"uri.{k}": v for k, v in new.items()})
            tracking.MetricsLogger(parent)(0, {f"{result.stage}/{k}": v for k, v in result.metrics.items()})

    earlier = finished_stages(parent) if attempt > 1 else {}  # what an earlier attempt of this flow run finished
    for result in earlier.values():
        if result.stage in stages:
            done(result, record=False)
    if attempt > 1:
        get_run_logger().info("attempt %d of this flow run, carrying on in MLflow run %s; skipping finished stages: "
                              "%s", attempt, parent, ", ".join(results) or "none")
    todo = [s for s in stages if s not in results]

    def run(stage: Stage, config, **inputs: str | None) -> StageResult:  # or reuse a finished run of the same stage
        inputs = {k: v for k, v in inputs.items() if v is not None}
        key = reuse.stage_key(stage.name, config, inputs)
        finished = None if fresh else reuse.find_finished(key)
        if finished is not None:
            return reuse_stage(stage.name, config, inputs, key, finished.info.run_id, parent)
        result = run_stage(stage, config, parent, inputs, cfg.name, get_run_logger())  # in process or on its pool
        reuse.record_finished(result, key)
        return result

    try:
        for name in todo:  # in the recipe's order, each from the URIs the stages before it made
            stage = declared()[name]
            done(run(stage, getattr(cfg, name), **{param: uris.get(uri) for param, uri in stage.inputs.items()}))
    except BaseException as e:
        tracking.end_run_if_room(parent, "KILLED" if is_interrupt(e) else "FAILED")
        raise
    tracking.end_run(parent, "FINISHED")
    get_run_logger().info("MLflow pipeline run %s finished", parent)
    return PipelineResult(run_id=parent, stages=results)
