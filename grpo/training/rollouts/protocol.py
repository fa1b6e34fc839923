"""What every asynchronous sampler does, whatever carries it (a process, a Ray actor): the `Plan` it samples by, the
`Unit` it hands over, its steps (`worker_steps`, `sample_steps`), its copy of the policy, and the fault points the
tests stop or kill it at. The package's docstring (`grpo.training.rollouts`) says how the parts fit.

Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import copy
import os
import signal
import struct
import threading
import time
from contextlib import nullcontext
from multiprocessing.connection import Connection
from typing import Callable, NamedTuple

import torch

from grpo.configs.sampling import GenerationConfig, SamplingConfig
from grpo.kernels.attention import attending_packed, cpu_attention
from grpo.kernels.gemm import GemmPlan, fp32_gemm
from grpo.kernels.mlp import compact_mlp
from grpo.sampling.engines import Engine, Rollout, build_engine
from grpo.sampling.rollout import decode_figures
from grpo.training.batches import PromptOrder
from grpo.training.distributed import index_share, sampling_seed
from grpo.training.lora import causal_lm
from grpo.training.policy import scored_logps

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
    order: PromptOrder | None = None  # which prompts each step takes (the trainer's); None: prompt_order over all


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
            order = plan.order or PromptOrder(len(plan.cells), plan.prompts_per_step, plan.seed)
            idx = index_share(order(step), plan.process_index, plan.num_processes)  # this trainer process's share
            torch.manual_seed(sampling_seed(plan.seed, step, plan.process_index))  # the synchronous loop's seed
            t1 = time.perf_counter()
            rollout = engine.generate([plan.cells[i] for i in idx], plan.num_generations, plan.sampling,
                                      logprobs=True)
            if reference is not None:
                rollout = reference_scored(plan, reference, rollout)
            deliver(Unit(step, version, rollout, index, time.perf_counter() - t1, idle, decode_figures(engine)))
