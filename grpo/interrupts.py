"""Stopping a run on Ctrl-C or SIGTERM within seconds, its MLflow runs ended KILLED rather than FAILED.

A signal reaches Python's main thread only. A training loop runs there (Prefect runs a sync task in its caller's
thread), but rejection sampling's shard tasks run in a thread pool, and Prefect waits for every running one before
the flow can end: a shard that samples for minutes would hold the stop that long. So a thread doing such work
registers itself (`interruptible`), and when a stage is interrupted the same exception is raised in each of those
threads (`interrupt_threads`): it lands at the thread's next Python instruction, within a decoding step.

Within a flow run Prefect turns SIGTERM into its own `TerminationSignal`; `is_interrupt` counts it with
KeyboardInterrupt, so a run cancelled by a worker or killed by a scheduler is KILLED too.

Some calls must not stop halfway: a write to a SQLite tracking store stopped inside its transaction leaves the
database locked for the rest of the process, so the run could not even be ended KILLED. Inside
`signals_deferred` the main thread's stop waits for the block's end (a single database call: milliseconds), and so
do a SIGALRM and a SIGTERM handler someone else set: Prefect's time limit on a flow run (a stage's
`resources.timeout_s`) raises from the first, and an attempt past its limit that was stopped inside a write left
every later write "database is locked"; inside a flow run Prefect's own SIGTERM handler raises TerminationSignal,
which did the same to a sweep's point stopped by its sweep in the middle of a write.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_threads: set[int] = set()  # idents of threads inside `interruptible` work
_lock = threading.Lock()
# set by `stop_on_signals` once a stop signal arrived: whatever fails from then on is the stop's doing (a signal that
# lands inside `compile()` surfaces as a SystemError, not a KeyboardInterrupt, in CPython)
_stopping = threading.Event()
_deferring = 0  # depth of `signals_deferred` blocks open in the main thread
_deferred: list[int] = []  # a stop signal that arrived inside one, raised when the outermost ends


def is_interrupt(exc: BaseException) -> bool:
    """Whether `exc` means someone stopped the run (Ctrl-C, SIGTERM, a cancelled flow run), not that it failed."""
    if isinstance(exc, KeyboardInterrupt) or _stopping.is_set():
        return True
    # Prefect's TerminationSignal, named rather than imported: this module is plain Python, like the rest of grpo/
    return any(c.__name__ == "TerminationSignal" and c.__module__.startswith("prefect.")
               for c in type(exc).__mro__)


@contextmanager
def interruptible() -> Iterator[None]:
    """Mark the calling thread's work in the block as stoppable by `interrupt_threads`."""
    me = threading.get_ident()
    with _lock:
        _threads.add(me)
    try:
        yield
    finally:
        with _lock:
            _threads.discard(me)


def interrupt_threads() -> int:
    """Raise KeyboardInterrupt in every other thread inside `interruptible` work; returns how many."""
    me = threading.get_ident()
    with _lock:  # a thread cannot leave its block while this runs, so no exception lands outside one
        targets = [t for t in _threads if t != me]
        for ident in targets:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(KeyboardInterrupt))
        _threads.difference_update(targets)  # once is enough
    return len(targets)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """In the main thread, a stop signal that arrives within the block raises its KeyboardInterrupt at the block's
    end instead of inside it, and a SIGALRM or SIGTERM handler someone else set (a flow run's time limit, Prefect's
    TerminationSignal) runs there too (elsewhere signals do not land, and nothing changes). For short calls only."""
    global _deferring
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _deferring += 1
    holds = [_hold(sig) for sig in _HELD] if _deferring == 1 else []
    try:
        yield
    finally:
        _deferring -= 1
        arrived = [(hold[1], rang) for hold in holds if (rang := _release(hold)) is not None]
        if not _deferring and _deferred:
            _deferred.clear()
            raise KeyboardInterrupt
        for handler, rang in arrived:
            handler(*rang)  # the handler, now the call is whole: it raises its own error (the first one does)


# signals whose handler someone else may have set (Prefect's time limit, its TerminationSignal), held in the block
_HELD = tuple(getattr(signal, name) for name in ("SIGALRM", "SIGTERM") if hasattr(signal, name))


def _hold(sig: int):
    """(sig, its handler, the arrivals held) while a handler someone set is replaced by one that holds them; None
    where none is (SIG_DFL, SIG_IGN: nothing of Python's to run halfway) or the handler is `stop_on_signals`' own,
    which defers by itself."""
    handler = signal.getsignal(sig)
    if not callable(handler) or getattr(handler, "defers", False):
        return None
    held: list[tuple] = []
    signal.signal(sig, lambda signum, frame: held.append((signum, frame)))
    return sig, handler, held


def _release(hold) -> tuple | None:
    """Put a held handler back; the first arrival held, if one came."""
    if hold is None:
        return None
    sig, handler, held = hold
    signal.signal(sig, handler)
    return held[0] if held else None


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """In the main thread: SIGINT and SIGTERM raise KeyboardInterrupt once; signals after the first are ignored, so
    the clean-up the first one started (ending runs, stopping processes) is not itself interrupted."""
    received = []

    def handler(signum, frame):
        if received:
            return
        received.append(signum)
        _stopping.set()
        if _deferring:  # inside a call that must not stop halfway: raised when it ends
            _deferred.append(signum)
            return
        raise KeyboardInterrupt

    handler.defers = True  # type: ignore[attr-defined]  (signals_deferred leaves it in place)
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    _stopping.clear()
    _deferred.clear()
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        _stopping.clear()
        _deferred.clear()


def raise_if_stopping() -> None:
    """At a safe point of long work in the main thread (a training step's end): raise the stop again if one arrived.
    A signal handler runs wherever the main thread is, a finalizer (`__del__`) included, and Python only prints an
    exception raised there ("Exception ignored in ..."): a sweep's point stopped while a garbage-collected socket
    closed trained on until its sweep killed it. Signals after the first are ignored, so nothing else would."""
    if _stopping.is_set() and threading.current_thread() is threading.main_thread() and not _deferring:
        raise KeyboardInterrupt


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send this process `sig` when the process that started it exits (Linux's PR_SET_PDEATHSIG;
    elsewhere a no-op: the child outlives a killed parent, as any orphan would). Called in a child: between fork and
    exec (`preexec_fn`), or first thing in a multiprocessing target."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def alive(pid: int) -> bool:
    """Whether process `pid` is still there (one that started this one, say, where the parent is a fork server)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
