"""The code reward's settings: how a completion's program is run against its row's tests (grpo.rewards.code).

Plain pydantic, a section of the GRPO and rejection settings (grpo.configs.training, grpo.configs.rejection).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


CODE_LANGUAGES = ("python",)  # what the sandbox can run (a `language` column, or `code.language`)


class CodeConfig(BaseModel):
    """The code reward: how a completion's program is run against its row's tests (grpo.rewards.code).

    Each test runs in its own sandbox (grpo.rewards.sandbox); the limits are per test, like a programming judge's.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    all_or_nothing: bool = False  # score 1.0 only when every test passes (else 0.0); off: the fraction passed
    language: Literal[CODE_LANGUAGES] = "python"  # the programs' language: Python only for now
    cpu_time_s: float = Field(2.0, gt=0)  # CPU seconds per process of a test
    wall_time_s: float = Field(5.0, gt=0)  # wall-clock seconds per test; then everything it started is killed
    memory_mb: int = Field(1024, ge=64)  # address space per process, in MiB
    max_processes: int = Field(32, ge=4)  # processes and threads at once (the sandbox itself takes 3)
    max_open_files: int = Field(64, ge=8)  # file descriptors per process
    max_output_bytes: int = Field(1 << 20, ge=1024)  # stdout beyond this fails the test
    max_file_bytes: int = Field(16 << 20, ge=1)  # largest file a program may write; also its folder's size
    python: str = "python3"  # the sandbox's interpreter: a path, or a name found in /usr/local/bin, /usr/bin, /bin
    workers: int = Field(0, ge=0)  # tests run at once; 0 = one per core this process may use
    # a test killed for wall time runs once more, alone, with rerun_factor times its limit, before it fails: a busy
    # machine's slowness is not the program's. Reruns of one call take at most rerun_budget_s between them; a test
    # left without its rerun is ungraded (timeout_under_load), neither passed nor failed
    rerun_factor: float = Field(2.0, ge=1)
    rerun_budget_s: float = Field(120.0, ge=0)
