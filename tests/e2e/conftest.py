"""Fixtures of the end-to-end tests (real `r1` processes, servers, clusters). The session's environment and fixtures
are the root conftest's (tests/conftest.py); nothing is set up again here."""

from __future__ import annotations

import pytest

from processes import R1


@pytest.fixture
def r1(tmp_path):
    """`r1(*args)` starts a real `r1 args` on an embedded home of its own (tmp_path/home); every one started is
    killed when the test ends, whatever it found."""
    started = []

    def start(*args: str) -> R1:
        run = R1(tmp_path / "home", list(args))
        started.append(run)
        return run

    yield start
    for run in started:  # nothing is left behind, whatever the test found
        run.kill()
