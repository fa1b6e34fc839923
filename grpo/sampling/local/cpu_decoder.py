"""The lean decoder: one decode step of a plain Qwen2/Llama model in a handful of matmuls, for sampling on CPU.

transformers' forward costs more in per-op overhead than in arithmetic for small models decoding a few dozen rows;
this decoder reads the model's own weights (or packed copies of them) and runs the same numbers with fewer ops.
`lean_decode_supported` says which models it takes. Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers import DynamicCache, PreTrainedModel

from grpo.kernels.gemm import pack_weight, packed_library, packed_product

# Llama-family decoders (RMSNorm, rotary, grouped-query attention, SwiGLU MLP) whose decode step LeanDecoder
# reproduces from the weights alone. Anything else, or anything unusual in these, decodes through _HFDecoder.
_LEAN_ARCHITECTURES = {"Qwen2ForCausalLM", "LlamaForCausalLM"}
STATIC_ROPE = {"default", "linear", "llama3"}  # rope types whose cos/sin depend on the position alone


FIRST_ROOM = 64  # completion positions a row's K/V starts with (doubled as the rows write past them)

# fused and packed weight copies only for models this small: for a large model they would cost as much memory as
# the model itself, and its matmuls are big enough to run well without them
COPY_MAX_BYTES = 1 << 30


def lora_reason(m: torch.nn.Module) -> str | None:
    """None when `m` is a plain `nn.Linear`, or peft's LoRA `Linear` over one whose active adapters are plain LoRA
    (what `PackedLinear` computes: base plus each adapter's B A x, scaled); else why a step reading weights cannot."""
    if type(m) is torch.nn.Linear:
        return None
    if (type(m).__name__, type(m).__module__) != ("Linear", "peft.tuners.lora.layer") \
            or type(getattr(m, "base_layer", None)) is not torch.nn.Linear:
        return f"a projection is a {type(m).__name__}, not a plain nn.Linear or a LoRA adapter over one (quantized?)"
    active = [a for a in m.active_adapters if a in m.lora_A]
    if any(a in getattr(m, "lora_variant", {}) for a in active):
        return "a LoRA variant (DoRA or another) computes more than B A x"
    if any(m.lora_B[a].bias is not None for a in active):
        return "a LoRA adapter with a bias (lora_bias)"
    return None


def _adapters(m: torch.nn.Module) -> tuple[torch.nn.Linear, list[tuple[torch.Tensor, torch.Tensor, float]]]:
    """A projection as its base `nn.Linear` and the (A [r, in], B [out, r], scaling) of each adapter its forward adds
    (none for a plain linear, or for adapters turned off or already merged into the base)."""
    if type(m) is torch.nn.Linear or m.disable_adapters or m.merged:
        return getattr(m, "base_layer", m), []
    return m.base_layer, [(m.lora_A[a].weight, m.lora_B[a].weight, m.scaling[a])
                          for a in m.active_adapters if a in m.lora_A]


def _low_rank(parts: list[list[tuple[torch.Tensor, torch.Tensor, float]]], outs: list[int],
              like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """Every adapter of side-by-side projections as one pair: A [R, in] (all adapters' A stacked) and a block
    matrix B [sum(out), R] (each adapter's scaled B in its projection's rows and its own columns, zeros elsewhere),
    so the adapters' term of a fused q/k/v or gate/up is two matmuls: (x A^T) B^T. In `like`'s dtype and device."""
    if not any(parts):
        return None, None
    a = torch.cat([A for adapters in parts for A, _, _ in adapters]).to(like.dtype)  # [R, in]
    b = like.new_zeros(sum(outs), a.size(0))  # [out, R]
    row = col = 0
    for adapters, out in zip(parts, outs):
        for _, B, scale in adapters:
            b[row : row + out, col : col + B.size(1)] = B * scale
            col += B.size(1)
        row += out
    return a, b


class PackedLinear:
    """One or more `nn.Linear`s applied to the same input, outputs side by side: [rows, in] -> [rows, sum(out)].

    With copies allowed (small models), their weights are concatenated into one matrix, so q/k/v (or gate/up) take
    one matmul instead of several, and on CPU the matrix is packed once for a GEMM library: decode runs the same
    small-M matmuls (M = batch rows) dozens of times per generate call, and packing skips the weight reordering in
    every call after the first. That is 10-20% faster sampling for the GRPO benchmark's model on 2 CPU cores, bit
    for bit the numbers of `F.linear`, with MKL's packing. `gemm` (the loop's `fp32_gemm`; None: no packing) says
    which library packs (`grpo.kernels.gemm.packed_library`): MKL, or oneDNN where it measures clearly faster for
    the shape (an output layer as wide as a real vocabulary: 2x on a Zen 4), whose products round otherwise.
    Without copies, each module's own weight is used in place.

    A projection may be peft's LoRA `Linear` (`lora_reason` says which): its base weight is read as above, and its
    adapters add (x A^T) B^T, all the projections' adapters in one pair of small matmuls (`_low_rank`), copies
    made here (rank x in, out x rank: a few MB at 7B) and rebuilt with the weights after every optimizer step.
    """

    def __init__(self, modules: list[torch.nn.Module], rows: int, copies: bool, gemm: str | None = "auto"):
        self.rows, self.packed, self.parts, self.library = rows, None, None, None
        split = [_adapters(m) for m in modules]
        linears = [base for base, _ in split]
        self.lora_a, self.lora_b = _low_rank([adapters for _, adapters in split], [m.out_features for m in linears],
                                             linears[0].weight)
        fused = fused_view([m.weight for m in linears]) if len(linears) > 1 else None
        if len(linears) > 1 and fused is None and not copies:
            self.parts = [(m.weight, m.bias) for m in linears]
            return
        if fused is None:
            fused = linears[0].weight if len(linears) == 1 else torch.cat([m.weight for m in linears])  # [out, in]
        self.weight = fused
        self.bias = _cat_bias(*linears)  # [out] or None
        if copies and gemm is not None and self.weight.device.type == "cpu" and self.weight.dtype == torch.float32:
            N, K = self.weight.shape
            self.library = packed_library(gemm, rows, K, N)
            if self.library is not None:
                self.packed = pack_weight(self.weight, rows, self.library)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
        if self.parts is not None:
            y = torch.cat([torch.nn.functional.linear(x, w, b) for w, b in self.parts], -1)
        elif self.packed is None:
            y = torch.nn.functional.linear(x, self.weight, self.bias)
        else:
            y = packed_product(x, self.packed, self.weight, self.bias, self.rows, self.library)
        if self.lora_a is None:
            return y
        return torch.addmm(y, torch.nn.functional.linear(x, self.lora_a), self.lora_b.t())  # + (x A^T) B^T


class LeanLayer(NamedTuple):
    """One decoder layer's weights as the lean step reads them."""

    ln1: torch.Tensor  # [H] input RMSNorm weight
    qkv: PackedLinear  # [H] -> [(Hq + 2 Hkv) D]: q, k and v projections
    o: PackedLinear  # [Hq D] -> [H]
    ln2: torch.Tensor  # [H] post-attention RMSNorm weight
    gate_up: PackedLinear  # [H] -> [2 I]: gate and up projections
    down: PackedLinear  # [I] -> [H]


def fused_view(weights: list[torch.Tensor]) -> torch.Tensor | None:
    """The [sum(out), in] matrix of `weights` laid out one after another in one storage (the sampler's own copy makes
    q/k/v and gate/up so: `StaticSampler._sampling_model`), as a view: a fused projection with no copy. None when
    they are not."""
    if any(type(w) not in (torch.Tensor, torch.nn.Parameter) for w in weights):
        return None  # a DTensor (a sharded model), a quantized or meta weight: no storage of its own to lay out
    w0, at = weights[0], weights[0].storage_offset()
    for w in weights:
        if (w.dim() != 2 or not w.is_contiguous() or w.size(1) != w0.size(1) or w.storage_offset() != at
                or w.device != w0.device or w.untyped_storage().data_ptr() != w0.untyped_storage().data_ptr()):
            return None
        at += w.numel()
    return w0.detach().as_strided((sum(w.size(0) for w in weights), w0.size(1)), (w0.size(1), 1),
                                  w0.storage_offset())


def _cat_bias(*linears: torch.nn.Linear) -> torch.Tensor | None:
    biases = [m.bias for m in linears]
    if len(linears) == 1 or all(b is None for b in biases):
        return biases[0]
    return torch.cat([b if b is not None else torch.zeros(m.out_features, dtype=m.weight.dtype,
                                                          device=m.weight.device) for b, m in zip(biases, linears)])


def lean_layer(layer, rows: int, copies: bool, gemm: str | None = "auto") -> LeanLayer:
    """The layer's weights as the lean step uses them (built per generate call: the policy changes between them)."""
    a, m = layer.self_attn, layer.mlp
    return LeanLayer(layer.input_layernorm.weight, PackedLinear([a.q_proj, a.k_proj, a.v_proj], rows, copies, gemm),
                      PackedLinear([a.o_proj], rows, copies, gemm), layer.post_attention_layernorm.weight,
                      PackedLinear([m.gate_proj, m.up_proj], rows, copies, gemm),
                      PackedLinear([m.down_proj], rows, copies, gemm))


def lean_decode_supported(model: PreTrainedModel) -> bool:
    """True when `model` is a plain Qwen2/Llama decoder that `LeanDecoder` computes exactly."""
    if type(model).__name__ not in _LEAN_ARCHITECTURES:
        return False
    cfg, core = model.config, getattr(model, "model", None)
    rotary = getattr(core, "rotary_emb", None)
    if rotary is None or getattr(rotary, "rope_type", None) not in STATIC_ROPE or cfg.hidden_act != "silu":
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen2/Llama RMSNorm: statistics in fp32, the weight applied in the input dtype."""
    if x.dtype == weight.dtype == torch.float32:
        return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)  # fewer ops; the same numbers in fp32
    # HF's normalisation as torch's rms_norm without a weight, which computes a bf16/fp16 input in fp32 and rounds
    # once to the input dtype (the same ops on a CPU, bit for bit; one kernel instead of seven on CUDA, where a
    # replayed decode step is bound by its kernel count), then the weight applied in the input dtype, as HF does
    return weight * torch.nn.functional.rms_norm(x, weight.shape, None, eps)


class LeanDecoder:
    """Decode steps computed straight from the model's weights, without the per-layer Python of transformers.

    Per step and layer: one fused QKV matmul, rotary from a table, K/V written in place into a cache that starts
    at the prompt and `FIRST_ROOM` positions a row and doubles as the rows write past it (never past the budget: a
    budget the rows do not reach costs nothing), one SDPA call with the query heads of a KV group folded into the
    query axis (GQA without copying K/V), the output projection, and one fused gate/up matmul (a small model's; see
    `PackedLinear`). The padding mask is built with the cache and sliced.
    """

    def __init__(self, model: PreTrainedModel, cache: DynamicCache, mask: torch.Tensor, next_pos: torch.Tensor,
                 max_new: int, gemm: str = "auto"):
        core, cfg = model.model, model.config
        B, P = mask.shape
        attn = core.layers[0].self_attn
        self.n_kv, self.head_dim, self.scale = cfg.num_key_value_heads, attn.head_dim, attn.scaling
        self.n_q = cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.embed, self.norm = core.embed_tokens.weight, core.norm.weight
        copies = sum(p.numel() * p.element_size() for p in model.parameters()) <= COPY_MAX_BYTES
        self.head = PackedLinear([model.lm_head], B, copies, gemm)
        self.layers = [lean_layer(layer, B, copies, gemm) for layer in core.layers]
        self.k = [layer.keys for layer in cache.layers]  # [B, Hkv, P, D] each: the prompt's, copied at `_reach`
        self.v = [layer.values for layer in cache.layers]
        self.mask, self.next_pos, self.max_new, self.rotary = mask, next_pos, max_new, core.rotary_emb
        self.prompt_len, self.t, self.room = P, P, 0  # self.t: cache slot of the next token
        self._reach(min(max_new, FIRST_ROOM))

    def _reach(self, room: int) -> None:
        """Room for `room` completion positions a row: K/V [B, Hkv, P + room, D] a layer (the written part copied
        over), the padding bias and the rotary rows of those positions. Called as rows write past the room
        (doubling, never past `max_new`), so the cache follows what the rows write, not the budget."""
        B, T = self.mask.size(0), self.prompt_len + room
        for kv in (self.k, self.v):
            for i, old in enumerate(kv):
                buf = old.new_empty(B, self.n_kv, T, self.head_dim)
                buf[:, :, : self.t] = old[:, :, : self.t]
                kv[i] = buf
        # every completion slot is attended to, left padding never; additive, which SDPA on CPU runs faster than bool
        keep = torch.cat([self.mask.bool(), self.mask.new_ones(B, room, dtype=torch.bool)], 1)  # [B, P+room]
        dtype = self.embed.dtype
        self.bias = torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(
            ~keep, torch.finfo(dtype).min)[:, None, None]  # [B, 1, 1, P+room]
        positions = self.next_pos[:, None] + torch.arange(room, device=keep.device)  # [B, room]
        table = torch.arange(int(positions.max()) + 1, device=keep.device)[None]  # [1, T]
        cos, sin = self.rotary(self.embed[:1], position_ids=table)  # [1, T, D] each, HF's own numbers
        half = self.head_dim // 2
        # rotate_half(x) * sin == flip_halves(x) * sin_signed: the halves swapped and the first half negated
        sin = torch.cat([-sin[..., :half], sin[..., half:]], -1)
        self.cos, self.sin = cos[0][positions], sin[0][positions]  # [B, room, D]
        self.room = room

    @classmethod
    def build(cls, model: PreTrainedModel, cache: DynamicCache, mask: torch.Tensor, next_pos: torch.Tensor,
              max_new: int, gemm: str = "auto") -> "LeanDecoder | None":
        layers = getattr(cache, "layers", None)
        if not lean_decode_supported(model) or not layers or not all(hasattr(x, "keys") for x in layers):
            return None
        return cls(model, cache, mask, next_pos, max_new, gemm)

    def __call__(self, tok: torch.Tensor) -> torch.Tensor:
        B, t, D, Hkv, Hq = tok.size(0), self.t, self.head_dim, self.n_kv, self.n_q
        if t - self.prompt_len == self.room:  # the rows write past the cache: double it
            self._reach(min(self.max_new, 2 * self.room))
        cos, sin = self.cos[:, t - self.prompt_len, None], self.sin[:, t - self.prompt_len, None]  # [B, 1, D]
        bias = self.bias[..., : t + 1]  # [B, 1, 1, t+1]
        x = torch.nn.functional.embedding(tok, self.embed)  # [B, H]
        for i, w in enumerate(self.layers):
            h = rms_norm(x, w.ln1, self.eps)  # [B, H]
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
            h = rms_norm(x, w.ln2, self.eps)
            gate, up = w.gate_up(h).chunk(2, -1)  # [B, I] each
            x = x + w.down(torch.nn.functional.silu(gate) * up)
        self.t = t + 1
        return self.head(rms_norm(x, self.norm, self.eps))  # [B, V]
