"""Generation behind one interface: `generate(prompts, n, sampling) -> Rollout`.

The transformers backend here is a plain sampling loop over the model's KV cache. It returns what GRPO needs and
`model.generate` does not hand back cheaply: the completion token ids, their mask, and the sampling policy's
log-probability of every sampled token (so with one inner iteration nothing is recomputed for pi_old). It stops as
soon as every sequence has ended. A vLLM backend implements the same `generate` on GPUs.
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple, Protocol

import torch
from pydantic import BaseModel, ConfigDict
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from grpo.data import as_messages


class SamplingConfig(BaseModel):
    """How completions are sampled."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_new_tokens: int = 96  # completion budget in tokens; leave room, a truncated completion earns nothing
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus sampling; 1.0 keeps the whole distribution
    top_k: int = 0  # 0 keeps every token
    batch_size: int = 64  # sequences decoded together (prompts x n are cut into batches of this many)


class Rollout(NamedTuple):
    """Sampled completions for N = len(prompts) * n sequences, laid out prompt by prompt (a group is n rows)."""

    prompt_ids: torch.Tensor  # [N, P] left-padded prompt tokens
    prompt_mask: torch.Tensor  # [N, P] 1 on real prompt tokens
    completion_ids: torch.Tensor  # [N, C] right-padded with the pad id
    completion_mask: torch.Tensor  # [N, C] 1 up to and including the end-of-turn token
    logprobs: torch.Tensor  # [N, C] log-prob of each sampled token under the sampling distribution, 0 on padding
    truncated: torch.Tensor  # [N] True when the budget ran out before an end-of-turn token
    texts: list[str]  # N decoded completions, special tokens removed


class GenerationBackend(Protocol):
    def generate(self, prompts: list, n: int, sampling: SamplingConfig) -> Rollout: ...


def render_prompts(tokenizer: PreTrainedTokenizerBase, prompts: list) -> list[str]:
    """Prompt cells (strings or chat messages) as the text the model sees, ending where the assistant begins."""
    return [tokenizer.apply_chat_template(as_messages(p), add_generation_prompt=True, tokenize=False) for p in prompts]


def _pick(logits: torch.Tensor, s: SamplingConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose the next token of each row; return it and its log-prob under the distribution sampled from."""
    logits = logits.float()  # [B, V]
    if s.temperature == 0:
        logp = torch.log_softmax(logits, -1)
        tok = logp.argmax(-1)  # [B]
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
    if s.temperature != 1.0:  # dividing by 1 changes nothing: skip the full-vocab pass
        logits = logits / s.temperature
    if s.top_k:
        kth = torch.topk(logits, min(s.top_k, logits.size(-1)), dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > s.top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    logp = torch.log_softmax(logits, -1)  # [B, V]
    tok = _draw(logp.exp())  # [B]
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


def _draw(probs: torch.Tensor) -> torch.Tensor:
    """One index per row, drawn with probability probs[b, i] / probs[b].sum() by inverting the CDF.

    One uniform per row instead of multinomial's one exponential per vocabulary entry (most of a small model's
    sampling time). The CDF is float64 so a long tail of tiny probabilities keeps its mass; u lies in (0, total],
    so the first index whose CDF reaches u always exists and never has zero probability (top-k/top-p cut-offs).
    """
    cdf = probs.double().cumsum(-1)  # [B, V]
    u = (1 - torch.rand_like(cdf[:, -1:])) * cdf[:, -1:]  # [B, 1]
    return torch.searchsorted(cdf, u).squeeze(-1)  # [B]


@torch.inference_mode()
def sample_batch(model: PreTrainedModel, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, s: SamplingConfig,
                 eos_ids: list[int], pad_id: int, autocast: bool = False) -> tuple[torch.Tensor, ...]:
    """Decode one batch of left-padded prompts; returns (completion_ids, completion_mask, logprobs, truncated)."""
    device = next(model.parameters()).device
    ids, mask = prompt_ids.to(device), prompt_mask.to(device)  # [B, P]
    B = ids.size(0)
    eos = torch.tensor(eos_ids, device=device)
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, P] positions that ignore left padding
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with amp:
        logits, cache = _prefill(model, ids, mask, pos)  # [B, V]
    next_pos = pos[:, -1] + 1  # [B]
    # autocast changes every op's dtype, which the lean path does not mirror: it keeps to the HF loop
    step = None if autocast else _LeanDecoder.build(model, cache, mask, next_pos, s.max_new_tokens)
    if step is None:
        step = _HFDecoder(model, cache, mask, next_pos, amp)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    toks, lps, alive = [], [], []
    for i in range(s.max_new_tokens):
        tok, lp = _pick(logits, s)  # [B], [B]
        alive.append(~done)
        toks.append(tok.masked_fill(done, pad_id))
        lps.append(lp.masked_fill(done, 0.0))
        done = done | torch.isin(tok, eos)
        if i == s.max_new_tokens - 1 or bool(done.all()):  # no decode step for a token nobody will read
            break
        logits = step(toks[-1])  # [B, V]
    completion_ids = torch.stack(toks, 1)  # [B, C]
    completion_mask = torch.stack(alive, 1).long()  # [B, C]
    return completion_ids.cpu(), completion_mask.cpu(), torch.stack(lps, 1).float().cpu(), (~done).cpu()


def _prefill(model: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor,
             pos: torch.Tensor) -> tuple[torch.Tensor, DynamicCache]:
    """Next-token logits and the KV cache of every row, running each distinct prompt only once.

    The n rows of a group share their prompt, so one forward per prompt and a row gather of its cache give the
    same numbers as N forwards for a fraction of the work.
    """
    inverse, first = distinct_rows(torch.cat([ids, mask.to(ids.dtype)], 1))  # [B], [U]
    cache = DynamicCache()
    logits = model(input_ids=ids[first], attention_mask=mask[first], position_ids=pos[first], past_key_values=cache,
                   use_cache=True, logits_to_keep=1).logits[:, -1]  # [U, V]
    if not torch.equal(first, torch.arange(ids.size(0), device=ids.device)):
        # [U, ...] -> [B, ...]; also when every row is distinct, since `first` then lists them in sorted order
        cache.reorder_cache(inverse)
    return logits[inverse], cache  # [B, V]


def distinct_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For a [B, W] tensor: (inverse [B], first [U]) with rows[first][inverse] == rows and rows[first] distinct."""
    _, inverse = torch.unique(rows, dim=0, return_inverse=True)  # [B]
    n_unique = int(inverse.max()) + 1
    order = torch.arange(rows.size(0), device=rows.device)  # [B]
    first = torch.full((n_unique,), rows.size(0), device=rows.device).scatter_reduce(0, inverse, order, "amin")
    return inverse, first  # [B], [U]


class _HFDecoder:
    """One decode step through the model's own forward: works for any causal LM that takes a DynamicCache."""

    def __init__(self, model: PreTrainedModel, cache: DynamicCache, mask: torch.Tensor, next_pos: torch.Tensor,
                 amp):
        self.model, self.cache, self.mask, self.pos, self.amp = model, cache, mask, next_pos[:, None], amp

    def __call__(self, tok: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)  # [B, P+t+1]
        with self.amp:
            logits = self.model(input_ids=tok[:, None], attention_mask=self.mask, position_ids=self.pos,
                                past_key_values=self.cache, use_cache=True).logits[:, -1]  # [B, V]
        self.pos = self.pos + 1
        return logits


# Llama-family decoders (RMSNorm, rotary, grouped-query attention, SwiGLU MLP) whose decode step _LeanDecoder
# reproduces from the weights alone. Anything else, or anything unusual in these, decodes through _HFDecoder.
_LEAN_ARCHITECTURES = {"Qwen2ForCausalLM", "LlamaForCausalLM"}
_STATIC_ROPE = {"default", "linear", "llama3"}  # rope types whose cos/sin depend on the position alone


# fused and packed weight copies only for models this small: for a large model they would cost as much memory as
# the model itself, and its matmuls are big enough to run well without them
_COPY_MAX_BYTES = 1 << 30


class _Linear:
    """One or more `nn.Linear`s applied to the same input, outputs side by side: [rows, in] -> [rows, sum(out)].

    With copies allowed (small models), their weights are concatenated into one matrix, so q/k/v (or gate/up) take
    one matmul instead of several, and on CPU the matrix is packed once for MKL's GEMM: decode runs the same
    small-M matmuls (M = batch rows) dozens of times per generate call, and packing skips the weight reordering in
    every call after the first. That is 10-20% faster sampling for the GRPO benchmark's model on 2 CPU cores, bit
    for bit the numbers of `F.linear`. Without copies, each module's own weight is used in place.
    """

    def __init__(self, linears: list[torch.nn.Linear], rows: int, copies: bool):
        self.rows, self.packed, self.parts = rows, None, None
        if len(linears) > 1 and not copies:
            self.parts = [(m.weight, m.bias) for m in linears]
            return
        self.weight = linears[0].weight if len(linears) == 1 else torch.cat([m.weight for m in linears])  # [out, in]
        self.bias = _cat_bias(*linears)  # [out] or None
        if copies and _mkl_packing() and self.weight.device.type == "cpu" and self.weight.dtype == torch.float32:
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight.detach(), rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
        if self.parts is not None:
            return torch.cat([torch.nn.functional.linear(x, w, b) for w, b in self.parts], -1)
        if self.packed is None:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, self.rows)


@functools.cache
def _mkl_packing() -> bool:
    """Whether this torch build has MKL's packed GEMM (CPU builds with MKL; not ARM or most GPU-only builds)."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


class _LeanLayer(NamedTuple):
    """One decoder layer's weights as the lean step reads them."""

    ln1: torch.Tensor  # [H] input RMSNorm weight
    qkv: _Linear  # [H] -> [(Hq + 2 Hkv) D]: q, k and v projections
    o: _Linear  # [Hq D] -> [H]
    ln2: torch.Tensor  # [H] post-attention RMSNorm weight
    gate_up: _Linear  # [H] -> [2 I]: gate and up projections
    down: _Linear  # [I] -> [H]


def _cat_bias(*linears: torch.nn.Linear) -> torch.Tensor | None:
    biases = [m.bias for m in linears]
    if len(linears) == 1 or all(b is None for b in biases):
        return biases[0]
    return torch.cat([b if b is not None else torch.zeros(m.out_features, dtype=m.weight.dtype,
                                                          device=m.weight.device) for b, m in zip(biases, linears)])


def _lean_layer(layer, rows: int, copies: bool) -> _LeanLayer:
    """The layer's weights as the lean step uses them (built per generate call: the policy changes between them)."""
    a, m = layer.self_attn, layer.mlp
    return _LeanLayer(layer.input_layernorm.weight, _Linear([a.q_proj, a.k_proj, a.v_proj], rows, copies),
                      _Linear([a.o_proj], rows, copies), layer.post_attention_layernorm.weight,
                      _Linear([m.gate_proj, m.up_proj], rows, copies), _Linear([m.down_proj], rows, copies))


def lean_decode_supported(model: PreTrainedModel) -> bool:
    """True when `model` is a plain Qwen2/Llama decoder that `_LeanDecoder` computes exactly."""
    if type(model).__name__ not in _LEAN_ARCHITECTURES:
        return False
    cfg, core = model.config, getattr(model, "model", None)
    rotary = getattr(core, "rotary_emb", None)
    if rotary is None or getattr(rotary, "rope_type", None) not in _STATIC_ROPE or cfg.hidden_act != "silu":
        return False
    sliding = getattr(cfg, "use_sliding_window", False) or any(
        t != "full_attention" for t in getattr(cfg, "layer_types", None) or [])
    if sliding:  # the lean step attends to the whole cache
        return False
    if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
        return False  # the lean step reads the weights alone: a hook (a logit mask, an adapter) would be skipped
    linear = torch.nn.Linear
    for layer in core.layers:
        a, m = layer.self_attn, layer.mlp
        if not all(type(x) is linear for x in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj,
                                                m.down_proj, model.lm_head)):  # not LoRA-wrapped or quantized
            return False
    return True


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen2/Llama RMSNorm: statistics in fp32, the weight applied in the input dtype."""
    if x.dtype == weight.dtype == torch.float32:
        return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)  # fewer ops; the same numbers in fp32
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class _LeanDecoder:
    """Decode steps computed straight from the model's weights, without the per-layer Python of transformers.

    Per step and layer: one fused QKV matmul, rotary from a table built once, K/V written in place into a
    preallocated cache, one SDPA call with the query heads of a KV group folded into the query axis (GQA without
    copying K/V), the output projection, and one fused gate/up matmul (for a small model; see `_Linear`). The padding
    mask is built once and sliced.
    """

    def __init__(self, model: PreTrainedModel, cache: DynamicCache, mask: torch.Tensor, next_pos: torch.Tensor,
                 max_new: int):
        core, cfg = model.model, model.config
        B, P = mask.shape
        attn = core.layers[0].self_attn
        self.n_kv, self.head_dim, self.scale = cfg.num_key_value_heads, attn.head_dim, attn.scaling
        self.n_q = cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.embed, self.norm = core.embed_tokens.weight, core.norm.weight
        copies = sum(p.numel() * p.element_size() for p in model.parameters()) <= _COPY_MAX_BYTES
        self.head = _Linear([model.lm_head], B, copies)
        self.layers = [_lean_layer(layer, B, copies) for layer in core.layers]
        self.k, self.v = [], []
        for layer in cache.layers:  # [B, Hkv, P, D] each -> [B, Hkv, P + max_new, D], prompt part filled
            for prefilled, out in ((layer.keys, self.k), (layer.values, self.v)):
                buf = prefilled.new_empty(B, self.n_kv, P + max_new, self.head_dim)
                buf[:, :, :P] = prefilled
                out.append(buf)
        # every completion slot is attended to, left padding never; additive, which SDPA on CPU runs faster than bool
        keep = torch.cat([mask.bool(), mask.new_ones(B, max_new, dtype=torch.bool)], 1)  # [B, P+max_new]
        dtype = self.embed.dtype
        self.bias = torch.zeros(keep.shape, dtype=dtype, device=mask.device).masked_fill(
            ~keep, torch.finfo(dtype).min)[:, None, None]  # [B, 1, 1, P+max_new]
        positions = next_pos[:, None] + torch.arange(max_new, device=mask.device)  # [B, max_new]
        table = torch.arange(int(positions.max()) + 1, device=mask.device)[None]  # [1, T]
        cos, sin = core.rotary_emb(self.embed[:1], position_ids=table)  # [1, T, D] each, HF's own numbers
        half = self.head_dim // 2
        # rotate_half(x) * sin == flip_halves(x) * sin_signed: the halves swapped and the first half negated
        sin = torch.cat([-sin[..., :half], sin[..., half:]], -1)
        self.cos, self.sin = cos[0][positions], sin[0][positions]  # [B, max_new, D]
        self.prompt_len, self.t = P, P  # self.t: cache slot of the next token

    @classmethod
    def build(cls, model: PreTrainedModel, cache: DynamicCache, mask: torch.Tensor, next_pos: torch.Tensor,
              max_new: int) -> "_LeanDecoder | None":
        layers = getattr(cache, "layers", None)
        if not lean_decode_supported(model) or not layers or not all(hasattr(x, "keys") for x in layers):
            return None
        return cls(model, cache, mask, next_pos, max_new)

    def __call__(self, tok: torch.Tensor) -> torch.Tensor:
        B, t, D, Hkv, Hq = tok.size(0), self.t, self.head_dim, self.n_kv, self.n_q
        cos, sin = self.cos[:, t - self.prompt_len, None], self.sin[:, t - self.prompt_len, None]  # [B, 1, D]
        bias = self.bias[..., : t + 1]  # [B, 1, 1, t+1]
        x = torch.nn.functional.embedding(tok, self.embed)  # [B, H]
        for i, w in enumerate(self.layers):
            h = _rms_norm(x, w.ln1, self.eps)  # [B, H]
            qkv = w.qkv(h)  # [B, (Hq+2Hkv) D]
            qk = qkv[:, : (Hq + Hkv) * D].view(B, Hq + Hkv, D)  # rotary goes on q and k together
            qk = qk * cos + qk.view(B, Hq + Hkv, 2, D // 2).flip(2).view(B, Hq + Hkv, D) * sin
            self.k[i][:, :, t] = qk[:, Hq:]  # [B, Hkv, D]
            self.v[i][:, :, t] = qkv[:, (Hq + Hkv) * D :].view(B, Hkv, D)
            q = qk[:, :Hq].reshape(B, Hkv, Hq // Hkv, D)  # query head h reads KV head h // (Hq/Hkv)
            o = torch.nn.functional.scaled_dot_product_attention(
                q, self.k[i][:, :, : t + 1], self.v[i][:, :, : t + 1], attn_mask=bias,
                scale=self.scale)  # [B, Hkv, Hq/Hkv, D]
            x = x + w.o(o.reshape(B, Hq * D))
            h = _rms_norm(x, w.ln2, self.eps)
            gate, up = w.gate_up(h).chunk(2, -1)  # [B, I] each
            x = x + w.down(torch.nn.functional.silu(gate) * up)
        self.t = t + 1
        return self.head(_rms_norm(x, self.norm, self.eps))  # [B, V]


def _pad_right(tensors: list[torch.Tensor], value) -> torch.Tensor:
    width = max(t.size(1) for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.size(1)), value=value) for t in tensors])


class TransformersBackend:
    """Sampling with a transformers causal LM on whatever device it sits on."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, autocast: bool = False):
        self.model, self.tokenizer, self.autocast = model, tokenizer, autocast
        self.eos_ids = sorted({tokenizer.eos_token_id, *_extra_eos(model)})

    def generate(self, prompts: list, n: int, sampling: SamplingConfig) -> Rollout:
        tok = self.tokenizer
        tok.padding_side = "left"
        enc = tok(render_prompts(tok, prompts), padding=True, return_tensors="pt", add_special_tokens=False)
        prompt_ids = enc["input_ids"].repeat_interleave(n, 0)  # [N, P]
        prompt_mask = enc["attention_mask"].repeat_interleave(n, 0)  # [N, P]
        was_training = self.model.training
        self.model.eval()
        parts = []
        try:
            for i in range(0, prompt_ids.size(0), sampling.batch_size):
                sl = slice(i, i + sampling.batch_size)
                parts.append(sample_batch(self.model, prompt_ids[sl], prompt_mask[sl], sampling, self.eos_ids,
                                          tok.pad_token_id, self.autocast))
        finally:
            self.model.train(was_training)
        completion_ids = _pad_right([p[0] for p in parts], tok.pad_token_id)  # [N, C]
        completion_mask = _pad_right([p[1] for p in parts], 0)  # [N, C]
        logprobs = _pad_right([p[2] for p in parts], 0.0)  # [N, C]
        truncated = torch.cat([p[3] for p in parts])  # [N]
        texts = tok.batch_decode(completion_ids.masked_fill(completion_mask == 0, tok.pad_token_id),
                                 skip_special_tokens=True)
        return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, logprobs, truncated, texts)


def _extra_eos(model: PreTrainedModel) -> list[int]:
    """End-of-turn ids a real model's generation config lists besides the tokenizer's eos."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)
