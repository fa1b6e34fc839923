"""Every stage, declared once beside its flow, and what the pipeline, pre-flight, the CLI and `r1 deploy` read there.

A stage is three things: its settings (a `StageConfig` section of the recipe, grpo/configs/recipe.py), its flow
(`flows/<stage>.py`, which ends with its `STAGE = Stage(...)` declaration: inputs and outputs) and its tasks. The
recipe's sections give the order; this module finds each stage's declaration in the flow module of the same name.
Nothing else lists the stages. What a stage reads is checked before it runs by its pre-flight (flows/stage_checks.py),
kept out of the flow module so that `r1` checks it before Prefect and the stages' libraries load.
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from dataclasses import dataclass, field
from typing import Callable

from prefect import Flow

from grpo import startup
from grpo.configs.recipe import STAGES
from runtime import tracking
from runtime.stage import StageResult


def run_name(stage: str) -> Callable[[], str]:
    """A stage flow's run name: `<stage>:<recipe name>` where the pipeline or `r1 stage` gave it that name (a placed
    stage's flow run is created with it), else the stage's name."""
    def name() -> str:
        from prefect.runtime import flow_run

        startup.imports_done()  # a flow-run process's start-up ends as its run starts (flows/__init__.py)
        given = flow_run.name or ""
        return given if given.startswith(f"{stage}:") else stage

    return name


@dataclass(frozen=True)
class Stage:
    """One stage of the recipe: its flow and what it takes from and gives to the pipeline."""

    flow: Flow  # its flow: `config` (its recipe section), `parent_run_id` and one parameter per input
    inputs: dict[str, str]  # flow parameter -> the pipeline URI it is filled from (required ones first)
    outputs: dict[str, str]  # pipeline URI name -> the key of its StageResult.uris that holds it
    optional: frozenset[str] = frozenset()  # pipeline URIs among `inputs` it runs without (no eval, no mixing)
    # an optional URI -> the field of the stage's config that, when true, makes it needed after all
    needed_when: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.flow.name

    def needs(self, config=None) -> list[str]:
        """The pipeline URIs it cannot run without (with `config`, its recipe section: those it asks for too)."""
        return [uri for uri in self.inputs.values() if uri not in self.optional
                or (config is not None and uri in self.needed_when and getattr(config, self.needed_when[uri]))]


@lru_cache(maxsize=1)
def declared() -> dict[str, Stage]:
    """Stage name -> its declaration, in the recipe's order (read on first use: the flow modules import this one)."""
    found = {}
    for name in STAGES:
        stage = getattr(importlib.import_module(f"flows.{name}"), "STAGE", None)
        if not isinstance(stage, Stage) or stage.name != name:
            raise ImportError(f"flows/{name}.py must declare STAGE = Stage(flow=<its flow named {name!r}>, ...)")
        found[name] = stage
    return found


def missing_inputs(stages: list[str], uris: dict[str, str]) -> list[tuple[str, str]]:
    """(stage, URI name) pairs that neither an earlier selected stage nor `uris` will provide."""
    have, missing = set(uris), []
    for stage in stages:
        missing += [(stage, need) for need in declared()[stage].needs() if need not in have]
        have |= set(declared()[stage].outputs)
    return missing


def finished_stages(parent_run_id: str) -> dict[str, StageResult]:
    """The stages a pipeline's MLflow parent run records as finished: every output they always make is among its
    `uri.<name>` tags. Each is rebuilt from those tags, its `<stage>/<metric>` metrics and its finished child run."""
    parent = tracking.client().get_run(parent_run_id)
    uris = {k[len("uri."):]: v for k, v in parent.data.tags.items() if k.startswith("uri.")}
    children = {r.data.tags.get("stage"): r.info.run_id for r in reversed(tracking.find_runs(
        f"tags.mlflow.parentRunId = '{parent_run_id}' and attributes.status = 'FINISHED'"))}  # newest wins
    finished = {}
    for name, stage in declared().items():
        outputs = stage.outputs
        if name in children and all(u in uris for u in outputs if u not in _optional_outputs()):
            metrics = {k[len(name) + 1:]: v for k, v in parent.data.metrics.items() if k.startswith(name + "/")}
            finished[name] = StageResult(stage=name, run_id=children[name], metrics=metrics,
                                         uris={key: uris[u] for u, key in outputs.items() if u in uris})
    return finished


def _optional_outputs() -> set[str]:
    """Outputs some stage may not make (a held-out split, say): those that every taker lists as optional."""
    takers: dict[str, list[bool]] = {}
    for stage in declared().values():
        for uri in stage.inputs.values():
            takers.setdefault(uri, []).append(uri in stage.optional)
    return {uri for uri, optional in takers.items() if all(optional)}
