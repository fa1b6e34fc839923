"""Rule-based rewards for GRPO (the DeepSeek-R1 recipe), with TRL's and open-r1's reward-function contract.

A reward function is ``fn(completions, **dataset_columns) -> list[float | None]``:

* a completion is a string or a list of chat messages (the last assistant message's ``content`` is scored);
* dataset columns arrive as keyword lists aligned with ``completions`` (``answer=[...]``); unknown keywords are
  accepted and ignored (TRL also passes ``prompts``, ``completion_ids``, ``trainer_state``);
* ``None`` means "does not apply" (TRL turns it into NaN);
* ``Ungraded(reason)`` (`outcomes`) means "should have been graded and could not" (a timeout, a sandbox or judge
  failure): not a wrong answer. A function that raises or answers NaN is taken as ungraded too. The loops leave
  ungraded rows out of the advantage (`RewardScores.graded`).

One module per kind of reward:

| module | what it holds |
|---|---|
| `text` | the text a reward scores, from a string or chat messages |
| `format` | the `<think>…</think><answer>…</answer>` format rewards and TRL's tag count |
| `answers` | answer extraction (`<answer>`, `\\boxed{}`) |
| `accuracy` | the accuracy reward: fast exact paths first (`math_fast`, `math_latex`), math-verify for the rest (`math_verify_pool`) |
| `forms` | answer forms the rule rewrites before it compares (e-notation, spaced thousands, mixed numbers, numbers in words) |
| `math_fast`, `math_latex` | verdicts decided exactly without math-verify: plain numbers as fractions, a small LaTeX arithmetic engine |
| `math_verify_pool` | math-verify in a process pool under the project's own timeout (the package's only module-level state) |
| `code`, `code_harness` | the code reward: the completion's program against its row's tests (`code_harness` runs inside the sandbox, imported nowhere) |
| `correct` | whether a completion is right by its row's own check (all tests pass, else the answer matches): evaluation and rejection sampling |
| `sandbox` | running an untrusted program: bubblewrap namespaces, limits, and a pool of them |
| `language` | R1's language-consistency reward |
| `overlong` | DAPO's overlong penalty |
| `outcomes` | the third outcome of a grader, `Ungraded(reason)`, and its reasons |
| `registry` | names to functions (`REWARD_FUNCTIONS`) and weighted scoring (`score_completions`) |
| `steps` | step verifiers for process supervision: where each reasoning step ends and whether it holds (`arithmetic`, `gsm8k`) |
| `audit` | a labelled set of (reference, answer, equivalent?) pairs in the forms graders miss, for auditing answer checkers (`r1 audit-rewards`) |

To add a reward: write ``fn(completions, **columns)`` in a module here, add it to ``REWARD_FUNCTIONS`` in `registry`
and its name to ``RULE_REWARDS`` in `grpo.configs.grading` (what a recipe is checked against); recipes then name it
under ``rewards:``.

Everything here is pure Python: no torch, no Prefect, no MLflow. The only module-level state is the process pool
for the symbolic math check (`math_verify_pool`); the code reward's sandboxes live only as long as a call.
"""

from grpo.rewards.accuracy import AccuracyReport, accuracy_reward, check_accuracy
from grpo.rewards.answers import extract_answer, extract_boxed
from grpo.rewards.code import CodeReport, check_code, code_reward, extract_program, make_code_reward
from grpo.rewards.format import format_reward, format_reward_strict, make_format_reward, tag_count_reward
from grpo.rewards.language import language_consistency_reward
from grpo.rewards.math_verify_pool import prepare_for_math_verify, shutdown_symbolic_pool
from grpo.rewards.outcomes import Ungraded
from grpo.rewards.overlong import make_overlong_penalty, overlong_penalty
from grpo.rewards.registry import (REWARD_COLUMNS, REWARD_FUNCTIONS, RewardScores, UnknownRewardError,
                                   check_reward_columns, score_completions)
from grpo.rewards.sandbox import SandboxUnavailable
from grpo.rewards.text import completion_text

__all__ = [
    "AccuracyReport",
    "CodeReport",
    "REWARD_COLUMNS",
    "REWARD_FUNCTIONS",
    "RewardScores",
    "SandboxUnavailable",
    "UnknownRewardError",
    "Ungraded",
    "accuracy_reward",
    "check_accuracy",
    "check_code",
    "check_reward_columns",
    "code_reward",
    "completion_text",
    "extract_answer",
    "extract_boxed",
    "extract_program",
    "format_reward",
    "format_reward_strict",
    "language_consistency_reward",
    "make_code_reward",
    "make_format_reward",
    "make_overlong_penalty",
    "overlong_penalty",
    "prepare_for_math_verify",
    "score_completions",
    "shutdown_symbolic_pool",
    "tag_count_reward",
]
