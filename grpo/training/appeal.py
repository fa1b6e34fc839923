"""A second look at the rule's negatives (TinyV's appeal): a judge, asked with the reference answer, may turn a right
answer the rule missed into a positive; it never turns a rule's positive into a negative.

Rule checkers are precise but miss right answers written in forms they cannot read (TinyV found over 38% false
negatives on Big-Math-RL-Verified), and miss more as the policy gets stronger. With `grpo.grading.appeal` set to a
judge (a local model or an endpoint, `grpo.sampling.judge`), every completion the accuracy reward scores 0.0 against
a reference goes to the judge with the question, the completion and the reference; a yes makes it 1.0. A no, a reply
without a verdict or a failed request leaves the rule's 0.0: the rule did grade it. Rows the rule could not grade,
or that have no reference, are not appealed.

Its figures, per step: `reward_figures/accuracy/appeal_calls` (judge requests) and `.../appeal_upheld` (0.0 turned
to 1.0).

Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from grpo.rewards.text import completion_text


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    if isinstance(prompt, list):
        return "\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in prompt)
    return str(prompt)


def appealed(rule: Callable, judge) -> Callable:
    """`rule` (a reward function reading `answer`) with its 0.0s against a reference appealed to `judge` (anything
    with `judge_many([(question, response, reference)]) -> [Verdict]`). The returned function has `take_figures()`:
    the calls and upheld appeals since the last take."""
    counts = {"appeal_calls": 0, "appeal_upheld": 0}

    @functools.wraps(rule)
    def reward(completions: Sequence[Any], answer: Sequence[Any] | None = None, prompts: Sequence[Any] | None = None,
               **columns: Any) -> list:
        scores = list(rule(completions, answer=answer, prompts=prompts, **columns))
        if answer is None:
            return scores
        ask = [i for i, s in enumerate(scores)
               if type(s) is float and s == 0.0 and answer[i] is not None and str(answer[i]).strip()]
        if not ask:
            return scores
        questions = prompts if prompts is not None else [""] * len(completions)
        verdicts = judge.judge_many([(_prompt_text(questions[i]), completion_text(completions[i]), str(answer[i]))
                                     for i in ask])
        counts["appeal_calls"] += len(ask)
        for i, verdict in zip(ask, verdicts):
            if verdict.accepted is True:  # only ever up: a rule's positive never goes to the judge
                scores[i] = 1.0
                counts["appeal_upheld"] += 1
        return scores

    def take_figures() -> dict[str, float]:
        out = {k: float(v) for k, v in counts.items()}
        counts.update(dict.fromkeys(counts, 0))
        return out

    reward.take_figures = take_figures
    return reward
