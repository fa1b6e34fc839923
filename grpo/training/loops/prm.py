"""A process reward model (PRM): the probability that a reasoning step still leads to the right answer.

Labels, Math-Shepherd style (Wang et al. 2024, "hard estimation"): from a policy's completions, each step's prefix
(prompt + the completion up to the step's end) is continued K times by the policy; the step is good (1) if any of
the K rollouts reaches the reference answer, else bad (0). No person labels a step: a step after which the answer
cannot be reached is a wrong one. `label_steps` makes them; `label_worked_solutions` makes the labels a perfect
roller-out would give on the synthetic task (a corrupted step and the ones after it are bad), for tests.

The model is the alignment reward model's (grpo.training.loops.reward_model) with one output per token instead of one
per sequence: a causal LM backbone with a one-output linear head (`AutoModelForTokenClassification`), read at the
token each step ends in and trained with binary cross-entropy on the step labels, with the same settings
(`RewardModelConfig`) and loop. As a step verifier (`prm_step_verifier`) it finds the steps with a rule segmenter
(the synthetic task's equations, or GSM8K's lines) and rewards each with its probability of being good.

A micro-batch's rows go through the model as one row without padding where `packing` allows (as the reward model's
do: each row from position 0, attending to itself alone, its step ends read at its own offset in the row), the
padded batch's logits to float rounding.

Run it alone:
    labels = label_steps(build_engine(GenerationConfig(), policy, tok), rows, completions, k=4,
                         sampling=SamplingConfig())
    result = train_prm(labels, RewardModelConfig(model=ModelConfig(name_or_path=cold_start_dir)), "out/prm")
    then a recipe's reasoning_grpo.grpo: {supervision: process, step_verifier: prm, prm_path: out/prm/model}

Must not depend on Prefect or MLflow: metrics go to a callback.
"""

from __future__ import annotations

import logging
import math
import random
from collections import Counter
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import pandas as pd
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo.configs.model import ModelConfig
from grpo.configs.reward import RewardModelConfig
from grpo.configs.sampling import SamplingConfig
from grpo.data.arithmetic import Problem, format_response
from grpo.kernels.attention import PACKED, attending_packed
from grpo.models import load_scoring_model
from grpo.rewards import accuracy_reward
from grpo.rewards.outcomes import reason_of
from grpo.rewards.steps import STEP_VERIFIER_FUNCTIONS, Steps, StepVerifier
from grpo.sampling.local import TransformersBackend, render_prompts
from grpo.training.accelerator import make_accelerator
from grpo.training.batches import batch_indices, pad_right
from grpo.training.grading import GradingWatch, StepGrading
from grpo.training.optimizers import make_adamw, optimizer_step
from grpo.training.packing import pack_sequences
from grpo.training.reward_scorer import packs
from grpo.training.schedules import make_scheduler
from grpo.training.strategy import make_strategy

logger = logging.getLogger(__name__)

MetricsCallback = Callable[[int, dict[str, float]], None]


class PRMResult(NamedTuple):
    model_dir: Path  # the trained process reward model and its tokenizer
    steps: int  # optimizer steps taken
    final_loss: float  # mean binary cross-entropy over the last logging window
    heldout: dict[str, float]  # prm/heldout_auc, prm/heldout_accuracy (threshold 0.5), prm/heldout_positive_share


# ----------------------------------------------------------------------------------------------------------------
# Labels

def label_steps(engine: TransformersBackend, rows: pd.DataFrame, completions: Sequence[str], k: int,
                sampling: SamplingConfig, segment: str = "arithmetic", *, grade: Callable = accuracy_reward,
                max_ungraded_share: float = 0.05) -> pd.DataFrame:
    """Math-Shepherd hard labels: a step is good if one of `k` rollouts from its prefix reaches the answer.

    `engine`: the policy's local engine (`grpo.sampling.engines.build_engine`), which continues text as it is.
    `grade`: whether a rollout reaches the answer, a reward function's contract (`fn(completions, answer=...)`:
    1.0 reaches it).

    `rows` holds `prompt` and `answer`, one row a completion. Returns one row a completion that has a labelled
    step: prompt, completion, step_ends (character offsets), labels (1 good, 0 bad). A step none of whose rollouts
    reaches the answer while some could not be graded (a check that timed out, raised, ...: `grpo.rewards.outcomes`)
    is neither: it is left out, its end and label both, and counted in the frame's `attrs` ("prm/steps",
    "prm/ungraded_steps", "reward_ungraded/accuracy/<reason>"). Past `max_ungraded_share` of the steps so left out,
    the labelling stops (`grpo.training.grading.GradingStop`) in the grading watch's line rather than hand a PRM
    labels from a biased few.
    """
    if len(rows) != len(completions):
        raise ValueError(f"{len(rows)} rows for {len(completions)} completions")
    steps = STEP_VERIFIER_FUNCTIONS[segment](list(completions))
    rendered = render_prompts(engine.tokenizer, rows["prompt"].tolist())
    prefixes, owners = [], []  # every step's prefix, and the (completion, step) it belongs to
    for i, (s, text) in enumerate(zip(steps, completions)):
        for j, end in enumerate(s.ends):
            prefixes.append(rendered[i] + text[:end])
            owners.append((i, j))
    if not prefixes:
        raise ValueError(f"the {segment} segmenter found no step in any of the {len(completions)} completions")
    rollout = engine.generate_from_text(prefixes, k, sampling)  # k rows a prefix, prefix by prefix
    answers = rows["answer"].astype(str).tolist()
    # a rollout's whole completion: the original up to the step's end, then what the policy wrote from there
    right = grade([completions[i][: steps[i].ends[j]] + rollout.texts[n * k + r]
                   for n, (i, j) in enumerate(owners) for r in range(k)],
                  answer=[answers[i] for i, _ in owners for _ in range(k)])
    labels: dict[int, list[int | None]] = {}
    reasons: Counter = Counter()  # ("accuracy", reason) -> steps left unlabelled
    for n, (i, j) in enumerate(owners):
        checks = right[n * k : (n + 1) * k]
        why = [reason_of(r) for r in checks if reason_of(r) is not None]
        # good when some rollout from it reaches the answer; bad only when every rollout was graded and none did
        label = 1 if any(r == 1.0 for r in checks) else None if why else 0
        if label is None:
            reasons["accuracy", Counter(why).most_common(1)[0][0]] += 1
        labels.setdefault(i, [None] * len(steps[i].ends))[j] = label
    ungraded = sum(reasons.values())
    # one pass, one window; labels that all tie are said below, in the labelling's own words
    watch = GradingWatch(max_ungraded_share, 1, no_signal_steps=2, stop_without_signal=False, stage="PRM labelling")
    watch.observe(0, StepGrading(len(owners), ungraded, reasons, 1, 1))  # may stop here, in one line
    out = []
    for i in sorted(labels):
        kept = [(e, y) for e, y in zip(steps[i].ends, labels[i]) if y is not None]
        if kept:
            out.append({"prompt": rows["prompt"].iloc[i], "completion": completions[i],
                        "step_ends": [e for e, _ in kept], "labels": [y for _, y in kept]})
    frame = pd.DataFrame(out)
    if len({y for row in out for y in row["labels"]}) < 2:  # every label alike: no step told from another
        logger.warning("PRM labelling: all %d labelled steps are %s; a PRM trained on them learns no step from "
                       "another", len(owners) - ungraded, "good" if out and out[0]["labels"][0] else "bad")
    frame.attrs = {"prm/steps": float(len(owners)), "prm/ungraded_steps": float(ungraded),
                   **{f"reward_ungraded/{name}/{reason}": float(n) for (name, reason), n in reasons.items()}}
    return frame


def label_worked_solutions(problems: Sequence[Problem], seed: int = 0) -> pd.DataFrame:
    """The labels a perfect roller-out gives on the synthetic task: each worked solution once as it is (every step
    good) and once with one step's result off by 1-3 (that step and every later one bad: no rollout that trusts
    the wrong result reaches the answer)."""
    rng = random.Random(seed)
    out = []
    for p in problems:
        out.append(_labelled(p.question, format_response(p), len(p.steps), None))
        bad = rng.randrange(len(p.steps))
        a, op, b, _, c = p.steps[bad].split(" ")
        wrong = int(c) + rng.choice([-3, -2, -1, 1, 2, 3])
        wrong = wrong if wrong >= 0 else int(c) + 1
        corrupted = Problem(p.question, tuple(f"{a} {op} {b} = {wrong}" if n == bad else s
                                              for n, s in enumerate(p.steps)), p.answer)
        out.append(_labelled(p.question, format_response(corrupted), len(p.steps), bad))
    return pd.DataFrame(out)


def _labelled(question: str, response: str, n_steps: int, bad: int | None) -> dict:
    (steps,) = STEP_VERIFIER_FUNCTIONS["arithmetic"]([response])
    assert len(steps.ends) == n_steps, response
    return {"prompt": question, "completion": response, "step_ends": list(steps.ends),
            "labels": [int(bad is None or j < bad) for j in range(n_steps)]}


# ----------------------------------------------------------------------------------------------------------------
# The model, and reading it at the steps' ends

def build_prm(cfg: ModelConfig, seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A one-output token classifier: the embedded backbone ("tiny") or a folder's (a policy, or a trained PRM)
    (`grpo.models.load_scoring_model`)."""
    return load_scoring_model(cfg, "token", seed)


def encode_steps(tok: PreTrainedTokenizerBase, prompts: Sequence, completions: Sequence[str],
                 step_ends: Sequence[Sequence[int]]) -> list[tuple[list[int], list[int]]]:
    """(token ids of the chat-rendered prompt + completion, the token each step ends in) per row."""
    out = []
    for rendered, text, ends in zip(render_prompts(tok, list(prompts)), completions, step_ends):
        enc = tok(rendered + text, add_special_tokens=False, return_offsets_mapping=True)
        token_ends = [e for _, e in enc["offset_mapping"]]
        positions = []
        for end in ends:
            target = len(rendered) + end  # the step's last character is target - 1
            positions.append(next((t for t, e in enumerate(token_ends) if e >= target), len(token_ends) - 1))
        out.append((enc["input_ids"], positions))
    return out


def step_logits(model: torch.nn.Module, rows: Sequence[tuple[list[int], list[int]]], pad_id: int,
                device: torch.device, *, packed_for: PreTrainedModel | None = None) -> torch.Tensor:
    """The PRM's logits [S] at every step end of `rows` ((token ids, step-end positions) each), row by row, with
    gradients where they are on; `model` may be wrapped (it is called through its own forward).

    Padded (`packed_for` None): rows right-padded, so positions stay each row's own. Packed (`packed_for`: the
    unwrapped model, see `packs`): one row [1, T] without padding, each row's step ends read at its offset in it;
    the same numbers to float rounding. Its sequences travel as `packed_segments` where the model attends with
    `packed_attention` (`attending_packed`), else as position ids alone.
    """
    if packed_for is None:
        ids, mask = pad_right([r[0] for r in rows], pad_id)
        b = torch.tensor([n for n, (_, positions) in enumerate(rows) for _ in positions], dtype=torch.long)  # [S]
        t = torch.tensor([p for _, positions in rows for p in positions], dtype=torch.long)  # [S]
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits[..., 0]  # [B, T]
        return logits[b.to(logits.device), t.to(logits.device)].float()  # [S]
    inputs = pack_sequences([r[0] for r in rows])
    inputs.pop("ends")
    starts = [seg.start for seg in inputs["packed_segments"].segments]  # [B] where each row begins in the packed one
    at = torch.tensor([start + p for start, (_, positions) in zip(starts, rows) for p in positions],
                      dtype=torch.long)  # [S]
    if packed_for.config._attn_implementation != PACKED:
        inputs.pop("packed_segments")
    logits = model(**{k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}).logits[0, :, 0]  # [T]
    return logits[at.to(logits.device)].float()  # [S]


@torch.no_grad()
def score_step_positions(model: PreTrainedModel, pad_id: int, rows: list[tuple[list[int], list[int]]],
                         batch_size: int = 64, packed: bool = False) -> list[list[float]]:
    """The PRM's logit at every step end of every row (`step_logits`, in batches; `packed`: each batch one row)."""
    device = next(model.parameters()).device
    scores: list[list[float]] = []
    with attending_packed(model, packed):
        for s in range(0, len(rows), batch_size):
            chunk = rows[s : s + batch_size]
            flat = step_logits(model, chunk, pad_id, device, packed_for=model if packed else None).tolist()  # [S]
            for _, positions in chunk:
                scores.append(flat[: len(positions)])
                flat = flat[len(positions):]
    return scores


def _auc(scores: list[float], labels: list[int]) -> float:
    """Probability that a good step outscores a bad one (ties count half): 0.5 is chance."""
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    if not pos or not neg:
        return math.nan
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def evaluate_prm(model: PreTrainedModel, tok: PreTrainedTokenizerBase, labelled: pd.DataFrame,
                 batch_size: int = 64, packed: bool = False) -> dict[str, float]:
    rows = encode_steps(tok, labelled["prompt"].tolist(), labelled["completion"].tolist(), labelled["step_ends"])
    scores = [x for r in score_step_positions(model.eval(), tok.pad_token_id, rows, batch_size, packed) for x in r]
    labels = [int(y) for ys in labelled["labels"] for y in ys]
    return {"prm/heldout_auc": _auc(scores, labels),
            "prm/heldout_accuracy": sum((s > 0) == bool(y) for s, y in zip(scores, labels)) / len(labels),
            "prm/heldout_positive_share": sum(labels) / len(labels)}


# ----------------------------------------------------------------------------------------------------------------
# Training

def train_prm(labelled: pd.DataFrame, cfg: RewardModelConfig, output_dir: str | Path,
              on_metrics: MetricsCallback | None = None, *, heldout: pd.DataFrame | None = None) -> PRMResult:
    """Train a PRM on rows (prompt, completion, step_ends, labels) and save it to `output_dir/model`."""
    for column in ("prompt", "completion", "step_ends", "labels"):
        if column not in labelled.columns:
            raise ValueError(f"PRM rows need a {column!r} column; found {list(labelled.columns)}")
    model, tok = build_prm(cfg.model, cfg.seed)
    rows = encode_steps(tok, labelled["prompt"].tolist(), labelled["completion"].tolist(), labelled["step_ends"])
    labels = [list(map(float, ys)) for ys in labelled["labels"]]
    for i, (ids, positions) in enumerate(rows):
        if len(ids) > cfg.max_seq_len:
            raise ValueError(f"PRM rows: row {i} is {len(ids)} tokens; expected at most max_seq_len={cfg.max_seq_len}")
        if len(positions) != len(labels[i]):
            raise ValueError(f"PRM rows: row {i} has {len(positions)} step ends and {len(labels[i])} labels")
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    acc = make_accelerator(cfg.mixed_precision, cfg.grad_accum_steps)
    model.config.use_cache = False
    optimizer = make_adamw(model, cfg.learning_rate, cfg.weight_decay)
    scheduler = make_scheduler(cfg.lr_scheduler, optimizer, num_warmup_steps=cfg.warmup_steps,
                               num_training_steps=cfg.max_steps)
    strategy = make_strategy(acc)  # one process (the PRM trains where the benchmark or test runs)
    model, optimizer, scheduler = strategy.prepare(model, optimizer, scheduler)
    unwrapped = acc.unwrap_model(model)
    # each micro-batch's rows as one row without padding, where the model's attention takes it exactly
    packed = packs(cfg.packing, unwrapped)
    window: list[float] = []
    last_loss = math.nan
    with attending_packed(unwrapped, packed):  # held for the run: packed rows attend sequence by sequence
        model.train()
        for step in range(cfg.max_steps):
            for micro in range(cfg.grad_accum_steps):
                idx = batch_indices(len(rows), cfg.batch_size, step * cfg.grad_accum_steps + micro, cfg.seed)
                y = torch.tensor([v for i in idx for v in labels[i]])  # [S] each step end's label, row by row
                with strategy.accumulate(model):
                    picked = step_logits(model, [rows[i] for i in idx], tok.pad_token_id, acc.device,
                                         packed_for=unwrapped if packed else None)  # [S]
                    loss = F.binary_cross_entropy_with_logits(picked, y.to(picked.device))
                    acc.backward(loss)
                    optimizer_step(acc, model, optimizer, scheduler, cfg.max_grad_norm)
                window.append(loss.item())
            done = step + 1
            if done % cfg.log_every == 0 or done == cfg.max_steps:
                last_loss = sum(window) / len(window)
                window.clear()
                if on_metrics:
                    on_metrics(done, {"prm/loss": last_loss, "prm/learning_rate": scheduler.get_last_lr()[0]})
    metrics = evaluate_prm(unwrapped, tok, heldout, cfg.eval_batch_size, packed) if heldout is not None else {}
    if on_metrics and metrics:
        on_metrics(cfg.max_steps, metrics)
    model_dir = Path(output_dir) / "model"
    unwrapped.config.use_cache = True
    unwrapped.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    return PRMResult(model_dir, cfg.max_steps, last_loss, metrics)


# ----------------------------------------------------------------------------------------------------------------
# As a step verifier

def prm_step_verifier(path: str | Path, segment: str = "arithmetic", batch_size: int = 64) -> StepVerifier:
    """A trained PRM as a step verifier: the rule segmenter's steps, each rewarded with P(good) from the model."""
    if segment not in STEP_VERIFIER_FUNCTIONS:
        raise ValueError(f"unknown segmenter {segment!r}; known: {sorted(STEP_VERIFIER_FUNCTIONS)}")
    model, tok = build_prm(ModelConfig(name_or_path=str(path)))
    model.eval()
    find_steps = STEP_VERIFIER_FUNCTIONS[segment]

    def prm(completions: Sequence, prompts: Sequence | None = None, prompt: Sequence | None = None,
            **_) -> list[Steps]:
        prompts = prompts if prompts is not None else prompt
        if prompts is None:
            raise ValueError("the process reward model reads the question: pass a 'prompts' (or 'prompt') column")
        texts = [str(c) for c in completions]
        ends = [s.ends for s in find_steps(texts)]
        keep = [i for i, e in enumerate(ends) if e]
        out = [Steps() for _ in texts]
        rows = encode_steps(tok, [prompts[i] for i in keep], [texts[i] for i in keep], [ends[i] for i in keep])
        for i, logits in zip(keep, score_step_positions(model, tok.pad_token_id, rows, batch_size)):
            out[i] = Steps(tuple(ends[i]), tuple(1 / (1 + math.exp(-x)) for x in logits))
        return out

    return prm
