"""One point of a sweep run side by side with others on this machine (flows/sweep_launch.py starts it):

    python -m flows.cli.point '{"recipe": ..., "stages": [...], "overrides": {...}, "sweep": {...}}'

It runs the point's pipeline as `r1 run` does, nested under the sweep's MLflow run, on the Prefect API and
tracking store its environment names (the sweep's), and stops as `r1 run` does on Ctrl-C or SIGTERM: its runs
end KILLED and the same sweep again resumes it.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    job = json.loads(argv[0])
    import tasks  # noqa: F401  (the embedded-default environment before Prefect loads)
    from flows.cli.r1 import _until_stopped
    from flows.r1_pipeline import r1_pipeline

    result = _until_stopped(lambda: r1_pipeline(recipe=job["recipe"], stages=job["stages"],
                                                overrides=job["overrides"] or None, sweep=job["sweep"]),
                            "the same `r1 sweep` resumes it")
    if result is None:
        return 130
    print(f"MLflow pipeline run {result.run_id}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
