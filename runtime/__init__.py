"""What every stage runs inside: its MLflow run and the tracking calls, the embedded home (R1_HOME) and its stores,
heartbeats, durable checkpoint copies, a tracking server's outages, system metrics, progress, and the reports a stage
and a sweep leave. Imports `grpo/` and nothing above it (tasks/ and flows/ import this).

Importing it sets the embedded default's environment (Prefect and MLflow state under R1_HOME unless the user points
them at servers) and quiets the libraries' known noise, before Prefect reads its settings.
"""

from runtime.env import quiet_libraries, use_local_defaults

use_local_defaults()
quiet_libraries()
