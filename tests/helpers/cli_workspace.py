"""The `r1` error catalogue's workspace (tests/flows/cli/test_errors.py, test_errors_endpoints.py): a fresh state
folder and MLflow store, a small recipe to break, and the check that `r1` failed as a user error should.

The `ws` fixture that makes one is in tests/flows/cli/conftest.py.
"""

from __future__ import annotations

import copy
import json
import socket
import sqlite3
from pathlib import Path

import yaml

from flows.cli.r1 import main
from tiny_configs import TINY

SMALL_MODEL = {"tiny": TINY}
SMALL = {
    "name": "small",
    "cold_start_sft": {"model": SMALL_MODEL, "data": {"num_train": 64, "num_heldout": 8},
                       "train": {"max_steps": 2, "batch_size": 8, "checkpoint_every": 0},
                       "eval": {"num_prompts": 8, "num_samples": 0, "max_new_tokens": 16}},
    "reasoning_grpo": {"data": {"num_train": 32, "num_heldout": 8},
                       "grpo": {"max_steps": 1, "prompts_per_step": 2, "num_generations": 2,
                                "sampling": {"max_new_tokens": 16}, "checkpoint_every": 0},
                       "eval": {"num_prompts": 8, "num_samples": 0, "max_new_tokens": 16}},
    "rejection_sampling": {"data": {"num_train": 8, "num_heldout": 8},
                           "rejection": {"samples_per_prompt": 2, "sampling": {"max_new_tokens": 16},
                                         "target_samples": 8, "shard_size": 8}},
    "sft": {"model": SMALL_MODEL, "train": {"max_steps": 2, "batch_size": 8, "checkpoint_every": 0},
            "eval": {"num_prompts": 8, "num_samples": 0, "max_new_tokens": 16}},
    "alignment_grpo": {"data": {"num_train": 8, "num_heldout": 8}, "general_prompts": 8,
                       "preferences": {"num_train": 16, "num_heldout": 8},
                       "reward_model": {"model": SMALL_MODEL, "max_steps": 1, "batch_size": 8},
                       "grpo": {"max_steps": 1, "prompts_per_step": 2, "num_generations": 2,
                                "sampling": {"max_new_tokens": 16}, "checkpoint_every": 0,
                                "rewards": {"accuracy": 1.0, "reward_model": 1.0}},
                       "eval": {"num_prompts": 8, "num_samples": 0, "max_new_tokens": 16}},
}


def closed_port() -> int:
    """A port nothing listens on (bound and released: connecting to it is refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Workspace:
    """A fresh state folder and MLflow store, and helpers to write recipes and data into a temp folder."""

    def __init__(self, root: Path):
        self.root = root
        self.home = root / "home"
        self.db = self.home / "mlflow.db"

    def recipe(self, **sections) -> str:
        """The small recipe with `sections` merged in (a dotted key sets one nested field)."""
        data = copy.deepcopy(SMALL)
        for dotted, value in sections.items():
            *parents, last = dotted.split("__")
            node = data
            for key in parents:
                node = node.setdefault(key, {})
            node[last] = value
        path = self.root / "recipe.yaml"
        path.write_text(yaml.safe_dump(data))
        return str(path)

    def file(self, name: str, text: str) -> str:
        path = self.root / name
        path.write_text(text)
        return str(path)

    def jsonl(self, name: str, rows: list[dict]) -> str:
        return self.file(name, "".join(json.dumps(r) + "\n" for r in rows))

    def model_folder(self, name: str, config: dict | None) -> str:
        folder = self.root / name
        folder.mkdir()
        if config is not None:
            (folder / "config.json").write_text(json.dumps(config))
        return str(folder)

    def client(self):
        from runtime import tracking

        return tracking.client()

    def runs(self) -> int:
        if not self.db.exists():
            return 0
        with sqlite3.connect(self.db) as c:
            return c.execute("select count(*) from runs").fetchone()[0]


def fails_cleanly(capsys, ws: Workspace, argv: list[str], *expected: str) -> str:
    """Run `r1 argv`; assert it failed as a user error should, before anything started; return the line."""
    runs_before = ws.runs()
    capsys.readouterr()  # what the test's own set-up printed
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, (rc, out, err)
    assert "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("r1: "), err
    for text in expected:
        assert text in lines[0], (text, lines[0])
    assert ws.runs() == runs_before, "a run was made before the error"
    return lines[0]
