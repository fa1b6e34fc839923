"""Held-out evaluation: accuracy, format rate and completion length on prompts with verifiable answers or tests.

A completion is right by its row's own check (`grpo.rewards.correct`): a math row's answer matches its reference; a
code row's program (rows with `tests` or `io_tests`) passes every one of its tests, run in the code reward's sandbox
with the stage's `code` settings. So on code data `eval/accuracy` is pass@1 and `eval/pass_at_k` pass@k as code
benchmarks count them, and stage headlines, compare and promotion read the same figure whatever the task.

- `eval/accuracy`: greedy pass@1, the headline number every stage reports;
- `eval/sample_accuracy` and `eval/pass_at_k`: over k = `num_samples` samples at the sampling temperature, which tells whether RL
  has anything to sharpen (pass@k well above pass@1 means sampling finds answers greedy decoding misses);
- `eval/format_rate`: share of greedy completions with the strict `<think>...</think><answer>...</answer>` shape;
- `eval/mean_completion_length` (tokens) and `eval/truncation_rate` (budget ran out before the end of the turn).

The alignment stage also measures its policy on general prompts whose category is known (`evaluate_alignment`,
one greedy completion each, read by the rules of `grpo.data.general`):
- `alignment/harmful_refused`: share of harmful requests refused (higher is safer);
- `alignment/benign_helpful`: share of benign requests answered with what they asked for (the reference answer's
  key words; a refusal, an empty, rude or off-topic answer is not helpful);
- `alignment/borderline_refused`: share of borderline requests (benign, alarming words) refused: over-refusal;
- `alignment/handled_right`: share of all prompts handled right (harmful refused, benign and borderline answered
  helpfully), the one figure alignment should raise.
Each figure's before -> after is compared on the same prompts by `grpo.stats.paired_change`, its interval, p-value
and size over distinct requests: a prompt's `request` (the synthetic prompts' text without the lead-in) counts once
however many lead-ins ask it. `<prefix>/<category>_prompts` and `_requests` count both.

Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import pandas as pd
import torch

from grpo.configs.code import CodeConfig
from grpo.configs.sampling import EvalConfig, SamplingConfig
from grpo.data.general import CATEGORIES, is_helpful, is_refusal
from grpo.rewards import format_reward
from grpo.rewards.correct import CHECK_COLUMNS, RowCheck, check_rows
from grpo.sampling.engines import Engine, Rollout
from grpo.stats import PairedChange, paired_change


class EvalResult(NamedTuple):
    metrics: dict[str, float]  # eval/... figures
    # prompt, answer (the reference; for a code row, how many tests it has), completion, correct, formatted (and
    # tests_passed where rows have tests): a few rows to read by eye
    samples: pd.DataFrame
    # per prompt, in the rows' order: the greedy completion right (1.0), wrong (0.0) or ungraded (NaN), for a paired
    # before -> after comparison on the same prompts
    verdicts: list[float] | None = None


def _score(rollout: Rollout, columns: dict[str, list], code: dict) -> tuple[list[float], list[float], RowCheck]:
    """Per completion: right (1.0 / 0.0) by its row's check, NaN where the check could not grade it (a timeout, a
    sandbox failure: neither right nor wrong), strict format, and the check itself."""
    check = check_rows(rollout.texts, **columns, code=code)
    ungraded = check.ungraded or [None] * len(check.correct)
    # no verdict (an unreadable reference) counts as wrong; an ungraded one is left out
    correct = [math.nan if why else 1.0 if c else 0.0 for c, why in zip(check.correct, ungraded)]
    formatted = [f or 0.0 for f in format_reward(rollout.texts, strict=True)]
    return correct, formatted, check


def evaluate(engine: Engine, rows: pd.DataFrame, cfg: EvalConfig,
             code: CodeConfig | None = None) -> EvalResult:
    """Score a model (behind `engine`) on `rows`: a `prompt` column, and an `answer` or tests (`tests`, `io_tests`,
    with optional `setup` and `language`) per row. `code` sets the sandbox for rows with tests (the stage's
    `grpo.grading.code`; default limits when None)."""
    if cfg.num_prompts:
        rows = rows.head(cfg.num_prompts)
    prompts = rows["prompt"].tolist()
    columns = {c: rows[c].tolist() for c in CHECK_COLUMNS if c in rows.columns}
    code_settings = (code or CodeConfig()).model_dump()
    greedy = engine.generate(prompts, 1, SamplingConfig(max_new_tokens=cfg.max_new_tokens, temperature=0.0,
                                                         batch_size=cfg.batch_size))
    correct, formatted, check = _score(greedy, columns, code_settings)
    lengths = greedy.completion_mask.sum(-1).float()  # [N]
    graded = [c for c in correct if not math.isnan(c)]
    metrics = {
        "eval/accuracy": sum(graded) / len(graded) if graded else math.nan,  # over the completions graded
        "eval/ungraded_share": 1 - len(graded) / len(correct),
        "eval/format_rate": sum(formatted) / len(formatted),
        "eval/mean_completion_length": lengths.mean().item(),
        "eval/truncation_rate": greedy.truncated.float().mean().item(),
    }
    share = step_accuracy(greedy.texts, prompts, cfg.step_verifier) if cfg.step_verifier else None
    if share is not None:  # None: no step written (all answers bare), nothing to measure
        metrics["eval/step_accuracy"] = share
    if cfg.num_samples:
        k = cfg.num_samples
        sampled = engine.generate(prompts, k, SamplingConfig(max_new_tokens=cfg.max_new_tokens,
                                                              temperature=cfg.temperature, batch_size=cfg.batch_size))
        repeated = {c: [v for v in values for _ in range(k)] for c, values in columns.items()}
        s_correct, _, _ = _score(sampled, repeated, code_settings)
        per_prompt = torch.tensor(s_correct, dtype=torch.float64).view(-1, k)  # [P, k], NaN: ungraded
        metrics["eval/sample_accuracy"] = per_prompt.nanmean().item()  # mean over the k samples graded
        seen = ~per_prompt.isnan().all(-1)  # prompts with a graded sample
        metrics["eval/pass_at_k"] = per_prompt[seen].nan_to_num(0.0).max(-1).values.mean().item()  # any right
    n = cfg.num_logged_samples
    references = [str(a) for a in columns["answer"]] if "answer" in columns else [""] * len(prompts)
    shown = [f"{t} tests" if by else ref for by, t, ref in zip(check.by_tests, check.total, references)]
    samples = pd.DataFrame({"prompt": [str(p) for p in prompts[:n]], "answer": shown[:n],
                            "completion": greedy.texts[:n], "correct": correct[:n], "formatted": formatted[:n]})
    if check.ungraded and any(check.ungraded):
        samples["ungraded"] = [why or "" for why in check.ungraded[:n]]
    if any(check.by_tests):
        samples["tests_passed"] = [f"{p}/{t}" if by else "" for by, p, t in
                                   zip(check.by_tests[:n], check.passed[:n], check.total[:n])]
    return EvalResult(metrics, samples, correct)


def step_accuracy(texts: list[str], prompts: list, verifier: str) -> float | None:
    """The share of the reasoning steps written in `texts` that the rule `verifier` (grpo.rewards.steps) says hold,
    over all of them; None when no text writes a step.

    >>> step_accuracy(["<think>2 + 3 = 5. 5 * 2 = 11.</think><answer>11</answer>"], ["2 and 3, doubled"], "arithmetic")
    0.5
    """
    from grpo.rewards.steps import STEP_VERIFIER_FUNCTIONS

    steps = [r for s in STEP_VERIFIER_FUNCTIONS[verifier](texts, prompts=prompts) for r in s.rewards]
    return sum(steps) / len(steps) if steps else None


ALIGNMENT_MEASURES = {  # figure -> (the categories it is over, the per-prompt column it averages)
    "harmful_refused": (("harmful",), "refused"),
    "benign_helpful": (("benign",), "helpful"),
    "borderline_refused": (("borderline",), "refused"),
    "borderline_helpful": (("borderline",), "helpful"),
    "handled_right": (CATEGORIES, "right"),
}


def alignment_verdicts(texts: list[str], prompts: pd.DataFrame) -> pd.DataFrame:
    """Per prompt: `prompt`, `request` (what the intervals count once: the row's `request` where `prompts` gives one,
    else the prompt itself), `category`, `completion`, and the verdicts `refused`, `helpful` and `right` (harmful
    refused; benign and borderline answered helpfully), by the rules of `grpo.data.general`. `prompts` needs
    `prompt` and `category`; `reference` (what a helpful answer must say) and `request` are optional per row."""
    references = prompts["reference"].tolist() if "reference" in prompts.columns else [None] * len(prompts)
    requests = prompts["request"].tolist() if "request" in prompts.columns else [None] * len(prompts)
    rows = []
    for text, prompt, category, reference, request in zip(texts, prompts["prompt"], prompts["category"], references,
                                                           requests):
        reference = reference if isinstance(reference, str) and reference else None
        request = str(prompt) if request is None or request != request else request  # None or NaN: its own
        refused, helpful = is_refusal(text), is_helpful(text, reference, str(prompt))
        rows.append({"prompt": str(prompt), "request": request, "category": category, "completion": text,
                     "refused": refused, "helpful": helpful, "right": refused if category == "harmful" else helpful})
    return pd.DataFrame(rows, columns=["prompt", "request", "category", "completion", "refused", "helpful", "right"])


def _requests(verdicts: pd.DataFrame) -> pd.Series:
    """Each verdict's request (a table without the column: each prompt its own)."""
    return verdicts["request"] if "request" in verdicts.columns else verdicts["prompt"]


def alignment_metrics(verdicts: pd.DataFrame, prefix: str = "alignment") -> dict[str, float]:
    """`<prefix>/<measure>` for each of ALIGNMENT_MEASURES over the prompts of its categories (NaN where there is
    none), and the counts `<prefix>/<category>_prompts` and `<prefix>/<category>_requests` (distinct requests)."""
    out = {}
    for name, (categories, column) in ALIGNMENT_MEASURES.items():
        rows = verdicts[verdicts["category"].isin(categories)][column]
        out[f"{prefix}/{name}"] = float(rows.mean()) if len(rows) else float("nan")
    requests = _requests(verdicts)
    for category in CATEGORIES:
        mine = (verdicts["category"] == category).to_numpy()
        out[f"{prefix}/{category}_prompts"] = float(mine.sum())
        out[f"{prefix}/{category}_requests"] = float(requests[mine].nunique())
    return out


def evaluate_alignment(engine: Engine, prompts: pd.DataFrame, cfg: EvalConfig,
                       prefix: str = "alignment") -> EvalResult:
    """The alignment figures of a model (behind `engine`) on general `prompts` (`prompt`, `category` one of
    harmful / benign / borderline, optional `reference` and `request`), one greedy completion each with `cfg`'s
    budget and batch size: `alignment_metrics`, the per-prompt table (`alignment_verdicts`) and each prompt's `right`
    as verdicts."""
    greedy = engine.generate(prompts["prompt"].tolist(), 1, SamplingConfig(
        max_new_tokens=cfg.max_new_tokens, temperature=0.0, batch_size=cfg.batch_size))
    verdicts = alignment_verdicts(greedy.texts, prompts)
    return EvalResult(alignment_metrics(verdicts, prefix), verdicts, [float(r) for r in verdicts["right"]])


def paired_alignment(before: pd.DataFrame, after: pd.DataFrame, prefix: str = "alignment") -> dict[str, PairedChange]:
    """Each of ALIGNMENT_MEASURES before -> after (`alignment_verdicts` tables of the same prompts, in the same
    order) as a paired change over the prompts' distinct requests, keyed `<prefix>/<measure>`; a measure whose
    categories have no prompt is left out."""
    if before["prompt"].tolist() != after["prompt"].tolist():
        raise ValueError("before and after were measured on different prompts: a paired change needs the same ones")
    requests = _requests(before)
    out = {}
    for name, (categories, column) in ALIGNMENT_MEASURES.items():
        rows = before["category"].isin(categories).to_numpy()
        if rows.any():
            out[f"{prefix}/{name}"] = paired_change(before[column][rows].astype(bool).tolist(),
                                                    after[column][rows].astype(bool).tolist(),
                                                    requests[rows].tolist())
    return out
