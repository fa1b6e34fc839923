"""Stage 5, alignment GRPO: make the SFT model helpful and harmless without losing its reasoning.

R1's last stage runs RL on a mix: reasoning prompts keep their rule rewards, general prompts are scored by reward
models for helpfulness (on the final summary) and harmlessness (on the whole response). Here the recipe's rewards
name either R1's two (`helpfulness` for benign and borderline prompts, on the final answer; `harmlessness` for
harmful ones, on the whole response; routed by each prompt's category) or one `reward_model` for every general
prompt, each trained in this stage on preference pairs with the Bradley-Terry loss, from the stage's own checkpoint
with `reward_model.from_policy` (or an existing one, `reward_model_uris`); `grpo.prompt_mix` sets the share of
general prompts in every step, and a watch logs their true score beside the reward models' (over-optimisation in
sight, grpo.training.alignment_watch). The held-out reasoning split is scored before and after, and the result is
logged as an MLflow model and registered as a new version; the alias (`models:/<name>@champion`) moves to it when
its held-out accuracy is at least the current holder's, on every run with `promotion: always` (`--promote`), or when
a person says so in the Prefect UI with `promotion: approve` (`tasks/promotion.py`).

With `algorithm: dpo` DPO replaces the reward model and GRPO (`grpo.training.loops.dpo`): the policy learns from the same
preference pairs directly, against the starting checkpoint as its frozen reference; evaluation, the logged model and
promotion are unchanged. Whichever algorithm trains, the stage measures its policy on held-out general prompts of known
category before and after, on the same prompts (`alignment_eval`): harmful requests refused, benign ones answered
helpfully (with what the prompt asked for), borderline ones refused (over-refusal) and the share handled right, each
change with its paired 95% interval over distinct requests, a request's lead-in copies counted once
(`grpo.evaluate.evaluate_alignment`, `grpo.stats.paired_change`); the synthetic
held-out phrasings are the headline (`alignment/...`), the held-out subjects are reported apart
(`alignment_subjects/...`).

Run alone:  r1 stage alignment_grpo --checkpoint runs:/<sft run id>/checkpoint
"""

from __future__ import annotations

from prefect import flow

from flows.stages import Stage, run_name
from grpo.configs.recipe import AlignmentGRPOConfig
from runtime.report import publish_stage_report
from runtime.stage import StageResult, stage_run
from tasks.alignment import (compare_alignment, evaluate_alignment, metrics_prefix, prepare_alignment_prompts,
                             reward_model_names, train_dpo_model, train_reward_model_task)
from tasks.evaluate import evaluate_model
from tasks.grpo import train_grpo_model
from tasks.promotion import heldout_key, promote_model, register_model, remember_for_approval, resumed_for_approval

NAME = "alignment_grpo"


# flow runs are named after the stage (`<stage>:<recipe name>` when the pipeline or `r1 stage` runs it)
@flow(name=NAME, flow_run_name=run_name(NAME), log_prints=True)
def alignment_grpo(checkpoint_uri: str, config: AlignmentGRPOConfig = AlignmentGRPOConfig(),
                   parent_run_id: str | None = None) -> StageResult:
    """GRPO from `checkpoint_uri` (the stage-4 SFT model); return the final checkpoint and its registered version."""
    resumed = resumed_for_approval(NAME)  # resumed after a person's answer: the stage's work is done
    result = resumed or _align(checkpoint_uri, config, parent_run_id)
    version = result.uris["registered_model"].rsplit("/", 1)[1]
    if config.promotion == "approve" and not resumed:
        remember_for_approval(result)
    decision = promote_model(result.run_id, config, version)  # after the stage run ends: the flow may wait here
    result = result.model_copy(update={"metrics": {**result.metrics, "promotion/promoted": float(decision.promote)}})
    publish_stage_report(result)
    return result


def _align(checkpoint_uri: str, config: AlignmentGRPOConfig, parent_run_id: str | None) -> StageResult:
    """The stage's work in its MLflow run: reward model and GRPO (or DPO), evaluation, a new registered version."""
    dpo = config.algorithm == "dpo"
    steps = config.dpo.max_steps if dpo else config.grpo.max_steps
    with stage_run(NAME, config, parent_run_id, inputs={"checkpoint_uri": checkpoint_uri}) as run_id:
        data = prepare_alignment_prompts(run_id, config)
        # the reward models GRPO reads, by reward name: one for every general prompt, or R1's two
        reward_models = {} if dpo else {name: train_reward_model_task(run_id, config, name, checkpoint_uri)
                                        for name in reward_model_names(config)}
        metrics = {}
        if config.eval_before:
            if data.heldout:
                before = evaluate_model(run_id, checkpoint_uri, config.model, data.heldout, config.eval, step=0,
                                        code=config.grpo.grading.code, generation=config.generation)
                metrics.update({f"{k}_before": v for k, v in before.items()})
            if config.alignment_eval.enabled:
                verdicts_before = evaluate_alignment(run_id, checkpoint_uri, config, step=0)
                metrics.update({f"{k}_before": v for k, v in _alignment_figures(verdicts_before).items()})
        if dpo:
            checkpoint = train_dpo_model(run_id, NAME, config.model, checkpoint_uri, config)
        else:
            checkpoint = train_grpo_model(run_id, NAME, config.model, checkpoint_uri, data.train, config.grpo,
                                          reward_models=reward_models, distributed=config.distributed,
                                          generation=config.generation,
                                          # the iterative reward model: trained further on the policy's samples
                                          refresh=config.reward_model if config.reward_model.refresh_every else None,
                                          preferences=config.preferences,
                                          watch=config.watch if config.watch.enabled else None,
                                          helpfulness_reads=config.reward_model.helpfulness_reads)
        if data.heldout:
            metrics.update(evaluate_model(run_id, checkpoint, config.model, data.heldout, config.eval,
                                          step=steps, code=config.grpo.grading.code, generation=config.generation))
        if config.alignment_eval.enabled:
            verdicts_after = evaluate_alignment(run_id, checkpoint, config, step=steps)
            metrics.update(_alignment_figures(verdicts_after))
            if config.eval_before:  # the same prompts both times: the change with its paired interval
                metrics.update(compare_alignment(run_id, verdicts_before, verdicts_after, steps))
        metrics.update(_last_logged(run_id, (*(f"{metrics_prefix(n)}/heldout_accuracy" for n in reward_models),
                                             "dpo/heldout_accuracy")))
        version = register_model(run_id, checkpoint, config, metrics.get("eval/accuracy"),
                                 heldout_key(data.heldout, config.eval))
    registered = f"models:/{config.registered_model}/{version}"  # this run's version, whatever the alias does
    uris = {"checkpoint": checkpoint, "registered_model": registered}
    uris.update(reward_models)  # reward_model, or helpfulness and harmlessness
    return StageResult(stage=NAME, run_id=run_id, metrics=metrics, uris=uris)


def _alignment_figures(verdicts: dict[str, dict]) -> dict[str, float]:
    """The alignment figures of `evaluate_alignment`'s per-prompt verdicts (what it logged), for the summary."""
    import pandas as pd

    from grpo.evaluate import alignment_metrics

    out = {}
    for prefix, table in verdicts.items():
        out.update({k: v for k, v in alignment_metrics(pd.DataFrame(table), prefix).items()
                    if not k.endswith(("_prompts", "_requests"))})
    return out


def _last_logged(run_id: str, keys: tuple[str, ...]) -> dict[str, float]:
    """Each figure's last logged value: the held-out pair accuracy the reward model ended with (refreshed last, with
    the iterative reward model, at a GRPO step below its own training's) or DPO's."""
    from runtime import tracking

    out = {}
    for key in keys:
        history = tracking.client().get_metric_history(run_id, key)
        if history:
            out[key] = max(history, key=lambda m: (m.timestamp, m.step)).value
    return out


STAGE = Stage(flow=alignment_grpo,
              inputs={"checkpoint_uri": "sft_checkpoint"},
              outputs={"final_checkpoint": "checkpoint", "registered_model": "registered_model"})
