"""SFT rows as tokens: a small frame tokenized in memory, or a dataset of Parquet files (the curated one, any size)
tokenized once, a batch at a time, into Arrow files that the loop then reads a row at a time.

Both give the same `Example` for row i, so a loop takes the same batches from either. The Arrow files sit in the
loop's output folder, named by what decides their tokens (the files' bytes, the tokenizer, `max_seq_len`): a resumed
run reads them again instead of tokenizing. The processes of a launch tokenize once between them: each its own
contiguous share of the rows into a part file, then every process reads all the parts, in order, as one sequence.
What a process holds is bounded by settings, not by the row count: the rows of one Parquet read (`TOKENIZE_ROWS`),
the text of one tokenizer call (`TOKENIZE_CHARS`), the rows the loop asks for; per row only its token counts and place
in the files (16 bytes). Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import tempfile
import time
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch.distributed as dist
from transformers import PreTrainedTokenizerBase

from grpo.data.row_files import content_digest, frames, parquet_files
from grpo.data.tables import DataError
from grpo.sampling.local import render_prompts, response_text


# rows read from a Parquet file at a time (the row group being read is decoded whole besides)
TOKENIZE_ROWS = 256
# text (characters of prompt + response) in one tokenizer call, a longer row alone: its encodings and token lists
# cost ~120 bytes a character (tiny recipe's tokenizer, 4 KB rows: peak +58 MiB at 64 Ki, +108 MiB at 512 Ki,
# +169 MiB at 256 rows, ~1 MiB), at the same rows a second
TOKENIZE_CHARS = 1 << 19
# how long a process waits for another's part before naming it missing: 10 minutes and a second for every 10 rows of
# a share (~10x under the slowest rate measured: 93 rows/s of 4 KB rows on a busy 2-core machine)
PART_WAIT_S, PART_ROWS_PER_S = 600, 10


class Example(NamedTuple):
    input_ids: list[int]  # prompt + response + end-of-turn
    labels: list[int]  # -100 on prompt tokens


def tokenize_rows(rows: pd.DataFrame, tokenizer: PreTrainedTokenizerBase, max_seq_len: int, source: str = "dataset",
                  first_row: int = 0) -> list[Example]:
    """Chat-format each row and mask the prompt out of the labels; a prompt that leaves no room fails here.

    `first_row`: the number of `rows`' first row in `source`, named in that error."""
    cells = rows["prompt"].tolist()
    prompts = render_prompts(tokenizer, cells)
    responses = [response_text(tokenizer, c, p, r) for c, p, r in zip(cells, prompts, rows["response"].tolist())]
    if not prompts:
        return []
    # one call for all rows: the same ids as one call a row, encoded in the tokenizer's own batches
    prompt_ids = tokenizer(prompts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    response_ids = tokenizer(responses, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    examples = []
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        if len(p) >= max_seq_len:
            raise DataError(f"{source}: row {first_row + i}, column 'prompt': {len(p)} tokens leave no room for the "
                            f"response within max_seq_len={max_seq_len}")
        ids = (p + r)[:max_seq_len]
        examples.append(Example(ids, ([-100] * len(p) + r)[:max_seq_len]))
    return examples


def label_count(labels: list[int]) -> int:
    """The tokens of a row the loss counts: labels not -100 once the model shifts them by one."""
    return len(labels) - 1 - labels[1:].count(-100)


SCHEMA = pa.schema([("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32())),
                    ("length", pa.int32()), ("label_tokens", pa.int32())])


class TokenPlaces(NamedTuple):
    """Where each row of a token file lies, and its token counts: 16 bytes a row, no token."""

    lengths: np.ndarray  # [N] int32 tokens of each row
    label_tokens: np.ndarray  # [N] int32 the tokens its loss counts
    first: np.ndarray  # [B+1] int64 each record batch's first row, then N
    start: np.ndarray  # [N] int64 a row's first token within its record batch
    ids_at: np.ndarray  # [B] int64 file offset of each record batch's input_ids values
    labels_at: np.ndarray  # [B] int64 and of its labels
    part: np.ndarray  # [B] int32 the file each record batch lies in (0 for one file)


def token_places(path: str | Path, release_batches: int = 64) -> TokenPlaces:
    """Read from the file mapped, a record batch at a time, its pages let go every `release_batches` batches (each
    batch's offsets are a few bytes, but each page touched maps its neighbours too: ~130 KB a batch)."""
    lengths, label_tokens, first, starts, ids_at, labels_at = [], [], [0], [], [], []
    with open(path, "rb") as f:
        whole = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # unmapped with the last view of it, as this returns
    view = pa.py_buffer(whole)  # a buffer's place in this view is its place in the file
    reader = pa.ipc.open_file(pa.BufferReader(view))
    for k in range(reader.num_record_batches):
        batch = reader.get_batch(k)  # views of the map, not copies
        ids, labels = batch.column("input_ids"), batch.column("labels")
        offsets = ids.offsets.to_numpy()
        if not np.array_equal(offsets, labels.offsets.to_numpy()):
            raise DataError(f"{path}: input_ids and labels differ in length; delete the file to tokenize again")
        ids_at.append(ids.values.buffers()[1].address - view.address + 4 * ids.values.offset)
        labels_at.append(labels.values.buffers()[1].address - view.address + 4 * labels.values.offset)
        starts.append(offsets[:-1].astype(np.int64))
        lengths.append(np.array(batch.column("length").to_numpy(), np.int32))  # copies, not views
        label_tokens.append(np.array(batch.column("label_tokens").to_numpy(), np.int32))
        first.append(first[-1] + batch.num_rows)
        if hasattr(whole, "madvise") and k % release_batches == release_batches - 1:
            whole.madvise(mmap.MADV_DONTNEED)  # the pages stay in the kernel's page cache
    join = lambda parts, dtype: np.concatenate(parts) if parts else np.zeros(0, dtype)  # noqa: E731
    return TokenPlaces(join(lengths, np.int32), join(label_tokens, np.int32), np.array(first, np.int64),
                       join(starts, np.int64), np.array(ids_at, np.int64), np.array(labels_at, np.int64),
                       np.zeros(len(ids_at), np.int32))


def joined_places(parts: list[TokenPlaces]) -> TokenPlaces:
    """Part files' places as one file's: rows and record batches numbered on from the part before."""
    rows = np.cumsum([0] + [len(p.lengths) for p in parts])  # [P+1] each part's first row, then N
    cat = lambda field: np.concatenate([getattr(p, field) for p in parts])  # noqa: E731
    return TokenPlaces(cat("lengths"), cat("label_tokens"),
                       np.concatenate([p.first[:-1] + n for p, n in zip(parts, rows)] + [rows[-1:]]),
                       cat("start"), cat("ids_at"), cat("labels_at"),
                       np.concatenate([np.full(len(p.ids_at), k, np.int32) for k, p in enumerate(parts)]))


class TokenizedRows(Sequence[Example]):
    """Tokenized rows in Arrow files, read as one sequence in the order given: row i as an `Example`, read from its
    file when asked for (two reads), and every row's token counts as arrays without reading any tokens.

    A row is read, not mapped: this process holds the rows it is asked for and 16 bytes a row, while the files'
    pages stay the kernel's page cache (an epoch's random reads through a map would leave the whole file counted in
    this process's memory, its resident set growing with the rows). `tokenized`: the rows this process tokenized
    into them (0 where it found them written)."""

    def __init__(self, *paths: str | Path, tokenized: int = 0):
        self.places = joined_places([token_places(p) for p in paths])
        self.lengths, self.label_tokens = self.places.lengths, self.places.label_tokens
        self.tokenized = tokenized
        self._fds = [os.open(p, os.O_RDONLY) for p in paths]
        for fd in self._fds:
            if hasattr(os, "posix_fadvise"):  # rows are read in a random order: no read-ahead past what is asked for
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)

    def __del__(self):
        for fd in getattr(self, "_fds", ()):
            os.close(fd)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i):  # an index from `batch_indices`
        i = int(i) + (len(self) if i < 0 else 0)
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        p = self.places
        batch = int(np.searchsorted(p.first, i, side="right")) - 1  # a lookup, not a walk over the batches
        n, at = 4 * int(p.lengths[i]), 4 * int(p.start[i])  # bytes of the row's int32 tokens, and their place
        fd = self._fds[p.part[batch]]
        return Example(np.frombuffer(os.pread(fd, n, int(p.ids_at[batch]) + at), np.int32).tolist(),
                       np.frombuffer(os.pread(fd, n, int(p.labels_at[batch]) + at), np.int32).tolist())


def text_runs(chars: Sequence[int], max_chars: int) -> list[slice]:
    """Consecutive rows (`chars`: each one's characters) in runs of at most `max_chars` characters, in order; a
    longer row alone.

    >>> text_runs([3, 4, 2, 9, 1], 7)
    [slice(0, 2, None), slice(2, 3, None), slice(3, 4, None), slice(4, 5, None)]
    """
    runs: list[slice] = []
    start, used = 0, 0
    for i, n in enumerate(chars):
        if i > start and used + n > max_chars:
            runs.append(slice(start, i))
            start, used = i, 0
        used += n
    return runs + ([slice(start, len(chars))] if len(chars) > start else [])


def as_batch(examples: list[Example]) -> pa.RecordBatch:
    return pa.record_batch([pa.array([e.input_ids for e in examples], SCHEMA.field("input_ids").type),
                            pa.array([e.labels for e in examples], SCHEMA.field("labels").type),
                            pa.array([len(e.input_ids) for e in examples], pa.int32()),
                            pa.array([label_count(e.labels) for e in examples], pa.int32())], schema=SCHEMA)


def tokens_key(files: list[Path], tokenizer: PreTrainedTokenizerBase, max_seq_len: int) -> str:
    """What decides the tokens: the files' bytes, the tokenizer and its chat template, the length limit."""
    described = json.dumps([content_digest(files), type(tokenizer).__name__, tokenizer.name_or_path, len(tokenizer),
                            tokenizer.chat_template, tokenizer.eos_token, max_seq_len], default=str)
    return hashlib.sha256(described.encode()).hexdigest()[:16]


def launch_place() -> tuple[int, int]:
    """This process's rank in its launch and the launch's processes: the process group's where one is up, else what
    the launcher set (torchrun's and `accelerate launch`'s RANK and WORLD_SIZE), else (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def row_share(counts: Sequence[int], rank: int, ranks: int) -> list[tuple[int, int, int]]:
    """Process `rank` of `ranks`'s contiguous share of files of `counts` rows, read in order as one table: each
    file it takes rows of, as (file, first row, row past the last), in the file's own row numbers.

    >>> row_share([8, 8, 5], 1, 2)  # rows 10 to 20 of 21
    [(1, 2, 8), (2, 0, 5)]
    """
    total = sum(counts)
    lo, hi = total * rank // ranks, total * (rank + 1) // ranks  # of the whole table
    share, first = [], 0  # first: the file's first row in the whole table
    for k, n in enumerate(counts):
        if max(lo - first, 0) < min(hi - first, n):
            share.append((k, max(lo - first, 0), min(hi - first, n)))
        first += n
    return share


def tokenize_share(files: list[Path], share: list[tuple[int, int, int]], tokenizer: PreTrainedTokenizerBase,
                   max_seq_len: int, path: Path, source: str, batch_rows: int, max_chars: int) -> int:
    """Rows `share` (`row_share`) tokenized into the Arrow file `path`, written aside and moved into place (so a
    file there is whole); the rows tokenized. A prompt too long fails naming its file and row."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    done = 0
    try:
        with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, SCHEMA) as writer:
            for k, start, stop in share:
                name = f"{source} ({files[k].name})" if len(files) > 1 else source
                for at, frame in frames(files[k], ["prompt", "response"], batch_rows):
                    if at + len(frame) <= start:  # before the share: read past, not tokenized
                        continue
                    if at >= stop:
                        break
                    cut = slice(max(start - at, 0), min(stop - at, len(frame)))
                    frame, at = frame.iloc[cut], at + cut.start
                    chars = frame["prompt"].map(lambda c: len(str(c))) + frame["response"].str.len()
                    for run in text_runs(chars.tolist(), max_chars):
                        examples = tokenize_rows(frame.iloc[run], tokenizer, max_seq_len, name, at + run.start)
                        writer.write_batch(as_batch(examples))
                        done += len(examples)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return done


def wait_for_parts(parts: list[Path], timeout_s: float) -> None:
    """Every process's part in place: past a barrier where a process group is up, then (the files of another machine
    may take a moment to show) until each is there, or an error naming the first missing after `timeout_s`."""
    if len(parts) > 1 and dist.is_available() and dist.is_initialized():
        dist.barrier()
    deadline = time.monotonic() + timeout_s
    for rank, part in enumerate(parts):
        while not part.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{part}: process {rank} of {len(parts)} wrote no tokens within {timeout_s:.0f} s "
                                   f"(did it fail? do the processes share this folder?)")
            time.sleep(0.5)


def tokenize_files(paths: Sequence[str | Path], tokenizer: PreTrainedTokenizerBase, max_seq_len: int,
                   cache_dir: str | Path, source: str = "dataset", batch_rows: int = TOKENIZE_ROWS,
                   max_chars: int = TOKENIZE_CHARS, wait_s: float | None = None) -> TokenizedRows:
    """The rows of Parquet files (or folders of them), read in order as one table `batch_rows` at a time and
    tokenized at most `max_chars` characters a call, then read a row at a time (`TokenizedRows`). A prompt too long
    fails here naming its file and row, before any training.

    Each of a launch's processes (`launch_place`) tokenizes its contiguous share of the rows into
    `cache_dir/tokens-<key>-<rank>-of-<ranks>.arrow`, then waits for the others' (`wait_s`, by default
    `PART_WAIT_S` and a second for every `PART_ROWS_PER_S` rows of a share) and reads them all; a part already
    there is not tokenized again."""
    files = [f for p in paths for f in parquet_files(p)]
    rank, ranks = launch_place()
    key = tokens_key(files, tokenizer, max_seq_len)
    parts = [Path(cache_dir) / f"tokens-{key}-{r}-of-{ranks}.arrow" for r in range(ranks)]
    counts = [pq.ParquetFile(f).metadata.num_rows for f in files]
    done = 0
    if not parts[rank].exists():
        parts[rank].parent.mkdir(parents=True, exist_ok=True)
        done = tokenize_share(files, row_share(counts, rank, ranks), tokenizer, max_seq_len, parts[rank], source,
                              batch_rows, max_chars)
    wait_for_parts(parts, PART_WAIT_S + sum(counts) / ranks / PART_ROWS_PER_S if wait_s is None else wait_s)
    return TokenizedRows(*parts, tokenized=done)


def tokenized(rows: pd.DataFrame | Sequence[str | Path], tokenizer: PreTrainedTokenizerBase, max_seq_len: int,
              cache_dir: str | Path, source: str = "dataset") -> Sequence[Example]:
    """A frame's rows tokenized in memory, or Parquet files' tokenized into (or read from) `cache_dir`."""
    if isinstance(rows, pd.DataFrame):
        return tokenize_rows(rows, tokenizer, max_seq_len, source)
    return tokenize_files(rows, tokenizer, max_seq_len, cache_dir, source)


def token_counts(examples: Sequence[Example]) -> tuple[Sequence[int], Sequence[int]]:
    """Every row's tokens and the tokens its loss counts; a token file has them (as arrays) without reading its
    tokens."""
    if isinstance(examples, TokenizedRows):
        return examples.lengths, examples.label_tokens
    return [len(e.input_ids) for e in examples], [label_count(e.labels) for e in examples]
