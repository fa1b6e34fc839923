"""The GRPO objective: clipped policy-gradient surrogate plus a k3 KL penalty.

Per completion token (ρ the importance ratio, A the sequence's advantage, or the token's own under process
supervision):

    loss_t = -min(ρ·A, clip(ρ, 1-ε, 1+ε_high)·A) + β·KL_t
    KL_t   = exp(ref - logp) - (ref - logp) - 1          (k3, always >= 0)

ρ is one of ``IMPORTANCE_RATIOS``: per token, exp(logp_t - old_t) (GRPO), or one per sequence, exp of the mean
of the sequence's log-ratios (GSPO), clipped per sequence.

Truncated importance sampling (TIS, Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy
RL training"): the tokens were drawn by a sampler whose numbers differ from the trainer's (bf16, another kernel,
vLLM), so with ``tis_cap`` C each token's policy-gradient term is weighted by the constant
w_t = min(π_train(t) / π_sampler(t), C), π_train the training policy before the update (old_t) and π_sampler the
sampler's log-prob of the chosen token. As in the paper (and verl), the weight corrects the policy-gradient
estimate; the KL penalty is left as it is. The per-token losses are reduced to a scalar by one of
``AGGREGATORS``, and ``BATCH_SHARES`` says how the losses of micro-batches add up to the batch's.
``old_logps`` and ``ref_logps`` are treated as constants (detached).
Masked-out positions must still hold finite numbers: they are zeroed by
multiplication, and ``inf * 0`` would be NaN.

Pure tensor functions: must not depend on models, Prefect or MLflow.
"""

from typing import Callable

import torch
from torch import Tensor

# Aggregators map (per-token loss [B, T] (or [B, 1], broadcast), mask [B, T] float) -> scalar.
Aggregator = Callable[[Tensor, Tensor], Tensor]


def _grpo_mean(per_token: Tensor, mask: Tensor) -> Tensor:
    """Mean over sequences of each sequence's token mean (original GRPO)."""
    n_tokens = mask.sum(dim=1).clamp(min=1)  # [B]; an empty row gives 0, not NaN
    per_seq = (per_token * mask).sum(dim=1) / n_tokens  # [B]
    return per_seq.mean()


def _token_mean(per_token: Tensor, mask: Tensor) -> Tensor:
    """Token mean over the batch: every token weighs the same (bnpo, dapo)."""
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def _dr_grpo_mean(per_token: Tensor, mask: Tensor) -> Tensor:
    """Token sum over a constant B×T: no length bias from the divisor (Dr. GRPO)."""
    return (per_token * mask).sum() / mask.numel()


AGGREGATORS: dict[str, Aggregator] = {
    "grpo": _grpo_mean,
    "bnpo": _token_mean,
    "dapo": _token_mean,
    "dr_grpo": _dr_grpo_mean,
}

# Batch shares map (a micro-batch's mask [b, T], the whole batch's mask [B, T]) -> the weight of the micro-batch's
# loss in the batch's: the trainer backpropagates share x loss for each micro-batch of one optimizer step.


def _row_share(part: Tensor, whole: Tensor) -> float:
    """The micro-batch's share of rows: accumulated, grpo and dr_grpo give their whole-batch loss; bnpo gives the
    mean of the micro-batches' token means (TRL's bnpo: normalised by the tokens of the local batch)."""
    return part.size(0) / whole.size(0)


def _token_share(part: Tensor, whole: Tensor) -> float:
    """The micro-batch's share of tokens: accumulated, the token mean over the whole batch (DAPO,
    arXiv:2503.14476; TRL's dapo: normalised by the tokens of the global accumulated batch)."""
    return float(part.sum() / whole.sum().clamp(min=1))


BATCH_SHARES: dict[str, Callable[[Tensor, Tensor], float]] = {
    "grpo": _row_share,
    "bnpo": _row_share,
    "dapo": _token_share,
    "dr_grpo": _row_share,
}


# Importance ratios map (logps [B, T], old_logps [B, T], mask [B, T]) -> log ρ, [B, T] or [B, 1] (per sequence).


def _token_log_ratio(logps: Tensor, old: Tensor, mask: Tensor) -> Tensor:
    """log ρ_t = logp_t - old_t, one ratio per token (PPO, GRPO)."""
    return logps - old  # [B, T]


def _sequence_log_ratio(logps: Tensor, old: Tensor, mask: Tensor) -> Tensor:
    """log s = mean over the sequence's tokens of (logp_t - old_t): s = (π/π_old)^(1/|y|), one ratio per sequence
    (GSPO, arXiv:2507.18071; TRL's importance_sampling_level="sequence"). An empty row gets 0 (ρ = 1)."""
    return ((logps - old) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)  # [B, 1]


IMPORTANCE_RATIOS: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "token": _token_log_ratio,
    "sequence": _sequence_log_ratio,
}


def batch_share(loss_type: str, part_mask: Tensor, whole_mask: Tensor) -> float:
    """The weight of a micro-batch's `grpo_loss` (its rows' mask `part_mask`) in the loss of the whole batch."""
    return BATCH_SHARES[loss_type](part_mask, whole_mask)


# Part shares map (some rows' mask [b', T], their micro-batch's mask [b, T]) -> the weight of those rows' loss in the
# micro-batch's: exact, as each aggregator is a mean over rows (grpo; dr_grpo, whose divisor is rows x the batch's
# width) or over tokens (bnpo, dapo). Packed micro-batches filled to a token budget hold other rows than the
# `micro_batch_size` ones; their loss is read part by part in those, so that bnpo keeps its value too.
PART_SHARES: dict[str, Callable[[Tensor, Tensor], float]] = {
    "grpo": _row_share,
    "bnpo": _token_share,
    "dapo": _token_share,
    "dr_grpo": _row_share,
}


def part_share(loss_type: str, part_mask: Tensor, micro_mask: Tensor) -> float:
    """The weight of some rows' `grpo_loss` (mask `part_mask`) in the loss of their micro-batch (`micro_mask`).

    >>> part_share("bnpo", torch.tensor([[1., 1., 0.]]), torch.tensor([[1., 1., 0.], [1., 1., 0.]]))  # 2 of 4 tokens
    0.5
    """
    return PART_SHARES[loss_type](part_mask, micro_mask)


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
    importance_sampling_level: str = "token",
    sampler_logps: Tensor | None = None,
    tis_cap: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """GRPO loss and detached stats.

    logps, old_logps, ref_logps, mask: [B, T] over completion tokens; advantages: [B], one a sequence, or [B, T],
    one a token (process supervision).
    old_logps None means one update per rollout (μ=1): ratio 1, gradient -A.
    ref_logps may be None only when beta == 0; with beta == 0 no KL is computed.
    importance_sampling_level: "token" or "sequence" (GSPO), see ``IMPORTANCE_RATIOS``.
    sampler_logps: [B, T] the sampler's log-prob of each chosen token (the tempered full distribution's, as old's);
    with tis_cap (> 0) each token's policy-gradient term is weighted by min(exp(old - sampler), tis_cap), a
    constant.

    Stats (python floats): kl (token mean over the mask), clip_ratio,
    clip_ratio/low, clip_ratio/high, ratio_mean (means over the ratios: the
    mask's tokens, or its non-empty sequences at the sequence level) and
    pg_loss (the aggregated policy term without the KL). With sampler_logps, d = old - sampler per token:
    tis/logp_diff_mean and tis/logp_diff_max (|d| over the mask), tis/mismatch_kl (the token mean over the mask
    of exp(d) - d - 1, the k3 estimate of KL(π_sampler || π_train) from the sampler's tokens; 0 when the two
    agree); with tis_cap also tis/weight_mean (the capped weights' token mean) and tis/truncated_share (the share
    of the mask's tokens whose weight exp(d) exceeded the cap).

    Worked example: ρ = e^0.5 ≈ 1.65 > 1.2 with A = 1, so the clipped 1.2·A is
    selected (-1.2, no gradient); the second token has ρ = 1 (-1.0).
    >>> loss, stats = grpo_loss(torch.tensor([[0.5, 0.0]]), torch.zeros(1, 2), None,
    ...                         torch.tensor([1.0]), torch.ones(1, 2), beta=0.0)
    >>> round(loss.item(), 4), stats["clip_ratio/high"]
    (-1.1, 0.5)
    """
    if loss_type not in AGGREGATORS:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {sorted(AGGREGATORS)}")
    if importance_sampling_level not in IMPORTANCE_RATIOS:
        raise ValueError(f"unknown importance_sampling_level {importance_sampling_level!r}; "
                         f"expected one of {sorted(IMPORTANCE_RATIOS)}")
    if beta != 0 and ref_logps is None:
        raise ValueError(f"beta={beta} needs ref_logps; pass them or set beta=0")
    if advantages.shape not in (logps.shape[:1], logps.shape):
        raise ValueError(f"advantages must be [B]={tuple(logps.shape[:1])} or, one a token, [B, T]="
                         f"{tuple(logps.shape)}; got {tuple(advantages.shape)}")
    if advantages.dim() == 2 and importance_sampling_level != "token":
        raise ValueError("advantages one a token [B, T] need importance_sampling_level 'token'")
    if tis_cap is not None and (tis_cap <= 0 or sampler_logps is None):
        raise ValueError(f"tis_cap={tis_cap} needs sampler_logps and a cap above 0")
    eps_low = epsilon
    eps_high = epsilon if epsilon_high is None else epsilon_high
    aggregate = AGGREGATORS[loss_type]
    log_ratio = IMPORTANCE_RATIOS[importance_sampling_level]

    mask = mask.to(logps.dtype)  # [B, T]
    old = logps.detach() if old_logps is None else old_logps.detach()  # [B, T]
    ratio = torch.exp(log_ratio(logps, old, mask))  # [B, T] or [B, 1]
    # what a ratio stands for: the mask's tokens, or (one ratio a sequence) the sequences with any token
    counted = mask if ratio.size(1) == mask.size(1) else (mask.sum(1, keepdim=True) > 0).to(mask.dtype)
    adv = advantages.detach() if advantages.dim() == 2 else advantages.detach().unsqueeze(1)  # [B, T] or [B, 1]
    unclipped = ratio * adv  # [B, T] or [B, 1]
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv  # [B, T] or [B, 1]
    pg_per_token = -torch.min(unclipped, clipped)  # [B, T] or [B, 1], broadcast over the tokens below
    if tis_cap is not None:
        raw_weight = torch.exp(old - sampler_logps.detach())  # [B, T] π_train / π_sampler
        tis_weight = raw_weight.clamp(max=tis_cap)  # [B, T], a constant
        pg_per_token = pg_per_token * tis_weight  # [B, T]

    per_token = pg_per_token  # [B, T] or [B, 1]
    kl = 0.0
    if beta != 0:
        kl_per_token = k3_kl(logps, ref_logps)  # [B, T]
        per_token = pg_per_token + beta * kl_per_token  # [B, T]
        kl = _masked_mean(kl_per_token.detach(), mask)
    loss = aggregate(per_token, mask)

    with torch.no_grad():
        # The clipped term wins exactly where the ratio left the trust region in
        # the direction the advantage pushes it; those tokens (sequences) get no gradient.
        low = ((ratio < 1 - eps_low) & (adv < 0)).to(mask.dtype)  # [B, T] or [B, 1]
        high = ((ratio > 1 + eps_high) & (adv > 0)).to(mask.dtype)  # [B, T] or [B, 1]
        stats = {
            "kl": kl,
            "clip_ratio": _masked_mean(low + high, counted),
            "clip_ratio/low": _masked_mean(low, counted),
            "clip_ratio/high": _masked_mean(high, counted),
            "ratio_mean": _masked_mean(ratio, counted),
            "pg_loss": aggregate(pg_per_token, mask).item(),
        }
        if sampler_logps is not None:  # how far the sampler's numbers are from the trainer's
            d = old - sampler_logps.detach()  # [B, T] log π_train - log π_sampler
            gap = d.abs()  # [B, T]
            stats["tis/logp_diff_mean"] = _masked_mean(gap, mask)
            stats["tis/logp_diff_max"] = gap.masked_fill(mask == 0, 0.0).max().item() if gap.numel() else 0.0
            # k3 of KL(π_sampler || π_train) over the sampler's own tokens: E_sampler[r - 1 - log r], r = e^d
            d_in = d.masked_fill(mask == 0, 0.0)  # [B, T] padding's numbers may be anything: exp must not overflow
            stats["tis/mismatch_kl"] = _masked_mean(torch.exp(d_in) - d_in - 1, mask)
            if tis_cap is not None:
                stats["tis/weight_mean"] = _masked_mean(tis_weight, mask)
                stats["tis/truncated_share"] = _masked_mean((raw_weight > tis_cap).to(mask.dtype), mask)
    return loss, stats
