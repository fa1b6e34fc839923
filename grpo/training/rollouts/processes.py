"""Asynchronous rollouts: sampler processes apart from the trainer, at most `max_staleness` optimizer steps behind it.

The GRPO loop (`grpo.training.loops.grpo_trainer`) with `rollout.mode: async` takes each step's groups from
`RolloutWorkers` instead of sampling them itself:

- **Workers.** `rollout.workers` processes on this machine (each on its device, with its own copy of the policy and
  its own engine, `grpo.sampling.engines`). Worker w samples steps w, w + W, w + 2W, ... in order: each
  step's prompts are the ones the synchronous loop would take (`prompt_order`), sampled under the same seed
  (`sampling_seed`), so a worker draws the tokens the synchronous loop would draw from the same weights. Workers
  are forked from a server process that imported torch and this module once (multiprocessing's forkserver, where
  the system has it): a new worker, or one replacing a lost one, starts in a fraction of a second instead of the
  ~5 s of a 2-core CPU that a spawned one spent importing; it gets the trainer's environment of the moment.
- **Versions and the bound.** A version is the count of optimizer steps behind a set of weights. A step's groups
  are trained at version step x num_iterations, so a worker samples step s only with weights of version at least
  s x num_iterations - max_staleness (AReaL's capacity rule: nothing is generated that would break the bound); it
  waits for a push otherwise. Every unit of groups carries the version that sampled it, and `take` checks the bound
  again: a unit past it is a `RolloutError`, never trained, never dropped.
- **Weights.** The trainer writes its whole weights into shared memory every `sync_every` optimizer steps: two
  copies, written in turn, each with the version it holds (-1 while written). Sampler and trainer share the host,
  so shared memory is the cheapest path and needs no collective: the trainer never waits on a worker to push,
  so a stopped worker cannot hang a push. A worker takes the newest complete copy between two steps' batches,
  never mid-completion: every token of a group is then sampled by one version, and its engine holds no KV cache
  or prefill across calls (the next call prefills under the new weights; `engine.sync_weights` refreshes any
  bf16 copy or captured step). A copy overwritten while a worker read it is read again.
- **The reference.** With `rollout.reference: sampler` a worker also scores the KL term's reference log-probs of the
  groups it sampled (`reference_scored`: the trainer's frozen copy, kernels and micro-batches), and the trainer
  skips that forward pass.
- **Ray.** `grpo.training.rollout_ray` runs the same `sample_steps` in Ray actors (`rollout.launcher: ray`).
- **Faults.** Each worker beats a heartbeat every second from a thread. A worker that exits, or whose heartbeat is
  older than `timeout_s` (stopped, hung), is named in one line, killed and replaced by a new one that takes the
  newest weights and samples the steps its predecessor had not delivered; past `max_restarts` the stage fails with
  one line. Nothing between trainer and worker blocks without a deadline: the trainer reads each worker's pipe in
  a thread of its own, which hands over whole units only, so a worker stopped halfway through writing one holds up
  that thread alone and the check above still runs every 0.2 s; weights go through shared memory, which no stopped
  worker can hold up. Workers die with the trainer's process (PR_SET_PDEATHSIG, and a check of the parent), and
  `close` stops every one of them (a stopped one continued, to act on SIGTERM). `FAULT_POINTS` names every point of
  the protocol where the tests stop or kill a worker (`R1_ROLLOUT_FAULTS`).

Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import copy
import logging
import multiprocessing as mp
import os
import pickle
import queue
import signal
import struct
import threading
import time
from contextlib import nullcontext, suppress
from multiprocessing.connection import Connection
from typing import Callable, NamedTuple, Sequence

import torch

from grpo import cores
from grpo.config import GenerationConfig, SamplingConfig
from grpo.interrupts import alive, die_with_parent
from grpo.kernels.attention import attending_packed, cpu_attention
from grpo.kernels.gemm import GemmPlan, fp32_gemm
from grpo.kernels.mlp import compact_mlp
from grpo.rollout_config import RolloutConfig
from grpo.sampling.engines import Engine, Rollout, build_engine
from grpo.sampling.rollout import decode_figures
from grpo.training.batches import prompt_order
from grpo.training.distributed import index_share, sampling_seed
from grpo.training.lora import causal_lm
from grpo.training.policy import scored_logps

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # seconds between a worker's heartbeats
POLL_S = 0.002  # seconds between a worker's looks for newer weights while it waits for them
STARTUP_S = 120.0  # seconds a new worker may take to beat first (the first imports torch and the model's code)

# Fault injection, for the tests: R1_ROLLOUT_FAULTS="<point>:<stop|kill>,..." makes the first sampler (process or
# Ray actor) that reaches a point SIGSTOP or SIGKILL itself there, once for the run (a file per fired fault in
# R1_ROLLOUT_FAULTS_DIR, made exclusively, so the replacement passes it). Every point of the protocol:
FAULT_POINTS = (
    "start",  # the heartbeat beating, the policy not yet built
    "first-weights",  # before the worker's first copy of the pushed weights
    "before-send",  # a unit sampled, not yet written to the trainer
    "mid-send",  # half of a unit written (a process's pipe)
    "after-send",  # a unit written whole
    "weights",  # before a later push's weights are read, between two steps
    "shutdown",  # every step delivered, the process not yet ended
)
FAULTS, FAULTS_DIR = "R1_ROLLOUT_FAULTS", "R1_ROLLOUT_FAULTS_DIR"


class RolloutError(RuntimeError):
    """The asynchronous rollout cannot go on (a bound broken, workers that keep dying): one line says why."""


class Unit(NamedTuple):
    """One step's groups, sampled by one worker with one version of the weights."""

    step: int
    version: int  # optimizer steps behind the weights that sampled every token of it
    rollout: Rollout
    worker: int
    busy_s: float  # the worker's seconds sampling it
    idle_s: float  # the worker's seconds waiting for weights new enough before it
    decode: dict | None = None  # what the worker's decode steps did for it (`rollout.decode_figures`)


class Plan(NamedTuple):
    """What every worker needs to sample the steps (picklable: it travels to each spawned process)."""

    cells: list  # the stage's prompts
    prompts_per_step: int
    num_generations: int
    sampling: SamplingConfig
    generation: GenerationConfig
    seed: int
    num_iterations: int  # optimizer steps a GRPO step (a step s trains at version s x this)
    max_staleness: int
    max_steps: int
    dtype: torch.dtype | None  # the engine's sampling dtype (a bf16 copy), None: the weights'
    gemm: GemmPlan | None  # the trainer's fp32 GEMM plan, so a worker's prefill computes as the trainer's would
    packed: bool  # whether the trainer's attention takes packed rows (its forward is patched so; the worker's too)
    # wraps each worker's engine (a module-level function, so a spawned process can import it): one that records
    # or slows its calls, in tests and benchmarks; None: the engine as built
    engine_wrapper: Callable[[Engine], Engine] | None = None
    process_index: int = 0  # the trainer process these workers serve (each samples its process's share)
    num_processes: int = 1
    # whether the trainer samples its policy itself, under the loop's kernels (cpu attention, the compact MLP, the
    # GEMM plan), which the workers then use too; not where it samples a gathered copy (fsdp), which has none
    policy_kernels: bool = True
    # rollout.reference sampler: the frozen reference each worker scores its groups with (the trainer's copy, in its
    # dtype), as the trainer would: micro-batches of `micro_batch_size` rows or `max_tokens` tokens, under autocast
    # to `autocast` (the trainer's mixed precision; None: none)
    reference: torch.nn.Module | None = None
    micro_batch_size: int = 8
    max_tokens: int | None = None
    autocast: torch.dtype | None = None
    # the names of the parameters that require grad in the model the trainer samples (None: the copy's flags as the
    # skeleton has them): a worker's copy gets the same flags, since torch picks kernels by them. `matmul` folds a
    # batched product into one GEMM where an operand requires grad and runs it batch by batch where none does, and
    # the two round apart (on an AVX-512 CPU): the prefill's output head, fed the last position of each prompt
    # ([u, 1, H], a strided slice), gives the sampler's log-probs another last bit in a copy without the flags
    grad_params: frozenset[str] | None = None


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


def fault(point: str, out: Connection | None = None, data: bytes | None = None) -> None:
    """Stop or kill this process at `point` where R1_ROLLOUT_FAULTS asks it and no sampler did yet (see FAULT_POINTS);
    at "mid-send" first write half of `data` to `out`, framed as `Connection.send_bytes` frames it."""
    spec = dict(item.split(":", 1) for item in os.environ.get(FAULTS, "").split(",") if item)
    action = spec.get(point)
    if action is None:
        return
    if action not in ("stop", "kill") or point not in FAULT_POINTS or not os.environ.get(FAULTS_DIR):
        raise ValueError(f"{FAULTS}: {point}:{action} is not <one of {', '.join(FAULT_POINTS)}>:<stop|kill>, or "
                         f"{FAULTS_DIR} is not set")
    try:
        os.close(os.open(os.path.join(os.environ[FAULTS_DIR], f"{point}-{action}"), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return  # fired once already, in this worker's predecessor
    if point == "mid-send" and out is not None and data is not None:
        os.write(out.fileno(), struct.pack("!i", len(data)) + data[:len(data) // 2])
    # to this thread: it takes the signal before it returns (one sent to the process may be taken by another thread
    # a moment later, and this one would go on meanwhile); a stop or a kill is the whole process's all the same
    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP if action == "stop" else signal.SIGKILL)
    if point == "mid-send":
        os._exit(1)  # continued after a stop mid-unit: the pipe holds half a unit, nothing more may follow


def worker_steps(worker: int, workers: int, first: int, max_steps: int) -> range:
    """The steps worker `worker` of `workers` samples from step `first` on."""
    return range(first + (worker - first) % workers, max_steps, workers)


def _heartbeat(beats, index: int, parent: int, stop: threading.Event) -> None:
    while not stop.is_set():
        beats[index] = time.time()
        if not alive(parent):  # the trainer is gone, where PR_SET_PDEATHSIG is not there (or names the fork server)
            os._exit(1)
        stop.wait(HEARTBEAT_S)


def worker_context() -> mp.context.BaseContext:
    """Forked from a server that imported this module once where the system has one (Linux), spawned elsewhere."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])  # read when the server starts: torch and the model's code, once
    return ctx


def sampler_model(plan: Plan, skeleton: torch.nn.Module, tokenizer, device: str) -> tuple[torch.nn.Module, Engine]:
    """A sampler's own copy of the policy on `device` (a push never changes it mid-step) and its engine."""
    model = copy.deepcopy(skeleton).to(device).eval()
    if plan.grad_params is not None:  # the trainer's flags, so the same kernels run (`Plan.grad_params`)
        for name, p in model.named_parameters():
            p.requires_grad_(name in plan.grad_params)
    engine = build_engine(plan.generation, model, tokenizer, dtype=plan.dtype, who="a rollout worker")
    if plan.engine_wrapper is not None:
        engine = plan.engine_wrapper(engine)
    return model, engine


def reference_scored(plan: Plan, reference: torch.nn.Module, rollout: Rollout) -> Rollout:
    """`rollout` with its completions' reference log-probs, scored as the trainer's `build_batch` would."""
    input_ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    attention_mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1)
    device = next(reference.parameters()).device
    with torch.autocast(device.type, dtype=plan.autocast) if plan.autocast is not None else nullcontext():
        ref = scored_logps(None, reference, input_ids.to(device), attention_mask.to(device),
                           rollout.completion_ids.size(1), plan.micro_batch_size, plan.sampling.temperature,
                           packed=plan.packed, max_tokens=plan.max_tokens)
    return rollout._replace(ref_logprobs=ref.cpu())


def sample_steps(index: int, plan: Plan, model: torch.nn.Module, engine: Engine, weights,
                 deliver: Callable[[Unit], None], first: int, workers: int) -> None:
    """Worker `index` of `workers`: its steps from `first` on, in order, each sampled once weights new enough are in
    and handed to `deliver`. `weights` is where pushes land: `newest()` (the newest complete version, -1 before
    any) and `read_into(model)` (that copy into the model; its version)."""
    core = causal_lm(model) if plan.policy_kernels else None
    reference = None if plan.reference is None else plan.reference.to(next(model.parameters()).device)
    version = -1
    with (cpu_attention(core, reference), compact_mlp(core), fp32_gemm(core, plan.gemm),
          fp32_gemm(reference, plan.gemm), attending_packed(core, plan.packed),
          attending_packed(reference, plan.packed)):
        for step in worker_steps(index, workers, first, plan.max_steps):
            need = step * plan.num_iterations - plan.max_staleness  # the oldest weights that may sample the step
            t0 = time.perf_counter()
            while version < need or weights.newest() > version:  # the newest weights, between two steps' batches
                if weights.newest() > version:
                    fault("first-weights" if version < 0 else "weights")
                    version = weights.read_into(model)
                    engine.sync_weights()
                else:
                    time.sleep(POLL_S)
            idle = time.perf_counter() - t0
            idx = index_share(prompt_order(len(plan.cells), step, plan.prompts_per_step, plan.seed),
                              plan.process_index, plan.num_processes)  # this trainer process's share
            torch.manual_seed(sampling_seed(plan.seed, step, plan.process_index))  # the synchronous loop's seed
            t1 = time.perf_counter()
            rollout = engine.generate([plan.cells[i] for i in idx], plan.num_generations, plan.sampling,
                                      logprobs=True)
            if reference is not None:
                rollout = reference_scored(plan, reference, rollout)
            deliver(Unit(step, version, rollout, index, time.perf_counter() - t1, idle, decode_figures(engine)))


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


class RolloutWorkers:
    """The stage's sampler processes and the buffer of units they deliver (the trainer's side)."""

    local = True  # the samplers are processes on this machine (not Ray actors: grpo.training.rollout_ray)

    def __init__(self, cfg: RolloutConfig, plan: Plan, model: torch.nn.Module, tokenizer, *, first_step: int,
                 timeout_s: float, devices: Sequence[str], trainers_here: int = 1):
        # the host's cores split between its trainer processes and each one's workers
        self._books(cfg, plan, tokenizer, first_step, timeout_s, devices,
                    cfg.threads or cores.share(trainers_here * (cfg.workers + 1)))
        self.ctx = worker_context()
        self.shared = SharedWeights(model, self.ctx)
        # the module the workers copy: the model's structure on the CPU, its parameters the first shared copy's
        memo = {id(p): torch.nn.Parameter(self.shared.copies[0][n], requires_grad=False)
                for n, p in model.named_parameters()}
        self.skeleton = copy.deepcopy(model, memo).to("cpu")
        self.beats = self.ctx.Array("d", [0.0] * cfg.workers, lock=False)
        self.inbox: queue.Queue[bytes] = queue.Queue()  # whole units, from every worker's reader thread

    def _books(self, cfg: RolloutConfig, plan: Plan, tokenizer, first_step: int, timeout_s: float,
               devices: Sequence[str], threads: int) -> None:
        """What the trainer's side keeps whatever the samplers are: the buffer, the counts, the figures."""
        self.cfg, self.plan, self.tokenizer = cfg, plan, tokenizer
        self.timeout_s, self.devices, self.threads = timeout_s, list(devices), threads
        self.received: dict[int, Unit] = {}
        self.workers: list = [None] * cfg.workers
        self.restarts = 0
        self.first_step = first_step
        self.next_step = first_step  # the step `take` hands out next
        self.idle_s = 0.0  # the trainer's seconds waiting in `take` since the last `figures`
        self.worker_busy_s = self.worker_idle_s = 0.0
        self.consumed_staleness: list[int] = []

    # -- the workers ---------------------------------------------------------------------------------------------

    def start(self, model: torch.nn.Module, version: int) -> None:
        """Push `version`'s weights and start every worker; if one cannot start, those started are stopped."""
        try:
            self.push(model, version)
            for w in range(self.cfg.workers):
                self._start(w, self.first_step)
        except BaseException:
            self.close()
            raise

    def _start(self, w: int, first: int) -> None:
        reader, writer = self.ctx.Pipe(duplex=False)
        self.beats[w] = -time.time()  # not yet started (negative): its imports may take longer than the timeout
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

    def _replace(self, w: int, why: str) -> None:
        worker = self.workers[w]
        name = self._name(worker)
        self._kill(worker)
        self.restarts += 1
        if self.restarts > self.cfg.max_restarts:
            raise RolloutError(f"rollout worker {w} ({name}) {why}, and {self.cfg.max_restarts} "
                               f"workers were already replaced in this run (rollout.max_restarts): stopping; the "
                               f"same command resumes from the last checkpoint")
        # its first step not yet delivered: the units it sent stay in the buffer, those in flight are sampled again
        mine = worker_steps(w, self.cfg.workers, self.first_step, self.plan.max_steps)
        first = next((s for s in mine if s >= self.next_step and s not in self.received), self.plan.max_steps)
        log.warning("rollout worker %d (%s) %s; replaced by a new one with the newest weights (version %d), "
                    "sampling again from step %d (restart %d of %d)", w, name, why, self.newest(), first,
                    self.restarts, self.cfg.max_restarts)
        self._start(w, first)

    @staticmethod
    def _name(worker: _Worker) -> str:
        return f"pid {worker.process.pid}"

    def _check(self) -> None:
        """Replace any worker that died or went silent for longer than the timeout."""
        now = time.time()
        for w, worker in enumerate(self.workers):
            code = worker.process.exitcode
            beat = self.beats[w]
            silent = now - abs(beat)
            if code is not None and code != 0:
                name = signal.Signals(-code).name if code < 0 and -code in signal.valid_signals() else f"code {code}"
                self._replace(w, f"died ({name})")
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

    # -- the trainer's side --------------------------------------------------------------------------------------

    def take(self, step: int) -> Unit:
        """Step `step`'s groups, waiting for them; a unit sampled past the bound is a `RolloutError`."""
        t0 = time.perf_counter()
        while step not in self.received:
            self._drain(0.2)
            if step not in self.received:
                self._check()
        self._drain(0.0)
        self.idle_s += time.perf_counter() - t0
        unit = self.received.pop(step)
        self.next_step = step + 1
        staleness = step * self.plan.num_iterations - unit.version
        if not 0 <= staleness <= self.plan.max_staleness:
            raise RolloutError(f"step {step}'s groups were sampled by weights of version {unit.version}, "
                               f"{staleness} optimizer steps behind the trainer: outside rollout.max_staleness "
                               f"{self.plan.max_staleness}; nothing of them was trained")
        self.worker_busy_s += unit.busy_s
        self.worker_idle_s += unit.idle_s
        self.consumed_staleness.append(staleness)
        return unit

    def figures(self, unit: Unit) -> dict[str, float]:
        """The step's rollout figures (and the trainer's wait since the last call, reset)."""
        staleness = unit.step * self.plan.num_iterations - unit.version
        m = {"async/staleness_mean": float(staleness), "async/staleness_max": float(staleness),
             "async/buffer_depth": float(len(self.received)), "async/trainer_idle_s": self.idle_s,
             "async/sampler_busy_s": unit.busy_s, "async/sampler_idle_s": unit.idle_s,
             "async/restarts": float(self.restarts), **(unit.decode or {})}
        self.idle_s = 0.0
        return m

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
