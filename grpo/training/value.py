"""PPO's critic: a separate value model as large as the policy, initialised from the policy's checkpoint.

The policy's decoder (every layer and the embeddings, copied, trained apart) with a linear head that reads one value
per position in place of the language-model head, as InstructGPT and TRL's PPOTrainer build it (TRL: a
sequence-classification model with one label). This copy, its gradients and its optimizer state are the memory
GRPO saves by having no critic. Packed rows (`packed=True`) are read as the policy's are (grpo.training.logprobs).
Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import copy

import torch
from transformers import PreTrainedModel

from grpo.training.logprobs import packed_inputs


class ValueModel(torch.nn.Module):
    """V(s_t) for every completion token t: the value of the prefix the token is sampled from."""

    def __init__(self, trunk: PreTrainedModel, seed: int = 0):
        super().__init__()
        self.trunk = trunk  # a decoder without its head: input ids -> last hidden states
        head = torch.nn.Linear(trunk.config.hidden_size, 1)
        # small random weights (the decoder's own init scale), zero bias: values start near 0 and the trunk gets
        # a gradient from the first step (a zero head would give it none); seeded, so a run is reproducible
        torch.nn.init.normal_(head.weight, std=getattr(trunk.config, "initializer_range", 0.02),
                              generator=torch.Generator().manual_seed(seed))
        torch.nn.init.zeros_(head.bias)
        first = next(trunk.parameters())
        self.head = head.to(first.device, first.dtype)

    @classmethod
    def from_policy(cls, policy: PreTrainedModel, seed: int = 0) -> "ValueModel":
        """A critic whose decoder is a copy of the policy's (the language-model head is left out)."""
        return cls(copy.deepcopy(policy.base_model), seed)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, n_completion: int, *,
                packed: bool = False) -> torch.Tensor:
        """Values [N, C] float32 of the states before each of the last `n_completion` tokens of every row.

        `packed`: the rows go through the trunk as one row without padding (`packed_inputs`, as the policy's
        log-probs do), the head reads the positions that predict the completion tokens, and padding holds 0 (the
        padded path leaves whatever the head gave there; every use masks it out)."""
        if packed:
            rows, inputs = packed_inputs(self.trunk, input_ids, attention_mask, n_completion)
            hidden = self.trunk(**inputs).last_hidden_state[0, rows.predictors]  # [M, H]
            values = self.head(hidden).squeeze(-1).float()  # [M]
            return values.new_zeros(rows.valid.shape).masked_scatter(rows.valid, values)  # [N, C]
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [N, L] left padding is skipped
        hidden = self.trunk(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False).last_hidden_state  # [N, L, H]
        hidden = hidden[:, -(n_completion + 1):-1]  # [N, C, H] the positions that predict the completion tokens
        return self.head(hidden).squeeze(-1).float()  # [N, C]
