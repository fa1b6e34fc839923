"""An evaluation made once (runtime.eval_reuse): a stage that scores the checkpoint an earlier stage scored the same
way logs that stage's figures and samples instead of scoring again; an evaluation that samples nothing reads the
greedy figures of one that did; any setting that changes the figures, or another run's checkpoint, scores anew."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from grpo.configs.sampling import EvalConfig
from grpo.models import load_model_and_tokenizer
from runtime import tracking
from tasks.evaluate import evaluate_model
from tiny_configs import SMALL

EVAL = EvalConfig(num_prompts=4, num_samples=2, max_new_tokens=8, batch_size=4, num_logged_samples=2)


@pytest.fixture
def scored(prefect_harness, tmp_path):
    """A run that made a checkpoint and scored it (as cold start does); its id, the checkpoint's URI, the held-out
    rows' URI and the figures."""
    torch.manual_seed(0)
    model, tokenizer = load_model_and_tokenizer(SMALL)
    model.save_pretrained(tmp_path / "ckpt")
    tokenizer.save_pretrained(tmp_path / "ckpt")
    maker = tracking.start_run("eval-reuse-maker", tags={"stage": "test"})
    uri = tracking.log_dir(maker, tmp_path / "ckpt", "checkpoint")
    rows = pd.DataFrame({"prompt": [f"What is {i} + 1?" for i in range(6)], "answer": [str(i + 1) for i in range(6)]})
    heldout = tracking.log_frame(maker, rows, "heldout")
    metrics = evaluate_model(maker, uri, SMALL, heldout, EVAL, step=4)
    return maker, uri, heldout, metrics


def _stage_run(name: str) -> str:
    return tracking.start_run(name, tags={"stage": "test"})


def test_the_same_evaluation_of_an_earlier_stages_checkpoint_is_read_not_scored_again(scored, mlflow_client):
    maker, uri, heldout, metrics = scored
    assert "eval/pass_at_k" in metrics
    assert sum(k.startswith("r1.eval.") for k in mlflow_client.get_run(maker).data.tags) == 2  # whole and greedy

    later = _stage_run("eval-reuse-later")
    assert evaluate_model(later, uri, SMALL, heldout, EVAL, step=0) == metrics
    run = mlflow_client.get_run(later)
    assert run.data.tags["r1.eval_reused.step_0"] == maker
    assert run.data.metrics == pytest.approx(metrics)
    assert [a.path for a in mlflow_client.list_artifacts(later, "eval")] == ["eval/samples_step_0.json"]
    assert not any(k.startswith("r1.eval.") for k in run.data.tags)  # another run's checkpoint: no record of its own

    greedy_only = _stage_run("eval-reuse-greedy")  # samples nothing: the greedy figures of the one that sampled
    got = evaluate_model(greedy_only, uri, SMALL, heldout, EVAL.model_copy(update={"num_samples": 0}), step=0)
    assert got == {k: v for k, v in metrics.items() if k not in ("eval/sample_accuracy", "eval/pass_at_k")}
    assert mlflow_client.get_run(greedy_only).data.tags["r1.eval_reused.step_0"] == maker


@pytest.mark.parametrize("change", [{"max_new_tokens": 6}, {"temperature": 0.5}, {"num_prompts": 3}])
def test_a_setting_that_changes_the_figures_scores_anew(scored, mlflow_client, change):
    maker, uri, heldout, metrics = scored
    fresh = _stage_run("eval-reuse-fresh")
    got = evaluate_model(fresh, uri, SMALL, heldout, EVAL.model_copy(update=change), step=0)
    assert "r1.eval_reused.step_0" not in mlflow_client.get_run(fresh).data.tags
    assert got.keys() == metrics.keys()
