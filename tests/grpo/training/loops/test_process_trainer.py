"""The GRPO trainer with process supervision, on a real tiny model: step rewards become token advantages."""

import math

import pandas as pd
import pytest
import torch

from grpo.configs.data import TaskConfig
from grpo.configs.model import ModelConfig
from grpo.configs.reward import RewardModelConfig
from grpo.configs.sampling import SamplingConfig
from grpo.configs.training import GRPOConfig, SFTConfig
from grpo.data.arithmetic import generate_problems, rl_rows, sft_rows
from grpo.models import load_model_and_tokenizer
from grpo.rewards import REWARD_FUNCTIONS, accuracy_reward
from grpo.rewards.outcomes import TIMEOUT, Ungraded
from grpo.rewards.steps import Steps, arithmetic_steps
from grpo.sampling.local.backend import Rollout, TransformersBackend, render_prompts
from grpo.training.logprobs import token_logps
from grpo.training.loops.grpo_trainer import GRPOTrainer
from grpo.training.loops.prm import label_steps, label_worked_solutions, prm_step_verifier, train_prm
from grpo.training.loops.sft_trainer import train_sft
from grpo.training.process import process_advantages
from tiny_configs import SMALL

TASK = TaskConfig(max_operand=3, counting_share=0.5)
PROMPT = "Ben has 9 apples, buys 3 and gives away 2. How many are left?"
RIGHT = "<think>Given 9, 3, 2. 9 + 3 = 12. 12 - 2 = 10.</think><answer>10</answer>"
WRONG_FIRST = "<think>Given 9, 3, 2. 9 + 3 = 13. 13 - 2 = 11.</think><answer>11</answer>"


def make_trainer(tmp_path, model=None, tok=None, prompts=None, reward_functions=None, step_verifiers=None,
                 **overrides):
    if model is None:
        model, tok = load_model_and_tokenizer(SMALL)
    prompts = prompts if prompts is not None else pd.DataFrame({"prompt": [PROMPT], "answer": ["10"]})
    cfg = GRPOConfig(**{"max_steps": 1, "prompts_per_step": 1, "num_generations": 2, "checkpoint_every": 0,
                        "sampling": SamplingConfig(max_new_tokens=8), "supervision": "process",
                        "step_verifier": "arithmetic", "beta": 0.0, "mixed_precision": "no", **overrides})
    seen = {}
    trainer = GRPOTrainer(model, tok, prompts, cfg, tmp_path, progress=False, reward_functions=reward_functions,
                          step_verifiers=step_verifiers, on_metrics=lambda step, m: seen.__setitem__(step, m))
    return trainer, seen


def forced_rollout(tok, prompt: str, completions: list[str]) -> Rollout:
    """The completions as if sampled: chat-rendered prompt left-padded, completion + end-of-turn right-padded."""
    (rendered,) = render_prompts(tok, [prompt])
    p = tok(rendered, add_special_tokens=False)["input_ids"]
    rows = [tok(c, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for c in completions]
    C = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_token_id] * (C - len(r)) for r in rows])  # [N, C]
    mask = torch.tensor([[1] * len(r) + [0] * (C - len(r)) for r in rows])  # [N, C]
    N = len(rows)
    texts = tok.batch_decode(ids.masked_fill(mask == 0, tok.pad_token_id), skip_special_tokens=True)
    assert texts == completions
    return Rollout(texts, torch.zeros(N, dtype=torch.bool), torch.tensor([p] * N),
                   torch.ones(N, len(p), dtype=torch.long), ids, mask, torch.zeros(N, C))


def test_a_wrong_step_lowers_the_advantage_of_the_tokens_up_to_it(tmp_path):
    trainer, _ = make_trainer(tmp_path, learning_rate=1e-3)
    tok = trainer.tokenizer
    rollout = forced_rollout(tok, PROMPT, [RIGHT, WRONG_FIRST])
    outcome = trainer.score(rollout, [0]).total
    assert outcome == [1.5, 0.5]  # accuracy 1 + format 0.5; the wrong answer keeps the format's half
    steps = trainer.advantage.score_steps(rollout, [0], outcome)
    assert steps.rewards == [[1.0, 1.0, 1.5], [0.0, 1.0, 0.5]]  # two checked steps, then the answer
    for text, ends, n in zip(rollout.texts, steps.ends, rollout.completion_mask.sum(1).tolist()):
        ids = rollout.completion_ids[0 if text == RIGHT else 1].tolist()
        results = ("= 12.", "= 10.") if text == RIGHT else ("= 13.", "= 11.")
        # each checked step ends in the token that completes its period; the answer at the end-of-turn token
        for k, result in zip(ends[:2], results):
            assert tok.decode(ids[: k + 1]).rstrip().endswith(result)
            assert not tok.decode(ids[:k]).rstrip().endswith(result)
        assert ends[2] == n - 1
    batch = trainer.build_batch(rollout, outcome, steps)
    C = rollout.completion_ids.size(1)
    torch.testing.assert_close(batch.advantages, process_advantages(steps.rewards, steps.ends, 2, C))
    wrong = batch.advantages[1]  # [C]
    first, second = steps.ends[1][0], steps.ends[1][1]
    # the wrong first step's negative r~ weighs on the tokens up to it, not on those after it
    assert wrong[: first + 1].max() < wrong[first + 1 : second + 1].min()
    assert (batch.advantages[0][: steps.ends[0][2] + 1] > 0).all()  # every step right, the answer too
    # one optimizer step raises the surrogate sum_t A_t logp_t (first order: Adam's first step follows the sign)
    def surrogate():
        with torch.no_grad():
            logps, _ = token_logps(trainer.model, batch.input_ids, batch.attention_mask, C, 1.0)
        return float((logps * batch.advantages * batch.completion_mask).sum())

    before = surrogate()
    stats = trainer.optimise(batch)
    assert math.isfinite(stats["train/loss"])
    assert surrogate() > before


def test_completions_without_steps_fall_back_to_outcome_grpo_exactly(tmp_path):
    trainer, _ = make_trainer(tmp_path)
    rollout = forced_rollout(trainer.tokenizer, PROMPT, ["<think>I know it.</think><answer>10</answer>",
                                                         "<think>Easy.</think><answer>9</answer>"])
    outcome = trainer.score(rollout, [0]).total
    steps = trainer.advantage.score_steps(rollout, [0], outcome)
    assert steps.checked == [0, 0]
    process = trainer.build_batch(rollout, outcome, steps).advantages  # [N, C]
    sequence = trainer.build_batch(rollout, outcome).advantages  # [N]
    torch.testing.assert_close(process, sequence[:, None] * rollout.completion_mask)


UNSURE = "<think>Given 9, 3, 2. 9 + 3 = 12. 12 - 2 = 9.</think><answer>9</answer>"  # its second step wrong


def unsure(completions, **_):
    """Cannot grade the completion that answers 9 (a check that timed out); 0.0 for the others."""
    return [Ungraded(TIMEOUT) if "<answer>9<" in c else 0.0 for c in completions]


def test_an_ungraded_completion_changes_no_other_completions_token_advantages(tmp_path):
    """A group of three whose third completion a reward could not grade: the other two get exactly the advantages
    of a group of those two alone (its checked steps, partial outcome and all, are in no mean or std), and the
    ungraded one has no advantage and no loss token."""
    trainer, _ = make_trainer(tmp_path, num_generations=3, rewards={"accuracy": 1.0, "format": 0.5, "unsure": 1.0},
                              reward_functions={**REWARD_FUNCTIONS, "unsure": unsure})
    rollout = forced_rollout(trainer.tokenizer, PROMPT, [RIGHT, WRONG_FIRST, UNSURE])
    scores = trainer.score(rollout, [0])
    assert scores.graded_rows == [True, True, False]
    steps = trainer.advantage.score_steps(rollout, [0], scores.total)
    assert steps.checked == [2, 2, 2]  # the ungraded completion's steps were checked, and still count for nothing
    batch = trainer.build_batch(rollout, scores.total, steps, scores.graded_rows)
    C = rollout.completion_ids.size(1)
    alone = process_advantages(steps.rewards[:2], steps.ends[:2], 2, C)  # the group without the ungraded row
    torch.testing.assert_close(batch.advantages[:2].cpu(), alone)
    assert batch.advantages[2].abs().sum() == 0 and batch.completion_mask[2].sum() == 0


@pytest.mark.parametrize("answer, reason", [("malformed", "malformed"), ("raises", "raised")])
def test_a_step_verifier_that_cannot_check_leaves_its_rows_ungraded_and_the_watch_stops_the_run(tmp_path, answer,
                                                                                                reason):
    """Step ends out of order, or a raise: every completion ungraded for that reason, not a crash of the stage nor
    a run that trains on nothing unseen; the grading watch counts them and stops in its one line."""
    from grpo.training.grading import GradingStop

    def verifier(completions, **_):
        if answer == "raises":
            raise RuntimeError("the verifier's service is down")
        return [Steps((5, 3), (1.0, 1.0)) for _ in completions]

    trainer, _ = make_trainer(tmp_path, step_verifiers={"arithmetic": verifier}, max_ungraded_share=0.05,
                              ungraded_window=1)
    with pytest.raises(GradingStop) as stop:
        trainer.train()
    assert str(stop.value).startswith("GRPO stopped before step 1: 2 of the last 2 rows (100%, over 1 steps) could "
                                      f"not be graded, past grpo.grading.max_ungraded_share 5%; the grader "
                                      f"'step_verifier' most often, for {reason} (2 rows)")


def reaches(completions, answer, **_):
    """The answer is reached from a prefix whose first step is right; from UNSURE's second step the check cannot
    say (it timed out)."""
    return [Ungraded(TIMEOUT) if "12 - 2 = 9." in c else float("9 + 3 = 12." in c) for c in completions]


def test_a_step_whose_rollouts_could_not_be_graded_gets_no_label_and_changes_no_other(tmp_path):
    """UNSURE's second step: no rollout from it graded. It is left out (no end, no label) and counted; every other
    step's label is the one it has when UNSURE is not labelled at all. Past the share allowed, the labelling stops
    in the grading watch's line."""
    from grpo.training.grading import GradingStop

    model, tok = load_model_and_tokenizer(SMALL)
    backend = TransformersBackend(model, tok)
    sampling = SamplingConfig(max_new_tokens=4, temperature=0.0)
    completions = [RIGHT, WRONG_FIRST, UNSURE]
    rows = pd.DataFrame({"prompt": [PROMPT] * 3, "answer": ["10"] * 3})
    labels = label_steps(backend, rows, completions, 2, sampling, grade=reaches, max_ungraded_share=0.5)
    alone = label_steps(backend, rows[:2], completions[:2], 2, sampling, grade=reaches, max_ungraded_share=0.5)
    pd.testing.assert_frame_equal(labels[:2], alone)
    assert alone["labels"].tolist() == [[1, 1], [0, 0]]
    unsure = labels.iloc[2]
    assert unsure["step_ends"] == [RIGHT.index("12.") + 3] and unsure["labels"] == [1]  # its first step only
    assert labels.attrs == {"prm/steps": 6.0, "prm/ungraded_steps": 1.0, "reward_ungraded/accuracy/timeout": 1.0}
    with pytest.raises(GradingStop, match=r"^PRM labelling stopped before step 1: 1 of the last 6 rows \(17%, over 1 "
                                          r"steps\) could not be graded, past grpo.grading.max_ungraded_share 5%; the "
                                          r"grader 'accuracy' most often, for timeout \(1 rows\)"):
        label_steps(backend, rows, completions, 2, sampling, grade=reaches)


def test_a_step_verifier_that_finds_no_step_stops_the_first_step(tmp_path):
    trainer, _ = make_trainer(tmp_path)  # an untrained model writes no equation
    with pytest.raises(ValueError, match="step_verifier 'arithmetic' found no step in any of the first 2 "
                                         "completions"):
        trainer.train()


def test_a_process_reward_model_must_be_passed_in(tmp_path):
    with pytest.raises(ValueError, match="'prm' needs a process reward model passed in step_verifiers"):
        make_trainer(tmp_path, step_verifier="prm", prm_path="somewhere")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Models this small run faster on one thread, and on a busy 2-core machine two threads that wait on each
    other run 20x slower (1.2 s against 24 s for 20 SFT steps, measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cold_start(tmp_path_factory):
    """SMALL after a short SFT on the synthetic task: it writes the format and equations, some of them right."""
    model, tok = load_model_and_tokenizer(SMALL)
    rows = sft_rows(generate_problems(TASK, 256, "train"), TASK)
    cfg = SFTConfig(max_steps=100, batch_size=16, learning_rate=3e-3, warmup_steps=5, checkpoint_every=0,
                    mixed_precision="no")
    result = train_sft(model, tok, rows, cfg, tmp_path_factory.mktemp("cold"), progress=False)
    return result.model_dir


def test_training_with_process_supervision_logs_its_steps(tmp_path, cold_start):
    model, tok = load_model_and_tokenizer(ModelConfig(name_or_path=str(cold_start)))
    prompts = rl_rows(generate_problems(TASK, 8, "train"))
    trainer, seen = make_trainer(tmp_path, model, tok, prompts, max_steps=2, prompts_per_step=2, num_generations=4,
                                 sampling=SamplingConfig(max_new_tokens=48), learning_rate=1e-4)
    result = trainer.train()
    assert sorted(seen) == [1, 2]
    for m in seen.values():
        assert m["process/steps_per_completion"] > 0.5  # the cold start writes its equations
        assert 0.0 <= m["process/step_accuracy"] <= 1.0
        assert 0.0 <= m["process/fallback"] <= 8.0
        assert math.isfinite(m["train/loss"])
    assert (result.model_dir / "config.json").exists()


def test_steps_are_labelled_by_rollouts_from_their_prefixes(cold_start):
    model, tok = load_model_and_tokenizer(ModelConfig(name_or_path=str(cold_start)))
    rows = rl_rows(generate_problems(TASK, 16, "heldout"))
    backend = TransformersBackend(model, tok)
    greedy = SamplingConfig(max_new_tokens=48, temperature=0.0)
    completions = backend.generate(rows["prompt"].tolist(), 1, greedy).texts
    right = accuracy_reward(completions, answer=rows["answer"].tolist())
    # greedy rollouts (k = 1): from the last step's end (just before "</think>", a token of its own, so the prefix
    # is the same tokens as the completion's) the policy writes what it wrote, so that step is good exactly when
    # the completion's answer is right
    labels = label_steps(backend, rows, completions, 1, greedy)
    assert len(labels) > 8
    for row in labels.itertuples():
        i = completions.index(row.completion)
        assert row.step_ends == list(arithmetic_steps([row.completion])[0].ends)
        assert set(row.labels) <= {0, 1}
        assert row.labels[-1] == right[i], row.completion
    # sampled rollouts: one of k = 4 reaching the answer is enough
    sampled = label_steps(backend, rows, completions, 4, SamplingConfig(max_new_tokens=48, temperature=1.0))
    assert [len(x) for x in sampled["labels"]] == [len(x) for x in labels["labels"]]


def test_training_with_a_process_reward_model_as_the_step_verifier(tmp_path, cold_start):
    labelled = label_worked_solutions(generate_problems(TASK, 64, "train"))
    prm = train_prm(labelled, RewardModelConfig(model=SMALL, max_steps=5, batch_size=16, mixed_precision="no"),
                    tmp_path / "prm")
    model, tok = load_model_and_tokenizer(ModelConfig(name_or_path=str(cold_start)))
    prompts = rl_rows(generate_problems(TASK, 8, "train"))
    cfg = GRPOConfig(max_steps=1, prompts_per_step=2, num_generations=4, checkpoint_every=0, beta=0.0,
                     sampling=SamplingConfig(max_new_tokens=48), supervision="process", step_verifier="prm",
                     prm_path=str(prm.model_dir), mixed_precision="no")
    seen = {}
    trainer = GRPOTrainer(model, tok, prompts, cfg, tmp_path / "grpo", progress=False,
                          on_metrics=lambda step, m: seen.__setitem__(step, m),
                          step_verifiers={"prm": prm_step_verifier(prm.model_dir)})
    trainer.train()
    # the PRM's step rewards are probabilities, not the rule's 0/1
    assert 0.0 < seen[1]["process/step_accuracy"] < 1.0
    assert seen[1]["process/steps_per_completion"] > 0.5
