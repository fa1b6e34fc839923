"""Asynchronous rollouts as a GRPO loop's rollout source (grpo.training.sources): the samplers `start_rollouts`
starts, planned from the policy runtime, each step's groups taken from them and scored, the weights pushed every
`rollout.sync_every` optimizer steps.

Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import torch

from grpo import cores
from grpo.configs.distributed import COLLECTIVE_TIMEOUT
from grpo.configs.sampling import GenerationConfig
from grpo.sampling.engines import sampling_dtype
from grpo.training.distributed import local_processes, process_share
from grpo.training.rollouts.base import Rollouts
from grpo.training.rollouts.protocol import Plan
from grpo.training.rollouts.start import start_rollouts
from grpo.training.runtime import PolicyRuntime


class AsyncSource:
    """`rollout.workers` samplers apart from the trainer, started by `start` (before the loop's patches: each worker
    makes the same ones to its copy); the importance weight pi_prox / pi_behave capped at `rollout.behaviour_cap`
    (decoupled PPO) unless `tis_cap` says otherwise."""

    engine = None  # the samplers build their own

    def __init__(self, runtime: PolicyRuntime, generation: GenerationConfig, order: Callable[..., list[int]]):
        self.runtime, self.generation, self.order = runtime, generation, order
        self.behaviour_cap = runtime.cfg.rollout.behaviour_cap
        self.unseen = None  # every group sampled is handed on
        self.rollouts: Rollouts | None = None
        self.push_s = 0.0
        self.threads = torch.get_num_threads()

    def start(self, first_step: int) -> None:
        rt, cfg = self.runtime, self.runtime.cfg
        self.threads = torch.get_num_threads()
        acc, sampler = rt.acc, rt.strategy.sampler_model()
        plan = Plan(rt.cells, cfg.prompts_per_step, cfg.num_generations, cfg.sampling, self.generation, cfg.seed,
                    cfg.num_iterations, cfg.rollout.max_staleness, cfg.max_steps, sampling_dtype(acc.mixed_precision),
                    rt.gemm, rt.packed, process_index=acc.process_index, num_processes=acc.num_processes,
                    policy_kernels=sampler is acc.unwrap_model(rt.model),
                    grad_params=frozenset(n for n, p in sampler.named_parameters() if p.requires_grad),
                    order=self.order)
        if cfg.rollout.reference == "sampler":  # the workers score the KL term's reference; the trainer keeps none
            plan = plan._replace(reference=rt.ref_model.to("cpu"),  # moved off the trainer's device
                                 micro_batch_size=cfg.memory.micro_batch_size,
                                 max_tokens=cfg.memory.max_tokens_per_microbatch,
                                 autocast={"bf16": torch.bfloat16, "fp16": torch.float16}.get(
                                     str(acc.mixed_precision)))
            rt.ref_model = None
        timeout = cfg.rollout.timeout_s or float(os.environ.get(COLLECTIVE_TIMEOUT, "1800"))
        self.rollouts = start_rollouts(cfg.rollout, plan, sampler, rt.tokenizer, first_step=first_step,
                                       version=first_step * cfg.num_iterations,  # a resumed run's: its checkpoint's
                                       timeout_s=timeout, device=acc.device, local_processes=local_processes(acc),
                                       local_index=acc.local_process_index)
        if self.rollouts.local and all(d == "cpu" for d in self.rollouts.devices):  # the cores the workers leave
            here = cores.cpu_cores() // local_processes(acc)
            torch.set_num_threads(min(self.threads, max(1, here - cfg.rollout.workers * self.rollouts.threads)))

    def collect(self, step: int) -> tuple:
        """The step's groups, sampled by a worker up to `max_staleness` optimizer steps ago, scored here."""
        idx = process_share(self.runtime.acc, self.order(step))
        unit = self.rollouts.take(step)
        cfg = self.runtime.cfg
        scores = self.runtime.score(unit.rollout, idx, cfg.num_generations,
                                    cfg.schedule.rewards_at(cfg.rewards, step, cfg.max_steps))
        stats = {**self.rollouts.figures(unit), "async/push_s": self.push_s}
        self.push_s = 0.0
        return unit.rollout, idx, scores, stats

    def sync(self, version: int) -> None:
        """Every `rollout.sync_every` optimizer steps, push the weights to the samplers (before they start, a resume
        that loaded weights in place: the sampler's copy only)."""
        if self.rollouts is None:
            self.runtime.strategy.sync_sampler()
        elif self.pushes_at(version):
            t0 = time.perf_counter()
            self.runtime.strategy.sync_sampler()  # under fsdp: the whole weights gathered, unit by unit (a collective)
            self.rollouts.push(self.runtime.strategy.sampler_model(), version)
            self.push_s += time.perf_counter() - t0

    def pushes_at(self, version: int) -> bool:
        return version % self.runtime.cfg.rollout.sync_every == 0

    def close(self) -> None:
        """No sampler process outlives the loop."""
        if self.rollouts is not None:
            self.rollouts.close()
            self.rollouts = None
            torch.set_num_threads(self.threads)
