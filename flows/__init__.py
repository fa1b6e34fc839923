"""Prefect flows: one per stage (each deployable alone) and `r1_pipeline`, which chains them."""

import sys

from grpo import startup

# A flow run's own process (a process worker's `python -m prefect.engine`) imports the stages' libraries next: without
# the cyclic collector (grpo.startup), until the run starts (each flow's run-name function, which Prefect calls first,
# ends the start-up). `r1` defers in its own `main`.
if getattr(getattr(sys.modules.get("__main__"), "__spec__", None), "name", None) == "prefect.engine":
    startup.defer_collection()

import runtime  # noqa: E402,F401  (sets the embedded-default environment before Prefect reads its settings)
