"""grpo.startup: the collector off while a process imports, one collection and a freeze once it is done, never again
after; a child forked in between gets it back. Each check in a fresh interpreter of its own (the tests' own
processes have frozen their start-up already)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHECKS = """
import gc, os, weakref
from grpo import startup

assert gc.isenabled()
startup.defer_collection()
assert not gc.isenabled()

class Node:  # garbage in a cycle, made while the collector is off
    pass
a, b = Node(), Node()
a.other, b.other = b, a
refs = [weakref.ref(a), weakref.ref(b)]
del a, b
kept = [Node() for _ in range(1000)]  # alive: a module's objects, say

pid = os.fork()
if pid == 0:  # a child forked before the start-up ended has the collector on
    os._exit(0 if gc.isenabled() else 1)
assert os.waitpid(pid, 0)[1] == 0, "the forked child's collector was off"
assert not gc.isenabled() and all(r() is not None for r in refs)  # no collection yet

startup.imports_done()
assert gc.isenabled()
assert gc.get_freeze_count() >= len(kept)  # what was alive is frozen
assert all(r() is None for r in refs)  # the cycle was collected before the freeze, not kept for good

startup.defer_collection()  # after the start-up: nothing changes, nothing is frozen again
assert gc.isenabled()
frozen = gc.get_freeze_count()
startup.imports_done()
assert gc.get_freeze_count() == frozen

gc.disable()  # someone else turned it off: kept off
startup.defer_collection(); startup.collection_back()
assert not gc.isenabled()
print("ok")
"""


def test_the_collector_is_off_during_start_up_and_on_after_with_the_imports_frozen():
    done = subprocess.run([sys.executable, "-c", CHECKS], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_a_command_that_ends_before_its_work_turns_the_collector_back_on_without_freezing():
    code = ("import gc; from grpo import startup; startup.defer_collection(); startup.collection_back(); "
            "assert gc.isenabled() and gc.get_freeze_count() == 0; "
            "startup.defer_collection(); assert not gc.isenabled(); print('ok')")  # still a start-up: defers again
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
