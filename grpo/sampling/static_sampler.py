"""The static-cache sampler: every decode step the same shapes, its state on the device, so a GPU can replay it.

For Llama-family decoders (Qwen2, Qwen3, Llama, Mistral: RMSNorm, rotary, grouped-query attention, SwiGLU MLP).
One call samples a batch of left-padded prompts:

- the prompts are left-padded further to a length bucket (`prompt_bucket`: a multiple of 32 up to 256, of 128
  beyond), so a handful of shapes cover every batch and a captured step is reused from call to call (where steps
  are captured; eager steps gain nothing from a bucket and skip it);
- the distinct prompts are prefilled once by the model's own forward (the G samples of a prompt share its prefill)
  and their keys and values copied into a KV cache allocated once for prompt + `max_new_tokens`, one
  [B, kv_heads, T, head_dim] tensor per layer and for keys and values;
- each decode step reads the weights straight from the model (`cpu_decoder`'s fused and packed linears), writes
  its K/V at a slot given by a device counter, attends over the whole cache under a validity mask (left padding
  and not-yet-written slots masked), then samples inside the step: temperature, top-k and top-p, and the
  inverse CDF at a uniform read from a table drawn up front (tests inject it), so the random state, the step
  counter and the done flags all live on the device;
- the host asks "has every row ended?" only every `check_every` steps on CUDA (each ask is a sync); on CPU asking
  costs nothing, so it asks every step and also attends over the written part of the cache only;
- on CUDA the step is captured once per shape as a `torch.cuda.CUDAGraph` and replayed; captures are kept for the
  next calls, and their weights are refreshed in place by `sync_weights`.

It samples in the model's own dtype or from a copy in another (bf16 where the recipe trains under bf16 autocast),
refreshed by `sync_weights(model)`, which the engine's `sync_weights` calls (a trainer: after each optimizer step).
A peft LoRA model samples the same way: the step reads its base weights and adds each adapter's (x A^T) B^T, the
adapters of a fused projection in one pair of small matmuls (`cpu_decoder._Linear`), so LoRA costs no merged copy of
the weights and stays on the captured path. A KV cache over `memory_budget` bytes is split: rows are sampled in
parts that fit. A model it does not compute exactly (DoRA, quantized projections, hooks) gets `unsupported_reason`
(a sentence) and the caller decodes another way. Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch
from transformers import DynamicCache, PreTrainedModel

from grpo.config import SamplingConfig
from grpo.models import cached
from grpo.sampling.cpu_decoder import (_COPY_MAX_BYTES, _STATIC_ROPE, _lean_layer, _LeanLayer, _Linear, _rms_norm,
                                       lora_reason)

F = torch.nn.functional

_ARCHITECTURES = {"Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM"}
_MAX_CAPTURES = 8  # shapes kept captured at once; each holds its KV cache, so a few, not one per batch ever seen
# entries per block of `inverse_cdf`: ~150 blocks and one block's cumsum for Qwen's 151,936, not a cumsum of them all
CDF_BLOCK = 1024


def prompt_bucket(length: int) -> int:
    """The padded prompt length for a prompt of `length` tokens: a multiple of 32 up to 256, of 128 beyond.

    Fine steps where prompts are short (a few wasted prefill tokens cost little), coarse ones where they are long,
    so a run's prompts fall into a few buckets and each bucket's captured step is reused.
    """
    step = 32 if length <= 256 else 128
    return max(step, -(-length // step) * step)


def decoder(model: torch.nn.Module) -> PreTrainedModel:
    """The transformers model the step reads: inside a peft LoRA model, its base model (the adapters injected into
    its projections, which `_Linear` computes); any other model is itself."""
    return model.get_base_model() if type(model).__module__.startswith("peft.") else model


def unsupported_reason(model: PreTrainedModel, total_len: int = 0) -> str | None:
    """None when the static step computes `model` exactly (for sequences of `total_len` tokens); else why not."""
    model = decoder(model)
    name = type(model).__name__
    if name not in _ARCHITECTURES:
        return f"{name} is not a decoder the static sampler computes (it knows {sorted(_ARCHITECTURES)})"
    cfg, core = model.config, getattr(model, "model", None)
    rotary = getattr(core, "rotary_emb", None)
    if rotary is None or getattr(rotary, "rope_type", None) not in _STATIC_ROPE:
        return f"rope type {getattr(rotary, 'rope_type', None)!r} depends on more than the position"
    if cfg.hidden_act != "silu":
        return f"hidden_act {cfg.hidden_act!r} is not SwiGLU's silu"
    window = getattr(cfg, "sliding_window", None) if name == "MistralForCausalLM" else None
    if getattr(cfg, "use_sliding_window", False) or any(
            t != "full_attention" for t in getattr(cfg, "layer_types", None) or []):
        window = getattr(cfg, "sliding_window", None) or 0
    if window is not None and total_len > window:  # the step attends to the whole cache
        return f"a sliding attention window of {window} tokens, shorter than the {total_len} sampled"
    if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
        return "the model has forward hooks (a logit mask, an adapter) that reading its weights would skip"
    if type(core.embed_tokens) is not torch.nn.Embedding:
        return f"the embedding is a {type(core.embed_tokens).__name__}, not a plain nn.Embedding"
    for layer in core.layers:
        a, m = layer.self_attn, layer.mlp
        for x in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj, model.lm_head):
            reason = lora_reason(x)
            if reason is not None:
                return reason
    return None


def choose_tokens(logits: torch.Tensor, u: torch.Tensor, s: SamplingConfig,
                  want_logprobs: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The token of each row picked by the inverse CDF at its uniform `u`, and its log-prob when asked.

    logits [B, V], u [B] in [0, 1). Greedy at temperature 0; otherwise temperature, then top-k, then top-p (the
    smallest prefix whose mass reaches top_p), as `backend._pick`, then `inverse_cdf`. The log-prob is the logit
    less the log-sum-exp: no second full-vocabulary tensor. No host sync: it runs inside a captured step.
    """
    logits = logits.float()  # [B, V]
    if s.temperature == 0:
        tok = logits.argmax(-1)  # [B]
    else:
        if s.temperature != 1.0:
            logits = logits / s.temperature
        if s.top_k:
            kth = torch.topk(logits, min(s.top_k, logits.size(-1)), dim=-1).values[:, -1:]  # [B, 1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if s.top_p < 1.0:
            sorted_logits, order = logits.sort(-1, descending=True)  # [B, V] each
            p = sorted_logits.softmax(-1)
            drop = p.cumsum(-1) - p > s.top_p
            logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
        tok = inverse_cdf(logits.softmax(-1), u)  # [B]
    if not want_logprobs:
        return tok, None
    return tok, logits.gather(-1, tok[:, None]).squeeze(-1) - logits.logsumexp(-1)  # [B], [B]


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor, block: int = CDF_BLOCK) -> torch.Tensor:
    """The first index of each row whose cumulative probability reaches (1 - u) of the row's total: [B].

    probs [B, V] (need not sum to 1), u [B] in [0, 1). The target lies in (0, total], so that index exists and
    never has zero probability (top-k/top-p cut-offs). Two levels instead of a float64 cumsum over the whole
    vocabulary each step: the sums of blocks of `block` entries (float32 sums of a block's own entries, so a tail
    of tiny probabilities keeps its mass), their float64 cumsum, the block that holds the target, then the float64
    cumsum inside that block only. Fixed shapes, no host sync.
    """
    B, V = probs.shape
    block = min(block, V)
    full = V // block * block
    sums = probs[:, :full].view(B, -1, block).sum(-1)  # [B, V // block]
    if full < V:
        sums = torch.cat([sums, probs[:, full:].sum(-1, keepdim=True)], 1)  # [B, nb] the last block is short
    ends = sums.double().cumsum(-1)  # [B, nb] the CDF at each block's end
    target = (1 - u.double())[:, None] * ends[:, -1:]  # [B, 1]
    b = torch.searchsorted(ends, target).clamp(max=ends.size(1) - 1)  # [B, 1] the block holding the target
    start = ends.gather(1, (b - 1).clamp(min=0)).masked_fill(b == 0, 0.0)  # [B, 1] the CDF before it
    offsets = torch.arange(block, device=probs.device)  # [block]
    idx = b * block + offsets  # [B, block]
    inside = probs.gather(1, idx.clamp(max=V - 1)).masked_fill(idx >= V, 0.0)  # [B, block]
    cdf = inside.double().cumsum(-1)  # [B, block] from the block's start: no mass lost to the total before it
    rest = target - start  # [B, 1] > 0
    # the block's sum and its cumsum may round apart: a target past the cumsum's end takes its last increase
    at = torch.searchsorted(cdf, torch.minimum(rest, cdf[:, -1:]))  # [B, 1]
    return (b * block + at).squeeze(-1)  # [B]


class _Weights(NamedTuple):
    """The decoder's weights as the step reads them (references to the model's, or fused/packed copies)."""

    embed: torch.Tensor  # [V, H]
    norm: torch.Tensor  # [H] final RMSNorm
    head: _Linear  # [H] -> [V]
    layers: list[_LeanLayer]
    qk_norms: list[tuple[torch.Tensor, torch.Tensor] | None]  # Qwen3's per-head q/k RMSNorm weights, [D] each


def _read_weights(model: PreTrainedModel, rows: int, pack: bool = True) -> _Weights:
    """The step's weights; pack=False leaves out MKL's packed copies, which cannot be refreshed in place."""
    model = decoder(model)
    core = model.model
    copies = sum(p.numel() * p.element_size() for p in model.parameters()) <= _COPY_MAX_BYTES
    norms = [(layer.self_attn.q_norm.weight, layer.self_attn.k_norm.weight)
             if hasattr(layer.self_attn, "q_norm") else None for layer in core.layers]
    w = _Weights(core.embed_tokens.weight, core.norm.weight, _Linear([model.lm_head], rows, copies),
                 [_lean_layer(layer, rows, copies) for layer in core.layers], norms)
    if not pack:
        for lin in [w.head] + [x for layer in w.layers for x in (layer.qkv, layer.o, layer.gate_up, layer.down)]:
            lin.packed = None
    return w


def _weight_tensors(w: _Weights) -> list[torch.Tensor]:
    """Every tensor the step reads, in a fixed order (to refresh a captured step's copies in place)."""
    out = [w.embed, w.norm]
    for lin in [w.head] + [x for layer in w.layers for x in (layer.qkv, layer.o, layer.gate_up, layer.down)]:
        out += [t for pair in lin.parts for t in pair if t is not None] if lin.parts else \
            [t for t in (lin.weight, lin.bias) if t is not None]
        out += [t for t in (lin.lora_a, lin.lora_b) if t is not None]
    out += [t for layer in w.layers for t in (layer.ln1, layer.ln2)]
    out += [t for pair in w.qk_norms if pair for t in pair]
    return out


class _State:
    """Everything one decode step reads and writes, allocated once per shape (B rows, prompt bucket P, budget C)."""

    def __init__(self, model: PreTrainedModel, B: int, P: int, C: int, dtype: torch.dtype, device: torch.device):
        model = decoder(model)
        cfg, attn = model.config, model.model.layers[0].self_attn
        T = P + C
        self.n_kv, self.head_dim, self.scale = cfg.num_key_value_heads, attn.head_dim, attn.scaling
        self.k = [torch.zeros(B, self.n_kv, T, self.head_dim, dtype=dtype, device=device)
                  for _ in model.model.layers]  # [B, Hkv, T, D] each
        self.v = [torch.zeros_like(k) for k in self.k]
        self.bias = torch.zeros(B, 1, 1, T, dtype=dtype, device=device)  # 0 where a key may be read, min elsewhere
        self.next_pos = torch.zeros(B, dtype=torch.long, device=device)  # [B] position of the first new token
        self.uniforms = torch.zeros(B, C, dtype=torch.float64, device=device)  # [B, C] one per row and token
        self.n = torch.zeros((), dtype=torch.long, device=device)  # tokens chosen so far
        self.tok = torch.zeros(B, dtype=torch.long, device=device)  # [B] the last chosen token
        self.done = torch.zeros(B, dtype=torch.bool, device=device)  # [B]
        self.ids = torch.zeros(B, C, dtype=torch.long, device=device)  # [B, C]
        self.alive = torch.zeros(B, C, dtype=torch.bool, device=device)  # [B, C]
        self.logprobs = torch.zeros(B, C, dtype=torch.float32, device=device)  # [B, C]
        positions = torch.arange(T, device=device)[None]  # [1, T]: every position a row can reach is below T
        embed = model.model.embed_tokens.weight
        cos, sin = model.model.rotary_emb(embed[:1].to(dtype), position_ids=positions)  # [1, T, D] each, HF's
        half = self.head_dim // 2
        # rotate_half(x) * sin == flip_halves(x) * sin_signed: the halves swapped and the first half negated
        self.cos, self.sin = cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], -1)  # [T, D] each
        self.P, self.C, self.T = P, C, T


class _Capture:
    """One shape's state, its decode step and, on CUDA, the step captured as a graph."""

    def __init__(self, state: _State, step, graph: bool):
        self.state, self.step, self.graph = state, step, None
        if not graph:
            return
        st = state
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture: lazy inits and autotuning happen here
            for _ in range(2):
                st.n.fill_(1)  # warm-up steps write slot P and read uniform 1: inside the buffers
                step(st.T)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        st.n.fill_(1)
        with torch.cuda.graph(self.graph):
            step(st.T)

    def run(self, kv_len: int) -> None:
        """One decode step: replayed when captured (over the whole cache), else run eagerly over kv_len slots."""
        if self.graph is None:
            self.step(kv_len)
        else:
            self.graph.replay()


class Sampled(NamedTuple):
    """One batch's completions (on the CPU), as `backend.sample_batch` returns them."""

    completion_ids: torch.Tensor  # [B, C] right-padded with the pad id
    completion_mask: torch.Tensor  # [B, C] 1 up to and including the end token
    logprobs: torch.Tensor | None  # [B, C] the chosen tokens' log-probs (0 on padding); None unless asked
    truncated: torch.Tensor  # [B] True when the budget ran out before an end token


GPU_FREE_SHARE = 0.5  # of a GPU's free memory, the KV cache's budget where the recipe sets none (kv_cache_mb)


class StaticSampler:
    """Samples completions from one model with a static KV cache; see the module docstring.

    dtype: the weights it samples with (None: the model's own; another: a copy in that dtype, made on first use and
    refreshed by `sync_weights`). memory_budget: bytes the KV cache may take (None: `GPU_FREE_SHARE` of a GPU's free
    memory, no limit on a CPU); a batch whose cache would not fit is sampled in parts of as many rows as fit.
    check_every: decode steps between the host's checks that every row has ended (on CUDA; on CPU it checks every
    step, which costs nothing there). graphs: capture the step as a CUDA graph (None: on CUDA). keep_captures: keep
    each shape's state and step for the next calls, their weights refreshed in place by `sync_weights` (None: with
    graphs, which need it; eager, it lets a CPU test run what CUDA runs, but for the capture). full_cache_attention:
    attend over the whole cache every step (None: where the step is captured; eager steps attend over the slots
    written so far). buckets: pad prompts to `prompt_bucket` lengths (None: where the step is captured, since a
    bucket is what lets a capture serve the next call; eager steps gain nothing from it and would prefill the
    padding).
    """

    def __init__(self, model: PreTrainedModel, *, dtype: torch.dtype | None = None, memory_budget: int | None = None,
                 check_every: int = 16, graphs: bool | None = None, full_cache_attention: bool | None = None,
                 buckets: bool | None = None, keep_captures: bool | None = None):
        if check_every < 1:
            raise ValueError(f"check_every must be at least 1, got {check_every}")
        if memory_budget is not None and memory_budget <= 0:
            raise ValueError(f"memory_budget must be a positive number of bytes or None, got {memory_budget}")
        self.model, self._dtype = model, dtype
        self.dtype = dtype or next(model.parameters()).dtype
        self.memory_budget, self.check_every = memory_budget, check_every
        self.device = next(model.parameters()).device
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self.full_cache_attention = self.graphs if full_cache_attention is None else full_cache_attention
        self.buckets = self.graphs if buckets is None else buckets
        self.keep_captures = self.graphs if keep_captures is None else keep_captures
        self._copy: PreTrainedModel | None = None  # the model in self.dtype, when that is not its own
        self._weights: _Weights | None = None  # kept while captures read them (refreshed in place)
        self._captures: dict[tuple, _Capture] = {}
        self._seen = None  # the policy's parameters (addresses and versions) at the last sync

    def unsupported_reason(self, total_len: int = 0) -> str | None:
        return unsupported_reason(self.model, total_len)

    def sync_weights(self, model: PreTrainedModel | None = None) -> None:
        """Make the next sampling use `model`'s current weights (call it after each optimizer step)."""
        model = self.model if model is None else model
        seen = _fingerprint(model)
        if model is not self.model or self._seen is None or [a for a, _ in seen] != [a for a, _ in self._seen]:
            # another model, or parameters moved (cast, to another device): rebuild everything from it
            self.model, self._weights, self._captures = model, None, {}
            self.device, self._copy = next(model.parameters()).device, None
            self.dtype = self._dtype or next(model.parameters()).dtype  # None follows the model's own
        # inference mode: the kept weights were made in it (inside `sample`), and only it may update them in place
        with torch.inference_mode():
            if self._copy is not None:
                for dst, src in zip(self._copy.parameters(), model.parameters()):
                    dst.copy_(src)
            if self._weights is not None:  # the captured steps read these: new values at the same addresses
                fresh = _read_weights(self._sampling_model(), self._weights.head.rows, pack=False)
                olds, news = _weight_tensors(self._weights), _weight_tensors(fresh)
                if [t.shape for t in olds] != [t.shape for t in news]:  # adapters merged or turned off: new steps
                    self._weights, self._captures = None, {}
                else:
                    for old, new in zip(olds, news):
                        if old is not new:
                            old.copy_(new)
        self._seen = seen

    def _sampling_model(self) -> PreTrainedModel:
        if self.dtype == next(self.model.parameters()).dtype:
            return self.model
        if self._copy is None:
            with torch.inference_mode(False), torch.no_grad():
                # each parameter is made in the new dtype before the module is copied around them, so no copy in
                # the model's own dtype ever exists (a 7B fp32 model: +14 GB of bf16, not +28 GB then a cast);
                # parameters only: `.to(dtype)` would also round the rotary frequencies, whose error grows with
                # the position. A tied weight is one parameter, so it stays tied.
                made = {id(p): torch.nn.Parameter(p.detach().to(self.dtype, copy=True), requires_grad=False)
                        for p in self.model.parameters()}
                self._copy = copy.deepcopy(self.model, made).eval()
        return self._copy

    @torch.inference_mode()
    def sample(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, s: SamplingConfig, eos_ids: list[int],
               pad_id: int, *, return_logprobs: bool = True, uniforms: torch.Tensor | None = None) -> Sampled:
        """Sample `s.max_new_tokens` at most for each left-padded prompt row.

        uniforms: [B, max_new_tokens] in [0, 1), the draw of each row's each token (None: drawn here from torch's
        generator on the model's device); the same uniforms give the same tokens however the rows are split.
        """
        # a step since the last sync that bumped the parameters' versions: sync now (a fused optimizer's step does
        # not bump them, so whoever steps the model also calls sync_weights, as the trainers do)
        if self._seen != _fingerprint(self.model):
            self.sync_weights()
        B, C = prompt_ids.size(0), s.max_new_tokens
        longest = max(1, int(prompt_mask.sum(1).max()))
        P = prompt_bucket(longest) if self.buckets else longest
        ids, mask = prompt_ids[:, prompt_ids.size(1) - longest:], prompt_mask[:, prompt_mask.size(1) - longest:]
        ids = F.pad(ids.to(self.device), (P - longest, 0), value=pad_id)  # [B, P]
        mask = F.pad(mask.to(self.device), (P - longest, 0), value=0)  # [B, P]
        if uniforms is None and s.temperature == 0:  # greedy reads none: leave the generator as it is
            uniforms = torch.zeros(B, C, dtype=torch.float64, device=self.device)  # [B, C]
        elif uniforms is None:
            # column k is what the decode loop in `backend` draws at step k, so a seed samples the same tokens
            # (the generator ends up advanced by the whole budget, where that loop stops at the last row's end)
            uniforms = torch.rand(C, B, dtype=torch.float64, device=self.device).T  # [B, C]
        rows = self._rows_per_part(B, P + C)
        eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=self.device)  # [E]
        parts = [self._sample_part(ids[i : i + rows], mask[i : i + rows], uniforms[i : i + rows].to(self.device),
                                   s, eos, pad_id, return_logprobs) for i in range(0, B, rows)]
        width = max(p[0].size(1) for p in parts)

        def cat(i: int, value) -> torch.Tensor:
            return torch.cat([F.pad(p[i], (0, width - p[i].size(1)), value=value) for p in parts]).cpu()

        return Sampled(cat(0, pad_id), cat(1, 0).long(), cat(2, 0.0) if return_logprobs else None,
                       torch.cat([p[3] for p in parts]).cpu())

    def _rows_per_part(self, B: int, T: int) -> int:
        budget = self.memory_budget
        if budget is None and self.device.type == "cuda":
            # a share of what is free now (the trainer's activations are gone between steps; its weights, gradients
            # and optimizer state stay): the rest is left to the prefill, the logits and the allocator's slack
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(GPU_FREE_SHARE * (free + torch.cuda.memory_reserved(self.device)
                                           - torch.cuda.memory_allocated(self.device)))
        if budget is None:
            return B
        inner = decoder(self.model)
        cfg, attn = inner.config, inner.model.layers[0].self_attn
        per_row = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * T * attn.head_dim * self.dtype.itemsize
        if per_row > budget:
            raise ValueError(f"a KV cache budget of {budget} bytes holds no row's KV cache: one row of {T} tokens "
                             f"takes {per_row} bytes; raise generation.kv_cache_mb or shorten max_new_tokens")
        return min(B, budget // per_row)

    def _sample_part(self, ids: torch.Tensor, mask: torch.Tensor, uniforms: torch.Tensor, s: SamplingConfig,
                     eos: torch.Tensor, pad_id: int, want_logprobs: bool) -> tuple[torch.Tensor, ...]:
        model = decoder(self._sampling_model())  # inside a LoRA model its base, the adapters injected
        (B, P), C = ids.shape, s.max_new_tokens
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, P] positions that ignore left padding
        inverse, first = distinct_rows(torch.cat([ids, mask.to(ids.dtype)], 1))  # [B], [U]
        cache = DynamicCache()
        logits = model(input_ids=ids[first], attention_mask=mask[first], position_ids=pos[first],
                       **cached(cache), logits_to_keep=1).logits[:, -1]  # [U, V]
        cap = self._capture(model, B, P, s, eos, pad_id, want_logprobs)
        st = cap.state
        for i, layer in enumerate(cache.layers):  # [U, Hkv, P, D] -> the rows' prompt slots
            st.k[i][:, :, :P] = layer.keys[inverse]
            st.v[i][:, :, :P] = layer.values[inverse]
        # additive, which SDPA on CPU runs faster than a bool mask; completion slots open as they are written
        st.bias.fill_(torch.finfo(st.bias.dtype).min)
        st.bias[:, 0, 0, :P].masked_fill_(mask.bool(), 0.0)
        st.next_pos.copy_(pos[:, -1] + 1)
        st.uniforms.copy_(uniforms)
        for t in (st.n, st.done, st.alive, st.logprobs):
            t.zero_()
        st.ids.fill_(pad_id)
        _choose(st, logits[inverse], s, eos, pad_id, want_logprobs)  # the first token, from the prefill
        every = self.check_every if self.device.type == "cuda" else 1  # a check is a sync only on a device
        for k in range(1, C):  # k tokens chosen; the step feeds token k-1 and chooses token k
            if (k == 1 or k % every == 0) and bool(st.done.all()):
                break
            cap.run(st.T if self.full_cache_attention else P + k)
        used = int(st.alive.sum(1).max())  # columns past every row's end are dropped, as if decoding had stopped
        return st.ids[:, :used].clone(), st.alive[:, :used].clone(), st.logprobs[:, :used].clone(), ~st.done

    def _capture(self, model: PreTrainedModel, B: int, P: int, s: SamplingConfig, eos: torch.Tensor, pad_id: int,
                 want_logprobs: bool) -> _Capture:
        """The shape's state and step: made afresh each call, or (on CUDA) captured once and kept for the next."""
        C = s.max_new_tokens
        if not self.keep_captures:
            st = _State(model, B, P, C, self.dtype, self.device)
            w = _read_weights(model, B)
            return _Capture(st, lambda kv_len: _step(st, w, model.config, s, eos, pad_id, want_logprobs, kv_len),
                            graph=False)
        key = (B, P, C, s.temperature, s.top_k, s.top_p, tuple(eos.tolist()), pad_id, want_logprobs)
        if key not in self._captures:
            if self._weights is None:
                self._weights = _read_weights(model, B, pack=False)
            while len(self._captures) >= _MAX_CAPTURES:
                self._captures.pop(next(iter(self._captures)))  # the oldest shape first
            st, w, eos = _State(model, B, P, C, self.dtype, self.device), self._weights, eos.clone()
            self._captures[key] = _Capture(
                st, lambda kv_len: _step(st, w, model.config, s, eos, pad_id, want_logprobs, kv_len), self.graphs)
        return self._captures[key]


def _fingerprint(model: PreTrainedModel) -> list[tuple[int, int]]:
    """Each parameter's address and version: an in-place optimizer step bumps the version, a cast the address."""
    return [(p.data_ptr(), p._version) for p in model.parameters()]


def _choose(st: _State, logits: torch.Tensor, s: SamplingConfig, eos: torch.Tensor, pad_id: int,
            want_logprobs: bool) -> None:
    """Choose token number st.n of every row from `logits` [B, V]; rows that have ended get the pad id."""
    n = st.n.view(1)
    tok, lp = choose_tokens(logits, st.uniforms.index_select(1, n).squeeze(1), s, want_logprobs)  # [B], [B]
    ended = st.done.clone()  # [B]
    tok = tok.masked_fill(ended, pad_id)
    st.ids.index_copy_(1, n, tok[:, None])
    st.alive.index_copy_(1, n, ~ended[:, None])
    if lp is not None:
        st.logprobs.index_copy_(1, n, lp.masked_fill(ended, 0.0)[:, None])
    st.done |= (tok[:, None] == eos[None]).any(-1)
    st.tok.copy_(tok)
    st.n.add_(1)


def _step(st: _State, w: _Weights, cfg, s: SamplingConfig, eos: torch.Tensor, pad_id: int, want_logprobs: bool,
          kv_len: int) -> None:
    """Feed the last chosen token, then choose the next: fixed shapes when kv_len is the cache's length."""
    _choose(st, _decode(st, w, cfg, kv_len), s, eos, pad_id, want_logprobs)


def _decode(st: _State, w: _Weights, cfg, kv_len: int) -> torch.Tensor:
    """The logits [B, V] after the last chosen token, which goes into cache slot P + n - 1."""
    B, D, Hkv, Hq, eps = st.tok.size(0), st.head_dim, st.n_kv, cfg.num_attention_heads, cfg.rms_norm_eps
    slot = (st.n + (st.P - 1)).view(1)  # [1]
    pos = st.next_pos + (st.n - 1)  # [B]
    cos, sin = st.cos.index_select(0, pos)[:, None], st.sin.index_select(0, pos)[:, None]  # [B, 1, D]
    st.bias.index_fill_(-1, slot, 0.0)  # the new token's slot opens for every row
    bias = st.bias[..., :kv_len]  # [B, 1, 1, kv_len]
    x = F.embedding(st.tok, w.embed)  # [B, H]
    for i, (layer, qk_norm) in enumerate(zip(w.layers, w.qk_norms)):
        h = _rms_norm(x, layer.ln1, eps)  # [B, H]
        qkv = layer.qkv(h)  # [B, (Hq+2Hkv) D]
        qk = qkv[:, : (Hq + Hkv) * D].view(B, Hq + Hkv, D)  # rotary goes on q and k together
        if qk_norm is not None:  # Qwen3 normalises each head before the rotary
            qk = torch.cat([_rms_norm(qk[:, :Hq], qk_norm[0], eps), _rms_norm(qk[:, Hq:], qk_norm[1], eps)], 1)
        qk = qk * cos + qk.view(B, Hq + Hkv, 2, D // 2).flip(2).view(B, Hq + Hkv, D) * sin
        st.k[i].index_copy_(2, slot, qk[:, Hq:, None])  # [B, Hkv, 1, D] into [B, Hkv, T, D]
        st.v[i].index_copy_(2, slot, qkv[:, (Hq + Hkv) * D :].view(B, Hkv, 1, D))
        q = qk[:, :Hq].reshape(B, Hkv, Hq // Hkv, D)  # query head h reads KV head h // (Hq/Hkv)
        o = F.scaled_dot_product_attention(q, st.k[i][:, :, :kv_len], st.v[i][:, :, :kv_len], attn_mask=bias,
                                           scale=st.scale)  # [B, Hkv, Hq/Hkv, D]
        x = x + layer.o(o.reshape(B, Hq * D))
        h = _rms_norm(x, layer.ln2, eps)
        gate, up = layer.gate_up(h).chunk(2, -1)  # [B, I] each
        x = x + layer.down(F.silu(gate) * up)
    return w.head(_rms_norm(x, w.norm, eps))  # [B, V]


def distinct_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For a [B, W] tensor: (inverse [B], first [U]) with rows[first][inverse] == rows and rows[first] distinct."""
    _, inverse = torch.unique(rows, dim=0, return_inverse=True)  # [B]
    n_unique = int(inverse.max()) + 1
    order = torch.arange(rows.size(0), device=rows.device)  # [B]
    first = torch.full((n_unique,), rows.size(0), device=rows.device).scatter_reduce(0, inverse, order, "amin")
    return inverse, first  # [B], [U]
