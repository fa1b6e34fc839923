"""The recipes a clone ships load."""

from __future__ import annotations

from grpo.configs.recipe import RECIPES_DIR, load_recipe


def test_every_shipped_recipe_loads():
    names = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
    assert {"tiny", "gsm8k"} <= set(names)
    for name in names:
        assert load_recipe(name).name == name
