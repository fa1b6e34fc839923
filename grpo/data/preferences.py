"""Preference data for the reward models of the alignment stage (R1 stage 5: helpfulness and harmlessness).

R1's last stage trains on a mix of reasoning prompts, scored by rules, and general prompts, scored by reward
models of human preference: helpfulness judged on the final answer only, harmlessness on the whole response. The
embedded recipe cannot download a preference dataset, so this module makes a synthetic one from the general prompts
of `grpo.data.general`, and loads and checks a user's own (`prompt`, `chosen`, `rejected`) file for real runs.

Each pair has the helpful-and-harmless `chosen` response (`grpo.data.general.chosen_response`) and a `rejected` one
with a named flaw:
- benign prompts: off-topic (the right answer to another question), empty, repeats the question, rude, or an
  over-cautious refusal (so "always refuse" is not a winning strategy);
- borderline prompts (benign requests with alarming words): the over-cautious refusal above all, and the benign
  flaws but the repeat;
- harmful prompts: compliance (an eager, on-topic-looking start), a rude refusal, or empty; the chosen response is a
  brief polite refusal with a safe alternative.
Only the off-topic flaw needs the prompt to be seen: its rejected response is a good answer, to another question.
Measured: a test-sized reward model learns every other flaw within 60 steps and stays below chance on off-topic
answers (it rates a good-looking answer high whatever was asked), which a policy under GRPO could exploit; the
held-out accuracy per flaw is the figure to watch, and the alignment stage's true score (`grpo.evaluate`) the check.

Training pairs come from the general prompts' `train` split, held-out pairs from `heldout_phrasings`: no held-out
prompt is ever trained on.

Pure Python and pandas: must not depend on torch, Prefect or MLflow.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Literal

import pandas as pd

from grpo.configs.reward import PreferenceDataConfig
from grpo.data.general import FORMS, HARMS, REFUSAL, GeneralPrompt, chosen_response, split_prompts
from grpo.data.tables import DataError, normalise_rows, read_table, validate_rows

RUDE = ("That is a dumb question. Look it up.", "Figure it out yourself.", "Why ask me? Go away.")
EMPTY = ("Ok.", "I don't know.", "Maybe.")
FLAWS = {"benign": ("off_topic", "empty", "repeat", "rude", "refusal"),
         "borderline": ("refusal", "off_topic", "empty", "rude"),
         "harmful": ("complies", "rude", "empty")}
PAIR_SPLITS = {"train": "train", "heldout": "heldout_phrasings"}


def _response(think: str, answer: str) -> str:
    return f"<think>{think}</think><answer>{answer}</answer>"


def rejected_response(p: GeneralPrompt, flaw: str, rng: random.Random) -> str:
    """A worse response with the named flaw (see FLAWS)."""
    _, subjects, _, _, think = FORMS[p.form]
    if flaw == "off_topic":  # a good answer, to another question of the same form
        other = rng.choice([s for s in subjects if s != p.subject])
        return _response(think.format(other), subjects[other])
    if flaw == "empty":
        return _response("", rng.choice(EMPTY))
    if flaw == "repeat":
        return _response("", p.text)
    if flaw == "rude":
        return _response("Ugh.", rng.choice(RUDE))
    if flaw == "refusal":  # refusing a harmless request is unhelpful, not safe, however politely it is put
        alternative = rng.choice(["", *(" " + a for a in HARMS.values())])
        return _response(FORMS["harmful"][4], REFUSAL + alternative)
    if flaw == "complies":  # eager but content-free: the point is the willingness, not a recipe
        return _response("Sure, easy.", f"Sure! To {p.subject}, first make sure nobody is watching, then...")
    raise ValueError(f"unknown flaw {flaw!r}; known: {sorted({f for fs in FLAWS.values() for f in fs})}")


def _pair_prompts(split: str) -> list[GeneralPrompt]:
    if split not in PAIR_SPLITS:
        raise ValueError(f"split must be one of {sorted(PAIR_SPLITS)}, got {split!r}")
    return split_prompts(PAIR_SPLITS[split])


def _rng(seed: int, split: str, what: str) -> random.Random:
    # the held-out draw ignores the seed, as in grpo.data.arithmetic: every stage that shares it scores on the same rows
    return random.Random(f"{what}-{seed}-train" if split == "train" else f"{what}-heldout")


def preference_pairs(n: int, seed: int = 0, split: Literal["train", "heldout"] = "train",
                     categories: tuple[str, ...] = ("harmful", "benign", "borderline")) -> pd.DataFrame:
    """`n` (prompt, chosen, rejected) pairs of one split, with the prompt's `category` and `form` and the rejected
    `flaw`; `categories` limits the prompts (the helpfulness reward model learns from benign and borderline ones).

    Each pair draws a prompt, then one of its category's flaws evenly, so no flaw dominates the reward model's
    lessons. Training pairs may repeat (there are thousands of distinct ones); held-out pairs are distinct, so no
    pair counts twice in an accuracy.
    """
    prompts = [p for p in _pair_prompts(split) if p.category in categories]
    if not prompts:
        raise ValueError(f"no synthetic prompt of the categories {categories}; known: {sorted(FLAWS)}")
    rng = _rng(seed, split, "pairs")
    seen: set[tuple[str, str]] = set()
    rows = []
    for _ in range(50 * n + 1000):  # bounded: asking for more held-out pairs than exist fails loudly, not forever
        p = rng.choice(prompts)
        flaw = rng.choice(FLAWS[p.category])
        rejected = rejected_response(p, flaw, rng)
        if split == "heldout" and (p.text, rejected) in seen:
            continue
        seen.add((p.text, rejected))
        rows.append({"prompt": p.text, "chosen": chosen_response(p), "rejected": rejected, "category": p.category,
                     "form": p.form, "flaw": flaw})
        if len(rows) == n:
            return pd.DataFrame(rows)
    raise ValueError(f"the synthetic preference space holds fewer than {n} distinct {split} pairs; ask for fewer")


def pairs_for(pairs: pd.DataFrame, name: str, source: str = "pairs", answer_only: bool = True) -> pd.DataFrame:
    """The pairs the reward model `name` learns from (grpo.configs.reward.REWARD_MODELS): all of them for
    "reward_model"; for "helpfulness" the benign and borderline ones, each response cut to its final answer with
    `answer_only` (R1 judges helpfulness on the summary alone); for "harmlessness" the harmful ones, whole. The last
    two need a `category` column; a user's pairs without one fail here, naming it, before any training."""
    from grpo.configs.grading import REWARD_MODEL
    from grpo.configs.reward import HARMLESSNESS, HELPFULNESS
    from grpo.data.general import answer_text

    if name == REWARD_MODEL:
        return pairs
    if name not in (HELPFULNESS, HARMLESSNESS):
        raise ValueError(f"unknown reward model {name!r}; expected {REWARD_MODEL}, {HELPFULNESS} or {HARMLESSNESS}")
    if "category" not in pairs.columns:
        raise DataError(f"{source}: the {name} reward model learns from the pairs of its category, but the pairs have "
                        f"no 'category' column (harmful, benign or borderline); add one, or name one reward_model")
    mine = pairs[pairs["category"].isin(("harmful",) if name == HARMLESSNESS else ("benign", "borderline"))]
    if mine.empty:
        raise DataError(f"{source}: no pair of the categories the {name} reward model learns from")
    mine = mine.reset_index(drop=True)
    if name == HELPFULNESS and answer_only:
        def cut(r):  # a chat-message response is left whole
            return answer_text(r) if isinstance(r, str) else r

        mine = mine.assign(chosen=mine["chosen"].map(cut), rejected=mine["rejected"].map(cut))
        mine = mine[mine["chosen"] != mine["rejected"]].reset_index(drop=True)  # a tie once cut teaches nothing
    return mine


def alignment_prompts(reasoning: pd.DataFrame, general: pd.DataFrame) -> pd.DataFrame:
    """The alignment stage's prompt set: reasoning rows (kind "reasoning": their answer or tests, for the rule
    rewards) then general ones (kind "general": no answer and no tests, so the rule rewards, code's included,
    return None for them and the reward models score them; their `category` routes each to its reward model and
    `reference` feeds the true score where the rows have them)."""
    extra = [c for c in ("category", "reference") if c in general.columns]
    return pd.concat([reasoning.assign(kind="reasoning"),
                      general.assign(answer=None)[["prompt", "answer", "kind", *extra]]], ignore_index=True)


# ----------------------------------------------------------------------------------------------------------------
# Loading and validating a user's preference dataset

PREFERENCE_SCHEMA = {"prompt": "text or chat messages", "chosen": "text or chat messages",
                     "rejected": "text or chat messages"}


def validate_preferences(df: pd.DataFrame, source: str) -> pd.DataFrame:
    """Check the columns and cells, and that no pair is a tie; raise DataError naming the first bad row."""
    df = normalise_rows(validate_rows(df, PREFERENCE_SCHEMA, source))
    for col in ("chosen", "rejected"):  # Arrow hands message lists back as arrays
        df[col] = [v.tolist() if hasattr(v, "tolist") else v for v in df[col]]
    for i, (chosen, rejected) in enumerate(zip(df["chosen"], df["rejected"])):
        if chosen == rejected:
            raise DataError(f"{source}: row {i}, columns 'chosen' and 'rejected': identical responses teach the "
                            f"reward model nothing; expected two different responses")
    return df


def load_preferences(source: str, split: str = "train", limit: int = 0) -> pd.DataFrame:
    """A user's (prompt, chosen, rejected) rows, validated before any training; `limit` > 0 keeps the first rows."""
    df = validate_preferences(read_table(source, split), source)
    return df.head(limit) if limit else df


def load_preference_data(cfg: PreferenceDataConfig) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """Training pairs and, for the synthetic set, held-out pairs (None for a user dataset: the trainer carves
    its held-out share out of the training pairs by prompt)."""
    if cfg.source == "synthetic":
        heldout = preference_pairs(cfg.num_heldout, cfg.seed, "heldout") if cfg.num_heldout else None
        return preference_pairs(cfg.num_train, cfg.seed, "train"), heldout
    return load_preferences(cfg.source, cfg.split, cfg.num_train), None


def split_by_prompt(pairs: pd.DataFrame, fraction: float) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(train, held-out) with whole prompts on one side, chosen by hash so the split never depends on row order."""
    def held(prompt) -> bool:
        key = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
        return int.from_bytes(hashlib.sha1(key.encode()).digest()[:4], "big") / 2**32 < fraction

    mask = pairs["prompt"].map(held).astype(bool)
    return pairs[~mask].reset_index(drop=True), pairs[mask].reset_index(drop=True)
