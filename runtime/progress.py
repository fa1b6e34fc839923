"""A long stage's progress in Prefect: a progress artifact (0-100 %) kept up to date from the trainer's metrics.

The training loops in `grpo/` report metrics through one callback every `log_every` steps and at the last step;
`TrainingProgress` is that callback: it logs the metrics to MLflow as before and moves the flow run's progress
bar (the *Artifacts* tab, key `<stage>-progress`), at most once every `every_s` seconds and always at the end.

`R1_STEP_PAUSE_S` (seconds, default 0) makes the stage sleep after each callback: a test that only needs a stage alive
(to stop it, time it out, fill its disk) keeps it training slowly instead of flat out beside the other tests. The
stage's MLflow run is then tagged `r1.step_pause_s`: its timings are not a quiet run's.
"""

from __future__ import annotations

import os
import time

from grpo.interrupts import raise_if_stopping
from runtime import outage, tracking


class TrainingProgress:
    """`callback(step, metrics)`: metrics to the MLflow run, `step / max_steps` to a Prefect progress artifact."""

    def __init__(self, run_id: str, stage: str, max_steps: int, every_s: float = 10.0):
        from prefect.artifacts import create_progress_artifact

        self.log_metrics = tracking.MetricsLogger(run_id)
        self.max_steps, self.every_s, self.last_update = max(max_steps, 1), every_s, time.monotonic()
        self.pause_s = step_pause_s()
        if self.pause_s:  # its timings are not a quiet run's: said where runs are compared
            tracking.set_tags(run_id, {"r1.step_pause_s": f"{self.pause_s:g}"})
        self.description = f"{stage}: training steps done, of {max_steps}"
        self.artifact_id = create_progress_artifact(0.0, key=f"{stage.replace('_', '-')}-progress",
                                                    description=self.description)

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        from prefect.artifacts import update_progress_artifact

        raise_if_stopping()  # a stop that landed where Python could only print it stops the stage here
        self.log_metrics(step, metrics)
        finished = step >= self.max_steps
        if finished:  # metrics queued while a tracking server was away are written (or fail the stage) while the
            outage.flush(self.log_metrics.run_id)  # loop still has its checkpoints: a rerun then resumes
        if finished or time.monotonic() - self.last_update >= self.every_s:  # the API need not hear every step
            update_progress_artifact(self.artifact_id, 100.0 * min(step, self.max_steps) / self.max_steps)
            self.last_update = time.monotonic()
        if self.pause_s and not finished:
            time.sleep(self.pause_s)


def step_pause_s() -> float:
    """`R1_STEP_PAUSE_S`, checked: a number of seconds >= 0."""
    text = os.environ.get("R1_STEP_PAUSE_S", "").strip()
    try:
        pause = float(text or 0)
    except ValueError:
        pause = -1
    if not pause >= 0:
        raise ValueError(f"R1_STEP_PAUSE_S={text!r}: expected a number of seconds >= 0")
    return pause
