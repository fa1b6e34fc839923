"""How settings are checked and their errors told: the precision setting's type, checks that span several fields,
and pydantic's errors as one line that names each field.

Imported by the settings beside it, so plain Python and pydantic only (no project module, no torch).
"""

from __future__ import annotations

import difflib
import warnings
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ValidationError


def _precision_spelling(value):
    """YAML reads a bare `no` as false; `fp32` is the other usual name for no mixed precision."""
    return "no" if value is False or value == "fp32" else value


# `auto`: bf16 where the hardware computes it natively, else fp32 (grpo.training.precision resolves it)
Precision = Annotated[Literal["auto", "bf16", "fp16", "no"], BeforeValidator(_precision_spelling)]


def check_prompts_per_step(prompts_per_step: int, prompts: int | None, source: str = "the data section") -> None:
    """A step draws prompts_per_step distinct prompts: the training set must hold that many (None: not known yet)."""
    if prompts is not None and prompts < prompts_per_step:
        raise ValueError(f"grpo.prompts_per_step ({prompts_per_step}) is more than the {prompts} training prompts "
                         f"{source} gives; lower it or give more prompts (data.num_train)")


def check_process_split(field: str, size: int, num_processes: int | str) -> None:
    """Each of the training processes takes an equal share of `field` (a global batch): it must split evenly."""
    if isinstance(num_processes, int) and num_processes > 1 and size % num_processes:
        raise ValueError(f"{field} ({size}) must be a multiple of distributed.num_processes ({num_processes}): each "
                         f"process takes an equal share of it")


def check_fits_context(field: str, tokens: int, context: int, plus_prompt: bool) -> None:
    """Raise if `tokens` (plus at least one prompt token for a completion budget) cannot fit `context`."""
    if tokens + plus_prompt > context:
        what = f"{field} ({tokens}) + the prompt" if plus_prompt else f"{field} ({tokens})"
        raise ValueError(f"{what} must fit the model's context of {context} tokens (max_position_embeddings)")


def describe_errors(e: ValidationError, root: type[BaseModel]) -> str:
    """Pydantic's errors on one line: `field.path: what was expected (got ...)`, joined by `; `.

    `root` is the model that was validated, to suggest the field a misspelt name meant.
    """
    problems = []
    for err in e.errors():
        where = ".".join(map(str, err["loc"]))
        msg = err["msg"].removeprefix("Value error, ")
        given = err.get("input")
        if err["type"] == "extra_forbidden":
            known = fields_at(root, err["loc"][:-1])
            close = difflib.get_close_matches(str(err["loc"][-1]), known + also_known(root, err["loc"][:-1]), n=1)
            msg = f"unknown field; did you mean {close[0]!r}?" if close else f"unknown field; known here: {known}"
        elif err["type"] not in ("value_error", "missing") and not isinstance(given, (dict, list)):
            msg += f" (got {given!r})"
        problems.append(f"{where}: {msg}" if where else msg)
    return "; ".join(problems)


def model_at(root: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The settings model of the section at `loc` below `root` (None when `loc` leads nowhere)."""
    model = root
    for key in loc:
        annotation = model.model_fields[key].annotation if key in model.model_fields else None
        inner = [a for a in (annotation, *getattr(annotation, "__args__", ())) if isinstance(a, type)
                 and issubclass(a, BaseModel)]
        if not inner:
            return None
        model = inner[0]
    return model


def unmoved_path(root: type[BaseModel], keys: list[str], value: Any = None) -> list[str]:
    """A dotted path's keys with a name a section took before it had sections of its own (its `moved_keys`) put in
    its section: [reasoning_grpo, grpo, beta] -> [reasoning_grpo, grpo, loss, beta]. A moved name that is also a
    section (GRPO's `optimizer`) moves only where it is set to a value that is not a mapping (the optimizer's name)."""
    for depth, key in enumerate(keys):
        model = model_at(root, tuple(keys[:depth]))
        moved = getattr(model, "moved_keys", {})
        if key in moved and (key not in model.model_fields or (depth == len(keys) - 1
                                                               and not isinstance(value, (dict, BaseModel)))):
            return keys[:depth] + moved[key].split(".") + keys[depth + 1:]
    return keys


def sectioned(root: type[BaseModel], data: dict, at: tuple = ()) -> tuple[dict, list[tuple[str, str]]]:
    """`data`, settings at `at` below `root`, with each name a section took before it had sections of its own put
    in its section ({grpo: {beta: 0}} -> {grpo: {loss: {beta: 0}}}), and the moves as (old path, new path). A recipe
    file is read so before a `base:` is merged under it, so a flat name overrides the base's sectioned one."""
    places = {key: unmoved_path(root, [*at, key], value)[len(at):] for key, value in data.items()}
    out = {key: dict(value) if isinstance(value, dict) else value for key, value in data.items()
           if len(places[key]) == 1}
    moves: list[tuple[str, str]] = []
    for key, (section, field) in ((k, p) for k, p in places.items() if len(p) > 1):
        old, new = ".".join(map(str, (*at, key))), ".".join(map(str, (*at, section, field)))
        if not isinstance(out.setdefault(section, {}), dict) or field in out[section]:
            # its section given as something else, or the field given both ways: left for the section's check to name
            out[key] = data[key]
            continue
        out[section][field] = data[key]
        moves.append((old, new))
    for key, value in out.items():
        if isinstance(value, dict) and model_at(root, (*at, key)) is not None:
            out[key], inner = sectioned(root, value, (*at, key))
            moves += inner
    return out, moves


class MovedSettingsWarning(FutureWarning):
    """Settings a recipe or override names by their paths before GRPO's sections (read so, still)."""


def warn_flat_names(moves: list[tuple[str, str]], where: str = "") -> None:
    """One FutureWarning (none without `moves`) naming the settings given by their names before GRPO's sections, and
    their paths now: still read (grpo.configs.training.MOVED_KEYS), and a copied recipe can be brought up to date."""
    if moves:
        warnings.warn(f"{where}{': ' if where else ''}GRPO settings named as before their sections: "
                      f"{', '.join(f'{old} is {new}' for old, new in moves)} (read so; write them by those paths)",
                      MovedSettingsWarning, stacklevel=3)


def also_known(root: type[BaseModel], loc: tuple) -> list[str]:
    """The names the section at `loc` also reads, besides its fields: the flat names a section took before it had
    sections of its own (its `moved_keys`), which a misspelt name may have meant."""
    return list(getattr(model_at(root, loc), "moved_keys", {}))


def fields_at(root: type[BaseModel], loc: tuple) -> list[str]:
    """The field names of the settings section at `loc` below `root` (empty when `loc` leads nowhere)."""
    model = model_at(root, loc)
    return list(model.model_fields) if model is not None else []


def check_fsdp_settings(distributed, *, weights_dtype: str = "float32",
                        optimizer: str = "adamw", field: str = "grpo") -> None:
    """Refuse, naming the field, what the sharded strategy cannot honour (before any model loads): `distributed` is
    a stage's section (grpo.configs.recipe.DistributedConfig)."""
    if distributed.strategy != "fsdp":
        return
    if weights_dtype == "bfloat16":
        raise ValueError(f"{field}.weights_dtype bfloat16 keeps fp32 master weights beside bf16 ones in one process; "
                         f"with distributed.strategy fsdp the shards are the fp32 masters and the units compute in "
                         f"bf16 where mixed_precision is bf16: set {field}.weights_dtype to float32")
    if optimizer == "adamw_8bit":
        raise ValueError(f"{field}.optimizer adamw_8bit (bitsandbytes) cannot step sharded weights; with "
                         f"distributed.strategy fsdp each process already holds 1/N of AdamW's state: set "
                         f"{field}.optimizer to adamw")
