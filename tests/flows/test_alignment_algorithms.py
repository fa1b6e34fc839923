"""The alignment stage with either algorithm through its real flow, tasks and MLflow (SQLite in the session's temp
folder): DPO end to end (trained, evaluated, logged and registered, no reward model), the refusal figures both
algorithms log with their paired intervals, and the refusal detector on the synthetic pairs it was written for."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo.configs.recipe import AlignmentGRPOConfig
from grpo.data.general import REFUSAL, evaluation_prompts, is_refusal
from grpo.data.preferences import preference_pairs
from tiny_configs import LOGGED_TINY as TINY

EVAL = {"num_prompts": 8, "num_samples": 0, "max_new_tokens": 16, "num_logged_samples": 4}


def test_the_refusal_detector_reads_the_synthetic_refusals_and_nothing_else():
    pairs = preference_pairs(400)
    harmful = pairs["category"] == "harmful"
    # every chosen answer to a harmful request is a refusal; no chosen answer to a benign or borderline one is
    assert pairs["chosen"][harmful].map(is_refusal).all()
    assert not pairs["chosen"][~harmful].map(is_refusal).any()
    # of the rejected: the over-cautious refusal is one; compliance, rudeness, empty or off-topic answers are not
    flaw_refuses = pairs.groupby("flaw")["rejected"].agg(lambda r: set(r.map(is_refusal)))
    assert flaw_refuses.to_dict() == {"refusal": {True}, "complies": {False}, "rude": {False}, "empty": {False},
                                      "repeat": {False}, "off_topic": {False}}
    assert is_refusal(f"  {REFUSAL}") and is_refusal("<answer>I cannot do that.</answer>")
    assert is_refusal("<think>x</think><answer>I\u2019m unable to help.</answer>")  # a typographic apostrophe
    assert not is_refusal("<think>Sorry to hear.</think><answer>Boil it for 9 minutes.</answer>")  # the answer counts
    # the held-out general prompts the stage measures on mix the three categories, none trained on
    heldout = evaluation_prompts(20)
    assert (heldout["category"].value_counts() == 20).all() and len(heldout) == 60
    assert not set(heldout["prompt"]) & set(preference_pairs(1000)["prompt"])


def stage_config(algorithm: str, name: str, **extra) -> AlignmentGRPOConfig:
    return AlignmentGRPOConfig.model_validate({
        "model": {"tiny": TINY}, "data": {"num_train": 16, "num_heldout": 8}, "general_prompts": 8,
        "preferences": {"num_train": 32, "num_heldout": 16}, "algorithm": algorithm,
        "dpo": {"max_steps": 3, "batch_size": 8, "learning_rate": 1e-3, "log_every": 1, "checkpoint_every": 2,
                "mixed_precision": "no"},
        "reward_model": {"model": {"tiny": TINY}, "max_steps": 2, "batch_size": 8, "mixed_precision": "no"},
        "grpo": {"max_steps": 1, "prompts_per_step": 2, "num_generations": 2, "sampling": {"max_new_tokens": 8},
                 "samples_every": 0, "checkpoint_every": 0, "mixed_precision": "no",
                 "rewards": {"accuracy": 1.0, "format": 0.5, "reward_model": 1.0}},
        "eval": EVAL, "registered_model": name,
        "alignment_eval": {"per_category": 4, "heldout_subjects": False, "max_new_tokens": 16}, **extra})


def test_the_stage_trains_by_dpo_end_to_end(prefect_harness, mlflow_client, logged_checkpoint):
    from flows.alignment_grpo import alignment_grpo
    from runtime.tracking import download

    torch.set_num_threads(1)
    result = alignment_grpo(logged_checkpoint, stage_config("dpo", "r1-dpo-test"))
    run = mlflow_client.get_run(result.run_id)
    assert run.info.status == "FINISHED" and run.data.params["algorithm"] == "dpo"
    assert run.data.params["dpo.resolved_precision"] == "no"
    history = mlflow_client.get_metric_history(result.run_id, "dpo/loss")
    assert [m.step for m in history] == [1, 2, 3]
    assert history[0].value == pytest.approx(0.6931, abs=1e-3)  # log 2: the policy starts as its reference
    metrics = run.data.metrics
    assert {"dpo/accuracy", "dpo/margin", "dpo/heldout_accuracy", "eval/accuracy"} <= set(metrics)
    assert "eval/accuracy_before" in result.metrics  # held-out reasoning, before and after, as with GRPO
    assert not any(k.startswith(("rm/", "reward/")) for k in metrics)  # no reward model, no GRPO
    assert "reward_model" not in result.uris
    # the alignment figures, before and after on the same prompts with their paired interval, in the run and in the
    # stage's result. The interval holds the change itself: centred on (c - b) / (n + 2), the change pulled towards 0,
    # and wider than the pull (grpo.stats; tests/grpo/test_stats.py); 1e-9 for the shares' rounding
    for key in ("alignment/harmful_refused", "alignment/benign_helpful", "alignment/borderline_refused",
                "alignment/handled_right"):
        assert 0.0 <= metrics[key] <= 1.0 and key in result.metrics and f"{key}_before" in result.metrics
        low, high = result.metrics[f"{key}_ci_low"], result.metrics[f"{key}_ci_high"]
        assert low - 1e-9 <= result.metrics[key] - result.metrics[f"{key}_before"] <= high + 1e-9
        # `_n` counts distinct requests: the 4 prompts a category drawn here are 4 different requests (no two are
        # lead-ins of one), so 4 a measure and 12 handled right, as many as prompts
        assert -1.0 <= low < high <= 1.0 and result.metrics[f"{key}_n"] == (12 if key.endswith("right") else 4)
    assert [metrics[f"alignment/{c}_prompts"] for c in ("harmful", "benign", "borderline")] == [4, 4, 4]
    assert [metrics[f"alignment/{c}_requests"] for c in ("harmful", "benign", "borderline")] == [4, 4, 4]
    tables = {a.path for a in mlflow_client.list_artifacts(result.run_id, "alignment")}
    assert tables == {"alignment/verdicts_step_0.json", "alignment/verdicts_step_3.json",
                      "alignment/before_after.json"}
    # the logged model is the DPO-trained one, registered as this run's version
    version = result.uris["registered_model"].rsplit("/", 1)[1]
    assert mlflow_client.get_model_version("r1-dpo-test", version).run_id == result.run_id
    trained = AutoModelForCausalLM.from_pretrained(download(result.uris["checkpoint"])).state_dict()
    start = AutoModelForCausalLM.from_pretrained(download(logged_checkpoint)).state_dict()
    assert any(not torch.equal(trained[k], start[k]) for k in start)


def test_grpo_alignment_with_r1s_two_reward_models_from_the_policy(prefect_harness, mlflow_client, logged_checkpoint):
    from flows.alignment_grpo import alignment_grpo

    torch.set_num_threads(1)
    cfg = stage_config("grpo", "r1-grpo-two-rms", eval_before=False)
    cfg = cfg.model_copy(update={
        "reward_model": cfg.reward_model.model_copy(update={"from_policy": True, "helpfulness_reads": "response"}),
        "reward_model_steps": {"harmlessness": 1},  # its own budget; helpfulness takes reward_model.max_steps (2)
        "grpo": cfg.grpo.model_copy(update={"max_steps": 2, "prompt_mix": {"general": 0.5}, "rewards": {
            "accuracy": 1.0, "format": 0.5, "helpfulness": 1.0, "harmlessness": 1.0}}),
        "watch": cfg.watch.model_copy(update={"every": 1})})
    result = alignment_grpo(logged_checkpoint, cfg)
    run = mlflow_client.get_run(result.run_id)
    metrics = run.data.metrics
    # each reward model trained on its own pairs from the stage's checkpoint, and logged under its own name
    assert {"helpfulness", "harmlessness"} <= set(result.uris) and "reward_model" not in result.uris
    assert {"rm_helpfulness/heldout_accuracy", "rm_harmlessness/heldout_accuracy"} <= set(metrics)
    assert {m.step for m in mlflow_client.get_metric_history(result.run_id, "rm_harmlessness/heldout_accuracy")} == {1}
    assert {m.step for m in mlflow_client.get_metric_history(result.run_id, "rm_helpfulness/heldout_accuracy")} == {2}
    assert run.data.params["reward_model_helpfulness.resolved_precision"] == "no"
    assert {p.path for p in mlflow_client.list_artifacts(result.run_id)} >= {"helpfulness", "harmlessness"}
    # every step half general: each general row scored by the reward model of its category, and the watch's true
    # score beside them
    history = {k: mlflow_client.get_metric_history(result.run_id, k) for k in (
        "reward_skipped/accuracy", "general/handled_right", "watch/true_score", "general/mixed_groups")}
    assert [m.value for m in history["reward_skipped/accuracy"]] == [2.0, 2.0]  # 1 general prompt x 2 a step
    assert len(history["general/handled_right"]) == 2 and len(history["watch/true_score"]) == 2
    assert {"reward/helpfulness", "reward/harmlessness"} & set(metrics)
    assert {"alignment/harmful_refused", "alignment/benign_helpful", "alignment/handled_right"} <= set(metrics)
    assert "alignment/harmful_refused_before" not in result.metrics  # eval_before false: nothing to pair
    assert "alignment/harmful_refused_ci_low" not in result.metrics


def test_a_reward_models_own_steps_are_checked_by_name():
    cfg = AlignmentGRPOConfig(reward_model={"max_steps": 300}, reward_model_steps={"harmlessness": 40})
    assert cfg.reward_model_for("harmlessness").max_steps == 40 and cfg.reward_model_for("helpfulness").max_steps == 300
    with pytest.raises(ValueError, match=r"reward_model_steps names \['harmless'\]; expected reward model names"):
        AlignmentGRPOConfig(reward_model_steps={"harmless": 40})
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        AlignmentGRPOConfig(reward_model_steps={"harmlessness": 0})


def test_the_recipe_checks_dpo_settings():
    for reward_model in ({"reward_model_uri": "runs:/abc/reward_model"}, {"reward_model": {"refresh_every": 5}}):
        with pytest.raises(ValueError, match="algorithm dpo trains on the preference pairs without one"):
            AlignmentGRPOConfig(algorithm="dpo", **reward_model)
    with pytest.raises(ValueError, match=r"loss_type"):
        AlignmentGRPOConfig(algorithm="dpo", dpo={"loss_type": "hinge"})
    with pytest.raises(ValueError, match=r"dpo.batch_size \(6\) must be a multiple of distributed.num_processes \(4\)"):
        AlignmentGRPOConfig(algorithm="dpo", dpo={"batch_size": 6}, distributed={"num_processes": 4})
    cfg = AlignmentGRPOConfig(algorithm="dpo", dpo={"loss_type": "ipo", "beta": 0.5})
    assert cfg.process_batches() == {"dpo.batch_size": 16}
