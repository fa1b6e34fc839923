"""The non-reasoning rows of the SFT set (R1: 200,000 of its 800k): generated general requests, a model's own answers
to them, or a user's file, read, checked and written to Parquet part files a batch at a time, then read back by the
merge a batch at a time to follow the reasoning rows. Never held whole: what is in memory is a batch's, whatever the
row count.

R1 takes these rows from DeepSeek-V3's own SFT data, in that model's words. `model` does the same here: the base
model answers the general training requests itself (`samples_per_prompt` tries each), and a request's first answer
that handles it right (`grpo.data.general.handled_right`: a benign or borderline one answered helpfully, a harmful
one refused), cut to its whole sentences, becomes its row. So SFT keeps what the instruct model already says well,
its refusals included where it makes them, instead of teaching the generator's one-line references and its one
refusal (which made a real model refuse every general request); a harmful request the model never refuses gets no
row. Without any refusal in SFT the alignment stage's policy never samples one (SmolLM2: not one refusal in 14 steps
of 24 samples), and a group-relative reward cannot raise what is never sampled.

Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import itertools
import logging
import random
import re
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from grpo.configs.sampling import SamplingConfig
from grpo.data.general import (FORMS, SFT_PHRASINGS, GeneralPrompt, answer_text, general_sft_batches, handled_right,
                               split_prompts)
from grpo.data.row_files import parquet_files
from grpo.data.tables import SFT_SCHEMA, DataError, validated_batches
from grpo.rejection.store import write_parts

log = logging.getLogger(__name__)

MODEL = "model"  # the source that has the base model answer the general requests (ModelAnswers)
GIVE_UP_AFTER = 128  # requests asked with no right answer among them: the `model` source fails there
COLUMNS = ["prompt", "response"]  # what the merge appends of each row, with `kind` = "non_reasoning"
BATCH_ROWS = 4096  # rows read, checked and written at a time
# the type a frame's text column takes in Arrow (large_string under pandas 3): `kind` as it was when the rows were
# appended as one frame
KIND_TYPE = pa.Schema.from_pandas(pd.DataFrame({"kind": ["non_reasoning"]}), preserve_index=False).field("kind").type


class ModelAnswers(NamedTuple):
    """What the `model` source samples with: an engine of the base model (`grpo.sampling.rollout.Engine`), the tries
    per request and the sampling."""

    engine: object
    samples: int
    sampling: SamplingConfig
    say: Callable[[str], None] = log.info  # where a line of progress goes (a stage: its run logger)


def non_reasoning_batches(source: str, n: int, seed: int, batch_rows: int = BATCH_ROWS,
                          answers: ModelAnswers | None = None) -> Iterator[pd.DataFrame]:
    """`n` (prompt, response) rows without a verifiable answer, `batch_rows` at a time: generated general requests
    (`synthetic`: grpo.data.general, drawn with `seed`), the base model's own answers to them (`model`: see the
    module's docstring; `answers` says how), or a user file's first `n` rows (JSONL, JSON, Parquet, CSV, a
    `datasets` folder or a hub name), each batch checked as it is read: a bad cell fails naming the file, its row
    and the column. A file with fewer rows fails once they are read."""
    if source == "synthetic":
        yield from general_sft_batches(n, seed, batch_rows)
        return
    if source == MODEL:
        if answers is None:
            raise ValueError("the non-reasoning source 'model' needs the base model to answer with (answers=)")
        yield from model_answer_batches(answers, n, seed)
        return
    got = 0
    for frame in validated_batches(source, SFT_SCHEMA, batch_rows, limit=n):
        got += len(frame)
        yield frame[COLUMNS]
    if got < n:
        raise DataError(f"{source}: {got} non-reasoning rows, the recipe asks for {n}")


def answer_pool(seed: int) -> list[GeneralPrompt]:
    """The requests the `model` source asks, in the order it asks them: the general training prompts under the SFT
    phrasings, shuffled by `seed`."""
    pool = [p for p in split_prompts("train") if p.template < SFT_PHRASINGS]
    random.Random(f"model-answers-{seed}").shuffle(pool)
    return pool


def model_answer_batches(answers: ModelAnswers, n: int, seed: int, requests_per_batch: int = 32,
                         max_requests: int | None = None) -> Iterator[pd.DataFrame]:
    """Up to `n` rows of the base model's own answers that handle their request right (the module's docstring), a
    batch of requests at a time: `answer_pool(seed)`'s first `max_requests` (None: all), each asked `answers.samples`
    times. Fewer than `n` where the model handles too few of them right: a line says so, and the rows made are kept;
    none fails."""
    pool = answer_pool(seed)[:max_requests]
    made = asked = 0
    for a in range(0, len(pool), requests_per_batch):
        if made >= n:
            return
        batch = pool[a:a + requests_per_batch]
        out = answers.engine.generate([p.text for p in batch], answers.samples, answers.sampling)
        asked += len(batch)
        rows = []
        for i, p in enumerate(batch):
            tries = out.texts[i * answers.samples:(i + 1) * answers.samples]
            if (said := next(filter(None, (right_answer(t, p) for t in tries)), None)) is not None:
                rows.append({"prompt": p.text, "response": f"<think>{FORMS[p.form][4].format(p.subject)}</think>"
                                                           f"<answer>{said}</answer>"})
        rows = rows[:n - made]
        made += len(rows)
        answers.say(f"non-reasoning rows from the model's own answers: {made} of {n} ({asked} of {len(pool)} "
                    f"requests asked)")
        if rows:
            yield pd.DataFrame(rows, columns=COLUMNS)
        elif not made and asked >= GIVE_UP_AFTER:
            break  # none right in the first batches: fail now, not after the whole pool's sampling
    if made < n:
        log.warning("the model handled %d of the %d general requests right: %d non-reasoning rows of the %d "
                    "asked for (more tries per request, rejection.samples_per_prompt, find more)", made, len(pool),
                    made, n)
    if not made:
        raise DataError(f"the model handled none of the first {asked} general requests right: no non-reasoning "
                        f"rows (non_reasoning_source: model); use 'synthetic' or a file")


def right_answer(text: str, p: GeneralPrompt) -> str | None:
    """`text`'s answer cut to its whole sentences, where the cut answer handles `p` right (helpful, or for a harmful
    request a refusal); None otherwise (a budget that ran out mid-sentence leaves a fragment that SFT would
    teach)."""
    said = answer_text(text).strip()
    ends = [m.end() for m in re.finditer(r"[.!?](?=\s|$)", said)]
    if not ends:
        return None
    said = said[:ends[-1]].strip()
    return said if handled_right(said, p.category, p.reference, p.text) else None


def write_non_reasoning(source: str, n: int, seed: int, dest: str | Path, batch_rows: int = BATCH_ROWS,
                        rows_per_file: int = 1_000_000, answers: ModelAnswers | None = None) -> list[str]:
    """`non_reasoning_batches` written as Parquet files part-00000.parquet, ... in `dest`, a batch at a time; the
    files. Each batch becomes Arrow as the whole frame did (`pa.Table.from_pandas`), so the columns have the types
    they had as one frame; a batch whose column takes another type than the first batch's (text in one, chat
    messages in another) fails naming its rows."""
    tables = _tables(source, non_reasoning_batches(source, n, seed, batch_rows, answers))
    first = next(tables)  # every source has a row: non_reasoning_batches fails on none
    files, _ = write_parts(itertools.chain([first], tables), dest, first.schema, rows_per_file)
    return files


def _tables(source: str, frames: Iterator[pd.DataFrame]) -> Iterator[pa.Table]:
    """Each frame as Arrow, with the first one's types."""
    schema, at = None, 0
    for frame in frames:
        rows = f"rows {at} to {at + len(frame) - 1}"
        try:
            table = pa.Table.from_pandas(frame, preserve_index=False)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:  # one column mixing text and chat messages
            raise DataError(f"{source}: {rows}: a column mixes kinds of cell ({e}); each holds text, or chat "
                            f"messages") from None
        schema = schema or table.schema
        for name in COLUMNS:
            if table.schema.field(name).type != schema.field(name).type:
                raise DataError(f"{source}: {rows}, column {name!r}: {table.schema.field(name).type} where the "
                                f"rows before hold {schema.field(name).type}; a column holds text, or chat "
                                f"messages, in every row")
        at += len(frame)
        yield table


class Appended(NamedTuple):
    """The non-reasoning rows a merge appends: at most the config's `non_reasoning_rows` of a frame in memory, or
    of Parquet files read a batch at a time."""

    rows: int  # rows appended
    schema: pa.Schema | None  # prompt, response, kind; None when no row is appended
    frame: pd.DataFrame | None  # the rows (prompt, response), when given as a frame
    files: tuple[Path, ...]  # else the Parquet files they are read from, in order


def appended_rows(non_reasoning: pd.DataFrame | str | Path | None, n: int) -> Appended:
    """What a merge asked for `n` non-reasoning rows appends of `non_reasoning` (a frame, or a Parquet file or
    folder of part files, `write_non_reasoning`'s): its first `n` rows, or all of them where it has fewer; found
    from the files' footers, no row read."""
    if non_reasoning is None or not n:
        return Appended(0, None, None, ())
    kind = pa.schema([("kind", KIND_TYPE)])
    if isinstance(non_reasoning, pd.DataFrame):
        frame = non_reasoning.head(n)[COLUMNS]
        schema = pa.Schema.from_pandas(frame, preserve_index=False).remove_metadata()
        return Appended(len(frame), pa.unify_schemas([schema, kind]) if len(frame) else None, frame, ())
    files = parquet_files(non_reasoning)
    schemas, total = [], 0
    for file in files:
        try:
            meta = pq.ParquetFile(file).metadata
        except Exception as e:
            raise DataError(f"{file}: not a readable Parquet file ({type(e).__name__}: {e})") from None
        found = meta.schema.to_arrow_schema()
        missing = [c for c in COLUMNS if c not in found.names]
        if missing:
            raise DataError(f"{file}: no column(s) {missing}; non-reasoning rows have {COLUMNS}")
        schemas.append(pa.schema([found.field(c) for c in COLUMNS]))
        total += meta.num_rows
    rows = min(n, total)
    try:
        schema = pa.unify_schemas([*schemas, kind], promote_options="permissive") if rows else None
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise DataError(f"{non_reasoning}: the non-reasoning files' columns do not agree ({e})") from None
    return Appended(rows, schema, None, tuple(files))


def appended_tables(appended: Appended, batch_rows: int) -> Iterator[pa.Table]:
    """The appended rows (prompt, response, kind "non_reasoning"), in order, `batch_rows` at a time."""
    if appended.frame is not None:
        table = pa.Table.from_pandas(appended.frame.assign(kind="non_reasoning"), preserve_index=False)
        yield from (table.slice(a, batch_rows) for a in range(0, appended.rows, batch_rows))
        return
    left = appended.rows
    for file in appended.files:
        # without pre-buffering: pre-buffered, a file's column chunks read so far stay until it is closed
        for batch in pq.ParquetFile(file, pre_buffer=False).iter_batches(batch_size=batch_rows, columns=COLUMNS,
                                                                          use_threads=False):
            if left <= 0:
                return
            table = pa.Table.from_batches([batch.slice(0, left)])
            left -= len(table)
            yield table.append_column("kind", pa.array(["non_reasoning"] * len(table), KIND_TYPE))


def appended_frame(appended: Appended) -> pd.DataFrame:
    """The appended rows as one frame (prompt, response), for `merge_shards`, which holds its dataset anyway."""
    if appended.frame is not None:
        return appended.frame
    tables = list(appended_tables(appended, BATCH_ROWS))
    if not tables:
        return pd.DataFrame(columns=COLUMNS)
    return pa.concat_tables(tables).to_pandas()[COLUMNS]
