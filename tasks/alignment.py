"""Tasks of the alignment stage: the reward model and the mixed prompt set, DPO in their place (`algorithm: dpo`),
and the refusal figures every algorithm logs (registering the final model and promoting it: `tasks.promotion`)."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.logging import get_run_logger

from grpo.configs.grading import REWARD_MODEL
from grpo.configs.model import ModelConfig
from grpo.configs.recipe import AlignmentGRPOConfig
from grpo.configs.reward import REWARD_MODELS
from grpo.data.general import alignment_eval_sets, general_prompts
from grpo.data.preferences import alignment_prompts, load_preference_data, pairs_for
from grpo.data.tables import load_rl_data, read_table, validate_rows
from grpo.training.launchers import launch
from grpo.training.jobs import DPOJob, RewardModelJob, run, write_frame
from grpo.training.loops.reward_model import RewardModelResult
from runtime import cluster, tracking
from runtime.durable import durable_resume
from runtime.progress import TrainingProgress
from runtime.stage import resolve_model, resolve_precision, work_dir
from tasks.data import DataURIs, report_dropped


@task(name="prepare_alignment_prompts")
def prepare_alignment_prompts(run_id: str, cfg: AlignmentGRPOConfig) -> DataURIs:
    """Reasoning prompts (answer: rule rewards) mixed with general ones (kind=general: the reward model)."""
    reasoning, heldout = load_rl_data(cfg.data)
    if cfg.general_source == "synthetic":
        general = general_prompts(cfg.general_prompts, seed=cfg.data.task.seed)
    else:
        general = validate_rows(read_table(cfg.general_source), {"prompt": "text or chat messages"},
                                cfg.general_source).iloc[: cfg.general_prompts]
        extra = [c for c in ("category", "reference") if c in general.columns]  # routing and the true score
        general = general.assign(kind="general")[["prompt", "kind", *extra]]
    rows = alignment_prompts(reasoning, general)
    source = cfg.data.source if cfg.data.source != "synthetic" else f"synthetic:{cfg.data.task.model_dump_json()}"
    tracking.log_dataset(run_id, rows, name="alignment_prompts", source=f"{source}+general:{cfg.general_source}",
                         context="training")
    train_uri = tracking.log_frame(run_id, rows, "dataset/train")
    heldout_uri = tracking.log_frame(run_id, heldout, "dataset/heldout") if heldout is not None else None
    get_run_logger().info("alignment prompts: %d reasoning + %d general", len(reasoning), len(general))
    report_dropped(run_id, cfg.data, reasoning, heldout)
    return DataURIs(train_uri, heldout_uri)


def reward_model_names(cfg: AlignmentGRPOConfig) -> list[str]:
    """The reward models the stage's GRPO reads: those of REWARD_MODELS its rewards name."""
    return [name for name in REWARD_MODELS if name in cfg.grpo.rewards]


def metrics_prefix(name: str) -> str:
    """Where a reward model's figures go: `rm/` for the one reward model, `rm_<name>/` for each of R1's two."""
    return "rm" if name == REWARD_MODEL else f"rm_{name}"


@task(name="train_reward_model")
def train_reward_model_task(run_id: str, cfg: AlignmentGRPOConfig, name: str = REWARD_MODEL,
                            checkpoint_uri: str | None = None) -> str:
    """Fit the reward model `name` on its preference pairs (Bradley-Terry; `pairs_for`), from the stage's starting
    checkpoint with `reward_model.from_policy`; log its figures under `metrics_prefix(name)`; return its URI. A
    model the recipe gives (`reward_model_uris`, `reward_model_uri`) is returned as it is."""
    given = cfg.reward_model_uris.get(name) or (cfg.reward_model_uri if name == REWARD_MODEL else None)
    if given:
        return given
    pairs, heldout = load_preference_data(cfg.preferences)
    answer_only = cfg.reward_model.helpfulness_reads == "answer"
    pairs = pairs_for(pairs, name, cfg.preferences.source, answer_only)
    heldout = pairs_for(heldout, name, "the held-out pairs", answer_only) if heldout is not None else None
    launch.check_splits(cfg.distributed, reward_model__batch_size=cfg.reward_model.batch_size)
    ray_address = cluster.check_training_cluster(cfg.distributed, "alignment_grpo")  # None: this machine's
    tracking.log_dataset(run_id, pairs.astype(str), name="preferences" if name == REWARD_MODEL else f"{name}_pairs",
                         source=cfg.preferences.source, context=metrics_prefix(name))
    launched = launch.is_launched(cfg.distributed)
    rm_cfg = cfg.reward_model_for(name)
    if rm_cfg.from_policy:
        if checkpoint_uri is None:
            raise ValueError("reward_model.from_policy starts the reward model from the stage's checkpoint: none given")
        rm_cfg = rm_cfg.model_copy(update={"model": resolve_model(cfg.model, checkpoint_uri)})
    # its precision logged as `reward_model.*` params and its work folder `reward_model` (`reward_model_<name>` for
    # each of R1's two)
    folder = "reward_model" if name == REWARD_MODEL else f"reward_model_{name}"
    rm_cfg = resolve_precision(run_id, folder, rm_cfg)
    out = work_dir(run_id, folder, cfg.preferences, rm_cfg, *launch.resume_key(cfg.distributed),
                   root=launch.work_root(cfg.distributed))
    job = RewardModelJob(cfg=rm_cfg, rows=write_frame(pairs, out / "inputs", "rows"), source=cfg.preferences.source,
                         heldout=write_frame(heldout, out / "inputs", "heldout") if heldout is not None else None,
                         output_dir=str(out), distributed=cfg.distributed)
    logger = tracking.MetricsLogger(run_id)
    prefix = metrics_prefix(name)

    def metrics(step: int, figures: dict[str, float]) -> None:  # rm/... as rm_<name>/... for each of two models
        logger(step, {prefix + k[2:] if k.startswith("rm/") else k: v for k, v in figures.items()})

    report = launch.run_launched(job, metrics, ray_address=ray_address) if launched else run(job, metrics)
    result = RewardModelResult(**{**report, "model_dir": Path(report["model_dir"])})
    metrics(result.steps, {**result.heldout_metrics, "rm/heldout_accuracy_before": result.heldout_accuracy_before})
    get_run_logger().info("%s reward model: held-out pair accuracy %.3f (untrained %.3f)", name,
                          result.heldout_accuracy, result.heldout_accuracy_before)
    return tracking.log_dir(run_id, result.model_dir, name)


@task(name="train_dpo_model")
def train_dpo_model(run_id: str, stage: str, model_cfg: ModelConfig, checkpoint_uri: str,
                    cfg: AlignmentGRPOConfig) -> str:
    """DPO from the checkpoint on the stage's preference pairs (`algorithm: dpo`); log its figures; return the new
    checkpoint's URI."""
    pairs, heldout = load_preference_data(cfg.preferences)  # a bad file fails here, in one line, before any model
    launch.check_splits(cfg.distributed, dpo__batch_size=cfg.dpo.batch_size)
    ray_address = cluster.check_training_cluster(cfg.distributed, stage)  # None: this machine's processes
    tracking.log_dataset(run_id, pairs.astype(str), name="preferences", source=cfg.preferences.source, context="dpo")
    dpo_cfg = resolve_precision(run_id, "dpo", cfg.dpo)
    # keyed by what determines the result, so rerunning an interrupted stage resumes from its last checkpoint
    out = work_dir(run_id, stage, checkpoint_uri, model_cfg, cfg.preferences, dpo_cfg,
                   *launch.resume_key(cfg.distributed), root=launch.work_root(cfg.distributed))
    with durable_resume(run_id, out) as step:  # its newest checkpoint, wherever it ran before; copies of new ones
        if step:
            get_run_logger().info("resuming from the checkpoint at step %d in %s", step, out)
        progress = TrainingProgress(run_id, stage, dpo_cfg.max_steps)  # MLflow metrics and the Prefect progress
        model_cfg = resolve_model(model_cfg, checkpoint_uri)
        job = DPOJob(model=model_cfg, cfg=dpo_cfg, rows=write_frame(pairs, out / "inputs", "rows"),
                     heldout=write_frame(heldout, out / "inputs", "heldout") if heldout is not None else None,
                     source=cfg.preferences.source, output_dir=str(out), distributed=cfg.distributed)
        if launch.is_launched(cfg.distributed):
            report = launch.run_launched(job, progress, ray_address=ray_address)
        else:
            report = run(job, progress)
        model_dir, steps, heldout_metrics = Path(report["model_dir"]), report["steps"], report["heldout_metrics"]
    get_run_logger().info("DPO finished: %d steps, held-out pair accuracy %.3f", steps,
                          heldout_metrics["dpo/heldout_accuracy"])
    return tracking.log_dir(run_id, model_dir, "checkpoint")


@task(name="evaluate_alignment")
def evaluate_alignment(run_id: str, checkpoint_uri: str, cfg: AlignmentGRPOConfig, step: int = 0) -> dict[str, dict]:
    """The checkpoint's alignment figures on each evaluation set (`alignment_eval_sets`: held-out phrasings as
    `alignment/...`, held-out subjects as `alignment_subjects/...`, requests unlike the training ones as
    `alignment_unlike/...`, or the user's file): logged as metrics, with the per-prompt table; returns each set's
    per-prompt verdicts for the before -> after comparison."""
    import torch

    from grpo.evaluate import evaluate_alignment as measure
    from grpo.models import load_model_and_tokenizer
    from grpo.sampling.engines import build_engine

    sets = alignment_eval_sets(cfg.alignment_eval)
    model, tokenizer = load_model_and_tokenizer(resolve_model(cfg.model, checkpoint_uri))
    if torch.cuda.is_available():
        model = model.cuda()
    engine = build_engine(cfg.generation, model, tokenizer, who="alignment evaluation")
    eval_cfg = cfg.eval.model_copy(update={"max_new_tokens": cfg.alignment_eval.max_new_tokens
                                           or cfg.eval.max_new_tokens})
    out = {}
    for prefix, prompts in sets.items():
        result = measure(engine, prompts, eval_cfg, prefix=prefix)
        tracking.MetricsLogger(run_id)(step, result.metrics)
        tracking.log_table(run_id, result.samples, f"{prefix}/verdicts_step_{step}.json")
        m = result.metrics
        get_run_logger().info("%s at step %d: harmful refused %.3f, benign helpful %.3f, borderline refused %.3f, "
                              "handled right %.3f (%d prompts, %d distinct requests)", prefix, step,
                              m[f"{prefix}/harmful_refused"], m[f"{prefix}/benign_helpful"],
                              m[f"{prefix}/borderline_refused"], m[f"{prefix}/handled_right"], len(prompts),
                              result.samples["request"].nunique())
        out[prefix] = result.samples.drop(columns=["completion"]).to_dict(orient="list")
    return out


@task(name="compare_alignment")
def compare_alignment(run_id: str, before: dict[str, dict], after: dict[str, dict], step: int) -> dict[str, float]:
    """Each alignment figure before -> after on the same prompts with its paired 95% interval over distinct requests
    (grpo.stats): logged as `<figure>_ci_low`, `_ci_high`, `_p` and `_n` (the distinct requests) beside the figure,
    with a per-prompt table (prompt, request, category, right and refused before and after); returns those figures
    for the stage's summary."""
    import pandas as pd

    from grpo.evaluate import paired_alignment

    figures = {}
    for prefix in after:
        if prefix not in before:
            continue
        b, a = pd.DataFrame(before[prefix]), pd.DataFrame(after[prefix])
        changes = paired_alignment(b, a, prefix)
        for key, change in changes.items():
            figures.update({f"{key}_ci_low": change.low, f"{key}_ci_high": change.high, f"{key}_p": change.p_value,
                            f"{key}_n": float(change.n)})
            get_run_logger().info("%s: %s", key, change.describe())
        table = b[["prompt", "request", "category"]].assign(right_before=b["right"], right_after=a["right"],
                                                              refused_before=b["refused"], refused_after=a["refused"])
        tracking.log_table(run_id, table, f"{prefix}/before_after.json")
    tracking.MetricsLogger(run_id)(step, figures)
    return figures
