"""LoRA adapters through peft (an optional extra: `pip install peft`): only the adapters train.

GRPO with LoRA keeps one copy of the model: the policy is the base with its adapters on, and the reference model
(the KL anchor) is the same base with them off, so no frozen copy of the weights is made. The trained policy is
saved as merged weights (the base with each adapter's update added in), which the next stage opens with
`from_pretrained` like any checkpoint; the adapter alone is saved beside it for whoever wants to keep it small.

Must not depend on Prefect or MLflow. peft is imported only when LoRA is asked for.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from transformers import PreTrainedModel

from grpo.configs.lora import LoRAConfig
from grpo.extras import require


def require_peft() -> None:
    """Fail, saying what to install, when peft (for `lora:`) is not importable."""
    require(["peft"], "lora:", "pip install peft", "remove `lora:` from the recipe")


def add_lora(model: PreTrainedModel, cfg: LoRAConfig) -> torch.nn.Module:
    """`model` with LoRA adapters on `cfg.target_modules` (a peft PeftModel); the base weights are frozen."""
    require_peft()
    from peft import LoraConfig, get_peft_model

    missing = [name for name in cfg.target_modules
               if not any(n.split(".")[-1] == name for n, _ in model.named_modules())]
    if missing:
        raise ValueError(f"lora.target_modules {missing} name no layer of this {type(model).__name__}")
    config = LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                        target_modules=list(cfg.target_modules), task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def is_lora(model: torch.nn.Module) -> bool:
    """Whether `model` is a peft model whose active adapter is plain LoRA (its forward is the base model's)."""
    config = getattr(model, "active_peft_config", None) if hasattr(model, "get_base_model") else None
    return (config is not None and getattr(config, "peft_type", None) == "LORA"  # a str enum
            and not getattr(config, "alora_invocation_tokens", None))


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a LoRA peft model (adapters injected, the same numbers); else `model`.

    peft's forward for LoRA only hands its arguments on, so the log-prob fast paths (the shared prompt pass, the
    chunked head) can read the inner model as they read any Qwen2/Llama.
    """
    return model.get_base_model() if is_lora(model) else model


def adapters_off(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """Within the block a LoRA model computes its base model (the reference); any other model is left as it is."""
    return model.disable_adapter() if is_lora(model) else contextlib.nullcontext()


def save_merged(model: torch.nn.Module, model_dir: Path, adapter_dir: Path | None = None) -> None:
    """Save a LoRA model's merged weights to `model_dir` (and its adapter to `adapter_dir`); the model given is
    merged in place, adapters gone. A model without adapters is saved as it is."""
    if not is_lora(model):
        model.save_pretrained(model_dir)
        return
    if adapter_dir is not None:
        model.save_pretrained(adapter_dir)
    model.merge_and_unload().save_pretrained(model_dir)
