"""SFT rows as tokens: a small frame tokenized in memory, or a dataset of Parquet files (the curated one, any size)
tokenized once, a batch at a time, into an Arrow file that the loop then reads memory-mapped.

Both give the same `Example` for row i, so a loop takes the same batches from either. The Arrow file sits in the
loop's output folder, named by what decides its tokens (the files' bytes, the tokenizer, `max_seq_len`): a resumed
run maps it again instead of tokenizing. Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import NamedTuple, Sequence

import pandas as pd
import pyarrow as pa
from transformers import PreTrainedTokenizerBase

from grpo.data.row_files import content_digest, frames, parquet_files
from grpo.data.tables import DataError
from grpo.sampling.local import render_prompts, response_text


# rows tokenized at a time: their token lists are Python ints (~36 bytes a token), 256 rows of 4k tokens ~75 MiB
TOKENIZE_ROWS = 256


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
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(responses, add_special_tokens=False)["input_ids"]
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


class TokenizedRows(Sequence[Example]):
    """Tokenized rows in an Arrow table (mapped from its file): row i as an `Example`, read when asked for, and
    every row's token counts as lists without reading any tokens."""

    def __init__(self, table: pa.Table):
        self.table = table
        self.lengths: list[int] = table.column("length").to_pylist()  # [N] tokens of each row
        self.label_tokens: list[int] = table.column("label_tokens").to_pylist()  # [N] tokens its loss counts
        self._ids, self._labels = table.column("input_ids"), table.column("labels")

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, i):  # an index from `batch_indices`
        return Example(self._ids[i].as_py(), self._labels[i].as_py())


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
                   cache_dir: str | Path, source: str = "dataset", batch_rows: int = TOKENIZE_ROWS) -> TokenizedRows:
    """The rows of Parquet files (or folders of them), read in order as one table, tokenized `batch_rows` at a
    time into `cache_dir/tokens-<key>.arrow` (written aside and moved into place, so a file there is whole) and
    mapped from it. A prompt too long fails here naming its file and row, before any training."""
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
                        writer.write_batch(as_batch(tokenize_rows(frame, tokenizer, max_seq_len, name, at)))
            os.replace(tmp, cache)  # each process of a launch may write it: the same bytes, the last move wins
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return TokenizedRows(pa.ipc.open_file(pa.memory_map(str(cache))).read_all())


def tokenized(rows: pd.DataFrame | Sequence[str | Path], tokenizer: PreTrainedTokenizerBase, max_seq_len: int,
              cache_dir: str | Path, source: str = "dataset") -> Sequence[Example]:
    """A frame's rows tokenized in memory, or Parquet files' tokenized into (or mapped from) `cache_dir`."""
    if isinstance(rows, pd.DataFrame):
        return tokenize_rows(rows, tokenizer, max_seq_len, source)
    return tokenize_files(rows, tokenizer, max_seq_len, cache_dir, source)


def token_counts(examples: Sequence[Example]) -> tuple[list[int], list[int]]:
    """Every row's tokens and the tokens its loss counts; a mapped table has them without reading its tokens."""
    if isinstance(examples, TokenizedRows):
        return examples.lengths, examples.label_tokens
    return [len(e.input_ids) for e in examples], [label_count(e.labels) for e in examples]
