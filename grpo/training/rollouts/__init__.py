"""Asynchronous rollouts: samplers apart from the trainer, at most `max_staleness` optimizer steps behind it.

The GRPO loop (`grpo.training.loops.grpo_trainer`) with `rollout.mode: async` is handed a rollout source,
`AsyncSource` (`source`), that takes each step's groups from a `Rollouts` (`start_rollouts`); the loop starts no
sampler itself:

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
- **Transports.** `Rollouts` (`base`) is what the loop sees: the buffer, the bound and the replacement of a lost
  worker. Two transports carry the samplers, each with its own constructor: `ProcessRollouts` (`processes`,
  processes on this machine, weights through shared memory) and `RayRollouts` (`ray_actors`, Ray actors,
  weights through the object store). `start_rollouts` (`start`) picks one from the recipe's `rollout` section,
  with its devices, and starts it. What every sampler does, whatever carries it, is `protocol`: `sample_steps`,
  the `Plan` and the `Unit`, and the fault points.
- **Faults.** Each worker beats a heartbeat every second from a thread. A worker that exits, or whose heartbeat is
  older than `timeout_s` (stopped, hung), or that the system says is stopped before its first beat (a process on
  Linux, `timeout_s` after it was seen so; a starting one otherwise gets `STARTUP_S`), is named in one line, killed
  and replaced by a new one that takes the
  newest weights and samples the steps its predecessor had not delivered; past `max_restarts` the stage fails with
  one line. Nothing between trainer and worker blocks without a deadline: the trainer reads each worker's pipe in
  a thread of its own, which hands over whole units only, so a worker stopped halfway through writing one holds up
  that thread alone and the check above still runs every 0.2 s; weights go through shared memory, which no stopped
  worker can hold up. Workers die with the trainer's process (PR_SET_PDEATHSIG, and a check of the parent), and
  `close` stops every one of them (a stopped one continued, to act on SIGTERM). `FAULT_POINTS` names every point of
  the protocol where the tests stop or kill a worker (`R1_ROLLOUT_FAULTS`).

| module | what it holds |
|---|---|
| `source` | `AsyncSource`: the samplers as a GRPO loop's rollout source, each step's groups taken and scored, weights pushed |
| `start` | `start_rollouts`: the transport the recipe's `rollout` section asks for, started on its devices |
| `base` | `Rollouts`, the trainer's side whatever the transport: the buffer, the staleness bound, a lost worker replaced |
| `processes` | `ProcessRollouts`: the samplers as processes on this machine, weights through shared memory |
| `ray_actors` | `RayRollouts`: the samplers as Ray actors, weights through the object store |
| `protocol` | what every sampler does: the `Plan`, the `Unit`, its steps (`sample_steps`), the fault points |

Must not depend on Prefect or MLflow.
"""

from grpo.training.rollouts.base import Rollouts
from grpo.training.rollouts.protocol import (FAULT_POINTS, FAULTS, FAULTS_DIR, Plan, RolloutError, Unit, fault,
                                             sample_steps, worker_steps)
from grpo.training.rollouts.start import start_rollouts

__all__ = ["FAULT_POINTS", "FAULTS", "FAULTS_DIR", "Plan", "RolloutError", "Rollouts", "Unit", "fault", "sample_steps",
           "start_rollouts", "worker_steps"]
