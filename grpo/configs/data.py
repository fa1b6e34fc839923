"""Where a stage's rows come from: the synthetic arithmetic word-problem task, or a user dataset and how its
columns and reference answers are read.

Plain pydantic: imports nothing of torch or of the modules that do the work, so a recipe is read and checked
before anything heavy loads.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator

# The names the settings may use; the modules that implement them check that they agree (grpo.data.arithmetic,
# grpo.data.formats), so a recipe is checked without importing them.
TASK_TEMPLATES = ("farm", "shop", "book", "boxes", "bus", "coins")  # synthetic word-problem templates
# what a stage reads from a dataset row (data.columns maps them); tests, io_tests and setup are the code reward's
DATA_ROLES = ("prompt", "answer", "response", "tests", "io_tests", "setup")
AnswerFormat = Literal["plain", "gsm8k", "boxed"]  # how a reference answer is read from its column (grpo.data.formats)
ANSWER_FORMATS = get_args(AnswerFormat)


class TaskConfig(BaseModel):
    """The synthetic arithmetic word-problem task."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_operand: int = Field(9, ge=1)  # largest number drawn; the difficulty dial (single digits: minutes to learn)
    templates: tuple[str, ...] = Field(TASK_TEMPLATES, min_length=1)  # which problem templates to draw from
    heldout_percent: int = Field(20, ge=1, le=99)  # share of problems reserved for held-out, by hash of the problem
    seed: int = 0  # the same seed draws the same training problems (the held-out split never changes)
    restate_givens: bool = True  # the chain of thought starts by copying out the problem's numbers
    # share of the worked solutions that count each addition and subtraction out one number at a time
    # ("9 + 3 = 10 11 12.") instead of recalling the result ("9 + 3 = 12."); the rest recall. A small model taught
    # both habits picks one per answer, which leaves reasoning RL a choice to learn from (see recipes/tiny.yaml)
    counting_share: float = Field(0.4, ge=0.0, le=1.0)

    @field_validator("templates")
    @classmethod
    def _known_templates(cls, templates: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [t for t in templates if t not in TASK_TEMPLATES]
        if unknown:
            raise ValueError(f"unknown task template(s) {unknown}; known: {list(TASK_TEMPLATES)}")
        return templates


class DataConfig(BaseModel):
    """Where a stage's rows come from: the synthetic task, or a user dataset."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # "synthetic", a .jsonl/.json/.parquet/.csv file, a `datasets` folder (saved with save_to_disk, or data files
    # that load_dataset reads), or a hub name (load_dataset(source, subset, split=split))
    source: str = "synthetic"
    subset: str | None = None  # the dataset's configuration (hub datasets and data-file folders; GSM8K: "main")
    split: str = "train"  # split to read from a hub dataset or a DatasetDict folder
    # role -> the dataset's column: {prompt: question} reads prompts from `question`; a role not named here is read
    # from the column of its own name. Roles: prompt, answer (the reference), response (SFT targets), and for the
    # code reward tests (assert statements, MBPP's test_list), io_tests ({inputs, outputs} on stdin/stdout) and
    # setup (code run before the tests, MBPP's test_setup_code); a row with tests needs no answer
    columns: dict[str, str] = Field(default_factory=dict)
    # how the reference answer is read from the answer column: "plain" (as it is), "gsm8k" (the number after
    # "####", commas removed) or "boxed" (the last \boxed{...}, as in MATH). With gsm8k or boxed and no response
    # column, SFT rows are built from the worked solution: <think>solution</think><answer>final</answer>
    answer_format: AnswerFormat = "plain"
    # a row whose reference cannot be read in answer_format (gsm8k: no number after "####"; boxed: no \boxed{}):
    # "error" stops before any model with the file, row and value; "drop" leaves it out and reports how many
    unreadable_answers: Literal["error", "drop"] = "error"
    num_train: int = Field(2000, ge=0)  # synthetic rows to generate (or the most rows to read from a user dataset; 0 = all)
    num_heldout: int = Field(200, ge=0)  # held-out rows for evaluation (0 = no evaluation)
    # held-out (prompt, answer) rows: "synthetic" (the task's split) or a user dataset, read with the same
    # subset, columns and answer_format as the training rows
    heldout_source: str = "synthetic"
    heldout_split: str = "test"  # split to read held-out rows from (hub datasets and DatasetDict folders)
    task: TaskConfig = TaskConfig()  # the synthetic task

    @field_validator("columns")
    @classmethod
    def _known_roles(cls, columns: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(columns) - set(DATA_ROLES))
        if unknown:
            raise ValueError(f"unknown role(s) {unknown} in columns; the roles are {list(DATA_ROLES)} "
                             f"(write role: dataset_column, e.g. prompt: question)")
        empty = [role for role, column in columns.items() if not column.strip()]
        if empty:
            raise ValueError(f"columns maps {empty} to an empty column name")
        return columns
