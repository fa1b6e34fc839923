"""A wait `r1` cannot show progress for is said when it starts and ticked while it lasts (flows.cli.waiting)."""

import io
import time

from flows.cli.waiting import saying


def test_a_wait_is_said_at_once_then_ticked_until_it_ends():
    out = io.StringIO()
    with saying("loading the libraries", every=0.05, out=out):
        assert out.getvalue() == "loading the libraries\n"  # said before the wait, not after its first tick
        time.sleep(0.3)
    lines = out.getvalue().splitlines()
    ticks = lines[1:]
    assert 3 <= len(ticks) <= 6, lines  # 0.3 s at one tick each 0.05 s, give or take a scheduler's slice
    assert all(t.startswith("  ... still loading the libraries (") and t.endswith(" s)") for t in ticks), lines
    time.sleep(0.15)
    assert out.getvalue().splitlines() == lines  # nothing once the block has ended


def test_a_wait_that_fails_stops_ticking():
    out = io.StringIO()
    try:
        with saying("starting", every=0.05, out=out):
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    said = out.getvalue()
    time.sleep(0.15)
    assert out.getvalue() == said == "starting\n"
