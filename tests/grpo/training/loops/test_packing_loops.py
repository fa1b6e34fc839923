"""Packed (padding-free) rows in the loops beyond GRPO and SFT's first ones: PPO's policy, reference and critic
passes, the reward model's Bradley-Terry scores, DPO's sequence log-probs, and SFT's token budget. Each against the
same loop padded: the numbers of one step (losses and gradients) and a short run (figures and weights).

Where numbers are compared: float32, one thread (the `one_thread` fixture), bounds relative to the values. The
models are real tiny Qwen2 decoders built from a config.
"""

from __future__ import annotations

import contextlib

import pandas as pd
import pytest
import torch

from comparisons import close
from grpo.configs.sampling import SamplingConfig
from grpo.configs.training import GRPOConfig
from grpo.kernels.attention import attending_packed
from grpo.models import load_model_and_tokenizer
from packing_inputs import grpo_rows, make_model
from tiny_configs import SMALL

pytestmark = pytest.mark.usefixtures("one_thread")  # one thread where numbers are compared (conftest)


def digits(completions, **_):
    """A random model writes some digits, unevenly: rewards that differ from row to row."""
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


# -- PPO -------------------------------------------------------------------------------------------------------------

def test_packed_critic_values_and_gradients_equal_the_padded_ones():
    """The critic reads the positions that predict each completion token, packed as the policy's log-probs are
    (groups sharing a prompt, rows of one token and of none in the batch)."""
    from grpo.training.value import ValueModel

    critic = ValueModel.from_policy(make_model(), seed=3).train()
    ids, mask, C = grpo_rows([3, 5, 2], [7, 1, 4, 0, 2, 6, 3, 3, 5], group=3)
    valid = mask[:, -C:].bool()
    weights = torch.randn(ids.size(0), C, generator=torch.Generator().manual_seed(2))
    out = {}
    for packed in (False, True):
        critic.zero_grad()
        with attending_packed(critic.trunk, packed):
            values = critic(ids, mask, C, packed=packed)  # [N, C]
        (values * weights * valid).sum().backward()
        out[packed] = values[valid], [p.grad.clone() for p in critic.parameters()]
        if packed:
            assert (values[~valid] == 0).all()  # padding holds 0
    assert close(out[True][0], out[False][0])
    assert all(close(a, b, 1e-4) for a, b in zip(out[True][1], out[False][1]))


def make_ppo(tmp_path, ppo=None, **overrides):
    from grpo.configs.ppo import PPOConfig
    from grpo.training.loops.ppo_trainer import PPOTrainer

    model, tok = load_model_and_tokenizer(SMALL)
    prompts = pd.DataFrame({"prompt": [f"Say {i}{'!' * (3 * i)}" for i in range(8)], "answer": list("01234567")})
    cfg = GRPOConfig(**{"max_steps": 1, "prompts_per_step": 2, "num_generations": 4, "checkpoint_every": 0,
                        "sampling": SamplingConfig(max_new_tokens=12), "rewards": {"digits": 1.0},
                        "mixed_precision": "no", "fp32_gemm": "mkl", "learning_rate": 1e-3, **overrides})
    seen = {}
    trainer = PPOTrainer(model, tok, prompts, cfg, tmp_path, ppo=ppo or PPOConfig(), reward_functions={"digits": digits},
                         progress=False, on_metrics=lambda step, m: seen.__setitem__(step, m))
    return trainer, seen


@contextlib.contextmanager
def ppo_attending_packed(trainer):
    """The packed kernel on the policy, the reference and the critic, as `PPOTrainer.train` holds it."""
    critic = trainer.acc.unwrap_model(trainer.critic)
    with (attending_packed(trainer.acc.unwrap_model(trainer.model)), attending_packed(trainer.ref_model),
          attending_packed(critic.trunk)):
        yield


def ppo_step(trainer, batch, **cfg) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The gradients one PPO step applies to the policy and the critic with these settings, and its figures; the
    weights of both are put back after."""
    grads = {}
    models = {"policy": trainer.model, "critic": trainer.critic}

    def recorder(name):
        def record(optimizer, args, kwargs):
            grads.update({f"{name}.{n}": p.grad.clone() for n, p in models[name].named_parameters()
                          if p.grad is not None})
        return record

    handles = [trainer.optimizer.optimizer.register_step_pre_hook(recorder("policy")),
               trainer.critic_optimizer.optimizer.register_step_pre_hook(recorder("critic"))]
    trainer.cfg = trainer.cfg.updated(**cfg)
    trainer.packed = cfg.get("packing", False)
    weights = {(k, n): p.detach().clone() for k, m in models.items() for n, p in m.named_parameters()}
    try:
        with ppo_attending_packed(trainer):
            stats = trainer.optimise(batch)
    finally:
        for h in handles:
            h.remove()
        with torch.no_grad():
            for k, m in models.items():
                for n, p in m.named_parameters():
                    p.copy_(weights[k, n])
    return grads, stats


def test_packed_ppo_batches_and_steps_equal_padded_ones_for_every_loss_type(tmp_path):
    """The rollout's reference, pi_old and critic passes packed (to a 60-token budget) give the padded batch; one
    step's policy and critic gradients are the padded step's for every loss type, micro-batches of 3 rows packed
    alone or other rows together under the budget."""
    from grpo.configs.ppo import PPOConfig

    torch.manual_seed(0)
    trainer, _ = make_ppo(tmp_path, PPOConfig(kl_in="loss"), beta=0.04, num_iterations=2, micro_batch_size=3)
    rollout, _, scores, _ = trainer.collect(0)
    batches = {}
    for packed, budget in ((False, None), (True, 60)):
        trainer.packed = packed
        trainer.cfg = trainer.cfg.updated(packing=packed, max_tokens_per_microbatch=budget)
        with ppo_attending_packed(trainer):
            batches[packed] = trainer.build_batch(rollout, scores.total)
    padded, packed = batches[False], batches[True]
    tokens = padded.attention_mask.sum(1)
    assert tokens.min() < tokens.max() and int(tokens.max()) <= 60 < int(tokens.sum())  # several budgeted batches
    m = padded.completion_mask.bool()
    for field in ("old_logps", "ref_logps", "old_values", "advantages", "returns"):
        assert close(getattr(packed, field)[m], getattr(padded, field)[m]), field
    for loss_type in ("grpo", "bnpo", "dapo", "dr_grpo"):
        want, want_stats = ppo_step(trainer, padded, loss_type=loss_type, packing=False,
                                    max_tokens_per_microbatch=None)
        for budget in (None, 60):
            got, stats = ppo_step(trainer, padded, loss_type=loss_type, packing=True,
                                  max_tokens_per_microbatch=budget)
            assert want.keys() == got.keys() and any(k.startswith("critic.") for k in got)
            assert all(close(got[n], g, 1e-4) for n, g in want.items()), (loss_type, budget)
            for key in ("train/loss", "value/loss", "pg_loss"):
                assert stats[key] == pytest.approx(want_stats[key], rel=1e-5, abs=1e-7), (loss_type, budget, key)


def test_a_short_ppo_run_packed_matches_the_padded_one(tmp_path):
    """Two steps (mu 2, the KL in the rewards): the same figures, policy and critic as the padded run."""
    runs = {}
    for packing in (False, True):
        torch.manual_seed(0)
        trainer, seen = make_ppo(tmp_path / str(packing), packing=packing, max_steps=2, num_iterations=2,
                                 max_tokens_per_microbatch=60 if packing else None)
        assert trainer.packed == packing
        trainer.train()
        runs[packing] = seen, {n: p.detach().clone() for m in (trainer.model, trainer.critic)
                               for n, p in m.named_parameters()}
    (padded, w_padded), (packed, w_packed) = runs[False], runs[True]
    for step in (1, 2):
        for key in ("train/loss", "value/loss", "kl", "reward/total", "value/explained_variance", "grad_norm",
                    "value/grad_norm"):
            assert packed[step][key] == pytest.approx(padded[step][key], rel=1e-4, abs=1e-6), (step, key)
    assert all(close(w_packed[n], w, 1e-5) for n, w in w_padded.items())


def test_a_ppo_token_budget_that_cannot_hold_a_row_fails_before_sampling(tmp_path):
    with pytest.raises(ValueError, match=r"PPO: max_tokens_per_microbatch=20 cannot hold prompt row 7"):
        make_ppo(tmp_path, max_tokens_per_microbatch=20)


# -- the reward model ------------------------------------------------------------------------------------------------

def reward_model(seed: int = 0):
    from grpo.training.reward_scorer import build_reward_model

    model, tok = build_reward_model(SMALL, seed)
    with torch.no_grad():  # a fresh head scores near 0 everywhere: make the scores differ
        model.score.weight.mul_(20.0)
    return model.float().train(), tok


@pytest.mark.parametrize("kernel", [True, False])
def test_packed_reward_scores_and_gradients_equal_the_padded_ones(kernel):
    """Sequences of uneven lengths (one of one token) scored packed, through the packed kernel or transformers'
    mask from the position ids: each its padded score, at its own last token, and the same gradients."""
    from grpo.training.reward_scorer import sequence_scores

    model, tok = reward_model()
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(1, 200, (n,), generator=g).tolist() for n in (9, 1, 14, 5, 11, 3)]
    weights = torch.randn(len(seqs), generator=g)
    out = {}
    for packed in (False, True):
        model.zero_grad()
        with attending_packed(model, packed and kernel):
            scores = sequence_scores(model, seqs, tok.pad_token_id, torch.device("cpu"),
                                     packed_for=model if packed else None)  # [B]
        (scores * weights).sum().backward()
        out[packed] = scores, [p.grad.clone() for p in model.parameters()]
    assert out[False][0].std() > 0.1  # scores that differ, so a shifted read would show
    assert close(out[True][0], out[False][0])
    assert all(close(a, b, 1e-4) for a, b in zip(out[True][1], out[False][1]))


def test_packing_true_on_a_reward_model_without_a_score_head_is_an_error():
    from grpo.training.reward_scorer import packs

    with pytest.raises(ValueError, match="packing: true needs a reward model whose scores come from"):
        packs(True, make_model())
    assert packs("auto", make_model()) is False and packs("auto", reward_model()[0]) is True


def test_a_short_reward_model_run_packed_matches_the_padded_one(tmp_path):
    """Three steps: the same losses, accuracies, held-out figures and weights as the padded run."""
    from transformers import AutoModelForSequenceClassification

    from grpo.configs.reward import RewardModelConfig
    from grpo.data.preferences import preference_pairs
    from grpo.training.loops.reward_model import train_reward_model

    runs = {}
    for packing in (False, True):
        cfg = RewardModelConfig(model=SMALL, max_steps=3, batch_size=6, learning_rate=1e-3, warmup_steps=0,
                                log_every=1, mixed_precision="no", packing=packing)
        seen = {}
        result = train_reward_model(preference_pairs(40), cfg, tmp_path / str(packing),
                                    lambda s, m: seen.setdefault(s, {}).update(m),
                                    heldout=preference_pairs(12, split="heldout"), progress=False)
        runs[packing] = seen, AutoModelForSequenceClassification.from_pretrained(result.model_dir).state_dict()
    (padded, w_padded), (packed, w_packed) = runs[False], runs[True]
    for step in (1, 2, 3):
        for key in ("rm/loss", "rm/margin", "rm/accuracy", "rm/grad_norm"):
            assert packed[step][key] == pytest.approx(padded[step][key], rel=1e-4, abs=1e-6), (step, key)
    assert packed[3]["rm/heldout_margin"] == pytest.approx(padded[3]["rm/heldout_margin"], rel=1e-4, abs=1e-6)
    # AdamW divides each gradient by its own size, so a rounding-sized difference in a near-zero gradient moves its
    # weight by a share of the learning rate (1e-3), not of the gradient: at most 2% of it
    assert all((w_packed[n] - w).abs().max() <= 2e-5 for n, w in w_padded.items())


# -- DPO -------------------------------------------------------------------------------------------------------------

def test_a_short_dpo_run_packed_matches_the_padded_one(tmp_path):
    """Three steps of DPO (policy and reference packed, a pair's prompt once): the same losses, margins, held-out
    figures and weights as the padded run."""
    from transformers import AutoModelForCausalLM

    from grpo.configs.dpo import DPOConfig
    from grpo.data.preferences import preference_pairs
    from grpo.training.loops.dpo import train_dpo

    runs = {}
    for packing in (False, True):
        model, tok = load_model_and_tokenizer(SMALL)
        cfg = DPOConfig(max_steps=3, batch_size=4, learning_rate=1e-3, warmup_steps=0, log_every=1,
                        checkpoint_every=0, mixed_precision="no", packing=packing)
        seen = {}
        result = train_dpo(model, tok, preference_pairs(16), cfg, tmp_path / str(packing),
                           lambda s, m: seen.setdefault(s, {}).update(m),
                           heldout=preference_pairs(8, split="heldout"), progress=False)
        runs[packing] = seen, AutoModelForCausalLM.from_pretrained(result.model_dir).state_dict()
    (padded, w_padded), (packed, w_packed) = runs[False], runs[True]
    assert abs(padded[3]["dpo/margin"]) > 1e-4  # the policy has moved from its reference
    for step in (1, 2, 3):
        for key in ("dpo/loss", "dpo/margin", "dpo/chosen_reward", "dpo/grad_norm"):
            assert packed[step][key] == pytest.approx(padded[step][key], rel=1e-4, abs=1e-6), (step, key)
    assert packed[3]["dpo/heldout_margin"] == pytest.approx(padded[3]["dpo/heldout_margin"], rel=1e-4, abs=1e-6)
    assert all(close(w_packed[n], w, 1e-5) for n, w in w_padded.items())


# -- SFT's token budget ----------------------------------------------------------------------------------------------

def sft_rows() -> pd.DataFrame:
    return pd.DataFrame({"prompt": [f"What is {i} + 1?{' ' * i}" for i in range(8)],
                         "response": [f"{i + 1}" + " and so on" * (i % 4) for i in range(8)]})


def test_sft_micro_batches_split_to_a_token_budget_match_whole_padded_ones(tmp_path):
    """Three steps of 2 micro-batches of 4 rows: padded whole, and packed in pieces of at most a budget a little over
    the longest row (several pieces a micro-batch): the same losses and weights, the step's loss the token mean."""
    from grpo.configs.training import SFTConfig
    from grpo.training.loops.sft_trainer import row_pieces, tokenize_rows, train_sft

    model, tok = load_model_and_tokenizer(SMALL)
    examples = tokenize_rows(sft_rows(), tok, 384)
    budget = max(len(e.input_ids) for e in examples) + 8
    assert len(row_pieces(examples[:4], budget)) > 1  # a micro-batch is split
    runs = {}
    for packing, max_tokens in ((False, None), (True, budget)):
        model, tok = load_model_and_tokenizer(SMALL)
        cfg = SFTConfig(max_steps=3, batch_size=4, grad_accum_steps=2, learning_rate=1e-3, warmup_steps=0,
                        log_every=1, checkpoint_every=0, mixed_precision="no", fp32_gemm="mkl", packing=packing,
                        max_tokens_per_microbatch=max_tokens)
        seen = {}
        result = train_sft(model, tok, sft_rows(), cfg, tmp_path / str(packing), lambda s, m: seen.__setitem__(s, m),
                           progress=False)
        runs[packing] = seen, type(model).from_pretrained(result.model_dir).state_dict()
    (padded, w_padded), (packed, w_packed) = runs[False], runs[True]
    for step in (1, 2, 3):
        for key in ("train/loss", "train/grad_norm"):
            assert packed[step][key] == pytest.approx(padded[step][key], rel=1e-5), (step, key)
    # AdamW's per-weight normalisation: a rounding-sized gradient difference moves a weight by a share of the rate
    assert all((w_packed[n] - w).abs().max() <= 2e-5 for n, w in w_padded.items())


def test_an_sft_token_budget_that_cannot_hold_a_row_fails_before_training(tmp_path):
    from grpo.configs.training import SFTConfig
    from grpo.data.tables import DataError
    from grpo.training.loops.sft_trainer import train_sft

    model, tok = load_model_and_tokenizer(SMALL)
    with pytest.raises(DataError, match=r"dataset: row 7 is \d+ tokens, more than max_tokens_per_microbatch=10"):
        train_sft(model, tok, sft_rows(), SFTConfig(max_steps=1, batch_size=4, max_tokens_per_microbatch=10),
                  tmp_path, progress=False)
    with pytest.raises(ValueError, match="needs packing"):
        SFTConfig(packing=False, max_tokens_per_microbatch=100)
