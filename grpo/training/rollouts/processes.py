"""Asynchronous rollouts on this machine: the samplers as processes (`rollout.launcher: process`, the default).

Each worker is forked from a server process that imported torch and this module once (multiprocessing's forkserver,
where the system has it), beats a heartbeat from a thread, reads pushed weights from two copies in shared memory
(`SharedWeights`) and writes whole units into a pipe that the trainer reads in a thread of its own per worker
(`_read`): a worker stopped halfway through a unit holds up nobody. It dies with the trainer (PR_SET_PDEATHSIG and a
check of its parent).

Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import os
import pickle
import queue
import signal
import threading
import time
from contextlib import suppress
from multiprocessing.connection import Connection
from typing import NamedTuple, Sequence

import torch

from grpo import cores
from grpo.configs.rollout import RolloutConfig
from grpo.interrupts import alive, die_with_parent
from grpo.training.rollouts.base import Rollouts
from grpo.training.rollouts.protocol import (HEARTBEAT_S, POLL_S, STARTUP_S, Plan, Unit, fault, sample_steps,
                                             sampler_model)

class SharedWeights:
    """Two copies of a model's parameters in shared memory, each with the version it holds (-1 while written)."""

    def __init__(self, model: torch.nn.Module, ctx):
        self.names = [n for n, _ in model.named_parameters()]
        self.copies = [{n: p.detach().to("cpu", copy=True).share_memory_() for n, p in model.named_parameters()}
                       for _ in range(2)]
        self.versions = ctx.Array("q", [-1, -1], lock=False)

    def write(self, model: torch.nn.Module, version: int) -> None:
        """Trainer side: the model's weights as `version`, into the copy not holding the newest."""
        i = 0 if self.versions[0] < self.versions[1] else 1
        self.versions[i] = -1
        with torch.no_grad():
            for n, p in model.named_parameters():
                self.copies[i][n].copy_(p.detach())
        self.versions[i] = version

    def newest(self) -> int:
        return max(self.versions[0], self.versions[1])

    def read_into(self, model: torch.nn.Module) -> int:
        """Worker side: the newest complete copy into `model`; its version (read again if overwritten meanwhile)."""
        params = dict(model.named_parameters())
        while True:
            i = 0 if self.versions[0] > self.versions[1] else 1
            version = self.versions[i]
            if version < 0:
                time.sleep(POLL_S)
                continue
            with torch.no_grad():
                for n in self.names:
                    params[n].copy_(self.copies[i][n])
            if self.versions[i] == version:
                return version


def _heartbeat(beats, index: int, parent: int, stop: threading.Event) -> None:
    while not stop.is_set():
        beats[index] = time.time()
        if not alive(parent):  # the trainer is gone, where PR_SET_PDEATHSIG is not there (or names the fork server)
            os._exit(1)
        stop.wait(HEARTBEAT_S)


def process_stopped(pid: int | None) -> bool:
    """Whether the system says process `pid` is stopped (SIGSTOP, or stopped under a debugger): Linux's
    /proc/<pid>/stat; False where it cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def worker_context() -> mp.context.BaseContext:
    """Forked from a server that imported this module once where the system has one (Linux), spawned elsewhere."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])  # read when the server starts: torch and the model's code, once
    return ctx


def _worker_main(index: int, slot: int, plan: Plan, skeleton: torch.nn.Module, tokenizer, shared: SharedWeights,
                 beats, out: Connection, first: int, workers: int, device: str, threads: int, parent: int,
                 environ: dict[str, str]) -> None:
    """One sampler process: its steps in order, each sampled once weights new enough are in."""
    os.environ.clear()  # the trainer's environment when it started this worker (a fork server's is its own)
    os.environ.update(environ)
    die_with_parent(signal.SIGKILL)  # the kernel kills this process when its parent exits (trainer or fork server)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle: it stops the workers
    torch.set_num_threads(threads)
    stop = threading.Event()
    threading.Thread(target=_heartbeat, args=(beats, slot, parent, stop), daemon=True).start()
    torch.ones(2**10).sum()  # the first parallel region on the main thread (see grpo.sampling.batcher)
    fault("start")
    model, engine = sampler_model(plan, skeleton, tokenizer, device)
    del skeleton
    # units leave through a thread, so the next step samples while the trainer has not yet read the last one
    outbox: queue.Queue = queue.Queue()
    sender = threading.Thread(target=_send, args=(outbox, out), daemon=True)
    sender.start()
    sample_steps(index, plan, model, engine, shared, lambda unit: outbox.put(pickle.dumps(unit)), first, workers)
    outbox.put(None)
    sender.join()
    fault("shutdown")
    stop.set()


def _send(outbox: queue.Queue, out: Connection) -> None:
    while (item := outbox.get()) is not None:
        fault("before-send")
        fault("mid-send", out, item)
        out.send_bytes(item)
        fault("after-send")
    out.close()


def _read(conn: Connection, inbox: queue.Queue) -> None:
    """The trainer's reader of one worker's pipe, in a thread of its own: each unit whole into `inbox`. A unit is
    read whole or not at all, and only this thread waits for its rest: a worker stopped halfway through writing one
    (SIGSTOP, a debugger, a VM paused) holds up nobody, and the trainer's liveness check goes on. Ends at the pipe's
    end (the worker finished, died or was killed), and closes it."""
    try:
        while True:
            inbox.put(conn.recv_bytes())
    except (EOFError, OSError):  # the worker is gone; a unit it had not finished is dropped with it
        pass
    finally:
        conn.close()


class _Worker(NamedTuple):
    index: int
    process: mp.process.BaseProcess
    reader: threading.Thread  # `_read` of its pipe


class ProcessRollouts(Rollouts):
    """The samplers as processes on this machine, forked from a server process, weights through shared memory."""

    def __init__(self, cfg: RolloutConfig, plan: Plan, model: torch.nn.Module, tokenizer, *, first_step: int,
                 timeout_s: float, devices: Sequence[str], trainers_here: int = 1):
        # the host's cores split between its trainer processes and each one's workers
        super().__init__(cfg, plan, tokenizer, first_step=first_step, timeout_s=timeout_s, devices=devices,
                         threads=cfg.threads or cores.share(trainers_here * (cfg.workers + 1)))
        self.ctx = worker_context()
        self.shared = SharedWeights(model, self.ctx)
        # the module the workers copy: the model's structure on the CPU, its parameters the first shared copy's
        memo = {id(p): torch.nn.Parameter(self.shared.copies[0][n], requires_grad=False)
                for n, p in model.named_parameters()}
        self.skeleton = copy.deepcopy(model, memo).to("cpu")
        self.beats = self.ctx.Array("d", [0.0] * cfg.workers, lock=False)
        self.stopped_since: dict[int, float] = {}  # worker -> when it was first seen stopped before its first beat
        self.inbox: queue.Queue[bytes] = queue.Queue()  # whole units, from every worker's reader thread

    # -- the workers ---------------------------------------------------------------------------------------------

    def _start(self, w: int, first: int) -> None:
        reader, writer = self.ctx.Pipe(duplex=False)
        self.beats[w] = -time.time()  # not yet started (negative): its imports may take longer than the timeout
        self.stopped_since.pop(w, None)
        with cores.children_share(self.threads):  # its wait policy too, read when its OpenMP loads
            p = self.ctx.Process(target=_worker_main, name=f"r1-rollout-{self.plan.process_index}-{w}", daemon=True,
                                 args=(w, w, self.plan, self.skeleton, self.tokenizer, self.shared, self.beats,
                                       writer, first, self.cfg.workers, self.devices[w], self.threads, os.getpid(),
                                       dict(os.environ)))
            p.start()
        writer.close()
        thread = threading.Thread(target=_read, args=(reader, self.inbox), name=f"r1-rollout-reader-{w}", daemon=True)
        thread.start()
        self.workers[w] = _Worker(w, p, thread)

    def push(self, model: torch.nn.Module, version: int) -> float:
        """The trainer's current weights to the workers as `version`; the seconds the copy took."""
        t0 = time.perf_counter()
        self.shared.write(model, version)
        return time.perf_counter() - t0

    def newest(self) -> int:
        """The newest version pushed."""
        return self.shared.newest()

    @staticmethod
    def _name(worker: _Worker) -> str:
        return f"pid {worker.process.pid}"

    def _check(self) -> None:
        """Replace any worker that died or went silent for longer than the timeout; one not yet beating (its imports
        may take longer than the timeout) within `STARTUP_S`, or within the timeout where the system says it is
        stopped (SIGSTOP, a debugger)."""
        now = time.time()
        for w, worker in enumerate(self.workers):
            code = worker.process.exitcode
            beat = self.beats[w]
            silent = now - abs(beat)
            stopped = code is None and beat < 0 and process_stopped(worker.process.pid)
            since = self.stopped_since.setdefault(w, now) if stopped else self.stopped_since.pop(w, None)
            if code is not None and code != 0:
                name = signal.Signals(-code).name if code < 0 and -code in signal.valid_signals() else f"code {code}"
                self._replace(w, f"died ({name})")
            elif stopped and now - since > self.timeout_s:
                self._replace(w, f"was stopped before its first heartbeat, for {now - since:.0f} s (rollout.timeout_s "
                                 f"{self.timeout_s:g})")
            elif code is None and beat < 0 and silent > max(self.timeout_s, STARTUP_S):
                self._replace(w, f"did not start within {silent:.0f} s")
            elif code is None and beat > 0 and silent > self.timeout_s:
                self._replace(w, f"gave no sign of life for {silent:.0f} s (rollout.timeout_s {self.timeout_s:g}: "
                                 f"stopped or hung)")

    def _drain(self, wait_s: float) -> None:
        """Every unit the workers' readers have whole, waiting up to `wait_s` for one (never longer, whatever a
        worker is doing: `_check` runs next)."""
        try:
            data = self.inbox.get(timeout=wait_s) if wait_s > 0 else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            unit: Unit = pickle.loads(data)
            if unit.step >= self.next_step:  # a replaced worker's reader may hand over a step already trained
                self.received[unit.step] = unit
            try:
                data = self.inbox.get_nowait()
            except queue.Empty:
                return

    def close(self) -> None:
        """Stop every worker (a moment to finish on its own, then SIGKILL), whatever state it is in."""
        for worker in self.workers:
            if worker is not None and worker.process.is_alive():
                worker.process.terminate()
                with suppress(ProcessLookupError):
                    os.kill(worker.process.pid, signal.SIGCONT)  # a stopped worker acts on SIGTERM once continued
        deadline = time.time() + 5.0
        for worker in self.workers:
            if worker is not None:
                worker.process.join(max(0.0, deadline - time.time()))
                self._kill(worker)
        self.workers = [None] * len(self.workers)

    @staticmethod
    def _kill(worker: _Worker | None) -> None:
        if worker is None:
            return
        if worker.process.is_alive():
            worker.process.kill()  # SIGKILL: ends a stopped process too
        worker.process.join(10.0)
        worker.reader.join(10.0)  # its pipe ended with it: the reader hands over what it had whole, and closes it
