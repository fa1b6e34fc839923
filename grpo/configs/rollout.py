"""Where a sampling stage's rollouts come from: the `rollout` section of reasoning and alignment GRPO and online RFT.

`mode: sync` (the default) samples, scores and trains in turn in the stage's own process. `mode: async` samples in
worker processes apart from the trainer (`grpo.training.rollouts`), up to `max_staleness` optimizer steps
behind it, while the trainer trains (docs/sampling.md, "Asynchronous rollouts").

Plain pydantic: imports nothing of torch or of the modules that do the work.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class RolloutConfig(BaseModel):
    """Synchronous or asynchronous rollouts, and the asynchronous workers' settings."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["sync", "async"] = "sync"
    # async: the most optimizer steps the policy that sampled a group may be behind the trainer when the group is
    # trained. Kept at the producer (a worker samples a step's groups only with weights new enough) and checked
    # at the consumer (a group past it stops the stage). 0 is the synchronous algorithm, sampled in another process.
    max_staleness: int = Field(1, ge=0)
    # async: optimizer steps between weight pushes to the workers; at most max_staleness + 1, or a worker would wait
    # for weights that never come
    sync_every: int = Field(1, ge=1)
    workers: int = Field(1, ge=1)  # async: sampler workers (per training process)
    # async: where the workers run. "processes": on this machine (each training process's host), beside the
    # trainer; "ray": Ray actors on the cluster at ray_address (the recipe's rejection_sampling.cluster.ray_address
    # where unset), each asking for `threads` CPUs and, where the trainer is on a GPU, one GPU
    launcher: Literal["processes", "ray"] = "processes"
    # async: who scores the KL term's reference log-probs. "trainer": the trainer, a forward pass over each step's
    # batch; "sampler": each worker, on the groups it sampled, with its own frozen copy of the reference (the
    # trainer's step loses that forward and its reference copy; the workers hold one each). Needs beta > 0, no LoRA
    reference: Literal["trainer", "sampler"] = "trainer"
    ray_address: str | None = None  # launcher ray: host:port of the cluster's GCS, ray://host:port, or "auto"
    # async: each worker's device, one per worker ("cpu", "cuda:1"); None: the trainer's device on a CPU, on a GPU
    # machine the GPUs after the trainer's, one a worker
    devices: tuple[str, ...] | None = None
    # async: torch threads a worker computes with; None: this machine's cores / (workers + 1) for processes, 1 for
    # Ray actors (each asks the cluster for that many CPUs)
    threads: int | None = Field(None, ge=1)
    # async: seconds a worker may go without a sign of life (a heartbeat every second, its samples) before it is
    # named, killed and replaced; None: the collective timeout (distributed.collective_timeout_s)
    timeout_s: float | None = Field(None, gt=0)
    max_restarts: int = Field(3, ge=0)  # async: workers replaced in one run before the stage fails
    # async: the cap C of the behaviour weight min(pi_prox / pi_behave, C) on each token's policy term, where the
    # stage's tis_cap is unset (decoupled PPO; the truncated importance sampling paper's C = 2)
    behaviour_cap: float = Field(2.0, gt=0)
    dynamic_sampling: bool = False  # DAPO: drop groups with no reward spread and refill the batch
    max_refill_rounds: int = Field(3, ge=0)  # extra sampling rounds per step when dynamic sampling

    @model_validator(mode="after")
    def _pushes_reach_the_bound(self) -> "RolloutConfig":
        if self.mode == "async" and self.sync_every > self.max_staleness + 1:
            raise ValueError(f"rollout.sync_every {self.sync_every} > max_staleness + 1 = {self.max_staleness + 1}: "
                             f"between pushes the workers' weights fall {self.sync_every - 1} steps behind, past the "
                             f"bound, and they would wait for weights that never come; push more often or raise "
                             f"max_staleness")
        if self.devices is not None and self.launcher == "ray":
            raise ValueError("rollout.devices names devices of this machine; Ray actors get theirs from the cluster "
                             "(a GPU each where the trainer is on one): leave devices unset with launcher ray")
        if self.mode == "async" and self.dynamic_sampling:
            raise ValueError("rollout.mode async samples each step's prompts once, in a worker, before it is scored: "
                             "dynamic_sampling's refills need the scores first; turn one of them off")
        if self.devices is not None and len(self.devices) != self.workers:
            raise ValueError(f"rollout.devices names {len(self.devices)} devices for {self.workers} workers: one a "
                             f"worker")
        return self

    @property
    def asynchronous(self) -> bool:
        return self.mode == "async"


def check_async_rollout(rollout: RolloutConfig, *, engine: str, algorithm: str, where: str) -> None:
    """Raise, when the recipe is read, if asynchronous rollouts cannot run as the stage is set (`where`: its
    section's name; `engine`: what starts its training processes, distributed.engine)."""
    if not rollout.asynchronous:
        return
    if algorithm == "ppo":
        raise ValueError(f"{where}.grpo.rollout.mode async is for GRPO and online RFT: PPO's value model is fitted "
                         f"to the returns of the policy that sampled them and would learn stale values; use mode "
                         f"sync with algorithm ppo")
    if engine == "ray" and rollout.launcher != "ray":
        raise ValueError(f"{where}.grpo.rollout.mode async with distributed.engine ray: the training processes are "
                         f"Ray Train workers, and their samplers must be Ray actors too: set "
                         f"{where}.grpo.rollout.launcher ray (or rollout.mode sync)")
