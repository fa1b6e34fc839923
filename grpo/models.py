"""Models and tokenizers: real models loaded by name or path (the tiny one built from its config), and activation
checkpointing.

A real model is anything `from_pretrained(name_or_path)` accepts: a hub name on a machine that can reach the hub,
or a local folder (which is also what a checkpoint artifact downloads to); or one file, a GGUF on disk or inside an
installed package, read through the folder it is dequantized into once (`grpo.model_files`). `name_or_path: tiny`
builds the embedded model (`grpo.tiny`). Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from transformers.utils import logging as hf_logging

from grpo.configs.model import TINY, ModelConfig
from grpo.model_files import local_model
from grpo.tiny import build_tiny_model, build_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    cfg = local_model(cfg)
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
    if cfg.dtype not in DTYPES:
        raise ValueError(f"model.dtype must be one of {sorted(DTYPES)}, got {cfg.dtype!r}")
    if not Path(cfg.name_or_path).exists() and cfg.name_or_path.startswith((".", "/")):
        raise FileNotFoundError(f"model folder {cfg.name_or_path!r} does not exist")


def load_model_and_tokenizer(cfg: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Build the tiny model or load `cfg.name_or_path` (hub name or local folder) with `from_pretrained`."""
    cfg = local_model(cfg)
    check_model_config(cfg)
    tok = load_tokenizer(cfg)
    if cfg.name_or_path == TINY:
        return build_tiny_model(cfg.tiny, tok).to(DTYPES[cfg.dtype]), tok
    kwargs = dict(trust_remote_code=cfg.trust_remote_code, dtype=DTYPES[cfg.dtype])
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    model = AutoModelForCausalLM.from_pretrained(cfg.name_or_path, **kwargs)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


# a model that scores with one output: a whole sequence (a reward model) or each token (a process reward model)
SCORING_HEADS = {"sequence": AutoModelForSequenceClassification, "token": AutoModelForTokenClassification}


def load_scoring_model(cfg: ModelConfig, head: str, seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A one-output classifier over `cfg`'s backbone (`head`: "sequence" or "token", SCORING_HEADS), with
    `pad_token_id` set so a sequence head finds each row's last token.

    "tiny" builds the embedded backbone (the weights `build_tiny_model` gives for its seed) under a fresh head drawn
    with `seed`; anything else goes to the head's `from_pretrained`, which keeps a causal LM's backbone and starts a
    new head (a policy's folder), or reloads a trained scorer whole.
    """
    if head not in SCORING_HEADS:
        raise ValueError(f"head must be one of {sorted(SCORING_HEADS)}, got {head!r}")
    cfg = local_model(cfg)
    check_model_config(cfg)
    tok = load_tokenizer(cfg)
    if cfg.name_or_path == TINY:
        lm = build_tiny_model(cfg.tiny, tok)
        lm.config.num_labels = 1
        torch.manual_seed(seed)  # the head's initialisation
        model = SCORING_HEADS[head].from_config(lm.config)
        model.model.load_state_dict(lm.model.state_dict())
        return model.to(DTYPES[cfg.dtype]), tok
    kwargs = dict(num_labels=1, pad_token_id=tok.pad_token_id, trust_remote_code=cfg.trust_remote_code,
                  dtype=DTYPES[cfg.dtype])
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    torch.manual_seed(seed)
    with _quiet_new_head(cfg.name_or_path):
        return SCORING_HEADS[head].from_pretrained(cfg.name_or_path, **kwargs), tok


@contextlib.contextmanager
def _quiet_new_head(path: str):
    """A causal LM's folder has no scoring head: transformers' loading report would print it as missing, which is
    the point; a scorer's own folder (or a hub name) is loaded with its report."""
    architectures = []
    config = Path(path) / "config.json"
    if config.is_file():
        architectures = json.loads(config.read_text()).get("architectures") or []
    if not any(a.endswith("ForCausalLM") for a in architectures):
        yield
        return
    # its loading report, and the tensor-parallel plan's note on the layers the new head adds
    loggers = [hf_logging.get_logger(n) for n in ("transformers.modeling_utils",
                                                  "transformers.distributed.tensor_parallel")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(hf_logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


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


@functools.cache
def _cache_keyword() -> str:
    """The keyword a transformers model's forward takes its KV cache by: `cache` where transformers has it (5.24
    warns at `past_key_values`, which 5.40 removes), `past_key_values` in the releases before the rename."""
    from transformers.models.llama.modeling_llama import LlamaModel  # every decoder's forward is renamed at once

    return "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


def cached(cache) -> dict:
    """The keyword arguments that hand `cache` (a transformers `Cache`, filled in place) to a model's forward."""
    return {_cache_keyword(): cache, "use_cache": True}
