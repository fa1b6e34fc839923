"""flows/stages.py's run-name functions, which Prefect calls first as a flow run starts: in a flow run's own process
(a process worker's `python -m prefect.engine`) they end the start-up that flows/__init__.py began without the cyclic
collector (grpo.startup)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# as `python -m prefect.engine` sees itself (the engine then imports the flow's module and names its run)
AS_THE_ENGINE = """
import gc, sys, types
sys.modules["__main__"].__spec__ = types.SimpleNamespace(name="prefect.engine")
import flows.stages
off = not gc.isenabled()
name = flows.stages.run_name("cold_start_sft")()
print(off, gc.isenabled(), gc.get_freeze_count() > 0, name)
"""
ELSEWHERE = "import gc, flows.stages; print(gc.isenabled(), gc.get_freeze_count())"


def test_a_flow_run_process_imports_the_stages_without_the_collector_and_has_it_back_once_its_run_is_named():
    def run(code: str) -> str:
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.split()

    assert run(AS_THE_ENGINE) == ["True", "True", "True", "cold_start_sft"]
    assert run(ELSEWHERE) == ["True", "0"]  # any other process that imports the flows: left as it was
