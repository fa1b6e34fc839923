"""The reward model of the alignment stage (R1 stage 5): a scalar score of how helpful and harmless a response is.

R1 scores its general (non-reasoning) prompts with reward models trained on human preference pairs; this module
trains one and hands it to GRPO as an ordinary reward function. The model is a causal LM backbone with a one-output
linear head (`AutoModelForSequenceClassification`, num_labels=1) that reads the hidden state of the last token of
prompt + response. It is trained with the Bradley-Terry loss `-log sigmoid(r_chosen - r_rejected)`, which makes
`sigmoid(r_a - r_b)` the modelled probability that a person prefers response a to b (InstructGPT, Ouyang et al.
2022, eq. 1). Only differences of scores mean anything; GRPO's group normalisation discards the offset anyway.

How this differs from the paper: R1 scores helpfulness on the final summary only and harmlessness on the whole
response, with two models; here one model reads the whole response (`<think>` included), which is what the
synthetic pairs in grpo.data.preferences teach. The loop has no resumable checkpoints: it is short next to SFT and GRPO.

Run it alone:
    from grpo.data.preferences import preference_pairs
    from grpo.reward_config import RewardModelConfig
    from grpo.training.reward_model import train_reward_model
    result = train_reward_model(preference_pairs(1000), RewardModelConfig(), "out/rm",
                                heldout=preference_pairs(200, split="heldout"))

Must not depend on Prefect or MLflow: metrics go to a callback.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import (
    AutoModelForSequenceClassification,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2ForSequenceClassification,
)

from grpo.config import TINY, ModelConfig
from grpo.reward_config import RewardModelConfig
from grpo.data.tables import DataError
from grpo.models import _DTYPES, activation_checkpointing, check_model_config, load_tokenizer
from grpo.recipe import DistributedConfig
from grpo.rewards import completion_text
from grpo.sampling.backend import render_prompts
from grpo.tiny import build_tiny_model
from grpo.training.accelerator import make_accelerator, make_adamw, optimizer_step
from grpo.training.distributed import check_split, main_only, process_share, reduce_metrics
from grpo.training.schedules import make_scheduler
from grpo.training.sft_trainer import _response_text, batch_indices
from grpo.training.strategy import make_strategy

MetricsCallback = Callable[[int, dict[str, float]], None]


class PairExample(NamedTuple):
    chosen_ids: list[int]  # chat-formatted prompt + chosen response
    rejected_ids: list[int]  # chat-formatted prompt + rejected response


class RewardModelResult(NamedTuple):
    model_dir: Path  # the trained reward model and its tokenizer, loadable with from_pretrained
    steps: int  # optimizer steps taken
    final_loss: float  # mean Bradley-Terry loss over the last logging window
    heldout_accuracy: float  # share of held-out pairs scored chosen > rejected after training (nan: no held-out)
    heldout_accuracy_before: float  # the same before training: the untrained model's baseline
    heldout_metrics: dict[str, float]  # rm/heldout_accuracy, rm/heldout_margin and, with a `flaw` column, per flaw
    seconds: float  # wall time of the training loop


# ----------------------------------------------------------------------------------------------------------------
# The loss

def bradley_terry_loss(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> torch.Tensor:
    """Mean over pairs of `-log sigmoid(r_chosen - r_rejected)`: the negative log-likelihood that the chosen wins.

    >>> bradley_terry_loss(torch.tensor([0.0]), torch.tensor([0.0]))  # a tie: -log(1/2)
    tensor(0.6931)
    """
    return -F.logsigmoid(chosen_rewards.float() - rejected_rewards.float()).mean()  # [B] -> scalar


def pair_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> dict[str, float]:
    """Accuracy (share of pairs with r_chosen strictly above r_rejected; a tie is a miss) and mean margin."""
    margin = (chosen_rewards.float() - rejected_rewards.float()).detach()  # [B]
    return {"accuracy": (margin > 0).float().mean().item(), "margin": margin.mean().item()}


# ----------------------------------------------------------------------------------------------------------------
# The model

def build_reward_model(cfg: ModelConfig, seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A sequence classifier with one output and `pad_token_id` set, so it can find each row's last token.

    "tiny" builds the embedded backbone (the same weights `build_tiny_model` gives for its seed) under a fresh
    head; anything else goes to `AutoModelForSequenceClassification.from_pretrained`, which keeps a causal LM's
    backbone and starts a new head, or reloads a trained reward model whole.
    """
    check_model_config(cfg)
    tok = load_tokenizer(cfg)
    if cfg.name_or_path == TINY:
        lm = build_tiny_model(cfg.tiny, tok)
        lm.config.num_labels = 1
        torch.manual_seed(seed)  # the head's initialisation
        model = Qwen2ForSequenceClassification(lm.config)
        model.model.load_state_dict(lm.model.state_dict())
        return model.to(_DTYPES[cfg.dtype]), tok
    kwargs = dict(num_labels=1, pad_token_id=tok.pad_token_id, trust_remote_code=cfg.trust_remote_code,
                  dtype=_DTYPES[cfg.dtype])
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_pretrained(cfg.name_or_path, **kwargs), tok


def load_reward_model(path: str | Path, dtype: str = "float32") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A reward model saved by `train_reward_model` (or any one-output sequence classifier folder)."""
    return build_reward_model(ModelConfig(name_or_path=str(path), dtype=dtype))


# ----------------------------------------------------------------------------------------------------------------
# Text to token ids, and batches

def encode(tokenizer: PreTrainedTokenizerBase, prompts: Sequence, responses: Sequence) -> list[list[int]]:
    """Prompt + response as the chat template renders a finished assistant turn (end-of-turn marker included)."""
    rendered = render_prompts(tokenizer, list(prompts))
    out = []
    for cell, prompt, response in zip(prompts, rendered, responses):
        text = completion_text(response)
        out.append(tokenizer(prompt + _response_text(tokenizer, cell, prompt, text), add_special_tokens=False)
                   ["input_ids"])
    return out


def encode_pairs(pairs: pd.DataFrame, tokenizer: PreTrainedTokenizerBase, max_seq_len: int,
                 source: str = "pairs") -> list[PairExample]:
    """Every pair as token ids; one that does not fit fails here, before any training.

    Cutting a long pair would drop the end of the response, which is exactly the token the score is read from.
    """
    chosen = encode(tokenizer, pairs["prompt"].tolist(), pairs["chosen"].tolist())
    rejected = encode(tokenizer, pairs["prompt"].tolist(), pairs["rejected"].tolist())
    for i, (c, r) in enumerate(zip(chosen, rejected)):
        for col, ids in (("chosen", c), ("rejected", r)):
            if len(ids) > max_seq_len:
                raise DataError(f"{source}: row {i}, column {col!r}: prompt + response is {len(ids)} tokens; "
                                f"expected at most max_seq_len={max_seq_len}")
    return [PairExample(c, r) for c, r in zip(chosen, rejected)]


def pad_right(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right padding: every row starts at position 0, so a row's positions and score do not depend on its batch."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id)  # [B, T]
    mask = torch.zeros((len(seqs), width), dtype=torch.long)  # [B, T]
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


def split_by_prompt(pairs: pd.DataFrame, fraction: float) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(train, held-out) with whole prompts on one side, chosen by hash so the split never depends on row order."""
    def held(prompt) -> bool:
        key = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
        return int.from_bytes(hashlib.sha1(key.encode()).digest()[:4], "big") / 2**32 < fraction

    mask = pairs["prompt"].map(held).astype(bool)
    return pairs[~mask].reset_index(drop=True), pairs[mask].reset_index(drop=True)


# ----------------------------------------------------------------------------------------------------------------
# Scoring

class RewardModelScorer:
    """Scores (prompt, completion) pairs with a reward model: batched, without gradients, right-padded.

    Sequence classifiers in transformers read the rightmost token that is not padding, so right padding puts
    each row's score on its own last token and at the same positions it has alone; the tokenizer's own padding
    side (left, for generation) is never used. A completion longer than `max_seq_len` keeps its end: the score
    is read there, and a policy's overlong sample must not stop a GRPO run.
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, batch_size: int = 64,
                 max_seq_len: int | None = None):
        if model.config.pad_token_id is None:
            raise ValueError("the reward model's config has no pad_token_id: it could not find each row's last token")
        self.model = model.eval()  # no_grad below; parameters stay trainable for a caller that goes on training
        self.tokenizer, self.batch_size = tokenizer, batch_size
        self.max_seq_len = max_seq_len or getattr(model.config, "max_position_embeddings", None) or 4096

    @classmethod
    def from_pretrained(cls, path: str | Path, batch_size: int = 64, dtype: str = "float32") -> RewardModelScorer:
        return cls(*load_reward_model(path, dtype), batch_size=batch_size)

    @torch.no_grad()
    def score_ids(self, seqs: list[list[int]]) -> list[float]:
        device = next(self.model.parameters()).device
        seqs = [s[-self.max_seq_len:] for s in seqs]
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))  # like lengths together: less padding
        scores = [0.0] * len(seqs)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            ids, mask = pad_right([seqs[i] for i in chunk], self.model.config.pad_token_id)
            out = self.model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits[:, 0]  # [B]
            for i, s in zip(chunk, out.float().tolist()):
                scores[i] = s
        return scores

    def score(self, prompts: Sequence, completions: Sequence) -> list[float]:
        """One score per (prompt, completion); prompts are text or chat messages, completions text or messages."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
        return self.score_ids(encode(self.tokenizer, prompts, completions)) if prompts else []


def reward_model_reward(scorer: RewardModelScorer,
                        only_kind: str | None = "general") -> Callable[..., list[float | None]]:
    """The scorer as a reward function with the project's contract: `fn(completions, prompt, **columns)`.

    Takes the prompts from a `prompt` column (or TRL's `prompts`). With a `kind` column, only rows of `only_kind`
    are scored and the rest get None (R1 scores reasoning prompts by rules and general prompts by the reward
    model; in a mixed dataset each reward abstains on the other's rows). `only_kind=None` scores every row.
    """
    def reward_model(completions: Sequence, prompt: Sequence | None = None, *, prompts: Sequence | None = None,
                     kind: Sequence | None = None, **_) -> list[float | None]:
        prompt = prompt if prompt is not None else prompts
        if prompt is None:
            raise ValueError("reward_model needs the prompts: pass a 'prompt' column (or TRL's 'prompts')")
        rows = [i for i in range(len(completions)) if only_kind is None or kind is None or kind[i] == only_kind]
        out: list[float | None] = [None] * len(completions)
        for i, s in zip(rows, scorer.score([prompt[i] for i in rows], [completions[i] for i in rows])):
            out[i] = s
        return out

    return reward_model


def evaluate_pairs(scorer: RewardModelScorer, pairs: pd.DataFrame) -> dict[str, float]:
    """Held-out pair accuracy and mean margin, and accuracy per `flaw` when the pairs name one."""
    prompts = pairs["prompt"].tolist()
    chosen = torch.tensor(scorer.score(prompts, pairs["chosen"].tolist()))  # [N]
    rejected = torch.tensor(scorer.score(prompts, pairs["rejected"].tolist()))  # [N]
    m = pair_metrics(chosen, rejected)
    out = {"rm/heldout_accuracy": m["accuracy"], "rm/heldout_margin": m["margin"]}
    if "flaw" in pairs.columns:
        for flaw, idx in pairs.groupby("flaw").indices.items():
            out[f"rm/heldout_accuracy/{flaw}"] = pair_metrics(chosen[idx], rejected[idx])["accuracy"]
    return out


# ----------------------------------------------------------------------------------------------------------------
# Training

def train_reward_model(
    pairs: pd.DataFrame,
    cfg: RewardModelConfig,
    output_dir: str | Path,
    on_metrics: MetricsCallback | None = None,
    *,
    heldout: pd.DataFrame | None = None,
    source: str = "pairs",
    progress: bool = True,
    distributed: DistributedConfig | None = None,
) -> RewardModelResult:
    """Train a reward model on `pairs` (prompt, chosen, rejected) and save it with its tokenizer to `output_dir/model`.

    Held-out pairs are `heldout` when given, else `cfg.eval_fraction` of the prompts carved out of `pairs`.
    """
    model, tok = build_reward_model(cfg.model, cfg.seed)
    if heldout is None and cfg.eval_fraction > 0:
        pairs, heldout = split_by_prompt(pairs, cfg.eval_fraction)
    if len(pairs) == 0:
        raise DataError(f"{source}: no training pairs left after holding out eval_fraction={cfg.eval_fraction}")
    examples = encode_pairs(pairs, tok, cfg.max_seq_len, source)  # fails before any training
    if heldout is not None and len(heldout) == 0:
        heldout = None
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    acc = make_accelerator(cfg.mixed_precision, cfg.grad_accum_steps)
    strategy = make_strategy(acc, distributed)  # how the processes hold the model (ddp or fsdp)
    check_split("batch_size", cfg.batch_size, acc.num_processes)  # pairs per global micro-batch
    model.config.use_cache = False  # one forward per batch: a KV cache would only cost memory
    checkpointing = activation_checkpointing(model, cfg.gradient_checkpointing)  # on for the training loop only
    optimizer = make_adamw(model, cfg.learning_rate, cfg.weight_decay)
    scheduler = make_scheduler(cfg.lr_scheduler, optimizer, num_warmup_steps=cfg.warmup_steps,
                               num_training_steps=cfg.max_steps)
    model, optimizer, scheduler = strategy.prepare(model, optimizer, scheduler)

    def evaluate() -> dict[str, float]:
        if heldout is None:
            return {"rm/heldout_accuracy": math.nan, "rm/heldout_margin": math.nan}
        # every process scores all the held-out pairs, in the same batches: under fsdp each forward is a
        # collective; under ddp the others would only wait for the main one
        model.eval()  # the mode a scorer loaded from the saved folder runs in: the same figures
        with acc.autocast():
            metrics = evaluate_pairs(RewardModelScorer(acc.unwrap_model(model), tok, cfg.eval_batch_size), heldout)
        model.train()
        return metrics

    before = evaluate()["rm/heldout_accuracy"]
    with checkpointing:
        model.train()
        window: dict[str, list[float]] = {"rm/loss": [], "rm/accuracy": [], "rm/margin": []}
        last_loss = math.nan
        start_time = time.perf_counter()
        bar = tqdm(total=cfg.max_steps, desc="reward model", disable=not progress or not acc.is_main_process,
                   mininterval=2.0)
        for step in range(cfg.max_steps):
            for micro in range(cfg.grad_accum_steps):
                idx = batch_indices(len(examples), cfg.batch_size, step * cfg.grad_accum_steps + micro, cfg.seed)
                batch = [examples[i] for i in process_share(acc, idx)]  # pairs are equal shares: DDP's mean is exact
                B = len(batch)
                # chosen and rejected in one forward: rows [0, B) are chosen, [B, 2B) their rejected partners
                ids, mask = pad_right([e.chosen_ids for e in batch] + [e.rejected_ids for e in batch],
                                      tok.pad_token_id)
                with strategy.accumulate(model):
                    rewards = model(input_ids=ids.to(acc.device),
                                    attention_mask=mask.to(acc.device)).logits[:, 0]  # [2B]
                    loss = bradley_terry_loss(rewards[:B], rewards[B:])
                    acc.backward(loss)
                    grad_norm = optimizer_step(acc, model, optimizer, scheduler, cfg.max_grad_norm)
                m = pair_metrics(rewards[:B], rewards[B:])
                window["rm/loss"].append(loss.item())
                window["rm/accuracy"].append(m["accuracy"])
                window["rm/margin"].append(m["margin"])
            bar.update(1)
            done = step + 1
            if done % cfg.log_every == 0 or done == cfg.max_steps:
                means = reduce_metrics(acc, {k: sum(v) / len(v) for k, v in window.items()})  # over processes
                for v in window.values():
                    v.clear()
                last_loss = means["rm/loss"]
                bar.set_postfix(loss=f"{last_loss:.3f}", acc=f"{means['rm/accuracy']:.2f}")
                if on_metrics and acc.is_main_process:
                    on_metrics(done, {**means, "rm/learning_rate": scheduler.get_last_lr()[0],
                                      "rm/grad_norm": float(grad_norm) if grad_norm is not None else math.nan})
        bar.close()
    seconds = time.perf_counter() - start_time

    heldout_metrics = evaluate()
    if on_metrics and heldout is not None and acc.is_main_process:
        on_metrics(cfg.max_steps, heldout_metrics)
    model_dir = Path(output_dir) / "model"
    whole = strategy.whole_model(model)  # the whole weights, on the main process
    with main_only(acc) as main:
        if main:
            whole.config.use_cache = True
            whole.save_pretrained(model_dir)
            tok.save_pretrained(model_dir)
    return RewardModelResult(model_dir, cfg.max_steps, last_loss, heldout_metrics["rm/heldout_accuracy"], before,
                             heldout_metrics, seconds)
