"""DAPO's dynamic sampling: which groups carry a gradient (their rewards differ), and one batch made of the groups
kept from several draws. The rollout source `grpo.training.sources.DynamicRefill` calls both when
`rollout.dynamic_sampling` is on; the GRPO loop reads `spread_groups` for every step's `reward/zero_std_groups`.

Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import torch

from grpo.sampling.engines import Rollout, cat_padded


def spread_groups(total: list[float], G: int, graded: list[bool] | None = None) -> list[int]:
    """Indices of groups whose rewards differ (the only ones that carry a gradient), over their `graded` rows."""
    graded = [True] * len(total) if graded is None else graded
    spread = []
    for g in range(len(total) // G):
        values = [total[i] for i in range(g * G, (g + 1) * G) if graded[i]]
        if len(values) >= 2 and max(values) > min(values):
            spread.append(g)
    return spread


def concat_groups(parts, G: int, want: int, pad_id: int):
    """Keep up to `want` groups with reward spread from several draws; with none at all, keep the first draw.

    `parts` holds (rollout, scores, prompt indices, kept group numbers) per draw; returns what one draw of the
    engine source gives (`EngineSource.draw`): the rollout, its prompt indices and its scores.
    """
    chosen = [(r, s, g, idx[g]) for r, s, idx, kept in parts for g in kept][:want]
    if not chosen:  # no group had spread: train on the first draw (zero advantages; only the KL term acts)
        r, s, idx, _ = parts[0]
        chosen = [(r, s, g, idx[g]) for g in range(len(idx))]
    rows = lambda g: slice(g * G, (g + 1) * G)  # noqa: E731
    prompt_w = max(r.prompt_ids.size(1) for r, *_ in chosen)

    def left(t: torch.Tensor, value) -> torch.Tensor:
        return torch.nn.functional.pad(t, (prompt_w - t.size(1), 0), value=value)

    rollout = Rollout(
        prompt_ids=torch.cat([left(r.prompt_ids[rows(g)], pad_id) for r, _, g, _ in chosen]),
        prompt_mask=torch.cat([left(r.prompt_mask[rows(g)], 0) for r, _, g, _ in chosen]),
        completion_ids=cat_padded([r.completion_ids[rows(g)] for r, _, g, _ in chosen], pad_id),
        completion_mask=cat_padded([r.completion_mask[rows(g)] for r, _, g, _ in chosen], 0),
        logprobs=None if chosen[0][0].logprobs is None else cat_padded(
            [r.logprobs[rows(g)] for r, _, g, _ in chosen], 0.0),
        truncated=torch.cat([r.truncated[rows(g)] for r, _, g, _ in chosen]),
        texts=[t for r, _, g, _ in chosen for t in r.texts[rows(g)]],
    )
    # the kept groups' scores, and every draw's counts of failures and skips
    kept = [s.take(list(range(g * G, (g + 1) * G))) for _, s, g, _ in chosen]
    draws = {id(p[1]): p[1] for p in parts}.values()
    first = kept[0]
    scores = type(first)(
        per_function={name: [v for k in kept for v in k.per_function[name]] for name in first.per_function},
        total=[v for k in kept for v in k.total],
        failures={name: sum(s.failures.get(name, 0) for s in draws) for name in first.failures},
        skipped={name: sum(s.skipped.get(name, 0) for s in draws) for name in first.skipped},
        ungraded={name: [v for k in kept for v in k.ungraded[name]] for name in first.ungraded},
        graded=[v for k in kept for v in k.graded_rows],
        figures={key: sum(s.figures.get(key, 0.0) for s in draws) for key in {k for s in draws for k in s.figures}},
    )
    return rollout, [i for *_, i in chosen], scores
