"""Threads that fit the cores: each process the project starts beside others gets a share of the machine's cores.

torch's CPU ops run on OpenMP (libgomp in the CPU wheels). An OpenMP thread that waits for work spins for a while
before it sleeps, which costs nothing while a process has the cores to itself and everything when processes together
want more threads than there are cores: the spinning takes the cores from the work. Measured on a 2-core AVX2 EPYC at
load 13, a loop of 300 small matmuls took 9.1-10.5 s with the default wait policy, 1.7 s with a passive one and
1.2 s with one thread.

So wherever the project starts processes that share a machine (sweep points, asynchronous sampler processes, the
training processes of one machine), each gets `share(processes)` threads and a passive wait policy (`thread_env`).
Ray sizes its actors itself (OMP_NUM_THREADS = the CPUs an actor asks for). A single process on an idle machine is
left as it is: all the cores, spinning waits.

A user overrides either by setting it: `OMP_NUM_THREADS` (and `MKL_NUM_THREADS`) or `OMP_WAIT_POLICY` in the
environment of the command win over these defaults, in every process it starts. The wait policy is read once, when
OpenMP loads (at `import torch`): it must be in a process's environment when it starts; the number of threads can
also be set later (`torch.set_num_threads`).

Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
WAIT_POLICY = "OMP_WAIT_POLICY"


def cpu_cores() -> int:
    """The cores this process may run on (its affinity where the system has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def share(processes: int, cores: int | None = None) -> int:
    """Threads for each of `processes` processes side by side on `cores` (this machine's): an equal share, at least 1."""
    return max(1, (cores or cpu_cores()) // max(1, processes))


def user_threads(environ: Mapping[str, str] | None = None) -> int | None:
    """The thread count the user set (OMP_NUM_THREADS), or None where it is unset or not a positive number."""
    value = (os.environ if environ is None else environ).get("OMP_NUM_THREADS", "")
    return int(value) if value.strip().isdigit() and int(value) > 0 else None


def thread_env(threads: int, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables a process started beside others gets: `threads` threads and a wait policy that does not spin,
    or what the user set instead (in `environ`, this process's environment by default)."""
    environ = os.environ if environ is None else environ
    threads = user_threads(environ) or threads  # MKL follows the user's OMP_NUM_THREADS where only that is set
    wanted = {**{var: str(threads) for var in THREAD_VARS}, WAIT_POLICY: "PASSIVE"}
    return {var: environ.get(var) or value for var, value in wanted.items()}


def shared_env(threads: int, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """`environ` (this process's by default) with `thread_env` in it: the whole environment of a child process."""
    environ = dict(os.environ if environ is None else environ)
    return {**environ, **thread_env(threads, environ)}


@contextlib.contextmanager
def children_share(threads: int) -> Iterator[None]:
    """Within the block, processes started from this one (multiprocessing's spawn copies `os.environ`) get
    `thread_env(threads)`; this process's environment is as it was after. Its own threads and wait policy do not
    change (its OpenMP has read them already)."""
    before = {var: os.environ.get(var) for var in (*THREAD_VARS, WAIT_POLICY)}
    os.environ.update(thread_env(threads))
    try:
        yield
    finally:
        for var, value in before.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
