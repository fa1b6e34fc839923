"""A process's start-up without the cyclic garbage collector: its imports a sixth cheaper, its collections after
them shorter.

Every process the project starts (`r1`, a sweep's point, a launched loop's worker, a flow run's process) first imports
torch, transformers, MLflow or Prefect: about 700k Python objects, and about 400k more that are garbage by the
time the imports end. CPython's collector runs over and over while they are made (each full collection walks every
object alive), and after the imports each full collection still walks the 700k modules, classes and functions that
live as long as the process. Measured on a 2-core Zen 4 (AMD EPYC, AVX-512, Python 3.11), the libraries an `r1 run`
loads: 6.6-6.8 s of CPU with the collector on; 5.0-5.2 s with it off, and 0.57 s more for one collection at the end.
A whole `r1 run` of a 4-step tiny stage: 14.6 -> 12.1 s of CPU, 12.0 -> 8.7 s wall (`farm-bench`, median of 5;
docs/benchmarks/test-suite.md).

So an entry point calls `defer_collection()` first and `imports_done()` once its libraries are loaded and before it
builds a model or reads data: one collection frees the imports' garbage, `gc.freeze()` moves every object alive then
out of the collector's view for good (modules, classes and functions are never freed anyway), and the collector is
back on for the work. Nothing made after that is frozen: a model or a dataset stays collectable.

A child forked in between (before the exec of a subprocess, or a fork start method) gets the collector back on.
"""

from __future__ import annotations

import gc
import os

_deferred = False  # set by `defer_collection` until `imports_done` (or `collection_back`)
_frozen = False  # `imports_done` ran: this process's start-up is over, later calls change nothing


def _in_child() -> None:
    if _deferred:
        gc.enable()


os.register_at_fork(after_in_child=_in_child)


def defer_collection() -> None:
    """Turn the cyclic collector off while this process imports its libraries (until `imports_done`). Does nothing
    where the collector is off already (someone else's choice, kept) or once `imports_done` has run: objects made
    after the start-up may be freed in cycles, and a second freeze would keep them for good."""
    global _deferred
    if gc.isenabled() and not _frozen:
        gc.disable()
        _deferred = True


def imports_done() -> None:
    """After a `defer_collection()`: collect once, freeze every object alive now (`gc.freeze`) and turn the collector
    back on. Call it before the process builds anything it means to free. Does nothing without a deferral."""
    global _deferred, _frozen
    if _deferred:
        gc.collect()
        gc.freeze()
        _deferred, _frozen = False, True
        gc.enable()


def collection_back() -> None:
    """The collector on again, nothing frozen: where a command ends without having reached its work."""
    global _deferred
    if _deferred:
        _deferred = False
        gc.enable()
