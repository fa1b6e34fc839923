"""Where a GRPO step's groups come from: a rollout source, built once per run and handed to the loop.

- `EngineSource`: sampled in the loop by the stage's engine (grpo.sampling.engines) on the policy's whole weights
  (the policy itself, or under fsdp a copy gathered after every step), then scored;
- `DynamicRefill`: an engine source whose groups with no reward spread (no gradient) are dropped and more prompts
  sampled to refill the batch (DAPO's dynamic sampling);
- `AsyncSource` (grpo.training.rollouts.source): sampler processes or Ray actors, at most `max_staleness` optimizer
  steps behind the trainer.

Each has `start(first_step)`, `collect(step)` (the step's rollout, its prompts, its scores and figures), `sync(version)`
(make the next rollouts sample the policy's weights after `version` optimizer steps), `pushes_at(version)` (whether
that sync reaches the sampler), `close()`, and `behaviour_cap` (the importance weight's cap the source asks for, or
None). `rollout_source` builds the one a config asks for.

Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Callable, Mapping, Protocol

from grpo.configs.sampling import GenerationConfig
from grpo.sampling.engines import Engine, Rollout, build_engine, sampling_dtype
from grpo.sampling.rollout import decode_figures
from grpo.training.batches import prompt_mix_order
from grpo.training.distributed import process_share
from grpo.training.dynamic import concat_groups, spread_groups
from grpo.training.grading import StepGrading
from grpo.training.policy import sample_rollout
from grpo.training.runtime import PolicyRuntime

Collected = tuple[Rollout, list[int], object, dict[str, float]]  # rollout, prompt rows, scores, figures


class RolloutSource(Protocol):
    behaviour_cap: float | None
    unseen: StepGrading | None  # the last step's rows sampled but not handed on (dropped groups), for the watch

    def start(self, first_step: int) -> None: ...

    def collect(self, step: int) -> Collected: ...

    def sync(self, version: int) -> None: ...

    def pushes_at(self, version: int) -> bool: ...

    def close(self) -> None: ...


class EngineSource:
    """Each step's prompts sampled `n` times by `engine` in the loop, and scored (GRPO's rewards by the step's
    schedule, `scheduled`; else the config's)."""

    behaviour_cap = None
    unseen = None

    def __init__(self, runtime: PolicyRuntime, engine: Engine | None, order: Callable[..., list[int]], n: int, *,
                 who: str, scheduled: bool = True, figures: Mapping[str, float] | None = None):
        self.runtime, self.engine, self.order, self.n, self.who = runtime, engine, order, n, who
        self.scheduled, self.figures = scheduled, dict(figures or {})
        self.logprobs = runtime.cfg.loss.tis_cap is not None  # the sampler's log-probs only where the loss reads them

    def sample(self, idx: list[int]) -> Rollout:
        return sample_rollout(self.engine, [self.runtime.cells[i] for i in idx], self.n, self.runtime.cfg.sampling,
                              logprobs=self.logprobs, who=self.who)

    def score(self, rollout: Rollout, idx: list[int], step: int = 0):
        """The rewards that count at `step` (`grpo.schedule.rewards_from`) of the rollout's completions."""
        cfg = self.runtime.cfg
        rewards = cfg.schedule.rewards_at(cfg.rewards, step, cfg.max_steps) if self.scheduled else None
        return self.runtime.score(rollout, idx, self.n, rewards)

    def draw(self, step: int, draw: int = 0) -> tuple[Rollout, list[int], object]:
        idx = process_share(self.runtime.acc, self.order(step, draw))  # this process's share of the step's prompts
        rollout = self.sample(idx)
        return rollout, idx, self.score(rollout, idx, step)

    def collect(self, step: int) -> Collected:
        rollout, idx, scores = self.draw(step)
        return rollout, idx, scores, {**self.figures, **decode_figures(self.engine)}

    def start(self, first_step: int) -> None:
        pass

    def sync(self, version: int) -> None:
        """Gather the weights into the sampler's copy where the strategy keeps one, then let the engine refresh what
        it holds (a bf16 copy, captured steps)."""
        self.runtime.strategy.sync_sampler()
        self.engine.sync_weights()

    def pushes_at(self, version: int) -> bool:
        return True

    def close(self) -> None:
        pass


class DynamicRefill:
    """DAPO's dynamic sampling over an engine source: groups whose rewards all agree carry no gradient, so they are
    dropped and more prompts sampled, up to `max_refill_rounds` more draws, until the batch holds its groups.
    The dropped groups' rows are `unseen`: the grading watch counts them, so graders that fail on the groups it
    drops, or groups that stop carrying signal, are seen as they would be without the filter."""

    behaviour_cap = None

    def __init__(self, source: EngineSource, pad_token_id: int):
        self.source, self.pad_token_id = source, pad_token_id
        self.unseen: StepGrading | None = None

    @property
    def engine(self) -> Engine | None:
        return self.source.engine

    @engine.setter
    def engine(self, engine: Engine) -> None:
        self.source.engine = engine

    def collect(self, step: int) -> Collected:
        cfg, acc = self.source.runtime.cfg, self.source.runtime.acc
        G, want = cfg.num_generations, cfg.prompts_per_step // acc.num_processes
        rollout, idx, scores = self.source.draw(step)
        stats = {"dynamic/refill_rounds": 0.0}
        parts = [(rollout, scores, idx, spread_groups(scores.total, G, scores.graded_rows))]
        # the kept batch is filtered, so its reward figures read high: record the unfiltered first draw too (its
        # graded rows: an ungraded row's total is no reward)
        first = [t for t, g in zip(scores.total, scores.graded_rows) if g]
        stats["dynamic/first_draw_reward"] = sum(first) / len(first) if first else float("nan")
        stats["dynamic/first_draw_ungraded_share"] = 1 - len(first) / len(scores.total)
        stats["dynamic/first_draw_zero_std_groups"] = 1 - len(parts[0][3]) / len(idx)
        for draw in range(1, cfg.rollout.max_refill_rounds + 1):
            if sum(len(p[3]) for p in parts) >= want:
                break
            r, more, s = self.source.draw(step, draw)
            parts.append((r, s, more, spread_groups(s.total, G, s.graded_rows)))
            stats["dynamic/refill_rounds"] = float(draw)
        rollout, idx, scores = concat_groups(parts, G, want, self.pad_token_id)
        drawn = functools.reduce(StepGrading.plus, [_grading(s, len(ids), len(spread)) for _, s, ids, spread in parts])
        kept = _grading(scores, len(idx), len(spread_groups(scores.total, G, scores.graded_rows)))
        self.unseen = _less(drawn, kept)  # the dropped groups, for the grading watch
        stats["dynamic/groups"] = float(len(idx))
        return rollout, idx, scores, {**stats, **decode_figures(self.engine)}  # the refills' steps too

    def start(self, first_step: int) -> None:
        self.source.start(first_step)

    def sync(self, version: int) -> None:
        self.source.sync(version)

    def pushes_at(self, version: int) -> bool:
        return True

    def close(self) -> None:
        self.source.close()


def _grading(scores, groups: int, spread: int) -> StepGrading:
    graded = scores.graded_rows
    return StepGrading(len(graded), len(graded) - sum(graded), Counter(scores.ungraded_counts()), groups, spread)


def _less(drawn: StepGrading, kept: StepGrading) -> StepGrading:
    """What a step drew and did not keep (the kept groups are some of the drawn ones)."""
    return StepGrading(drawn.rows - kept.rows, drawn.ungraded - kept.ungraded, drawn.reasons - kept.reasons,
                       drawn.groups - kept.groups, drawn.spread - kept.spread)


def rollout_source(runtime: PolicyRuntime, generation: GenerationConfig | None = None,
                   engine: Engine | None = None) -> RolloutSource:
    """GRPO's rollout source as `runtime.cfg` asks: asynchronous samplers (`rollout.mode: async`, which build their
    own engines), else `engine` (or the stage's, on the policy's whole weights in the loop's precision) in the loop,
    refilled when dynamic sampling is on."""
    cfg, generation = runtime.cfg, generation or GenerationConfig()
    order = prompt_mix_order(runtime.prompts, cfg)  # all rows alike, or `prompt_mix`'s share of each kind every step
    if cfg.rollout.asynchronous:
        from grpo.training.rollouts.source import AsyncSource  # the transports load only where a run uses them

        return AsyncSource(runtime, generation, order)
    dtype = sampling_dtype(runtime.acc.mixed_precision)
    engine = engine or build_engine(generation, runtime.strategy.sampler_model(dtype), runtime.tokenizer, dtype=dtype,
                                    who="GRPO", fp32_gemm=cfg.memory.fp32_gemm)
    if not cfg.rollout.dynamic_sampling:  # its figure reads 0 on a run that never refills
        return EngineSource(runtime, engine, order, cfg.num_generations, who="GRPO",
                            figures={"dynamic/refill_rounds": 0.0})
    return DynamicRefill(EngineSource(runtime, engine, order, cfg.num_generations, who="GRPO"),
                         runtime.tokenizer.pad_token_id)
