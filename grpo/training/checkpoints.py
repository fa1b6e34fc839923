"""Resumable checkpoints of the SFT and GRPO loops: `<output_dir>/checkpoints/step-<n>/`, one Accelerate state each.

A checkpoint counts only once its `trainer_state.json` is written (last), so one cut off mid-save is ignored and the
run resumes from the one before. Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from accelerate import Accelerator


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    done = [p for p in Path(root).glob("step-*") if (p / "trainer_state.json").exists()]
    return max(done, key=lambda p: int(p.name.split("-")[1]), default=None)


def checkpoint_step(path: Path) -> int:
    return json.loads((path / "trainer_state.json").read_text())["step"]


def resumable_step(output_dir: str | Path) -> int:
    """The step a loop writing to `output_dir` would resume from (0: it starts over)."""
    latest = latest_checkpoint(Path(output_dir) / "checkpoints")
    return checkpoint_step(latest) if latest is not None else 0


def save_checkpoint(acc: Accelerator, root: Path, step: int, keep: int, *, strategy=None) -> None:
    """Model, optimizer, scheduler and RNG state at `step`, as the loop's `strategy` writes them
    (`grpo.training.strategy`; accelerate's own format without one); only the newest `keep` checkpoints stay."""
    path = root / f"step-{step}"
    # every process calls it: under ddp the main process writes the weights and optimizer, each process its RNG
    # state; under fsdp each process writes its shards
    if strategy is not None:
        strategy.save_state(path)
    else:
        acc.save_state(str(path), safe_serialization=False)  # tied embeddings trip safetensors' shared-memory check
    acc.wait_for_everyone()  # the marker goes in once every process has written its part
    if acc.is_main_process:
        (path / "trainer_state.json").write_text(json.dumps({"step": step}))  # last: marks the checkpoint complete
        for old in sorted(root.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    acc.wait_for_everyone()
