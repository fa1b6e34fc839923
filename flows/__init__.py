"""Prefect flows: one per stage (each deployable alone) and `r1_pipeline`, which chains them."""

import runtime  # noqa: F401  (sets the embedded-default environment before Prefect reads its settings)
