"""What every generation engine returns (`Rollout`) and offers (`Engine`); `grpo.sampling.engines` picks which one
samples. Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from grpo.configs.sampling import SamplingConfig


class Rollout(NamedTuple):
    """N = len(prompts) * n sampled completions, laid out prompt by prompt (a group is n rows).

    Every engine gives the texts, the truncation flags and the token counts. An engine that runs the model itself
    (`local`) also gives the token ids, their masks and (when asked) each sampled token's log-prob; a text-only one
    (`http`) leaves them None, and a consumer that needs them says so (`require_tokens`).
    """

    texts: list[str]  # N completions, special tokens removed
    truncated: torch.Tensor  # [N] bool: the budget ran out before an end-of-turn token
    prompt_ids: torch.Tensor | None = None  # [N, P] left-padded prompt tokens
    prompt_mask: torch.Tensor | None = None  # [N, P] 1 on real prompt tokens
    completion_ids: torch.Tensor | None = None  # [N, C] right-padded with the pad id
    completion_mask: torch.Tensor | None = None  # [N, C] 1 up to and including the end-of-turn token
    logprobs: torch.Tensor | None = None  # [N, C] each sampled token's log-prob under the sampler, 0 on padding
    token_counts: torch.Tensor | None = None  # [N] tokens per completion, as a text-only engine's server counted
    # [N, C] the KL term's reference log-probs of the completions, where the sampler scored them (an asynchronous
    # worker with rollout.reference: sampler); None: the trainer scores them
    ref_logprobs: torch.Tensor | None = None

    @property
    def completion_tokens(self) -> torch.Tensor:
        """[N] tokens generated per completion, the end-of-turn token included."""
        return self.completion_mask.sum(-1) if self.completion_mask is not None else self.token_counts

    @property
    def has_tokens(self) -> bool:
        return self.completion_ids is not None


def cat_padded(tensors: list[torch.Tensor], value) -> torch.Tensor:
    """[n_i, C_i] tensors stacked into one [sum n_i, max C_i], each padded on the right with `value`."""
    width = max(t.size(1) for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.size(1)), value=value) for t in tensors])


def require_tokens(rollout: Rollout, who: str) -> Rollout:
    """`rollout` itself, or an error naming `who` needs its token ids and which engine gives them."""
    if not rollout.has_tokens:
        raise ValueError(f"{who} needs the completions' token ids, and this engine returned text only (an http "
                         f"engine does); set generation.backend: local")
    return rollout


class Engine(Protocol):
    """What every generation engine offers."""

    def generate(self, prompts: list, n: int, sampling: SamplingConfig) -> Rollout:
        """`n` completions of each prompt (a string, or chat messages rendered with the chat template)."""
        ...

    def sync_weights(self) -> None:
        """Make the next `generate` sample from the model's current weights (after an optimizer step)."""
        ...


def decode_figures(engine) -> dict[str, float]:
    """What `engine`'s decode steps did since the last call, as a stage logs it (`sampler/...`: the local engine's
    slots, pages and preemptions; `backend.TransformersBackend.decode_figures`); empty for an engine that does not
    count its steps (a server behind `http`, a wrapper)."""
    figures = getattr(engine, "decode_figures", None)
    return figures() if callable(figures) else {}
