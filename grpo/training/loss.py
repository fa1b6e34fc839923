"""The GRPO objective: clipped policy-gradient surrogate plus a k3 KL penalty.

Per completion token (ρ = exp(logp - old_logp), A the sequence's advantage):

    loss_t = -min(ρ·A, clip(ρ, 1-ε, 1+ε_high)·A) + β·KL_t
    KL_t   = exp(ref - logp) - (ref - logp) - 1          (k3, always >= 0)

and the per-token losses are reduced to a scalar by one of ``AGGREGATORS``.
``old_logps`` and ``ref_logps`` are treated as constants (detached).
Masked-out positions must still hold finite numbers: they are zeroed by
multiplication, and ``inf * 0`` would be NaN.

Pure tensor functions: must not depend on models, Prefect or MLflow.
"""

from typing import Callable

import torch
from torch import Tensor

# Aggregators map (per-token loss [B, T], mask [B, T] float) -> scalar.
Aggregator = Callable[[Tensor, Tensor], Tensor]


def _grpo_mean(per_token: Tensor, mask: Tensor) -> Tensor:
    """Mean over sequences of each sequence's token mean (original GRPO)."""
    n_tokens = mask.sum(dim=1).clamp(min=1)  # [B]; an empty row gives 0, not NaN
    per_seq = (per_token * mask).sum(dim=1) / n_tokens  # [B]
    return per_seq.mean()


def _bnpo_mean(per_token: Tensor, mask: Tensor) -> Tensor:
    """Token mean over the whole batch: every token weighs the same (DAPO-style)."""
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def _dr_grpo_mean(per_token: Tensor, mask: Tensor) -> Tensor:
    """Token sum over a constant B×T: no length bias from the divisor (Dr. GRPO)."""
    return (per_token * mask).sum() / mask.numel()


AGGREGATORS: dict[str, Aggregator] = {
    "grpo": _grpo_mean,
    "bnpo": _bnpo_mean,
    "dr_grpo": _dr_grpo_mean,
}


def _masked_mean(x: Tensor, mask: Tensor) -> float:
    """Token mean of ``x`` [B, T] over ``mask`` as a python float (0.0 if no tokens)."""
    return ((x * mask).sum() / mask.sum().clamp(min=1)).item()


def k3_kl(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(π || π_ref); no gradient to the reference.

    >>> k3_kl(torch.tensor([0.0]), torch.tensor([2.0]).log())  # e^ln2 - ln2 - 1
    tensor([0.3069])
    """
    delta = ref_logps.detach() - logps  # [B, T]
    return torch.exp(delta) - delta - 1  # [B, T]


def grpo_loss(
    logps: Tensor,
    old_logps: Tensor | None,
    ref_logps: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.04,
    loss_type: str = "grpo",
) -> tuple[Tensor, dict[str, float]]:
    """GRPO loss and detached stats.

    logps, old_logps, ref_logps, mask: [B, T] over completion tokens; advantages: [B].
    old_logps None means one update per rollout (μ=1): ratio 1, gradient -A.
    ref_logps may be None only when beta == 0; with beta == 0 no KL is computed.

    Stats (python floats): kl, clip_ratio, clip_ratio/low, clip_ratio/high,
    ratio_mean (all token means over the mask) and pg_loss (the aggregated
    policy term without the KL).

    Worked example: ρ = e^0.5 ≈ 1.65 > 1.2 with A = 1, so the clipped 1.2·A is
    selected (-1.2, no gradient); the second token has ρ = 1 (-1.0).
    >>> loss, stats = grpo_loss(torch.tensor([[0.5, 0.0]]), torch.zeros(1, 2), None,
    ...                         torch.tensor([1.0]), torch.ones(1, 2), beta=0.0)
    >>> round(loss.item(), 4), stats["clip_ratio/high"]
    (-1.1, 0.5)
    """
    if loss_type not in AGGREGATORS:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {sorted(AGGREGATORS)}")
    if beta != 0 and ref_logps is None:
        raise ValueError(f"beta={beta} needs ref_logps; pass them or set beta=0")
    if advantages.shape != logps.shape[:1]:
        raise ValueError(f"advantages must be [B]={tuple(logps.shape[:1])}, got {tuple(advantages.shape)}")
    eps_low = epsilon
    eps_high = epsilon if epsilon_high is None else epsilon_high
    aggregate = AGGREGATORS[loss_type]

    mask = mask.to(logps.dtype)  # [B, T]
    old = logps.detach() if old_logps is None else old_logps.detach()  # [B, T]
    ratio = torch.exp(logps - old)  # [B, T]
    adv = advantages.detach().unsqueeze(1)  # [B, 1]
    unclipped = ratio * adv  # [B, T]
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv  # [B, T]
    pg_per_token = -torch.min(unclipped, clipped)  # [B, T]

    per_token = pg_per_token  # [B, T]
    kl = 0.0
    if beta != 0:
        kl_per_token = k3_kl(logps, ref_logps)  # [B, T]
        per_token = pg_per_token + beta * kl_per_token  # [B, T]
        kl = _masked_mean(kl_per_token.detach(), mask)
    loss = aggregate(per_token, mask)

    with torch.no_grad():
        # The clipped term wins exactly where the ratio left the trust region in
        # the direction the advantage pushes it; those tokens get no gradient.
        low = ((ratio < 1 - eps_low) & (adv < 0)).to(mask.dtype)  # [B, T]
        high = ((ratio > 1 + eps_high) & (adv > 0)).to(mask.dtype)  # [B, T]
        stats = {
            "kl": kl,
            "clip_ratio": _masked_mean(low + high, mask),
            "clip_ratio/low": _masked_mean(low, mask),
            "clip_ratio/high": _masked_mean(high, mask),
            "ratio_mean": _masked_mean(ratio, mask),
            "pg_loss": aggregate(pg_per_token, mask).item(),
        }
    return loss, stats
