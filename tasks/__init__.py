"""Prefect tasks: thin wrappers that read a stage's inputs from MLflow, call `grpo`, log, and return URIs."""

from tasks.env import quiet_libraries, use_local_defaults

use_local_defaults()
quiet_libraries()
