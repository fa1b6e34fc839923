"""The optional extras (peft, bitsandbytes, Ray and prefect-ray): one check that the packages a setting needs are
installed, run before any work, saying what to install and what to set instead.

Must not depend on torch, Prefect or MLflow.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence


def importable(module: str) -> bool:
    """Whether `module` (dotted or not) can be imported here, without importing it (its parents are)."""
    parts = module.split(".")
    try:
        return all(importlib.util.find_spec(".".join(parts[:i])) is not None for i in range(1, len(parts) + 1))
    except (ImportError, ValueError):  # a parent that is missing, or one set aside as not installed
        return False


def require(modules: Sequence[str], setting: str, install: str, otherwise: str = "") -> None:
    """Fail in one line when any of `modules` is not importable: what `setting` needs, `install` (the command), and
    `otherwise` (what to set instead), e.g.

    >>> require(["json"], "lora:", "pip install json")
    >>> require(["no_such_package"], "lora:", "pip install no-such-package", "remove `lora:` from the recipe")
    Traceback (most recent call last):
    ...
    ModuleNotFoundError: lora: needs no_such_package, which is not installed: pip install no-such-package; or remove `lora:` from the recipe
    """
    missing = [m for m in modules if not importable(m)]
    if missing:
        which = " and ".join(missing)
        raise ModuleNotFoundError(f"{setting} needs {which}, which {'is' if len(missing) == 1 else 'are'} not "
                                  f"installed: {install}" + (f"; or {otherwise}" if otherwise else ""))
