"""Task: load (or generate) a stage's rows, validate them, and record them in MLflow as inputs and artifacts."""

from __future__ import annotations

from typing import Literal, NamedTuple

import pandas as pd
from prefect import task
from prefect.logging import get_run_logger

from grpo.configs.data import DataConfig
from grpo.data.tables import dropped_rows, load_rl_data, load_sft_data
from runtime import tracking


class DataURIs(NamedTuple):
    train: str  # runs:/<id>/dataset/train: Parquet of the training rows
    heldout: str | None  # runs:/<id>/dataset/heldout: Parquet of held-out (prompt, answer) rows, if any


LOADERS = {"sft": load_sft_data, "rl": load_rl_data}


@task(name="prepare_data")
def prepare_data(run_id: str, cfg: DataConfig, kind: Literal["sft", "rl"]) -> DataURIs:
    """Rows for an SFT (prompt, response) or RL (prompt, answer) stage; a bad file fails here, before any model."""
    train, heldout = LOADERS[kind](cfg)
    source = cfg.source if cfg.source != "synthetic" else f"synthetic:{cfg.task.model_dump_json()}"
    tracking.log_dataset(run_id, train, name=f"{kind}_train", source=source, context="training")
    train_uri = tracking.log_frame(run_id, train, "dataset/train")
    heldout_uri = None
    if heldout is not None:
        tracking.log_dataset(run_id, heldout, name="heldout", source=cfg.heldout_source if cfg.heldout_source
                             != "synthetic" else source, context="evaluation")
        heldout_uri = tracking.log_frame(run_id, heldout, "dataset/heldout")
    get_run_logger().info("%s data: %d training rows, %s held-out rows", kind, len(train),
                          len(heldout) if heldout is not None else "no")
    report_dropped(run_id, cfg, train, heldout)
    return DataURIs(train_uri, heldout_uri)


def report_dropped(run_id: str, cfg: DataConfig, train: pd.DataFrame, heldout: pd.DataFrame | None) -> None:
    """Under `unreadable_answers: drop`, the rows left out, as metrics of the run and a warning in the flow's log:
    a dataset that lost rows should be seen where the run is read, not only in the loader's own output."""
    if cfg.unreadable_answers != "drop":
        return  # unreadable answers failed the load; nothing was left out
    counts = {"data/dropped_train_rows": dropped_rows(train), "data/dropped_heldout_rows": dropped_rows(heldout)}
    tracking.MetricsLogger(run_id)(0, counts)
    if any(counts.values()):
        get_run_logger().warning("dropped rows whose answer cannot be read (data.unreadable_answers: drop): %d of "
                                 "%s, %d of %s", counts["data/dropped_train_rows"], cfg.source,
                                 counts["data/dropped_heldout_rows"], cfg.heldout_source)


def read_frame(uri: str) -> pd.DataFrame:
    """A Parquet artifact folder (or file) as a DataFrame."""
    return pd.read_parquet(tracking.download(uri))
