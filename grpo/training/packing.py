"""Packed (padding-free) training rows: sequences one after another in one row, and micro-batches filled to a token
budget.

A padded micro-batch [B, L] computes B x L positions for sum(lengths) real ones; with lengths spread from a few tokens
to the budget (reasoning traces) most of it is padding. Packed, a micro-batch is one row [1, T] holding only real
tokens: positions restart at 0 for each sequence, and attention stays within each sequence (`Segment`s read by
`grpo.kernels.attention.packed_attention`; a flash-attention model reads the positions alone, as transformers does).

Two layouts of GRPO's rows (a left-padded prompt then a right-padded completion, the last C columns):
- shared prompts: each distinct prompt once, then each of its rows' completions as a sequence of its own that also
  reads the prompt (positions continuing from the prompt's length): the padded path's shared prompt pass, packed;
- one sequence a row (prompt then completion): for attention that only knows position ids (flash-attention).
Either way a row's last token is not fed (nothing is predicted from it), and `PackedRows.predictors` says which
packed position predicts each completion token.

`pack_in_order` fills micro-batches with whole rows in their order up to `max_tokens` (why in order: see there).
Pure torch and python; must not depend on models, Prefect or MLflow.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from grpo.kernels.attention import PackedSegments, Segment
from grpo.training.batches import micro_batches
from grpo.training.loss import batch_share, part_share


class PackedRows(NamedTuple):
    """N padded rows as one packed row, and the way back to their [N, C] completion tokens."""

    input_ids: torch.Tensor  # [1, T] every sequence's tokens, no padding
    position_ids: torch.Tensor  # [1, T] from 0 for each sequence (from the prompt's length for a shared-prompt one)
    segments: PackedSegments  # the sequences of the row, in order, covering [0, T)
    predictors: torch.Tensor  # [M] the packed position whose output predicts each real completion token
    valid: torch.Tensor  # [N, C] bool: the real completion tokens (row-major order of `predictors`)


def row_spans(attention_mask: torch.Tensor, n_completion: int) -> tuple[list[int], list[int]]:
    """Each row's prompt and completion token counts, checking that its tokens are one run: a left-padded prompt
    then a right-padded completion (the last `n_completion` columns). A row without a prompt token cannot predict its
    first completion token: an error naming the row."""
    mask = attention_mask.bool().cpu()  # [N, L]
    P = mask.size(1) - n_completion
    prompt = mask[:, :P].sum(1).tolist()  # [N]
    completion = mask[:, P:].sum(1).tolist()  # [N]
    for r, (p, c) in enumerate(zip(prompt, completion)):
        if not (mask[r, P - p:P].all() and mask[r, P:P + c].all()):
            raise ValueError(f"row {r}: its tokens are not a left-padded prompt then a right-padded completion "
                             f"(attention mask {mask[r].int().tolist()}); packing needs that layout")
        if c and not p:
            raise ValueError(f"row {r} has {c} completion tokens and no prompt token: its first completion token "
                             f"has nothing to be predicted from")
    return prompt, completion


def pack_completions(input_ids: torch.Tensor, attention_mask: torch.Tensor, n_completion: int,
                     share_prompts: bool) -> PackedRows:
    """Pack N rows [N, P+C] (left-padded prompts, right-padded completions) into one row without padding.

    `share_prompts`: each distinct prompt once, its rows' completions reading it (needs `packed_attention`);
    otherwise each row is a sequence of its own from position 0 (what position-id attention understands).
    """
    N, L = input_ids.shape
    C, P = n_completion, L - n_completion
    prompt_len, completion_len = row_spans(attention_mask, C)
    ids = input_ids.cpu()
    pieces: list[torch.Tensor] = []  # token runs of the packed row, in order
    positions: list[torch.Tensor] = []
    segments: list[Segment] = []
    predictors: list[torch.Tensor] = []  # per row, [c] packed positions predicting its completion tokens
    at = 0  # the packed row's length so far

    def put(tokens: torch.Tensor, first_position: int, prefix: tuple[int, int] = (0, 0)) -> int:
        nonlocal at
        start = at
        pieces.append(tokens)
        positions.append(torch.arange(first_position, first_position + tokens.numel()))
        segments.append(Segment(start, start + tokens.numel(), *prefix))
        at += tokens.numel()
        return start

    prompt_at: dict[tuple[int, ...], tuple[int, int]] = {}  # a distinct prompt's tokens -> (start, length)
    for r in range(N):
        p, c = prompt_len[r], completion_len[r]
        if c == 0:  # nothing of it is scored: no token of it is fed
            predictors.append(torch.zeros(0, dtype=torch.long))
            continue
        prompt = ids[r, P - p:P]  # [p]
        completion = ids[r, P:P + c - 1]  # [c-1] the last token predicts nothing
        if share_prompts:
            key = tuple(prompt.tolist())
            if key not in prompt_at:
                prompt_at[key] = (put(prompt, 0), p)
            start, _ = prompt_at[key]
            last_prompt = start + p - 1  # predicts the first completion token of every row of the group
            own = put(completion, p, (start, start + p)) if c > 1 else at
            predictors.append(torch.cat([torch.tensor([last_prompt]), torch.arange(own, own + c - 1)]))
        else:
            start = put(torch.cat([prompt, completion]), 0)
            predictors.append(torch.arange(start + p - 1, start + p - 1 + c))
    if not pieces:  # no row has a completion token: one prompt token keeps the forward well-formed
        put(ids[0, max(P - 1, 0):max(P, 1)], 0)
    device = input_ids.device
    valid = attention_mask[:, P:].bool()  # [N, C] real completion tokens, a prefix of each row
    return PackedRows(torch.cat(pieces)[None].to(device), torch.cat(positions)[None].to(device),
                      PackedSegments(segments), torch.cat(predictors).to(device), valid)


def pack_sequences(input_ids: Sequence[Sequence[int]]) -> dict:
    """Whole sequences (a reward model's prompt + response, SFT's rows) as one row [1, T]: the model's inputs, each
    sequence from position 0 and attending to itself alone; `ends` [B] holds each one's last position."""
    ids = [torch.tensor(list(x), dtype=torch.long) for x in input_ids]
    if not ids or any(x.numel() == 0 for x in ids):
        raise ValueError(f"packing needs at least one sequence and a token in each; got lengths "
                         f"{[x.numel() for x in ids]}")
    segments, start = [], 0
    for x in ids:
        segments.append(Segment(start, start + x.numel()))
        start += x.numel()
    return {"input_ids": torch.cat(ids)[None],  # [1, T]
            "position_ids": torch.cat([torch.arange(x.numel()) for x in ids])[None],  # [1, T]
            "packed_segments": PackedSegments(segments), "use_cache": False,
            "ends": torch.tensor([s.end - 1 for s in segments])}  # [B]


def pack_examples(input_ids: Sequence[Sequence[int]], labels: Sequence[Sequence[int]]) -> dict:
    """SFT's rows (token ids and labels, -100 where no loss) as one row [1, T]: the model's inputs.

    Each sequence's first label is -100, so the shifted loss never predicts one sequence's first token from the
    last of the one before it; the loss then counts the padded batch's tokens, and its token mean is theirs.
    """
    packed = pack_sequences(input_ids)
    packed.pop("ends")
    packed_labels = [torch.tensor([-100] + list(y[1:]), dtype=torch.long) for y in labels]
    packed["labels"] = torch.cat(packed_labels)[None]  # [1, T]
    return packed


def micro_batch_rows(attention_mask: torch.Tensor, micro_batch_size: int,
                     max_tokens: int | None) -> list[slice] | list[list[int]]:
    """A batch's micro-batches: `micro_batch_size` rows each (slices) without a token budget, else whole rows in
    order up to `max_tokens` real tokens each (`pack_in_order`)."""
    if max_tokens is None:
        return micro_batches(attention_mask.size(0), micro_batch_size)
    return pack_in_order(row_tokens(attention_mask), max_tokens)


def row_tokens(attention_mask: torch.Tensor) -> list[int]:
    """Each row's real tokens: the most it adds to a packed row (one less, fewer where its prompt is shared)."""
    return attention_mask.sum(1).tolist()


def pack_in_order(tokens: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Row indices of micro-batches: whole rows in their order, a new micro-batch when the next row would pass
    `max_tokens` (next-fit).

    In order rather than first-fit decreasing: a GRPO group's rows stay side by side, so their prompt is packed once
    per micro-batch rather than once per row; a micro-batch is a run of rows, so the loss of each part of it is read
    from the padded batch's own slices; and a row's micro-batch depends on the rows before it alone. The price: a
    micro-batch can close short of the budget when the next row is long (never two in a row below half the budget).
    A row longer than the budget is an error naming it, raised before any forward (the trainers check the longest
    row a step can make before training starts): a budget is a memory bound, and a row past it would break it.

    >>> pack_in_order([3, 4, 2, 5, 1], 7)
    [[0, 1], [2, 3], [4]]
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_microbatch must be at least 1, got {max_tokens}")
    batches: list[list[int]] = []
    used = max_tokens + 1  # no micro-batch open yet
    for i, n in enumerate(tokens):
        if n > max_tokens:
            raise ValueError(f"row {i} has {n} tokens, more than max_tokens_per_microbatch={max_tokens}; raise the "
                             f"budget to at least the longest row (prompt + completion tokens)")
        if used + n > max_tokens:
            batches.append([])
            used = 0
        batches[-1].append(i)
        used += n
    return batches


def reference_parts(rows: Sequence[int], micro_batch_size: int) -> list[tuple[list[int], slice]]:
    """A micro-batch's rows split by the row-count micro-batch (`micro_batch_size` rows, in order) each would have
    been in: (positions within `rows`, that micro-batch's slice of the batch). The losses whose value depends on the
    micro-batch (bnpo: the token mean of each) are read per part.

    >>> reference_parts([2, 3, 4], 2)
    [([0], slice(2, 4, None)), ([1, 2], slice(4, 6, None))]
    """
    parts: dict[int, list[int]] = {}
    for j, r in enumerate(rows):
        parts.setdefault(r // micro_batch_size, []).append(j)
    return [(js, slice(k * micro_batch_size, (k + 1) * micro_batch_size)) for k, js in parts.items()]


def loss_parts(loss_type: str, mask: torch.Tensor, rows: slice | Sequence[int], micro_batch_size: int,
               weight: float) -> list[tuple[list[int] | None, float]]:
    """A micro-batch's loss in parts, each (its positions among `rows`, or None for all; its weight in the step's
    loss), for a loss aggregated by `loss_type` over the batch's completion `mask` [N, C].

    A micro-batch of `micro_batch_size` rows (a slice) is one part weighted as always (`batch_share`); a packed one
    filled to a token budget is read in the row-count micro-batches its rows come from (`reference_parts`), so that
    every loss_type (bnpo's token mean per micro-batch too) keeps the value it has without a budget."""
    if isinstance(rows, slice):
        return [(None, batch_share(loss_type, mask[rows], mask) * weight)]
    return [(local, batch_share(loss_type, mask[ref], mask)
             * part_share(loss_type, mask[[rows[j] for j in local]], mask[ref]) * weight)
            for local, ref in reference_parts(rows, micro_batch_size)]
