"""How completions are sampled: a stage's sampling settings, the engine that samples them (`grpo.sampling.engines`),
and held-out evaluation's samples.

Plain pydantic: imports nothing of torch or of the modules that do the work, so a recipe is read and checked
before anything heavy loads.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

class SamplingConfig(BaseModel):
    """How completions are sampled."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_new_tokens: int = Field(96, ge=1)  # completion budget in tokens; leave room, a truncated completion earns nothing
    temperature: float = Field(1.0, ge=0)  # 0 means greedy
    top_p: float = Field(1.0, gt=0, le=1)  # nucleus sampling; 1.0 keeps the whole distribution
    top_k: int = Field(0, ge=0)  # 0 keeps every token
    batch_size: int = Field(64, ge=1)  # sequences decoded together (prompts x n are cut into batches of this many)


class EvalConfig(BaseModel):
    """Held-out evaluation."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_prompts: int = Field(200, ge=0)  # held-out prompts scored (0 = all)
    num_samples: int = Field(4, ge=0)  # k for sample_accuracy and pass_at_k (0 skips sampling)
    temperature: float = Field(1.0, ge=0)  # sampling temperature for the k samples
    max_new_tokens: int = Field(96, ge=1)  # completion budget
    batch_size: int = Field(128, ge=1)  # sequences decoded together
    num_logged_samples: int = Field(16, ge=0)  # completions kept in the samples table
    # also eval/step_accuracy: the share of the greedy answers' reasoning steps this rule verifier says hold
    # ("arithmetic": the synthetic task's equations; "gsm8k": GSM8K's <<a*b=c>> steps); None: not measured
    step_verifier: Literal["arithmetic", "gsm8k"] | None = None


class GenerationConfig(BaseModel):
    """Which engine samples a stage's completions (`grpo.sampling.engines`): the model in this process, or (rejection
    sampling only) OpenAI-compatible servers."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: Literal["local", "http"] = "local"  # local: the model in this process; http: /v1/completions servers
    # local only: "auto" samples Qwen2/Qwen3/Llama/Mistral-style models with the paged-cache sampler (CUDA graphs on
    # a GPU) and other models step by step; "loop" always step by step (docs/sampling.md)
    sampler: Literal["auto", "loop"] = "auto"
    kv_cache_mb: int | None = Field(None, ge=1)  # local only: the K/V cache's page pool at most; None: half the
    #                                              GPU's free memory (no limit on a CPU); rows beyond it wait their turn
    endpoints: tuple[str, ...] = ()  # http only: endpoint roots, the part before /completions (http://gpu-0:8000/v1)
    model: str = ""  # http only: the model name the endpoints serve (vLLM: --served-model-name)
    max_in_flight: int = Field(32, ge=1)  # http only: requests in flight at once per endpoint (per process)
    api_key_env: str = "R1_GENERATION_API_KEY"  # http only: NAME of the env var holding the key (a Bearer token)
    timeout_s: float = Field(1800.0, gt=0)  # http only: per request; one 32k-token trace at 30 tokens/s is 18 min
    retries: int = Field(3, ge=0)  # http only: further tries per sample, on another live endpoint where there is one
    backoff_s: float = Field(1.0, ge=0)  # http only: wait before a sample's first retry; doubles on each further one
    max_failures: int = Field(3, ge=1)  # http only: failures in a row that give an endpoint up (refused: at once)

    @field_validator("endpoints")
    @classmethod
    def _http_urls(cls, urls: tuple[str, ...]) -> tuple[str, ...]:
        bad = [u for u in urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"endpoints must start with http:// or https://, got {bad}")
        urls = tuple(u.rstrip("/") for u in urls)
        twice = sorted({u for u in urls if urls.count(u) > 1})
        if twice:
            raise ValueError(f"endpoints listed twice: {twice}")
        return urls

    @model_validator(mode="after")
    def _http_needs_servers(self) -> "GenerationConfig":
        if self.backend == "http" and not (self.endpoints and self.model):
            raise ValueError("backend 'http' needs endpoints (e.g. ['http://127.0.0.1:8000/v1']) and the model "
                             "name they serve")
        return self
