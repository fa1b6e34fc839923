"""Attention for training-sized batches on CPU: explicit matmuls, grouped-query heads folded, no K/V copies.

transformers' SDPA path on CPU copies every K/V head to each query head that reads it (`repeat_kv`) whenever a mask
is passed, which GRPO's padded batches always do, and torch's CPU flash kernel is slow to differentiate at these
sizes (a few dozen to a few hundred positions). Here the query heads that share a K/V head are stacked along the
query axis, so one batched matmul per K/V head computes their scores against K/V as stored. On the GRPO benchmark's
model the attention's forward and backward take ~45% less time than SDPA's, and the repeated K/V heads are no longer
kept for the backward. The numbers match SDPA's to float rounding (~1e-6).

`cpu_attention(model)` switches a model to it for the duration of a block, and only where it is exactly the model's
own attention: a plain causal Qwen2/Llama decoder with SDPA or eager attention, on CPU, with no sliding window.

A speed trick with the model's own numbers; must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel
from transformers.masking_utils import eager_mask

NAME = "r1_cpu_grouped"
# the language models, and their decoders alone (PPO's critic is a copy of one)
_SUPPORTED = {"Qwen2ForCausalLM", "LlamaForCausalLM", "Qwen2Model", "LlamaModel"}


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
