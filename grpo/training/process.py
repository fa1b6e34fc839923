"""Process supervision for GRPO: a reward at the end of every reasoning step, and token advantages from them.

DeepSeekMath (Shao et al. 2024, section 4.1.3) scores each completion i of a group at the end of each of its steps:
R = {r_i^index(j)}. All step rewards of the group are normalised together, r~ = (r - mean(R)) / std(R), and a
token's advantage is the sum of the normalised rewards of the steps that end at or after it:

    A_t = sum over steps j of the completion with index(j) >= t of r~_j

So a token is credited for everything that follows it: a wrong step lowers the advantage of the tokens up to its
end, not of those after it. With one step per completion, ending at its last token, the group's steps are its G
rewards and every token gets (r_i - mean) / std: outcome GRPO exactly.

The final step. The step verifiers (grpo.rewards.steps) check the intermediate steps of the reasoning; the answer
is not one of them. Here the answer is a step of its own: it ends at the completion's last token and its reward is
the outcome reward (the recipe's weighted rule rewards: accuracy, format, ...). A completion with no recognisable
step keeps only that step, i.e. the outcome reward (counted as a fallback). Step rewards and the outcome reward
are normalised together, so their scales should be comparable: a checked step scores 1.0 or 0.0. Dynamic
sampling still keeps or drops a group by its outcome rewards.

Pure tensor and text functions: must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping, NamedTuple, Sequence

import torch
from torch import Tensor

from grpo.rewards.outcomes import MALFORMED, RAISED
from grpo.rewards.steps import Steps, StepVerifier, step_problem

logger = logging.getLogger(__name__)


class StepRewards(NamedTuple):
    """Every completion's steps at token level, the answer step included (N completions, grouped by prompt)."""

    ends: list[list[int]]  # per completion: index of the last completion token of each step, increasing
    rewards: list[list[float]]  # per completion: one reward per step; the last is the outcome reward
    checked: list[int]  # per completion: how many steps a step verifier checked (0: the outcome fallback)
    # per completion: why the step verifier could not check it (it raised, or answered malformed steps:
    # `grpo.rewards.outcomes`), else None; such a completion is ungraded, and trains nothing
    ungraded: list[str | None] | None = None


def process_advantages(step_rewards: Sequence[Sequence[float]], step_ends: Sequence[Sequence[int]],
                       group_size: int, width: int, scale: str = "group", eps: float = 1e-4,
                       graded: Sequence[bool] | None = None) -> Tensor:
    """Token advantages [N, width] from each completion's step rewards and the token index each step ends at.

    Rows are laid out group by group, as in `group_advantages`. The mean is each group's over all its steps; the
    std (unbiased, 0 for fewer than two steps) is the group's (`scale="group"`), the whole batch's over all steps
    (`"batch"`), or not divided by (`"none"`). Tokens after a completion's last step get 0.

    `graded` (per row): the rows whose rewards could be had; the steps of the others are no reward at all, left out
    of every mean and std before they are taken, and their tokens get 0 (as `group_advantages` does).

    Hand-worked (group of two; steps r = [1, 0] ending at tokens 0 and 2, and [1] ending at token 1; scale none):
    mean 2/3, r~ = [1/3, -2/3] and [1/3]; first row [1/3 - 2/3, -2/3, -2/3], second [1/3, 1/3, 0]
    >>> process_advantages([[1.0, 0.0], [1.0]], [[0, 2], [1]], 2, 3, scale="none")
    tensor([[-0.3333, -0.6667, -0.6667],
            [ 0.3333,  0.3333,  0.0000]])
    """
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"unknown scale {scale!r}; expected one of ['batch', 'group', 'none']")
    N = len(step_rewards)
    if len(step_ends) != N:
        raise ValueError(f"{len(step_ends)} rows of step ends for {N} rows of step rewards")
    if group_size < 1 or N % group_size:
        raise ValueError(f"{N} completions are not whole groups of group_size {group_size}")
    if graded is not None and len(graded) != N:
        raise ValueError(f"{len(graded)} graded flags for {N} rows of step rewards")
    rows, ends, values = [], [], []
    for i, (r, e) in enumerate(zip(step_rewards, step_ends)):
        if len(r) != len(e):
            raise ValueError(f"completion {i}: {len(r)} step rewards for {len(e)} step ends")
        bad = [t for t in e if not 0 <= t < width]
        if bad:
            raise ValueError(f"completion {i}: step ends {bad} lie outside the {width} completion tokens")
        if graded is not None and not graded[i]:
            continue
        rows += [i] * len(r)
        ends += list(e)
        values += [float(x) for x in r]
    advantages = torch.zeros(N, width + 1)  # [N, C+1]; the extra column keeps the reverse cumsum simple
    if not rows:
        return advantages[:, :width]
    row = torch.tensor(rows)  # [S] the completion each step belongs to
    end = torch.tensor(ends)  # [S]
    r = torch.tensor(values)  # [S]
    group = row // group_size  # [S]
    n_groups = N // group_size
    count = torch.zeros(n_groups).index_add_(0, group, torch.ones_like(r))  # [B] steps per group
    mean = torch.zeros(n_groups).index_add_(0, group, r) / count.clamp(min=1)  # [B]
    centered = r - mean[group]  # [S]
    if scale == "group":
        sq = torch.zeros(n_groups).index_add_(0, group, centered**2)  # [B]
        std = torch.where(count > 1, (sq / (count - 1).clamp(min=1)).sqrt(), torch.zeros_like(sq))  # [B]
        normalised = centered / (std[group] + eps)  # [S]
    elif scale == "batch":
        std = r.std() if r.numel() > 1 else torch.zeros(())
        normalised = centered / (std + eps)  # [S]
    else:
        normalised = centered  # [S]
    advantages.index_put_((row, end), normalised, accumulate=True)  # [N, C+1] each step's r~ at its end token
    # A_t = sum of r~ over steps ending at or after t: a cumulative sum from the right
    return advantages.flip(1).cumsum(1).flip(1)[:, :width]  # [N, C]


def token_char_ends(tokenizer, completion_ids: Tensor, completion_mask: Tensor, texts: Sequence[str]) -> list[list[int]]:
    """Per completion: how many characters of its decoded text the tokens up to each one produce ([N] lists of C).

    Texts are decoded with special tokens skipped (as the sampler decodes them), so an end-of-turn token adds
    nothing. Token by token where the pieces add up to the text; otherwise (a character split across tokens)
    prefix by prefix, which is exact but slower.
    """
    out = []
    for ids, mask, text in zip(completion_ids.tolist(), completion_mask.tolist(), texts):
        ids = [t for t, m in zip(ids, mask) if m]
        pieces = tokenizer.batch_decode([[t] for t in ids], skip_special_tokens=True)
        if "".join(pieces) != text:
            pieces = None
        lengths, total = [], 0
        for k in range(len(ids)):
            if pieces is not None:
                total += len(pieces[k])
            else:
                total = len(tokenizer.decode(ids[: k + 1], skip_special_tokens=True))
            lengths.append(total)
        out.append(lengths)
    return out


def char_to_token_ends(char_ends: Sequence[int], token_chars: Sequence[int]) -> list[int]:
    """The token each step ends in: the first whose text reaches past the step's last character.

    `char_ends` are exclusive character offsets (a step "1 + 2 = 3." at the start ends at 10); `token_chars[k]` is
    how many characters tokens 0..k produce. A step ending past the text ends in the last token.
    >>> char_to_token_ends([3, 5], [2, 4, 6])
    [1, 2]
    """
    out, k = [], 0
    for e in char_ends:
        while k < len(token_chars) - 1 and token_chars[k] < e:
            k += 1
        out.append(k)
    return out


def step_rewards(steps: Sequence[Steps], outcome: Sequence[float], token_chars: Sequence[Sequence[int]]) -> StepRewards:
    """The token-level steps of every completion: its checked steps, then the answer step rewarded with `outcome`.

    The answer step ends at the completion's last token (the end-of-turn token when there is one), so every token
    is covered. Steps that end in that same token merge into the answer step's position but keep their own reward.
    """
    if not len(steps) == len(outcome) == len(token_chars):
        raise ValueError(f"{len(steps)} step lists, {len(outcome)} outcome rewards, {len(token_chars)} completions")
    ends, rewards, checked = [], [], []
    for s, o, chars in zip(steps, outcome, token_chars):
        last = max(len(chars) - 1, 0)
        ends.append(char_to_token_ends(s.ends, chars) + [last])
        rewards.append(list(s.rewards) + [float(o)])
        checked.append(len(s.rewards))
    return StepRewards(ends, rewards, checked)


def score_steps(verifier: StepVerifier, texts: Sequence[str], columns: Mapping[str, Any], outcome: Sequence[float],
                token_chars: Sequence[Sequence[int]], name: str = "step verifier") -> StepRewards:
    """Run a step verifier on the completions and add each one's answer step (see `step_rewards`).

    A completion with no recognisable step falls back to the outcome reward alone; how many did is logged here and
    counted in `step_metrics`.
    """
    texts = list(texts)
    failed: list[str | None] = [None] * len(texts)
    try:
        raw = list(verifier(texts, **columns))
    except Exception:  # one by one, so a completion the verifier cannot check fails alone
        logger.warning("process supervision: the %s raised on the batch; checking its completions one by one", name,
                       exc_info=True)
        raw = []
        for i, text in enumerate(texts):
            single = {k: [v[i]] if isinstance(v, (list, tuple)) and len(v) == len(texts) else v
                      for k, v in columns.items()}
            try:
                one = list(verifier([text], **single))
            except Exception:
                one, failed[i] = [Steps()], RAISED
            raw.append(one[0] if len(one) == 1 else f"{len(one)} step lists for 1 completion")
    if len(raw) != len(texts):  # no answer can be told from another's: every completion is ungraded
        logger.warning("process supervision: the %s returned %d step lists for %d completions; all ungraded "
                       "(malformed)", name, len(raw), len(texts))
        raw, failed = [Steps()] * len(texts), [MALFORMED] * len(texts)
    steps = []
    for i, s in enumerate(raw):  # a malformed answer makes its completion ungraded, not the stage fail
        problem = None if failed[i] else step_problem(s, i)
        if problem is not None:
            logger.warning("process supervision: the %s answered malformed steps: %s; ungraded", name, problem)
            failed[i] = MALFORMED
        steps.append(s if failed[i] is None else Steps())
    result = step_rewards(steps, outcome, token_chars)._replace(ungraded=failed)
    fallback = sum(n == 0 for n in result.checked)
    if fallback:
        logger.info("process supervision: %d of %d completions had no step %s recognised; they take the outcome "
                    "reward alone", fallback, len(texts), name)
    return result


def graded_by_steps(scores, steps: StepRewards):
    """The step's reward scores (`grpo.rewards.RewardScores`) with the step verifier's verdicts added as one more
    grader, `step_verifier`: a completion it could not check is ungraded for its reason, so the loop's group
    statistics, figures, samples table and grading watch leave it out and count it as they do a reward's."""
    why = steps.ungraded or [None] * len(scores.total)
    if not any(why):
        return scores
    graded = [g and w is None for g, w in zip(scores.graded_rows, why)]
    return dataclasses.replace(scores, ungraded={**scores.ungraded, "step_verifier": list(why)}, graded=graded)


def step_metrics(steps: StepRewards) -> dict[str, float]:
    """process/steps_per_completion and process/step_accuracy (checked steps only, the answer step apart),
    process/fallback: completions with no checked step, which took the outcome reward alone, and the completions
    the step verifier left ungraded, by reason (`reward_ungraded/step_verifier/<reason>`)."""
    checked = [r for rewards, n in zip(steps.rewards, steps.checked) for r in rewards[:n]]
    n = max(len(steps.checked), 1)
    why = steps.ungraded or [None] * len(steps.checked)
    return {"process/steps_per_completion": len(checked) / n,
            "process/step_accuracy": sum(checked) / len(checked) if checked else float("nan"),
            # an ungraded completion took no reward at all, not the outcome's alone
            "process/fallback": float(sum(c == 0 and w is None for c, w in zip(steps.checked, why))),
            **{f"reward_ungraded/step_verifier/{reason}": float(why.count(reason)) for reason in (RAISED, MALFORMED)}}
