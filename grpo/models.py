"""Models and tokenizers: the embedded tiny model built from a config, and real models loaded by name or path.

The tiny model is a Qwen2-architecture causal LM of a few million parameters with a tokenizer made here (no
download): byte-level BPE trained in a fraction of a second on text the project generates (the synthetic word
problems and their worked solutions, the general prompts and responses, the judge's prompt, the chat markup), so
a word or a number up to two digits is one token and any other text falls back to bytes; the chat markers and
the four reasoning tags are whole tokens. Measured on the tiny recipe's rows: 2.5x fewer tokens than one token
per byte (prompt 61 -> 17, worked solution 45 -> 24), which makes every stage that many times cheaper and leaves
a small model fewer positions to copy a number across. `tokenizer="byte"` keeps one token per byte. A real model
is anything `from_pretrained(name_or_path)` accepts: a hub name on a machine that can reach the hub, or a local
folder (which is also what a checkpoint artifact downloads to).
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

TINY = "tiny"  # the name that means "build the embedded model from ModelConfig.tiny"
REASONING_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
PAD, EOS, IM_START, IM_END = "<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"

# Qwen-style chat markup, kept short: every marker and newline is a token for the tiny model.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class TinyModelConfig(BaseModel):
    """Shape of the embedded model (defaults: 2.97M parameters, measured to learn the format in about a minute)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hidden_size: int = 256  # width of the residual stream
    intermediate_size: int = 688  # MLP width
    num_hidden_layers: int = 4  # transformer blocks
    num_attention_heads: int = 4  # query heads
    num_key_value_heads: int = 2  # grouped-query KV heads
    max_position_embeddings: int = 512  # longest prompt + completion, in tokens
    seed: int = 0  # weight initialisation seed: the same seed builds the same base model
    tokenizer: Literal["bpe", "byte"] = "bpe"  # BPE trained on the project's own text, or one token per byte
    vocab_size: int = Field(1024, ge=300, le=8192)  # BPE only: bytes, markers, tags and learned merges in all


class ModelConfig(BaseModel):
    """Which model a stage starts from."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name_or_path: str = TINY  # "tiny" builds the embedded model; anything else goes to from_pretrained
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)  # used only when name_or_path == "tiny"
    trust_remote_code: bool = False  # off unless the recipe turns it on
    dtype: str = "float32"  # weights dtype when loading: float32, bfloat16 or float16
    attn_implementation: str | None = None  # e.g. "sdpa" or "flash_attention_2"; None lets transformers pick


def tokenizer_corpus() -> list[str]:
    """The text the tiny tokenizer learns its merges from: everything the embedded recipe feeds its models.

    Word problems at three operand sizes (so numbers up to two digits become tokens), their worked solutions,
    the general prompts with chosen and rejected responses, the judge's prompt and the chat markup. Generated,
    so the same code always builds the same tokenizer.
    """
    from grpo.data import TaskConfig, generate_problems, sft_rows  # here: grpo.data does not need the models
    from grpo.judge import JUDGE_PROMPT
    from grpo.preferences import preference_pairs

    texts: list[str] = []
    for max_operand in (6, 9, 30):
        task = TaskConfig(max_operand=max_operand)
        rows = sft_rows(generate_problems(task, 600, "train"), task)
        texts += list(rows["prompt"]) + list(rows["response"])
    pairs = preference_pairs(400)
    texts += list(pairs["prompt"]) + list(pairs["chosen"]) + list(pairs["rejected"])
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


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    if cfg.name_or_path == TINY:
        return build_tokenizer(cfg.tiny.tokenizer, cfg.tiny.vocab_size)
    if _generic_fast_tokenizer(Path(cfg.name_or_path)):
        # A folder saved from a plain fast tokenizer (every checkpoint of the tiny model): read tokenizer.json as it
        # is. AutoTokenizer would pick the model type's class (Qwen2Tokenizer for these folders), which rebuilds
        # the pre-tokenizer with its own digit splitting: " 12" would become "Ġ", "1", "2", tokens the model never
        # saw in training.
        tok = PreTrainedTokenizerFast.from_pretrained(cfg.name_or_path)
    else:
        tok = AutoTokenizer.from_pretrained(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code)
    if tok.pad_token is None:  # many base models ship without one; padding is masked out anyway
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def _generic_fast_tokenizer(folder: Path) -> bool:
    """Whether `folder` holds a tokenizer.json saved by a generic fast tokenizer (no model-specific class)."""
    config = folder / "tokenizer_config.json"
    if not (folder / "tokenizer.json").is_file() or not config.is_file():
        return False
    try:
        declared = json.loads(config.read_text())
    except (OSError, ValueError):
        return False
    generic = ("TokenizersBackend", "PreTrainedTokenizerFast")
    return "auto_map" not in declared and declared.get("tokenizer_class") in generic


def check_model_config(cfg: ModelConfig) -> None:
    """Fail before any loading on a dtype we do not know or a local folder that is not there."""
    if cfg.dtype not in _DTYPES:
        raise ValueError(f"model.dtype must be one of {sorted(_DTYPES)}, got {cfg.dtype!r}")
    if not Path(cfg.name_or_path).exists() and cfg.name_or_path.startswith((".", "/")):
        raise FileNotFoundError(f"model folder {cfg.name_or_path!r} does not exist")


def load_model_and_tokenizer(cfg: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Build the tiny model or load `cfg.name_or_path` (hub name or local folder) with `from_pretrained`."""
    check_model_config(cfg)
    tok = load_tokenizer(cfg)
    if cfg.name_or_path == TINY:
        return build_tiny_model(cfg.tiny, tok).to(_DTYPES[cfg.dtype]), tok
    kwargs = dict(trust_remote_code=cfg.trust_remote_code, dtype=_DTYPES[cfg.dtype])
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    model = AutoModelForCausalLM.from_pretrained(cfg.name_or_path, **kwargs)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def is_checkpointing(model: torch.nn.Module) -> bool:
    """Whether activation checkpointing is on for `model` (transformers 5's name, or 4.x's)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def _enable_checkpointing(model: PreTrainedModel) -> None:
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if getattr(model, "_require_grads_hook", None) is not None:
        model.disable_input_require_grads()


def _disable_checkpointing(model: PreTrainedModel) -> None:
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


@contextlib.contextmanager
def activation_checkpointing(model: PreTrainedModel, enabled: bool = True) -> Iterator[None]:
    """Within the block, each decoder layer of `model` keeps only its input for the backward and recomputes the rest.

    One more forward pass of compute in the backward, for the activation memory of one layer instead of all of
    them: what lets a real model's batch fit on its GPU. Non-reentrant checkpointing (torch's recommended form),
    which needs no gradient on the layers' inputs, so the input-embedding hook transformers installs for the
    reentrant form is removed again (a hooked model would sample through the generic decode path). The KV cache
    is off in the block (a training forward would only fill it) and the model's own setting is back after, as is
    checkpointing off, also after an error. Nothing changes when `enabled` is False or checkpointing is already on.
    """
    if not enabled or is_checkpointing(model):
        yield
        return
    use_cache = model.config.use_cache
    _enable_checkpointing(model)
    model.config.use_cache = False
    try:
        yield
    finally:
        _disable_checkpointing(model)
        model.config.use_cache = use_cache
