"""A free TCP port for a server, a rendezvous or a cluster node this machine starts.

By default the kernel picks one (bind to port 0), from the ephemeral range outgoing connections also draw from.
`R1_PORTS=LOW-HIGH` makes every port this project picks come from that range instead: for a machine whose firewall
opens only some ports, or for processes side by side that must never pick the same port (the test session gives
each of its workers a range of its own, below the ephemeral range, so a port one worker chose but has not bound
yet is never handed to the other, nor taken by a connection). A port handed out once is not handed out again by
the same process.
"""

from __future__ import annotations

import os
import random
import socket

ENV = "R1_PORTS"
_given: set[int] = set()


def port_range(value: str | None = None) -> tuple[int, int] | None:
    """The range `R1_PORTS` names, or None when unset; a malformed value is an error naming what was expected."""
    value = os.environ.get(ENV, "") if value is None else value
    if not value.strip():
        return None
    try:
        low, high = (int(part) for part in value.split("-"))
    except ValueError:
        raise ValueError(f"{ENV}={value!r}: expected LOW-HIGH, two port numbers, e.g. 20000-25999") from None
    if not 1 <= low <= high <= 65535:
        raise ValueError(f"{ENV}={value!r}: expected 1 <= LOW <= HIGH <= 65535")
    return low, high


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (it may be taken before the caller binds it: start the server soon)."""
    bounds = port_range()
    if bounds is None:
        for _ in range(100):
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in _given:
                break
        _given.add(port)
        return port
    low, high = bounds
    candidates = [p for p in random.sample(range(low, high + 1), min(high - low + 1, 4096)) if p not in _given]
    for port in candidates:
        if _bindable(host, port):
            _given.add(port)
            return port
    raise RuntimeError(f"no free port in {ENV}={low}-{high} on {host}: widen the range or stop what holds it")
