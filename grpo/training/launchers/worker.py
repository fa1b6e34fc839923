"""What each process of a launched training stage runs: one training loop, read from a job file.

    accelerate launch --num_processes N -m grpo.training.launchers.worker <work folder>/launch/job.json

The stage task builds the loop's typed job (`grpo.training.jobs`: every input a local file, rows as
Parquet, the model a folder or the tiny config); `grpo.training.launchers.launch` writes it with where to report as
one document (`jobs.Launched`), starts this module under `accelerate launch`, and logs what the main process
reports. This module checks the document and runs `jobs.run`, as the task's own process does. Only the main process
(rank 0) reports, through the loops' callbacks: it appends metrics and sample tables as JSON lines to the job's events
file, and writes `result.json` when the loop has finished. Imports neither Prefect nor MLflow: the task that
launched it is the only process that talks to them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pandas as pd

from grpo import startup
from grpo.training.jobs import Launched, load_libraries, read_launched, run


class EventWriter:
    """The loops' `on_metrics` and `on_samples` callbacks: one JSON line each, appended to the events file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def _write(self, event: dict) -> None:
        with self.path.open("a") as f:  # one write per line, flushed on close: the task reads whole lines only
            f.write(json.dumps(event) + "\n")

    def metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._write({"step": step, "metrics": {k: float(v) for k, v in metrics.items()}})

    def samples(self, step: int, table: pd.DataFrame) -> None:
        self._write({"step": step, "samples": json.loads(table.to_json(orient="split", index=False))})


def run_job(launched: Launched) -> None:
    """Run the launched job's loop in this process (one of the launch's, or a Ray Train worker); rank 0 writes the
    report."""
    startup.defer_collection()  # a launched process's start-up: its loop's libraries, then the collector on again
    load_libraries(launched.job)
    startup.imports_done()
    events = EventWriter(launched.events)
    report = run(launched.job, events.metrics, events.samples)
    if int(os.environ.get("RANK", "0")) == 0:  # the global rank; the loops have saved and synchronised
        Path(launched.result).write_text(json.dumps(report))


def main(argv: list[str] | None = None) -> int:
    startup.defer_collection()
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not Path(argv[0]).is_file():
        print(__doc__, file=sys.stderr)
        return 2
    from pydantic import ValidationError

    try:
        launched = read_launched(Path(argv[0]).read_text())
    except ValidationError as e:  # one document, checked field by field before any model loads
        raise SystemExit(f"{argv[0]}: not a launched job: {e}") from None
    run_job(launched)
    from grpo.training.distributed import exit_process

    exit_process(0)  # after the whole loop, on success: a failure exits non-zero anyway


if __name__ == "__main__":
    sys.exit(main())
