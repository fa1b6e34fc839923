"""What a GRPO loop is handed to run after every step (the iterative reward model's refresh,
grpo.training.loops.rm_refresh; the alignment watch, grpo.training.alignment_watch).

Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import pandas as pd


class StepHook(Protocol):
    """Work the loop does after every step with that step's samples, whose state travels in the loop's checkpoints."""

    def after_step(self, step: int, table: pd.DataFrame) -> dict[str, float]:
        """The step's samples, every process's (`prompt`, `completion`, `reward`, `reward/<name>`, in groups of
        G rows); returns figures to log with the step's. Called on every process, with the same table."""

    def save(self, folder: Path) -> None:
        """Its state into a checkpoint folder (the main process calls it)."""

    def load(self, folder: Path) -> None:
        """Its state back from a checkpoint folder (every process calls it)."""

    def finish(self, output_dir: Path) -> None:
        """What it leaves beside the trained model when the loop ends (the main process calls it)."""
