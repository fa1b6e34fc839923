"""Batches of the loops: which rows a step takes, and token lists padded into tensors.

Pure functions of their arguments (a step's rows depend on the step and the seed alone, so a resumed run takes what
it would have taken). Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

from typing import NamedTuple

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


class PromptOrder(NamedTuple):
    """Which prompts each step takes (picklable: asynchronous samplers draw the same ones): `prompt_order` over all
    rows, or, with strata, a fixed count from each stratum every step, each walked in its own epoch-wise
    permutations (so a small stratum repeats sooner than a large one), the step's prompts then interleaved."""

    n_prompts: int
    per_step: int
    seed: int
    strata: tuple[tuple[int, ...], ...] = ()  # the row indices of each stratum
    counts: tuple[int, ...] = ()  # prompts a step takes from each stratum (summing to per_step)

    def __call__(self, step: int, draw: int = 0) -> list[int]:
        if not self.strata:
            return prompt_order(self.n_prompts, step, self.per_step, self.seed, draw)
        idx = []
        for s, (rows, k) in enumerate(zip(self.strata, self.counts)):
            if k:  # the stratum's own stream: [seed, 2, s] never meets prompt_order's [seed, 0] or [seed, 1]
                idx += [rows[i] for i in prompt_order(len(rows), step, k, hash_seed(self.seed, 2, s), draw)]
        # interleaved, so each process's contiguous share of the step holds every stratum alike
        return [idx[i] for i in np.random.default_rng([self.seed, 3, step, draw]).permutation(len(idx))]


def hash_seed(*parts: int) -> int:
    """One 63-bit seed from several integers (a stream of its own for each combination)."""
    return int(np.random.SeedSequence(list(parts)).generate_state(2, np.uint64)[0] >> np.uint64(1))


def mixed_order(kinds: list[str], per_step: int, seed: int, mix: dict[str, float]) -> PromptOrder:
    """The PromptOrder of a prompt table whose rows have these `kinds`, taking round(share x per_step) prompts of
    each kind `mix` names every step and the rest from the other rows; an empty mix draws from all rows alike.
    A kind with no row, a count of 0 for a share above 0, or a stratum smaller than its count is an error here,
    before any sampling."""
    order = PromptOrder(len(kinds), per_step, seed)
    if not mix:
        return order
    named = {k: round(share * per_step) for k, share in mix.items()}
    present = set(kinds)
    for kind, k in named.items():
        if kind not in present:
            raise ValueError(f"prompt_mix names kind {kind!r}, but no prompt row has it (kinds: {sorted(present)})")
        if k == 0:
            raise ValueError(f"prompt_mix gives {kind!r} {mix[kind]:g} of {per_step} prompts a step: less than one; "
                             f"raise the share or prompts_per_step")
    rest = per_step - sum(named.values())
    strata = [tuple(i for i, kind in enumerate(kinds) if kind == name) for name in named]
    others = tuple(i for i, kind in enumerate(kinds) if kind not in named)
    counts = list(named.values())
    if rest:
        if not others:
            raise ValueError(f"prompt_mix leaves {rest} of {per_step} prompts a step to other kinds, but every row is "
                             f"of a kind it names ({sorted(named)}): make the shares add up to 1")
        strata.append(others)
        counts.append(rest)
    for rows, k, name in zip(strata, counts, [*named, "the other kinds"]):
        if len(rows) < k:
            raise ValueError(f"prompt_mix takes {k} prompts of {name} a step, but there are only {len(rows)}")
    return order._replace(strata=tuple(strata), counts=tuple(counts))


def prompt_mix_order(prompts, cfg) -> PromptOrder:
    """`mixed_order` of a loop's prompt table (a DataFrame) under its GRPOConfig's `prompt_mix`."""
    if cfg.prompt_mix and "kind" not in prompts.columns:
        raise ValueError(f"prompt_mix {cfg.prompt_mix} shares each step's prompts by the rows' `kind`, but the prompts "
                         f"have no `kind` column (columns: {list(prompts.columns)})")
    kinds = prompts["kind"].astype(str).tolist() if cfg.prompt_mix else [""] * len(prompts)
    return mixed_order(kinds, cfg.prompts_per_step, cfg.seed, cfg.prompt_mix)


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
