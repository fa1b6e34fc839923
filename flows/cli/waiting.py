"""No silence over ten seconds while `r1` waits on something it cannot show progress for (the libraries loading, a
local server coming up): a line when the wait starts, and another every few seconds while it lasts."""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator

EVERY_S = 8.0  # under the ten seconds a person waits without a word


@contextmanager
def saying(what: str, every: float = EVERY_S, out=None) -> Iterator[None]:
    """Print `what` now, then "... still <what> (N s)" every `every` seconds until the block ends (a daemon thread:
    it prints between the block's bytecodes, imports included)."""
    out = out or sys.stdout
    print(what, file=out, flush=True)
    done = threading.Event()
    started = time.monotonic()

    def tick() -> None:
        while not done.wait(every):
            print(f"  ... still {what} ({time.monotonic() - started:.0f} s)", file=out, flush=True)

    ticker = threading.Thread(target=tick, name="r1-waiting", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
