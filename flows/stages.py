"""Every stage flow by name, and the pipeline URIs each one takes (flow parameter -> pipeline URI name)."""

from flows.alignment_grpo import alignment_grpo
from flows.cold_start_sft import cold_start_sft
from flows.reasoning_grpo import reasoning_grpo
from flows.rejection_sampling import rejection_sampling
from flows.sft import sft
from tasks import tracking
from tasks.stage import StageResult

FLOWS = {"cold_start_sft": cold_start_sft, "reasoning_grpo": reasoning_grpo,
         "rejection_sampling": rejection_sampling, "sft": sft, "alignment_grpo": alignment_grpo}

# what a stage reads: flow parameter -> the pipeline URI it is filled from (required ones first)
INPUTS = {
    "cold_start_sft": {},
    "reasoning_grpo": {"checkpoint_uri": "cold_start_checkpoint"},
    "rejection_sampling": {"checkpoint_uri": "reasoning_checkpoint"},
    "sft": {"dataset_uri": "curated_dataset", "heldout_uri": "heldout", "cold_start_dataset_uri": "cold_start_dataset"},
    "alignment_grpo": {"checkpoint_uri": "sft_checkpoint"},
}
OPTIONAL = {"heldout", "cold_start_dataset"}  # a stage runs without these (no eval / no mixing)

# what a stage produces: pipeline URI name -> key in its StageResult.uris
OUTPUTS = {
    "cold_start_sft": {"cold_start_checkpoint": "checkpoint", "cold_start_dataset": "dataset"},
    "reasoning_grpo": {"reasoning_checkpoint": "checkpoint"},
    "rejection_sampling": {"curated_dataset": "dataset", "heldout": "heldout"},
    "sft": {"sft_checkpoint": "checkpoint"},
    "alignment_grpo": {"final_checkpoint": "checkpoint", "registered_model": "registered_model"},
}


def missing_inputs(stages: list[str], uris: dict[str, str]) -> list[tuple[str, str]]:
    """(stage, URI name) pairs that neither an earlier selected stage nor `uris` will provide."""
    have, missing = set(uris), []
    for stage in stages:
        missing += [(stage, need) for need in INPUTS[stage].values() if need not in have and need not in OPTIONAL]
        have |= set(OUTPUTS[stage])
    return missing


def finished_stages(parent_run_id: str) -> dict[str, StageResult]:
    """The stages a pipeline's MLflow parent run records as finished: every output they always make is among its
    `uri.<name>` tags. Each is rebuilt from those tags, its `<stage>/<metric>` metrics and its finished child run."""
    parent = tracking.client().get_run(parent_run_id)
    uris = {k[len("uri."):]: v for k, v in parent.data.tags.items() if k.startswith("uri.")}
    children = {r.data.tags.get("stage"): r.info.run_id for r in reversed(tracking.find_runs(
        f"tags.mlflow.parentRunId = '{parent_run_id}' and attributes.status = 'FINISHED'"))}  # newest wins
    finished = {}
    for stage, outputs in OUTPUTS.items():
        if stage in children and all(name in uris for name in outputs if name not in OPTIONAL):
            metrics = {k[len(stage) + 1:]: v for k, v in parent.data.metrics.items() if k.startswith(stage + "/")}
            finished[stage] = StageResult(stage=stage, run_id=children[stage], metrics=metrics,
                                          uris={key: uris[name] for name, key in outputs.items() if name in uris})
    return finished
