"""An evaluation made once: a stage that scores a checkpoint another stage has scored the same way reads its figures.

A stage that evaluates the checkpoint it has just made records the evaluation on its run (a tag per key: the
figures and where its samples table is). The next stage scores that checkpoint again before it trains (reasoning
GRPO's `eval_before`, say): where the checkpoint's run holds a record under the same key, its figures and samples
table are logged to the new run as they are, with the run they came from (`r1.eval_reused.step_<n>`), and the
model is not loaded at all.

The key is everything that decides the figures: the checkpoint's URI, the held-out rows scored (the content of the
columns the evaluation reads), the greedy pass's settings (`max_new_tokens`, `batch_size`, `step_verifier`), the
code sandbox's limits, the generation engine's settings, how the model is loaded (dtype, attention, remote code)
and whether CUDA scores it. The k samples' settings (`num_samples`, `temperature`) join the key where the
evaluation samples; an evaluation that samples nothing reads the greedy figures of one that did.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

import pandas as pd

from grpo.configs.code import CodeConfig
from grpo.configs.model import ModelConfig
from grpo.configs.sampling import EvalConfig, GenerationConfig
from grpo.rewards.correct import CHECK_COLUMNS
from runtime import tracking

TAG = "r1.eval."
SAMPLED = ("eval/sample_accuracy", "eval/pass_at_k")  # what the k samples give; the rest is the greedy pass's


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def eval_keys(checkpoint_uri: str, model_cfg: ModelConfig, rows: pd.DataFrame, cfg: EvalConfig,
              code: CodeConfig | None, generation: GenerationConfig, cuda: bool) -> tuple[str, str]:
    """The keys of an evaluation's greedy pass and of the whole of it (one and the same where it samples nothing)."""
    scored = rows.head(cfg.num_prompts) if cfg.num_prompts else rows
    scored = scored[[c for c in ("prompt", *CHECK_COLUMNS) if c in scored.columns]]  # what the evaluation reads
    greedy = {"checkpoint": checkpoint_uri, "rows": _digest(scored.to_json(orient="records")),
              "load": model_cfg.model_dump(mode="json", include={"dtype", "attn_implementation", "trust_remote_code"}),
              "eval": cfg.model_dump(mode="json", include={"max_new_tokens", "batch_size", "step_verifier"}),
              "code": (code or CodeConfig()).model_dump(mode="json"), "generation": generation.model_dump(mode="json"),
              "cuda": cuda}
    if not cfg.num_samples:
        key = _digest(greedy)
        return key, key
    whole = {**greedy, "sampled": cfg.model_dump(mode="json", include={"num_samples", "temperature"})}
    return _digest(greedy), _digest(whole)


def _run_of(checkpoint_uri: str) -> str | None:
    return checkpoint_uri[len("runs:/"):].split("/", 1)[0] if checkpoint_uri.startswith("runs:/") else None


def record(run_id: str, checkpoint_uri: str, keys: tuple[str, str], metrics: dict[str, float],
           samples_file: str) -> None:
    """Keep an evaluation of the run's own checkpoint on the run, for the stages after it (another run's is left
    alone: nothing is written to a run this stage did not make)."""
    if _run_of(checkpoint_uri) != run_id:
        return
    greedy, whole = keys
    tags = {TAG + whole: json.dumps({"metrics": metrics, "samples": samples_file})}
    if greedy != whole:
        tags[TAG + greedy] = json.dumps({"metrics": {k: v for k, v in metrics.items() if k not in SAMPLED},
                                         "samples": samples_file})
    tracking.set_tags(run_id, tags)


def earlier(checkpoint_uri: str, keys: tuple[str, str]) -> tuple[str, dict] | None:
    """The run that made `checkpoint_uri` and its record of the same evaluation, if it holds one."""
    from mlflow.exceptions import MlflowException

    source = _run_of(checkpoint_uri)
    if source is None:
        return None
    try:
        tags = tracking.client().get_run(source).data.tags
    except MlflowException:
        return None
    value = tags.get(TAG + keys[1])
    return (source, json.loads(value)) if value else None


def reuse(run_id: str, step: int, source: str, found: dict, samples_file: str) -> dict[str, float]:
    """Log the earlier evaluation's figures and samples table to `run_id` at `step`; its figures."""
    metrics = {k: float(v) for k, v in found["metrics"].items()}
    tracking.MetricsLogger(run_id)(step, metrics)
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tracking.download(f"runs:/{source}/{found['samples']}", dst=tmp))
        table = json.loads(local.read_text())
    tracking.log_table(run_id, pd.DataFrame(table["data"], columns=table["columns"]), samples_file)
    tracking.set_tags(run_id, {f"r1.eval_reused.step_{step}": source})
    return metrics
