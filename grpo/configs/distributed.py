"""How a stage's training loops spread over processes and machines: the recipe's `distributed` section.

Its own module, apart from the recipe's stage configs, because the training parts, the launchers and the stage
tasks all read it. Plain pydantic: imports nothing of torch or of the modules that do the work.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# the environment variable that carries `collective_timeout_s` from the launcher to each process's loop (seconds
# a collective, an all-reduce or a barrier, may wait); the launcher sets it and the loops' Accelerator reads it
COLLECTIVE_TIMEOUT = "R1_COLLECTIVE_TIMEOUT_S"


class FSDPConfig(BaseModel):
    """The sharded strategy's settings (`distributed.strategy: fsdp`; docs/distributed.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # free each unit's gathered weights after its forward and gather them again for the backward: the least
    # memory (one unit whole at a time) for one more all-gather a unit a step
    reshard_after_forward: bool = True
    # keep the shards of the weights, gradients and optimizer state in CPU memory, copied to the GPU a unit at a
    # time: fits a larger model in GPU memory for a slower step (no effect on a CPU)
    cpu_offload: bool = False
    # mean absolute gap in log-probs (nats a token) between the sampler's gathered copy and the sharded trainer on
    # the same tokens, checked after every weight sync, above which the stage stops; None: 1e-3 where the loop
    # computes in fp32, 0.1 in bf16 (a copy gathered wrong differs by whole nats)
    max_sync_logprob_gap: float | None = Field(None, gt=0)


class DistributedConfig(BaseModel):
    """How many processes a stage's training loops run on: one, inside the stage's own process, by default.

    With more, the stage task runs the loop under `accelerate launch` (DDP: gloo on CPU, NCCL with one GPU per
    process) and the batch sizes stay global: each process takes an equal share (docs/distributed.md).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    # processes on each machine; "auto": one per GPU the machine shows (in a Kubernetes job: the GPUs it requested),
    # 1 without GPUs
    num_processes: int | Literal["auto"] = 1
    # machines (pods, nodes) the processes span, each starting num_processes of them: a multi-pod job whose pods
    # find each other through R1_MACHINE_RANK, R1_MAIN_PROCESS_IP, R1_MAIN_PROCESS_PORT and R1_JOIN_DIR
    # (docs/distributed.md); the global batches split over all of them
    num_machines: int = Field(1, ge=1)
    # an accelerate config file for the launch (its own settings: dynamo, NUMA, ...); not one that shards (FSDP,
    # DeepSpeed): `strategy` does that
    config_file: str | None = None
    # a collective (all-reduce, barrier, a sharded weight's gather) that waits longer fails the stage, to be
    # retried, instead of hanging it
    collective_timeout_s: float = Field(1800.0, ge=10, le=86400)
    # how the training processes hold the model (grpo.training.strategy): "ddp", whole weights, gradients and
    # optimizer state on every process (16 bytes a parameter with AdamW); "fsdp", each process holds 1/N of them
    # (FSDP2: one unit per decoder layer plus the root), gathering a unit's weights only while it computes
    strategy: Literal["ddp", "fsdp"] = "ddp"
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig)  # read only with strategy fsdp
    # what starts the processes: "local", `accelerate launch` on this machine (or the machines of one job,
    # num_machines); "ray", Ray Train workers on a Ray cluster, restarted from the last checkpoint when a node is lost
    engine: Literal["local", "ray"] = "local"
    # engine ray: the cluster (host:port of its GCS, ray://host:port, or "auto" for $RAY_ADDRESS); None takes
    # rejection_sampling.cluster.ray_address from the recipe
    ray_address: str | None = None
    num_workers: int = Field(2, ge=1)  # engine ray: training processes, one per GPU on GPU nodes
    # engine ray: a folder every Ray node and this machine mount (NFS, a shared volume): the stage's work folder
    # (job, inputs, checkpoints, final model) lives there, so any node reads and resumes it
    shared_dir: str | None = None
    max_failures: int = Field(2, ge=0)  # engine ray: restarts of the workers (a lost node) before the stage fails

    @field_validator("num_processes")
    @classmethod
    def _at_least_one(cls, n):
        if isinstance(n, int) and n < 1:
            raise ValueError(f"must be at least 1 or \"auto\" (got {n})")
        return n

    @model_validator(mode="after")
    def _one_way_to_shard(self) -> "DistributedConfig":
        if self.strategy == "fsdp" and self.config_file:
            raise ValueError("config_file (an accelerate config file) and strategy fsdp both say how to shard the "
                             "model: set one of them")
        if self.engine == "ray":
            if self.num_processes != 1 or self.num_machines != 1 or self.config_file:
                raise ValueError("engine ray starts num_workers processes where the cluster places them: leave "
                                 "num_processes, num_machines and config_file at their defaults")
            if not self.shared_dir:
                raise ValueError("engine ray needs shared_dir: a folder every Ray node and this machine mount, where "
                                 "the stage's job, checkpoints and final model live")
        return self


def rollout_ray_address(own: str | None, engine: str | None, training: str | None,
                        recipe: str | None) -> str | None:
    """The Ray cluster a GRPO stage's sampler actors (`grpo.rollout.launcher: ray`) run on, one rule wherever it is
    read: their own `rollout.ray_address`, else the cluster the stage's Ray Train workers run on (`distributed.engine:
    ray` with its `ray_address`), else the recipe's (`rejection_sampling.cluster.ray_address`); None when none names
    one.

    >>> rollout_ray_address(None, "ray", "train:6379", "head:6379"), rollout_ray_address(None, "local", None, "head:6379")
    ('train:6379', 'head:6379')
    """
    return own or (training if engine == "ray" else None) or recipe or None

