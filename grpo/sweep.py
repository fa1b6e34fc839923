"""A sweep: the recipe run once per point of a grid of its settings, times seeds (`r1 sweep`, a recipe's `sweep:`).

    r1 sweep --recipe tiny --grid reasoning_grpo.grpo.loss.beta=0,0.04 --grid alignment_grpo.algorithm=grpo,dpo \\
             --seeds 3

or, in a recipe file, its `sweep:` section (grpo/configs/sweep.py).

Each point is the grid's cartesian product of settings (in the order given, the last setting varying fastest) and a
seed, and runs as one pipeline run with those settings as overrides. Seed k adds k to the training seeds of the stages
in `seed_stages` (`train.seed`, `grpo.seed`, `rejection.seed`, `reward_model.seed`, `dpo.seed`; never the base
model's initialisation or which problems the data draws), so seed 0 is the recipe as written. Points that agree on
every stage up to some stage share those stages: the pipeline's stage keys make the second point reuse what the first
trained. A seed that reaches the cold start makes one cold start per seed; `seed_stages` without it shares one.

Everything here is checked before any point runs (`expand`): each path and value as the recipe checks an override,
an empty grid, a value list that is empty or repeats a value, a seed count below 1.

Must not depend on torch, Prefect or MLflow (the recipe module is torch-free).
"""

from __future__ import annotations

import itertools
import json
from typing import Any, NamedTuple

import yaml

from grpo.configs.recipe import RecipeError, apply_overrides, setting_path
from grpo.configs.sweep import STAGE_NAMES, SweepConfig
# the parts of a stage's settings a seed does not reach: the base model's weights and the problems drawn
NOT_SEEDED = {"model", "data", "preferences"}


class SweepError(ValueError):
    """A sweep asked for wrongly: the message names the setting and the value."""


class Point(NamedTuple):
    """One run of the sweep: its grid settings, its seed, and every override it gives the recipe."""

    index: int  # 0-based, in the sweep's order
    settings: dict[str, Any]  # grid path -> value (and `variant` -> its name, where the sweep names variants)
    seed: int
    overrides: dict[str, Any]  # settings (a variant's own) plus the seeded paths
    stages: tuple[str, ...] = STAGE_NAMES  # the stages the point runs, in the recipe's order

    def label(self, short: bool = False) -> str:
        """`reasoning_grpo.grpo.loss.beta=0.04, seed 1`; short: each setting by its last name (`beta=0.04, seed 1`)."""
        names = short_names(list(self.settings)) if short else {p: p for p in self.settings}
        return ", ".join([*(f"{names[path]}={show(v)}" for path, v in self.settings.items()), f"seed {self.seed}"])

    def key(self) -> str:
        return json.dumps({"settings": self.settings, "seed": self.seed}, sort_keys=True, default=str)


def short_names(paths: list[str]) -> dict[str, str]:
    """Each path by its last name, or by as many of its last names as tell it from the others."""
    for depth in range(1, max((p.count(".") + 1 for p in paths), default=1) + 1):
        names = {p: ".".join(p.split(".")[-depth:]) for p in paths}
        if len(set(names.values())) == len(paths):
            return names
    return {p: p for p in paths}


def show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def parse_grid(given: list[str]) -> dict[str, list[Any]]:
    """`--grid PATH=V1,V2,...` flags as {path: [values]}, each value read as YAML (0.04 a number, true a bool);
    `PATH=[[1, 2], [3]]`, a YAML list, for values with commas in them."""
    grid: dict[str, list[Any]] = {}
    for item in given:
        path, sep, text = item.partition("=")
        path = path.strip()
        if not sep or not path:
            raise SweepError(f"--grid {item!r}: expected PATH=V1,V2,..., such as reasoning_grpo.grpo.loss.beta=0,0.04")
        if path in grid:
            raise SweepError(f"--grid {path}: given twice; put all its values in one flag")
        try:
            values = yaml.safe_load(text) if text.strip().startswith("[") else \
                [yaml.safe_load(part) for part in text.split(",")]
        except yaml.YAMLError as e:
            raise SweepError(f"--grid {item!r}: a value is not valid YAML ({getattr(e, 'problem', e)})") from None
        if not isinstance(values, list):
            raise SweepError(f"--grid {item!r}: expected a list of values")
        grid[path] = values
    return grid


def seed_paths(recipe, stages: list[str]) -> list[str]:
    """The recipe paths a seed changes in these stages: every `seed` field of their settings outside the base model
    and the data."""
    paths = []
    for stage in stages:
        for path in _leaf_paths(getattr(recipe, stage).model_dump()):
            parts = path.split(".")
            if parts[-1] == "seed" and not NOT_SEEDED & set(parts[:-1]):
                paths.append(f"{stage}.{path}")
    return paths


def _leaf_paths(data: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        out += _leaf_paths(value, path + ".") if isinstance(value, dict) else [path]
    return out


def _get(data: dict, path: str) -> Any:
    for key in path.split("."):
        data = data[key]
    return data


def with_fixed(points: list[Point], fixed: dict[str, Any]) -> list[Point]:
    """The points, each also given the settings every point shares (`r1 sweep --set`); a point's own (its grid
    settings, its variant's, its seed) win where both name a path."""
    return [p._replace(overrides={**fixed, **p.overrides}) for p in points] if fixed else points


def expand(recipe, sweep: SweepConfig) -> list[Point]:
    """The sweep's points, each checked as the recipe checks overrides; a SweepError naming the setting and the value
    for the first that fails, before anything runs."""
    if not sweep.grid and not sweep.variants and sweep.seeds == 1:
        raise SweepError("the sweep is empty: give a setting to vary (--grid PATH=V1,V2 or a recipe's sweep.grid "
                         "or sweep.variants) or --seeds above 1")
    for path, values in sweep.grid.items():
        if not values:
            raise SweepError(f"--grid {path}: no values; expected one or more, such as {path}=A,B")
        shown = [json.dumps(v, sort_keys=True, default=str) for v in values]
        twice = sorted({show(v) for v, s in zip(values, shown) if shown.count(s) > 1})
        if twice:
            raise SweepError(f"--grid {path}: {', '.join(twice)} given twice")
    grid = {}
    for path, values in sweep.grid.items():
        grid[path] = []
        for value in values:  # each alone: the error names this path and this value
            try:
                checked = apply_overrides(recipe, {path: value})
            except RecipeError as e:
                raise SweepError(f"--grid {path}={show(value)}: {e}") from None
            # as the recipe reads it: "1e-5" -> 1e-05
            grid[path].append(_get(checked.model_dump(mode="json"), setting_path(path, value)))
    variants = {name: _variant(recipe, name, given, sweep) for name, given in sweep.variants.items()} or \
        {None: ({}, tuple(s for s in STAGE_NAMES if s in (sweep.stages or STAGE_NAMES)))}
    points = []
    for name, (own, stages) in variants.items():
        seeded = seed_paths(recipe, [s for s in (sweep.seed_stages or stages) if s in stages])
        for combo in itertools.product(*grid.values()):
            settings = {**({"variant": name} if name is not None else {}), **dict(zip(grid, combo))}
            given = {**own, **dict(zip(grid, combo))}
            for seed in range(sweep.seeds):
                read = apply_overrides(recipe, given).model_dump() if seed else {}
                overrides = {**given, **{p: _get(read, setting_path(p)) + seed for p in seeded if seed}}
                try:
                    apply_overrides(recipe, overrides)
                except RecipeError as e:  # settings that pass alone and fail together (fields that must agree)
                    raise SweepError(f"the point {Point(0, settings, seed, {}).label()}: {e}") from None
                points.append(Point(len(points), settings, seed, overrides, stages))
    return points


def _variant(recipe, name: str, given: dict[str, Any], sweep: SweepConfig) -> tuple[dict[str, Any], tuple[str, ...]]:
    """A named variant's overrides, each checked as the recipe checks one, and the stages its points run."""
    own = {path: value for path, value in given.items() if path != "stages"}
    stages = tuple(s for s in STAGE_NAMES if s in (given.get("stages") or sweep.stages or STAGE_NAMES))
    try:
        apply_overrides(recipe, own)
    except RecipeError as e:  # the message names the path and the value
        raise SweepError(f"variant {name}: {e}") from None
    return own, stages


def seeds_reach(recipe, sweep: SweepConfig) -> str:
    """One line on what a seed changes, for the terminal and the sweep run: the stages it reaches and what they
    cost (a cold start per seed, or one shared)."""
    if sweep.seeds == 1:
        return "one seed (the recipe's own)"
    stages = list(sweep.stages or STAGE_NAMES)
    reached = [s for s in (sweep.seed_stages or stages) if s in stages and seed_paths(recipe, [s])]
    if not reached:
        return f"{sweep.seeds} seeds reach no stage this sweep runs: every seed is the same run"
    first = reached[0]
    shared = [s for s in stages if stages.index(s) < stages.index(first)]
    tail = f"; {', '.join(shared)} shared by all seeds" if shared else ""
    return (f"{sweep.seeds} seeds reach {', '.join(reached)}: each seed trains its own {first} and everything "
            f"after it{tail}")
