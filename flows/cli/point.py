"""One point of a sweep run side by side with others on this machine (flows/sweep_launch.py starts it):

    python -m flows.cli.point '{"recipe": ..., "stages": [...], "overrides": {...}, "sweep": {...}}'

It runs the point's pipeline as `r1 run` does, nested under the sweep's MLflow run, on the Prefect API and
tracking store its environment names (the sweep's), and stops as `r1 run` does on Ctrl-C or SIGTERM: its runs
end KILLED and the same sweep again resumes it. The sweep stops it (SIGINT, SIGKILL 30 s later); once the sweep's
process is gone (killed by its supervisor, say), nothing would, so it gives itself ORPHAN_S to end and then exits.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

ORPHAN_S = 60.0  # how long a point whose sweep is gone may take to end its runs before it exits


def _exit_once_orphaned(parent: int) -> None:
    """In a thread: once `parent` (the sweep) is gone, ORPHAN_S later, exit whatever the main thread is doing."""
    while os.getppid() == parent:
        time.sleep(1.0)
    time.sleep(ORPHAN_S)
    print(f"r1: its sweep's process is gone and this point did not end within {ORPHAN_S:.0f} s; exiting",
          file=sys.stderr, flush=True)
    os._exit(137)


def main(argv: list[str]) -> int:
    from grpo import startup

    startup.defer_collection()  # until the pipeline's libraries are loaded (`until_stopped`)
    job = json.loads(argv[0])
    threading.Thread(target=_exit_once_orphaned, args=(os.getppid(),), name="r1-orphan-exit", daemon=True).start()
    import runtime  # noqa: F401  (the embedded-default environment before Prefect loads)
    from flows.cli.r1 import until_stopped
    from flows.r1_pipeline import r1_pipeline

    result = until_stopped(lambda: r1_pipeline(recipe=job["recipe"], stages=job["stages"],
                                                overrides=job["overrides"] or None, sweep=job["sweep"]),
                            "the same `r1 sweep` resumes it")
    if result is None:
        return 130
    print(f"MLflow pipeline run {result.run_id}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
