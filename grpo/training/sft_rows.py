"""SFT rows as tokens: a small frame tokenized in memory, or a dataset of Parquet files (the curated one, any size)
tokenized once, a batch at a time, into an Arrow file that the loop then reads a row at a time.

Both give the same `Example` for row i, so a loop takes the same batches from either. The Arrow file sits in the
loop's output folder, named by what decides its tokens (the files' bytes, the tokenizer, `max_seq_len`): a resumed
run reads it again instead of tokenizing. What the process holds is bounded by settings, not by the row count: the
rows of one Parquet read (`TOKENIZE_ROWS`), the text of one tokenizer call (`TOKENIZE_CHARS`), the rows the loop asks
for; per row only its token counts and place in the file (16 bytes). Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import tempfile
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
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
                       join(starts, np.int64), np.array(ids_at, np.int64), np.array(labels_at, np.int64))


class TokenizedRows(Sequence[Example]):
    """Tokenized rows in an Arrow file: row i as an `Example`, read from the file when asked for (two reads), and
    every row's token counts as arrays without reading any tokens.

    A row is read, not mapped: this process holds the rows it is asked for and 16 bytes a row, while the file's
    pages stay the kernel's page cache (an epoch's random reads through a map would leave the whole file counted in
    this process's memory, its resident set growing with the rows)."""

    def __init__(self, path: str | Path):
        self.places = token_places(path)
        self.lengths, self.label_tokens = self.places.lengths, self.places.label_tokens
        self._fd = os.open(path, os.O_RDONLY)
        if hasattr(os, "posix_fadvise"):  # rows are read in a random order: no read-ahead past what is asked for
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)

    def __del__(self):
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i):  # an index from `batch_indices`
        i = int(i) + (len(self) if i < 0 else 0)
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        p = self.places
        batch = int(np.searchsorted(p.first, i, side="right")) - 1  # a lookup, not a walk over the batches
        n, at = 4 * int(p.lengths[i]), 4 * int(p.start[i])  # bytes of the row's int32 tokens, and their place
        return Example(np.frombuffer(os.pread(self._fd, n, int(p.ids_at[batch]) + at), np.int32).tolist(),
                       np.frombuffer(os.pread(self._fd, n, int(p.labels_at[batch]) + at), np.int32).tolist())


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


def tokenize_files(paths: Sequence[str | Path], tokenizer: PreTrainedTokenizerBase, max_seq_len: int,
                   cache_dir: str | Path, source: str = "dataset", batch_rows: int = TOKENIZE_ROWS,
                   max_chars: int = TOKENIZE_CHARS) -> TokenizedRows:
    """The rows of Parquet files (or folders of them), read in order as one table `batch_rows` at a time and
    tokenized at most `max_chars` characters a call, into `cache_dir/tokens-<key>.arrow` (written aside and moved
    into place, so a file there is whole), then read from it a row at a time (`TokenizedRows`). A prompt too long
    fails here naming its file and row, before any training."""
    files = [f for p in paths for f in parquet_files(p)]
    cache = Path(cache_dir) / f"tokens-{tokens_key(files, tokenizer, max_seq_len)}.arrow"
    if not cache.exists():
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache.parent, prefix=f".{cache.name}.", suffix=".tmp")
        os.close(fd)
        try:
            with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, SCHEMA) as writer:
                for file in files:
                    name = f"{source} ({file.name})" if len(files) > 1 else source
                    for at, frame in frames(file, ["prompt", "response"], batch_rows):
                        chars = frame["prompt"].map(lambda c: len(str(c))) + frame["response"].str.len()
                        for run in text_runs(chars.tolist(), max_chars):
                            writer.write_batch(as_batch(tokenize_rows(frame.iloc[run], tokenizer, max_seq_len, name,
                                                                      at + run.start)))
            os.replace(tmp, cache)  # each process of a launch may write it: the same bytes, the last move wins
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return TokenizedRows(cache)


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
