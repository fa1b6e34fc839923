"""Datasets recorded in MLflow by reference: a dataset kept as Parquet files (the curated one, up to R1's ~800k long
rows) is logged as its artifact folder, plus an input record of its URI, digest, rows and columns and a small sample
table; never as one in-memory frame."""

from __future__ import annotations

import json

from mlflow.data.code_dataset_source import CodeDatasetSource
from mlflow.entities import Dataset, DatasetInput, InputTag

from grpo.data.row_files import RowFiles, head_rows
from runtime import tracking

SAMPLE_ROWS = 50  # rows of a dataset's sample table


def log_dataset_reference(run_id: str, dataset: RowFiles, *, name: str, source: str, context: str) -> None:
    """An input record of `dataset` (MLflow's Datasets tab) from its description: nothing of it is read here."""
    columns = json.dumps({"mlflow_colspec": [{"name": c, "type": t} for c, t in dataset.schema.items()]})
    entity = Dataset(name=name, digest=dataset.digest, source_type="code",
                     source=CodeDatasetSource(tags={"source": source}).to_json(), schema=columns,
                     profile=json.dumps({"num_rows": dataset.rows}))
    tracking.log_input(run_id, DatasetInput(entity, tags=[InputTag("mlflow.data.context", context)]))


def log_sample_table(run_id: str, dataset: RowFiles, artifact_file: str) -> None:
    """The dataset's first rows as a table (cells as text), read from its first file(s) only."""
    tracking.log_table(run_id, head_rows(dataset.files, SAMPLE_ROWS).astype(str), artifact_file)
