"""The reward registry and weighted scoring: names to functions, and the per-function scores of a batch.

Pure Python; must not depend on torch, Prefect or MLflow.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from grpo.configs.grading import RULE_REWARDS
from grpo.rewards.accuracy import accuracy_reward
from grpo.rewards.code import code_reward
from grpo.rewards.format import format_reward, format_reward_strict, tag_count_reward
from grpo.rewards.language import language_consistency_reward
from grpo.rewards.outcomes import NOT_A_NUMBER, RAISED, WRONG_LENGTH, Ungraded
from grpo.rewards.overlong import overlong_penalty
from grpo.rewards.sandbox import SandboxUnavailable

logger = logging.getLogger(__name__)



REWARD_FUNCTIONS: dict[str, Callable[..., list[float | None]]] = {
    "format": format_reward,
    "format_strict": format_reward_strict,
    "accuracy": accuracy_reward,
    "tag_count": tag_count_reward,
    "language_consistency": language_consistency_reward,
    "overlong": overlong_penalty,  # needs max_completion_length: see make_overlong_penalty
    "code": code_reward,  # runs programs in a sandbox; a recipe's settings: grpo.rewards.code.make_code_reward
}
if set(REWARD_FUNCTIONS) != set(RULE_REWARDS):  # the names a recipe is checked against (grpo.configs) are these
    raise ImportError(f"grpo.rewards.registry scores {sorted(REWARD_FUNCTIONS)} but grpo.configs.grading.RULE_REWARDS "
                      f"names {sorted(RULE_REWARDS)}: add the reward's name to both")

# the dataset columns a reward reads: it needs at least one of them (checked before training)
REWARD_COLUMNS: dict[str, tuple[str, ...]] = {"accuracy": ("answer",), "code": ("tests", "io_tests")}


def check_reward_columns(rewards: Iterable[str], columns: Iterable[str], source: str = "the data") -> None:
    """Raise ValueError, before any training, if a reward needs a column the rows do not have."""
    columns = set(columns)
    for name in rewards:
        needed = REWARD_COLUMNS.get(name, ())
        if needed and not columns & set(needed):
            either = " or ".join(repr(c) for c in needed)
            raise ValueError(f"{source}: the {name} reward reads the {either} column, and the rows have none "
                             f"(columns: {sorted(columns)}); name the dataset's column in data.columns "
                             f"(e.g. {needed[0]}: {'test_list' if name == 'code' else 'solution'})")


class UnknownRewardError(KeyError, ValueError):
    """A reward spec names a function the registry does not have."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


@dataclasses.dataclass(frozen=True)
class RewardScores:
    """A batch's scores, per reward function and weighted. Three outcomes a completion: a score; None, the
    function does not apply to it (counted in `skipped`, adds 0.0); ungraded (`grpo.rewards.outcomes`), the function
    should have graded it and could not (a timeout, a sandbox or judge failure, a raise, a non-number): its reason in
    `ungraded`, and the completion is not `graded` if any weighted function left it so. An ungraded completion's
    `total` counts the functions that did grade it; it is not a reward, and the loops leave it out."""

    per_function: dict[str, list[float | None]]  # None: the function does not apply, or it could not grade
    total: list[float]  # sum of weight * score, a None counting as 0.0
    failures: dict[str, int]  # completions each function failed on (raised, NaN/inf/non-number, wrong length)
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)  # completions it returned None for
    # per function, per completion: why it could not grade it (None where it did, or does not apply)
    ungraded: dict[str, list[str | None]] = dataclasses.field(default_factory=dict)
    graded: list[bool] | None = None  # per completion: every weighted function graded it (None: all were)
    # what functions report of their own work ("<function>/<figure>": a count), from a `take_figures()` they carry
    # (the accuracy reward's appeal to a judge: its calls, and the negatives it turned)
    figures: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def graded_rows(self) -> list[bool]:
        return [True] * len(self.total) if self.graded is None else self.graded

    def reasons(self) -> list[str]:
        """Per completion, why it is ungraded ("accuracy: timeout; code: sandbox_error"), "" where it is not."""
        return ["; ".join(f"{name}: {why[i]}" for name, why in self.ungraded.items() if why[i] is not None)
                for i in range(len(self.total))]

    def ungraded_counts(self) -> dict[tuple[str, str], int]:
        """(function, reason): completions it left ungraded for that reason."""
        counts: dict[tuple[str, str], int] = {}
        for name, why in self.ungraded.items():
            for reason in why:
                if reason is not None:
                    counts[name, reason] = counts.get((name, reason), 0) + 1
        return counts

    def take(self, rows: list[int]) -> RewardScores:
        """These completions' scores, in this order (the counts of failures and skips stay the batch's)."""
        return RewardScores(
            per_function={name: [v[i] for i in rows] for name, v in self.per_function.items()},
            total=[self.total[i] for i in rows], failures=dict(self.failures), skipped=dict(self.skipped),
            ungraded={name: [v[i] for i in rows] for name, v in self.ungraded.items()},
            graded=None if self.graded is None else [self.graded[i] for i in rows], figures=dict(self.figures))


def _normalize_specs(
    reward_specs: Mapping[str, float] | Iterable[tuple[str, float]], registry: Mapping[str, Callable]
) -> list[tuple[str, float]]:
    """[(name, weight)], validated; raises before anything is scored."""
    items = list(reward_specs.items() if isinstance(reward_specs, Mapping) else reward_specs)
    if not all(isinstance(item, (tuple, list)) and len(item) == 2 for item in items):
        raise ValueError(f"reward specs must be {{name: weight}} or [(name, weight), ...], got {reward_specs!r}")
    names = [name for name, _ in items]
    unknown = [name for name in names if name not in registry]
    if unknown:
        raise UnknownRewardError(f"unknown reward function(s) {unknown}; known: {sorted(registry)}")
    if len(set(names)) != len(names):
        raise ValueError(f"reward listed twice: {names}")
    for name, weight in items:
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            raise ValueError(f"weight for {name!r} must be a finite number, got {weight!r}")
    return [(name, float(weight)) for name, weight in items]


def _clean_score(value: Any) -> Any:
    """A finite float; None for None (the function does not apply); an `Ungraded` as it came, or one for
    NaN/inf/non-numbers (`NOT_A_NUMBER`). 0-d arrays/tensors are unwrapped."""
    if value is None or isinstance(value, Ungraded):
        return value
    if not isinstance(value, numbers.Real) and hasattr(value, "item"):
        try:
            value = value.item()
        except Exception:
            return Ungraded(NOT_A_NUMBER, type(value).__name__)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else Ungraded(NOT_A_NUMBER, repr(value))
    return Ungraded(NOT_A_NUMBER, type(value).__name__)


def _call_reward(
    fn: Callable, completions: list, columns: Mapping[str, Any], log_level: int = logging.WARNING
) -> list[Any] | Ungraded:
    """The function's cleaned scores (see _clean_score), or an `Ungraded` (RAISED) if it raised. Wrong length: all
    ungraded (WRONG_LENGTH)."""
    name = getattr(fn, "__name__", repr(fn))
    try:
        raw = list(fn(completions, **columns))
    except SandboxUnavailable:  # not a bad completion: nothing can be scored here, and training must stop
        raise
    except Exception as e:
        logger.log(log_level, "reward %s raised", name, exc_info=True)
        return Ungraded(RAISED, f"{type(e).__name__}: {e}"[:200])
    if len(raw) != len(completions):
        logger.warning("reward %s returned %d scores for %d completions", name, len(raw), len(completions))
        return [Ungraded(WRONG_LENGTH, f"{len(raw)} scores for {len(completions)}")] * len(completions)
    return [_clean_score(v) for v in raw]


def _score_one_function(fn: Callable, completions: list, columns: Mapping[str, Any]) -> list[Any]:
    """Whole batch first; if that raises, completion by completion so a bad one fails alone."""
    scores = _call_reward(fn, completions, columns)
    if not isinstance(scores, Ungraded):
        return scores
    n = len(completions)
    out: list[Any] = []
    for i in range(n):
        # Aligned columns are sliced; anything else (a scalar setting) is passed as is.
        single_columns = {
            k: [v[i]] if isinstance(v, (list, tuple)) and len(v) == n else v for k, v in columns.items()
        }
        single = _call_reward(fn, [completions[i]], single_columns, log_level=logging.DEBUG)
        out.append(single if isinstance(single, Ungraded) else single[0])
    return out


def score_completions(
    completions: Sequence[Any],
    reward_specs: Mapping[str, float] | Iterable[tuple[str, float]],
    columns: Mapping[str, Any] | None = None,
    *,
    registry: Mapping[str, Callable[..., list[float | None]]] | None = None,
) -> RewardScores:
    """Run the named reward functions and combine them with their weights.

    ``reward_specs``: {name: weight} or [(name, weight), ...], names from
    ``registry`` (default ``REWARD_FUNCTIONS``). ``columns``: dataset columns,
    passed to every function as keyword arguments.

    Bad specs (unknown name, duplicate, non-finite weight) and columns that do
    not align with the completions raise ValueError (unknown names:
    UnknownRewardError, also a KeyError) before anything is scored. After that
    nothing raises but SandboxUnavailable (the code reward cannot run programs
    here, and never runs them unsandboxed): a score is None when its function returned None (it does
    not apply to that completion, counted in ``skipped``), and the completion is ungraded by it (its reason in
    ``ungraded``) when the function answered `Ungraded` for it, raised for it, returned NaN/inf/a non-number, or
    returned the wrong number of scores (then all of them); the last three are also counted in ``failures``. A
    completion a weighted function left ungraded is not ``graded``. Neither adds to ``total``, so a failure never
    poisons the other rewards with NaN.
    """
    registry = REWARD_FUNCTIONS if registry is None else registry
    specs = _normalize_specs(reward_specs, registry)
    completions = list(completions)
    columns = dict(columns or {})
    if "completions" in columns:
        raise ValueError("'completions' cannot be a column name")
    for name, values in columns.items():
        if isinstance(values, (list, tuple)) and len(values) != len(completions):
            raise ValueError(f"column {name!r} has {len(values)} values for {len(completions)} completions")

    per_function: dict[str, list[float | None]] = {}
    failures: dict[str, int] = {}
    skipped: dict[str, int] = {}
    ungraded: dict[str, list[str | None]] = {}
    graded = [True] * len(completions)
    total = [0.0] * len(completions)
    figures: dict[str, float] = {}
    for name, weight in specs:
        raw = _score_one_function(registry[name], completions, columns)
        take = getattr(registry[name], "take_figures", None)
        if callable(take):
            figures.update({f"{name}/{key}": float(value) for key, value in take().items()})
        failures[name] = sum(isinstance(s, Ungraded) and s.reason in (RAISED, NOT_A_NUMBER, WRONG_LENGTH)
                             for s in raw)
        skipped[name] = sum(s is None for s in raw)
        ungraded[name] = [s.reason if isinstance(s, Ungraded) else None for s in raw]
        scores = [None if isinstance(s, Ungraded) else s for s in raw]
        per_function[name] = scores
        for i, s in enumerate(raw):
            if isinstance(s, Ungraded):
                graded[i] = graded[i] and weight == 0
            elif s is not None:
                total[i] += weight * s
    return RewardScores(per_function=per_function, total=total, failures=failures, skipped=skipped,
                        ungraded=ungraded, graded=graded, figures=figures)
