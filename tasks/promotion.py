"""The final model in the MLflow registry, and whether it takes the alias a team serves from.

The alignment stage logs its checkpoint as an MLflow model (the transformers flavour, task `llm/v1/chat`), so
`mlflow.pyfunc.load_model("models:/<name>@<alias>")` answers chat messages through the tokenizer's own chat template,
as the model was trained, and `mlflow models serve -m models:/<name>@<alias> --env-manager local` serves the same on
`/invocations`. Each run registers a new version tagged with its held-out accuracy (`heldout_accuracy`) and what
that figure was measured on (`heldout_key`: a digest of the held-out rows and the evaluation settings); then the
recipe's `alignment_grpo.promotion` decides whether the alias moves to it:

- `auto` (the default): when the new version's held-out accuracy is at least the holder's (ties go to the newer
  model). The alias stays put when this run has no held-out figure, or when the two figures were measured on
  different held-out sets or settings (they do not compare: choose `always` or `approve` to move it anyway). A
  holder that records no figure (registered before versions were tagged) gives way. The first version takes it.
- `always`: every run moves it (`r1 run --promote`, `r1 stage alignment_grpo --promote`).
- `approve`: a person decides in the Prefect UI, on a form that shows both figures and what `auto` would do. The
  flow run pauses (`pause_flow_run`) when it runs in process, and is suspended (`suspend_flow_run`, freeing its
  machine) when it runs from a deployment; resumed, the suspended run skips the finished stage and goes on from the
  answer. Without an answer within `approval_timeout_s` the alias stays where it is and the flow run fails.

The decision is recorded on the stage run: tags `promotion.mode`, `promotion.decision` (`promoted`, `kept` or
`awaiting approval`), `promotion.reason`, `promotion.version`, `promotion.holder_version`, and metrics
`promotion/accuracy`, `promotion/holder_accuracy`, `promotion/promoted` (1 or 0); the version is tagged the same.
"""

from __future__ import annotations

import hashlib
import json
from typing import NamedTuple

from mlflow.exceptions import MlflowException
from prefect import task
from prefect.exceptions import FlowPauseTimeout
from prefect.input import RunInput
from prefect.logging import get_run_logger
from pydantic import BaseModel, ConfigDict

from grpo.configs.recipe import AlignmentGRPOConfig
from grpo.configs.sampling import EvalConfig
from runtime import tracking
from runtime.stage import StageResult

ACCURACY_TAG = "heldout_accuracy"  # on a model version: the held-out accuracy its run measured
HELDOUT_TAG = "heldout_key"  # on a model version: what that accuracy was measured on
RESULT_TAG = "r1.stage_result"  # on a stage run waiting for approval: its StageResult, for the resumed flow run
AWAITING = "awaiting approval"


class Holder(NamedTuple):
    """The version an alias points at, with the figure it was promoted on."""

    version: str
    accuracy: float | None  # None: it records none
    heldout_key: str | None


class Decision(BaseModel):
    """Whether the alias moves to the new version, and why."""

    model_config = ConfigDict(frozen=True)

    promote: bool
    reason: str
    accuracy: float | None = None  # the new version's held-out accuracy
    holder: Holder | None = None  # the version the alias pointed at before


def decide(mode: str, accuracy: float | None, heldout_key: str | None, holder: Holder | None) -> Decision:
    """The gate: `auto` compares held-out accuracies, `always` promotes ("approve" asks a person after `auto`)."""
    def verdict(promote: bool, reason: str) -> Decision:
        return Decision(promote=promote, reason=reason, accuracy=accuracy, holder=holder)

    if holder is None:
        return verdict(True, "no version holds the alias yet")
    if mode == "always":
        return verdict(True, "promotion: always")
    if accuracy is None:
        return verdict(False, "this run has no held-out accuracy to compare (no held-out set)")
    if holder.accuracy is None:
        return verdict(True, f"version {holder.version}, the holder, records no held-out accuracy")
    if heldout_key and holder.heldout_key and heldout_key != holder.heldout_key:
        return verdict(False, f"held-out accuracy {accuracy:.3f} and version {holder.version}'s {holder.accuracy:.3f} "
                              "were measured on different held-out sets or settings and do not compare")
    if accuracy >= holder.accuracy:
        return verdict(True, f"held-out accuracy {accuracy:.3f} >= {holder.accuracy:.3f} of version {holder.version}")
    return verdict(False, f"held-out accuracy {accuracy:.3f} < {holder.accuracy:.3f} of version {holder.version}")


def heldout_key(heldout_uri: str | None, cfg: EvalConfig) -> str | None:
    """A digest of the held-out rows and the evaluation settings: two accuracies compare only when these match."""
    if heldout_uri is None:
        return None
    from tasks.data import read_frame

    rows = read_frame(heldout_uri).astype(str).to_json(orient="records")
    blob = json.dumps([rows, cfg.model_dump(mode="json")], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _pip_requirements() -> list[str]:
    """What the logged model needs, pinned to what made it. Given, because MLflow's own guess imports torchvision
    (not installed here) and starts a subprocess to infer the rest."""
    from importlib.metadata import version

    return [f"{name}=={version(name).split('+')[0]}" for name in ("transformers", "torch", "accelerate")]


@task(name="register_model")
def register_model(run_id: str, checkpoint_uri: str, cfg: AlignmentGRPOConfig, accuracy: float | None,
                   heldout: str | None = None) -> str:
    """Log the checkpoint as an MLflow model on the stage run and register it as a new version of
    `cfg.registered_model`, tagged with its held-out accuracy; return the version. Moves no alias."""
    import mlflow

    from grpo.models import load_model_and_tokenizer
    from runtime.stage import resolve_model

    prefix = f"runs:/{run_id}/"
    if not checkpoint_uri.startswith(prefix):
        raise ValueError(f"register_model: {checkpoint_uri} is not an artifact of run {run_id}")
    c = tracking.client()
    try:
        c.get_registered_model(cfg.registered_model)
    except MlflowException as e:  # only "not registered yet": a server or permission error stops here
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        c.create_registered_model(cfg.registered_model,
                                  description="Final model of the R1 pipeline (after alignment GRPO).")
    # the objects, not the folder: MLflow records the tokenizer's class (a plain fast tokenizer) and loads it back
    # as that; from a folder it would guess the model type's tokenizer class, which splits digits differently
    model, tokenizer = load_model_and_tokenizer(resolve_model(cfg.model, checkpoint_uri))
    logged = mlflow.transformers.log_model(
        transformers_model={"model": model, "tokenizer": tokenizer}, name="model", task="llm/v1/chat",
        run_id=run_id, pip_requirements=_pip_requirements(),
        model_config={"max_new_tokens": cfg.eval.max_new_tokens})
    tags = {"stage": "alignment_grpo", **({ACCURACY_TAG: f"{accuracy:.6g}"} if accuracy is not None else {}),
            **({HELDOUT_TAG: heldout} if heldout else {})}
    version = c.create_model_version(cfg.registered_model, logged.model_uri, run_id=run_id, tags=tags,
                                     model_id=logged.model_id)
    get_run_logger().info("registered %s version %s (held-out accuracy %s)", cfg.registered_model, version.version,
                          tags.get(ACCURACY_TAG, "not measured"))
    return str(version.version)


def current_holder(name: str, alias: str) -> Holder | None:
    """The version `alias` points at, with its recorded held-out accuracy (its run's `eval/accuracy` for a version
    registered before versions were tagged); None when the alias points nowhere."""
    c = tracking.client()
    try:
        version = c.get_model_version_by_alias(name, alias)
    except MlflowException as e:
        if e.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            raise
        return None
    accuracy = version.tags.get(ACCURACY_TAG)
    if accuracy is None and version.run_id:
        try:
            accuracy = c.get_run(version.run_id).data.metrics.get("eval/accuracy")
        except MlflowException:  # its run was deleted
            accuracy = None
    return Holder(str(version.version), None if accuracy is None else float(accuracy), version.tags.get(HELDOUT_TAG))


class PromotionApproval(RunInput):
    """The form a person answers in the Prefect UI when the recipe says `promotion: approve`."""

    promote: bool = False  # point the alias at the new version
    note: str = ""  # why (recorded on the stage run)


def ask_approval(gate: Decision, name: str, alias: str, version: str, timeout_s: int) -> Decision:
    """Wait for a person's answer in the Prefect UI: the flow run pauses in process, or is suspended when it runs
    from a deployment (Prefect runs it again from the start once answered; see `resumed_for_approval`)."""
    from prefect.flow_runs import pause_flow_run, suspend_flow_run
    from prefect.runtime import deployment

    holder = gate.holder
    figures = (f"held-out accuracy {_figure(gate.accuracy)}; @{alias} is version {holder.version} with "
               f"{_figure(holder.accuracy)}" if holder else f"held-out accuracy {_figure(gate.accuracy)}; "
                                                              f"@{alias} points at no version yet")
    description = (f"Move **{name}@{alias}** to version {version}?\n\n{figures}.\n\n"
                   f"The accuracy gate (`promotion: auto`) would {'promote' if gate.promote else 'not promote'}: "
                   f"{gate.reason}.")
    form = PromotionApproval.with_initial_data(description=description, promote=gate.promote)
    wait = suspend_flow_run if deployment.id else pause_flow_run
    answer = wait(wait_for_input=form, timeout=timeout_s, key=f"promote-{name}-{alias}")
    said = "approved" if answer.promote else "declined"
    reason = f"{said} in the Prefect UI{f' ({answer.note})' if answer.note else ''}; the gate said: {gate.reason}"
    return gate.model_copy(update={"promote": answer.promote, "reason": reason})


def _figure(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.3f}"


def record_decision(run_id: str, cfg: AlignmentGRPOConfig, version: str, decision: Decision | None,
                    reason: str | None = None) -> None:
    """Tags and metrics on the stage run and tags on the version: the mode, the decision, why, both figures."""
    holder = decision.holder if decision else None
    state = AWAITING if decision is None else "promoted" if decision.promote else "kept"
    tags = {"promotion.mode": cfg.promotion, "promotion.decision": state, "promotion.version": version,
            "promotion.reason": reason or (decision.reason if decision else ""),
            "promotion.holder_version": holder.version if holder else "none"}
    tracking.set_tags(run_id, tags)
    if decision is not None:
        figures = {"promotion/promoted": float(decision.promote), "promotion/accuracy": decision.accuracy,
                   "promotion/holder_accuracy": holder.accuracy if holder else None}
        tracking.MetricsLogger(run_id)(0, {k: v for k, v in figures.items() if v is not None})
        c = tracking.client()
        for key in ("promotion.decision", "promotion.reason"):
            c.set_model_version_tag(cfg.registered_model, version, key, tags[key])


def promote_model(run_id: str, cfg: AlignmentGRPOConfig, version: str) -> Decision:
    """Decide whether `cfg.alias` moves to `version` (see the module's docstring), move it if so, record why.

    A plain function rather than a task: with `promotion: approve` it pauses or suspends the flow run, which a
    flow does, not a task. Call it after the stage run has ended, so a suspended flow run leaves that run finished.
    """
    tags = tracking.client().get_model_version(cfg.registered_model, version).tags  # what `register_model` saw
    accuracy = None if tags.get(ACCURACY_TAG) is None else float(tags[ACCURACY_TAG])
    holder = current_holder(cfg.registered_model, cfg.alias)
    gate = decide("auto" if cfg.promotion == "approve" else cfg.promotion, accuracy, tags.get(HELDOUT_TAG), holder)
    decision = gate
    if cfg.promotion == "approve":
        record_decision(run_id, cfg, version, None, f"waiting for a person in the Prefect UI; the gate says: "
                                                    f"{gate.reason}")
        try:
            decision = ask_approval(gate, cfg.registered_model, cfg.alias, version, cfg.approval_timeout_s)
        except FlowPauseTimeout:
            record_decision(run_id, cfg, version, gate.model_copy(update={
                "promote": False, "reason": f"no answer in the Prefect UI within {cfg.approval_timeout_s} s"}))
            raise
    if decision.promote:
        tracking.client().set_registered_model_alias(cfg.registered_model, cfg.alias, version)
    record_decision(run_id, cfg, version, decision)
    _logger().info("%s version %s %s @%s: %s", cfg.registered_model, version,
                          "takes" if decision.promote else "does not take", cfg.alias, decision.reason)
    return decision


def _logger():
    """The flow run's logger (so the decision shows in the Prefect UI), or a plain one outside a flow run."""
    import logging

    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(__name__)


def remember_for_approval(result: StageResult) -> None:
    """Record the stage's result on its run, so a flow run suspended for approval finds it when resumed."""
    if result.run_id:
        tracking.set_tags(result.run_id, {RESULT_TAG: result.model_dump_json()})


def resumed_for_approval(stage: str) -> StageResult | None:
    """In a flow run resumed after a suspension for approval: the result of the stage run it finished before.

    Prefect runs a resumed flow run's function again from the start; the stage's work is done and in MLflow, so
    the flow skips to the answer instead of training again.
    """
    from prefect.runtime import deployment, flow_run

    if not (flow_run.id and deployment.id):
        return None
    runs = tracking.find_runs(f"tags.`prefect.flow_run_id` = '{flow_run.id}' and tags.stage = '{stage}' "
                              "and attributes.status = 'FINISHED'")
    for run in runs:
        if run.data.tags.get("promotion.decision") == AWAITING and RESULT_TAG in run.data.tags:
            return StageResult.model_validate_json(run.data.tags[RESULT_TAG])
    return None

