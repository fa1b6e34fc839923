"""Stage 5, alignment GRPO: make the SFT model helpful and harmless without losing its reasoning.

R1's last stage runs RL on a mix: reasoning prompts keep their rule rewards, general prompts are scored by reward
models for helpfulness (on the final summary) and harmlessness (on the whole response). Here one reward model,
trained in this stage on preference pairs with the Bradley-Terry loss (or an existing one, `reward_model_uri`),
scores the general prompts; the held-out reasoning split is scored before and after, and the result is logged as an
MLflow model and registered as a new version; the alias (`models:/<name>@champion`) moves to it when its held-out
accuracy is at least the current holder's, on every run with `promotion: always` (`--promote`), or when a person
says so in the Prefect UI with `promotion: approve` (`tasks/promotion.py`).

With `algorithm: dpo` DPO replaces the reward model and GRPO (`grpo.training.loops.dpo`): the policy learns from the same
preference pairs directly, against the starting checkpoint as its frozen reference; evaluation, the logged model and
promotion are unchanged. Whichever algorithm trains, the stage measures its policy on held-out general prompts before
and after: the share of harmful requests refused (`alignment/harmful_refused`) and of harmless ones answered
(`alignment/harmless_answered`), by the refusal detector in `grpo.data.preferences`.

Run alone:  r1 stage alignment_grpo --checkpoint runs:/<sft run id>/checkpoint
"""

from __future__ import annotations

from prefect import flow

from flows.checks import check_model_folder, check_rewards, check_uri, looks_like_a_path, reading
from flows.stages import Stage, run_name
from grpo.configs.checks import check_prompts_per_step
from grpo.configs.recipe import AlignmentGRPOConfig
from runtime.report import publish_stage_report
from runtime.stage import StageResult, stage_run
from tasks.alignment import evaluate_refusals, prepare_alignment_prompts, train_dpo_model, train_reward_model_task
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
        reward_model = None if dpo else train_reward_model_task(run_id, config)
        metrics = {}
        if config.eval_before:
            if data.heldout:
                before = evaluate_model(run_id, checkpoint_uri, config.model, data.heldout, config.eval, step=0,
                                        code=config.grpo.code, generation=config.generation)
                metrics.update({f"{k}_before": v for k, v in before.items()})
            if config.refusal_prompts:
                before = evaluate_refusals(run_id, checkpoint_uri, config, step=0)
                metrics.update({f"{k}_before": v for k, v in before.items()})
        if dpo:
            checkpoint = train_dpo_model(run_id, NAME, config.model, checkpoint_uri, config)
        else:
            checkpoint = train_grpo_model(run_id, NAME, config.model, checkpoint_uri, data.train, config.grpo,
                                          reward_model_uri=reward_model, distributed=config.distributed,
                                          generation=config.generation,
                                          # the iterative reward model: trained further on the policy's samples
                                          refresh=config.reward_model if config.reward_model.refresh_every else None,
                                          preferences=config.preferences)
        if data.heldout:
            metrics.update(evaluate_model(run_id, checkpoint, config.model, data.heldout, config.eval,
                                          step=steps, code=config.grpo.code, generation=config.generation))
        if config.refusal_prompts:
            metrics.update(evaluate_refusals(run_id, checkpoint, config, step=steps))
        metrics.update(_last_logged(run_id, ("rm/heldout_accuracy", "dpo/heldout_accuracy")))
        version = register_model(run_id, checkpoint, config, metrics.get("eval/accuracy"),
                                 heldout_key(data.heldout, config.eval))
    registered = f"models:/{config.registered_model}/{version}"  # this run's version, whatever the alias does
    uris = {"checkpoint": checkpoint, "registered_model": registered}
    if reward_model:
        uris["reward_model"] = reward_model
    return StageResult(stage=NAME, run_id=run_id, metrics=metrics, uris=uris)


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


def check_alignment_grpo(cfg: AlignmentGRPOConfig) -> None:
    """Pre-flight: what the stage reads, read and validated as it will be (no model loaded)."""
    from grpo.data.preferences import load_preference_data
    from grpo.data.tables import load_rl_data, read_table, validate_rows

    with reading("alignment_grpo.data"):
        train, heldout = load_rl_data(cfg.data)
    if cfg.refusal_prompts:
        from grpo.data.preferences import general_prompts

        with reading("alignment_grpo.refusal_prompts"):
            general_prompts(cfg.refusal_prompts, split="heldout", heldout_percent=cfg.preferences.heldout_percent)
    if cfg.algorithm == "dpo":  # no reward model, no general prompts: the preference pairs are what it reads
        with reading("alignment_grpo.preferences"):
            load_preference_data(cfg.preferences)
        return
    check_rewards("alignment_grpo", cfg.grpo, train, heldout)
    general = cfg.general_prompts
    if cfg.general_source != "synthetic":
        with reading("alignment_grpo.general_source"):
            rows = validate_rows(read_table(cfg.general_source), {"prompt": "text or chat messages"},
                                 cfg.general_source)
        general = min(general, len(rows))
    with reading("alignment_grpo"):
        check_prompts_per_step(cfg.grpo.prompts_per_step, len(train) + general,
                               f"{cfg.data.source} with {general} general prompts")
    if cfg.reward_model_uri is None:
        with reading("alignment_grpo.preferences"):
            load_preference_data(cfg.preferences)
    elif cfg.reward_model_uri.startswith("runs:/"):
        check_uri("alignment_grpo.reward_model_uri", cfg.reward_model_uri)
    elif looks_like_a_path(cfg.reward_model_uri):
        check_model_folder("alignment_grpo.reward_model_uri", cfg.reward_model_uri)


STAGE = Stage(flow=alignment_grpo,
              inputs={"checkpoint_uri": "sft_checkpoint"},
              outputs={"final_checkpoint": "checkpoint", "registered_model": "registered_model"},
              check=check_alignment_grpo,
              loads=lambda config: [] if config.reward_model_uri or config.algorithm == "dpo" else [
                  # a given reward model trains nothing, and DPO has none
                  ("alignment_grpo.reward_model.model.name_or_path", config.reward_model.model)])
