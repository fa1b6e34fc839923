"""Loading and validating datasets: user files and hub datasets, checked before training starts.

Rows come in two shapes:
- SFT rows: `prompt` (str or chat messages) and `response` (`<think>...</think><answer>...</answer>`);
- RL rows: `prompt` and `answer` (the reference a reward checks against).
A bad dataset fails here with a `DataError` naming the file, row and column. Must not depend on torch, Prefect or
MLflow.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pandas as pd

from grpo.config import DataConfig, TaskConfig
from grpo.data.arithmetic import Problem, generate_problems, rl_rows, sft_rows

# Loading and validating datasets

SFT_SCHEMA = {"prompt": "text or chat messages", "response": "text"}
RL_SCHEMA = {"prompt": "text or chat messages", "answer": "text or number"}


class DataError(ValueError):
    """A dataset that cannot be used, with the file, row and column that say why."""


def read_table(source: str, split: str = "train") -> pd.DataFrame:
    """Read a user dataset into a DataFrame: JSONL, JSON, Parquet, CSV, a saved `datasets` folder or a hub name."""
    path = Path(source)
    suffix = path.suffix.lower()
    if suffix in {".jsonl", ".json", ".parquet", ".csv"}:
        if not path.is_file():
            raise DataError(f"{source}: no such file")
        if suffix == ".jsonl":
            return _read_jsonl(path)
        if suffix == ".json":
            return pd.read_json(path)
        if suffix == ".parquet":
            return pd.read_parquet(path)
        return pd.read_csv(path)
    if path.is_dir():
        import datasets

        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataError(f"{source}: no split {split!r}; it has {sorted(ds)}")
            ds = ds[split]
        return ds.to_pandas()
    if path.is_absolute() or source.startswith("."):
        raise DataError(f"{source}: no such file or folder")
    import datasets  # a hub name: needs network access to the hub (or its local cache)

    return datasets.load_dataset(source, split=split).to_pandas()


def _read_jsonl(path: Path) -> pd.DataFrame:
    rows = []
    with path.open() as f:
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: line {i} is not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}: line {i} is a JSON {type(row).__name__}, expected an object")
            rows.append(row)
    return pd.DataFrame(rows)


def _is_messages(value) -> bool:
    if hasattr(value, "tolist"):  # Parquet/Arrow hand back numpy arrays for lists
        value = value.tolist()
    return (isinstance(value, list) and len(value) > 0
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in value))


def validate_rows(df: pd.DataFrame, schema: dict[str, str], source: str) -> pd.DataFrame:
    """Check every required column exists and every cell has the expected type; raise DataError naming the first bad one."""
    missing = [c for c in schema if c not in df.columns]
    if missing:
        raise DataError(f"{source}: missing column(s) {missing}; expected columns {list(schema)}, "
                        f"found {list(df.columns)}")
    if len(df) == 0:
        raise DataError(f"{source}: no rows")
    for col, kind in schema.items():
        for i, value in enumerate(df[col].tolist()):
            ok = isinstance(value, str) and value.strip() != ""
            if kind == "text or chat messages" and not ok:
                ok = _is_messages(value)
            if kind == "text or number" and not ok:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
            if not ok:
                raise DataError(f"{source}: row {i}, column {col!r}: expected {kind}, got {value!r:.80}")
    return df


def normalise_rows(df: pd.DataFrame) -> pd.DataFrame:
    """Plain Python cells: Arrow-read chat messages become lists, numeric answers become text."""
    df = df.copy()
    df["prompt"] = [p.tolist() if hasattr(p, "tolist") else p for p in df["prompt"]]
    if "answer" in df.columns:
        df["answer"] = [str(a) for a in df["answer"]]
    return df


def _load(cfg: DataConfig, schema: dict[str, str],
          synthetic: Callable[[list[Problem], TaskConfig], pd.DataFrame]) -> pd.DataFrame:
    if cfg.source == "synthetic":
        return synthetic(generate_problems(cfg.task, cfg.num_train, "train"), cfg.task)
    df = normalise_rows(validate_rows(read_table(cfg.source, cfg.split), schema, cfg.source))
    return df.head(cfg.num_train) if cfg.num_train else df


def load_heldout(cfg: DataConfig) -> pd.DataFrame | None:
    """Held-out (prompt, answer) rows: the task's fixed held-out split, a user file, or None when switched off."""
    if not cfg.num_heldout or not cfg.heldout_source:
        return None
    if cfg.heldout_source == "synthetic":
        return rl_rows(generate_problems(cfg.task, cfg.num_heldout, "heldout"))
    df = validate_rows(read_table(cfg.heldout_source, cfg.split), RL_SCHEMA, cfg.heldout_source)
    return normalise_rows(df).head(cfg.num_heldout)


def load_sft_data(cfg: DataConfig) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """Training rows (prompt, response) and held-out rows (prompt, answer), both validated before any training."""
    return _load(cfg, SFT_SCHEMA, lambda ps, task: sft_rows(ps, task)), load_heldout(cfg)


def load_rl_data(cfg: DataConfig) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """Training prompts with reference answers (prompt, answer) and held-out rows, validated up front."""
    return _load(cfg, RL_SCHEMA, lambda ps, task: rl_rows(ps)), load_heldout(cfg)


def as_messages(prompt) -> list[dict]:
    """A prompt cell as chat messages: a plain string becomes one user turn."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return list(prompt)
