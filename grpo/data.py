"""Data: the synthetic reasoning task, loaders for user data, and schema checks that fail before training.

The synthetic task is multi-step arithmetic word problems in the spirit of the R1 notes' example ("Mr. Curtis has
325 chickens ... 28 are roosters ... twenty hens do not lay eggs ... how many egg-laying hens?" -> 277), each with a
worked chain of thought and an integer answer. Operand size and step count are the difficulty dials: a model of a
few million parameters learns single-digit operands in minutes and two-digit ones hardly at all.

Rows come in two shapes:
- SFT rows: `prompt` (str or chat messages) and `response` (`<think>...</think><answer>...</answer>`);
- RL rows: `prompt` and `answer` (the reference a reward checks against).

The held-out split is chosen by a hash of the problem with the person's name taken out, so train and held-out
never share a problem (not even the same numbers under another name), whatever the seeds and sizes.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field

# ----------------------------------------------------------------------------------------------------------------
# The synthetic task

NAMES = ["Ava", "Ben", "Cleo", "Dan", "Eli", "Fay", "Gus", "Ivy", "Jon", "Kim", "Leo", "Mia", "Ned", "Oli", "Pam"]


@dataclass(frozen=True)
class Problem:
    question: str
    steps: tuple[str, ...]  # one equation per reasoning step, e.g. "7 + 5 = 12"
    answer: int


def _eq(a: int, op: str, b: int) -> tuple[str, int]:
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"{a} {op} {b} = {value}", value


# Each template draws its numbers from `rng` (all in [1, hi]), keeps every intermediate result non-negative,
# and returns the question and the equations that solve it.
def _farm(rng: random.Random, hi: int, name: str) -> Problem:
    roosters, idle, hens = rng.randint(1, hi), rng.randint(1, hi), rng.randint(1, hi)
    total = roosters + idle + hens
    s1, h = _eq(total, "-", roosters)
    s2, laying = _eq(h, "-", idle)
    q = f"{name} has {total} chickens; {roosters} are roosters. {idle} hens lay no eggs. How many hens lay eggs?"
    return Problem(q, (s1, s2), laying)


def _shop(rng: random.Random, hi: int, name: str) -> Problem:
    a, b = rng.randint(1, hi), rng.randint(1, hi)
    c = rng.randint(1, a + b)
    s1, t = _eq(a, "+", b)
    s2, left = _eq(t, "-", c)
    q = f"{name} has {a} apples, buys {b} and gives away {c}. How many are left?"
    return Problem(q, (s1, s2), left)


def _book(rng: random.Random, hi: int, name: str) -> Problem:
    a, b = rng.randint(1, hi), rng.randint(1, hi)
    pages = a + b + rng.randint(1, hi)
    s1, read = _eq(a, "+", b)
    s2, left = _eq(pages, "-", read)
    q = f"A book has {pages} pages. {name} reads {a}, then {b}. How many pages are left?"
    return Problem(q, (s1, s2), left)


def _boxes(rng: random.Random, hi: int, name: str) -> Problem:
    boxes, per, extra = rng.randint(1, max(2, hi // 2)), rng.randint(1, max(2, hi // 2)), rng.randint(1, hi)
    s1, packed = _eq(boxes, "*", per)
    s2, total = _eq(packed, "+", extra)
    q = f"{name} packs {boxes} boxes of {per} pens and has {extra} more. How many pens in all?"
    return Problem(q, (s1, s2), total)


def _bus(rng: random.Random, hi: int, name: str) -> Problem:
    start, on, off = rng.randint(1, hi), rng.randint(1, hi), rng.randint(1, hi)
    off = min(off, start + on)
    s1, mid = _eq(start, "+", on)
    s2, end = _eq(mid, "-", off)
    q = f"{name}'s bus has {start} people. {on} get on, {off} get off. How many are on now?"
    return Problem(q, (s1, s2), end)


def _coins(rng: random.Random, hi: int, name: str) -> Problem:
    a, b, c = rng.randint(1, hi), rng.randint(1, hi), rng.randint(1, hi)
    s1, t = _eq(a, "+", b)
    s2, total = _eq(t, "+", c)
    q = f"{name} finds {a} coins, then {b}, then {c}. How many coins in all?"
    return Problem(q, (s1, s2), total)


TEMPLATES: dict[str, Callable[[random.Random, int, str], Problem]] = {
    "farm": _farm, "shop": _shop, "book": _book, "boxes": _boxes, "bus": _bus, "coins": _coins,
}


class TaskConfig(BaseModel):
    """The synthetic arithmetic word-problem task."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_operand: int = 9  # largest number drawn; the difficulty dial (single digits are learnable in minutes)
    templates: tuple[str, ...] = tuple(TEMPLATES)  # which problem templates to draw from
    heldout_percent: int = 20  # share of problems reserved for held-out, by hash of the name-free problem
    seed: int = 0  # the same seed draws the same training problems (the held-out split never changes)
    restate_givens: bool = True  # the chain of thought starts by copying out the problem's numbers
    # share of the worked solutions that count each addition and subtraction out one number at a time
    # ("9 + 3 = 10 11 12.") instead of recalling the result ("9 + 3 = 12."); the rest recall. A small model taught
    # both habits picks one per answer, which leaves reasoning RL a choice to learn from (see recipes/tiny.yaml)
    counting_share: float = Field(0.4, ge=0.0, le=1.0)


def count_out(step: str) -> str:
    """An addition or subtraction counted out one number at a time: "9 + 3 = 12" -> "9 + 3 = 10 11 12".

    The last number is the result. Every count is one step up or down (one fact per number), where recalling
    "9 + 3 = 12" needs one fact per pair of operands. Products and steps that add or take away nothing stay as
    they are.
    """
    a, op, b, _ = re.fullmatch(r"([0-9]+) ([-+*]) ([0-9]+) = ([0-9]+)", step).groups()
    a, b = int(a), int(b)
    if op == "*" or b == 0:
        return step
    sign = 1 if op == "+" else -1
    return f"{a} {op} {b} = " + " ".join(str(a + sign * i) for i in range(1, b + 1))


def format_response(p: Problem, restate_givens: bool = True, counting: bool = False) -> str:
    """The cold-start target: the chain of thought, then the bare integer as the answer.

    The chain of thought first restates the problem's numbers in order ("Given 8, 5, 2."), then solves it one
    equation per step, recalling each result or (`counting`) counting it out. A small model's main failure is the
    arithmetic itself; copying the givens out in order first keeps the numbers a few tokens away.
    """
    givens = f"Given {', '.join(re.findall(r'[0-9]+', p.question))}. " if restate_givens else ""
    steps = [count_out(s) if counting else s for s in p.steps]
    return f"<think>{givens}{' '.join(s + '.' for s in steps)}</think><answer>{p.answer}</answer>"


def is_heldout(question: str, percent: int) -> bool:
    digest = hashlib.sha1(question.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < percent


def generate_problems(cfg: TaskConfig, n: int, split: Literal["train", "heldout"], *, seed_offset: int = 0) -> list[Problem]:
    """`n` distinct problems of one split, deterministic in (cfg, split, seed_offset)."""
    unknown = [t for t in cfg.templates if t not in TEMPLATES]
    if unknown:
        raise ValueError(f"unknown task templates {unknown}; known: {sorted(TEMPLATES)}")
    # the held-out draw ignores the seed: every stage that shares the task scores on the same problems
    rng = random.Random(f"{cfg.seed}-train-{seed_offset}" if split == "train" else f"heldout-{seed_offset}")
    want_heldout = split == "heldout"
    seen: set[str] = set()
    out: list[Problem] = []
    for _ in range(200 * n + 1000):  # bounded: a tiny question space must fail loudly, not loop forever
        name = rng.choice(NAMES)
        p = TEMPLATES[rng.choice(cfg.templates)](rng, cfg.max_operand, name)
        problem_key = p.question.replace(name, "_")  # the arithmetic, whoever it is about
        # held-out problems are distinct even without names; training rows may repeat one under other names
        dedupe = problem_key if want_heldout else p.question
        if dedupe in seen or is_heldout(problem_key, cfg.heldout_percent) != want_heldout:
            continue
        seen.add(dedupe)
        out.append(p)
        if len(out) == n:
            return out
    raise ValueError(f"the task's question space holds fewer than {n} distinct {split} problems "
                     f"(max_operand={cfg.max_operand}); raise max_operand or ask for fewer rows")


def counts_out(question: str, share: float, seed: int) -> bool:
    """Whether this row's worked solution counts out its steps: a fixed share, chosen by hash (not by row order)."""
    digest = hashlib.sha1(f"count-{seed}-{question}".encode()).digest()
    return int.from_bytes(digest[:4], "big") < share * 2**32


def sft_rows(problems: list[Problem], task: TaskConfig | None = None) -> pd.DataFrame:
    """Prompt/response rows with worked solutions written the way `task` says (its defaults when None)."""
    task = task or TaskConfig()
    return pd.DataFrame({"prompt": [p.question for p in problems],
                         "response": [format_response(p, task.restate_givens,
                                                      counts_out(p.question, task.counting_share, task.seed))
                                      for p in problems]})


def rl_rows(problems: list[Problem]) -> pd.DataFrame:
    return pd.DataFrame({"prompt": [p.question for p in problems], "answer": [str(p.answer) for p in problems]})


# ----------------------------------------------------------------------------------------------------------------
# Loading and validating datasets

SFT_SCHEMA = {"prompt": "text or chat messages", "response": "text"}
RL_SCHEMA = {"prompt": "text or chat messages", "answer": "text or number"}


class DataConfig(BaseModel):
    """Where a stage's rows come from: the synthetic task, or a user dataset."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: str = "synthetic"  # "synthetic", a .jsonl/.json/.parquet/.csv file, a saved `datasets` folder, or a hub name
    split: str = "train"  # split to read from a hub dataset or a DatasetDict folder
    num_train: int = 2000  # synthetic rows to generate (or the most rows to read from a user dataset; 0 = all)
    num_heldout: int = 200  # held-out rows for evaluation (0 = no evaluation)
    heldout_source: str = "synthetic"  # held-out (prompt, answer) rows: "synthetic" (the task's split) or a file
    task: TaskConfig = TaskConfig()  # the synthetic task


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
