"""The catalogue of mistakes a user can make, each told by the real `r1` command in one line before anything starts.

Every case runs `flows.cli.r1.main` in process against a fresh state folder and MLflow store, and checks: exit code 2,
one line on stderr naming what is wrong, no traceback, and no MLflow run made (a pipeline or stage creates one as
its first act, right after the Prefect server it runs under has started). The base recipe is small, so a case that
wrongly got through would fail fast instead of training for minutes. One case runs `r1` as a subprocess to show
that no Prefect server started either.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_workspace import fails_cleanly  # the workspace; the `ws` fixture that makes one: tests/flows/cli/conftest.py
from flows.cli.r1 import main


# ----------------------------------------------------------------------------------------------------------------
# The recipe: types, ranges, names, fields that must agree. Each is found when the recipe is read.

RECIPE_CASES = {
    "unknown field": ({"cold_start_sft__train__max_stpes": 3}, ["cold_start_sft.train.max_stpes",
                                                                 "did you mean 'max_steps'"]),
    "wrong type": ({"cold_start_sft__train__max_steps": "many"}, ["cold_start_sft.train.max_steps",
                                                                   "valid integer", "'many'"]),
    "negative steps": ({"cold_start_sft__train__max_steps": -5}, ["cold_start_sft.train.max_steps",
                                                                   "greater than or equal to 1", "-5"]),
    "zero GRPO steps": ({"reasoning_grpo__grpo__max_steps": 0}, ["reasoning_grpo.grpo.max_steps"]),
    "group of one": ({"reasoning_grpo__grpo__num_generations": 1}, ["reasoning_grpo.grpo.num_generations",
                                                                     "greater than or equal to 2"]),
    "no group": ({"reasoning_grpo__grpo__num_generations": 0}, ["num_generations", "(got 0)"]),
    "zero batch": ({"cold_start_sft__train__batch_size": 0}, ["cold_start_sft.train.batch_size"]),
    "zero sampling batch": ({"rejection_sampling__rejection__sampling": {"batch_size": 0}},
                            ["rejection_sampling.rejection.sampling.batch_size"]),
    "negative learning rate": ({"sft__train__learning_rate": -0.1}, ["sft.train.learning_rate", "greater than 0"]),
    "top_p above one": ({"reasoning_grpo__grpo__sampling": {"top_p": 1.5}}, ["reasoning_grpo.grpo.sampling.top_p"]),
    "reward typo": ({"reasoning_grpo__grpo__rewards": {"accuarcy": 1.0}}, ["unknown reward(s) ['accuarcy']",
                                                                           "'accuracy'"]),
    "reward model in stage 2": ({"reasoning_grpo__grpo__rewards": {"reward_model": 1.0}},
                                ["reasoning_grpo", "unknown reward(s) ['reward_model']"]),
    "no rewards": ({"reasoning_grpo__grpo__rewards": {}}, ["reasoning_grpo.grpo.rewards", "at least one reward"]),
    "more prompts per step than prompts": ({"reasoning_grpo__grpo__prompts_per_step": 500},
                                           ["prompts_per_step (500)", "32 training prompts"]),
    "unknown precision": ({"sft__train__mixed_precision": "bf61"}, ["sft.train.mixed_precision",
                                                                    "'auto', 'bf16', 'fp16' or 'no'"]),
    "unknown scheduler": ({"cold_start_sft__train__lr_scheduler": "cosnie"}, ["cold_start_sft.train.lr_scheduler",
                                                                              "'cosine'"]),
    "unknown loss type": ({"reasoning_grpo__grpo__loss_type": "ppo"},
                          ["reasoning_grpo.grpo.loss.loss_type", "'dr_grpo'"]),
    "completion budget over the context": ({"reasoning_grpo__grpo__sampling": {"max_new_tokens": 600}},
                                           ["reasoning_grpo.grpo.sampling.max_new_tokens (600) + the prompt",
                                            "context of 512 tokens"]),
    "sequence over the context": ({"sft__train__max_seq_len": 1024}, ["sft.train.max_seq_len (1024)", "512"]),
    "heads that do not divide": ({"cold_start_sft__model__tiny": {"hidden_size": 60, "num_attention_heads": 8}},
                                 ["cold_start_sft.model.tiny", "hidden_size (60)"]),
    "unknown task template": ({"cold_start_sft__data__task": {"templates": ["farm", "zoo"]}},
                              ["cold_start_sft.data.task.templates", "'zoo'"]),
    "unknown readability filter": ({"rejection_sampling__rejection__filters": ["tagz"]}, ["'tagz'"]),
    "no training processes": ({"cold_start_sft__distributed": {"num_processes": 0}},
                              ["cold_start_sft.distributed.num_processes", "at least 1", "(got 0)"]),
    "prompts that do not split across processes": (
        {"reasoning_grpo__distributed": {"num_processes": 4}},
        ["reasoning_grpo", "grpo.prompts_per_step (2) must be a multiple of distributed.num_processes (4)"]),
    "pairs that do not split across processes": (
        {"alignment_grpo__distributed": {"num_processes": 3}, "alignment_grpo__grpo__prompts_per_step": 3},
        ["alignment_grpo", "reward_model.batch_size (8) must be a multiple of distributed.num_processes (3)"]),
    "no such accelerate config file": ({"sft__distributed": {"num_processes": 2, "config_file": "fsdp-70b.yaml"}},
                                       ["sft: distributed.config_file", "'fsdp-70b.yaml'"]),
    "bad judge URL": ({"rejection_sampling__judge": {"backend": "http", "base_url": "localhost:8000"}},
                      ["rejection_sampling.judge.base_url", "http://"]),
    "unknown algorithm": ({"reasoning_grpo__algorithm": "ppo2"}, ["reasoning_grpo.algorithm",
                                                                  "'grpo', 'ppo' or 'online_rft'"]),
    "online RFT reading a reward the stage does not compute": (
        {"reasoning_grpo__algorithm": "online_rft", "reasoning_grpo__online_rft": {"correct_reward": "code"}},
        ["reasoning_grpo", "online_rft.correct_reward 'code' is not among grpo.rewards"]),
    "an unknown DPO loss": ({"alignment_grpo__algorithm": "dpo", "alignment_grpo__dpo__loss_type": "hinge"},
                            ["alignment_grpo.dpo.loss_type", "'sigmoid' or 'ipo'"]),
    "DPO with a reward model": ({"alignment_grpo__algorithm": "dpo",
                                 "alignment_grpo__reward_model_uri": "runs:/feedbeef/reward_model"},
                                ["alignment_grpo", "algorithm dpo trains on the preference pairs without one"]),
    "PPO discount above one": ({"reasoning_grpo__algorithm": "ppo", "reasoning_grpo__ppo__gamma": 1.5},
                               ["reasoning_grpo.ppo.gamma", "less than or equal to 1"]),
    "PPO setting misspelt": ({"reasoning_grpo__ppo__lambda": 0.9}, ["reasoning_grpo.ppo.lambda", "'lam'"]),
    "PPO with dynamic sampling": ({"reasoning_grpo__algorithm": "ppo", "reasoning_grpo__grpo__dynamic_sampling": True},
                                  ["reasoning_grpo", "algorithm ppo", "grpo.rollout.dynamic_sampling"]),
    "PPO with a schedule": ({"reasoning_grpo__algorithm": "ppo",
                             "reasoning_grpo__grpo__schedule": {"reference_every": 5}},
                            ["reasoning_grpo", "algorithm ppo", "remove grpo.schedule"]),
    "a scheduled reward the stage does not name": (
        {"alignment_grpo__grpo__schedule": {"rewards_from": {"helpfulness": 0.5}}},
        ["alignment_grpo.grpo: schedule.rewards_from", "names ['helpfulness'], which rewards does not"]),
    "a reward model's steps under an unknown name": ({"alignment_grpo__reward_model_steps": {"harmless": 40}},
                                                     ["alignment_grpo.reward_model_steps names ['harmless']"]),
    "PPO step over the prompts": ({"reasoning_grpo__algorithm": "ppo", "reasoning_grpo__grpo__prompts_per_step": 20},
                                  ["reasoning_grpo", "20 x 2 = 40 prompts a step", "32 training prompts"]),
    "process supervision without a step verifier": ({"reasoning_grpo__grpo__supervision": "process"},
                                                    ["reasoning_grpo.grpo", "needs a step_verifier"]),
    "unknown step verifier": ({"reasoning_grpo__grpo__supervision": "process",
                               "reasoning_grpo__grpo__step_verifier": "arithmatic"},
                              ["reasoning_grpo.grpo.grading.step_verifier", "'gsm8k'"]),
    "a process reward model without its path": ({"reasoning_grpo__grpo__supervision": "process",
                                                 "reasoning_grpo__grpo__step_verifier": "prm"},
                                                ["step_verifier 'prm' and prm_path go together"]),
    "the arithmetic step verifier on a user dataset": ({"reasoning_grpo__grpo__supervision": "process",
                                                        "reasoning_grpo__grpo__step_verifier": "arithmetic",
                                                        "reasoning_grpo__data__source": "gsm8k_train.jsonl"},
                                                       ["step_verifier 'arithmetic'", "use step_verifier 'gsm8k'"]),
    "process supervision with PPO": ({"reasoning_grpo__algorithm": "ppo", "reasoning_grpo__grpo__supervision": "process",
                                      "reasoning_grpo__grpo__step_verifier": "arithmetic"},
                                     ["supervision 'outcome' with ppo"]),
    "process supervision with the code reward": ({"reasoning_grpo__grpo__supervision": "process",
                                                  "reasoning_grpo__grpo__rewards": {"code": 1.0, "format": 0.5}},
                                                 ["reasoning_grpo.grpo", "supervision 'process' cannot be used with "
                                                  "the code reward", "set supervision: outcome"]),
    "a stage on a pool the recipe does not declare": ({"sft__resources": {"pool": "r1-gpu"}},
                                                      ["sft.resources.pool 'r1-gpu' is not among the recipe's pools"]),
    "more GPUs than the pool gives": ({"pools": {"r1-gpu": {"gpus": 4}},
                                       "reasoning_grpo__resources": {"pool": "r1-gpu", "gpus": 8}},
                                      ["reasoning_grpo.resources.gpus (8) is more than pool 'r1-gpu' can give"]),
    # no server at all, or (when a session's test server is the current API) a server without that pool
    "a placed stage without its pool": ({"pools": {"r1-gpu": {"gpus": 8}},
                                         "reasoning_grpo__resources": {"pool": "r1-gpu", "gpus": 8}},
                                        ["reasoning_grpo.resources.pool 'r1-gpu'"]),
    "a retry count out of range": ({"sft__resources": {"retries": 100}},
                                   ["sft.resources.retries", "less than or equal to 20"]),
    "a negative retry delay": ({"sft__resources": {"retries": 1, "retry_delays_s": [-5]}},
                               ["sft.resources.retry_delays_s", "0 to 86400 seconds"]),
    "a zero timeout": ({"sft__resources": {"timeout_s": 0}}, ["sft.resources.timeout_s", "greater than 0"]),
    "a judge with no requests in flight": ({"rejection_sampling__judge": {"backend": "http", "max_workers": 0}},
                                           ["rejection_sampling.judge.max_workers", "greater than or equal to 1"]),
    "a plan with no throughput": ({"rejection_sampling__budget": {"tokens_per_s": 0}},
                                  ["rejection_sampling.budget.tokens_per_s", "greater than 0"]),
    "process supervision in alignment": ({"alignment_grpo__grpo__supervision": "process",
                                          "alignment_grpo__grpo__step_verifier": "arithmetic"},
                                         ["alignment_grpo.grpo.grading.supervision must be 'outcome'"]),
}


@pytest.mark.parametrize("case", list(RECIPE_CASES))
def test_a_bad_recipe_is_one_line_before_anything_starts(case, ws, capsys):
    sections, expected = RECIPE_CASES[case]
    fails_cleanly(capsys, ws, ["run", "--recipe", ws.recipe(**sections)], *expected)


OVERRIDE_CASES = {
    "an unknown path": (["--set", "cold_start_sft.train.max_stpes=3"],
                        ["override 'cold_start_sft.train.max_stpes'", "no field 'max_stpes'",
                         "did you mean 'max_steps'"]),
    "a path through a setting": (["--set", "reasoning_grpo.eval_before.steps=3"],
                                 ["reasoning_grpo.eval_before is a setting (bool), not a section"]),
    "a bad value": (["--set", "reasoning_grpo.grpo.learning_rate=fast"],
                    ["with overrides", "reasoning_grpo.grpo.optimizer.learning_rate", "valid number", "'fast'"]),
    "a value the recipe's other fields reject": (["--set", "reasoning_grpo.grpo.prompts_per_step=40"],
                                                 ["prompts_per_step", "40"]),
    "no value": (["--set", "cold_start_sft.train.max_steps"], ["expected PATH=VALUE"]),
    "a value that is not YAML": (["--set", "cold_start_sft.train.max_steps=[3"], ["the value is not valid YAML"]),
}


@pytest.mark.parametrize("case", list(OVERRIDE_CASES))
def test_a_bad_override_is_one_line_before_anything_starts(case, ws, capsys):
    flags, expected = OVERRIDE_CASES[case]
    fails_cleanly(capsys, ws, ["run", "--recipe", ws.recipe(), *flags], *expected)


def test_an_unknown_recipe_lists_the_known_ones(ws, capsys):
    fails_cleanly(capsys, ws, ["run", "--recipe", "no-such-recipe"], "no recipe 'no-such-recipe'", "tiny")


def test_a_recipe_that_is_not_yaml_names_the_line(ws, capsys):
    path = ws.file("broken.yaml", "cold_start_sft:\n  train: {max_steps: 3\n")
    fails_cleanly(capsys, ws, ["run", "--recipe", path], "broken.yaml: not valid YAML at line")


@pytest.mark.parametrize("text", ["", "# only a comment\n\n   # and another\n"])
def test_an_empty_recipe_is_one_line_naming_the_file(ws, capsys, text):
    path = ws.file("empty.yaml", text)
    fails_cleanly(capsys, ws, ["run", "--recipe", path], "empty.yaml: the recipe is empty")


def test_a_recipe_that_is_not_a_mapping_says_so(ws, capsys):
    path = ws.file("list.yaml", "- cold_start_sft\n- sft\n")
    fails_cleanly(capsys, ws, ["run", "--recipe", path], "list.yaml: expected a mapping of recipe sections",
                  "got a list")


def test_fp16_without_a_gpu(ws, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: fp16 is a fine choice here")
    fails_cleanly(capsys, ws, ["run", "--recipe", ws.recipe(cold_start_sft__train__mixed_precision="fp16")],
                  "cold_start_sft.train.mixed_precision fp16 needs a CUDA GPU")



def test_a_cpu_bf16_override_that_is_neither_0_nor_1(ws, capsys, monkeypatch):
    monkeypatch.setenv("R1_CPU_BF16", "yes")
    fails_cleanly(capsys, ws, ["run", "--recipe", ws.recipe()], "R1_CPU_BF16 must be 1", "or 0", "got 'yes'")


# ----------------------------------------------------------------------------------------------------------------
# Data and models the recipe names: read (never loaded as a model) before anything starts


def test_a_missing_data_file(ws, capsys):
    recipe = ws.recipe(cold_start_sft__data={"source": str(ws.root / "cold.jsonl")})
    fails_cleanly(capsys, ws, ["run", "--recipe", recipe], "cold_start_sft.data:", "cold.jsonl: no such file")


def test_a_data_file_that_is_not_json_lines(ws, capsys):
    path = ws.file("cold.jsonl", '{"prompt": "2+2?", "response": "<think>2+2=4</think><answer>4</answer>"}\n{oops\n')
    recipe = ws.recipe(cold_start_sft__data={"source": path})
    fails_cleanly(capsys, ws, ["run", "--recipe", recipe, "--stages", "cold_start_sft"],
                  "cold.jsonl: line 2 is not valid JSON")


def test_a_data_file_without_the_column_the_stage_needs(ws, capsys):
    path = ws.jsonl("cold.jsonl", [{"prompt": "2+2?", "completion": "4"}])
    fails_cleanly(capsys, ws, ["run", "--recipe", ws.recipe(cold_start_sft__data={"source": path})],
                  "missing column(s) ['response']")


def test_a_data_file_with_an_empty_cell(ws, capsys):
    path = ws.jsonl("rl.jsonl", [{"prompt": "2+2?", "answer": "4"}, {"prompt": "3+3?", "answer": ""}])
    recipe = ws.recipe(reasoning_grpo__data={"source": path})
    fails_cleanly(capsys, ws, ["run", "--recipe", recipe, "--stages", "reasoning_grpo", "--from-run", "x"],
                  "reasoning_grpo.data:", "row 1, column 'answer'")


def test_a_gsm8k_answer_that_is_not_a_number(ws, capsys):
    from gsm8k_data import gsm8k_rows

    rows = gsm8k_rows(20)
    rows[17]["answer"] = rows[17]["answer"].rsplit("####", 1)[0] + "#### seventy"
    path = ws.jsonl("gsm.jsonl", rows)
    recipe = ws.recipe(reasoning_grpo__data={"source": path, "columns": {"prompt": "question"},
                                             "answer_format": "gsm8k"})
    fails_cleanly(capsys, ws, ["run", "--recipe", recipe, "--stages", "reasoning_grpo", "--from-run", "x"],
                  "reasoning_grpo.data:", f"{path}: row 17, column 'answer'", "got '#### seventy'")


def test_a_preference_file_with_a_tie_for_dpo(ws, capsys):
    pair = {"prompt": "Hi", "chosen": "<answer>Hello!</answer>", "rejected": "<answer>Go away.</answer>"}
    path = ws.jsonl("prefs.jsonl", [pair, {**pair, "rejected": pair["chosen"]}])
    recipe = ws.recipe(alignment_grpo__algorithm="dpo", alignment_grpo__preferences={"source": path})
    fails_cleanly(capsys, ws, ["run", "--recipe", recipe, "--stages", "alignment_grpo", "--from-run", "x"],
                  "alignment_grpo.preferences:", f"{path}: row 1, columns 'chosen' and 'rejected'")


def test_too_few_prompts_in_a_user_file_for_one_step(ws, capsys):
    path = ws.jsonl("rl.jsonl", [{"prompt": "2+2?", "answer": "4"}])
    recipe = ws.recipe(reasoning_grpo__data={"source": path, "num_heldout": 0})
    fails_cleanly(capsys, ws, ["run", "--recipe", recipe, "--stages", "cold_start_sft,reasoning_grpo"],
                  "prompts_per_step (2) is more than the 1 training prompts", "rl.jsonl")


def test_general_prompts_without_a_known_category_for_r1s_two_reward_models(ws, capsys):
    path = ws.jsonl("general.jsonl", [{"prompt": "How do I boil an egg?", "category": "benign"},
                                      {"prompt": "Hi", "category": "harmless"}])
    recipe = ws.recipe(alignment_grpo__general_source=path,
                       alignment_grpo__grpo={"max_steps": 1, "prompts_per_step": 2, "num_generations": 2,
                                             "sampling": {"max_new_tokens": 16}, "checkpoint_every": 0,
                                             "rewards": {"accuracy": 1.0, "helpfulness": 1.0, "harmlessness": 1.0}})
    fails_cleanly(capsys, ws, ["run", "--recipe", recipe], "general.jsonl: row 1, column 'category'",
                  "harmful, benign, borderline", "'harmless'")


def test_too_few_non_reasoning_rows(ws, capsys):
    path = ws.jsonl("general.jsonl", [{"prompt": "Hi", "response": "Hello"}])
    recipe = ws.recipe(rejection_sampling__non_reasoning_source=path,
                       rejection_sampling__rejection={"target_samples": 8, "non_reasoning_rows": 4})
    fails_cleanly(capsys, ws, ["run", "--recipe", recipe, "--stages", "cold_start_sft,reasoning_grpo,"
                                                                      "rejection_sampling"],
                  "rejection_sampling.non_reasoning_source", "has 1 rows", "asks for 4")


def test_a_bad_non_reasoning_row_is_named_before_anything_runs(ws, capsys):
    path = ws.jsonl("general.jsonl", [{"prompt": "Hi", "response": "Hello"}, {"prompt": "Bye", "response": ""}])
    recipe = ws.recipe(rejection_sampling__non_reasoning_source=path,
                       rejection_sampling__rejection={"target_samples": 8, "non_reasoning_rows": 2})
    fails_cleanly(capsys, ws, ["run", "--recipe", recipe, "--stages", "cold_start_sft,reasoning_grpo,"
                                                                      "rejection_sampling"],
                  "rejection_sampling.non_reasoning_source", "general.jsonl: row 1, column 'response'",
                  "expected text")


def test_held_out_code_rows_in_an_sft_stage_without_a_sandbox(ws, capsys, monkeypatch):
    from grpo.rewards import sandbox

    # the SFT stage would evaluate them by running their tests after training: refused before, not after
    path = ws.jsonl("code.jsonl", [{"text": "Write add(a, b).", "test_list": ["assert add(1, 2) == 3"]}])
    recipe = ws.recipe(cold_start_sft__data={"num_train": 64, "heldout_source": path, "num_heldout": 1,
                                             "columns": {"prompt": "text", "tests": "test_list"}})
    monkeypatch.setenv("PATH", str(ws.root))  # no bwrap on it
    sandbox._probe.cache_clear()
    try:
        fails_cleanly(capsys, ws, ["run", "--recipe", recipe, "--stages", "cold_start_sft"],
                      "cold_start_sft.data.heldout_source:", "bubblewrap (bwrap) is not installed")
    finally:
        sandbox._probe.cache_clear()


def test_a_missing_model_folder(ws, capsys):
    recipe = ws.recipe(cold_start_sft__model={"name_or_path": str(ws.root / "no-model")})
    fails_cleanly(capsys, ws, ["run", "--recipe", recipe], "cold_start_sft.model.name_or_path", "no model folder")


def test_a_model_package_that_is_not_installed_names_the_install(ws, capsys):
    recipe = ws.recipe(cold_start_sft__model={"package": "r1-no-such-models", "file": "m.gguf"})
    fails_cleanly(capsys, ws, ["run", "--recipe", recipe], "cold_start_sft.model: model package "
                  "'r1-no-such-models' is not installed", "pip install --no-deps r1-no-such-models")


def test_a_gguf_path_that_is_not_there(ws, capsys):
    recipe = ws.recipe(sft__model={"name_or_path": str(ws.root / "no-model.gguf")})
    fails_cleanly(capsys, ws, ["run", "--recipe", recipe], "sft.model: no GGUF file", "no-model.gguf")


def test_a_process_reward_model_folder_that_is_not_there(ws, capsys):
    recipe = ws.recipe(reasoning_grpo__grpo__supervision="process", reasoning_grpo__grpo__step_verifier="prm",
                       reasoning_grpo__grpo__prm_path=str(ws.root / "no-prm"))
    fails_cleanly(capsys, ws, ["run", "--recipe", recipe], "reasoning_grpo.grpo.grading.prm_path", "no model folder")


def test_a_model_folder_without_config_json(ws, capsys):
    folder = ws.model_folder("empty-model", None)
    recipe = ws.recipe(sft__model={"name_or_path": folder})
    fails_cleanly(capsys, ws, ["run", "--recipe", recipe], "sft.model.name_or_path", "has no config.json")


def test_a_completion_budget_over_a_model_folders_context(ws, capsys):
    folder = ws.model_folder("short-model", {"model_type": "qwen2", "max_position_embeddings": 64})
    recipe = ws.recipe(cold_start_sft__model={"name_or_path": folder},
                       cold_start_sft__train={"max_steps": 2, "max_seq_len": 64},
                       reasoning_grpo__grpo={"max_steps": 1, "prompts_per_step": 2, "num_generations": 2,
                                             "sampling": {"max_new_tokens": 64}})
    fails_cleanly(capsys, ws, ["run", "--recipe", recipe, "--stages", "cold_start_sft,reasoning_grpo"],
                  "reasoning_grpo.grpo.sampling.max_new_tokens (64) + the prompt", "context of 64 tokens")


# ----------------------------------------------------------------------------------------------------------------
# Stage names, run ids and URIs on the command line


def test_an_unknown_stage_in_stages(ws, capsys):
    fails_cleanly(capsys, ws, ["run", "--recipe", ws.recipe(), "--stages", "sfft,alignment_grpo"],
                  "unknown stage(s) ['sfft']", "cold_start_sft")


def test_an_unknown_stage_to_run_alone(ws, capsys):
    fails_cleanly(capsys, ws, ["stage", "no_such_stage", "--recipe", ws.recipe()], "unknown stage(s)",
                  "cold_start_sft")


def test_a_stage_without_its_input(ws, capsys):
    fails_cleanly(capsys, ws, ["stage", "reasoning_grpo", "--recipe", ws.recipe()], "needs --checkpoint")


def test_sft_alone_that_mixes_in_the_cold_start_rows_needs_them(ws, capsys):
    """An input the stage declares optional is needed after all when its section asks for it (include_cold_start)."""
    fails_cleanly(capsys, ws, ["stage", "sft", "--recipe", ws.recipe(sft__include_cold_start=True), "--dataset",
                               "runs:/0123456789abcdef0123456789abcdef/dataset/curated"],
                  "needs --input cold_start_dataset_uri=runs:/<run id>/...", "sft.include_cold_start is set")


def test_stages_whose_inputs_nothing_makes(ws, capsys):
    fails_cleanly(capsys, ws, ["run", "--recipe", ws.recipe(), "--stages", "sft,alignment_grpo"],
                  "sft needs curated_dataset", "--from-run")


def test_from_run_before_any_run_exists(ws, capsys):
    fails_cleanly(capsys, ws, ["run", "--recipe", ws.recipe(), "--stages", "sft", "--from-run", "abc123"],
                  "--from-run: no MLflow run 'abc123'", "has no runs yet")
    assert not ws.db.exists()  # the check did not create the store either


def test_from_run_with_an_unknown_run_id(ws, capsys):
    ws.client().search_experiments()  # the store exists
    fails_cleanly(capsys, ws, ["run", "--recipe", ws.recipe(), "--stages", "sft", "--from-run", "abc123"],
                  "--from-run: no MLflow run 'abc123'")


def test_from_run_with_a_stage_run_instead_of_a_pipeline_run(ws, capsys):
    from runtime import tracking

    run_id = tracking.start_run("cold_start_sft", tags={"stage": "cold_start_sft"})
    fails_cleanly(capsys, ws, ["run", "--recipe", ws.recipe(), "--stages", "sft", "--from-run", run_id],
                  f"--from-run {run_id}: the run records no stage URIs", "expected a pipeline run")


def test_a_checkpoint_uri_of_an_unknown_run(ws, capsys):
    ws.client().search_experiments()
    fails_cleanly(capsys, ws, ["stage", "reasoning_grpo", "--recipe", ws.recipe(), "--checkpoint",
                               "runs:/0123abcd/checkpoint"], "--checkpoint: no MLflow run '0123abcd'")


def test_a_checkpoint_uri_whose_run_has_no_checkpoint(ws, capsys):
    from runtime import tracking

    run_id = tracking.start_run("cold_start_sft", tags={"stage": "cold_start_sft"})
    fails_cleanly(capsys, ws, ["stage", "reasoning_grpo", "--recipe", ws.recipe(), "--checkpoint",
                               f"runs:/{run_id}/checkpoint"], f"run {run_id} has no artifact 'checkpoint'")


def test_a_checkpoint_folder_that_is_not_there(ws, capsys):
    fails_cleanly(capsys, ws, ["stage", "reasoning_grpo", "--recipe", ws.recipe(), "--checkpoint",
                               str(ws.root / "ckpt")], "ckpt: no such file or folder")


def test_a_reward_model_uri_of_an_unknown_run(ws, capsys):
    ws.client().search_experiments()
    recipe = ws.recipe(alignment_grpo__reward_model_uri="runs:/feedbeef/reward_model")
    fails_cleanly(capsys, ws, ["run", "--recipe", recipe, "--stages", "alignment_grpo", "--from-run", "x"],
                  "alignment_grpo.reward_model_uri: no MLflow run 'feedbeef'")


def test_compare_with_unknown_runs(ws, capsys):
    ws.client().search_experiments()
    fails_cleanly(capsys, ws, ["compare", "aaa", "bbb"], "RUN 1: no MLflow run 'aaa'")


# ----------------------------------------------------------------------------------------------------------------
# --debug, and what a user sees from a process of their own


def test_debug_adds_the_traceback(ws, capsys):
    recipe = ws.recipe(reasoning_grpo__grpo__num_generations=1)
    assert main(["run", "--recipe", recipe, "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("r1: ")


def test_from_a_process_of_its_own_nothing_starts(ws):
    """The command a user types: one line, exit 2, no Prefect server started, no MLflow store made."""
    recipe = ws.recipe(reasoning_grpo__grpo__rewards={"accuarcy": 1.0})
    prefect_home = ws.root / "prefect"
    env = {**os.environ, "PREFECT_HOME": str(prefect_home), "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--recipe", recipe], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "accuarcy" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr and "Starting temporary server" not in proc.stdout
    assert not list(prefect_home.rglob("*.db")) and not ws.db.exists()
