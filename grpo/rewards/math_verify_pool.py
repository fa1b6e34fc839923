"""The symbolic check: math-verify in a process pool under the project's own timeout.

math-verify's own timeout uses `signal.alarm`, which fails off the main thread (Prefect runs tasks in threads), so
the check runs in worker processes (or, where those cannot start, in threads with no hard limit). The pool is the
only module-level state in the rewards package. Must not depend on torch, Prefect or MLflow.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Iterable, Sequence
from contextlib import contextmanager, nullcontext
from itertools import product
from typing import Any

from grpo.rewards.answers import LATEX_COMMAND_RE, LATEX_DELIMITERS, PROSE_WORD_RE

logger = logging.getLogger(__name__)



def prepare_for_math_verify(text: str) -> str:
    """The string handed to ``math_verify.parse`` for an extracted answer or a reference.

    math-verify only reads LaTeX inside math delimiters: a bare ``\\frac13`` or
    ``\\sqrt{2}`` parses to nothing. So bare math is wrapped in ``$…$``; text
    that already has delimiters, or reads as prose (a word of 4+ letters outside
    LaTeX commands, e.g. "The answer is 5"), is passed as is so math-verify's
    own answer anchors apply.
    """
    s = text.strip()
    if s.endswith(".") and not s.endswith(".."):
        s = s[:-1].rstrip()
    if not s or any(d in s for d in LATEX_DELIMITERS):
        return s
    if PROSE_WORD_RE.search(LATEX_COMMAND_RE.sub(" ", s)):
        return s
    return f"${s}$"


class _DropTimeoutDisabledNotice(logging.Filter):
    """math-verify warns once that its timeout is off; ours applies instead (see _SymbolicPool)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledNotice())

# Verdict codes exchanged with the worker processes (small ints pickle cheaply). The last three are no verdict, each
# for what happened: the check ran past its time, raised, or lost its worker process (the pool broke)
EQUAL, DIFFERENT, TIMEOUT, BAD_REFERENCE, RAISED, CRASHED = 1, 0, -1, -2, -3, -4


class _SymbolicTimeout(BaseException):
    """Raised by our alarm. A BaseException so math-verify's ``except Exception`` cannot swallow it."""


@contextmanager
def _time_limit(seconds: float):
    """SIGALRM-based limit; only used in the pool's worker processes, where
    tasks run on the main thread (signals cannot be used elsewhere)."""

    def _raise(signum, frame):
        raise _SymbolicTimeout

    previous = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@functools.lru_cache(maxsize=4096)
def _mv_parse(text: str) -> tuple:
    """math-verify's parse, cached: the G completions of a GRPO group share one
    reference, and a parse (sympy expressions, immutable) is deterministic."""
    import math_verify

    # parsing_timeout=None: math-verify's signal.alarm fails off the main thread;
    # the caller imposes the time limit instead.
    return tuple(math_verify.parse(prepare_for_math_verify(text), parsing_timeout=None))


def _probe_values(symbols: Iterable[Any]) -> dict:
    """Deterministic positive rational values per symbol *name* (same name, same value)."""
    import sympy

    names = sorted({s.name for s in symbols})
    by_name = {n: sympy.Rational(13 + 7 * i, 11 + 2 * i) for i, n in enumerate(names)}
    return {s: by_name[s.name] for s in symbols}


def _is_elementary(expr: Any) -> bool:
    """A plain sympy Expr built from numbers, symbols, + * ^, pi, e, exp/log/trig."""
    import sympy
    from sympy.matrices.expressions import MatrixExpr

    allowed = (
        sympy.Add, sympy.Mul, sympy.Pow, sympy.Rational, sympy.Float, sympy.Symbol,
        sympy.core.numbers.NumberSymbol, sympy.exp, sympy.log, sympy.sin, sympy.cos, sympy.tan,
    )  # fmt: skip
    if not isinstance(expr, sympy.Expr) or isinstance(expr, (sympy.Symbol, MatrixExpr)):
        return False  # top-level Symbols get math-verify's name-based comparison
    return all(isinstance(node, allowed) for node in sympy.preorder_traversal(expr))


def _clearly_different(gold: Any, pred: Any) -> bool:
    """True only if gold and pred provably differ numerically, so verify() must say False.

    This skips math-verify's slow ``simplify(gold - pred)`` for wrong answers.
    Soundness: for elementary expressions, verify() is True only when they are
    equal as strings, equal after 6-decimal rounding, or ``simplify(a-b) == 0``;
    all three imply (near-)equal values at any point of the common domain. A
    real gap far beyond the rounding tolerance at one probe point rules them
    out. Anything else (sets, relations, percentages, symbols compared by name,
    complex or undefined values) returns False and goes to verify().
    """
    import sympy

    try:
        if not (_is_elementary(gold) and _is_elementary(pred)):
            return False
        subs = _probe_values(gold.free_symbols | pred.free_symbols)
        a = gold.evalf(30, subs=subs)
        b = pred.evalf(30, subs=subs)
        if not all(isinstance(v, (sympy.Float, sympy.Rational)) and v.is_finite for v in (a, b)):
            return False
        gap = abs(a - b)
        return bool(gap > 2e-6 + 1e-12 * max(abs(a), abs(b)))
    except Exception:
        return False


def _parsed_match(gold_parsed: list, pred_parsed: list) -> bool:
    """``math_verify.verify(gold, pred)`` with the provably-False pairs skipped.

    verify() on lists is ``any(compare(g, t) for g, t in product(gold, pred))``;
    calling it pair by pair keeps exactly those semantics.
    """
    import math_verify

    for g, t in product(gold_parsed, pred_parsed):
        if _clearly_different(g, t):
            continue
        if math_verify.verify(g, t, timeout_seconds=None):  # timeout: see _mv_parse
            return True
    return False


def _check_group(gold: str, preds: Sequence[str | None], timeout_s: float, use_alarm: bool) -> list[int]:
    """Verdict codes for one reference against several predictions (gold parsed once).

    ``None`` in ``preds`` asks only whether the reference parses.
    """
    limit = (lambda: _time_limit(timeout_s)) if use_alarm else nullcontext
    try:
        with limit():
            gold_parsed = _mv_parse(gold)
    except _SymbolicTimeout:
        return [TIMEOUT] * len(preds)
    except Exception:  # a BaseException, the alarm is not caught here
        logger.warning("symbolic check of the reference %r raised", gold, exc_info=True)
        return [RAISED] * len(preds)
    if not gold_parsed:
        return [BAD_REFERENCE] * len(preds)
    codes = []
    for pred in preds:
        if pred is None:
            codes.append(DIFFERENT)
            continue
        try:
            with limit():
                # Same string, same parse: reuse the reference's (parse is deterministic).
                pred_parsed = gold_parsed if pred == gold else _mv_parse(pred)
                equal = _parsed_match(gold_parsed, pred_parsed)
            code = EQUAL if equal else DIFFERENT  # outside the with: the alarm may fire in its exit
        except _SymbolicTimeout:
            code = TIMEOUT
        except Exception:  # this pair alone: the others of the group keep their verdicts
            logger.warning("symbolic check of %r against %r raised", pred, gold, exc_info=True)
            code = RAISED
        codes.append(code)
    return codes


# A unit of work for one worker: (reference, [predictions]) groups.
_Chunk = list[tuple[str, list[str | None]]]


def _check_chunk(groups: _Chunk, timeout_s: float) -> list[list[int]]:
    """Worker-process entry point: each parse/verify under a SIGALRM limit."""
    return [_check_group(gold, preds, timeout_s, use_alarm=True) for gold, preds in groups]


def _init_worker() -> None:
    """Pool initializer: pay math-verify's import and first-parse costs once per worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    # Warm math-verify's parser (its ANTLR DFA cache fills with use) on common answer shapes.
    for gold, pred in _WARMUP_PAIRS:
        _parsed_match(_mv_parse(gold), _mv_parse(pred))


_WARMUP_PAIRS = (
    ("\\frac{1}{2}", "0.5"),
    ("2\\sqrt{3}", "\\sqrt{12}"),
    ("x^2+3x", "x(x+3)"),
    ("\\frac{\\pi}{3}", "60^\\circ"),
    ("(1,2)", "\\{1,2\\}"),
    ("x=5", "5"),
)


def _worker_ready() -> bool:
    return True


_MATH_VERIFY_READY = threading.Event()


def _import_math_verify() -> None:
    if not _MATH_VERIFY_READY.is_set():
        import math_verify  # noqa: F401

        _MATH_VERIFY_READY.set()


def _check_in_thread(gold: str, pred: str | None, timeout_s: float) -> int:
    """The default symbolic check: a daemon thread per pair, waited on for at most 2 x timeout_s.

    Threads, not the process pool, by default: they need no `if __name__ == "__main__"` guard in the calling
    script and no worker start-up (seconds, or a minute on a busy machine, inside a training step). A thread
    cannot be killed, so a pathological pair keeps burning CPU in the background after its timeout; the caller
    still gets its verdict (0.0) on time. The process backend kills stuck checks and spreads them over cores.
    """
    _import_math_verify()  # a first import takes seconds: keep it outside the timed check
    result: list[int] = []

    def run() -> None:
        try:
            result.extend(_check_group(gold, [pred], timeout_s, use_alarm=False))
        except Exception:  # never let a worker error escape; a check that raised, not one that ran out of time
            logger.exception("symbolic check failed")
            result.append(RAISED)

    thread = threading.Thread(target=run, name="accuracy-reward-symbolic", daemon=True)
    thread.start()
    thread.join(2 * timeout_s)  # reference parse + prediction check
    return result[0] if result else TIMEOUT


class _SymbolicPool:
    """Lazily created, reused process pool for the math-verify check.

    Why processes, not threads: math-verify's own timeout is signal.alarm,
    which only works on the main thread, and Prefect runs tasks in worker
    threads. A hung thread can never be killed, a process can. Each worker
    runs tasks on its own main thread, so there a SIGALRM limit interrupts a
    slow parse/simplify per pair (and lets the worker move on). If a worker is
    stuck where signals cannot reach (inside C code), the caller's backstop
    wait expires and the whole pool is killed and replaced.

    "spawn" rather than "fork": forking a process that already runs threads
    (Prefect, torch) can deadlock the child.
    """

    _STARTUP_GRACE_S = 60.0  # spawning workers imports sympy: slow on a busy box
    _BACKSTOP_SLACK_S = 10.0
    _MAX_BREAKS = 3  # after this many broken pools, use threads

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._executor: cf.ProcessPoolExecutor | None = None
        self._breaks = 0
        self._warm = False  # some task has completed on the current executor

    @staticmethod
    def workers() -> int:
        return max(1, int(os.environ.get("R1_REWARD_WORKERS", min(4, os.cpu_count() or 1))))

    def _get(self) -> tuple[cf.ProcessPoolExecutor | None, bool]:
        """(executor or None when processes are unavailable, whether it may still be starting)."""
        with self._lock:
            if self._breaks >= self._MAX_BREAKS:
                return None, False
            if self._executor is not None:
                return self._executor, not self._warm
            self._warm = False
            try:
                self._executor = cf.ProcessPoolExecutor(
                    max_workers=self.workers(),
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_init_worker,
                )
                # Workers are spawned on demand; start them all now, in parallel,
                # rather than one by one inside later (timed) checks.
                for _ in range(self.workers()):
                    self._executor.submit(_worker_ready)
            except Exception:
                logger.warning("cannot create a process pool; symbolic checks use threads", exc_info=True)
                self._breaks = self._MAX_BREAKS
                if self._executor is not None:
                    self._executor.shutdown(wait=False, cancel_futures=True)
                    self._executor = None
                return None, False
            return self._executor, True

    def _discard(self, executor: cf.ProcessPoolExecutor, *, broken: bool) -> None:
        """Kill the pool's processes (the only way to stop a stuck check) and forget it."""
        with self._lock:
            if self._executor is executor:
                self._executor = None
                self._breaks += int(broken)
        # concurrent.futures has no public kill: terminate the workers directly.
        for process in list(getattr(executor, "_processes", {}).values()):
            try:
                process.kill()
            except Exception:
                pass
        executor.shutdown(wait=False, cancel_futures=True)

    def shutdown(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)

    def run(self, chunks: list[_Chunk], timeout_s: float, retry: bool = True) -> list[list[list[int]] | int]:
        """Per chunk, its verdict codes; or one code for a chunk that gave none, saying why: TIMEOUT (stuck past
        the backstop, the pool killed), CRASHED (a worker died, and again in a fresh pool), RAISED."""
        executor, starting = self._get()
        if executor is None:
            return [_run_chunk_in_threads(chunk, timeout_s) for chunk in chunks]
        try:
            futures = [executor.submit(_check_chunk, chunk, timeout_s) for chunk in chunks]
        except Exception:  # e.g. a daemonic process may not have children
            logger.warning("process pool unusable; symbolic checks use threads", exc_info=True)
            self._discard(executor, broken=True)
            with self._lock:
                self._breaks = self._MAX_BREAKS
            return [_run_chunk_in_threads(chunk, timeout_s) for chunk in chunks]

        # Every pair is bounded by the in-worker alarm; this backstop only fires
        # if a worker ignores it. It assumes the worst case: all units serial.
        units = sum(len(preds) + 1 for chunk in chunks for _, preds in chunk)
        budget = self._BACKSTOP_SLACK_S + timeout_s * units + (self._STARTUP_GRACE_S if starting else 0.0)
        _, not_done = cf.wait(futures, timeout=budget)
        if not_done:
            logger.warning("symbolic check stuck past %.0fs; killing the worker pool", budget)
            self._discard(executor, broken=False)

        results: list[list[list[int]] | int] = []
        broken = []
        for i, future in enumerate(futures):
            if future in not_done:
                results.append(TIMEOUT)
                continue
            try:
                results.append(future.result())
                self._warm = True
            except cf.process.BrokenProcessPool:
                broken.append(i)
                results.append(CRASHED)
            except Exception:
                logger.exception("symbolic check failed")
                results.append(RAISED)
        if broken:
            self._discard(executor, broken=True)
            if retry:  # one fresh pool for the chunks a crash took down
                retried = self.run([chunks[i] for i in broken], timeout_s, retry=False)
                for i, result in zip(broken, retried):
                    results[i] = result
        return results


def _run_chunk_in_threads(chunk: _Chunk, timeout_s: float) -> list[list[int]]:
    return [[_check_in_thread(gold, pred, timeout_s) for pred in preds] for gold, preds in chunk]


_POOL = _SymbolicPool()


def shutdown_symbolic_pool() -> None:
    """Stop the worker processes (a later check starts new ones)."""
    _POOL.shutdown()


def symbolic_verdicts(pairs: Sequence[tuple[str, str | None]], timeout_s: float, backend: str) -> list[int]:
    """Verdict codes for unique (reference, prediction) pairs, in order."""
    if not pairs:
        return []
    if backend == "thread":
        return [_check_in_thread(g, p, timeout_s) for g, p in pairs]
    # Sort by reference so each worker parses a reference once for its group,
    # then cut into a few contiguous chunks to spread over the workers.
    order = sorted(range(len(pairs)), key=lambda i: pairs[i][0])
    n_chunks = min(len(order), 2 * _POOL.workers())
    bounds = [round(k * len(order) / n_chunks) for k in range(n_chunks + 1)]
    chunks, chunk_index = [], []
    for lo, hi in zip(bounds, bounds[1:]):
        groups: dict[str, list[str | None]] = {}
        index: dict[str, list[int]] = {}
        for i in order[lo:hi]:
            gold, pred = pairs[i]
            groups.setdefault(gold, []).append(pred)
            index.setdefault(gold, []).append(i)
        chunks.append(list(groups.items()))
        chunk_index.append(list(index.values()))
    codes = [TIMEOUT] * len(pairs)
    for result, idx_groups in zip(_POOL.run(chunks, timeout_s), chunk_index):
        if isinstance(result, int):  # the chunk gave no verdicts: each pair of it takes the reason why
            for i in (i for idxs in idx_groups for i in idxs):
                codes[i] = result
            continue
        for group_codes, idxs in zip(result, idx_groups):
            for code, i in zip(group_codes, idxs):
                codes[i] = code
    return codes
