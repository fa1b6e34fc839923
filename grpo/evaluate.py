"""Held-out evaluation: accuracy, format rate and completion length on prompts with verifiable answers.

- `eval/accuracy`: greedy pass@1, the headline number every stage reports;
- `eval/sample_accuracy` and `eval/pass_at_k`: over k = `num_samples` samples at the sampling temperature, which tells whether RL
  has anything to sharpen (pass@k well above pass@1 means sampling finds answers greedy decoding misses);
- `eval/format_rate`: share of greedy completions with the strict `<think>...</think><answer>...</answer>` shape;
- `eval/mean_completion_length` (tokens) and `eval/truncation_rate` (budget ran out before the end of the turn).

Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

from typing import NamedTuple

import pandas as pd
import torch

from grpo.config import EvalConfig, SamplingConfig
from grpo.rewards import accuracy_reward, format_reward
from grpo.sampling.backend import GenerationBackend, Rollout


class EvalResult(NamedTuple):
    metrics: dict[str, float]  # eval/... figures
    samples: pd.DataFrame  # prompt, answer, completion, correct, formatted: a few rows to read by eye


def _score(rollout: Rollout, answers: list[str]) -> tuple[list[float], list[float]]:
    correct = [c or 0.0 for c in accuracy_reward(rollout.texts, answer=answers)]
    formatted = [f or 0.0 for f in format_reward(rollout.texts, strict=True)]
    return correct, formatted


def evaluate(backend: GenerationBackend, rows: pd.DataFrame, cfg: EvalConfig) -> EvalResult:
    """Score a model (behind `backend`) on `rows` with `prompt` and `answer` columns."""
    if cfg.num_prompts:
        rows = rows.head(cfg.num_prompts)
    prompts, answers = rows["prompt"].tolist(), [str(a) for a in rows["answer"]]
    greedy = backend.generate(prompts, 1, SamplingConfig(max_new_tokens=cfg.max_new_tokens, temperature=0.0,
                                                         batch_size=cfg.batch_size))
    correct, formatted = _score(greedy, answers)
    lengths = greedy.completion_mask.sum(-1).float()  # [N]
    metrics = {
        "eval/accuracy": sum(correct) / len(correct),
        "eval/format_rate": sum(formatted) / len(formatted),
        "eval/mean_completion_length": lengths.mean().item(),
        "eval/truncation_rate": greedy.truncated.float().mean().item(),
    }
    if cfg.num_samples:
        k = cfg.num_samples
        sampled = backend.generate(prompts, k, SamplingConfig(max_new_tokens=cfg.max_new_tokens,
                                                              temperature=cfg.temperature, batch_size=cfg.batch_size))
        s_correct, _ = _score(sampled, [a for a in answers for _ in range(k)])
        per_prompt = torch.tensor(s_correct).view(-1, k)  # [P, k]
        metrics["eval/sample_accuracy"] = per_prompt.mean().item()  # mean over the k samples
        metrics["eval/pass_at_k"] = per_prompt.max(-1).values.mean().item()  # any of the k right
    n = cfg.num_logged_samples
    samples = pd.DataFrame({"prompt": [str(p) for p in prompts[:n]], "answer": answers[:n],
                            "completion": greedy.texts[:n], "correct": correct[:n], "formatted": formatted[:n]})
    return EvalResult(metrics, samples)
