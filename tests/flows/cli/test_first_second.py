"""The first second of `r1 run`: what it will run and where its runs go is said, and a bad recipe or data file is told
in one line, before torch, Prefect or MLflow is imported (those take seconds to load on a small machine).

Each case runs `r1` as a user starts it, in a process of its own, with an import hook that ends the process at the
first import of one of those libraries and names it: what `r1` printed by then is all a user sees in its first
seconds. (benchmarks/cli_first_second.py times the same moments.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[3]
HEAVY = ("torch", "prefect", "mlflow")
STOPPED = 3  # the exit code of a process the hook ended

STOP_AT_HEAVY = f"""
import os, sys

heavy = {set(HEAVY)!r}
assert not heavy & {{m.partition(".")[0] for m in sys.modules}}, "imported before r1 started"


class StopAtHeavy:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in heavy:
            sys.stdout.flush()
            sys.stderr.write(f"imported {{name}}\\n")
            sys.stderr.flush()
            os._exit({STOPPED})
        return None


sys.meta_path.insert(0, StopAtHeavy())
from flows.cli.r1 import main

sys.exit(main(sys.argv[1:]))
"""


def r1_until_heavy(ws, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_HOME": str(ws.root / "prefect")}
    return subprocess.run([sys.executable, "-c", STOP_AT_HEAVY, *argv], env=env, capture_output=True, text=True,
                          timeout=120)


def told_in_one_line(proc: subprocess.CompletedProcess, *expected: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)  # not STOPPED: nothing heavy loaded
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("r1: "), proc.stderr
    for text in expected:
        assert text in lines[0], (text, lines[0])


def test_the_first_line_says_what_runs_and_where_before_any_heavy_import(ws):
    proc = r1_until_heavy(ws, "run", "--recipe", ws.recipe(), "--stages", "cold_start_sft,reasoning_grpo")
    assert proc.returncode == STOPPED, (proc.stdout, proc.stderr)  # the checks passed; the run's libraries come next
    first = proc.stdout.splitlines()[0]
    assert first.startswith("recipe small (") and "stages cold_start_sft, reasoning_grpo;" in first, first
    assert f"MLflow at sqlite:///{ws.db}" in first and f"state folder {ws.home}" in first, first
    assert proc.stderr.startswith("imported "), proc.stderr
    # the libraries' seconds of loading are announced before they start (and ticked while they last: test_waiting)
    assert proc.stdout.splitlines()[-1] == "loading Prefect, MLflow, torch and transformers", proc.stdout


def _write(path: Path, rows: list[dict]) -> str:
    import pandas as pd

    frame = pd.DataFrame(rows)
    if path.suffix == ".jsonl":
        frame.to_json(path, orient="records", lines=True)
    elif path.suffix == ".csv":
        frame.to_csv(path, index=False)
    else:
        frame.to_parquet(path)
    return str(path)


def test_a_bad_recipe_value_or_data_file_is_told_before_any_heavy_import(ws):
    cases = {  # what is wrong: (the recipe's sections, flags), what the line names
        "an unknown field": ({"cold_start_sft__train__max_stpes": 3}, [],
                             ["cold_start_sft.train.max_stpes", "did you mean 'max_steps'"]),
        "a bad value": ({}, ["--set", "reasoning_grpo.grpo.optimizer.learning_rate=fast"],
                        ["reasoning_grpo.grpo.optimizer.learning_rate", "'fast'"]),
    }
    for suffix in (".jsonl", ".csv", ".parquet"):
        path = _write(ws.root / f"cold{suffix}", [{"prompt": "2+2?", "completion": "4"}])
        cases[f"a {suffix} file without a column"] = (
            {"cold_start_sft__data": {"source": path}}, [],
            [f"cold_start_sft.data: {path}", "missing column(s) ['response']"])
    for case, (sections, flags, expected) in cases.items():
        proc = r1_until_heavy(ws, "run", "--recipe", ws.recipe(**sections), *flags)
        told_in_one_line(proc, *expected)
        if sections.get("cold_start_sft__data"):  # a readable recipe: what it was about to run came first
            assert "stages cold_start_sft, reasoning_grpo, rejection_sampling, sft, alignment_grpo;" in proc.stdout, \
                (case, proc.stdout)


def test_a_bad_row_is_told_with_its_file_row_and_column_before_any_heavy_import(ws):
    path = _write(ws.root / "rl.jsonl", [{"prompt": "2+2?", "answer": "4"}, {"prompt": "3+3?", "answer": ""}])
    told_in_one_line(r1_until_heavy(ws, "stage", "reasoning_grpo", "--recipe",
                                    ws.recipe(reasoning_grpo__data={"source": path}), "--checkpoint", path),
                     f"reasoning_grpo.data: {path}: row 1, column 'answer'")
