"""The repository at an earlier commit, checked out in a temporary git worktree: what a benchmark runs to compare the
code as it is with code that is gone (the static KV cache, the sampler before continuous batching)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STATIC_REV = "2f2b6ce"  # the last commit whose sampler could still decode with a static cache (kv_layout="static")


@contextlib.contextmanager
def worktree(rev: str):
    """The repository at `rev`, checked out in a temporary folder (removed after). On a machine that got a copy of
    the files without git's history, `R1_REV_TREES` names a folder holding `<rev>/` as `git archive` wrote it."""
    exported = Path(os.environ.get("R1_REV_TREES", "")) / rev
    if os.environ.get("R1_REV_TREES"):
        if not (exported / "grpo").is_dir():
            raise FileNotFoundError(f"R1_REV_TREES has no {rev}/grpo: git archive {rev} | tar -x -C {exported}")
        yield exported
        return
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / rev
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev], check=True,
                       capture_output=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)
