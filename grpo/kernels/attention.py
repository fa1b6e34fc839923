"""Attention for training-sized batches on CPU: explicit matmuls, grouped-query heads folded, no K/V copies.

transformers' SDPA path on CPU copies every K/V head to each query head that reads it (`repeat_kv`) whenever a mask
is passed, which GRPO's padded batches always do, and torch's CPU flash kernel is slow to differentiate at these
sizes (a few dozen to a few hundred positions). Here the query heads that share a K/V head are stacked along the
query axis, so one batched matmul per K/V head computes their scores against K/V as stored. On the GRPO benchmark's
model the attention's forward and backward take ~45% less time than SDPA's, and the repeated K/V heads are no longer
kept for the backward. The numbers match SDPA's to float rounding (~1e-6).

`cpu_attention(model)` switches a model to it for the duration of a block, and only where it is exactly the model's
own attention: a plain causal Qwen2/Llama decoder with SDPA or eager attention, on CPU, with no sliding window.

`packed_attention` (`attending_packed(model)`) is the same attention on a packed row (grpo.training.packing):
sequence by sequence, each reading its own keys and, for a completion that shares its group's prompt, the prompt's,
so no score is computed between two sequences (a block-diagonal mask over the row would cost T^2 of them).

A speed trick with the model's own numbers; must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel
from transformers.masking_utils import eager_mask

NAME = "r1_cpu_grouped"
# the language models, their decoders alone (PPO's critic is a copy of one), their sequence classifiers (the
# reward model: the same decoder under a one-output head) and token classifiers (the process reward model)
_SUPPORTED = {"Qwen2ForCausalLM", "LlamaForCausalLM", "Qwen2Model", "LlamaModel", "Qwen2ForSequenceClassification",
              "LlamaForSequenceClassification", "Qwen2ForTokenClassification", "LlamaForTokenClassification"}


def grouped_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """softmax(q k^T * scaling + mask) v for every query head, reading the K/V head it shares with its group.

    query [B, Hq, L, D], key/value [B, Hkv, S, D], attention_mask [B, 1, L, S] additive (0 or the dtype's min).
    Returns [B, L, Hq, D], the layout transformers' attention modules expect back.
    """
    B, Hq, L, D = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    G = Hq // Hkv  # query heads per K/V head; head h reads K/V head h // G (transformers' repeat_kv order)
    if scaling is None:
        scaling = D ** -0.5
    q = query.reshape(B, Hkv, G * L, D)  # [B, Hkv, G*L, D]
    scores = torch.matmul(q, key.transpose(-1, -2)).mul_(scaling)  # [B, Hkv, G*L, S]
    if attention_mask is not None:
        scores = scores.view(B, Hkv, G, L, S) + attention_mask[:, :, None, :, :S]  # [B, Hkv, G, L, S]
    probs = torch.softmax(scores, -1, dtype=torch.float32).to(query.dtype).view(B, Hkv, G * L, S)
    if dropout > 0.0:
        probs = torch.nn.functional.dropout(probs, p=dropout, training=True)
    out = torch.matmul(probs, value)  # [B, Hkv, G*L, D]
    return out.view(B, Hq, L, D).transpose(1, 2).contiguous(), None  # [B, L, Hq, D]


AttentionInterface.register(NAME, grouped_attention)
AttentionMaskInterface.register(NAME, eager_mask)  # always a materialised additive mask, never None


def grouped_attention_supported(model: torch.nn.Module) -> bool:
    """True when `grouped_attention` computes exactly what `model`'s own attention computes."""
    if not isinstance(model, PreTrainedModel) or type(model).__name__ not in _SUPPORTED:
        return False
    cfg = model.config
    if getattr(cfg, "_attn_implementation", None) not in ("sdpa", "eager"):
        return False  # flash or flex kernels, or someone else's function: left alone
    if getattr(cfg, "use_sliding_window", False) or any(
            t != "full_attention" for t in getattr(cfg, "layer_types", None) or []):
        return False
    if getattr(cfg, "attn_logit_softcapping", None):
        return False
    return all(p.device.type == "cpu" for p in model.parameters())


@contextlib.contextmanager
def cpu_attention(*models: torch.nn.Module | None) -> Iterator[None]:
    """Within the block, the given models that support it attend with `grouped_attention`; restored after."""
    switched = []
    try:
        for m in models:
            if m is not None and grouped_attention_supported(m):
                switched.append((m, m.config._attn_implementation))
                m.set_attn_implementation(NAME)
        yield
    finally:
        for m, impl in switched:
            m.set_attn_implementation(impl)


# -- packed rows ---------------------------------------------------------------------------------------------------

PACKED = "r1_packed"


class Segment(NamedTuple):
    """One sequence of a packed row: its own positions [start, end) and, for a completion that shares its group's
    prompt, the prompt's positions [prefix_start, prefix_end) (empty for a sequence of its own)."""

    start: int
    end: int
    prefix_start: int = 0
    prefix_end: int = 0


class PackedSegments:
    """The sequences of one packed row [1, T], in order and covering it, with their masks made once a forward (every
    layer reads the same ones)."""

    def __init__(self, segments: list[Segment]):
        self.segments = segments
        self._masks: dict[tuple, torch.Tensor] = {}

    def mask(self, prefix: int, length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Additive causal mask [1, 1, length, prefix + length]: query i sees the whole prefix and its own keys <= i."""
        key = (prefix, length, dtype, device)
        if key not in self._masks:
            seen = torch.ones(length, prefix + length, dtype=torch.bool, device=device).tril(prefix)  # [l, p+l]
            self._masks[key] = torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill(
                ~seen, torch.finfo(dtype).min)[None, None]  # [1, 1, l, p+l]
        return self._masks[key]


def segments_from_positions(position_ids: torch.Tensor) -> PackedSegments:
    """Sequences of a packed row read from its positions [1, T]: a new one wherever a position does not follow the one
    before (transformers' own reading, `find_packed_sequence_indices`); none shares a prefix."""
    pos = position_ids[0].tolist()
    starts = [i for i in range(len(pos)) if i == 0 or pos[i] != pos[i - 1] + 1]
    return PackedSegments([Segment(a, b) for a, b in zip(starts, starts[1:] + [len(pos)])])


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     packed_segments: PackedSegments | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention within each sequence of a packed row, sequence by sequence: Σ l_i (p_i + l_i) scores, not the T^2 of
    a block-diagonal mask over the whole row, and a completion reads its group's prompt where it shares one.

    query [1, Hq, T, D], key/value [1, Hkv, T, D]; the sequences come from `packed_segments` (passed through the
    model's forward), else from `position_ids`. Any other call is `grouped_attention`: with its padding mask, or
    causal (rows without padding, a cached step), so a model may keep this attention for every pass of a loop.
    Returns [B, L, Hq, D].
    """
    if attention_mask is not None:
        return grouped_attention(module, query, key, value, attention_mask, dropout, scaling)
    L, S = query.size(2), key.size(2)
    if L != S or (query.size(0) != 1 and packed_segments is None):  # unpadded rows, or a cached step: causal
        causal = PackedSegments([]).mask(S - L, L, query.dtype, query.device)  # [1, 1, L, S] the last L see back
        return grouped_attention(module, query, key, value, causal, dropout, scaling)
    if packed_segments is None:
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(query.size(2))[None]
        packed_segments = segments_from_positions(positions)
    outs = []
    for s in packed_segments.segments:
        p = s.prefix_end - s.prefix_start
        k, v = key[:, :, s.start:s.end], value[:, :, s.start:s.end]  # [1, Hkv, l, D]
        if p:
            k = torch.cat([key[:, :, s.prefix_start:s.prefix_end], k], 2)  # [1, Hkv, p+l, D]
            v = torch.cat([value[:, :, s.prefix_start:s.prefix_end], v], 2)  # [1, Hkv, p+l, D]
        mask = packed_segments.mask(p, s.end - s.start, query.dtype, query.device)  # [1, 1, l, p+l]
        outs.append(grouped_attention(module, query[:, :, s.start:s.end], k, v, mask, dropout, scaling)[0])
    return torch.cat(outs, 1), None  # [1, T, Hq, D]


def _packed_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """No mask for a packed row (the sequences say who sees whom); a padded batch's mask as `grouped_attention`'s."""
    if attention_mask is None:
        return None
    return eager_mask(*args, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(PACKED, packed_attention)
AttentionMaskInterface.register(PACKED, _packed_mask)


def packed_attention_supported(model: torch.nn.Module) -> bool:
    """True when `packed_attention` computes what `model`'s own attention computes (on any device)."""
    if not isinstance(model, PreTrainedModel) or type(model).__name__ not in _SUPPORTED:
        return False
    cfg = model.config
    if getattr(cfg, "_attn_implementation", None) not in ("sdpa", "eager", NAME, PACKED):
        return False
    if getattr(cfg, "use_sliding_window", False) or any(
            t != "full_attention" for t in getattr(cfg, "layer_types", None) or []):
        return False
    return not getattr(cfg, "attn_logit_softcapping", None)


@contextlib.contextmanager
def attending_packed(model: torch.nn.Module | None, on: bool = True) -> Iterator[None]:
    """Within the block, `model` attends with `packed_attention` where it is `on` and supported (a loop holds it for
    its whole run: a checkpointed layer recomputed in the backward must find the attention its forward had)."""
    if model is None or not on or not packed_attention_supported(model) or \
            model.config._attn_implementation == PACKED:
        yield
        return
    impl = model.config._attn_implementation
    model.set_attn_implementation(PACKED)
    try:
        yield
    finally:
        model.set_attn_implementation(impl)
