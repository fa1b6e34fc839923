"""Online RFT: the coefficient against hand-worked numbers, its loss and gradient against a naive per-sample loop
(an all-wrong and an all-right group included), the recipe's checks, and a step of the GRPO trainer on a real tiny
model trained with the coefficients in place of the group advantages."""

import pandas as pd
import pytest
import torch
from pydantic import ValidationError

from grpo.configs.recipe import ReasoningGRPOConfig
from grpo.configs.rft import OnlineRFTConfig
from grpo.configs.sampling import SamplingConfig
from grpo.configs.training import GRPOConfig
from grpo.models import load_model_and_tokenizer
from grpo.rewards import REWARD_FUNCTIONS
from grpo.training.advantages import group_advantages
from grpo.training.loops.grpo_trainer import GRPOTrainer
from grpo.training.loss import grpo_loss
from grpo.training.rft import coefficient_function, rft_coefficients
from tiny_configs import SMALL


def test_the_coefficient_is_one_for_a_correct_sample_and_zero_otherwise():
    # threshold 1.0 on the accuracy reward: only a verified answer counts; None (not scorable) never does
    assert rft_coefficients([1.0, 0.0, None, 0.999, 2.0], 1.0).tolist() == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert rft_coefficients([0.5, 0.4], 0.5).tolist() == [1.0, 0.0]
    assert rft_coefficients([], 1.0).shape == (0,)


def naive_rft(logps, ref, correct, mask, beta):
    """Per sample, per token, in Python: loss -c·ρ + β·k3 (ρ = exp(logp - logp.detach()) = 1, whose gradient is the
    log-prob's), the mean over a sequence's tokens, then the mean over sequences; c = 1 if correct else 0."""
    B, T = logps.shape
    total = 0.0
    for b in range(B):
        c = 1.0 if correct[b] else 0.0  # no baseline, no normalisation
        seq, n = 0.0, 0
        for t in range(T):
            if not mask[b, t]:
                continue
            ratio = torch.exp(logps[b, t] - logps[b, t].detach())
            d = ref[b, t] - logps[b, t]
            seq = seq - c * ratio + beta * (torch.exp(d) - d - 1)
            n += 1
        total = total + seq / max(n, 1)
    return total / B


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_and_gradient_match_a_naive_per_sample_loop(beta):
    torch.manual_seed(0)
    G = 4
    # group 0 mixed, group 1 all wrong, group 2 all right
    rewards = [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    correct = [r >= 1.0 for r in rewards]
    B, T = len(rewards), 5
    mask = (torch.arange(T)[None, :] < torch.randint(1, T + 1, (B,))[:, None]).float()
    ref = torch.randn(B, T) - 2
    base = torch.randn(B, T) - 2
    coefficients = rft_coefficients(rewards, 1.0)

    logps = base.clone().requires_grad_(True)
    loss, stats = grpo_loss(logps, None, ref if beta else None, coefficients, mask, beta=beta)
    loss.backward()
    naive_logps = base.clone().requires_grad_(True)
    expected = naive_rft(naive_logps, ref, correct, mask, beta)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    assert torch.allclose(logps.grad, naive_logps.grad, atol=1e-7)

    # the policy-gradient part by hand: each correct sample's tokens get -1/(B·|o|), the others nothing
    pg_grad = torch.zeros(B, T)
    for b in range(B):
        if correct[b]:
            pg_grad[b] = -mask[b] / (B * mask[b].sum())
    kl_grad = logps.grad - pg_grad
    if beta == 0:
        assert kl_grad.abs().max() < 1e-9
    # the all-wrong group (rows 4-7): no policy gradient at all, only the KL's (0 with beta 0)
    assert torch.allclose(logps.grad[4:8], kl_grad[4:8], atol=1e-9)
    # the all-right group (rows 8-11): each sample pushed up as in SFT on it, where GRPO's advantage is 0
    assert coefficients[8:].tolist() == [1.0] * 4
    assert group_advantages(torch.tensor(rewards), G)[8:].abs().max() == 0
    assert (pg_grad[8:] * mask[8:]).sum(-1).tolist() == pytest.approx([-1 / B] * 4)
    assert stats["pg_loss"] == pytest.approx(-sum(correct) / B, abs=1e-6)  # ratio 1: -(mean coefficient)


def test_the_recipe_selects_online_rft_and_refuses_what_it_cannot_honour():
    cfg = ReasoningGRPOConfig(algorithm="online_rft", online_rft={"correct_reward": "format", "threshold": 0.5})
    assert cfg.online_rft == OnlineRFTConfig(correct_reward="format", threshold=0.5)
    with pytest.raises(ValidationError, match=r"online_rft.correct_reward 'code' is not among grpo.rewards"):
        ReasoningGRPOConfig(algorithm="online_rft", online_rft={"correct_reward": "code"})
    with pytest.raises(ValidationError, match=r"grpo.rollout.dynamic_sampling .* set it to false"):
        ReasoningGRPOConfig(algorithm="online_rft", grpo={"dynamic_sampling": True})
    with pytest.raises(ValidationError, match=r"supervision 'outcome' with online_rft"):
        ReasoningGRPOConfig(algorithm="online_rft", grpo={"supervision": "process", "step_verifier": "arithmetic"})
    with pytest.raises(ValidationError, match=r"extra"):
        ReasoningGRPOConfig(algorithm="online_rft", online_rft={"treshold": 1.0})
    ReasoningGRPOConfig(grpo={"dynamic_sampling": True})  # GRPO keeps its own options


def every_third(completions, **_):
    """'Correct' for completions 0, 3, 6, ... of a step: a fixed mix of right and wrong, whatever is sampled."""
    return [1.0 if i % 3 == 0 else 0.0 for i in range(len(completions))]


def test_a_trainer_step_trains_each_sample_with_its_coefficient(tmp_path):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model, tok = load_model_and_tokenizer(SMALL)
    prompts = pd.DataFrame({"prompt": [f"Say {i}" for i in range(8)], "answer": [str(i) for i in range(8)]})
    cfg = GRPOConfig(max_steps=1, prompts_per_step=2, num_generations=4, checkpoint_every=0, beta=0.04,
                     learning_rate=1e-2, mixed_precision="no", sampling=SamplingConfig(max_new_tokens=8),
                     rewards={"accuracy": 1.0, "format": 0.5})
    seen = {}
    trainer = GRPOTrainer(model, tok, prompts, cfg, tmp_path, progress=False,
                          reward_functions={**REWARD_FUNCTIONS, "accuracy": every_third},
                          coefficients=coefficient_function(OnlineRFTConfig()),
                          on_metrics=lambda step, m: seen.__setitem__(step, m))
    rollout, idx, scores, _ = trainer.collect(0)
    coefficients = trainer.advantage.coefficients(scores)
    assert coefficients.tolist() == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    batch = trainer.build_batch(rollout, coefficients.tolist())
    assert batch.advantages.tolist() == coefficients.tolist()  # as they are: no group mean taken, no std
    from grpo.training.logprobs import token_logps

    C = rollout.completion_ids.size(1)
    before, _ = token_logps(trainer.model, batch.input_ids, batch.attention_mask, C, 1.0)
    trainer.optimise(batch)
    with torch.no_grad():
        after, _ = token_logps(trainer.model, batch.input_ids, batch.attention_mask, C, 1.0)
    change = ((after - before.detach()) * batch.completion_mask).sum(-1)  # [N]
    assert change[coefficients == 1].mean() > 0  # the correct samples became more likely

    trainer.train()  # the loop logs GRPO's figures and the share of correct samples
    assert seen[1]["rft/correct"] == pytest.approx(3 / 8)
    assert {"reward/total", "reward/accuracy", "kl", "train/loss", "grad_norm"} <= set(seen[1])


def rft_trainer(tmp_path, correct, **overrides):
    """A GRPO trainer with online RFT's coefficients, `correct` the accuracy reward."""
    model, tok = load_model_and_tokenizer(SMALL)
    prompts = pd.DataFrame({"prompt": [f"Say {i}" for i in range(8)], "answer": [str(i) for i in range(8)]})
    cfg = GRPOConfig(**{"max_steps": 1, "prompts_per_step": 2, "num_generations": 4, "checkpoint_every": 0,
                        "beta": 0.0, "mixed_precision": "no", "sampling": SamplingConfig(max_new_tokens=8),
                        "rewards": {"accuracy": 1.0}, **overrides})
    seen = {}
    trainer = GRPOTrainer(model, tok, prompts, cfg, tmp_path, progress=False,
                          reward_functions={**REWARD_FUNCTIONS, "accuracy": correct},
                          coefficients=coefficient_function(OnlineRFTConfig()),
                          on_metrics=lambda step, m: seen.__setitem__(step, m))
    return trainer, seen


def first_row_only(completions, **_):
    """Grades the first completion of the step (correct) and the second group (rows 4, 7 correct); rows 1-3 of the
    first group it cannot (a check that timed out)."""
    from grpo.rewards.outcomes import TIMEOUT, Ungraded

    return [Ungraded(TIMEOUT) if i in (1, 2, 3) else float(i in (0, 4, 7)) for i in range(len(completions))]


def test_an_ungraded_sample_changes_no_other_samples_coefficient_or_the_share_correct(tmp_path):
    """Online RFT compares a sample with nothing: the one graded sample of a group whose others are ungraded trains
    with its coefficient as it would alone, and the share correct is over the graded samples."""
    torch.manual_seed(0)
    trainer, seen = rft_trainer(tmp_path, first_row_only)
    rollout, idx, scores, _ = trainer.collect(0)
    graded = scores.graded_rows
    assert graded == [True, False, False, False, True, True, True, True]
    coefficients = trainer.advantage.coefficients(scores)
    batch = trainer.build_batch(rollout, coefficients.tolist(), None, graded)
    kept = [0, 4, 5, 6, 7]
    assert batch.advantages[kept].tolist() == [1.0, 1.0, 0.0, 0.0, 1.0]  # as without the ungraded rows
    assert torch.equal(batch.completion_mask[kept].cpu(), rollout.completion_mask[kept].float())
    assert batch.completion_mask[[1, 2, 3]].sum() == 0 and batch.advantages[[1, 2, 3]].abs().sum() == 0
    trainer.train()
    assert seen[1]["rft/correct"] == pytest.approx(3 / 5) and seen[1]["reward/ungraded_share"] == 3 / 8


@pytest.mark.parametrize("right, stops", [(1.0, False), (0.0, True)])
def test_online_rft_has_signal_when_a_sample_is_correct_not_when_rewards_differ(tmp_path, right, stops):
    """Every sample correct: each is pushed up, a signal though every group's rewards tie; none correct: no
    coefficient anywhere, and the run stops where the recipe asks."""
    from grpo.training.grading import GradingStop

    trainer, seen = rft_trainer(tmp_path, lambda completions, **_: [right] * len(completions), no_signal_steps=1,
                                stop_without_signal=True)
    if stops:
        with pytest.raises(GradingStop, match="no learning signal for 1 steps"):
            trainer.train()
    else:
        trainer.train()
        assert seen[1]["rft/correct"] == 1.0 and seen[1]["grad_norm"] > 0


def grpo_job(tmp_path, prompts: pd.DataFrame, cfg: GRPOConfig, out: str = "out", **kw):
    """A stage's GRPO job (grpo.training.jobs) on these prompts, as its task builds it."""
    from grpo.training.jobs import GRPOJob

    prompts.to_parquet(tmp_path / "rows.parquet")
    return GRPOJob(model=SMALL, cfg=cfg, rows=str(tmp_path / "rows.parquet"), output_dir=str(tmp_path / out), **kw)


def test_the_stage_trainer_refuses_settings_online_rft_cannot_honour(tmp_path):
    from grpo.training.jobs import build_rl_trainer

    prompts = pd.DataFrame({"prompt": ["Say 1", "Say 2"], "answer": ["1", "2"]})
    cfg = GRPOConfig(prompts_per_step=2, num_generations=2, dynamic_sampling=True)
    with pytest.raises(ValueError, match="grpo.rollout.dynamic_sampling drops groups"):
        build_rl_trainer(grpo_job(tmp_path, prompts, cfg, online_rft=OnlineRFTConfig()))
    with pytest.raises(ValueError, match="online_rft.correct_reward 'code' is not among grpo.rewards"):
        build_rl_trainer(grpo_job(tmp_path, prompts, GRPOConfig(prompts_per_step=2, num_generations=2),
                                  online_rft=OnlineRFTConfig(correct_reward="code")))


def test_the_reasoning_stage_runs_online_rft_through_its_flow(prefect_harness, mlflow_client, logged_checkpoint):
    from flows.reasoning_grpo import reasoning_grpo
    from tiny_configs import LOGGED_TINY

    torch.set_num_threads(1)
    config = ReasoningGRPOConfig.model_validate({
        "model": {"tiny": LOGGED_TINY}, "data": {"num_train": 16, "num_heldout": 4}, "algorithm": "online_rft",
        "grpo": {"max_steps": 2, "prompts_per_step": 2, "num_generations": 2, "sampling": {"max_new_tokens": 8},
                 "samples_every": 0, "checkpoint_every": 0, "mixed_precision": "no"},
        "eval": {"num_prompts": 4, "num_samples": 0, "max_new_tokens": 8, "num_logged_samples": 2},
        "eval_before": False})
    result = reasoning_grpo(logged_checkpoint, config)
    run = mlflow_client.get_run(result.run_id)
    assert run.info.status == "FINISHED" and run.data.params["algorithm"] == "online_rft"
    assert run.data.params["online_rft.correct_reward"] == "accuracy"
    history = mlflow_client.get_metric_history(result.run_id, "rft/correct")
    assert [m.step for m in history] == [1, 2] and all(0.0 <= m.value <= 1.0 for m in history)
    # what counted as correct is what the accuracy reward said: the same share
    accuracy = {m.step: m.value for m in mlflow_client.get_metric_history(result.run_id, "reward/accuracy")}
    assert all(m.value == pytest.approx(accuracy[m.step]) for m in history)
    assert "eval/accuracy" in result.metrics and result.uris["checkpoint"].endswith("/checkpoint")


def test_a_launched_process_runs_online_rft_from_its_job_file(tmp_path):
    """What each process of a launched stage runs (grpo.training.launchers.worker), here in this process: the job's
    `online_rft` section reaches the trainer, and the main process reports rft/correct."""
    import json

    from grpo.training.jobs import Launched, read_launched
    from grpo.training.launchers.worker import run_job

    torch.set_num_threads(1)
    prompts = pd.DataFrame({"prompt": [f"Say {i}" for i in range(4)], "answer": [str(i) for i in range(4)]})
    cfg = GRPOConfig(max_steps=1, prompts_per_step=2, num_generations=2, checkpoint_every=0, mixed_precision="no",
                     sampling=SamplingConfig(max_new_tokens=4))
    job = grpo_job(tmp_path, prompts, cfg, online_rft=OnlineRFTConfig(correct_reward="format", threshold=0.0))
    document = Launched(job=job, events=str(tmp_path / "events.jsonl"),
                        result=str(tmp_path / "result.json")).model_dump_json()
    run_job(read_launched(document))  # the job file, as a launched process reads it
    assert json.loads((tmp_path / "result.json").read_text())["steps"] == 1
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    metrics = [e["metrics"] for e in events if "metrics" in e]  # beside the step's samples table
    assert metrics[0]["rft/correct"] == 1.0  # threshold 0 on the format reward: every scored completion counts


def test_offline_rft_samples_from_the_frozen_start_while_the_policy_trains(tmp_path):
    """`online_rft.sampler: initial` (DeepSeekMath's offline RFT): the stage's trainer samples every step from a frozen
    copy of its starting model, which training leaves as it was, while the policy it trains moves."""
    from grpo.training.jobs import build_rl_trainer

    torch.manual_seed(0)
    torch.set_num_threads(1)
    prompts = pd.DataFrame({"prompt": [f"Say {i}" for i in range(8)], "answer": [str(i) for i in range(8)]})
    cfg = GRPOConfig(max_steps=2, prompts_per_step=2, num_generations=4, checkpoint_every=0, learning_rate=1e-2,
                     mixed_precision="no", sampling=SamplingConfig(max_new_tokens=8),
                     rewards={"accuracy": 1.0, "format": 0.5})
    trainer = build_rl_trainer(grpo_job(tmp_path, prompts, cfg, "offline", online_rft=OnlineRFTConfig(
        correct_reward="format", threshold=0.0, sampler="initial")))  # every sample "correct"
    sampler = trainer.engine.model
    assert sampler is not trainer.model and not any(p.requires_grad for p in sampler.parameters())
    start = {k: v.clone() for k, v in sampler.state_dict().items()}
    assert all(torch.equal(start[k], v) for k, v in trainer.model.state_dict().items())  # the start, copied
    trainer.train()
    assert all(torch.equal(start[k], v) for k, v in sampler.state_dict().items())  # frozen
    assert not all(torch.equal(start[k], v) for k, v in trainer.model.state_dict().items())  # the policy moved
    online = build_rl_trainer(grpo_job(tmp_path, prompts, cfg, "online", online_rft=OnlineRFTConfig()))
    assert online.engine.model is not sampler  # online RFT samples from the policy's own engine
    with pytest.raises(ValidationError, match="online_rft.sampler 'initial' .* use rollout.mode sync"):
        ReasoningGRPOConfig(algorithm="online_rft", online_rft={"sampler": "initial"},
                            grpo={"rollout": {"mode": "async"}})
