"""grpo.training.loss.grpo_loss against hand-worked numbers and a naive per-token loop (CPU)."""

import math

import pytest
import torch

from grpo.training.loss import batch_share, grpo_loss

LOSS_TYPES = ["grpo", "bnpo", "dapo", "dr_grpo"]
LEVELS = ["token", "sequence"]


def naive_grpo_loss(logps, old, ref, adv, mask, eps_low, eps_high, beta, loss_type, level="token", sampler=None,
                    tis_cap=None):
    """Plain per-token loop over 0-d tensors; returns (loss, stats) like grpo_loss.

    level "sequence" (GSPO): every token of a sequence uses the sequence's ratio exp(mean of its log-ratios), and the
    clip and ratio statistics count sequences (those with a token) instead of tokens.
    sampler, tis_cap: the sampler's log-probs; with a cap, each token's policy term times min(π_old/π_sampler, cap).
    """
    B, T = logps.shape
    seq_sums, seq_counts = [], []
    pg_sums = []
    kl_sum = ratio_sum = gap_sum = gap_max = weight_sum = mismatch_sum = 0.0
    n_truncated = 0
    n_low = n_high = 0
    n_units = 0  # tokens, or non-empty sequences
    for b in range(B):
        seq_sum = pg_sum = 0.0
        count = 0
        seq_ratio = None
        if level == "sequence":
            log_ratios = [logps[b, t] - old[b, t] for t in range(T) if mask[b, t]]
            if log_ratios:
                seq_ratio = torch.exp(sum(log_ratios) / len(log_ratios))
        for t in range(T):
            if not mask[b, t]:
                continue
            count += 1
            ratio = torch.exp(logps[b, t] - old[b, t]) if seq_ratio is None else seq_ratio
            first = level == "token" or count == 1  # a sequence's ratio is counted once
            lo, hi = 1 - eps_low, 1 + eps_high
            if ratio < lo:
                clipped_ratio = torch.tensor(lo, dtype=logps.dtype)  # constant: no gradient
            elif ratio > hi:
                clipped_ratio = torch.tensor(hi, dtype=logps.dtype)
            else:
                clipped_ratio = ratio
            unclipped_term = ratio * adv[b]
            clipped_term = clipped_ratio * adv[b]
            if clipped_term < unclipped_term:  # the min picks the clipped term
                term = clipped_term
                if first and adv[b] < 0:
                    n_low += 1
                elif first:
                    n_high += 1
            else:
                term = unclipped_term
            token_loss = -term
            if sampler is not None:
                d = old[b, t].item() - sampler[b, t].item()  # log π_train - log π_sampler
                gap = abs(d)
                gap_sum, gap_max = gap_sum + gap, max(gap_max, gap)
                mismatch_sum += math.exp(d) - d - 1  # k3 of KL(π_sampler || π_train), a sampler's token
            if tis_cap is not None:
                raw = math.exp(old[b, t].item() - sampler[b, t].item())
                weight = min(raw, tis_cap)  # a constant
                token_loss = token_loss * weight
                weight_sum += weight
                n_truncated += raw > tis_cap
            pg_sum = pg_sum + token_loss.item()
            if beta != 0:
                d = ref[b, t].item() - logps[b, t]
                kl = torch.exp(d) - d - 1
                token_loss = token_loss + beta * kl
                kl_sum += kl.item()
            if first:
                ratio_sum += ratio.item()
                n_units += 1
            seq_sum = seq_sum + token_loss
        seq_sums.append(seq_sum)
        pg_sums.append(pg_sum)
        seq_counts.append(count)

    n = sum(seq_counts)
    if loss_type == "grpo":
        loss = sum(s / max(c, 1) for s, c in zip(seq_sums, seq_counts)) / B
        pg = sum(s / max(c, 1) for s, c in zip(pg_sums, seq_counts)) / B
    elif loss_type in ("bnpo", "dapo"):  # one batch: both are its token mean
        loss = sum(seq_sums) / max(n, 1)
        pg = sum(pg_sums) / max(n, 1)
    else:  # dr_grpo
        loss = sum(seq_sums) / (B * T)
        pg = sum(pg_sums) / (B * T)
    stats = {
        "kl": kl_sum / n,
        "clip_ratio": (n_low + n_high) / n_units,
        "clip_ratio/low": n_low / n_units,
        "clip_ratio/high": n_high / n_units,
        "ratio_mean": ratio_sum / n_units,
        "pg_loss": pg,
    }
    if sampler is not None:
        stats["tis/logp_diff_mean"], stats["tis/logp_diff_max"] = gap_sum / n, gap_max
        stats["tis/mismatch_kl"] = mismatch_sum / n
    if tis_cap is not None:
        stats["tis/weight_mean"] = weight_sum / n
        stats["tis/truncated_share"] = n_truncated / n
    return loss, stats


def random_case(seed=0, level="token"):
    """B=5, T=6 in float64; ratios spread ~exp(±0.6) so clipping fires on both sides (for sequence ratios, row 0
    is moved up by 0.4 so that a sequence with a positive advantage clips too)."""
    g = torch.Generator().manual_seed(seed)
    B, T = 5, 6
    old = -1.0 - torch.rand(B, T, generator=g, dtype=torch.float64)  # [B, T]
    shift = torch.tensor([0.4 if level == "sequence" else 0.0, 0, 0, 0, 0], dtype=torch.float64)[:, None]
    logps = (old + shift + 0.6 * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    ref = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)  # [B, T]
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3], dtype=torch.float64)  # [B]
    lengths = torch.tensor([6, 3, 0, 1, 5])  # ragged, row 2 empty
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()  # [B, T]
    return logps, old, ref, adv, mask


def test_random_case_exercises_both_clip_sides():
    # guard for the comparison test below: it must actually hit low and high clipping
    logps, old, _, adv, mask = random_case()
    ratio = torch.exp(logps.detach() - old)
    on = mask.bool()
    low = (ratio < 0.8) & (adv[:, None] < 0) & on
    high = (ratio > 1.28) & (adv[:, None] > 0) & on
    assert low.any() and high.any()
    assert (mask.sum(1) == 0).any()


def test_random_case_clips_sequences_on_both_sides():
    # the same guard for the sequence level: some sequences' ratios leave [0.8, 1.28] both ways
    logps, old, _, adv, mask = random_case(level="sequence")
    seq = torch.exp(((logps.detach() - old) * mask).sum(1) / mask.sum(1).clamp(min=1))  # [B]
    assert ((seq < 0.8) & (adv < 0)).any() and ((seq > 1.28) & (adv > 0)).any()


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("epsilon_high", [None, 0.28])
def test_matches_naive_loop(loss_type, beta, epsilon_high, level):
    logps, old, ref, adv, mask = random_case(level=level)
    eps = 0.2
    eps_high = eps if epsilon_high is None else epsilon_high

    loss, stats = grpo_loss(
        logps, old, ref, adv, mask,
        epsilon=eps, epsilon_high=epsilon_high, beta=beta, loss_type=loss_type, importance_sampling_level=level,
    )
    (grad,) = torch.autograd.grad(loss, logps)

    want_loss, want_stats = naive_grpo_loss(logps, old, ref, adv, mask, eps, eps_high, beta, loss_type, level)
    (want_grad,) = torch.autograd.grad(want_loss, logps)

    torch.testing.assert_close(loss, want_loss)
    torch.testing.assert_close(grad, want_grad)
    assert stats["clip_ratio/low"] > 0 and stats["clip_ratio/high"] > 0
    for key, value in want_stats.items():
        assert stats[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    assert all(isinstance(v, float) for v in stats.values())
    # masked-out tokens (incl. the empty row) get no gradient
    assert (grad[mask == 0] == 0).all()


def test_hand_worked_clipping():
    # eps = 0.2, beta = 0, loss_type "grpo"
    # row 0, A = +1: logps [0.5, 0] vs old [0, 0]
    #   token 0: ρ = e^0.5 = 1.6487 > 1.2 -> min(1.6487, 1.2) = 1.2 (clipped) -> loss -1.2, grad 0
    #   token 1: ρ = 1 -> loss -1, d(-ρA)/dlogp = -ρA = -1
    #   row mean (-1.2 - 1) / 2 = -1.1
    # row 1, A = -1: logps [-0.5, 0]
    #   token 0: ρ = e^-0.5 = 0.6065 < 0.8 -> min(-0.6065, -0.8) = -0.8 (clipped) -> loss 0.8, grad 0
    #   token 1: ρ = 1 -> loss +1, d(-ρA)/dlogp = -ρA = +1
    #   row mean (0.8 + 1) / 2 = 0.9
    # loss = (-1.1 + 0.9) / 2 = -0.1; each token's grad is scaled by 1/2 (row mean) * 1/2 (batch mean)
    logps = torch.tensor([[0.5, 0.0], [-0.5, 0.0]], requires_grad=True)
    old = torch.zeros(2, 2)
    adv = torch.tensor([1.0, -1.0])
    loss, stats = grpo_loss(logps, old, None, adv, torch.ones(2, 2), epsilon=0.2, beta=0.0)
    (grad,) = torch.autograd.grad(loss, logps)

    assert loss.item() == pytest.approx(-0.1, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.25], [0.0, 0.25]]))
    assert stats["clip_ratio"] == pytest.approx(0.5)  # 2 of 4 tokens clipped
    assert stats["clip_ratio/low"] == pytest.approx(0.25)
    assert stats["clip_ratio/high"] == pytest.approx(0.25)
    # ratio mean (1.6487 + 1 + 0.6065 + 1) / 4 = 1.0638
    assert stats["ratio_mean"] == pytest.approx((math.exp(0.5) + math.exp(-0.5) + 2) / 4, rel=1e-6)
    assert stats["kl"] == 0.0
    assert stats["pg_loss"] == pytest.approx(-0.1, abs=1e-6)


def test_epsilon_high_widens_only_upper_bound():
    # ρ = e^0.2 = 1.2214, A = +1: clipped at 1.2 with ε_high = ε = 0.2 ...
    # ... but inside [0.8, 1.28] with ε_high = 0.28 -> loss -1.2214, grad -1.2214
    logps = torch.tensor([[0.2]], requires_grad=True)
    old, adv, mask = torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1)
    loss, stats = grpo_loss(logps, old, None, adv, mask, beta=0.0)
    assert loss.item() == pytest.approx(-1.2, abs=1e-6)
    assert stats["clip_ratio/high"] == 1.0
    loss, stats = grpo_loss(logps, old, None, adv, mask, epsilon_high=0.28, beta=0.0)
    (grad,) = torch.autograd.grad(loss, logps)
    assert loss.item() == pytest.approx(-math.exp(0.2), rel=1e-6)
    assert grad.item() == pytest.approx(-math.exp(0.2), rel=1e-6)
    assert stats["clip_ratio"] == 0.0


def test_hand_worked_k3_kl():
    # A = 0 kills the policy term; logp = 0, ref = ln 2 -> d = ref - logp = ln 2
    # k3 = e^d - d - 1 = 2 - 0.6931 - 1 = 0.3069; loss = β · k3 = 0.1 · 0.3069 = 0.03069
    # d k3 / d logp = -e^d + 1 = -2 + 1 = -1 -> grad = β · (-1) = -0.1
    # (the reversed estimator, d = logp - ref, would give 0.5 + 0.6931 - 1 = 0.1931)
    logps = torch.zeros(1, 1, requires_grad=True)
    ref = torch.full((1, 1), math.log(2.0), requires_grad=True)
    loss, stats = grpo_loss(logps, None, ref, torch.zeros(1), torch.ones(1, 1), beta=0.1)
    grad_logps, grad_ref = torch.autograd.grad(loss, [logps, ref], allow_unused=True)
    k3 = 2 - math.log(2.0) - 1
    assert loss.item() == pytest.approx(0.1 * k3, rel=1e-6)
    assert stats["kl"] == pytest.approx(k3, rel=1e-6)
    assert grad_logps.item() == pytest.approx(-0.1, rel=1e-6)
    assert grad_ref is None  # the reference is a constant


def test_old_logps_none_is_ratio_one_with_live_gradient():
    # μ = 1: ρ = 1 everywhere, loss = -A, and d(-ρA)/dlogp = -A per token (not 0)
    # A = [2, -1], T = 2, grpo mean: loss (-2 + 1) / 2 = -0.5; grad -A / (2 tokens · 2 rows)
    logps = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    adv = torch.tensor([2.0, -1.0])
    loss, stats = grpo_loss(logps, None, None, adv, torch.ones(2, 2), beta=0.0)
    (grad,) = torch.autograd.grad(loss, logps)
    assert loss.item() == pytest.approx(-0.5)
    torch.testing.assert_close(grad, torch.tensor([[-0.5, -0.5], [0.25, 0.25]]))
    assert stats["ratio_mean"] == pytest.approx(1.0)
    assert stats["clip_ratio"] == 0.0


def test_aggregations_differ_on_ragged_mask():
    # per-token loss = -A (ρ = 1); A = [1, 3]; mask rows have 1 and 3 tokens, T = 4
    #   grpo:    mean(-1/1, -9/3) = (-1 - 3) / 2 = -2
    #   bnpo:    (-1 - 9) / 4 tokens = -2.5
    #   dr_grpo: (-1 - 9) / (2 · 4) = -1.25
    logps = torch.zeros(2, 4)
    adv = torch.tensor([1.0, 3.0])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    #   dapo:    the same as bnpo within one batch (they differ in how micro-batches add up)
    want = {"grpo": -2.0, "bnpo": -2.5, "dapo": -2.5, "dr_grpo": -1.25}
    for loss_type, value in want.items():
        loss, _ = grpo_loss(logps, None, None, adv, mask, beta=0.0, loss_type=loss_type)
        assert loss.item() == pytest.approx(value), loss_type


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_all_zero_mask_is_finite(loss_type):
    logps = torch.randn(2, 3, requires_grad=True)
    loss, stats = grpo_loss(
        logps, None, torch.randn(2, 3), torch.tensor([1.0, -1.0]), torch.zeros(2, 3),
        loss_type=loss_type,
    )
    (grad,) = torch.autograd.grad(loss, logps)
    assert loss.item() == 0.0
    assert torch.isfinite(grad).all()
    assert all(math.isfinite(v) for v in stats.values())


def test_beta_zero_without_ref_works():
    logps = torch.randn(2, 3)
    loss, stats = grpo_loss(logps, None, None, torch.tensor([1.0, -1.0]), torch.ones(2, 3), beta=0.0)
    assert torch.isfinite(loss)
    assert stats["kl"] == 0.0


def test_beta_positive_without_ref_raises():
    with pytest.raises(ValueError, match="ref_logps"):
        grpo_loss(torch.randn(2, 3), None, None, torch.ones(2), torch.ones(2, 3), beta=0.04)


def test_unknown_loss_type_lists_valid_ones():
    with pytest.raises(ValueError, match="dr_grpo"):
        grpo_loss(torch.randn(2, 3), None, None, torch.ones(2), torch.ones(2, 3), beta=0.0, loss_type="sft")


def test_bad_advantages_shape_raises():
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(torch.randn(2, 3), None, None, torch.ones(3), torch.ones(2, 3), beta=0.0)


def test_hand_worked_sequence_ratio():
    # eps = 0.2, beta = 0, loss_type "grpo", one sequence of two tokens, A = +1, old = 0
    # logps [0.3, -0.1]: mean log-ratio 0.1 -> s = e^0.1 = 1.10517, inside [0.8, 1.2]
    #   every token's loss is -s·A = -1.10517; sequence mean -1.10517
    #   d(-s)/d logp_t = -s · 1/2 (the mean over 2 tokens) = -0.55259 for each token
    # at the token level the same numbers give ρ = [e^0.3, e^-0.1] = [1.34986, 0.90484]:
    #   token 0 is clipped (-1.2, no gradient), token 1 gives -0.90484; mean -1.05242, grads [0, -0.45242]
    logps = torch.tensor([[0.3, -0.1]], requires_grad=True)
    old, adv, mask = torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2)
    loss, stats = grpo_loss(logps, old, None, adv, mask, beta=0.0, importance_sampling_level="sequence")
    (grad,) = torch.autograd.grad(loss, logps)
    assert loss.item() == pytest.approx(-math.exp(0.1), rel=1e-6)
    torch.testing.assert_close(grad, torch.full((1, 2), -math.exp(0.1) / 2))
    assert stats["ratio_mean"] == pytest.approx(math.exp(0.1), rel=1e-6) and stats["clip_ratio"] == 0.0
    loss, stats = grpo_loss(logps, old, None, adv, mask, beta=0.0)
    (grad,) = torch.autograd.grad(loss, logps)
    assert loss.item() == pytest.approx((-1.2 - math.exp(-0.1)) / 2, rel=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -math.exp(-0.1) / 2]]))
    assert stats["clip_ratio/high"] == 0.5


def test_hand_worked_sequence_clipping_counts_sequences():
    # two sequences, A = [+1, -1], old = 0, eps = 0.2
    #   row 0: logps [0.5, 0.1, 0.3] -> mean 0.3, s = 1.34986 > 1.2 with A > 0: clipped at 1.2, loss -1.2, grad 0
    #   row 1: logps [-0.5, -0.3, pad] -> mean -0.4, s = 0.67032 < 0.8 with A < 0: clipped at 0.8, loss 0.8, grad 0
    # loss (grpo) = (-1.2 + 0.8) / 2 = -0.2; clip ratios count sequences: low 1/2, high 1/2
    logps = torch.tensor([[0.5, 0.1, 0.3], [-0.5, -0.3, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    loss, stats = grpo_loss(logps, torch.zeros(2, 3), None, torch.tensor([1.0, -1.0]), mask, beta=0.0,
                            importance_sampling_level="sequence")
    (grad,) = torch.autograd.grad(loss, logps)
    assert loss.item() == pytest.approx(-0.2, abs=1e-6)
    assert (grad == 0).all()
    assert stats["clip_ratio/low"] == 0.5 and stats["clip_ratio/high"] == 0.5 and stats["clip_ratio"] == 1.0
    assert stats["ratio_mean"] == pytest.approx((math.exp(0.3) + math.exp(-0.4)) / 2, rel=1e-6)


def test_dapo_and_bnpo_over_micro_batches():
    # per-token loss = -A (ρ = 1); A = [1, 3]; the rows hold 1 and 3 tokens; each row its own micro-batch
    #   dapo (token mean over the whole batch): (-1 - 9) / 4 tokens = -2.5
    #       micro-batch losses -1 and -3, token shares 1/4 and 3/4: -1/4 - 9/4 = -2.5
    #   bnpo (token mean per micro-batch, TRL's): micro-batch losses -1 and -3, row shares 1/2: -2.0
    logps = torch.zeros(2, 4)
    adv = torch.tensor([1.0, 3.0])
    mask = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 0]])
    for loss_type, want in (("dapo", -2.5), ("bnpo", -2.0)):
        total = 0.0
        for s in (slice(0, 1), slice(1, 2)):
            loss, _ = grpo_loss(logps[s], None, None, adv[s], mask[s], beta=0.0, loss_type=loss_type)
            total += batch_share(loss_type, mask[s], mask) * loss.item()
        assert total == pytest.approx(want), loss_type


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_micro_batches_add_up_to_the_whole_batch(loss_type, level):
    """share-weighted micro-batch losses and gradients add up to the one-batch loss (uneven micro-batches)."""
    logps, old, ref, adv, mask = random_case(level=level)
    kw = dict(epsilon=0.2, epsilon_high=0.28, beta=0.1, loss_type=loss_type, importance_sampling_level=level)
    whole, _ = grpo_loss(logps, old, ref, adv, mask, **kw)
    (want,) = torch.autograd.grad(whole, logps)
    parts = 0
    for s in (slice(0, 2), slice(2, 5)):
        loss, _ = grpo_loss(logps[s], old[s], ref[s], adv[s], mask[s], **kw)
        parts = parts + batch_share(loss_type, mask[s], mask) * loss
    (got,) = torch.autograd.grad(parts, logps)
    torch.testing.assert_close(parts, whole)
    torch.testing.assert_close(got, want)


def test_unknown_importance_sampling_level():
    with pytest.raises(ValueError, match="sequence"):
        grpo_loss(torch.randn(2, 3), None, None, torch.ones(2), torch.ones(2, 3), beta=0.0,
                  importance_sampling_level="segment")


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("tis_cap", [None, 1.2])
def test_truncated_importance_sampling_matches_naive_loop(loss_type, level, tis_cap):
    logps, old, ref, adv, mask = random_case(level=level)
    # the sampler's log-probs off the trainer's by ~exp(±0.4): some weights above the cap, most below
    sampler = old + 0.4 * torch.randn(old.shape, generator=torch.Generator().manual_seed(7), dtype=old.dtype)
    assert ((old - sampler).exp()[mask.bool()] > 1.2).any()
    kw = dict(epsilon=0.2, epsilon_high=0.28, beta=0.1, loss_type=loss_type, importance_sampling_level=level)
    loss, stats = grpo_loss(logps, old, ref, adv, mask, sampler_logps=sampler, tis_cap=tis_cap, **kw)
    (grad,) = torch.autograd.grad(loss, logps)
    want_loss, want_stats = naive_grpo_loss(logps, old, ref, adv, mask, 0.2, 0.28, 0.1, loss_type, level,
                                            sampler=sampler, tis_cap=tis_cap)
    (want_grad,) = torch.autograd.grad(want_loss, logps)
    torch.testing.assert_close(loss, want_loss)
    torch.testing.assert_close(grad, want_grad)
    assert set(want_stats) <= set(stats)
    for key, value in want_stats.items():
        assert stats[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_hand_worked_truncated_importance_sampling():
    # mu = 1 (old = logps, ratio 1), A = +1, beta = 0, loss_type "grpo", cap C = 1.5
    #   token 0: π_train 0.5, π_sampler 0.25 -> weight min(2, 1.5) = 1.5 -> loss -1.5, d/dlogp = -1.5 / 2 tokens
    #   token 1: π_train 0.2, π_sampler 0.8 -> weight min(0.25, 1.5) = 0.25 -> loss -0.25, d/dlogp = -0.25 / 2
    #   loss (-1.5 - 0.25) / 2 = -0.875; grads [-0.75, -0.125]
    #   |log π_train - log π_sampler| = [ln 2, ln 4]: mean 1.5 ln 2 = 1.0397, max ln 4 = 1.3863
    #   k3 mismatch, d = log π_train - log π_sampler = [ln 2, -ln 4], exp(d) - d - 1:
    #     token 0: 2 - ln 2 - 1 = 0.30685; token 1: 0.25 + ln 4 - 1 = 0.63629; mean (0.25 + ln 2) / 2 = 0.47157
    #   truncated share: weights [2, 0.25] against the cap 1.5: 1 of 2 = 0.5
    logps = torch.tensor([[0.5, 0.2]]).log().requires_grad_()
    sampler = torch.tensor([[0.25, 0.8]]).log()
    loss, stats = grpo_loss(logps, None, None, torch.tensor([1.0]), torch.ones(1, 2), beta=0.0,
                            sampler_logps=sampler, tis_cap=1.5)
    (grad,) = torch.autograd.grad(loss, logps)
    assert loss.item() == pytest.approx(-0.875, rel=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-0.75, -0.125]]))
    assert stats["tis/logp_diff_mean"] == pytest.approx(1.5 * math.log(2), rel=1e-6)
    assert stats["tis/logp_diff_max"] == pytest.approx(math.log(4), rel=1e-6)
    assert stats["tis/weight_mean"] == pytest.approx(0.875, rel=1e-6)
    assert stats["tis/mismatch_kl"] == pytest.approx((0.25 + math.log(2)) / 2, rel=1e-6)  # 0.471574
    assert stats["tis/truncated_share"] == 0.5
    # without a cap the sampler's log-probs only feed the mismatch figures: the loss is plain GRPO's -A
    loss, stats = grpo_loss(logps, None, None, torch.tensor([1.0]), torch.ones(1, 2), beta=0.0,
                            sampler_logps=sampler)
    assert loss.item() == pytest.approx(-1.0) and "tis/weight_mean" not in stats
    assert stats["tis/logp_diff_max"] == pytest.approx(math.log(4), rel=1e-6)
    assert "tis/truncated_share" not in stats  # no cap, nothing truncated to count
    assert stats["tis/mismatch_kl"] == pytest.approx((0.25 + math.log(2)) / 2, rel=1e-6)  # the cap does not change it
    # a sampler that agrees with the trainer: no mismatch, nothing truncated
    _, stats = grpo_loss(logps, None, None, torch.tensor([1.0]), torch.ones(1, 2), beta=0.0,
                         sampler_logps=logps.detach(), tis_cap=1.5)
    assert stats["tis/mismatch_kl"] == 0.0 and stats["tis/truncated_share"] == 0.0 and stats["tis/weight_mean"] == 1.0


def test_tis_cap_needs_sampler_logps_and_a_positive_cap():
    with pytest.raises(ValueError, match="sampler_logps"):
        grpo_loss(torch.randn(2, 3), None, None, torch.ones(2), torch.ones(2, 3), beta=0.0, tis_cap=2.0)
    with pytest.raises(ValueError, match="above 0"):
        grpo_loss(torch.randn(2, 3), None, None, torch.ones(2), torch.ones(2, 3), beta=0.0,
                  sampler_logps=torch.zeros(2, 3), tis_cap=0.0)
