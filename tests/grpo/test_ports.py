"""grpo.ports: a free port, from R1_PORTS's range when set, never the same one twice in a process."""

from __future__ import annotations

import socket

import pytest

from grpo import ports


def test_ports_come_from_the_range_asked_for_and_skip_one_in_use(monkeypatch):
    monkeypatch.setattr(ports, "_given", set())  # what this process was handed before does not count here
    for _ in range(50):  # a held port whose three neighbours are free now (the suite's servers take ports too)
        held = socket.socket()
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        if all(ports._bindable("127.0.0.1", p) for p in (taken + 1, taken + 2, taken + 3)):
            break
        held.close()
    with held:
        held.listen()
        monkeypatch.setenv(ports.ENV, f"{taken}-{taken + 3}")
        got = {ports.free_port() for _ in range(3)}
    assert got == {taken + 1, taken + 2, taken + 3}  # three different ports of the four, never the one held


def test_a_port_is_not_handed_out_twice_and_an_exhausted_range_says_so(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv(ports.ENV, f"{port}-{port}")
    monkeypatch.setattr(ports, "_given", set())
    assert ports.free_port() == port
    with pytest.raises(RuntimeError, match=f"no free port in R1_PORTS={port}-{port}"):
        ports.free_port()


@pytest.mark.parametrize("value", ["20000", "a-b", "30000-20000", "0-10"])
def test_a_malformed_range_is_an_error_naming_what_was_expected(monkeypatch, value):
    monkeypatch.setenv(ports.ENV, value)
    with pytest.raises(ValueError, match="R1_PORTS"):
        ports.free_port()


def test_without_a_range_the_kernel_picks(monkeypatch):
    monkeypatch.delenv(ports.ENV, raising=False)
    first, second = ports.free_port(), ports.free_port()
    assert first != second and all(1024 <= p <= 65535 for p in (first, second))
