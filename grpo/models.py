"""Models and tokenizers: the embedded tiny model built from a config, and real models loaded by name or path.

The tiny model is a Qwen2-architecture causal LM of a few million parameters with a byte-level tokenizer made
here (no download): 256 byte symbols, the chat markers and the four reasoning tags as whole tokens. A real model
is anything `from_pretrained(name_or_path)` accepts: a hub name on a machine that can reach the hub, or a local
folder (which is also what a checkpoint artifact downloads to).
"""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
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

# Qwen-style chat markup, kept short because every prompt byte is a token for the tiny model.
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
    max_position_embeddings: int = 512  # longest prompt + completion, in tokens (bytes)
    seed: int = 0  # weight initialisation seed: the same seed builds the same base model


class ModelConfig(BaseModel):
    """Which model a stage starts from."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name_or_path: str = TINY  # "tiny" builds the embedded model; anything else goes to from_pretrained
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)  # used only when name_or_path == "tiny"
    trust_remote_code: bool = False  # off unless the recipe turns it on
    dtype: str = "float32"  # weights dtype when loading: float32, bfloat16 or float16
    attn_implementation: str | None = None  # e.g. "sdpa" or "flash_attention_2"; None lets transformers pick


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with no merges: every UTF-8 byte is one token, plus chat markers and reasoning tags."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
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
        return build_tokenizer()
    tok = AutoTokenizer.from_pretrained(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code)
    if tok.pad_token is None:  # many base models ship without one; padding is masked out anyway
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


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
