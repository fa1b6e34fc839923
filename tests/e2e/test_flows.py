"""Stage and pipeline flows under a real Prefect test harness, logging to a real MLflow (SQLite in a temp folder)."""

import json

import pytest
import yaml
from transformers import AutoModelForCausalLM

from grpo.configs.recipe import ColdStartSFTConfig, RecipeError, apply_overrides, load_recipe
from grpo.training.precision import resolve
from tiny_configs import ALL_STAGES, TINY_GRPO, TINY_STAGE


@pytest.fixture
def recipe_file(tmp_path):
    path = tmp_path / "test.yaml"
    path.write_text(yaml.safe_dump(ALL_STAGES))
    return path


@pytest.fixture(scope="module")
def cold_start(prefect_harness):
    from flows.cold_start_sft import cold_start_sft

    auto = {**TINY_STAGE, "train": {**TINY_STAGE["train"], "mixed_precision": "auto"}}  # what the tiny recipe says
    return cold_start_sft(ColdStartSFTConfig.model_validate(auto))


@pytest.mark.precision
def test_cold_start_stage_tracks_everything(cold_start, mlflow_client, tmp_path):
    result = cold_start
    run = mlflow_client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["stage"] == "cold_start_sft"
    assert "prefect.flow_run_id" in run.data.tags
    assert run.data.params["train.max_steps"] == "4" and run.data.params["model.name_or_path"] == "tiny"
    # the recipe says auto; the run says what it trained in on this machine, and why
    assert run.data.params["train.mixed_precision"] == "auto"
    resolved = resolve("auto")
    assert run.data.params["train.resolved_precision"] == resolved.precision
    assert run.data.params["train.precision_reason"] == resolved.reason
    # the GEMM library each of a linear's GEMMs ran on, and why (measured where the loop trains in fp32 on a CPU)
    assert {run.data.params[f"train.fp32_gemm.{k}"] for k in ("forward", "input_grad", "weight_grad")} <= {"mkl",
                                                                                                       "onednn"}
    assert run.data.params["train.fp32_gemm.reason"]
    losses = mlflow_client.get_metric_history(result.run_id, "train/loss")
    assert [m.step for m in losses] == [2, 4]
    for key in ("eval/accuracy", "eval/format_rate", "eval/mean_completion_length", "eval/pass_at_k"):
        assert key in run.data.metrics and key in result.metrics
    assert 0 < run.data.metrics["eval/mean_completion_length"] <= 24
    contexts = {i.tags[0].value: i.dataset.name for i in run.inputs.dataset_inputs}
    assert contexts == {"training": "sft_train", "evaluation": "heldout"}

    assert result.uris["checkpoint"] == f"runs:/{result.run_id}/checkpoint"
    from runtime.tracking import download

    model = AutoModelForCausalLM.from_pretrained(download(result.uris["checkpoint"], tmp_path / "ckpt"))
    assert model.config.num_hidden_layers == 2
    table = json.loads((download(f"runs:/{result.run_id}/eval/samples_step_4.json", tmp_path / "t")).read_text())
    assert table["columns"] == ["prompt", "answer", "completion", "correct", "formatted"] and len(table["data"]) == 4


def test_reasoning_grpo_stage_starts_from_the_cold_start_checkpoint(cold_start, mlflow_client, tmp_path):
    from flows.reasoning_grpo import reasoning_grpo
    from grpo.configs.recipe import ReasoningGRPOConfig
    from runtime.tracking import download

    ckpt = cold_start.uris["checkpoint"]
    result = reasoning_grpo(ckpt, ReasoningGRPOConfig.model_validate(TINY_GRPO))
    run = mlflow_client.get_run(result.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["stage"] == "reasoning_grpo"
    assert run.data.params["input.checkpoint_uri"] == ckpt and run.data.params["grpo.loss.beta"] == "0.04"
    for key in ("reward/accuracy", "reward/format", "reward/total", "kl", "clip_ratio", "completion_length",
                "entropy", "reward/zero_std_groups", "tokens_per_s"):
        assert [m.step for m in mlflow_client.get_metric_history(result.run_id, key)] == [1, 2], key
    # held-out accuracy before (step 0) and after (step 2) GRPO, on the same run
    assert [m.step for m in mlflow_client.get_metric_history(result.run_id, "eval/accuracy")] == [0, 2]
    assert "eval/accuracy_before" in result.metrics and "eval/accuracy" in result.metrics
    samples = json.loads(download(f"runs:/{result.run_id}/samples/step_00001.json", tmp_path / "s").read_text())
    assert {"prompt", "completion", "reward", "reward/accuracy"} <= set(samples["columns"])
    # the trained weights are the cold start's moved by two small steps (none where no group's rewards differ),
    # nearer it than the base model the cold start began from
    from grpo.configs.model import ModelConfig
    from grpo.models import load_model_and_tokenizer

    start = AutoModelForCausalLM.from_pretrained(download(ckpt, tmp_path / "cold")).state_dict()
    trained = AutoModelForCausalLM.from_pretrained(download(result.uris["checkpoint"], tmp_path / "grpo")).state_dict()
    base = load_model_and_tokenizer(ModelConfig.model_validate(TINY_GRPO["model"]))[0].state_dict()

    def distance(a, b):
        return sum(float((a[k].float() - b[k].float()).norm() ** 2) for k in b) ** 0.5

    assert trained.keys() == start.keys()
    assert distance(trained, start) < 0.1 * distance(start, base), (distance(trained, start), distance(start, base))
    model = AutoModelForCausalLM.from_pretrained(download(result.uris["checkpoint"], tmp_path / "ckpt"))
    assert model.config.num_hidden_layers == 2  # (the trainer's own tests check that GRPO moves the weights)


def test_gsm8k_rows_run_through_reasoning_grpo_by_naming_columns_and_format(cold_start, mlflow_client, gsm8k_copy,
                                                                            tmp_path):
    from gsm8k_data import gsm8k_rows
    from flows.r1_pipeline import r1_pipeline
    from runtime.tracking import download
    from tasks.data import read_frame

    # a local copy laid out as the hub's openai/gsm8k; the recipe names only its subset, columns and answer format
    data = {"source": str(gsm8k_copy), "subset": "main", "columns": {"prompt": "question"}, "answer_format": "gsm8k",
            "heldout_source": str(gsm8k_copy), "num_heldout": 4}
    recipe = tmp_path / "gsm8k.yaml"
    recipe.write_text(yaml.safe_dump({"name": "gsm8k-test", "reasoning_grpo": {**TINY_GRPO, "data": data}}))
    result = r1_pipeline(recipe=str(recipe), stages=["reasoning_grpo"],
                         from_uris={"cold_start_checkpoint": cold_start.uris["checkpoint"]})
    stage = result.stages["reasoning_grpo"]
    run = mlflow_client.get_run(stage.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["data.columns.prompt"] == "question" and run.data.params["data.answer_format"] == "gsm8k"
    train = read_frame(stage.uris["dataset"])
    rows = gsm8k_rows(20)
    assert train["prompt"].tolist() == [r["question"] for r in rows]
    assert train["answer"].tolist() == [r["answer"].rsplit("#### ", 1)[1].replace(",", "") for r in rows]
    for key in ("reward/accuracy", "reward/format", "kl"):
        assert [m.step for m in mlflow_client.get_metric_history(stage.run_id, key)] == [1, 2], key
    # held-out rows come from the test split with the same mapping: clean numbers in the evaluation table
    table = json.loads(download(f"runs:/{stage.run_id}/eval/samples_step_2.json", tmp_path / "t").read_text())
    answers = [row[table["columns"].index("answer")] for row in table["data"]]
    assert answers == [r["answer"].rsplit("#### ", 1)[1].replace(",", "") for r in gsm8k_rows(4, start=100)]
    assert "eval/accuracy_before" in stage.metrics and "eval/accuracy" in stage.metrics


def test_pipeline_nests_stages_under_one_parent(prefect_harness, mlflow_client, recipe_file):
    from flows.r1_pipeline import r1_pipeline

    # fresh: every stage trains here, though an earlier test of this session may have finished one with the same key
    result = r1_pipeline(recipe=str(recipe_file), fresh=True)
    parent = mlflow_client.get_run(result.run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["recipe"] == "test"
    assert "prefect.flow_run_id" in parent.data.tags
    assert list(result.stages) == ["cold_start_sft", "reasoning_grpo", "rejection_sampling", "sft", "alignment_grpo"]
    for name, stage in result.stages.items():
        child = mlflow_client.get_run(stage.run_id)
        assert child.info.status == "FINISHED"
        assert child.data.tags["mlflow.parentRunId"] == result.run_id
        assert child.data.tags["stage"] == name
        assert child.data.params and child.data.metrics, name
        assert mlflow_client.list_artifacts(stage.run_id), name
    # each stage started from what the one before it made
    stages = result.stages
    run = lambda name: mlflow_client.get_run(stages[name].run_id)  # noqa: E731
    assert run("reasoning_grpo").data.params["input.checkpoint_uri"] == stages["cold_start_sft"].uris["checkpoint"]
    assert run("rejection_sampling").data.params["input.checkpoint_uri"] == stages["reasoning_grpo"].uris["checkpoint"]
    assert run("sft").data.params["input.dataset_uri"] == stages["rejection_sampling"].uris["dataset"]
    assert run("alignment_grpo").data.params["input.checkpoint_uri"] == stages["sft"].uris["checkpoint"]
    # every training loop logs the precision it ran in and why (here each was asked for: fp32)
    for name, section in [("reasoning_grpo", "grpo"), ("sft", "train"), ("alignment_grpo", "grpo"),
                          ("alignment_grpo", "reward_model")]:
        params = run(name).data.params
        assert params[f"{section}.resolved_precision"] == "no", (name, section)
        assert params[f"{section}.precision_reason"] == "asked for explicitly", (name, section)
    # stage 4 starts from the base model again, not from the RL model
    assert run("sft").data.params["model.name_or_path"] == "tiny"
    assert "cold_start_sft/eval/accuracy" in parent.data.metrics
    assert "alignment_grpo/eval/accuracy" in parent.data.metrics
    # the alignment stage's policy figures, before and after, on held-out general prompts
    assert {"alignment_grpo/alignment/harmful_refused", "alignment_grpo/alignment/benign_helpful_before"} <= set(
        parent.data.metrics)
    # the parent records every URI, so a later run can start from it
    assert parent.data.tags["uri.sft_checkpoint"] == stages["sft"].uris["checkpoint"]
    # the final model is registered and its alias resolves to this run's checkpoint
    version = mlflow_client.get_model_version_by_alias("r1-test", "champion")
    assert version.run_id == stages["alignment_grpo"].run_id
    from runtime.tracking import download

    model = AutoModelForCausalLM.from_pretrained(download("models:/r1-test@champion"))
    assert model.config.num_hidden_layers == 2
    assert run("alignment_grpo").data.tags["promotion.decision"] == "promoted"  # the first version takes the alias
    # every stage run records the machine's figures while it ran
    assert all("system/cpu_utilization_percentage" in run(name).data.metrics for name in stages)

    # rerun only the last two stages from this run's artifacts: a new parent that says where it came from
    rerun = r1_pipeline(recipe=str(recipe_file), stages=["sft", "alignment_grpo"], from_run=result.run_id)
    new_parent = mlflow_client.get_run(rerun.run_id)
    assert new_parent.data.tags["from_run"] == result.run_id and list(rerun.stages) == ["sft", "alignment_grpo"]
    assert (mlflow_client.get_run(rerun.stages["sft"].run_id).data.params["input.dataset_uri"]
            == stages["rejection_sampling"].uris["dataset"])


def test_pipeline_can_start_from_an_earlier_checkpoint(cold_start, mlflow_client, recipe_file):
    from flows.r1_pipeline import r1_pipeline

    with pytest.raises(ValueError, match="reasoning_grpo needs cold_start_checkpoint"):
        r1_pipeline(recipe=str(recipe_file), stages=["reasoning_grpo"])
    with pytest.raises(ValueError, match=r"unknown stage\(s\) \['sfft'\]"):
        r1_pipeline(recipe=str(recipe_file), stages=["sfft", "alignment_grpo"])
    with pytest.raises(ValueError, match="sft needs curated_dataset"):
        r1_pipeline(recipe=str(recipe_file), stages=["sft", "alignment_grpo"])
    result = r1_pipeline(recipe=str(recipe_file), stages=["reasoning_grpo"],
                         from_uris={"cold_start_checkpoint": cold_start.uris["checkpoint"]})
    assert list(result.stages) == ["reasoning_grpo"]
    parent = mlflow_client.get_run(result.run_id)
    assert parent.data.params["from.cold_start_checkpoint"] == cold_start.uris["checkpoint"]


def test_pipeline_overrides_change_the_stage_config_and_runs_are_named_after_the_recipe(prefect_harness, mlflow_client,
                                                                                       recipe_file):
    from prefect import get_client

    from flows.r1_pipeline import r1_pipeline

    # 2 steps where the recipe says 4, and a held-out set of 16: what the stage trains and logs follows the overrides
    overrides = {"cold_start_sft.train.max_steps": 2, "cold_start_sft.data.num_heldout": 16}
    result = r1_pipeline(recipe=str(recipe_file), stages=["cold_start_sft"], overrides=overrides)
    parent = mlflow_client.get_run(result.run_id)
    child = mlflow_client.get_run(result.stages["cold_start_sft"].run_id)
    assert child.data.params["train.max_steps"] == "2" and child.data.params["data.num_heldout"] == "16"
    assert [m.step for m in mlflow_client.get_metric_history(child.info.run_id, "train/loss")] == [2]
    for recorded in (parent.data.params, parent.data.tags):
        assert recorded["override.cold_start_sft.train.max_steps"] == "2"
        assert recorded["override.cold_start_sft.data.num_heldout"] == "16"

    # the flow runs, read back from the Prefect API: the pipeline's after the recipe's name (not the file's), its
    # stage's after the stage and the recipe
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(parent.data.tags["prefect.flow_run_id"]).name == "r1-test"
        assert client.read_flow_run(child.data.tags["prefect.flow_run_id"]).name == "cold_start_sft:test"


@pytest.mark.parametrize("overrides, expected", [
    ({"cold_start_sft.train.max_stpes": 2}, r"override 'cold_start_sft\.train\.max_stpes': cold_start_sft\.train "
                                            r"has no field 'max_stpes'; did you mean 'max_steps'\?"),
    ({"cold_start_sft.train.max_steps": 0}, r"recipe 'test' with overrides: cold_start_sft\.train\.max_steps: "
                                            r"Input should be greater than or equal to 1 \(got 0\)"),
])
def test_a_bad_override_fails_the_pipeline_before_any_run(prefect_harness, mlflow_client, recipe_file, overrides,
                                                          expected):
    from flows.r1_pipeline import r1_pipeline

    def runs() -> int:
        return len(mlflow_client.search_runs([e.experiment_id for e in mlflow_client.search_experiments()]))

    before = runs()
    with pytest.raises(RecipeError, match=expected):
        r1_pipeline(recipe=str(recipe_file), stages=["cold_start_sft"], overrides=overrides)
    assert runs() == before


def test_overrides_apply_to_any_field_and_are_checked_like_a_recipe():
    recipe = load_recipe("tiny")
    changed = apply_overrides(recipe, {"reasoning_grpo.grpo.learning_rate": 2e-5, "reasoning_grpo.eval_before": False,
                                       "reasoning_grpo.grpo.rewards.format": 0.25,  # a key of a dict setting
                                       "rejection_sampling.judge.model": "checkpoint"})  # a section left out
    assert changed.reasoning_grpo.grpo.optimizer.learning_rate == 2e-5 and changed.reasoning_grpo.eval_before is False
    assert changed.reasoning_grpo.grpo.rewards["format"] == 0.25
    assert changed.rejection_sampling.judge.model == "checkpoint" and recipe.rejection_sampling.judge is None
    assert changed.cold_start_sft == recipe.cold_start_sft and apply_overrides(recipe, {}) is recipe
    with pytest.raises(RecipeError, match=r"override 'reasoning\.grpo\.beta': the recipe has no field 'reasoning'; "
                                          r"did you mean 'reasoning_grpo'\?"):
        apply_overrides(recipe, {"reasoning.grpo.beta": 0.1})
    with pytest.raises(RecipeError, match=r"reasoning_grpo\.eval_before is a setting \(bool\), not a section"):
        apply_overrides(recipe, {"reasoning_grpo.eval_before.steps": 1})
    with pytest.raises(RecipeError, match=r"reasoning_grpo: grpo\.prompts_per_step \(3\) must be a multiple of "
                                          r"distributed\.num_processes \(2\)"):  # fields that must agree, as in a file
        apply_overrides(recipe, {"reasoning_grpo.grpo.prompts_per_step": 3,
                                 "reasoning_grpo.distributed.num_processes": 2})


def test_a_bad_user_dataset_fails_the_stage_before_training(prefect_harness, mlflow_client, tmp_path):
    from flows.cold_start_sft import cold_start_sft

    bad = tmp_path / "cold.jsonl"
    bad.write_text('{"prompt": "2+2?", "completion": "4"}\n')
    cfg = ColdStartSFTConfig.model_validate({**TINY_STAGE, "data": {"source": str(bad)}})
    with pytest.raises(Exception, match=r"cold\.jsonl: missing column\(s\) \['response'\]"):
        cold_start_sft(cfg)
    failed = mlflow_client.search_runs([r.experiment_id for r in mlflow_client.search_experiments()],
                                       "tags.stage = 'cold_start_sft' and attributes.status = 'FAILED'")
    assert failed and not any(a.path == "checkpoint" for a in mlflow_client.list_artifacts(failed[0].info.run_id))


def test_recipe_errors_name_the_field(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"cold_start_sft": {"train": {"max_step": 3}}}))
    with pytest.raises(RecipeError, match=r"bad\.yaml: cold_start_sft\.train\.max_step"):
        load_recipe(path)
    with pytest.raises(RecipeError, match="known recipes"):
        load_recipe("no-such-recipe")
    assert load_recipe("tiny").name == "tiny"


def test_a_recipe_with_a_base_is_the_base_with_its_own_settings_merged_over(tmp_path):
    tiny = load_recipe("tiny")
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump({
        "base": "tiny", "name": "mine", "reasoning_grpo": {"grpo": {"max_steps": 7, "rewards": {"accuracy": 2.0}}}}))
    (tmp_path / "beside.yaml").write_text(yaml.safe_dump({"base": "mine.yaml", "sft": {"train": {"max_steps": 9}}}))
    r = load_recipe(tmp_path / "beside.yaml")  # a base by path, beside the file, itself with a base
    assert r.name == "mine" and r.sft.train.max_steps == 9 and r.reasoning_grpo.grpo.max_steps == 7
    assert r.reasoning_grpo.grpo.rewards == {"accuracy": 2.0, "format": 0.5}  # a mapping merged key by key
    # the rest is the base's
    assert r.reasoning_grpo.grpo.optimizer.learning_rate == tiny.reasoning_grpo.grpo.optimizer.learning_rate
    assert r.cold_start_sft == tiny.cold_start_sft
    (tmp_path / "loop.yaml").write_text(yaml.safe_dump({"base": "loop.yaml"}))
    with pytest.raises(RecipeError, match=r"loop\.yaml: base: 'loop\.yaml' leads back to itself"):
        load_recipe(tmp_path / "loop.yaml")
    (tmp_path / "lost.yaml").write_text(yaml.safe_dump({"base": "no-such-base"}))
    with pytest.raises(RecipeError, match="no recipe 'no-such-base'"):
        load_recipe(tmp_path / "lost.yaml")
    (tmp_path / "typo.yaml").write_text(yaml.safe_dump({"base": "tiny", "sft": {"train": {"max_step": 3}}}))
    with pytest.raises(RecipeError, match=r"typo\.yaml: sft\.train\.max_step"):
        load_recipe(tmp_path / "typo.yaml")
