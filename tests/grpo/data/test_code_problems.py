"""The project's own code problems (recipes/data/code_problems.jsonl, MBPP's format) and a reasoning GRPO step
scored by the code reward on a tiny model, end to end.

Needs bubblewrap (`apt-get install -y bubblewrap`): skipped without it, failed in CI.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

from grpo.configs.code import CodeConfig
from grpo.configs.data import DataConfig
from grpo.configs.sampling import SamplingConfig
from grpo.configs.training import GRPOConfig
from grpo.data.tables import load_rl_data
from grpo.models import load_model_and_tokenizer
from grpo.rewards import check_code
from grpo.training.loops.grpo_trainer import GRPOTrainer
from tiny_configs import SMALL

PROBLEMS = Path(__file__).resolve().parents[3] / "recipes" / "data" / "code_problems.jsonl"
HELDOUT = PROBLEMS.with_name("code_problems_heldout.jsonl")
MBPP = {"prompt": "text", "tests": "test_list", "setup": "test_setup_code"}


@pytest.fixture(scope="module")
def problems() -> pd.DataFrame:
    rows, _ = load_rl_data(DataConfig(source=str(PROBLEMS), columns=MBPP, num_heldout=0))
    return rows


@pytest.fixture(scope="module")
def heldout() -> pd.DataFrame:
    _, rows = load_rl_data(DataConfig(source=str(PROBLEMS), heldout_source=str(HELDOUT), columns=MBPP))
    return rows


def solved(code: str) -> str:
    return f"<think>I write it.</think><answer>```python\n{code}\n```</answer>"


@pytest.mark.parametrize("which", ["train", "heldout"])
def test_every_reference_solution_passes_its_tests_and_an_empty_one_none(bwrap, problems, heldout, which):
    problems = problems if which == "train" else heldout
    assert len(problems) >= 8 and "answer" not in problems.columns
    references = [solved(code) for code in problems["code"]]
    stubs = [solved(code.split(":")[0] + ":\n    return None") for code in problems["code"]]  # the signature only
    report = check_code(references + stubs, tests=problems["tests"].tolist() * 2,
                        setup=problems["setup"].tolist() * 2, workers=2)
    n = len(problems)
    assert report.scores[:n] == [1.0] * n, [t for t, s in zip(problems["tests"], report.scores) if s != 1.0]
    assert report.scores[n:] == [0.0] * n


def test_a_reasoning_grpo_step_with_the_code_reward_runs_end_to_end(bwrap, problems, tmp_path):
    torch.manual_seed(0)
    model, tokenizer = load_model_and_tokenizer(SMALL)
    cfg = GRPOConfig(max_steps=1, prompts_per_step=2, num_generations=4, checkpoint_every=0, beta=0.0,
                     learning_rate=1e-2, sampling=SamplingConfig(max_new_tokens=8),
                     rewards={"code": 1.0, "format": 0.5}, code=CodeConfig(all_or_nothing=False, workers=2))
    seen = {}
    trainer = GRPOTrainer(model, tokenizer, problems, cfg, tmp_path, progress=False,
                          on_metrics=lambda step, metrics: seen.__setitem__(step, metrics))
    # the step as the trainer takes it, with the tiny model's samples swapped for programs it cannot yet write:
    # per group a right one, a half-right one, one that exits before its tests, and none at all
    idx = [0, 6]  # add, evens
    rollout = trainer.sample(idx)
    programs = []
    for i in idx:
        name = problems["code"][i].split("(")[0][4:]
        programs += [solved(problems["code"][i]), solved(f"def {name}(*a):\n    return 0"),
                     solved(problems["code"][i] + "\nraise SystemExit(0)"), "no program"]
    scores = trainer.score(rollout._replace(texts=programs), idx)
    # `return 0` passes add(-4, 4) == 0 (1 of 3) and none of evens' (0 is not a list)
    assert scores.per_function["code"] == [1.0, pytest.approx(1 / 3), 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    batch = trainer.build_batch(rollout, scores.total)
    assert batch.advantages[0] > 0 > batch.advantages[3]  # the passing program is pushed up, the empty one down
    trainer.optimise(batch)
    # and a whole training step with the model's own samples (which hold no program: 0.0 each, nothing failed)
    trainer.train()
    assert seen[1]["reward/code"] == 0.0 and (tmp_path / "model").is_dir()


def test_the_code_recipe_reads_them_by_naming_mbpp_columns(bwrap, monkeypatch):
    from flows.cli.preflight import check_recipe
    from grpo.configs.recipe import load_recipe

    monkeypatch.chdir(PROBLEMS.parents[2])  # the recipe names its data from the project folder
    recipe = load_recipe("code")
    assert recipe.reasoning_grpo.data.columns == MBPP and set(recipe.reasoning_grpo.grpo.rewards) == {"code", "format"}
    # held out on code problems of their own, so the stage's eval/accuracy is pass@1 and no training problem is in it
    train, held = load_rl_data(recipe.reasoning_grpo.data)
    assert "tests" in held.columns and len(held) == recipe.reasoning_grpo.eval.num_prompts == 8
    assert not set(held["prompt"]) & set(train["prompt"])
    check_recipe(recipe, ["reasoning_grpo"])  # rows, reward columns and the sandbox, as `r1 run` checks them
