"""Per-token log-probs of completions under a model, with the prompt pass shared by a group's rows.

GRPO scores each completion token under the policy (with gradients), pi_old and the reference model. Its rows come
in groups of G completions of one prompt, so each distinct prompt goes through the model once and its KV cache is
gathered to its rows.

With a real model's vocabulary the [N, C, V] float32 logits are the largest tensors of the step (5 GB for 32 rows
x 256 tokens x 151,936 entries, several times over with the log-softmax, the entropy and their gradients). Where
the model's logits are exactly `lm_head(last hidden state)` (`selective_head`) and the full logits would pass
`PLAIN_LOGITS_MAX_BYTES`, the log-probs come from the last hidden states chunk by chunk (`grpo.kernels.logprobs`):
the same numbers to float rounding, one chunk of logits alive at a time. Under DDP that whole computation runs as
the wrapped model's forward, inside DDP's own, and under FSDP2 as the sharded root's forward, inside its hooks
(`_inside_forward`). Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel
from transformers import DynamicCache, PreTrainedModel

from grpo.kernels.attention import PACKED, packed_attention_supported
from grpo.kernels.gemm import is_planned
from grpo.kernels.logprobs import logps_from_logits, selective_logps
from grpo.models import cached, is_checkpointing
from grpo.sampling.local import distinct_rows
from grpo.training.lora import causal_lm
from grpo.training.packing import PackedRows, pack_completions

# Full float32 logits up to this size are made as they are: the plain path then costs at most a few times this in
# memory, and keeps today's numbers bit for bit for small vocabularies (the tiny recipe, 2 MiB for the CPU bench's
# batch). Speed does not decide it: on CPU the chunked path is as fast as the plain one at every size measured
# (BENCHMARKS.md, benchmarks/logprobs.py); on a GPU it pays one more head matmul in the backward.
PLAIN_LOGITS_MAX_BYTES = 64 * 2**20

# CausalLMs whose logits are exactly lm_head(base_model(...).last_hidden_state[:, kept]): no soft-capping (Gemma 2/3),
# no logit scale (Cohere's logit_scale, Granite's logits_scaling), nothing between the decoder and the head.
_PLAIN_HEAD_MODELS = {"Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM"}


def token_logps(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, n_completion: int,
                temperature: float, with_entropy: bool = False, *, packed: bool = False,
                plain_max_bytes: int | None = None, chunk_tokens: int | None = None,
                _inside: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the last `n_completion` tokens of each row under `model` (and their entropy if asked).

    Returns logps [N, C] float32 and entropy [N, C] (no gradient) or None. `packed`: the rows go through the model
    as one row without padding (`grpo.training.packing`); the real tokens' numbers are the padded path's to float
    rounding, and the padding positions hold 0 (the padded path leaves whatever the model gave there; both are
    masked out of every loss). `plain_max_bytes` (default `PLAIN_LOGITS_MAX_BYTES`) and `chunk_tokens` choose the
    head's path and the chunk size; the defaults suit training.
    """
    if plain_max_bytes is None:
        plain_max_bytes = PLAIN_LOGITS_MAX_BYTES

    def inside(module: torch.nn.Module):
        return lambda ids, mask: token_logps(module, ids, mask, n_completion, temperature, with_entropy,
                                             packed=packed, plain_max_bytes=plain_max_bytes,
                                             chunk_tokens=chunk_tokens, _inside=True)

    if not _inside and isinstance(model, DistributedDataParallel) and not _hooked(model.module):
        return _inside_forward(model, model.module, inside(model.module), input_ids, attention_mask)
    if not _inside and isinstance(model, FSDPModule):  # the sharded root: its hooks gather its own weights
        return _inside_forward(model, model, inside(model), input_ids, attention_mask)
    model = causal_lm(model)  # a LoRA model's inner transformers model: its forward computes the same
    if packed:
        return _packed_logps(model, input_ids, attention_mask, n_completion, temperature, with_entropy,
                             plain_max_bytes, chunk_tokens, root_hooks_ran=_inside)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [N, L] left padding is skipped
    targets = input_ids[:, -n_completion:]  # [N, C]
    head = selective_head(model, root_hooks_ran=_inside)
    if head is None or targets.numel() * head.out_features * 4 <= plain_max_bytes:
        logits = _completion_outputs(model, input_ids, attention_mask, position_ids, n_completion)  # [N, C, V]
        return logps_from_logits(logits, targets, temperature, with_entropy)
    hidden = _completion_outputs(model, input_ids, attention_mask, position_ids, n_completion,
                                 hidden_states=True)  # [N, C, H]
    return selective_logps(hidden, head.weight, head.bias, targets, temperature, chunk_tokens=chunk_tokens,
                           with_entropy=with_entropy)


def packing_on(setting: bool | str, model: torch.nn.Module) -> bool:
    """Whether a loop packs its rows: `auto` where packed rows are exact and cheap: Qwen2/Llama on SDPA or eager
    attention on CPU (`packed_attention`, which the loop holds with `attending_packed`), any model on flash
    attention (varlen sequences from its position ids); true elsewhere too (`packed_attention` where supported,
    else transformers' own packed-sequence mask from the position ids)."""
    if setting != "auto":
        return bool(setting)
    model = causal_lm(model)
    impl = str(getattr(getattr(model, "config", None), "_attn_implementation", "") or "")
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())  # a GPU without flash: SDPA's padded kernels
    return (packed_attention_supported(model) and on_cpu) or "flash" in impl


def _packed_logps(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, n_completion: int,
                  temperature: float, with_entropy: bool, plain_max_bytes: int, chunk_tokens: int | None,
                  root_hooks_ran: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logps` on the rows packed into one row [1, T]: only real tokens go through the model and the head.

    With `packed_attention` (Qwen2/Llama on SDPA or eager attention, any device) a group's prompt is packed once and
    its completions read it, as the padded path shares it; a model on flash attention gets one sequence a row and
    its position ids (transformers cuts the varlen sequences from them); any other model gets transformers' own
    packed-sequence mask from the position ids (no padding mask).
    """
    N, C = input_ids.size(0), n_completion
    rows, inputs = packed_inputs(model, input_ids, attention_mask, C)
    targets = input_ids[:, -C:][rows.valid]  # [M] the real completion tokens, row-major
    head = selective_head(model, root_hooks_ran=root_hooks_ran)
    if head is None or targets.numel() * head.out_features * 4 <= plain_max_bytes:
        # the model's own logits, at the predicting positions only (transformers' 1-D logits_to_keep)
        logits = model(**inputs, logits_to_keep=rows.predictors).logits  # [1, M, V]
        logps, entropy = logps_from_logits(logits, targets[None], temperature, with_entropy)  # [1, M]
    else:
        hidden = model.base_model(**inputs).last_hidden_state[0, rows.predictors]  # [M, H]
        logps, entropy = selective_logps(hidden[None], head.weight, head.bias, targets[None], temperature,
                                         chunk_tokens=chunk_tokens, with_entropy=with_entropy)  # [1, M]
    out = logps.new_zeros(N, C).masked_scatter(rows.valid, logps[0])  # [N, C] 0 on padding
    if entropy is not None:
        entropy = entropy.new_zeros(N, C).masked_scatter(rows.valid, entropy[0])  # [N, C]
    return out, entropy


def packed_inputs(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  n_completion: int) -> tuple[PackedRows, dict]:
    """Rows [N, P+C] packed for `model` (`pack_completions`) and the keyword arguments of its forward on them.

    With `packed_attention` held (`attending_packed`) a group's prompt is packed once where sharing is exact
    (`_can_share_prompts`) and the sequences travel as `packed_segments`; otherwise one sequence a row, read from
    the position ids (flash attention, or transformers' packed-sequence mask)."""
    own_kernel = model.config._attn_implementation == PACKED  # the loop holds it (`attending_packed`)
    rows = pack_completions(input_ids, attention_mask, n_completion,
                            share_prompts=own_kernel and _can_share_prompts(model, packed=True))
    # no cache: transformers reads packed sequences from the position ids only without one
    inputs = {"input_ids": rows.input_ids, "position_ids": rows.position_ids, "use_cache": False}
    if own_kernel:
        inputs["packed_segments"] = rows.segments
    return rows, inputs


def _hooked(module: torch.nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _inside_forward(wrapper: torch.nn.Module, inner: torch.nn.Module, compute, *inputs: torch.Tensor):
    """`compute(*inputs)` run as `inner`'s forward, called through `wrapper` (DDP around it, or the FSDP2 root
    itself, whose forward hooks gather its weights and prepare their gradients' reduction).

    DDP prepares its gradient all-reduce in its forward (which parameters to expect, `no_sync`, and with
    `find_unused_parameters` a walk of the graph from the forward's outputs); FSDP2's root gathers its own weights
    (embeddings, final norm, head) in its pre-forward hook and reduces their gradients after the backward of what
    its forward returned. The chunked head uses the head's weight outside the model's own forward, so the whole
    computation has to be what the wrapper's forward returns. So the model computes what it computes alone
    (chunked head, shared prompt pass), within one wrapped forward. Its forward is replaced for this one call
    only, and put back before `compute` calls the module (under DDP, whose own hooks would run twice: `token_logps`
    does not come here for a DDP module that has any).
    """
    saved = vars(inner).get("forward")  # an instance forward already there (accelerate's autocast wrapper)

    def restore() -> None:
        if saved is None:
            vars(inner).pop("forward", None)
        else:
            inner.forward = saved

    def once(*args):  # the inputs as DDP hands them on (moved to its device: with none, DDP fails on a GPU)
        restore()
        return compute(*args)

    inner.forward = once
    try:
        return wrapper(*inputs)
    finally:
        restore()


def selective_head(model: torch.nn.Module, root_hooks_ran: bool = False) -> torch.nn.Linear | None:
    """The output head, when log-probs may be computed from the base model's hidden states with it; else None.

    Only for models whose forward is the decoder then the head and nothing else, run as they are: a wrapper's
    forward (DDP and FSDP sync gradients in it, PEFT routes through it) or a patched one must run, and a head that
    is not a plain `nn.Linear` (quantised, LoRA'd, hooked or offloaded) is not what `selective_logps` computes.
    `root_hooks_ran`: the call comes from inside the model's own forward (`_inside_forward`), whose hooks (FSDP2's
    on a sharded root) have run.
    """
    # FSDP2 makes a sharded model an instance of a class made of FSDPModule and its own (FSDPQwen2ForCausalLM)
    classes = {c.__name__ for c in type(model).__mro__}
    if not isinstance(model, PreTrainedModel) or not classes & _PLAIN_HEAD_MODELS:
        return None
    if "forward" in vars(model) and not hasattr(model, "_original_forward"):  # someone's patch, not accelerate's
        return None  # (accelerate wraps forward in autocast, which the trainer opens around the call anyway)
    cfg = model.config
    if any(getattr(cfg, k, None) not in (None, 1, 1.0) for k in ("final_logit_softcapping", "logit_scale",
                                                                   "logits_scaling")):
        return None
    head = model.get_output_embeddings()
    # fp32_gemm's forward on the head is F.linear on another library: the chunked head computes the same product
    # (without it, a CPU whose plan takes oneDNN made the [N, C, V] logits: 6.2 GB at Qwen2.5's vocabulary)
    patched = "forward" in vars(head) and not is_planned(head)
    if (type(head) is not torch.nn.Linear or head._forward_hooks or head._forward_pre_hooks
            or patched or (not root_hooks_ran and (model._forward_hooks or model._forward_pre_hooks))):
        return None
    return head


def _completion_outputs(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        position_ids: torch.Tensor, n_completion: int, hidden_states: bool = False) -> torch.Tensor:
    """The logits [N, C, V] that predict each row's last `n_completion` tokens, or the final hidden states [N, C, H]
    they come from (`hidden_states=True`: the base model's output, after its final norm, before the head).

    GRPO's rows come in groups of G completions of one prompt. Each distinct prompt goes through the model once,
    its KV cache is gathered to its rows, and the completions run on top: the plain forward's numbers (gradients
    flow back through the gather into the shared pass) for 1/G of the prompt work.
    """
    C = n_completion
    P = input_ids.size(1) - C

    def run(keep: int, **inputs) -> torch.Tensor:
        """The last `keep` positions' outputs (all of them for keep=0)."""
        if not hidden_states:
            return model(**inputs, logits_to_keep=keep).logits
        hidden = model.base_model(**inputs).last_hidden_state  # [n, l, H] cheap to keep whole (no V axis)
        return hidden[:, -keep:] if keep else hidden

    def plain() -> torch.Tensor:
        return run(C + 1, input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=position_ids)[:, :-1]  # [N, C, V|H]

    if P == 0 or C < 2 or not _can_share_prompts(model):
        return plain()
    inverse, first = distinct_rows(torch.cat([input_ids[:, :P], attention_mask[:, :P]], 1))  # [N], [U]
    if first.numel() == input_ids.size(0):
        return plain()
    cache = DynamicCache()
    head = run(1, input_ids=input_ids[first, :P], attention_mask=attention_mask[first, :P],
               position_ids=position_ids[first, :P],
               **cached(cache))  # [U, 1, V|H] predicts each prompt's first completion token
    if cache.get_seq_length() != P:  # a model that ignores the cache cannot share its prompt pass
        return plain()
    cache.reorder_cache(inverse)  # [U, ...] -> [N, ...]
    tail = run(0, input_ids=input_ids[:, P:-1], attention_mask=attention_mask[:, :-1],
               position_ids=position_ids[:, P:-1], **cached(cache))  # [N, C-1, V|H]
    return torch.cat([head[inverse], tail], 1)  # [N, C, V|H]


def _can_share_prompts(model: torch.nn.Module, packed: bool = False) -> bool:
    """Whether two forward passes over a shared cache give what one plain pass would (`packed`: whether a packed
    row may hold a group's prompt once).

    Not for wrapped models (DDP and friends expect one forward per backward; under DDP `token_logps` runs the
    inner model's two passes within one DDP forward), nor under gradient checkpointing
    (which turns the cache off; a packed row is one pass, which checkpointing leaves alone), nor with active
    dropout (rows of a group would share the prompt's noise).
    """
    if not isinstance(model, PreTrainedModel):
        return False
    if is_checkpointing(model) and not packed:
        return False
    if model.training:
        cfg = model.config
        rates = [getattr(cfg, k, 0.0) or 0.0 for k in ("attention_dropout", "hidden_dropout", "dropout",
                                                         "resid_pdrop", "embd_pdrop", "attn_pdrop")]
        rates += [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
        if any(float(r) > 0 for r in rates):
            return False
    return True
