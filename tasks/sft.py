"""Tasks of the supervised stages (cold-start SFT, and SFT on curated data): data, training, evaluation."""

from __future__ import annotations

from typing import NamedTuple

import pandas as pd
from prefect import task
from prefect.logging import get_run_logger

from grpo.data import DataConfig, load_sft_data
from grpo.evaluate import EvalConfig, evaluate
from grpo.generation import TransformersBackend
from grpo.models import ModelConfig, load_model_and_tokenizer
from grpo.sft import SFTConfig, train_sft
from tasks import tracking
from tasks.stage import work_dir


class DataURIs(NamedTuple):
    train: str  # runs:/<id>/dataset/train: Parquet of the training rows
    heldout: str | None  # runs:/<id>/dataset/heldout: Parquet of held-out (prompt, answer) rows, if any


def _read_parquet_artifact(uri: str) -> pd.DataFrame:
    return pd.read_parquet(tracking.download(uri))


@task(name="prepare_sft_data")
def prepare_sft_data(run_id: str, cfg: DataConfig) -> DataURIs:
    """Load (or generate) and validate the SFT rows, record them as the run's dataset input, store them as artifacts."""
    train, heldout = load_sft_data(cfg)  # a bad file fails here, before any model is built
    source = cfg.source if cfg.source != "synthetic" else f"synthetic:{cfg.task.model_dump_json()}"
    tracking.log_dataset(run_id, train, name="sft_train", source=source, context="training")
    train_uri = tracking.log_frame(run_id, train, "dataset/train")
    heldout_uri = None
    if heldout is not None:
        tracking.log_dataset(run_id, heldout, name="heldout", source=source, context="evaluation")
        heldout_uri = tracking.log_frame(run_id, heldout, "dataset/heldout")
    get_run_logger().info("SFT data: %d training rows, %s held-out rows", len(train),
                          len(heldout) if heldout is not None else "no")
    return DataURIs(train_uri, heldout_uri)


@task(name="train_sft_model")
def train_sft_model(run_id: str, stage: str, model_cfg: ModelConfig, train_uri: str, cfg: SFTConfig) -> str:
    """Fine-tune the model on the training rows; log per-step metrics; return the checkpoint's URI."""
    rows = _read_parquet_artifact(train_uri)
    model, tokenizer = load_model_and_tokenizer(model_cfg)
    # keyed by what determines the result, so rerunning an interrupted stage resumes from its last checkpoint
    out = work_dir(stage, model_cfg, cfg, rows["prompt"].astype(str).tolist()[:50], len(rows))
    result = train_sft(model, tokenizer, rows, cfg, out, tracking.MetricsLogger(run_id), source=train_uri)
    get_run_logger().info("SFT finished: %d steps, final loss %.4f", result.steps, result.final_loss)
    return tracking.log_dir(run_id, result.model_dir, "checkpoint")


@task(name="evaluate_model")
def evaluate_model(run_id: str, checkpoint_uri: str, model_cfg: ModelConfig, heldout_uri: str, cfg: EvalConfig,
                   step: int | None = None) -> dict[str, float]:
    """Load the checkpoint back with from_pretrained, score it on the held-out rows, log metrics and samples."""
    local = tracking.download(checkpoint_uri)
    model, tokenizer = load_model_and_tokenizer(model_cfg.model_copy(update={"name_or_path": str(local)}))
    result = evaluate(TransformersBackend(model, tokenizer), _read_parquet_artifact(heldout_uri), cfg)
    tracking.MetricsLogger(run_id)(step or 0, result.metrics)
    tracking.log_table(run_id, result.samples, "eval/samples.json")
    get_run_logger().info("held-out: %s", ", ".join(f"{k}={v:.3f}" for k, v in result.metrics.items()))
    return result.metrics
