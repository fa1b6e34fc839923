"""Prefect tasks: thin wrappers that read a stage's inputs from MLflow, call `grpo`, log, and return URIs. What they
run inside (tracking, the home, heartbeats, durable copies, reports) is `runtime/`."""

import runtime  # noqa: F401  (the embedded default's environment, set before any task module imports Prefect)
