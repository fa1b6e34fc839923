"""A stage's attempts: in this process or on its pool, again after a failure or a lost machine, within a time limit.

Prefect's own `retries` never fire for a process killed with -9 (nothing is left to report the failure), and a stage
flow run whose pod was preempted stays Running on the server. So the pipeline retries a stage itself: when the stage
raised, when its flow run ended Failed or Crashed, or when the heartbeat of its MLflow run stopped (runtime/heartbeat.py;
flows/placement.py marks such a flow run Crashed). Each new attempt is a new stage run that resumes from the last
durable checkpoint (runtime/durable.py), on whatever machine the pool gives it. How often and after what pause is the
stage's `resources` (`retries`, `retry_delays_s`); `timeout_s` bounds one attempt.
"""

from __future__ import annotations

import time

from flows.placement import run_placed
from flows.stages import Stage
from grpo.configs.recipe import StageConfig
from grpo.faults import Fault
from grpo.interrupts import is_interrupt
from runtime.stage import StageResult


def run_stage(stage: Stage, config: StageConfig, parent_run_id: str, inputs: dict[str, str], recipe_name: str,
              log) -> StageResult:
    """The stage's result, after as many attempts as its resources allow (the last attempt's error otherwise)."""
    res = config.resources
    for attempt in range(res.retries + 1):
        try:
            if res.pool:  # its own flow run on its pool; this one waits
                return run_placed(stage, config, parent_run_id, inputs, recipe_name, log)
            # `<stage>:<recipe name>`; a callable, not a template string, which would read braces as fields
            named = stage.flow.with_options(flow_run_name=lambda: f"{stage.name}:{recipe_name}",
                                            timeout_seconds=res.timeout_s)
            return named(config=config, parent_run_id=parent_run_id, **inputs)
        except BaseException as e:
            if is_interrupt(e):
                raise
            if attempt == res.retries:
                if isinstance(e, TimeoutError) and res.timeout_s:  # the limit the recipe set: one line, not a trace
                    raise Fault(f"{stage.name}: {'every attempt' if res.retries else 'the stage'} ran past its time "
                                f"limit ({stage.name}.resources.timeout_s = {res.timeout_s:g} s); the same command "
                                f"resumes from its last durable checkpoint") from e
                raise
            delay = res.retry_delay(attempt)
            log.warning("%s: attempt %d of %d failed (%s: %s); the next, in %.0f s, resumes from its last durable "
                        "checkpoint", stage.name, attempt + 1, res.retries + 1, type(e).__name__, e, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")
