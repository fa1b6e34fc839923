"""The trainer's side of asynchronous rollouts, whatever carries the samplers: the buffer of units, the staleness
bound checked on every unit taken, and the replacement of a worker lost (named in one line; past
`rollout.max_restarts` the stage stops). A transport (`processes.ProcessRollouts`, `ray_actors.RayRollouts`) starts,
feeds, watches and stops its samplers.

Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

import torch

from grpo.configs.rollout import RolloutConfig
from grpo.training.rollouts.protocol import Plan, RolloutError, Unit, worker_steps

log = logging.getLogger(__name__)


class Rollouts:
    """The samplers of one trainer process and the buffer of units they deliver (the trainer's side): `start`, then
    `take(step)` and `figures` each step, `push` new weights, `close` at the end."""

    local = True  # whether the samplers are processes on this machine (the trainer leaves them its cores)

    def __init__(self, cfg: RolloutConfig, plan: Plan, tokenizer, *, first_step: int, timeout_s: float,
                 devices: Sequence[str], threads: int):
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

    # -- what a transport does -----------------------------------------------------------------------------------

    def _start(self, w: int, first: int) -> None:
        """Start worker `w`, sampling its steps from `first` on with the newest weights pushed."""
        raise NotImplementedError

    def push(self, model: torch.nn.Module, version: int) -> float:
        """The trainer's current weights to the workers as `version`, never waiting on a worker; the seconds taken."""
        raise NotImplementedError

    def newest(self) -> int:
        """The newest version pushed."""
        raise NotImplementedError

    def _drain(self, wait_s: float) -> None:
        """Every unit delivered whole into `received`, waiting up to `wait_s` for one (never longer)."""
        raise NotImplementedError

    def _check(self) -> None:
        """`_replace` any worker that died, failed or went silent past the timeout."""
        raise NotImplementedError

    def _name(self, worker) -> str:
        raise NotImplementedError

    def _kill(self, worker) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Stop every worker, whatever state it is in."""
        raise NotImplementedError

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
