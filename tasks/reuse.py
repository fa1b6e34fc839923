"""Reusing a stage that already finished with the same config and inputs: the task that records the reuse.

The key that finds such a run, and the tags it is recorded with, are `runtime/reuse.py`'s.
"""

from __future__ import annotations

from prefect import task
from prefect.logging import get_run_logger
from pydantic import BaseModel

from runtime import tracking
from runtime.reuse import REUSED_FROM, record_finished
from runtime.stage import StageResult, read_result, stage_run


@task(name="reuse_stage", task_run_name="reuse {stage}")
def reuse_stage(stage: str, config: BaseModel, inputs: dict[str, str], key: str, earlier_run_id: str,
                parent_run_id: str) -> StageResult:
    """Record an earlier run's result as this pipeline's stage: a child run with the same config, inputs, URIs and
    headline metrics, tagged `r1.reused_from` with the run that did the work."""
    earlier = tracking.client().get_run(earlier_run_id)
    source = earlier.data.tags.get(REUSED_FROM, earlier_run_id)  # a reuse of a reuse points at the work itself
    done = read_result(earlier)
    with stage_run(stage, config, parent_run_id, inputs) as run_id:
        tracking.set_tags(run_id, {REUSED_FROM: source})
        tracking.MetricsLogger(run_id)(0, done.metrics)
        result = StageResult(stage=stage, run_id=run_id, uris=done.uris, metrics=done.metrics)
        record_finished(result, key)
    get_run_logger().info("%s: reusing MLflow run %s (same config and inputs)", stage, source)
    return result
