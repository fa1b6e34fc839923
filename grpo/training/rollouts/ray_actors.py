"""Asynchronous rollouts on a Ray cluster: the sampler workers as Ray actors (`rollout.launcher: ray`).

The same samplers as `processes.ProcessRollouts` (each worker's steps, prompts and seeds; the bound kept by
admission and checked in `take`; a replaced worker samples again the steps its predecessor had not delivered), with
Ray as the transport in place of spawned processes and shared memory:

- **Where.** Each worker is an actor on the cluster at `rollout.ray_address` (the recipe's Ray cluster where
  unset), asking for `rollout.threads` CPUs and, where the trainer computes on a GPU, one GPU: Ray places it on a
  GPU no training worker holds (under `distributed.engine: ray` the Ray Train workers hold theirs). A cluster that
  counts the trainer's own GPU among its resources (the trainer's machine a node of it, with engine local) may put
  a sampler there: start that node with `--num-gpus` leaving the trainer's out.
- **Weights.** A push puts the trainer's whole weights into Ray's object store once (`ray.put`: a copy the trainer
  may change at once) and sends its reference to every actor without waiting for an answer: a worker that stopped
  cannot hold a push. The actor takes the newest it was sent between two steps' batches, as a process worker takes
  the newest shared copy. Shared memory does not reach across machines; the object store does, and moves the
  weights node to node once per node.
- **Signs of life.** The trainer asks each actor for its finished units while it waits (`poll`); a poll unanswered
  for longer than `timeout_s` (a stopped or hung actor), an actor Ray reports dead (its process or node lost), or
  an error in its sampling names the worker in one line and replaces it, as `Rollouts` does a process.
- **Ending.** `close` kills every actor (`ray.kill`); an actor's owner is the trainer's process, so Ray also ends
  the actors when that process dies.

ray is imported only here, only when a stage asks for it. Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
import socket
import threading
import time

import torch

from grpo.configs.rollout import RolloutConfig
from grpo.training.rollouts.base import Rollouts
from grpo.training.rollouts.protocol import (FAULTS, FAULTS_DIR, STARTUP_S, Plan, RolloutError, Unit, fault,
                                             sample_steps, sampler_model)

log = logging.getLogger(__name__)


class _Inbox:
    """The newest weights pushed to an actor: `newest` and `read_into`, as `SharedWeights` has them."""

    def __init__(self):
        self.lock = threading.Lock()
        self.version, self.state = -1, None

    def put(self, version: int, state: dict[str, torch.Tensor]) -> None:
        with self.lock:
            if version > self.version:
                self.version, self.state = version, state

    def newest(self) -> int:
        return self.version

    def read_into(self, model: torch.nn.Module) -> int:
        with self.lock:
            version, state = self.version, self.state
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(state[name])
        return version


class Sampler:
    """The actor's body: one worker's steps, sampled in a thread of its own while Ray's calls (pushes, polls) come
    in on the actor's main thread. The thread starts with the second poll, the first so always answered: an actor
    that never answered one is one not yet placed or built (given `STARTUP_S`), and one that goes silent after it
    (stopped or hung while it builds its model, say) is found within `timeout_s`."""

    def __init__(self, index: int, plan: Plan, skeleton: torch.nn.Module, tokenizer, device: str, threads: int,
                 first: int, workers: int):
        torch.set_num_threads(threads)
        torch.ones(2**10).sum()  # the first parallel region on the main thread (see grpo.sampling.batcher)
        self.inbox = _Inbox()
        self.units: list[bytes] = []
        self.error: str | None = None
        self.done = False
        self.lock = threading.Lock()
        self.polls = 0
        self.sampler = threading.Thread(target=self._run, args=(index, plan, skeleton, tokenizer, device, first,
                                                                workers), name="r1-ray-sampler", daemon=True)

    def _run(self, index, plan, skeleton, tokenizer, device, first, workers) -> None:
        try:
            fault("start")
            model, engine = sampler_model(plan, skeleton, tokenizer, device)
            sample_steps(index, plan, model, engine, self.inbox, self._deliver, first, workers)
            fault("shutdown")
            self.done = True
        except BaseException as e:  # noqa: BLE001 (the trainer hears of it at its next poll)
            self.error = f"{type(e).__name__}: {e}".splitlines()[0]

    def _deliver(self, unit: Unit) -> None:
        data = pickle.dumps(unit)  # by value: nothing of it depends on this actor living on
        fault("before-send")
        with self.lock:
            self.units.append(data)
        fault("after-send")

    def weights(self, version: int, state: dict[str, torch.Tensor]) -> None:
        self.inbox.put(version, state)

    def poll(self) -> tuple[list[bytes], str | None, int, str]:
        """The units finished since the last poll, the sampling's error if it failed, this actor's pid and host."""
        if self.polls == 1:  # the first poll was answered (the actor runs its calls in turn): sampling starts now
            self.sampler.start()
        self.polls += 1
        with self.lock:
            units, self.units = self.units, []
        return units, self.error, os.getpid(), socket.gethostname()


class _Actor:
    """The trainer's handle on one actor: its poll in flight, and when it was sent or last answered."""

    def __init__(self, handle, started: float):
        self.handle = handle
        self.started = started
        self.answered = False
        self.poll = None  # the ObjectRef of the poll in flight
        self.asked = started  # when that poll was sent
        self.pid, self.host = None, None
        self.failure: str | None = None  # why it must be replaced (dead, its sampling failed)


def connect(address: str | None) -> None:
    """This process's connection to the cluster (none needed inside a Ray worker: it has one)."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address, logging_level="WARNING", log_to_driver=False)


class RayRollouts(Rollouts):
    """The samplers as Ray actors on a cluster, weights through its object store."""

    local = False

    def __init__(self, cfg: RolloutConfig, plan: Plan, model: torch.nn.Module, tokenizer, *, first_step: int,
                 timeout_s: float, device: str):
        import ray

        super().__init__(cfg, plan, tokenizer, first_step=first_step, timeout_s=timeout_s,
                         devices=[device] * cfg.workers, threads=cfg.threads or 1)
        connect(cfg.ray_address)
        self.ray = ray
        # the module the actors copy, on the CPU: its parameters copied there one by one (a whole copy on the
        # trainer's GPU first could not fit beside the trainer's own state at scale)
        memo = {id(p): torch.nn.Parameter(p.detach().to("cpu", copy=True), requires_grad=False)
                for p in model.parameters()}
        self.skeleton = ray.put(copy.deepcopy(model, memo).to("cpu").eval())
        self.gpus = 1 if device.startswith("cuda") else 0
        self.remote = ray.remote(Sampler)
        self.version, self.weights_ref = -1, None

    def start(self, model: torch.nn.Module, version: int) -> None:
        self._check_room()
        super().start(model, version)

    def _check_room(self) -> None:
        """Fail in one line where the cluster cannot place the workers at all (rather than waiting for them)."""
        total = self.ray.cluster_resources()
        cpus, gpus = total.get("CPU", 0), total.get("GPU", 0)
        need_cpu, need_gpu = self.cfg.workers * self.threads, self.cfg.workers * self.gpus
        if need_cpu > cpus or need_gpu > gpus:
            raise RolloutError(f"rollout.workers {self.cfg.workers} Ray actors ask for {need_cpu} CPUs"
                               f"{f' and {need_gpu} GPUs' if need_gpu else ''} (rollout.threads {self.threads} each"
                               f"{', a GPU each' if need_gpu else ''}); the cluster has {cpus:g} CPUs and {gpus:g} "
                               f"GPUs in all: fewer workers or threads, or more nodes")

    def _start(self, w: int, first: int) -> None:
        # SPREAD: the workers apart, on as many nodes as have room, and never inside the placement group of a Ray
        # Train worker that starts them (which would capture them, and has no room for them)
        # num_cpus is also the actor's threads: Ray sets OMP_NUM_THREADS to it, so actors share a node's cores
        # the tests' fault injection (protocol.FAULT_POINTS) reaches the actors through their environment
        faults = {k: os.environ[k] for k in (FAULTS, FAULTS_DIR) if os.environ.get(k)}
        env = {"runtime_env": {"env_vars": faults}} if faults else {}
        handle = self.remote.options(num_cpus=self.threads, num_gpus=self.gpus, max_restarts=0,
                                     scheduling_strategy="SPREAD", **env).remote(w, self.plan, self.skeleton, self.tokenizer,
                                                       "cuda" if self.gpus else "cpu", self.threads, first,
                                                       self.cfg.workers)
        if self.weights_ref is not None:
            handle.weights.remote(self.version, self.weights_ref)
        self.workers[w] = _Actor(handle, time.time())

    def newest(self) -> int:
        return self.version

    def push(self, model: torch.nn.Module, version: int) -> float:
        """The weights into the object store, their reference to every actor; nothing waits for an actor."""
        t0 = time.perf_counter()
        with torch.no_grad():
            state = {n: p.detach().to("cpu") for n, p in model.named_parameters()}
        self.version, self.weights_ref = version, self.ray.put(state)
        for actor in self.workers:
            if actor is not None:
                actor.handle.weights.remote(version, self.weights_ref)
        return time.perf_counter() - t0

    def _drain(self, wait_s: float) -> None:
        """Every unit the actors have finished, waiting up to `wait_s` for an answer."""
        now = time.time()
        for actor in self.workers:
            if actor is not None and actor.poll is None and actor.failure is None:
                actor.poll, actor.asked = actor.handle.poll.remote(), now
        polls = {a.poll: a for a in self.workers if a is not None and a.poll is not None}
        while polls:
            ready, _ = self.ray.wait(list(polls), num_returns=1, timeout=wait_s)
            if not ready:
                return
            actor = polls.pop(ready[0])
            actor.poll = None
            try:
                units, error, actor.pid, actor.host = self.ray.get(ready[0])
            except self.ray.exceptions.RayActorError as e:
                actor.failure = f"died ({_first_line(e)})"
                continue
            actor.answered = True
            for data in units:
                unit: Unit = pickle.loads(data)
                self.received[unit.step] = unit
            if error is not None:
                actor.failure = f"failed ({error})"
            wait_s = 0.0

    def _check(self) -> None:
        """Replace any actor that died, failed, or left a poll unanswered for longer than the timeout."""
        now = time.time()
        for w, actor in enumerate(self.workers):
            silent = now - actor.asked if actor.poll is not None else 0.0
            if actor.failure is not None:
                self._replace(w, actor.failure)
            elif not actor.answered and now - actor.started > max(self.timeout_s, STARTUP_S):
                self._replace(w, f"did not start within {now - actor.started:.0f} s (is there room on the cluster "
                                 f"for {self.threads} CPUs{' and a GPU' if self.gpus else ''}?)")
            elif actor.answered and silent > self.timeout_s:
                self._replace(w, f"gave no sign of life for {silent:.0f} s (rollout.timeout_s {self.timeout_s:g}: "
                                 f"stopped or hung)")

    @staticmethod
    def _name(actor: _Actor) -> str:
        return f"Ray actor, pid {actor.pid} on {actor.host}" if actor.pid else "Ray actor"

    def close(self) -> None:
        for w, actor in enumerate(self.workers):
            self._kill(actor)
            self.workers[w] = None

    def _kill(self, actor: _Actor | None) -> None:
        if actor is None:
            return
        try:
            self.ray.kill(actor.handle, no_restart=True)
        except Exception:  # noqa: BLE001 (already gone)
            pass
        if actor.pid and actor.host == socket.gethostname():  # a stopped process on this machine: Ray's kill
            _sigkill(actor.pid)  # asks it to exit, which a stopped process cannot


def _sigkill(pid: int) -> None:
    import signal

    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _first_line(error: BaseException) -> str:
    text = str(getattr(error, "error_msg", "") or error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__

