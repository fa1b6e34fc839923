"""Group-relative advantages for GRPO.

Rewards arrive flat, laid out group by group: rows ``0..G-1`` are prompt 0's G
samples, rows ``G..2G-1`` prompt 1's, and so on. Each sample's advantage is its
reward minus its group's mean, optionally divided by a spread (the group's std,
the batch's std, or nothing -- the Dr. GRPO variant).

Stds are torch's default unbiased ones (correction=1). The std of a single
element is undefined (NaN) under that definition, so here it is taken as 0:
a group of one sample then has advantage exactly 0 (it has nothing to be
compared against), never NaN.

Pure tensor functions: must not depend on models, Prefect or MLflow.
"""

from typing import Callable

import torch
from torch import Tensor


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """View flat rewards ``[B*G]`` as ``[B, G]``, with clear errors for bad input."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B*G], got shape {tuple(rewards.shape)}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards length {rewards.numel()} is not a multiple of group_size {group_size}"
        )
    if not rewards.is_floating_point():
        rewards = rewards.float()
    return rewards.view(-1, group_size)  # [B, G]


def _std(x: Tensor) -> Tensor:
    """Unbiased std over the last dim; 0 (not NaN) when that dim holds one element."""
    if x.shape[-1] < 2:
        return torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)
    return x.std(dim=-1)


def group_std(rewards: Tensor, group_size: int) -> Tensor:
    """Unbiased reward std of each group: ``[B*G] -> [B]`` (0 for groups of one).

    >>> group_std(torch.tensor([1.0, 0.0, 2.0, 2.0]), 2)
    tensor([0.7071, 0.0000])
    """
    return _std(_grouped(rewards, group_size))  # [B]


def zero_std_fraction(rewards: Tensor, group_size: int) -> float:
    """Share of groups whose rewards all agree, i.e. that carry no learning signal.

    Compares values exactly rather than testing ``std == 0``: the float mean of
    identical values can round, so a std-based test could miss them.

    >>> zero_std_fraction(torch.tensor([1.0, 1.0, 0.0, 1.0]), 2)
    0.5
    """
    grouped = _grouped(rewards, group_size)  # [B, G]
    if grouped.shape[0] == 0:
        return 0.0
    agree = (grouped == grouped[:, :1]).all(dim=1)  # [B]
    return agree.float().mean().item()


# Scalers map (centered [B, G], grouped rewards [B, G], eps) -> advantages [B, G].
Scaler = Callable[[Tensor, Tensor, float], Tensor]


def _scale_by_group(centered: Tensor, grouped: Tensor, eps: float) -> Tensor:
    return centered / (_std(grouped) + eps).unsqueeze(1)  # [B, G]


def _scale_by_batch(centered: Tensor, grouped: Tensor, eps: float) -> Tensor:
    # One spread for the whole batch, so easy and hard prompts keep their relative scale.
    return centered / (_std(grouped.flatten()) + eps)  # [B, G]


def _no_scale(centered: Tensor, grouped: Tensor, eps: float) -> Tensor:
    # Dr. GRPO: dividing by the group std up-weights near-unanimous groups; don't.
    return centered  # [B, G]


SCALERS: dict[str, Scaler] = {
    "group": _scale_by_group,
    "batch": _scale_by_batch,
    "none": _no_scale,
}


def group_advantages(
    rewards: Tensor, group_size: int, scale: str = "group", eps: float = 1e-4, graded: Tensor | None = None
) -> Tensor:
    """Group-relative advantages ``[B*G] -> [B*G]``, in the same order as ``rewards``.

    scale: "group" divides by each group's std + eps, "batch" by the whole
    batch's std + eps, "none" only subtracts the group mean. Groups of one get 0.

    graded: ``[B*G]`` bool, the rows whose reward could be had (`grpo.rewards.outcomes`); the others are no
    reward at all. Each group's mean and std are then over its graded rows only (the batch's std over the rows
    it trains on), an ungraded row's advantage is 0, and so is every row of a group with fewer than two graded
    rows: it has nothing to be compared against. All graded: the same numbers as without the mask.

    >>> group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2, scale="none")
    tensor([ 0.5000, -0.5000, -0.5000,  0.5000])
    >>> group_advantages(torch.tensor([1.0, 0.0, 9.0, 0.0, 0.0, 1.0]), 3, scale="none",
    ...                  graded=torch.tensor([True, True, False, True, False, True]))
    tensor([ 0.5000, -0.5000,  0.0000, -0.5000,  0.0000,  0.5000])
    """
    if scale not in SCALERS:
        raise ValueError(f"unknown scale {scale!r}; expected one of {sorted(SCALERS)}")
    if graded is not None and not bool(graded.all()):
        return _graded_advantages(_grouped(rewards, group_size), graded.bool().view(-1, group_size), scale, eps)
    grouped = _grouped(rewards, group_size)  # [B, G]
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # [B, G]
    return SCALERS[scale](centered, grouped, eps).flatten()  # [B*G]


def _graded_advantages(grouped: Tensor, graded: Tensor, scale: str, eps: float) -> Tensor:
    """`group_advantages` over the graded rows (`graded` [B, G] bool) of each group; 0 elsewhere."""
    out = torch.zeros_like(grouped)  # [B, G]
    trains = graded & (graded.sum(1, keepdim=True) >= 2)  # [B, G] graded rows of groups with two or more
    every = grouped[trains]  # the rewards the batch trains on, for scale "batch"
    batch_std = _std(every) if every.numel() else torch.zeros((), dtype=grouped.dtype)
    for b in range(grouped.size(0)):
        rows = graded[b]
        if int(rows.sum()) < 2:  # nothing to compare against: trains nothing
            continue
        values = grouped[b, rows]  # [g]
        centered = values - values.mean()
        if scale == "group":
            centered = centered / (_std(values) + eps)
        elif scale == "batch":
            centered = centered / (batch_std + eps)
        out[b, rows] = centered
    return out.flatten()  # [B*G]


def trained_rows(graded: list[bool], group_size: int) -> Tensor:
    """``[B*G]`` bool: the rows a step trains on, its `graded` rows in groups with at least two of them."""
    mask = torch.tensor(graded, dtype=torch.bool).view(-1, group_size)  # [B, G]
    return (mask & (mask.sum(1, keepdim=True) >= 2)).flatten()
