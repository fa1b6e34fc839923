"""The PPO objective with a critic, as InstructGPT runs it: per-token rewards, GAE, clipped policy and value losses.

For a completion of L tokens (t = 0..L-1), with V_t the critic's value of the state before token t:

    r_t   = -β·(logp_t - ref_t)  (+ the sequence's score at t = L-1)      k1 KL folded into the reward
    δ_t   = r_t + γ·V_{t+1} - V_t                     (V_L = 0: the completion has ended)
    A_t   = δ_t + γ·λ·A_{t+1}                         (GAE), returns R_t = A_t + V_t
    loss  = agg(-min(ρ_t·Â_t, clip(ρ_t, 1-ε, 1+ε_high)·Â_t) + β_loss·KL_t)
          + vf_coef · ½·agg(max((V'_t - R_t)², (V_t + clip(V'_t - V_t, -c, c) - R_t)²))

Â is A whitened over the batch's tokens, V' the critic being trained, agg one of the GRPO loss's reductions
(`grpo.training.loss.AGGREGATORS`), β_loss the KL coefficient when the KL is a loss term (k3, GRPO's) instead of a
reward. Completion masks are prefixes (right padding), as the samplers make them. Rewards, values, old log-probs and
returns are constants (detached).

Pure tensor functions: must not depend on models, Prefect or MLflow.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo.training.loss import AGGREGATORS, k3_kl


def masked_mean(x: Tensor, mask: Tensor, total=None) -> Tensor:
    """Mean of `x` over the mask's tokens (0 when there are none). `total` sums a tensor over the processes that
    each hold part of the batch, for the global batch's mean (the identity, or None, in one process)."""
    total = total or _itself
    return total((x * mask).sum()) / total(mask.sum()).clamp(min=1)


def _itself(t: Tensor) -> Tensor:
    return t


def token_rewards(scores: Tensor, mask: Tensor, logps: Tensor | None = None, ref_logps: Tensor | None = None,
                  beta: float = 0.0) -> Tensor:
    """Per-token rewards [N, C]: the sequence's score [N] on its last token, and -β·(logp - ref) on every token.

    >>> token_rewards(torch.tensor([1.0, 2.0]), torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    tensor([[0., 1., 0.],
            [2., 0., 0.]])
    """
    rewards = torch.zeros_like(mask)  # [N, C]
    if beta != 0:
        if logps is None or ref_logps is None:
            raise ValueError(f"beta={beta} in the reward needs the policy's and the reference's log-probs")
        rewards = -beta * (logps.detach() - ref_logps.detach()) * mask  # [N, C] k1 per token
    C = mask.size(1)
    last = C - 1 - mask.flip(1).argmax(1)  # [N] the last token of each row (an empty row has none)
    ended = mask.sum(1) > 0  # [N]
    rows = torch.arange(mask.size(0), device=mask.device)[ended]
    rewards[rows, last[ended]] += scores.to(rewards.dtype)[ended]
    return rewards


def gae_advantages(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0,
                   lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """GAE advantages and returns [N, C] over each row's completion tokens (zero beyond them).

    Values past a row's last token count as 0: the episode ends there.
    >>> adv, ret = gae_advantages(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.5]]), torch.ones(1, 2), 1.0, 0.5)
    >>> adv  # δ = [0 + 0.5 - 0.5, 1 + 0 - 0.5] = [0, 0.5]; A_0 = 0 + 0.5·0.5
    tensor([[0.2500, 0.5000]])
    """
    rewards, values = rewards * mask, values.detach() * mask  # [N, C]
    C = mask.size(1)
    advantages = torch.zeros_like(rewards)  # [N, C]
    running = torch.zeros_like(rewards[:, 0])  # [N] A_{t+1}
    for t in reversed(range(C)):  # C steps of [N] arithmetic: cheap beside one forward pass
        next_value = values[:, t + 1] if t + 1 < C else torch.zeros_like(running)  # [N]
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # [N]
        running = delta + gamma * lam * running
        advantages[:, t] = running
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8, total=None) -> Tensor:
    """(x - mean) / std over the mask's tokens (unbiased std, as TRL's); zero outside the mask.

    `total` sums a tensor over the processes that each hold part of the batch (the identity in one process), so the
    mean and std are the global batch's.
    """
    total = total or _itself
    n = total(mask.sum())
    mean = total((x * mask).sum()) / n.clamp(min=1)
    var = total((((x - mean) * mask) ** 2).sum()) / (n - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor, total=None) -> float:
    """1 - Var(returns - values) / Var(returns) over the mask's tokens: 1 = a perfect critic, 0 = a constant one.
    `total`: as `masked_mean`'s."""
    var_returns = masked_mean((returns - masked_mean(returns, mask, total)) ** 2, mask, total)
    residual = returns - values
    var_residual = masked_mean((residual - masked_mean(residual, mask, total)) ** 2, mask, total)
    return float(1 - var_residual / var_returns) if var_returns > 0 else float("nan")


def clipped_value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, cliprange_value: float,
                       loss_type: str = "grpo") -> tuple[Tensor, float]:
    """½·agg(max((V' - R)², (V + clip(V' - V, -c, c) - R)²)) and the share of tokens where the clipped term won.

    >>> loss, clipped = clipped_value_loss(torch.tensor([[1.0]]), torch.zeros(1, 1), torch.tensor([[2.0]]),
    ...                                    torch.ones(1, 1), 0.2)
    >>> round(loss.item(), 4), clipped  # max((1 - 2)², (0.2 - 2)²) / 2 = 3.24 / 2
    (1.62, 1.0)
    """
    old = old_values.detach()
    clipped = old + torch.clamp(values - old, -cliprange_value, cliprange_value)  # [N, C]
    unclipped_loss = (values - returns.detach()) ** 2  # [N, C]
    clipped_loss = (clipped - returns.detach()) ** 2  # [N, C]
    loss = 0.5 * AGGREGATORS[loss_type](torch.max(unclipped_loss, clipped_loss), mask)
    with torch.no_grad():
        clip_ratio = masked_mean((clipped_loss > unclipped_loss).to(mask.dtype), mask).item()
    return loss, clip_ratio


def ppo_loss(
    logps: Tensor,
    old_logps: Tensor | None,
    ref_logps: Tensor | None,
    advantages: Tensor,
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    cliprange_value: float = 0.2,
    vf_coef: float = 0.1,
    beta: float = 0.0,
    loss_type: str = "grpo",
) -> tuple[Tensor, dict[str, float]]:
    """PPO's loss (policy + vf_coef x value) and detached stats; every tensor [B, T] over completion tokens.

    old_logps None means one update per rollout: ratio 1. `beta` is the KL coefficient of a k3 loss term (GRPO's
    way); 0 when the KL is in the rewards instead. Stats: pg_loss, value/loss, value/clip_ratio, clip_ratio (and its
    low and high parts), ratio_mean, kl (k3, 0 without the loss term).
    """
    if loss_type not in AGGREGATORS:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {sorted(AGGREGATORS)}")
    if beta != 0 and ref_logps is None:
        raise ValueError(f"beta={beta} needs ref_logps; pass them or set beta=0")
    for name, t in (("advantages", advantages), ("values", values), ("old_values", old_values), ("returns", returns)):
        if t.shape != logps.shape:
            raise ValueError(f"{name} must be [B, T]={tuple(logps.shape)}, got {tuple(t.shape)}")
    aggregate = AGGREGATORS[loss_type]
    eps_low, eps_high = epsilon, epsilon if epsilon_high is None else epsilon_high
    mask = mask.to(logps.dtype)  # [B, T]
    old = logps.detach() if old_logps is None else old_logps.detach()  # [B, T]
    ratio = torch.exp(logps - old)  # [B, T]
    adv = advantages.detach()  # [B, T]
    pg_per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv)  # [B, T]
    per_token = pg_per_token
    kl = 0.0
    if beta != 0:
        kl_per_token = k3_kl(logps, ref_logps)  # [B, T]
        per_token = pg_per_token + beta * kl_per_token
        kl = masked_mean(kl_per_token.detach(), mask).item()
    value_loss, value_clip_ratio = clipped_value_loss(values, old_values, returns, mask, cliprange_value, loss_type)
    loss = aggregate(per_token, mask) + vf_coef * value_loss

    with torch.no_grad():
        low = ((ratio < 1 - eps_low) & (adv < 0)).to(mask.dtype)  # [B, T] the clipped term won, no gradient
        high = ((ratio > 1 + eps_high) & (adv > 0)).to(mask.dtype)  # [B, T]
        stats = {
            "pg_loss": aggregate(pg_per_token, mask).item(),
            "value/loss": value_loss.item(),
            "value/clip_ratio": value_clip_ratio,
            "clip_ratio": masked_mean(low + high, mask).item(),
            "clip_ratio/low": masked_mean(low, mask).item(),
            "clip_ratio/high": masked_mean(high, mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
            "kl": kl,
        }
    return loss, stats
