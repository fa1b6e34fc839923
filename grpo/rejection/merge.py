"""Merging written shards into the curated dataset: dedupe across shards, drop contaminated rows, cap to the target,
append the non-reasoning rows; decided from the rows' keys, then the kept rows read (and written) a batch at a time.

Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Protocol, Sequence

import fsspec
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from grpo.configs.rejection import RejectionConfig
from grpo.data.tables import DataError
from grpo.rejection.curate import KEPT_COLUMNS, HeldoutIndex, build_heldout_index, mark_rows
from grpo.rejection.filters import CONTAMINATED, DUPLICATE_ACROSS_SHARDS, OVER_TARGET, Counts
from grpo.rejection.non_reasoning import Appended, appended_frame, appended_rows, appended_tables
from grpo.rejection.store import COUNTS_KEY, HELDOUT_KEY, MARK_COLUMNS, as_frame, shard_done, store_of, write_parts

# the non-reasoning rows to append: a frame, or a Parquet file or folder of part files (`write_non_reasoning`'s),
# which the merge streams
NonReasoning = pd.DataFrame | str | Path | None


class RejectionResult(NamedTuple):
    dataset: pd.DataFrame  # reasoning rows (KEPT_COLUMNS) then non-reasoning rows; `kind` says which
    counts: Counts  # the reasoning samples, through the merge: generated == kept + sum(dropped)
    non_reasoning: int  # non-reasoning rows appended


def _stable_hash(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256("-".join(map(str, parts)).encode()).digest()[:8], "big")


class Selection(NamedTuple):
    """Which of the shards' rows the dataset keeps, decided from their keys alone."""

    keep: np.ndarray  # [N] bool over every shard's rows end to end, in shard order
    order: np.ndarray | None  # [kept] the kept rows (counted in shard order) in the dataset's order; None: in order
    in_order: bool  # the shards' rows already run in (source_prompt_id, sample_index) order (plan_shards' shards do)
    duplicates: int  # dropped as a repeat of an earlier row
    contaminated: int  # dropped as a copy of a held-out prompt
    over_target: int  # dropped by the cap to the target
    kept: int  # rows kept


CHUNK = 1 << 16  # rows a pass over the keys works on at once: its temporaries stay this size, whatever the rows


def _in_order(prompt_ids: np.ndarray, sample_indices: np.ndarray) -> bool:
    """Whether the rows run in (prompt id, sample index) order, checked a chunk at a time (no [N] temporary)."""
    for a in range(0, max(len(prompt_ids) - 1, 0), CHUNK):
        b = min(a + CHUNK, len(prompt_ids) - 1)
        p0, p1 = prompt_ids[a:b], prompt_ids[a + 1:b + 1]
        if not ((p0 < p1) | ((p0 == p1) & (sample_indices[a:b] <= sample_indices[a + 1:b + 1]))).all():
            return False
    return True


def _repeated_keys(keys: np.ndarray) -> np.ndarray:
    """The key values two rows or more hold, sorted. The keys are sorted a sixteenth at a time (split by their top
    four bits, a chunk of rows read at a time): the copy a sort needs is a sixteenth of the keys', not all of them."""
    bits = min(4, max(0, (len(keys) // CHUNK).bit_length() - 1))  # 2**bits parts: one when the keys are few
    found = []
    for part in range(1 << bits):
        some = np.concatenate([chunk[chunk >> np.uint64(64 - bits) == np.uint64(part)] if bits else chunk
                               for chunk in (keys[a:a + CHUNK] for a in range(0, len(keys), CHUNK))] or [keys[:0]])
        some.sort()
        found.append(np.unique(some[1:][some[1:] == some[:-1]]))
    return np.concatenate(found)  # the parts in their top bits' order: sorted


def _first_of_each_key(keys: np.ndarray, alive: np.ndarray) -> None:
    """Clear `alive` for every row whose key an earlier row holds: the repeated key values found first, then only
    the rows holding one, which are few, looked at."""
    repeated = _repeated_keys(keys)  # [R] sorted
    if not len(repeated):
        return
    rows = [a + np.flatnonzero(repeated[np.minimum(np.searchsorted(repeated, keys[a:a + CHUNK]), len(repeated) - 1)]
                               == keys[a:a + CHUNK]) for a in range(0, len(keys), CHUNK)]
    rows = np.concatenate(rows)  # [D] rows holding a repeated key, in order
    _, first = np.unique(keys[rows], return_index=True)  # each value's first row (a stable sort keeps row order)
    alive[rows] = False
    alive[rows[first]] = True


def _cap(prompt_ids: np.ndarray, sample_indices: np.ndarray, alive: np.ndarray, limit: int, seed: int) -> None:
    """Clear `alive` past `limit` survivors, covering prompts first: every prompt's first survivor before any
    prompt's second, ties among one rank broken by a hash of (seed, prompt id, sample index), then by position.

    The rows run in prompt order. Per prompt, its survivors count c; the ranks kept whole are those below the
    largest R with sum(min(c, R)) <= limit; the rest of the limit comes from the rows of rank R, hashed (one a
    prompt at most). Temporaries: a few numbers a prompt, a chunk's a row."""
    n = len(prompt_ids)
    starts = np.flatnonzero(np.r_[True, prompt_ids[1:] != prompt_ids[:-1]]) if n else np.zeros(0, np.int64)  # [P]
    counts = np.zeros(len(starts), np.int64)  # [P] each prompt's survivors, counted a chunk at a time
    for a in range(0, n, CHUNK):
        rows = a + np.flatnonzero(alive[a:a + CHUNK])
        counts += np.bincount(np.searchsorted(starts, rows, side="right") - 1, minlength=len(starts))
    low, high = 0, int(counts.max(initial=0))  # the largest R with sum(min(counts, R)) <= limit
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if int(np.minimum(counts, mid).sum()) <= limit else (low, mid - 1)
    whole, room = low, limit - int(np.minimum(counts, low).sum())
    before = np.r_[0, np.cumsum(counts)[:-1]]  # [P] survivors in the prompts before each
    at_rank, seen = [], 0  # rows of rank `whole`, in order
    for a in range(0, n, CHUNK):
        live = alive[a:a + CHUNK]
        prompt = np.searchsorted(starts, np.arange(a, a + len(live)), side="right") - 1  # [chunk]
        rank = seen + np.cumsum(live) - 1 - before[prompt]  # [chunk] a survivor's place among its prompt's
        seen += int(live.sum())
        at_rank.append(a + np.flatnonzero(live & (rank == whole)))
        live &= rank < whole  # a view: clears `alive` past the whole ranks
    candidates = np.concatenate(at_rank) if at_rank else np.zeros(0, np.int64)  # [<= P]
    ties = np.empty(len(candidates), np.uint64)  # hashed a chunk at a time: Python's numbers are a chunk's
    for a in range(0, len(candidates), CHUNK):
        some = candidates[a:a + CHUNK]
        ties[a:a + len(some)] = [_stable_hash(seed, p, s) for p, s in zip(prompt_ids[some].tolist(),
                                                                           sample_indices[some].tolist())]
    alive[candidates[np.lexsort((candidates, ties))[:room]]] = True


def select_rows(prompt_ids: np.ndarray, sample_indices: np.ndarray, keys: np.ndarray, flags: np.ndarray | None,
                dedupe: bool, limit: int, seed: int) -> Selection:
    """Dedupe, decontaminate and cap to `limit` in one pass over 8-byte keys, no text.

    The rows, in (source_prompt_id, sample_index) order (stable, so shard order breaks ties): the first of each
    `keys` value (when `dedupe`), not `flags`, and at most `limit` of them covering prompts first: every prompt's
    first surviving row before any prompt's second. Ties are broken by a hash of (seed, prompt id, sample index),
    so the pick depends on the rows alone, not on the order shards finished in.

    Shards in that order already (plan_shards' always are) cost about a byte a row beyond the arrays given (a flag
    a row; the sorts work on a sixteenth of the keys at a time); shards out of order are sorted first (`order`,
    copies of the arrays).
    """
    n = len(keys)
    in_order = _in_order(prompt_ids, sample_indices)
    order = None
    if not in_order:
        order = np.lexsort((sample_indices, prompt_ids))  # [N] stable: rows with equal keys keep their shard order
        prompt_ids, sample_indices, keys = prompt_ids[order], sample_indices[order], keys[order]
        flags = None if flags is None else flags[order]
    alive = np.ones(n, dtype=bool)  # [N] in (prompt, sample) order
    if dedupe:
        _first_of_each_key(keys, alive)
    duplicates = n - int(alive.sum())
    contaminated = 0
    if flags is not None:
        copied = flags & alive
        contaminated = int(copied.sum())
        alive &= ~copied
        del copied
    survivors, limit = int(alive.sum()), max(limit, 0)
    over_target = max(survivors - limit, 0)
    if over_target:
        _cap(prompt_ids, sample_indices, alive, limit, seed)
    if in_order:
        return Selection(alive, None, True, duplicates, contaminated, over_target, survivors - over_target)
    kept = order[alive]  # [kept] shard-order positions, in the dataset's order
    keep = np.zeros(n, dtype=bool)
    keep[kept] = True
    return Selection(keep, np.searchsorted(np.flatnonzero(keep), kept), False, duplicates, contaminated,
                     over_target, len(kept))


class ShardFile(NamedTuple):
    """A shard file as its footer tells it (no row read)."""

    path: str  # in the store's filesystem
    counts: Counts
    schema: pa.Schema  # its kept rows' columns, without the marks
    rows: int
    nulls: frozenset[str]  # bool and integer columns holding a null, which pandas makes object and float columns


def _shard_files(out_dir: str | Path, num_shards: int | None) -> tuple[fsspec.AbstractFileSystem, list[ShardFile]]:
    """Every shard's footer: its counts, columns and rows (no row is read here)."""
    fs, root = store_of(out_dir)
    if num_shards is None:
        indices = sorted(int(p.rsplit("/", 1)[1][len("shard-"):-len(".parquet")])
                         for p in fs.glob(f"{root}/shard-*.parquet"))
    else:
        indices = list(range(num_shards))
        missing = [i for i in indices if not shard_done(out_dir, i)]
        if missing:
            raise FileNotFoundError(f"{out_dir}: shard(s) {missing} not written yet; run them before merging")
    found = []
    for i in indices:
        path = f"{root}/shard-{i:05d}.parquet"
        try:
            with fs.open(path, "rb") as f:
                meta = pq.ParquetFile(f).metadata
                schema = meta.schema.to_arrow_schema()
                counts = Counts.from_dict(json.loads(schema.metadata[COUNTS_KEY]))
                nulls = _null_columns(meta, schema)
        except Exception as e:
            raise DataError(f"{path}: not a readable shard ({type(e).__name__}: {e}); delete it and run the stage "
                            f"again to sample that shard anew") from None
        rows = schema.remove_metadata()
        rows = pa.schema([f for f in rows if f.name not in MARK_COLUMNS], metadata=schema.metadata)
        found.append(ShardFile(path, counts, rows, meta.num_rows, nulls))
    return fs, found


def _null_columns(meta: pq.FileMetaData, schema: pa.Schema) -> frozenset[str]:
    """The bool and integer columns with a null in some row group (from the footer's statistics)."""
    nullable = {f.name for f in schema if pa.types.is_boolean(f.type) or pa.types.is_integer(f.type)}
    found = set()
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for c in range(group.num_columns):
            column = group.column(c)
            if column.path_in_schema in nullable and (column.statistics is None or column.statistics.null_count):
                found.add(column.path_in_schema)  # no statistics: counted as holding one, as pandas would see
    return frozenset(found)


KeyBatch = tuple[np.ndarray, np.ndarray, np.ndarray, "np.ndarray | None"]  # prompt id, sample, key, contaminated


def shard_keys(fs: fsspec.AbstractFileSystem, shard: ShardFile, index: HeldoutIndex | None,
               batch_rows: int) -> Iterator[KeyBatch]:
    """A shard's (source_prompt_id, sample_index, dedupe key, contaminated) arrays, `batch_rows` rows at a time.

    The shard task's marks where it wrote them against this held-out set; else worked out here from the text
    (shards written before marks existed, or against another held-out set). A file that cannot be read, or a bad
    row, is a DataError naming the shard (and the row and column).
    """
    try:
        yield from _shard_keys(fs, shard, index, batch_rows)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{shard.path}: not a readable shard ({type(e).__name__}: {e}); delete it and run the "
                        f"stage again to sample that shard anew") from None


def _shard_keys(fs: fsspec.AbstractFileSystem, shard: ShardFile, index: HeldoutIndex | None,
                batch_rows: int) -> Iterator[KeyBatch]:
    with fs.open(shard.path, "rb") as f:
        pf = pq.ParquetFile(f, pre_buffer=False)  # pre-buffered, a file's column chunks stay until it closes
        names = set(pf.schema_arrow.names)
        missing = [c for c in ("prompt", "response", "source_prompt_id", "sample_index") if c not in names]
        if missing:
            raise DataError(f"{shard.path}: no column(s) {missing}; a shard's kept rows have {KEPT_COLUMNS}")
        stored = pf.schema_arrow.metadata or {}
        marked = "merge_key" in names and (index is None or (
            "contaminated" in names and stored.get(HELDOUT_KEY, b"").decode() == index.digest))
        columns = ["source_prompt_id", "sample_index", *(
            ["merge_key", *(["contaminated"] if index is not None else [])] if marked else ["prompt", "response"])]
        at = 0
        for batch in pf.iter_batches(batch_size=batch_rows, columns=columns):
            for name in columns:
                if batch.column(name).null_count:
                    row = at + pc.index(pc.is_null(batch.column(name)), True).as_py()
                    raise DataError(f"{shard.path}: row {row}, column {name!r}: empty; every kept row has one")
            at += len(batch)
            pid = batch.column("source_prompt_id").to_numpy(zero_copy_only=False)
            sample = batch.column("sample_index").to_numpy(zero_copy_only=False)
            if len(sample) and not 0 <= sample.min() <= sample.max() < 2**31:  # the merge keeps 4 bytes a row
                i = int(np.flatnonzero((sample < 0) | (sample >= 2**31))[0])
                raise DataError(f"{shard.path}: row {at - len(batch) + i}, column 'sample_index': {sample[i]} is "
                                f"not a sample's number (0 to 2**31-1, each prompt's samples counted from 0)")
            if marked:
                key = batch.column("merge_key").to_numpy(zero_copy_only=False)
                flag = batch.column("contaminated").to_numpy(zero_copy_only=False) if index is not None else None
            else:
                marks = mark_rows(batch.select(["prompt", "response"]).to_pandas(), index)
                key, flag = marks.row_key, marks.contaminated if index is not None else None
            yield pid, sample, key, flag


class _MergePlan(NamedTuple):
    fs: fsspec.AbstractFileSystem
    shards: list[ShardFile]
    selection: Selection
    counts: Counts  # through the merge
    appended: Appended  # the non-reasoning rows to append


def _miscounted(shard: ShardFile) -> DataError:
    return DataError(f"{shard.path}: its footer counts {shard.rows} rows but they do not read as that many; delete "
                     f"it and run the stage again to sample that shard anew")


def _plan_merge(out_dir: str | Path, cfg: RejectionConfig, heldout: pd.DataFrame | Sequence[Any] | None,
                non_reasoning: NonReasoning, num_shards: int | None,
                reader: "ShardReader | None" = None) -> _MergePlan:
    """Read every shard's keys (through `reader`; here by default) and decide which rows the dataset keeps; no text
    is held."""
    fs, shards = _shard_files(out_dir, num_shards)
    index = None
    if heldout is not None and cfg.decontamination_ngram:
        prompts = heldout["prompt"].tolist() if isinstance(heldout, pd.DataFrame) else list(heldout)
        index = build_heldout_index(prompts, cfg.decontamination_ngram, cfg.decontamination_threshold)
    # every row's keys in arrays sized from the footers' row counts, filled a batch at a time: 21 bytes a row
    n = sum(shard.rows for shard in shards)
    pid, sample, key = np.empty(n, np.int64), np.empty(n, np.int32), np.empty(n, np.uint64)
    flags = np.empty(n, bool) if index is not None else None
    starts = np.r_[0, np.cumsum([shard.rows for shard in shards])].astype(np.int64)  # [shards + 1]
    read = np.zeros(len(shards), np.int64)  # rows read of each shard
    for position, batch in (reader or LOCAL).keys(out_dir, shards, index, cfg.merge_batch_rows):
        shard, at = shards[position], int(starts[position] + read[position])
        if read[position] + len(batch[0]) > shard.rows:
            raise _miscounted(shard)
        for into, part in zip((pid, sample, key, flags), batch):
            if into is not None:
                into[at:at + len(part)] = part
        read[position] += len(batch[0])
    for shard, got in zip(shards, read):
        if got != shard.rows:
            raise _miscounted(shard)
    selection = select_rows(pid, sample, key, flags, cfg.dedupe, cfg.target_samples - cfg.non_reasoning_rows,
                            cfg.seed)
    counts = Counts.zero(cfg)
    for shard in shards:
        counts = counts.plus(shard.counts)
    dropped = dict(counts.dropped)
    dropped[DUPLICATE_ACROSS_SHARDS] += selection.duplicates
    dropped[CONTAMINATED] += selection.contaminated
    dropped[OVER_TARGET] += selection.over_target
    counts = counts._replace(kept=selection.kept, dropped=dropped)
    return _MergePlan(fs, shards, selection, counts, appended_rows(non_reasoning, cfg.non_reasoning_rows))


def kept_batches(fs: fsspec.AbstractFileSystem, shard: ShardFile, keep: np.ndarray,
                 batch_rows: int) -> Iterator[pa.RecordBatch]:
    """The kept rows of one shard (`keep`: [its rows] bool), `batch_rows` read at a time."""
    with fs.open(shard.path, "rb") as f:
        pf = pq.ParquetFile(f, pre_buffer=False)
        at = 0
        for batch in pf.iter_batches(batch_size=batch_rows, columns=shard.schema.names):
            kept = keep[at:at + len(batch)]
            at += len(batch)
            if kept.any():
                yield batch.filter(pa.array(kept))


def conformed(table: pa.Table, kind: str, schema: pa.Schema) -> pa.Table:
    """`table` with the dataset's columns (`schema`; missing ones null) and `kind` set where it has none."""
    if "kind" not in table.column_names:
        table = table.append_column("kind", pa.array([kind] * len(table), pa.string()))
    return pa.table([table.column(f.name).cast(f.type) if f.name in table.column_names
                     else pa.nulls(len(table), f.type) for f in schema], schema=schema)


class ShardReader(Protocol):
    """Where the merge's two reads of the shard files run: here (`LOCAL`), or on a cluster's nodes
    (grpo.rejection.ray_reader)."""

    def keys(self, out_dir: str | Path, shards: list[ShardFile], index: HeldoutIndex | None,
             batch_rows: int) -> Iterator[tuple[int, KeyBatch]]:
        """Every shard's `shard_keys`, each batch with its shard's place in `shards`, in any order."""

    def kept(self, out_dir: str | Path, shards: list[ShardFile], keep: np.ndarray, schema: pa.Schema,
             batch_rows: int) -> Iterator[pa.Table]:
        """The kept rows (`keep`: [every shard's rows] bool) of every shard, `conformed` to `schema` as reasoning
        rows, in shard order, about `batch_rows` at a time."""


class _Here:
    """Both reads in this process, a shard after another."""

    def keys(self, out_dir, shards, index, batch_rows):
        fs, _ = store_of(out_dir)
        for position, shard in enumerate(shards):
            for batch in shard_keys(fs, shard, index, batch_rows):
                yield position, batch

    def kept(self, out_dir, shards, keep, schema, batch_rows):
        fs, _ = store_of(out_dir)
        pending, held, start = [], 0, 0
        for shard in shards:
            for batch in kept_batches(fs, shard, keep[start:start + shard.rows], batch_rows):
                pending.append(conformed(pa.Table.from_batches([batch]), "reasoning", schema))
                held += len(batch)
                if held >= batch_rows:
                    yield pa.concat_tables(pending)
                    pending, held = [], 0
            start += shard.rows
        if pending:
            yield pa.concat_tables(pending)


LOCAL: ShardReader = _Here()


def merge_shards(out_dir: str | Path, cfg: RejectionConfig, heldout: pd.DataFrame | Sequence[Any] | None = None,
                 non_reasoning: NonReasoning = None, num_shards: int | None = None) -> RejectionResult:
    """The final dataset from the written shards: dedupe across shards, decontaminate, cap, add non-reasoning rows.

    `num_shards`: the planned count; any missing shard is then an error. Without it, every shard file is read.
    `heldout`: held-out prompts (a table with a `prompt` column, or the prompts themselves). `non_reasoning`: a
    frame, or Parquet files (a file, or a folder of part files); its first `cfg.non_reasoning_rows` rows are
    appended. The rows are chosen from the shards' keys (`select_rows`) and only the kept ones are read; the dataset
    is held in memory, which `write_merged` does not do.
    """
    plan = _plan_merge(out_dir, cfg, heldout, non_reasoning, num_shards)
    frames, start = [], 0
    for shard in plan.shards:
        if shard.rows:
            keep = plan.selection.keep[start:start + shard.rows]
            table = pa.Table.from_batches(list(kept_batches(plan.fs, shard, keep, cfg.merge_batch_rows)),
                                          schema=shard.schema)
            frame = as_frame(table)
            for column in shard.nulls & set(frame.columns):  # the dtype the whole shard's column converts to
                if frame[column].dtype == bool:
                    frame[column] = frame[column].astype(object)
                elif pd.api.types.is_integer_dtype(frame[column].dtype):
                    frame[column] = frame[column].astype(np.float64)
            frames.append(frame)
        start += shard.rows
    rows = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=KEPT_COLUMNS)
    if not plan.selection.in_order:
        rows = rows.iloc[plan.selection.order]
    rows = rows.reset_index(drop=True).assign(kind="reasoning")
    extra = appended_frame(plan.appended)
    dataset = pd.concat([rows, extra.assign(kind="non_reasoning")], ignore_index=True) if len(extra) else rows
    return RejectionResult(dataset, plan.counts, len(extra))


class MergedDataset(NamedTuple):
    files: list[str]  # the dataset's Parquet files, in row order (reasoning rows, then non-reasoning ones)
    counts: Counts  # as in RejectionResult
    rows: int  # rows written, non-reasoning ones included
    non_reasoning: int  # non-reasoning rows appended


def write_merged(out_dir: str | Path, cfg: RejectionConfig, dest: str | Path,
                 heldout: pd.DataFrame | Sequence[Any] | None = None, non_reasoning: NonReasoning = None,
                 num_shards: int | None = None, rows_per_file: int = 1_000_000,
                 reader: ShardReader | None = None) -> MergedDataset:
    """`merge_shards`' dataset written as Parquet files in `dest` (a folder or store URI) without holding it.

    The keys are read first and the rows chosen (`select_rows`); then each shard's kept rows are read and written
    `cfg.merge_batch_rows` at a time, so the text in memory is a batch's, whatever the row count; the keys take
    about 22 bytes a row at their peak. The non-reasoning rows follow, read `cfg.merge_batch_rows` at a time where
    they are files. The files hold the same rows in the same order as `merge_shards`' dataset.
    `reader`: where the shard files are read, here by default (`grpo.rejection.ray_reader.RayDataReader`: on a
    Ray cluster's nodes); the keys are decided on and the files written here either way.
    """
    plan = _plan_merge(out_dir, cfg, heldout, non_reasoning, num_shards, reader)
    if not plan.selection.in_order:
        raise DataError(f"{out_dir}: the shards' rows are not in (source_prompt_id, sample_index) order from one "
                        f"file to the next (plan_shards' shards always are), so they cannot be streamed in the "
                        f"dataset's order; merge_shards sorts them in memory")
    appended = plan.appended
    try:
        # the columns of shards that kept rows (an empty one's may be typed null); of every shard when none did
        columns = [s.schema.remove_metadata() for s in plan.shards if s.rows] or [
            s.schema.remove_metadata() for s in plan.shards]
        schema = pa.unify_schemas(columns + [pa.schema([("kind", pa.string())])]
                                  + ([appended.schema] if appended.rows else []), promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise DataError(f"{out_dir}: shard and non-reasoning columns do not agree ({e})") from None

    def batches() -> Iterator[pa.Table]:  # the dataset in order, about `merge_batch_rows` rows at a time
        yield from (reader or LOCAL).kept(out_dir, plan.shards, plan.selection.keep, schema, cfg.merge_batch_rows)
        for table in appended_tables(appended, cfg.merge_batch_rows):
            yield conformed(table, "non_reasoning", schema)

    files, written = write_parts(batches(), dest, schema, rows_per_file)
    return MergedDataset(files, plan.counts, written, appended.rows)
