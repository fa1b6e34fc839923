"""Task: score a checkpoint on held-out prompts and log the figures and a table of completions."""

from __future__ import annotations

import torch
from prefect import task
from prefect.logging import get_run_logger

from grpo.configs.code import CodeConfig
from grpo.configs.model import ModelConfig
from grpo.configs.sampling import EvalConfig, GenerationConfig
from grpo.evaluate import evaluate
from grpo.models import load_model_and_tokenizer
from grpo.sampling.engines import build_engine
from runtime import eval_reuse, tracking
from runtime.stage import resolve_model
from tasks.data import read_frame


@task(name="evaluate_model")
def evaluate_model(run_id: str, checkpoint_uri: str, model_cfg: ModelConfig, heldout_uri: str, cfg: EvalConfig,
                   step: int = 0, code: CodeConfig | None = None,
                   generation: GenerationConfig = GenerationConfig()) -> dict[str, float]:
    """Load the checkpoint back with from_pretrained, score it on the held-out rows, log metrics and samples.
    Rows with tests run in the sandbox under `code` (the stage's grpo.grading.code; default limits when None);
    completions come from the stage's engine (`generation`). Where the run that made the checkpoint scored it the same
    way (runtime.eval_reuse), its figures and samples are logged instead, without loading the model."""
    rows, samples_file = read_frame(heldout_uri), f"eval/samples_step_{step}.json"
    keys = eval_reuse.eval_keys(checkpoint_uri, model_cfg, rows, cfg, code, generation, torch.cuda.is_available())
    found = eval_reuse.earlier(checkpoint_uri, keys)
    if found is not None:  # the stage that made the checkpoint scored it the same way: its figures, not again
        metrics = eval_reuse.reuse(run_id, step, *found, samples_file)
        get_run_logger().info("held-out at step %d, as run %s scored the same checkpoint the same way: %s", step,
                              found[0], ", ".join(f"{k}={v:.3f}" for k, v in metrics.items()))
        return metrics
    model, tokenizer = load_model_and_tokenizer(resolve_model(model_cfg, checkpoint_uri))
    if torch.cuda.is_available():
        model = model.cuda()
    engine = build_engine(generation, model, tokenizer, who="held-out evaluation")
    result = evaluate(engine, rows, cfg, code)
    tracking.MetricsLogger(run_id)(step, result.metrics)
    tracking.log_table(run_id, result.samples, samples_file)
    eval_reuse.record(run_id, checkpoint_uri, keys, result.metrics, samples_file)
    get_run_logger().info("held-out at step %d: %s", step, ", ".join(f"{k}={v:.3f}" for k, v in result.metrics.items()))
    return result.metrics
