"""The Bradley-Terry reward model's parts: its loss and pair figures, the model, prompt + response as token ids,
and the scorer that turns it into a reward function.

A part, not a loop: the reward model's loop (grpo.training.loops.reward_model) trains with these, and the iterative
reward model (grpo.training.loops.rm_refresh) goes on training the same scorer inside GRPO's loop; GRPO and
rejection sampling score with it. The model is a causal LM backbone with a one-output linear head
(`AutoModelForSequenceClassification`, num_labels=1) that reads the hidden state of the last token of prompt +
response; `sigmoid(r_a - r_b)` is the modelled probability that a person prefers response a to b (InstructGPT,
Ouyang et al. 2022, eq. 1).

Packed rows (`sequence_scores` with the model's `score` head): the sequences of a batch one after another in one
row without padding, each from position 0 and attending to itself alone, each score read from the head's output at
the sequence's own last token (the model's own pooling reads only the row's last).

Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import pandas as pd
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo.configs.grading import REWARD_MODEL
from grpo.configs.model import ModelConfig
from grpo.configs.reward import HARMLESSNESS, HELPFULNESS
from grpo.data.general import answer_text
from grpo.data.tables import DataError
from grpo.kernels.attention import PACKED, attending_packed
from grpo.models import load_scoring_model
from grpo.rewards import completion_text
from grpo.sampling.local import render_prompts, response_text
from grpo.training.batches import pad_right
from grpo.training.logprobs import packing_on
from grpo.training.packing import pack_sequences


class PairExample(NamedTuple):
    chosen_ids: list[int]  # chat-formatted prompt + chosen response
    rejected_ids: list[int]  # chat-formatted prompt + rejected response


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
    """A sequence classifier with one output and `pad_token_id` set, so it can find each row's last token
    (`grpo.models.load_scoring_model`: the embedded backbone under a fresh head, a policy's folder under a new one, or
    a trained reward model reloaded whole)."""
    return load_scoring_model(cfg, "sequence", seed)


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
        out.append(tokenizer(prompt + response_text(tokenizer, cell, prompt, text), add_special_tokens=False)
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


# ----------------------------------------------------------------------------------------------------------------
# Scoring

def packs(setting: bool | str, model: torch.nn.Module) -> bool:
    """Whether the reward model's rows are packed: `packing_on`'s rule (`auto` where packed rows are exact and
    cheap), for a model whose scores come from a per-position linear head `score` (transformers' sequence
    classifiers); `packing: true` on one without it is an error, raised before any training."""
    if not isinstance(getattr(model, "score", None), torch.nn.Linear):
        if setting is True:
            raise ValueError(f"packing: true needs a reward model whose scores come from a per-position linear head "
                             f"`score` (transformers' sequence classifiers); {type(model).__name__} has none: "
                             f"set packing: auto or false")
        return False
    return packing_on(setting, model)


def sequence_scores(model: torch.nn.Module, seqs: Sequence[Sequence[int]], pad_id: int, device: torch.device, *,
                    packed_for: PreTrainedModel | None = None) -> torch.Tensor:
    """The reward model's scores [B] of token sequences (with gradients where they are on); `model` may be wrapped
    (DDP, FSDP): it is called through its own forward.

    Padded (`packed_for` None): rows right-padded, each scored at its own last token by the model's pooling.
    Packed (`packed_for`: the unwrapped model, see `packs`): one row [1, T] without padding, each sequence's score
    read from its `score` head's per-position output at the sequence's last token; the same numbers to float
    rounding. Its sequences travel as `packed_segments` where the model attends with `packed_attention`
    (`attending_packed`), else as position ids alone.
    """
    if packed_for is None:
        ids, mask = pad_right([list(s) for s in seqs], pad_id)
        return model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits[:, 0]  # [B]
    inputs = pack_sequences(seqs)
    ends = inputs.pop("ends").to(device)  # [B]
    if packed_for.config._attn_implementation != PACKED:
        inputs.pop("packed_segments")
    outputs: list[torch.Tensor] = []
    # the model pools the row's last token only: the head's whole output [1, T, 1] is read instead
    handle = packed_for.score.register_forward_hook(lambda module, args, out: outputs.append(out))
    try:
        model(**{k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()})
    finally:
        handle.remove()
    return outputs[0][0, ends, 0]  # [B]


class RewardModelScorer:
    """Scores (prompt, completion) pairs with a reward model: batched, without gradients, right-padded.

    Sequence classifiers in transformers read the rightmost token that is not padding, so right padding puts
    each row's score on its own last token and at the same positions it has alone; the tokenizer's own padding
    side (left, for generation) is never used. A completion longer than `max_seq_len` keeps its end: the score
    is read there, and a policy's overlong sample must not stop a GRPO run.
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, batch_size: int = 64,
                 max_seq_len: int | None = None, packing: bool | str = False):
        if model.config.pad_token_id is None:
            raise ValueError("the reward model's config has no pad_token_id: it could not find each row's last token")
        self.model = model.eval()  # no_grad below; parameters stay trainable for a caller that goes on training
        self.tokenizer, self.batch_size = tokenizer, batch_size
        self.max_seq_len = max_seq_len or getattr(model.config, "max_position_embeddings", None) or 4096
        self.packed = packs(packing, model)  # each batch as one row without padding (`sequence_scores`)

    @classmethod
    def from_pretrained(cls, path: str | Path, batch_size: int = 64, dtype: str = "float32") -> RewardModelScorer:
        return cls(*load_reward_model(path, dtype), batch_size=batch_size)

    @torch.no_grad()
    def score_ids(self, seqs: list[list[int]]) -> list[float]:
        device = next(self.model.parameters()).device
        seqs = [s[-self.max_seq_len:] for s in seqs]
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))  # like lengths together: less padding
        scores = [0.0] * len(seqs)
        with attending_packed(self.model, self.packed):
            for start in range(0, len(order), self.batch_size):
                chunk = order[start : start + self.batch_size]
                out = sequence_scores(self.model, [seqs[i] for i in chunk], self.model.config.pad_token_id, device,
                                      packed_for=self.model if self.packed else None)  # [B]
                for i, s in zip(chunk, out.float().tolist()):
                    scores[i] = s
        return scores

    def score(self, prompts: Sequence, completions: Sequence) -> list[float]:
        """One score per (prompt, completion); prompts are text or chat messages, completions text or messages."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
        return self.score_ids(encode(self.tokenizer, prompts, completions)) if prompts else []


class Route(NamedTuple):
    """Which general rows a reward model scores, and what it reads of a response."""

    categories: tuple[str, ...] | None  # the rows' `category` it scores (None: every general row)
    answer_only: bool  # the final answer alone (`grpo.data.general.answer_text`), not the reasoning before it


# R1: helpfulness judged on the final summary only, harmlessness on the whole response, each on its own prompts
ROUTES = {REWARD_MODEL: Route(None, False), HELPFULNESS: Route(("benign", "borderline"), True),
          HARMLESSNESS: Route(("harmful",), False)}


def reward_model_reward(scorer: RewardModelScorer, only_kind: str | None = "general",
                        route: Route = ROUTES[REWARD_MODEL]) -> Callable[..., list[float | None]]:
    """The scorer as a reward function with the project's contract: `fn(completions, prompt, **columns)`.

    Takes the prompts from a `prompt` column (or TRL's `prompts`). With a `kind` column, only rows of `only_kind`
    are scored and the rest get None (R1 scores reasoning prompts by rules and general prompts by the reward
    model; in a mixed dataset each reward abstains on the other's rows). `only_kind=None` scores every row.
    A `route` with categories scores only the rows of those categories (a `category` column is then required) and
    abstains on the rest; with `answer_only` it reads the final answer alone.
    """
    def reward_model(completions: Sequence, prompt: Sequence | None = None, *, prompts: Sequence | None = None,
                     kind: Sequence | None = None, category: Sequence | None = None, **_) -> list[float | None]:
        prompt = prompt if prompt is not None else prompts
        if prompt is None:
            raise ValueError("reward_model needs the prompts: pass a 'prompt' column (or TRL's 'prompts')")
        if route.categories is not None and category is None:
            raise ValueError(f"a reward model for the {'/'.join(route.categories)} prompts needs each general row's "
                             f"`category` (harmful, benign or borderline); these rows have none: give the general "
                             f"prompts a category column, or name one reward_model for them all")
        rows = [i for i in range(len(completions)) if (only_kind is None or kind is None or kind[i] == only_kind)
                and (route.categories is None or category[i] in route.categories)]
        texts = [completion_text(completions[i]) for i in rows]
        if route.answer_only:
            texts = [answer_text(t) for t in texts]
        out: list[float | None] = [None] * len(completions)
        for i, s in zip(rows, scorer.score([prompt[i] for i in rows], texts)):
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
