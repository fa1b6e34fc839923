"""`grpo.schedule` in the GRPO loop on a real tiny model: a reward that counts only late, a reference that moves."""

import shutil

import pandas as pd
import pytest
import torch

from grpo.configs.sampling import SamplingConfig
from grpo.configs.training import GRPOConfig
from grpo.models import load_model_and_tokenizer
from grpo.training.loops.grpo_trainer import GRPOTrainer
from grpo.training.runtime import REFERENCE_FILE
from tiny_configs import SMALL

PROMPTS = pd.DataFrame({"prompt": [f"Say {i}" for i in range(8)], "answer": [str(i) for i in range(8)]})


def digits(completions, **_):
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def constant(completions, **_):
    return [1.0] * len(completions)


def run(tmp_path, schedule, on_step=None, **overrides):
    """A trainer of 3 steps (fp32, one thread); `on_step(trainer, step)` after each step's metrics."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model, tok = load_model_and_tokenizer(SMALL)
    cfg = GRPOConfig(**{"max_steps": 3, "prompts_per_step": 2, "num_generations": 4, "checkpoint_every": 0,
                        "sampling": SamplingConfig(max_new_tokens=8), "rewards": {"digits": 1.0, "constant": 1.0},
                        "learning_rate": 1e-2, "beta": 0.04, "mixed_precision": "no", "schedule": schedule,
                        **overrides})
    seen, box = {}, {}

    def metrics(step, m):
        seen[step] = m
        if on_step is not None:
            on_step(box["trainer"], step)

    box["trainer"] = trainer = GRPOTrainer(model, tok, PROMPTS, cfg, tmp_path, progress=False, on_metrics=metrics,
                                           reward_functions={"digits": digits, "constant": constant})
    return trainer, seen


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_reward_counts_only_from_its_share_of_the_steps(tmp_path):
    trainer, seen = run(tmp_path, {"rewards_from": {"constant": 0.5}})  # step 2 of 3 on (ceil(1.5) = 2: 0-based)
    trainer.train()
    assert [("reward/constant" in seen[s], "reward/digits" in seen[s]) for s in (1, 2, 3)] == [
        (False, True), (False, True), (True, True)]
    assert seen[3]["reward/constant"] == 1.0
    # the total is the rewards that count: digits alone first, digits + 1 once constant counts
    assert seen[1]["reward/total"] == pytest.approx(seen[1]["reward/digits"])
    assert seen[3]["reward/total"] == pytest.approx(seen[3]["reward/digits"] + 1.0)


def test_the_reference_becomes_the_policy_every_k_steps_and_travels_in_checkpoints(tmp_path):
    snapshots = {}

    def on_step(trainer, step):  # the policy after each step; the checkpoints as they stand before the last one
        snapshots[step] = weights(trainer.model)
        if step == 3:  # the loop removes its checkpoints once the model is saved
            shutil.copytree(trainer.output_dir / "checkpoints", tmp_path / f"kept-{trainer.output_dir.name}")

    trainer, _ = run(tmp_path / "a", {"reference_every": 2}, checkpoint_every=1, on_step=on_step)
    start = weights(trainer.ref_model)
    trainer.train()
    ref = weights(trainer.ref_model)
    assert not same(snapshots[1], snapshots[2]) and not same(snapshots[2], snapshots[3])  # every step moved it
    assert same(ref, snapshots[2]) and not same(ref, start)  # refreshed after step 2, not after 1 or 3

    # a run that resumes from step 2 scores its KL term against that reference, not the starting checkpoint's
    resumed, _ = run(tmp_path / "a", {"reference_every": 2})
    assert same(weights(resumed.ref_model), start)
    assert resumed._resume(tmp_path / "kept-a") == 2
    assert same(weights(resumed.ref_model), snapshots[2])

    # without the schedule the reference stays the starting checkpoint, and no checkpoint carries one
    fixed, _ = run(tmp_path / "b", {}, checkpoint_every=1, on_step=on_step)
    fixed.train()
    assert same(weights(fixed.ref_model), start)
    assert (tmp_path / "kept-b" / "step-2").is_dir() and not (tmp_path / "kept-b" / "step-2" / REFERENCE_FILE).exists()


def test_a_schedule_that_does_not_fit_the_run_fails_in_one_line():
    for settings, message in [
            ({"schedule": {"rewards_from": {"format": 0.5}}}, r"names \['format'\], which rewards does not"),
            ({"schedule": {"rewards_from": {"digits": 0.5}}}, "at least one reward must count from the start"),
            ({"schedule": {"reference_every": 5}, "beta": 0.0}, "needs beta > 0"),
            ({"schedule": {"rewards_from": {"digits": 1.0}}}, "less than 1")]:
        with pytest.raises(ValueError, match=message):
            GRPOConfig(rewards={"digits": 1.0}, **settings)
