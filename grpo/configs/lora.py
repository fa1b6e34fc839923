"""LoRA's settings: the `lora` section of the GRPO and DPO configs (`GRPOConfig`, `DPOConfig`); the other loops (SFT,
the reward model, PPO, the PRM) train every weight.

Plain pydantic: must not import torch or peft (a recipe is checked without them).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class LoRAConfig(BaseModel):
    """LoRA adapters (through peft, an optional extra): only they train; the reference is the base with them off."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    r: int = Field(16, ge=1)  # rank of each adapter's update
    alpha: float = Field(32.0, gt=0)  # the update is scaled by alpha / r
    dropout: float = Field(0.0, ge=0.0, lt=1.0)  # on the adapters' input; > 0 turns off the shared prompt pass
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                       "down_proj")  # linear layers (by name) that get an adapter
