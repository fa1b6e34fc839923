"""The embedded tiny model: a Qwen2-architecture causal LM of a few million parameters and a tokenizer made here.

No download: byte-level BPE trained in a fraction of a second on text the project generates (the synthetic word
problems and their worked solutions, the general prompts and responses, the judge's prompt, the chat markup), so
a word or a number up to two digits is one token and any other text falls back to bytes; the chat markers and
the four reasoning tags are whole tokens. Measured on the tiny recipe's rows: 2.5x fewer tokens than one token
per byte (prompt 61 -> 17, worked solution 45 -> 24), which makes every stage that many times cheaper and leaves
a small model fewer positions to copy a number across. `tokenizer="byte"` keeps one token per byte.
Imports the synthetic data (for the corpus) and the shared texts; must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from grpo.configs.model import TinyModelConfig
from grpo.texts import REASONING_TAGS

PAD, EOS, IM_START, IM_END = "<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"

# Qwen-style chat markup, kept short: every marker and newline is a token for the tiny model.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tokenizer_corpus() -> list[str]:
    """The text the tiny tokenizer learns its merges from: everything the embedded recipe feeds its models.

    Word problems at three operand sizes (so numbers up to two digits become tokens), their worked solutions,
    the general prompts with chosen and rejected responses, the judge's prompt and the chat markup. Generated,
    so the same code always builds the same tokenizer.
    """
    from grpo.configs.data import TaskConfig  # here: grpo.data does not need the models
    from grpo.data.arithmetic import generate_problems, sft_rows
    from grpo.data.general import LEAD_INS, all_prompts, chosen_response
    from grpo.data.preferences import preference_pairs
    from grpo.texts import JUDGE_PROMPT

    texts: list[str] = []
    for max_operand in (6, 9, 30):
        task = TaskConfig(max_operand=max_operand)
        rows = sft_rows(generate_problems(task, 600, "train"), task)
        texts += list(rows["prompt"]) + list(rows["response"])
    pairs = preference_pairs(400)
    texts += list(pairs["prompt"]) + list(pairs["chosen"]) + list(pairs["rejected"])
    # one chosen response per subject: lead-ins are all_prompts' innermost loop
    texts += [chosen_response(p) for p in all_prompts()[::len(LEAD_INS)] if p.template == 0]
    texts += [JUDGE_PROMPT] * 20
    texts += [f"{IM_START}{role}\n{IM_END}\n" for role in ("system", "user", "assistant")] * 50
    return texts


@functools.lru_cache(maxsize=4)
def _trained_bpe(vocab_size: int) -> str:
    """The learned BPE as JSON (trained once per process: ~0.3 s; each caller gets its own tokenizer object)."""
    core = Tokenizer(models.BPE())
    # the GPT-2 split: a leading space stays with its word or number, digits never merge with letters
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # the tags are added after training (as ordinary added tokens), so they count towards the size here
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(REASONING_TAGS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
                                  special_tokens=[PAD, EOS, IM_START, IM_END])
    core.train_from_iterator(tokenizer_corpus(), trainer)
    return core.to_str()


def build_tokenizer(kind: Literal["bpe", "byte"] = "bpe", vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """The tiny model's tokenizer: byte-level BPE learned from `tokenizer_corpus()`, or one token per byte.

    Both map any text to tokens (every byte is in the vocabulary) and decode it back unchanged.
    """
    if kind == "bpe":
        core = Tokenizer.from_str(_trained_bpe(vocab_size))
    elif kind == "byte":
        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
        core = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
        core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    else:
        raise ValueError(f"tokenizer must be 'bpe' or 'byte', got {kind!r}")
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=IM_END,  # generation stops at the end of the assistant turn
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[EOS, IM_START],
    )
    # The tags are ordinary added tokens, not special ones, so decoding keeps them in the text.
    tok.add_tokens(list(REASONING_TAGS))
    tok.chat_template = CHAT_TEMPLATE
    tok.padding_side = "left"  # generation pads on the left so every prompt ends where its completion starts
    return tok


def build_tiny_model(cfg: TinyModelConfig, tokenizer: PreTrainedTokenizerBase) -> Qwen2ForCausalLM:
    """A freshly initialised Qwen2 model; the same config and seed give the same weights."""
    torch.manual_seed(cfg.seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.convert_tokens_to_ids(EOS),
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model
