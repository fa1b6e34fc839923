"""Loading and validating datasets: user files and hub datasets, checked before training starts.

Rows come in two shapes:
- SFT rows: `prompt` (str or chat messages) and `response` (`<think>...</think><answer>...</answer>`);
- RL rows: `prompt` and `answer` (the reference a reward checks against), or, for code, `prompt` and tests
  (`tests`, `io_tests`, optional `setup`: grpo.rewards.code), which need no answer.
A dataset's own column names are mapped onto these roles by `DataConfig.columns`, and the reference answer is read
from its column as `DataConfig.answer_format` says (grpo.data.formats), so every consumer (rewards, evaluation,
rejection sampling, decontamination) sees the clean reference. A bad dataset fails here with a `DataError` naming
the file, row and column; a reference that cannot be read is an error too, unless `DataConfig.unreadable_answers`
says to drop such rows, when the loaded frame says how many went (`dropped_rows`). Must not depend on torch, Prefect
or MLflow.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable, Iterator, Sequence

import pandas as pd

from grpo.configs.data import DataConfig, TaskConfig
from grpo.data.arithmetic import Problem, generate_problems, rl_rows, sft_rows
from grpo.data.formats import ANSWER_READERS, EXPECTED, REASONING_READERS, shown
from grpo.rewards.code import as_io_tests, as_list, row_tests_problem
from grpo.texts import render_response

logger = logging.getLogger(__name__)

# Loading and validating datasets

SFT_SCHEMA = {"prompt": "text or chat messages", "response": "text"}
RL_SCHEMA = {"prompt": "text or chat messages", "answer": "text or number"}
DROPPED = "unreadable_answers_dropped"  # DataFrame.attrs key: rows left out under unreadable_answers: drop
CODE_ROLES = ("tests", "io_tests", "setup")  # the code reward's columns: an RL row with tests needs no answer


class DataError(ValueError):
    """A dataset that cannot be used, with the file, row and column that say why."""


FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


def read_table(source: str, split: str = "train", subset: str | None = None) -> pd.DataFrame:
    """Read a user dataset into a DataFrame: JSONL, JSON, Parquet, CSV, a `datasets` folder or a hub name.

    A folder saved with `save_to_disk` is read with `load_from_disk` (`split` picks from a DatasetDict); any other
    folder, and a hub name, goes to `load_dataset(source, subset, split=split)`, as the hub's own datasets do.
    """
    path = Path(source)
    suffix = path.suffix.lower()
    if suffix in FILE_SUFFIXES:
        if not path.is_file():
            raise DataError(f"{source}: no such file")
        if suffix == ".jsonl":
            return pd.DataFrame(next(_jsonl_rows(path, None)))
        if suffix == ".json":
            return pd.read_json(path)
        if suffix == ".parquet":
            return pd.read_parquet(path)
        return pd.read_csv(path)
    return _arrow_dataset(source, split, subset).to_pandas()


def _arrow_dataset(source: str, split: str, subset: str | None):
    """A folder or hub name as a `datasets.Dataset` (memory-mapped Arrow files): a folder saved with
    `save_to_disk` through `load_from_disk`, any other folder and a hub name through `load_dataset`."""
    path = Path(source)
    if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
        import datasets

        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataError(f"{source}: no split {split!r}; it has {sorted(ds)}")
            ds = ds[split]
        return ds
    if not path.is_dir() and (path.is_absolute() or source.startswith(".")):
        raise DataError(f"{source}: no such file or folder")
    import datasets  # a hub name needs the hub (or its local cache); a data-files folder does not

    try:
        return datasets.load_dataset(source, subset, split=split)
    except Exception as e:  # a wrong subset or split, no network: say which dataset the recipe asked for
        which = f"subset {subset!r}, split {split!r}" if subset else f"split {split!r}"
        raise DataError(f"{source} ({which}): cannot load it: {type(e).__name__}: {e}") from e


def _jsonl_rows(path: Path, batch_rows: int | None) -> Iterator[list[dict]]:
    """A JSONL file's objects, `batch_rows` at a time (all at once: None); a bad line fails naming it."""
    rows: list[dict] = []
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
            if len(rows) == batch_rows:
                yield rows
                rows = []
    if rows or batch_rows is None:
        yield rows


TEXT_KINDS = ("text", "text or chat messages")  # cells a CSV holds as text whatever they look like


def read_table_batches(source: str, batch_rows: int, split: str = "train", subset: str | None = None,
                       text_columns: Sequence[str] = ()) -> Iterator[pd.DataFrame]:
    """`read_table`'s rows, `batch_rows` at a time, without holding the table: a Parquet file a batch of its row
    groups at a time, a JSONL file by lines (a bad line fails as `read_table` says it), a CSV file in chunks
    (`text_columns` read as text: a chunk of number-like cells would otherwise read as numbers where the whole
    file reads as text), a `datasets` folder or hub dataset from its memory-mapped Arrow files. A JSON array is
    read whole and handed out in batches: the format has no rows to read apart."""
    path = Path(source)
    suffix = path.suffix.lower()
    if suffix == ".jsonl" and path.is_file():
        yield from (pd.DataFrame(rows) for rows in _jsonl_rows(path, batch_rows) if rows)
    elif suffix == ".parquet" and path.is_file():
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path, pre_buffer=False).iter_batches(batch_size=batch_rows, use_threads=False):
            yield batch.to_pandas()
    elif suffix == ".csv" and path.is_file():
        with pd.read_csv(path, chunksize=batch_rows, dtype=dict.fromkeys(text_columns, str)) as chunks:
            yield from chunks
    elif suffix in FILE_SUFFIXES:  # a JSON array, or no such file (read_table says so)
        table = read_table(source, split, subset)
        yield from (table.iloc[a:a + batch_rows] for a in range(0, len(table), batch_rows))
    else:
        yield from _arrow_dataset(source, split, subset).to_pandas(batch_size=batch_rows, batched=True)


def _is_messages(value) -> bool:
    if hasattr(value, "tolist"):  # Parquet/Arrow hand back numpy arrays for lists
        value = value.tolist()
    return (isinstance(value, list) and len(value) > 0
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in value))


def validate_rows(df: pd.DataFrame, schema: dict[str, str], source: str, first_row: int = 0) -> pd.DataFrame:
    """Check every required column exists and every cell has the expected type; raise DataError naming the first bad one.

    `first_row`: the number of `df`'s first row in `source`, for a file checked a batch at a time."""
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
                raise DataError(f"{source}: row {first_row + i}, column {col!r}: expected {kind}, got {value!r:.80}")
    return df


def validated_batches(source: str, schema: dict[str, str], batch_rows: int = 4096, limit: int | None = None,
                      split: str = "train", subset: str | None = None) -> Iterator[pd.DataFrame]:
    """A user table's first `limit` rows (every row: None), `batch_rows` at a time (`read_table_batches`), each batch
    checked as `validate_rows` checks a whole table: the first bad cell fails naming the file, its row in the file
    and the column. The rows past `limit` are not read."""
    text = [column for column, kind in schema.items() if kind in TEXT_KINDS]
    at = 0
    for frame in read_table_batches(source, batch_rows, split, subset, text):
        if limit is not None:
            frame = frame.iloc[:limit - at]
        if not len(frame):
            continue
        if at:  # a column only earlier rows had: empty cells here, as it reads in the whole table
            frame = frame.reindex(columns=[*frame.columns, *(c for c in schema if c not in frame.columns)])
        validate_rows(frame, schema, source, first_row=at)
        at += len(frame)
        yield frame
        if at == limit:
            return
    if not at:
        raise DataError(f"{source}: no rows")


def normalise_rows(df: pd.DataFrame) -> pd.DataFrame:
    """Plain Python cells: Arrow-read chat messages become lists, numeric answers become text."""
    df = df.copy()
    df["prompt"] = [p.tolist() if hasattr(p, "tolist") else p for p in df["prompt"]]
    if "answer" in df.columns:
        df["answer"] = [str(a) for a in df["answer"]]
    return df


def to_roles(df: pd.DataFrame, cfg: DataConfig, schema: dict[str, str], source: str) -> pd.DataFrame:
    """A user table as the stage's rows: `cfg.columns` mapped onto the roles in `schema`, every cell checked, the
    reference read in `cfg.answer_format`; other columns ride along (rewards receive them as keyword lists).

    An SFT schema (with `response`) on a table without a response column, in a format that holds worked solutions
    (gsm8k, boxed), builds each response from the answer column: `<think>solution</think><answer>final</answer>`.
    """
    schema = dict(schema)
    rl = "response" not in schema  # RL rows may carry tests (the code reward's) instead of an answer
    fmt = cfg.answer_format
    build_responses = ("response" in schema and "response" not in cfg.columns and "response" not in df.columns
                       and fmt in REASONING_READERS)
    if build_responses:
        del schema["response"]
        schema["answer"] = "text"
    if "answer" in schema and fmt != "plain":
        schema["answer"] = "text"  # a solution to read the answer from, not a bare number
    code = {}  # code role -> dataset column, for RL rows
    if rl:
        code = {role: cfg.columns.get(role, role) for role in CODE_ROLES
                if role in cfg.columns or role in df.columns}
        if cfg.columns.get("answer", "answer") not in df.columns and {"tests", "io_tests"} & set(code):
            del schema["answer"]  # rows checked by running their tests
    columns = {role: cfg.columns.get(role, role) for role in schema}
    missing = {role: column for role, column in code.items() if column not in df.columns}
    if missing:
        raise DataError(f"{source}: missing column(s) {list(missing.values())} (data.columns maps "
                        f"{', '.join(f'{r} to {c!r}' for r, c in missing.items())}); found columns {list(df.columns)}")
    missing = {role: column for role, column in columns.items() if column not in df.columns}
    if missing:
        reads = ", ".join(f"{role} from {column!r}" for role, column in missing.items())
        hint = "name the dataset's own columns in data.columns (role: column, e.g. prompt: question)"
        if "response" in missing and "response" not in cfg.columns:
            hint += ("; or, for worked solutions in the answer column, set data.answer_format (gsm8k or boxed) to "
                     "build responses from them")
        if rl and "answer" in missing:
            hint += "; or, for code problems, a tests (assert statements) or io_tests column instead of an answer"
        raise DataError(f"{source}: missing column(s) {list(missing.values())} (the stage reads {reads}); found "
                        f"columns {list(df.columns)}; {hint}")
    validate_rows(df, {columns[role]: kind for role, kind in schema.items()}, source)
    rows = pd.DataFrame({role: df[column].tolist() for role, column in columns.items()})
    produced = set(schema) | set(code) | ({"response"} if build_responses else set())
    for column in df.columns:  # the role wins over a dataset column of the same name
        if column not in columns.values() and column not in code.values() and column not in produced:
            rows[column] = df[column].tolist()
    if code:
        for role, values in read_code_columns(df, code, "answer" not in schema, source).items():
            rows[role] = pd.Series(values, dtype=object)  # None stays None (a str column would make it NaN)
    dropped = 0
    if "answer" in rows.columns:
        solutions = rows["answer"].tolist()
        answers = read_answers(solutions, cfg, source, columns["answer"])
        keep = [a is not None for a in answers]
        dropped = len(keep) - sum(keep)
        if dropped:
            rows = rows[keep].reset_index(drop=True)
            solutions, answers = [s for s, k in zip(solutions, keep) if k], [a for a in answers if a is not None]
        rows["answer"] = answers
        if build_responses:
            reasoning = REASONING_READERS[fmt]
            rows.insert(1, "response", [render_response(reasoning(s), a) for s, a in zip(solutions, rows["answer"])])
            rows = rows.drop(columns="answer")  # SFT rows are (prompt, response)
    rows = normalise_rows(rows)
    rows.attrs[DROPPED] = dropped
    return rows


def read_code_columns(df: pd.DataFrame, code: dict[str, str], need_tests: bool, source: str) -> dict[str, list]:
    """The code roles' cells as plain Python (tests a list of str, io_tests {inputs, outputs}, setup str or None),
    every row checked: tests that are not valid Python, io_tests whose inputs and outputs differ in number, a
    `language` other than Python, or (when the rows have no answer) no test at all fail here, naming the row."""
    n = len(df)
    cells = {role: df[column].tolist() if column in df.columns else [None] * n for role, column in code.items()}
    languages = df["language"].tolist() if "language" in df.columns else [None] * n
    for role in CODE_ROLES:
        cells.setdefault(role, [None] * n)
    for i in range(n):
        problem = row_tests_problem(cells["tests"][i], cells["io_tests"][i], cells["setup"][i], languages[i],
                                    need_tests=need_tests)
        if problem:
            names = ", ".join(f"{role} from {column!r}" for role, column in code.items())
            raise DataError(f"{source}: row {i}: {problem} (reading {names})")
    out = {"tests": [as_list(t) for t in cells["tests"]], "io_tests": [as_io_tests(t) for t in cells["io_tests"]],
           "setup": [s if isinstance(s, str) and s.strip() else None for s in cells["setup"]]}
    return {role: out[role] for role in code}


def read_answers(values: list, cfg: DataConfig, source: str, column: str) -> list[str | None]:
    """Each cell's reference answer in `cfg.answer_format`. A cell that has none is an error naming the file, row,
    column and value; under `unreadable_answers: drop` its answer is None, and a warning says how many."""
    fmt = cfg.answer_format
    answers = [ANSWER_READERS[fmt](v) for v in values]
    bad = [i for i, a in enumerate(answers) if a is None]
    if not bad:
        return answers
    i = bad[0]
    what = (f"row {i}, column {column!r}: expected {EXPECTED[fmt]} (data.answer_format: {fmt}), got "
            f"{shown(fmt, values[i])}")
    if cfg.unreadable_answers == "error":
        raise DataError(f"{source}: {what}; {len(bad)} of {len(values)} rows are like this (data.unreadable_answers: "
                        f"drop leaves them out)")
    if len(bad) == len(values):
        raise DataError(f"{source}: no row has an answer that can be read ({what}); all {len(values)} would be "
                        f"dropped (data.unreadable_answers: drop)")
    logger.warning("%s: dropped %d of %d rows whose answer cannot be read (data.unreadable_answers: drop); the first, "
                   "%s", source, len(bad), len(values), what)
    return answers


def dropped_rows(df: pd.DataFrame | None) -> int:
    """How many rows the loader left out of `df` under `unreadable_answers: drop` (0 for generated rows)."""
    return 0 if df is None else int(df.attrs.get(DROPPED, 0))


def _load(cfg: DataConfig, schema: dict[str, str],
          synthetic: Callable[[list[Problem], TaskConfig], pd.DataFrame]) -> pd.DataFrame:
    if cfg.source == "synthetic":
        return synthetic(generate_problems(cfg.task, cfg.num_train, "train"), cfg.task)
    df = to_roles(read_table(cfg.source, cfg.split, cfg.subset), cfg, schema, cfg.source)
    return df.head(cfg.num_train) if cfg.num_train else df


def load_heldout(cfg: DataConfig) -> pd.DataFrame | None:
    """Held-out (prompt, answer) rows, or (prompt, tests) code rows that evaluation checks by running their tests:
    the task's fixed held-out split, a user dataset (read with the training rows' subset, columns and answer
    format), or None when switched off."""
    if not cfg.num_heldout or not cfg.heldout_source:
        return None
    if cfg.heldout_source == "synthetic":
        return rl_rows(generate_problems(cfg.task, cfg.num_heldout, "heldout"))
    df = read_table(cfg.heldout_source, cfg.heldout_split, cfg.subset)
    return to_roles(df, cfg, RL_SCHEMA, cfg.heldout_source).head(cfg.num_heldout)


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
