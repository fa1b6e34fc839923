"""How a completion is graded: the rule rewards, step verifiers and languages a recipe may name, and the judge (a
model asked whether a response is right). The code reward's settings are in `grpo.configs.code`, the reward model
stage's in `grpo.configs.reward`.

Plain pydantic: imports nothing of torch or of the modules that do the work, so a recipe is read and checked
before anything heavy loads.
"""

from __future__ import annotations

import string
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from grpo.texts import JUDGE_PROMPT, JUDGE_TEMPLATE_FIELDS

# The names the settings may use; the modules that implement them check that they agree (grpo.rewards.registry,
# grpo.rewards.language, grpo.rewards.steps), so a recipe is checked without importing them.
LANGUAGES = ("en", "zh")  # what a chain of thought can be checked to be written in (grpo.rewards.language)
# the rule rewards a recipe can name under grpo.rewards: grpo.rewards.registry scores each by this name
RULE_REWARDS = ("format", "format_strict", "accuracy", "tag_count", "language_consistency", "overlong", "code")
REWARD_MODEL = "reward_model"  # the reward name that means the alignment stage's reward model
STEP_VERIFIERS = ("arithmetic", "gsm8k", "prm")  # process supervision's step verifiers (grpo.rewards.steps, .training.prm)

SELF_JUDGE = "checkpoint"  # JudgeConfig.model: the checkpoint being sampled judges its own samples


class JudgeConfig(BaseModel):
    """Which judge to ask and how."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: Literal["transformers", "http"] = "transformers"  # a local model, or an OpenAI-compatible endpoint
    model: str = "tiny"  # transformers: checkpoint folder, hub name or "tiny"; http: the served model's name
    base_url: str = "http://127.0.0.1:8000/v1"  # http only: endpoint root, the part before /chat/completions
    api_key_env: str = "R1_JUDGE_API_KEY"  # http only: NAME of the env var holding the key (sent as a Bearer token)
    max_new_tokens: int = Field(128, ge=1)  # the judge's reply budget; a reasoning judge needs far more
    temperature: float = Field(0.0, ge=0.0)  # 0 = greedy, so the same response gets the same verdict
    timeout_s: float = Field(60.0, gt=0)  # http only: per-request socket timeout
    max_retries: int = Field(2, ge=0)  # http only: further tries after a connection error, timeout, 5xx or 429
    backoff_s: float = Field(1.0, ge=0)  # http only: wait before the first retry; doubles on each further one
    # http only: requests in flight to the endpoint at once, from all of a process's shard tasks together; the
    # server batches the requests in flight (a chat request carries one conversation), so this is the judge's batch
    max_workers: int = Field(4, ge=1)
    batch_size: int = Field(16, ge=1)  # transformers only: judge prompts decoded together
    prompt_template: str = JUDGE_PROMPT  # str.format template with {question}, {reference} and {response}

    @field_validator("prompt_template")
    @classmethod
    def _known_fields(cls, template: str) -> str:
        try:
            fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
        except ValueError as e:  # an unmatched brace
            raise ValueError(f"prompt_template is not a valid str.format template ({e}); write literal braces "
                             f"as {{{{ and }}}}") from None
        unknown = fields - JUDGE_TEMPLATE_FIELDS
        if unknown:
            raise ValueError(f"prompt_template uses unknown fields {sorted(unknown)}; "
                             f"the known ones are {sorted(JUDGE_TEMPLATE_FIELDS)}")
        if "response" not in fields:
            raise ValueError("prompt_template must contain {response}, or the judge never sees what it judges")
        return template

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {url!r}")
        return url.rstrip("/")
