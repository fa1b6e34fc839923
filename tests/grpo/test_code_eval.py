"""Code rows beyond the training reward: held-out evaluation reports pass@1 and pass@k by running their tests,
rejection sampling keeps only programs that pass them, and alignment GRPO weights `code` beside the reward model,
whose general prompts have no tests. All through the same sandbox as the code reward.

Needs bubblewrap (`apt-get install -y bubblewrap`): skipped without it, failed in CI.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from grpo.configs.code import CodeConfig
from grpo.configs.data import DataConfig
from grpo.configs.recipe import AlignmentGRPOConfig
from grpo.configs.rejection import RejectionConfig
from grpo.configs.sampling import EvalConfig, SamplingConfig
from grpo.configs.training import GRPOConfig
from grpo.data.general import general_prompts
from grpo.data.preferences import alignment_prompts
from grpo.data.tables import load_rl_data
from grpo.evaluate import evaluate
from grpo.models import load_model_and_tokenizer
from grpo.rejection.curate import curate
from grpo.rejection.shards import validate_prompts
from grpo.rewards import REWARD_FUNCTIONS
from grpo.rewards.correct import check_rows
from grpo.rewards.sandbox import SandboxUnavailable
from grpo.sampling.local.backend import Rollout, TransformersBackend
from grpo.training.loops.grpo_trainer import GRPOTrainer
from grpo.training.reward_scorer import RewardModelScorer, build_reward_model, reward_model_reward
from tiny_configs import SMALL

PROBLEMS = Path(__file__).resolve().parents[2] / "recipes" / "data" / "code_problems.jsonl"
MBPP = {"prompt": "text", "tests": "test_list", "setup": "test_setup_code"}

ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]
RIGHT = "def add(a, b):\n    return a + b"
WRONG = "def add(a, b):\n    return a * b"  # passes add(2, 2) == 4 only: 1 of 3, so not a pass
ECHO = "print(input())"


def solved(code: str) -> str:
    return f"<think>I write it.</think><answer>```python\n{code}\n```</answer>"


class ScriptedBackend:
    """Answers each prompt with fixed completions: `greedy[prompt]` at temperature 0, else `sampled[prompt]` (k)."""

    def __init__(self, greedy: dict[str, str], sampled: dict[str, list[str]]):
        self.greedy, self.sampled = greedy, sampled

    def generate(self, prompts: list, n: int, sampling: SamplingConfig) -> Rollout:
        if sampling.temperature == 0:
            texts = [self.greedy[p] for p in prompts for _ in range(n)]
        else:
            texts = [t for p in prompts for t in self.sampled[p][:n]]
        ones = torch.ones(len(texts), 1, dtype=torch.long)
        return Rollout(texts, torch.zeros(len(texts), dtype=torch.bool), ones, ones, ones, ones, ones.float())


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def through_parquet(df: pd.DataFrame, path: Path) -> pd.DataFrame:
    """As a stage task reads the held-out rows back: Parquet turns lists into numpy arrays."""
    df.to_parquet(path)
    return pd.read_parquet(path)


# ----------------------------------------------------------------------------------------------------------------
# Evaluation

def test_a_right_and_a_wrong_program_evaluate_to_accuracy_one_half(bwrap, tmp_path):
    # held-out code rows are loaded like training rows (no answer column needed) and travel as Parquet
    path = write_jsonl(tmp_path / "mbpp.jsonl", [
        {"text": "Write add(a, b).", "test_list": ADD_TESTS, "test_setup_code": ""},
        {"text": "Write add(a, b), again.", "test_list": ADD_TESTS, "test_setup_code": ""}])
    _, heldout = load_rl_data(DataConfig(source=path, heldout_source=path, columns=MBPP, num_train=0))
    assert "answer" not in heldout.columns
    rows = through_parquet(heldout, tmp_path / "heldout.parquet")
    first, second = rows["prompt"].tolist()
    backend = ScriptedBackend(greedy={first: solved(RIGHT), second: solved(WRONG)},
                              sampled={first: [solved(WRONG), solved(RIGHT)], second: [solved(WRONG), "no code"]})
    result = evaluate(backend, rows, EvalConfig(num_samples=2), CodeConfig(workers=2))
    # greedy: 3 of 3 tests passed (a pass) and 1 of 3 (not a pass, though the reward would pay 1/3)
    assert result.metrics["eval/accuracy"] == 0.5
    # samples: the first prompt passes once in 2 (pass@2 yes), the second never: 1 of 4 samples, 1 of 2 prompts
    assert result.metrics["eval/sample_accuracy"] == 0.25 and result.metrics["eval/pass_at_k"] == 0.5
    assert result.samples["tests_passed"].tolist() == ["3/3", "1/3"]
    assert result.samples["answer"].tolist() == ["3 tests", "3 tests"]
    assert result.samples["correct"].tolist() == [1.0, 0.0]


def test_a_held_out_set_may_mix_math_rows_with_code_rows_and_stdin_tests(bwrap):
    rows = pd.DataFrame({
        "prompt": ["add", "echo", "2 + 2?", "3 + 3?"],
        "answer": [None, None, "4", "6"],
        "tests": [ADD_TESTS, None, None, None],
        "io_tests": [None, {"inputs": ["hi\n"], "outputs": ["hi\n"]}, None, None]})
    backend = ScriptedBackend(greedy={"add": solved(RIGHT), "echo": solved("print('hello')"),
                                      "2 + 2?": "<think>2 + 2 = 4.</think><answer>4</answer>",
                                      "3 + 3?": "<think>3 + 3 = 5.</think><answer>5</answer>"}, sampled={})
    result = evaluate(backend, rows, EvalConfig(num_samples=0), CodeConfig(workers=2))
    assert result.samples["correct"].tolist() == [1.0, 0.0, 1.0, 0.0] and result.metrics["eval/accuracy"] == 0.5
    assert result.samples["tests_passed"].tolist() == ["3/3", "0/1", "", ""]
    assert result.samples["answer"].tolist() == ["3 tests", "1 tests", "4", "6"]


def test_the_tiny_model_is_evaluated_on_the_code_problems(bwrap, tmp_path):
    torch.manual_seed(0)
    _, heldout = load_rl_data(DataConfig(source=str(PROBLEMS), heldout_source=str(PROBLEMS), columns=MBPP,
                                         num_train=0, num_heldout=4))
    model, tokenizer = load_model_and_tokenizer(SMALL)
    cfg = EvalConfig(num_samples=2, max_new_tokens=8, num_logged_samples=4)
    result = evaluate(TransformersBackend(model, tokenizer), through_parquet(heldout, tmp_path / "h.parquet"), cfg)
    # a random-weight model writes no program: every test counts as failed, none passes
    assert result.metrics["eval/accuracy"] == 0.0 and result.metrics["eval/pass_at_k"] == 0.0
    assert result.samples["tests_passed"].tolist() == ["0/3"] * 4


def test_without_bwrap_evaluating_code_rows_refuses(monkeypatch, tmp_path):
    from grpo.rewards import sandbox

    rows = pd.DataFrame({"prompt": ["add"], "tests": [ADD_TESTS]})
    backend = ScriptedBackend(greedy={"add": solved(RIGHT)}, sampled={})
    monkeypatch.setenv("PATH", str(tmp_path))
    sandbox._probe.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match="bubblewrap"):  # never scored by running the program bare
            evaluate(backend, rows, EvalConfig(num_samples=0))
    finally:
        sandbox._probe.cache_clear()


# ----------------------------------------------------------------------------------------------------------------
# Rejection sampling

class RecordingJudge:
    """Accepts everything and keeps the references it was shown."""

    def __init__(self):
        self.references: list[str | None] = []

    def judge_many(self, items):
        from grpo.sampling.judge import Verdict

        self.references += [reference for _, _, reference in items]
        return [Verdict(True, "VERDICT: yes") for _ in items]


def code_samples() -> pd.DataFrame:
    return pd.DataFrame({
        "prompt": ["Write add(a, b)."] * 3 + ["What is 2 + 2?"],
        "answer": [None, None, None, "4"],
        "tests": [ADD_TESTS] * 3 + [None],
        "source_prompt_id": [0, 0, 0, 1], "sample_index": [0, 1, 2, 0],
        "response": [solved(RIGHT), solved(WRONG), solved(RIGHT + "\nraise SystemExit(0)"),
                     "<think>2 + 2 = 4.</think><answer>4</answer>"]})


def test_rejection_sampling_keeps_passing_programs_and_drops_failing_ones_as_incorrect(bwrap):
    cfg = RejectionConfig(max_kept_per_prompt=0, code=CodeConfig(workers=2))
    samples = code_samples()
    # rows with tests need no answer and no judge: the check runs them
    validate_prompts(samples[["prompt", "answer", "tests"]], cfg, judge=None)
    result = curate(samples, cfg)
    assert result.kept["response"].tolist() == [solved(RIGHT), "<think>2 + 2 = 4.</think><answer>4</answer>"]
    # the wrong program (1 of 3 tests) and the one that exits before its tests both fail the check
    assert result.counts.dropped["incorrect"] == 2 and result.counts.rule_checked == 4
    assert result.samples["rule_correct"].tolist() == [True, False, False, True]
    assert set(result.kept["verdict_source"]) == {"rule"}


def test_the_judge_is_shown_a_code_rows_test_results(bwrap):
    judge = RecordingJudge()
    result = curate(code_samples(), RejectionConfig(max_kept_per_prompt=0, judge_when="always"), judge)
    assert judge.references == ["(no reference answer: the program in the response passed 3 of its 3 tests)",
                                "(no reference answer: the program in the response passed 1 of its 3 tests)",
                                "(no reference answer: the program in the response passed 0 of its 3 tests)", "4"]
    # the rule decides where it can; the judge's yes to the failing programs only shows up as disagreement
    assert result.counts.kept == 2 and (result.counts.both_checked, result.counts.agreed) == (4, 2)


# ----------------------------------------------------------------------------------------------------------------
# Alignment GRPO

def test_alignment_grpo_weights_code_beside_the_reward_model(bwrap, tmp_path):
    torch.manual_seed(0)
    code_rows, _ = load_rl_data(DataConfig(source=str(PROBLEMS), columns=MBPP, num_heldout=0))
    rows = through_parquet(alignment_prompts(code_rows.head(2), general_prompts(2)), tmp_path / "rows.parquet")
    cfg = GRPOConfig(max_steps=1, prompts_per_step=2, num_generations=2, checkpoint_every=0, beta=0.0,
                     sampling=SamplingConfig(max_new_tokens=8), rewards={"code": 1.0, "reward_model": 0.5},
                     code=CodeConfig(workers=2))
    AlignmentGRPOConfig(grpo=cfg)  # the stage offers code beside its reward model
    scorer = RewardModelScorer(*build_reward_model(SMALL))
    trainer = GRPOTrainer(*load_model_and_tokenizer(SMALL), rows, cfg, tmp_path,
                          reward_functions={**REWARD_FUNCTIONS, "reward_model": reward_model_reward(scorer)},
                          progress=False)
    idx = [0, 2]  # the first code problem (add) and the first general prompt
    rollout = trainer.sample(idx)
    texts = [solved(code_rows["code"][0]), "no program", "<think>A tip.</think><answer>Sleep well.</answer>",
             "<think>A tip.</think><answer>Drink water.</answer>"]
    scores = trainer.score(rollout._replace(texts=texts), idx)
    # code scores the code rows and abstains on the general ones; the reward model does the opposite
    assert scores.per_function["code"] == [1.0, 0.0, None, None]
    assert [s is None for s in scores.per_function["reward_model"]] == [True, True, False, False]
    assert scores.failures == {"code": 0, "reward_model": 0}
    # without tests a row has no verdict from the check either: it is left to the reward model (or a judge)
    assert check_rows(["x"], tests=[float("nan")], answer=[None]).correct == [None]
