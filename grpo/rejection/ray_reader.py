"""The merge's two reads of the shard files on a Ray cluster's nodes, through Ray Data.

`write_merged(..., reader=RayDataReader())`, in a process connected to the cluster (`ray.init(address=...)`): a Ray
Data task on some node reads each shard's keys (and marks a shard written without them) and sends back 21 bytes a
row; this process decides which rows the dataset keeps, as it does alone; then tasks read each shard's kept rows,
conform them to the dataset's columns and stream them back in shard order, and this process writes them. What this
process holds is what it holds reading the files itself: the keys, and a batch. The shard store must be one that
every node reads (the stage checks that it is). Ray is imported when a reader is used, not before.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa

from grpo.data.tables import DataError
from grpo.rejection.curate import HeldoutIndex
from grpo.rejection.merge import KeyBatch, ShardFile, conformed, kept_batches, shard_keys
from grpo.rejection.store import store_of


class RayDataReader:
    """Reads the shard files with Ray Data tasks spread over the cluster's nodes; `nodes` counts, after a merge,
    the shards whose keys each node read (by Ray node id)."""

    def __init__(self) -> None:
        self.nodes: Counter[str] = Counter()

    def keys(self, out_dir: str | Path, shards: list[ShardFile], index: HeldoutIndex | None,
             batch_rows: int) -> Iterator[tuple[int, KeyBatch]]:
        import ray.data

        if not shards:
            return
        items = ray.data.from_items([{"position": i} for i in range(len(shards))], override_num_blocks=len(shards))
        ds = items.map_batches(_keys_of, batch_size=1, fn_kwargs={
            "out_dir": str(out_dir), "shards": shards, "index": index, "batch_rows": batch_rows})
        with _settings(), _errors():
            for out in ds.iter_batches(batch_size=None, batch_format="numpy"):
                for k, position in enumerate(out["position"]):
                    if out["error"][k]:
                        raise DataError(str(out["error"][k]))
                    self.nodes[str(out["node"][k])] += 1
                    flag = out["flag"][k]
                    yield int(position), (np.frombuffer(out["pid"][k], np.int64),
                                          np.frombuffer(out["sample"][k], np.int32),
                                          np.frombuffer(out["key"][k], np.uint64),
                                          None if index is None else np.frombuffer(flag, bool))

    def kept(self, out_dir: str | Path, shards: list[ShardFile], keep: np.ndarray, schema: pa.Schema,
             batch_rows: int) -> Iterator[pa.Table]:
        import ray.data

        starts = np.r_[0, np.cumsum([s.rows for s in shards])]
        items = [{"position": i, "keep": np.packbits(keep[starts[i]:starts[i + 1]]).tobytes()}
                 for i in range(len(shards)) if keep[starts[i]:starts[i + 1]].any()]
        if not items:
            return
        ds = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
            _kept_of, batch_size=1, fn_kwargs={"out_dir": str(out_dir), "shards": shards, "schema": schema,
                                               "batch_rows": batch_rows})
        with _settings(), _errors():  # in shard order: the dataset's
            yield from ds.iter_batches(batch_size=batch_rows, batch_format="pyarrow")


def _keys_of(batch: dict[str, np.ndarray], out_dir: str, shards: list[ShardFile], index: HeldoutIndex | None,
             batch_rows: int) -> dict[str, list[Any]]:
    """On a node: the keys of the batch's shards, each shard's arrays as bytes, and the node's id; a bad shard's
    DataError as its `error`."""
    import ray

    fs, _ = store_of(out_dir)
    out: dict[str, list[Any]] = {name: [] for name in ("position", "node", "pid", "sample", "key", "flag", "error")}
    for position in batch["position"].tolist():
        error = ""
        try:
            parts = list(shard_keys(fs, shards[position], index, batch_rows))
        except DataError as e:  # sent back as a value: Ray Data's wrapper of a raised error keeps only its text
            parts, error = [], str(e)
        out["error"].append(error)
        joined = [np.concatenate([p[i] for p in parts]) if parts else np.zeros(0, t)
                  for i, t in ((0, np.int64), (1, np.int32), (2, np.uint64))]
        out["position"].append(position)
        out["node"].append(ray.get_runtime_context().get_node_id())
        out["pid"].append(joined[0].astype(np.int64, copy=False).tobytes())
        out["sample"].append(joined[1].astype(np.int32).tobytes())  # shard_keys checked the range
        out["key"].append(joined[2].astype(np.uint64, copy=False).tobytes())
        out["flag"].append(np.concatenate([p[3] for p in parts]).astype(bool).tobytes()
                           if index is not None and parts else b"")
    return out


def _kept_of(batch: dict[str, np.ndarray], out_dir: str, shards: list[ShardFile], schema: pa.Schema,
             batch_rows: int) -> Iterator[pa.Table]:
    """On a node: the kept rows of the batch's shards, conformed to the dataset's columns, a batch at a time."""
    fs, _ = store_of(out_dir)
    for position, packed in zip(batch["position"].tolist(), batch["keep"]):
        shard = shards[position]
        keep = np.unpackbits(np.frombuffer(packed, np.uint8), count=shard.rows).astype(bool)
        for part in kept_batches(fs, shard, keep, batch_rows):
            yield conformed(pa.Table.from_batches([part]), "reasoning", schema)


@contextlib.contextmanager
def _settings() -> Iterator[None]:
    """Ray Data's context for the merge: outputs in their inputs' order, no progress bars or progress lines."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    before = ctx.execution_options.preserve_order, ctx.enable_progress_bars
    ctx.execution_options.preserve_order, ctx.enable_progress_bars = True, False
    log = logging.getLogger("ray.data")
    level = log.level
    log.setLevel(max(level, logging.WARNING))  # a dozen lines a dataset at INFO
    try:
        yield
    finally:
        ctx.execution_options.preserve_order, ctx.enable_progress_bars = before
        log.setLevel(level)


@contextlib.contextmanager
def _errors() -> Iterator[None]:
    """A bad shard is a DataError on a node; here it is raised as that DataError, not as Ray's wrapper of it."""
    try:
        yield
    except Exception as e:
        original = _data_error(e)
        if original is None:
            raise
        raise DataError(str(original)) from None


def _data_error(e: BaseException | None) -> DataError | None:
    """The DataError a node raised, out of Ray's wrappers: the error's one line where it travelled, else read from
    the node's traceback that Ray Data's UserCodeException carries as text (its last `...DataError: ` line)."""
    text, seen = str(e), set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, DataError) and not hasattr(e, "cause"):  # not Ray's wrapper class made from it
            return DataError(str(e).splitlines()[0])  # its one line; Ray Data adds its own lines after it
        e = getattr(e, "cause", None) or e.__cause__ or e.__context__
    said = [ln for ln in text.splitlines() if ln.strip().startswith(f"{DataError.__module__}.DataError: ")]
    return DataError(said[-1].strip().split(": ", 1)[1]) if said else None
