"""Batches of the loops: which rows a step takes, and token lists padded into tensors.

Pure functions of their arguments (a step's rows depend on the step and the seed alone, so a resumed run takes what
it would have taken). Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import numpy as np
import torch


def batch_indices(n_rows: int, batch_size: int, micro_step: int, seed: int) -> list[int]:
    """Row indices of micro-batch number `micro_step`: a fresh permutation per epoch, a pure function of the step."""
    per_epoch = max(1, n_rows // batch_size)
    epoch, k = divmod(micro_step, per_epoch)
    perm = np.random.default_rng([seed, epoch]).permutation(n_rows)
    return perm[k * batch_size : (k + 1) * batch_size].tolist()


def prompt_order(n_prompts: int, step: int, per_step: int, seed: int, draw: int = 0) -> list[int]:
    """Prompt indices for a step: epoch-wise permutations walked in order, a pure function of the step.

    Draw 0 is the step's own batch; refill draws (dynamic sampling) come from a separate random stream, so they
    never shift which prompts later steps see.
    """
    if draw:
        return np.random.default_rng([seed, 1, step, draw]).choice(n_prompts, per_step, replace=False).tolist()
    per_epoch = n_prompts // per_step
    epoch, i = divmod(step, per_epoch)
    perm = np.random.default_rng([seed, 0, epoch]).permutation(n_prompts)
    return perm[i * per_step : (i + 1) * per_step].tolist()


def pad_right(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right padding: every row starts at position 0, so a row's positions and score do not depend on its batch."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id)  # [B, T]
    mask = torch.zeros((len(seqs), width), dtype=torch.long)  # [B, T]
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


def micro_batches(n: int, size: int) -> list[slice]:
    """The rows of a batch of `n` in slices of `size` (the last one shorter)."""
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]
