"""Per-token log-probs of completions under a model, with the prompt pass shared by a group's rows.

GRPO scores each completion token under the policy (with gradients), pi_old and the reference model. Its rows come
in groups of G completions of one prompt, so each distinct prompt goes through the model once and its KV cache is
gathered to its rows. Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from grpo.models import is_checkpointing
from grpo.sampling.backend import distinct_rows


def token_logps(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, n_completion: int,
                temperature: float, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the last `n_completion` tokens of each row under `model` (and their entropy if asked)."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [N, L] left padding is skipped
    logits = _completion_logits(model, input_ids, attention_mask, position_ids, n_completion).float()  # [N, C, V]
    if temperature > 0:
        logits = logits / temperature  # the distribution the tokens were sampled from
    logp_all = torch.log_softmax(logits, -1)  # [N, C, V]
    targets = input_ids[:, -n_completion:]  # [N, C]
    logps = logp_all.gather(-1, targets[..., None]).squeeze(-1)  # [N, C]
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)  # [N, C]
    return logps, entropy


def _completion_logits(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       position_ids: torch.Tensor, n_completion: int) -> torch.Tensor:
    """The logits that predict each row's last `n_completion` tokens, [N, C, V]; a prompt rows share runs once.

    GRPO's rows come in groups of G completions of one prompt. Each distinct prompt goes through the model once,
    its KV cache is gathered to its rows, and the completions run on top: the plain forward's numbers (gradients
    flow back through the gather into the shared pass) for 1/G of the prompt work.
    """
    C = n_completion
    P = input_ids.size(1) - C

    def plain() -> torch.Tensor:
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                     logits_to_keep=C + 1).logits[:, :-1]  # [N, C, V]

    if P == 0 or C < 2 or not _can_share_prompts(model):
        return plain()
    inverse, first = distinct_rows(torch.cat([input_ids[:, :P], attention_mask[:, :P]], 1))  # [N], [U]
    if first.numel() == input_ids.size(0):
        return plain()
    cache = DynamicCache()
    head = model(input_ids=input_ids[first, :P], attention_mask=attention_mask[first, :P],
                 position_ids=position_ids[first, :P], past_key_values=cache, use_cache=True,
                 logits_to_keep=1).logits  # [U, 1, V] predicts each prompt's first completion token
    if cache.get_seq_length() != P:  # a model that ignores the cache cannot share its prompt pass
        return plain()
    cache.reorder_cache(inverse)  # [U, ...] -> [N, ...]
    tail = model(input_ids=input_ids[:, P:-1], attention_mask=attention_mask[:, :-1],
                 position_ids=position_ids[:, P:-1], past_key_values=cache, use_cache=True).logits  # [N, C-1, V]
    return torch.cat([head[inverse], tail], 1)  # [N, C, V]


def _can_share_prompts(model: torch.nn.Module) -> bool:
    """Whether two forward passes over a shared cache give what one plain pass would.

    Not for wrapped models (DDP and friends expect one forward per backward), nor under gradient checkpointing
    (which turns the cache off), nor with active dropout (rows of a group would share the prompt's noise).
    """
    if not isinstance(model, PreTrainedModel):
        return False
    if is_checkpointing(model):
        return False
    if model.training:
        cfg = model.config
        rates = [getattr(cfg, k, 0.0) or 0.0 for k in ("attention_dropout", "hidden_dropout", "dropout",
                                                         "resid_pdrop", "embd_pdrop", "attn_pdrop")]
        rates += [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
        if any(float(r) > 0 for r in rates):
            return False
    return True
