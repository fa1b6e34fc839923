"""Shard files in a local folder or any fsspec store: written atomically, found, read back with their counts and
the marks the merge reads.

A shard folder is a local path or any fsspec URI (file:///shared/mount/..., s3://bucket/...): with a task runner on
a cluster, every node writes its shards to one store that the driver then merges from. Must not depend on Prefect
or MLflow.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable

import fsspec
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from grpo.rejection.budget import ShardTiming
from grpo.rejection.curate import ShardMarks, ShardResult
from grpo.rejection.filters import Counts
# A shard is shard-00003.parquet (kept rows and their marks, counts in its metadata) and shard-00003.json (the counts)
COUNTS_KEY = b"r1.rejection.counts"
TIMING_KEY = b"r1.rejection.timing"  # the ShardTiming its task measured
HELDOUT_KEY = b"r1.rejection.heldout"  # the HeldoutIndex digest the `contaminated` column was made against
MARK_COLUMNS = ("merge_key", "contaminated")  # ShardMarks as columns beside the kept rows


def store_of(out_dir: str | Path) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem holding `out_dir` and the folder's path in it."""
    return fsspec.core.url_to_fs(str(out_dir))


def join_uri(out_dir: str | Path, name: str) -> str | Path:
    return f"{str(out_dir).rstrip('/')}/{name}" if "://" in str(out_dir) else Path(out_dir) / name


def shard_path(out_dir: str | Path, index: int) -> str | Path:
    """The shard's Parquet file: a Path for a local folder, a URI for a store."""
    return join_uri(out_dir, f"shard-{index:05d}.parquet")


def shard_done(out_dir: str | Path, index: int) -> bool:
    """True when the shard's Parquet file exists; it is only ever moved into place whole."""
    fs, root = store_of(out_dir)
    return fs.isfile(f"{root}/shard-{index:05d}.parquet")


def write_atomically(fs: fsspec.AbstractFileSystem, path: str, write: Callable[[Any], None]) -> None:
    """Write a temporary file beside `path`, then move it over `path`: readers see all or nothing.

    Locally (a shared mount included) the temporary file is fsynced and renamed; on an object store the final
    move is a copy that appears whole (a put is atomic there).
    """
    folder, name = path.rsplit("/", 1)
    if isinstance(fs, LocalFileSystem):
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        return
    tmp = f"{folder}/.{name}.{uuid.uuid4().hex}.tmp"
    try:
        with fs.open(tmp, "wb") as f:
            write(f)
        fs.mv(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            fs.rm(tmp)
        raise


def check_writable(out_dir: str | Path) -> None:
    """Write and delete a probe file in `out_dir`, so an unwritable store fails before any shard is sampled."""
    fs, root = store_of(out_dir)
    probe = f"{root}/.write-probe-{uuid.uuid4().hex}"
    try:
        fs.makedirs(root, exist_ok=True)
        write_atomically(fs, probe, lambda f: f.write(b"probe"))
        fs.rm(probe)
    except Exception as e:
        raise PermissionError(f"shard store {str(out_dir)!r} is not writable ({type(e).__name__}: {e}); every "
                              f"shard is written there: give a folder or bucket the driver and every node can "
                              f"write") from None


def write_shard(result: ShardResult, out_dir: str | Path, index: int) -> str | Path:
    """Write the shard's kept rows, their marks and counts; the Parquet move comes last, so a present shard is
    a whole one."""
    fs, root = store_of(out_dir)
    fs.makedirs(root, exist_ok=True)
    path = f"{root}/shard-{index:05d}.parquet"
    counts = json.dumps(result.counts.to_dict())
    write_atomically(fs, path.removesuffix(".parquet") + ".json", lambda f: f.write(counts.encode()))
    table = pa.Table.from_pandas(result.kept, preserve_index=False)
    metadata = {**(table.schema.metadata or {}), COUNTS_KEY: counts.encode()}
    marks = result.marks
    if marks is not None:
        table = table.append_column("merge_key", pa.array(marks.row_key, pa.uint64()))
        if marks.contaminated is not None:
            table = table.append_column("contaminated", pa.array(marks.contaminated, pa.bool_()))
            metadata[HELDOUT_KEY] = marks.heldout.encode()
    if result.timing is not None:
        metadata[TIMING_KEY] = json.dumps(result.timing.to_dict()).encode()
    table = table.replace_schema_metadata(metadata)
    write_atomically(fs, path, lambda f: pq.write_table(table, f))
    return shard_path(out_dir, index)


def write_parts(tables: Iterable[pa.Table], dest: str | Path, schema: pa.Schema,
                rows_per_file: int = 1_000_000) -> tuple[list[str], int]:
    """`tables` (each of `schema`) written as Parquet files part-00000.parquet, ... in `dest` (a folder or store URI
    without part files yet), at most `rows_per_file` rows each, a table at a time: what is held is one table's.
    Returns the files, in row order, and the rows written."""
    fs, root = store_of(dest)
    fs.makedirs(root, exist_ok=True)
    if fs.glob(f"{root}/part-*.parquet"):
        raise FileExistsError(f"{dest} already holds a dataset (part-*.parquet); give an empty folder")
    files: list[str] = []
    writer, handle, in_file, written = None, None, 0, 0
    try:
        for table in tables:
            while len(table):
                if writer is None:
                    files.append(str(join_uri(dest, f"part-{len(files):05d}.parquet")))
                    handle = fs.open(f"{root}/part-{len(files) - 1:05d}.parquet", "wb")
                    writer, in_file = pq.ParquetWriter(handle, schema), 0
                part = table.slice(0, rows_per_file - in_file)
                writer.write_table(part)
                in_file, written, table = in_file + len(part), written + len(part), table.slice(len(part))
                # what Arrow's pool holds of the batches written goes back to the system now, not when it decays:
                # held, it grew with the batches (800k rows: +172 MiB peak RSS against +143 at 100k; +139 / +127)
                pa.default_memory_pool().release_unused()
                if in_file == rows_per_file:
                    writer.close()
                    handle.close()
                    writer = None
    finally:
        if writer is not None:
            writer.close()
            handle.close()
    return files, written


def as_frame(table: pa.Table) -> pd.DataFrame:
    """Kept rows as pandas: chat prompts as lists of messages, as they went in, not Parquet's numpy arrays."""
    kept = table.to_pandas()
    kept["prompt"] = [p.tolist() if hasattr(p, "tolist") else p for p in kept["prompt"]]
    return kept


def read_shard(out_dir: str | Path, index: int) -> ShardResult:
    """A written shard's kept rows, counts and marks (the counts from the Parquet metadata, which always has
    them; the marks where the shard task wrote them)."""
    fs, root = store_of(out_dir)
    with fs.open(f"{root}/shard-{index:05d}.parquet", "rb") as f:
        table = pq.read_table(f)
    metadata = table.schema.metadata
    counts = Counts.from_dict(json.loads(metadata[COUNTS_KEY]))
    marks = None
    if "merge_key" in table.column_names:
        flags = table.column("contaminated").to_numpy() if "contaminated" in table.column_names else None
        marks = ShardMarks(table.column("merge_key").to_numpy(), flags, metadata.get(HELDOUT_KEY, b"").decode())
    kept = as_frame(table.drop_columns([c for c in MARK_COLUMNS if c in table.column_names]))
    return ShardResult(kept, None, counts, marks, _timing(metadata))


def read_timing(out_dir: str | Path, index: int) -> ShardTiming | None:
    """What a written shard's task measured, from its file's footer alone; None for a shard written without it."""
    fs, root = store_of(out_dir)
    with fs.open(f"{root}/shard-{index:05d}.parquet", "rb") as f:
        return _timing(pq.ParquetFile(f).schema_arrow.metadata or {})


def _timing(metadata: dict) -> ShardTiming | None:
    raw = metadata.get(TIMING_KEY)
    return None if raw is None else ShardTiming.from_dict(json.loads(raw))
