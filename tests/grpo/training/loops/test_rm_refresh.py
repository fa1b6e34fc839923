"""The iterative reward model (`reward_model.refresh_every`): pairs from the policy's groups ranked by the rules
first and by the reward model elsewhere, a refresh that trains on the newest samples, its state resumed from GRPO's
checkpoints, a refresh packed against padded, and the alignment stage run with it under Prefect and MLflow. Real
tiny models, fp32 pinned."""

import math
import shutil

import pandas as pd
import pytest
import torch

from comparisons import close
from grpo.configs.reward import RewardModelConfig
from grpo.configs.sampling import SamplingConfig
from grpo.configs.training import GRPOConfig
from grpo.data.general import general_prompts
from grpo.data.preferences import preference_pairs
from grpo.models import load_model_and_tokenizer
from grpo.training.loops.grpo_trainer import GRPOTrainer
from grpo.training.loops.rm_refresh import RewardModelRefresh, policy_pairs
from grpo.training.reward_scorer import RewardModelScorer, build_reward_model, reward_model_reward
from tiny_configs import SMALL

WEIGHTS = {"digits": 0.5, "reward_model": 1.0}


def table(groups: list[list[tuple]]) -> pd.DataFrame:
    """Sample rows, groups in order: (prompt, completion, digits reward or None, reward-model score or None)."""
    rows = [{"prompt": p, "completion": c, "reward/digits": d, "reward/reward_model": r}
            for group in groups for p, c, d, r in group]
    return pd.DataFrame(rows)


def test_pairs_are_ranked_by_the_rules_first_and_by_the_reward_model_with_a_margin():
    samples = table([
        [("q1", "a1", 1.0, None), ("q1", "b1", 3.0, None), ("q1", "c1", 0.0, None)],  # rules differ: b1 > c1
        [("q2", "a2", 2.0, 0.1), ("q2", "b2", 2.0, 0.9), ("q2", "c2", 0.0, 5.0)],  # rules first, whatever rm says
        [("g1", "x", None, 0.2), ("g1", "y", None, 1.5), ("g1", "z", None, 0.4)],  # no rule: rm gap 1.3 >= 0.5
        [("g2", "x", None, 0.2), ("g2", "y", None, 0.5), ("g2", "z", None, 0.4)],  # rm gap 0.3 < 0.5: no pair
        [("q3", "a3", 1.0, None), ("q3", "b3", 1.0, None), ("q3", "c3", 1.0, None)],  # a tie and no rm: no pair
        [("g3", "same", None, 0.0), ("g3", "same", None, 2.0), ("g3", "same", None, 1.0)],  # one text: nothing
    ])
    pairs = policy_pairs(samples, 3, WEIGHTS, min_margin=0.5)
    assert pairs[["prompt", "chosen", "rejected", "ranked_by"]].values.tolist() == [
        ["q1", "b1", "c1", "rule"], ["q2", "b2", "c2", "rule"], ["g1", "y", "x", "reward_model"]]
    # the rule margin is the weighted rule total's: 0.5 x (3 - 0); the reward model's its score gap
    assert pairs["margin"].tolist() == pytest.approx([1.5, 1.0, 1.3])
    only_rm = policy_pairs(samples, 3, {"reward_model": 1.0}, 0.0)  # no rule weighted: the rows the model scored
    assert only_rm[["prompt", "ranked_by"]].values.tolist() == [["q2", "reward_model"], ["g1", "reward_model"],
                                                                ["g2", "reward_model"]]


def digits(completions, kind=None, **_):
    """A rule reward on the reasoning rows: how many digits a completion holds; None on general rows."""
    return [None if k == "general" else float(sum(ch.isdigit() for ch in c)) for c, k in zip(completions, kind)]


PROMPTS = pd.concat([pd.DataFrame({"prompt": [f"Count to {i}" for i in range(4)], "kind": "reasoning"}),
                     general_prompts(4)[["prompt", "kind"]]], ignore_index=True)
REFRESH = RewardModelConfig(model=SMALL, batch_size=4, refresh_every=3, refresh_steps=3, refresh_replay=0.25,
                            refresh_min_margin=0.0, learning_rate=1e-2, seed=5)


def make(folder, seen: dict | None = None, tables: dict | None = None):
    torch.manual_seed(0)
    rm, tok = build_reward_model(SMALL)
    scorer = RewardModelScorer(rm, tok)
    refresh = RewardModelRefresh(scorer, REFRESH, WEIGHTS, 4, replay=preference_pairs(16),
                                 heldout=preference_pairs(8, split="heldout"))
    policy, tok = load_model_and_tokenizer(SMALL)
    cfg = GRPOConfig(max_steps=4, prompts_per_step=4, num_generations=4, micro_batch_size=8, beta=0.04,
                     learning_rate=1e-2, warmup_steps=0, rewards=WEIGHTS, mixed_precision="no", checkpoint_every=2,
                     samples_every=1, log_every=1, sampling=SamplingConfig(max_new_tokens=8, temperature=1.0))
    trainer = GRPOTrainer(policy, tok, PROMPTS, cfg, folder, progress=False, hooks=[refresh],
                          reward_functions={"digits": digits, "reward_model": reward_model_reward(scorer)},
                          on_metrics=lambda step, m: seen.__setitem__(step, m) if seen is not None else None,
                          on_samples=lambda step, t: tables.__setitem__(step, t) if tables is not None else None)
    return trainer, refresh


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory):
    """Four GRPO steps with the reward model refreshed after step 3; the step-2 checkpoint kept aside."""
    folder = tmp_path_factory.mktemp("refresh")
    seen, tables = {}, {}
    trainer, refresh = make(folder, seen, tables)
    before = {k: v.clone() for k, v in refresh.scorer.model.state_dict().items()}
    save = trainer._save

    def keep(root, step):  # what an interrupted run would have left
        save(root, step)
        shutil.copytree(root / f"step-{step}", folder / f"kept-step-{step}")

    trainer._save = keep
    trainer.train()
    return folder, seen, tables, refresh, before


def test_a_refresh_trains_the_reward_model_on_the_newest_samples(whole_run):
    folder, seen, tables, refresh, before = whole_run
    assert [s for s in seen if "rm/refresh_pairs" in seen[s]] == [3]  # every refresh_every=3 steps
    want = pd.concat([policy_pairs(tables[s], 4, WEIGHTS, 0.0) for s in (1, 2, 3)], ignore_index=True)
    assert refresh.last_pairs.equals(want)  # the groups of steps 1-3, from the samples the policy wrote
    assert len(want) and set(want["ranked_by"]) == {"rule", "reward_model"}  # each kind of row gave pairs
    assert seen[3]["rm/refresh_pairs"] == len(want)
    assert math.isfinite(seen[3]["rm/refresh_loss"]) and 0 <= seen[3]["rm/heldout_accuracy"] <= 1
    after = refresh.scorer.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the scorer GRPO reads was trained
    assert len(refresh.pending) == 1  # step 4's samples wait for the next refresh


def test_step_four_is_scored_by_the_refreshed_reward_model(whole_run):
    _, seen, tables, refresh, _ = whole_run
    rows = tables[4][tables[4]["reward/reward_model"].notna()]
    scores = refresh.scorer.score(rows["prompt"].tolist(), rows["completion"].tolist())
    assert rows["reward/reward_model"].tolist() == pytest.approx(scores, abs=1e-5)


def test_a_resumed_run_refreshes_and_ends_as_the_whole_run(whole_run, tmp_path):
    """From the step-2 checkpoint (the reward model's state and step 1-2's samples in it): the refresh at step 3
    sees the same pairs, and the policy and reward model end as the uninterrupted run's."""
    folder, seen, _, refresh, _ = whole_run
    shutil.copytree(folder / "kept-step-2", tmp_path / "checkpoints" / "step-2")
    again_seen = {}
    trainer, again = make(tmp_path, again_seen)
    trainer.train()
    assert sorted(again_seen) == [3, 4]
    assert again.last_pairs.equals(refresh.last_pairs)
    for key in ("rm/refresh_loss", "reward/total", "train/loss"):
        assert again_seen[3][key] == pytest.approx(seen[3][key], rel=1e-5), key
    for name, p in again.scorer.model.state_dict().items():
        torch.testing.assert_close(p, refresh.scorer.model.state_dict()[name], rtol=0, atol=1e-6)
    from transformers import AutoModelForCausalLM
    a, b = (AutoModelForCausalLM.from_pretrained(f / "model") for f in (folder, tmp_path))
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=1e-6, msg=name)


def test_a_refresh_without_the_reward_model_among_the_rewards_is_refused_when_the_recipe_is_read():
    from grpo.configs.recipe import AlignmentGRPOConfig

    with pytest.raises(ValueError, match="reward_model.refresh_every trains the reward model further .* does not "
                                         "name 'reward_model'"):
        AlignmentGRPOConfig.model_validate({"reward_model": {"refresh_every": 2},
                                            "grpo": {"rewards": {"accuracy": 1.0}}})


@pytest.fixture
def one_thread():
    """Where numbers are compared: one thread, so each sum is taken in one order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_packed_refresh_matches_the_padded_one(one_thread):
    """One refresh (3 steps of 4 pairs, one a batch replayed) with each batch's sequences packed into one row, and
    padded: the same gradients at every step (clipped, as the optimizer reads them), the same loss and accuracy,
    and the same weights after, to fp32 rounding. Completions of uneven lengths, so the padded batches pad."""
    samples = table([
        [("Count to 3", "1 2 3", 3.0, 0.1), ("Count to 3", "one, then two", 0.0, 0.2),
         ("Count to 3", "1", 1.0, 0.3), ("Count to 3", "12, 3, and on to 45 and 678", 8.0, 0.4)],
        [("Say hi", "hi", None, 0.9), ("Say hi", "hello there, how are you today?", None, -0.4),
         ("Say hi", "hey", None, 0.1), ("Say hi", "greetings", None, 0.2)],
        [("Count to 2", "1 2", 2.0, None), ("Count to 2", "two", 0.0, None),
         ("Count to 2", "1 and 2", 2.0, None), ("Count to 2", "a long way round to 1 then 2, then 3", 3.0, None)],
    ])
    cfg = REFRESH.model_copy(update={"refresh_every": 1, "learning_rate": 1e-3})
    runs = {}
    for packing in (False, True):
        torch.manual_seed(0)
        rm, tok = build_reward_model(SMALL)
        with torch.no_grad():  # a fresh head scores near 0 everywhere: make the scores differ
            rm.score.weight.mul_(20.0)
        refresh = RewardModelRefresh(RewardModelScorer(rm, tok), cfg.model_copy(update={"packing": packing}),
                                     WEIGHTS, 4, replay=preference_pairs(16))
        assert refresh.packed is packing
        before = {k: v.clone() for k, v in rm.state_dict().items()}
        grads = []
        refresh.optimizer.register_step_pre_hook(
            lambda *_: grads.append([p.grad.clone() for p in rm.parameters()]))
        metrics = refresh.after_step(1, samples)
        runs[packing] = metrics, grads, {k: v.clone() for k, v in rm.state_dict().items()}
    (padded, g_padded, w_padded), (packed, g_packed, w_packed) = runs[False], runs[True]
    assert packed["rm/refresh_pairs"] == padded["rm/refresh_pairs"] == 3
    assert packed["rm/refresh_loss"] == pytest.approx(padded["rm/refresh_loss"], rel=1e-5)
    assert packed["rm/refresh_accuracy"] == padded["rm/refresh_accuracy"]
    assert len(g_packed) == len(g_padded) == cfg.refresh_steps
    for step, (a, b) in enumerate(zip(g_packed, g_padded)):
        assert all(close(x, y, 1e-4) for x, y in zip(a, b)), step
    # AdamW divides each gradient by its own size: a rounding-sized difference in a near-zero gradient moves its
    # weight by a share of the learning rate (1e-3), not of the gradient: at most 2% of it
    apart = {n: (w_packed[n] - w).abs().max().item() for n, w in w_padded.items()}
    assert max(apart.values()) <= 2e-5, apart
    assert all((w_padded[n] - w).abs().max() > 1e-4 for n, w in before.items())  # the refresh moved every weight


@pytest.mark.parametrize("distributed", [{}, {"num_processes": 2}], ids=["one", "launched-2"])
def test_the_alignment_stage_refreshes_its_reward_model(prefect_harness, mlflow_client, tmp_path, distributed):
    """`reward_model.refresh_every: 1` in the stage's section: the task trains the stage's reward model on each
    step's samples, replaying the stage's preference pairs, and logs the refresh's figures at the GRPO steps; in
    the task's process or in two launched ones (the job carries the settings and the pairs; each process refreshes
    its own copy on every process's samples)."""
    from flows.alignment_grpo import alignment_grpo
    from grpo.configs.recipe import AlignmentGRPOConfig

    model, tok = load_model_and_tokenizer(SMALL)
    start = tmp_path / "start"
    model.save_pretrained(start)
    tok.save_pretrained(start)
    cfg = AlignmentGRPOConfig.model_validate({
        "model": SMALL.model_dump(), "data": {"num_train": 16, "num_heldout": 8}, "general_prompts": 8,
        "eval_before": False, "preferences": {"num_train": 32, "num_heldout": 16},
        "reward_model": {"model": SMALL.model_dump(), "max_steps": 3, "batch_size": 8, "mixed_precision": "no",
                         "refresh_every": 1, "refresh_steps": 2, "refresh_min_margin": 0.0},
        "grpo": {"max_steps": 2, "prompts_per_step": 4, "num_generations": 4, "sampling": {"max_new_tokens": 16},
                 "checkpoint_every": 0, "mixed_precision": "no",
                 "rewards": {"accuracy": 1.0, "format": 0.5, "reward_model": 1.0}},
        "eval": {"num_prompts": 8, "num_samples": 0, "max_new_tokens": 16, "num_logged_samples": 2},
        "registered_model": "r1-refresh", "distributed": distributed,
    })
    result = alignment_grpo(str(start), cfg)
    run = mlflow_client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["reward_model.refresh_every"] == "1"
    history = {key: {m.step: m.value for m in mlflow_client.get_metric_history(result.run_id, key)}
               for key in ("rm/refresh_pairs", "rm/refresh_loss", "rm/heldout_accuracy")}
    assert sorted(history["rm/refresh_pairs"]) == [1, 2]  # a refresh after every step
    trained = [s for s in (1, 2) if history["rm/refresh_pairs"][s] > 0]  # a step whose groups all agree has none
    assert trained and all(s in history["rm/refresh_loss"] and s in history["rm/heldout_accuracy"] for s in trained)
    # the refreshed reward model is logged beside the one trained before GRPO, and loads as a scorer
    from runtime.tracking import download

    refreshed = RewardModelScorer.from_pretrained(download(f"runs:/{result.run_id}/reward_model_refreshed",
                                                           tmp_path / "refreshed"))
    first = RewardModelScorer.from_pretrained(download(result.uris["reward_model"], tmp_path / "first"))
    pair = (["Give me a tip for sleep."], ["<think>Sleep.</think><answer>Keep a regular bedtime.</answer>"])
    assert refreshed.score(*pair) != first.score(*pair)
