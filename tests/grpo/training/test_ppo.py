"""PPO with a critic: GAE, the clipped losses against hand-worked numbers and naive loops, the trainer on a real tiny
model, and the reasoning stage run with `algorithm: ppo` under Prefect and MLflow."""

import json
import math

import pandas as pd
import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo.configs.ppo import PPOConfig, PPOTrainingConfig
from grpo.configs.sampling import SamplingConfig
from grpo.configs.training import GRPOConfig
from grpo.models import load_model_and_tokenizer
from grpo.rewards import REWARD_FUNCTIONS
from grpo.training.loops.ppo_trainer import PPOTrainer
from grpo.training.ppo import (clipped_value_loss, explained_variance, gae_advantages, masked_whiten, ppo_loss,
                               token_rewards)
from tiny_configs import SMALL

pytestmark = pytest.mark.precision  # trains under `auto`: `make test` runs it under either CPU answer
PROMPTS = pd.DataFrame({"prompt": [f"Say {i}" for i in range(8)], "answer": [str(i) for i in range(8)]})


def prefix_mask(lengths: list[int], C: int) -> torch.Tensor:
    return (torch.arange(C)[None, :] < torch.tensor(lengths)[:, None]).float()  # [N, C]


# -- GAE and the per-token rewards ---------------------------------------------------------------------------------

def naive_gae(rewards, values, lengths, gamma, lam):
    """The textbook reverse loop, one row and one token at a time, in Python floats."""
    advantages, returns = [], []
    for r, v, L in zip(rewards, values, lengths):
        adv, running = [0.0] * len(r), 0.0
        for t in reversed(range(L)):
            next_value = v[t + 1] if t + 1 < L else 0.0  # the completion ends after its last token
            running = r[t] + gamma * next_value - v[t] + gamma * lam * running
            adv[t] = running
        advantages.append(adv)
        returns.append([adv[t] + v[t] if t < L else 0.0 for t in range(len(r))])
    return torch.tensor(advantages), torch.tensor(returns)


def test_gae_on_hand_worked_numbers():
    # row 0 has 3 tokens (reward 1 at the last), row 1 one token (reward 2); padding holds junk values (9)
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [2.0, 0.0, 0.0, 0.0]])
    values = torch.tensor([[0.5, 0.25, 0.5, 9.0], [1.0, 9.0, 9.0, 9.0]])
    mask = prefix_mask([3, 1], 4)
    # gamma 1, lambda 0.5: deltas row 0 = [0 + 0.25 - 0.5, 0 + 0.5 - 0.25, 1 + 0 - 0.5] = [-0.25, 0.25, 0.5]
    # A_2 = 0.5, A_1 = 0.25 + 0.5·0.5 = 0.5, A_0 = -0.25 + 0.5·0.5 = 0; row 1: delta = 2 - 1 = 1
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=0.5)
    assert torch.allclose(adv, torch.tensor([[0.0, 0.5, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0]]))
    assert torch.allclose(ret, torch.tensor([[0.5, 0.75, 1.0, 0.0], [2.0, 0.0, 0.0, 0.0]]))  # A + V
    # gamma 0.5, lambda 1: A_t is the discounted return minus V_t; returns row 0 = [0.25, 0.5, 1]
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.5, lam=1.0)
    assert torch.allclose(adv[0], torch.tensor([0.25 - 0.5, 0.5 - 0.25, 1.0 - 0.5, 0.0]))
    assert torch.allclose(ret[0], torch.tensor([0.25, 0.5, 1.0, 0.0]))


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.99, 0.0)])
def test_gae_matches_a_naive_reverse_loop_with_ragged_masks(gamma, lam):
    torch.manual_seed(0)
    lengths = [7, 1, 4, 0, 6]  # full, one token, middle, an empty row
    rewards, values = torch.randn(5, 7), torch.randn(5, 7)
    adv, ret = gae_advantages(rewards, values, prefix_mask(lengths, 7), gamma, lam)
    want_adv, want_ret = naive_gae(rewards.tolist(), values.tolist(), lengths, gamma, lam)
    assert torch.allclose(adv, want_adv, atol=1e-5) and torch.allclose(ret, want_ret, atol=1e-5)


def test_token_rewards_put_the_score_on_the_last_token_and_k1_on_every_one():
    mask = prefix_mask([2, 3, 0], 3)
    logps = torch.tensor([[-1.0, -2.0, -5.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0, -5.0], [-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]])
    r = token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask, logps, ref, beta=0.1)
    # k1 = logp - ref: row 0 [0.5, -1], row 1 [0, 1, -0.5]; reward -0.1·k1, the score added at the last token;
    # the empty row gets nothing (its score has no token to sit on)
    assert torch.allclose(r, torch.tensor([[-0.05, 0.1 + 1.0, 0.0], [0.0, -0.1, 0.05 + 2.0], [0.0, 0.0, 0.0]]))


def test_whitening_and_explained_variance_count_only_masked_tokens():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask = prefix_mask([2, 1], 3)
    w = masked_whiten(x, mask)
    # tokens 1, 2, 3: mean 2, unbiased std 1
    assert torch.allclose(w, torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]), atol=1e-6)
    returns = torch.tensor([[1.0, 2.0, 7.0], [3.0, 7.0, 7.0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 2.0), returns, mask) == pytest.approx(0.0)


# -- the losses ------------------------------------------------------------------------------------------------------

def test_value_loss_clipping_by_hand():
    values = torch.tensor([[1.0, 0.1, -1.0]], requires_grad=True)  # V' (the critic being trained)
    old = torch.zeros(1, 3)  # V at rollout time
    returns = torch.tensor([[2.0, 0.5, -0.1]])
    loss, clipped = clipped_value_loss(values, old, returns, torch.ones(1, 3), cliprange_value=0.2,
                                       loss_type="bnpo")
    # token 0: V' = 1 clipped to 0.2: max((1 - 2)², (0.2 - 2)²) = 3.24, the clipped term wins (no gradient)
    # token 1: V' = 0.1 inside the range: both (0.1 - 0.5)² = 0.16
    # token 2: V' = -1 clipped to -0.2: max((-1 + 0.1)², (-0.2 + 0.1)²) = 0.81, the unclipped term wins
    assert loss.item() == pytest.approx(0.5 * (3.24 + 0.16 + 0.81) / 3)
    assert clipped == pytest.approx(1 / 3)
    loss.backward()
    # d/dV' of ½·mean: (V' - R) / 3 where the unclipped term counts, 0 where the clipped one won
    assert torch.allclose(values.grad, torch.tensor([[0.0, (0.1 - 0.5) / 3, (-1.0 + 0.1) / 3]]))


def naive_ppo_loss(logps, old, ref, adv, values, old_values, returns, mask, eps_low, eps_high, clip_v, vf_coef, beta,
                   loss_type):
    """PPO's loss written out token by token, with the reductions spelled out per loss type."""
    B, T = logps.shape
    pg, vf = [[None] * T for _ in range(B)], [[None] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            ratio = torch.exp(logps[i, t] - old[i, t])
            a = adv[i, t]
            term = -torch.min(ratio * a, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a)
            if beta:
                d = ref[i, t] - logps[i, t]
                term = term + beta * (torch.exp(d) - d - 1)
            pg[i][t] = term
            v_clipped = old_values[i, t] + torch.clamp(values[i, t] - old_values[i, t], -clip_v, clip_v)
            vf[i][t] = torch.max((values[i, t] - returns[i, t]) ** 2, (v_clipped - returns[i, t]) ** 2)

    def reduce(per_token):
        rows = [sum(per_token[i][t] * mask[i, t] for t in range(T)) for i in range(B)]
        if loss_type == "grpo":  # mean over rows of each row's token mean (an empty row counts 0)
            return sum(r / max(mask[i].sum(), 1) for i, r in enumerate(rows)) / B
        if loss_type == "bnpo":  # token mean
            return sum(rows) / mask.sum()
        return sum(rows) / (B * T)  # dr_grpo

    return reduce(pg) + vf_coef * 0.5 * reduce(vf)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_ppo_loss_matches_a_straightforward_reimplementation(loss_type, beta):
    torch.manual_seed(1)
    B, T = 3, 5
    mask = prefix_mask([5, 2, 0], T)
    logps = (torch.randn(B, T) * 0.3 - 1).requires_grad_(True)
    old, ref = logps.detach() + torch.randn(B, T) * 0.3, logps.detach() + torch.randn(B, T) * 0.3  # ratios clip
    adv, returns = torch.randn(B, T), torch.randn(B, T)
    old_values = torch.randn(B, T)
    values = (old_values + torch.randn(B, T) * 0.4).requires_grad_(True)  # some beyond the value clip range
    kw = dict(eps_low=0.2, eps_high=0.28, clip_v=0.2, vf_coef=0.1, beta=beta, loss_type=loss_type)
    loss, stats = ppo_loss(logps, old, ref, adv, values, old_values, returns, mask, epsilon=0.2, epsilon_high=0.28,
                           cliprange_value=0.2, vf_coef=0.1, beta=beta, loss_type=loss_type)
    grads = torch.autograd.grad(loss, [logps, values])
    want = naive_ppo_loss(logps, old, ref, adv, values, old_values, returns, mask, **kw)
    want_grads = torch.autograd.grad(want, [logps, values])
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    for g, w in zip(grads, want_grads):
        assert torch.allclose(g, w, atol=1e-6)
    assert 0 < stats["clip_ratio"] < 1 and 0 < stats["value/clip_ratio"] < 1  # both clips took part
    assert (stats["kl"] > 0) == (beta > 0)


def test_one_update_per_rollout_has_ratio_one():
    logps = torch.randn(2, 3, requires_grad=True)
    zeros = torch.zeros(2, 3)
    loss, stats = ppo_loss(logps, None, None, torch.ones(2, 3), zeros, zeros, zeros, torch.ones(2, 3), loss_type="bnpo")
    loss.backward()
    assert stats["ratio_mean"] == 1.0 and stats["clip_ratio"] == 0.0
    assert torch.allclose(logps.grad, torch.full((2, 3), -1 / 6))  # -A / tokens: the plain policy gradient


# -- the trainer on a real tiny model ------------------------------------------------------------------------------

def digits(completions, **_):
    """Rewards a completion for each digit it holds: a random model writes some, unevenly."""
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def constant(completions, **_):
    return [1.0] * len(completions)


def make_ppo(tmp_path, ppo=None, registry=None, **overrides):
    model, tok = load_model_and_tokenizer(SMALL)
    grpo = GRPOConfig(**{"max_steps": 2, "prompts_per_step": 2, "num_generations": 4, "checkpoint_every": 0,
                         "sampling": SamplingConfig(max_new_tokens=8), "rewards": {"digits": 1.0},
                         "learning_rate": 1e-3, "samples_every": 1, **overrides})
    cfg = PPOTrainingConfig.from_grpo(grpo, ppo)  # PPO's own config, as the stage builds it
    seen, tables = {}, {}
    trainer = PPOTrainer(model, tok, PROMPTS, cfg, tmp_path,
                         reward_functions={**REWARD_FUNCTIONS, "digits": digits, "constant": constant,
                                           **(registry or {})},
                         progress=False,
                         on_metrics=lambda step, m: seen.__setitem__(step, m),
                         on_samples=lambda step, t: tables.__setitem__(step, t))
    return trainer, seen, tables


@pytest.mark.parametrize("kl_in,mu", [("reward", 1), ("loss", 2)])
def test_a_ppo_run_moves_policy_and_critic_and_logs_them(tmp_path, kl_in, mu):
    torch.manual_seed(0)
    trainer, seen, tables = make_ppo(tmp_path, PPOConfig(kl_in=kl_in), num_iterations=mu)
    policy = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    critic = {k: v.detach().clone() for k, v in trainer.critic.state_dict().items()}
    # the critic is a copy of the policy's decoder, not the same tensors
    assert torch.equal(critic["trunk.layers.0.mlp.up_proj.weight"], policy["model.layers.0.mlp.up_proj.weight"])
    trainer.train()
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "model").state_dict()
    assert any(not torch.equal(policy[k], after[k]) for k in after)
    moved = {k for k, v in trainer.critic.state_dict().items() if not torch.equal(critic[k], v)}
    assert "head.weight" in moved and any(k.startswith("trunk.layers.") for k in moved)

    # one completion for each of prompts_per_step x num_generations = 8 prompts, all different
    assert len(tables[1]) == 8 and tables[1]["prompt"].nunique() == 8
    m1, m2 = seen[1], seen[2]
    for key in ("value/loss", "value/explained_variance", "value/clip_ratio", "value/grad_norm", "kl", "clip_ratio",
                "pg_loss", "train/loss", "reward/total", "grad_norm", "entropy"):
        assert math.isfinite(m2[key]), key
    assert "reward/zero_std_groups" not in m2
    assert m2["kl"] > 1e-6  # the policy has left the reference it started as
    if kl_in == "reward":  # the rollout's KL: none at step 1, sampled from the reference itself; then a penalty,
        # whose sign a few samples' estimate (log pi - log pi_ref on the tokens drawn) does not fix
        assert m1["kl"] < 1e-9 and abs(m1["reward/kl_penalty"]) < 1e-6 and abs(m2["reward/kl_penalty"]) > 1e-6


def test_the_critic_fits_its_returns(tmp_path):
    torch.manual_seed(0)
    # rewards 1 for every completion, so the returns are near 1 where the fresh critic says near 0; a wide value
    # clip range, so that the loss can fall below its clipped floor within the batch
    trainer, _, _ = make_ppo(tmp_path, PPOConfig(vf_coef=1.0, cliprange_value=100.0), learning_rate=1e-2, beta=0.0,
                             rewards={"constant": 1.0})
    rollout, idx, scores, _ = trainer.collect(0)
    batch = trainer.build_batch(rollout, scores.total)
    losses = [trainer.optimise(batch)["value/loss"] for _ in range(4)]
    assert losses[-1] < losses[0] / 2, losses


def test_an_interrupted_ppo_run_resumes_policy_and_critic(tmp_path):
    common = {"max_steps": 2, "checkpoint_every": 1, "samples_every": 0}
    straight, _, _ = make_ppo(tmp_path / "straight", **common)
    straight.train()

    class Interrupt(Exception):
        pass

    def crash_at_2(step, _):
        if step == 2:
            raise Interrupt

    first, _, _ = make_ppo(tmp_path / "resumed", **common)
    first.on_metrics = crash_at_2
    with pytest.raises(Interrupt):
        first.train()
    resumed, _, _ = make_ppo(tmp_path / "resumed", **common)
    resumed.train()
    a, b = straight.critic.state_dict(), resumed.critic.state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "straight" / "model").state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "resumed" / "model").state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_an_ungraded_row_changes_no_other_rows_advantage_return_or_figure(tmp_path):
    """One row a reward could not grade: every other row's whitened advantages and returns, and the step's value,
    return, advantage and KL figures, are those of the batch without that row; the ungraded row trains nothing."""
    from grpo.rewards.outcomes import TIMEOUT, Ungraded

    plant = {}

    def unsure(completions, **_):
        return [Ungraded(TIMEOUT) if i == plant["row"] else float(sum(ch.isdigit() for ch in c))
                for i, c in enumerate(completions)]

    torch.manual_seed(0)
    trainer, _, _ = make_ppo(tmp_path, registry={"unsure": unsure}, rewards={"unsure": 1.0}, beta=0.04,
                             mixed_precision="no")
    idx = list(range(8))
    rollout = trainer.sample(idx)
    lengths = rollout.completion_mask.sum(1)
    plant["row"] = int(lengths.argmin())  # the shortest: the batch without it is as wide
    scores = trainer.score(rollout, idx)
    keep = [i for i in idx if i != plant["row"]]
    assert scores.graded_rows == [i != plant["row"] for i in idx]
    batch = trainer.build_batch(rollout, scores.total, scores.graded_rows)
    alone = rollout._replace(texts=[rollout.texts[i] for i in keep],
                             **{k: getattr(rollout, k)[keep] for k in ("truncated", "prompt_ids", "prompt_mask",
                                                                       "completion_ids", "completion_mask")})
    assert alone.completion_ids.size(1) == rollout.completion_ids.size(1)
    without = trainer.build_batch(alone, [scores.total[i] for i in keep])
    for field in ("advantages", "returns", "old_values", "completion_mask"):
        torch.testing.assert_close(getattr(batch, field)[keep], getattr(without, field), atol=1e-5, rtol=1e-4)
    assert batch.completion_mask[plant["row"]].sum() == 0
    assert batch.stats.keys() == without.stats.keys() and {"kl", "value/explained_variance"} <= batch.stats.keys()
    for key, value in without.stats.items():
        assert batch.stats[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_past_the_ungraded_limit_ppo_stops_in_grpo_s_line_keeps_its_steps_and_resumes(tmp_path):
    """A grader that breaks at step 3 of 6: PPO stops as GRPO does, in one line naming the grader and its reason,
    with steps 1-3 saved; fixed, the same command resumes at step 4."""
    from grpo.training.grading import GradingStop

    broken = {"from": 3}

    def grader(completions, **_):
        broken["calls"] = broken.get("calls", 0) + 1
        if broken["calls"] > broken["from"]:
            raise RuntimeError("the verifier's service is down")
        return digits(completions)

    def run():
        return make_ppo(tmp_path, registry={"grader": grader}, rewards={"grader": 1.0}, max_steps=6,
                        max_ungraded_share=0.05, ungraded_window=2, samples_every=0)

    trainer, seen, _ = run()
    with pytest.raises(GradingStop) as stop:
        trainer.train()
    line = str(stop.value)
    assert "\n" not in line and line.startswith("PPO stopped before step 4: 8 of the last 16 rows (50%, over 2 steps) "
                                                "could not be graded, past grpo.grading.max_ungraded_share 5%")
    assert "the grader 'grader' most often, for raised (8 rows)" in line and "resumes at step 4" in line
    assert sorted(seen) == [1, 2, 3] and (tmp_path / "checkpoints" / "step-3").is_dir()

    broken["from"] = 10**9  # fixed
    trainer, seen, _ = run()
    trainer.train()
    assert sorted(seen) == [4, 5, 6] and all(seen[s]["reward/ungraded_share"] == 0.0 for s in seen)


def test_a_ppo_run_without_reward_spread_stops_where_asked(tmp_path):
    from grpo.training.grading import GradingStop

    trainer, seen, _ = make_ppo(tmp_path, rewards={"constant": 1.0}, max_steps=3, no_signal_steps=2,
                                stop_without_signal=True)
    with pytest.raises(GradingStop,
                       match=r"^PPO: no learning signal for 2 steps .* stopped \(grpo.grading.stop_without_"):
        trainer.train()
    assert sorted(seen) == [1]


def test_too_few_prompts_for_a_ppo_step_fail_before_any_model_work(tmp_path):
    cfg = GRPOConfig(prompts_per_step=2, num_generations=8)
    with pytest.raises(ValueError, match=r"2 x 8 = 16 prompts a step, more than the 8 training prompts"):
        PPOTrainer(None, None, PROMPTS, cfg, tmp_path)


# -- the reasoning stage with algorithm ppo, end to end ------------------------------------------------------------

@pytest.mark.parametrize("distributed", [{}, {"num_processes": 2, "strategy": "fsdp"}], ids=["one", "fsdp-2"])
def test_reasoning_stage_runs_ppo_end_to_end(prefect_harness, mlflow_client, tmp_path, distributed):
    """The stage with `algorithm: ppo`, in the task's process or launched on two sharded processes (the job
    carries the ppo section to each)."""
    from flows.reasoning_grpo import reasoning_grpo
    from grpo.configs.recipe import ReasoningGRPOConfig
    from runtime.tracking import download

    model, tok = load_model_and_tokenizer(SMALL)
    start = tmp_path / "start"
    model.save_pretrained(start)
    tok.save_pretrained(start)
    cfg = ReasoningGRPOConfig.model_validate({
        "model": SMALL.model_dump(), "data": {"num_train": 32, "num_heldout": 8}, "eval_before": False,
        "algorithm": "ppo", "ppo": {"lam": 0.9},
        "grpo": {"max_steps": 2, "prompts_per_step": 2, "num_generations": 4, "sampling": {"max_new_tokens": 16},
                 "samples_every": 1, "checkpoint_every": 0, "learning_rate": 1e-3},
        "eval": {"num_prompts": 8, "num_samples": 0, "max_new_tokens": 16, "num_logged_samples": 4},
        "distributed": distributed,
    })
    result = reasoning_grpo(str(start), cfg)
    run = mlflow_client.get_run(result.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["stage"] == "reasoning_grpo"
    assert run.data.params["algorithm"] == "ppo" and run.data.params["ppo.lam"] == "0.9"
    for key in ("value/loss", "value/explained_variance", "kl", "clip_ratio", "value/clip_ratio", "reward/total"):
        assert [m.step for m in mlflow_client.get_metric_history(result.run_id, key)] == [1, 2], key
    assert "eval/accuracy" in result.metrics
    samples = json.loads(download(f"runs:/{result.run_id}/samples/step_00001.json", tmp_path / "s").read_text())
    assert len(samples["data"]) == 8  # one completion for each of 2 x 4 prompts
    trained = AutoModelForCausalLM.from_pretrained(download(result.uris["checkpoint"], tmp_path / "ckpt"))
    before = model.state_dict()
    assert any(not torch.equal(before[k], v) for k, v in trained.state_dict().items())


def test_ppo_has_a_config_of_its_own_built_from_the_stage_sections():
    grpo = GRPOConfig(learning_rate=2e-5, beta=0.0, micro_batch_size=4, max_ungraded_share=0.5, seed=3)
    cfg = PPOTrainingConfig.from_grpo(grpo, PPOConfig(gamma=0.9))
    assert (cfg.optimizer, cfg.loss, cfg.memory, cfg.grading, cfg.sampling, cfg.seed) == \
        (grpo.optimizer, grpo.loss, grpo.memory, grpo.grading, grpo.sampling, 3)
    assert cfg.ppo.gamma == 0.9 and "ppo" in PPOTrainingConfig.model_fields
    assert not {"lora", "prompt_mix", "rollout", "schedule"} & set(PPOTrainingConfig.model_fields)
    assert cfg == PPOTrainingConfig(learning_rate=2e-5, beta=0.0, micro_batch_size=4, max_ungraded_share=0.5, seed=3,
                                    ppo={"gamma": 0.9})  # flat names read into the sections, as GRPOConfig reads them
    with pytest.raises(ValueError, match="algorithm ppo has no groups to filter"):
        PPOTrainingConfig.from_grpo(GRPOConfig(dynamic_sampling=True))
    with pytest.raises(ValueError, match="rollout"):
        PPOTrainingConfig(dynamic_sampling=True)  # PPO has no rollout section
