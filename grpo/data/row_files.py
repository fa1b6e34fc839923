"""Datasets kept as Parquet files: a stage's artifact folder of part files (the curated dataset), or an older run's
single file. Listed, checked and described a batch at a time, so a dataset of any size is never held whole.

Must not depend on torch, Prefect or MLflow.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterator, NamedTuple

import pandas as pd
import pyarrow.parquet as pq

from grpo.data.tables import DataError, validate_rows

BATCH_ROWS = 4096  # rows read at a time: the text in memory is a batch's


class RowFiles(NamedTuple):
    """A Parquet dataset, described without reading it into memory (what MLflow records of it)."""

    files: list[Path]  # in row order
    rows: int
    digest: str  # of the files' bytes, in order: tells two versions apart
    schema: dict[str, str]  # column -> Arrow type, as the first file has them


def parquet_files(path: str | Path) -> list[Path]:
    """A Parquet file, or a folder's Parquet files in name order (part-00000.parquet, ...; an older run's
    data.parquet)."""
    path = Path(path)
    if path.is_file():
        return [path]
    files = sorted(p for p in path.glob("*.parquet") if p.is_file() and not p.name.startswith((".", "_")))
    if not files:
        raise DataError(f"{path}: no Parquet file{' in this folder' if path.is_dir() else ' or folder there'}")
    return files


def file_name(source: str, path: str | Path, file: Path) -> str:
    """How errors name one file of the dataset `source` (at `path`): the file itself where `source` is a folder."""
    return source if Path(path).is_file() else f"{source.rstrip('/')}/{file.name}"


def frames(file: Path, columns: list[str] | None = None,
           batch_rows: int = BATCH_ROWS) -> Iterator[tuple[int, pd.DataFrame]]:
    """A Parquet file's rows as frames of `batch_rows`, each with its first row's number in the file.

    Read without pre-buffering: pre-buffered, pyarrow keeps every row group's column chunks read so far until the
    file is closed, ~3 KB a row of 4 KB text (+240 MB over 82k rows of one part file), and a part file holds up to
    `write_merged`'s `rows_per_file` (1M); one thread, as flat and as fast (the batches are small)."""
    at = 0
    reader = pq.ParquetFile(file, pre_buffer=False)
    for batch in reader.iter_batches(batch_size=batch_rows, columns=columns, use_threads=False):
        yield at, batch.to_pandas()
        at += batch.num_rows


def content_digest(files: list[Path]) -> str:
    """A digest of the files' bytes, read 1 MiB at a time."""
    h = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()[:16]


def describe_row_files(path: str | Path) -> RowFiles:
    """The dataset's files, rows (from the footers), digest and columns; no row is checked."""
    files = parquet_files(path)
    schema = pq.read_schema(files[0])
    rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    return RowFiles(files, rows, content_digest(files), {f.name: str(f.type) for f in schema})


def check_row_files(path: str | Path, schema: dict[str, str], source: str,
                    batch_rows: int = BATCH_ROWS) -> RowFiles:
    """Every row checked against `schema` (as `validate_rows`), `batch_rows` at a time: the first bad cell fails
    naming its file, row and column, before anything expensive starts. Returns the dataset's description."""
    files = parquet_files(path)
    for file in files:
        name = file_name(source, path, file)
        try:
            found = pq.read_schema(file).names
        except Exception as e:
            raise DataError(f"{name}: not a readable Parquet file ({type(e).__name__}: {e})") from None
        missing = [c for c in schema if c not in found]
        if missing:
            raise DataError(f"{name}: missing column(s) {missing}; expected columns {list(schema)}, found {found}")
        for at, frame in frames(file, list(schema), batch_rows):
            validate_rows(frame, schema, name, first_row=at)
    described = describe_row_files(path)
    if not described.rows:
        raise DataError(f"{source}: no rows")
    return described


def head_rows(files: list[Path], n: int) -> pd.DataFrame:
    """A dataset's first `n` rows (a sample table), read from its first files only."""
    parts, left = [], n
    for file in files:
        for _, frame in frames(file, batch_rows=left):
            parts.append(frame.head(left))
            left -= len(parts[-1])
            break
        if left <= 0:
            break
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
