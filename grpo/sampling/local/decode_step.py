"""The sampler's decode step: S slots over a paged KV cache, each at its own point, one step for them all.

For Llama-family decoders (Qwen2, Qwen3, Llama, Mistral: RMSNorm, rotary, grouped-query attention, SwiGLU MLP).
The slots' fields (`SlotState`) are allocated once per shape (S slots, prompt bucket P, budget C): per slot its token
count, its prompt's next position, its row's random stream, limit and done flag, its chosen tokens and their
log-probs; the keys and values live in pages (`pages.PagedState`). A step (`_decode` then `_choose`):

- reads the weights straight from the model (`cpu_decoder`'s fused and packed linears);
- feeds each slot's last token, writes its K/V at the slot's own position in its pages (the slots are at different
  points), attends over what its state says it reads (`attention(kv_len)`: each slot its own positions), then
  samples inside the step: temperature, top-k and top-p, and the inverse CDF at the slot's draw for that token
  (`draws.uniform_at`: its row's stream and the token's count), so the random state, the counters and the done flags
  all live on the device and a slot's tokens depend on its own row alone;
- runs over the first m slots (`SlotState.rows(m)`, views of the same storage), so the scheduler (`slots.SlotBatch`),
  which keeps live slots at the front, computes no ended row eagerly; on CUDA the step is captured as a
  `torch.cuda.CUDAGraph` for each of `row_buckets(S)` and replayed, and a slot that ended between the host's checks
  writes a dump column and stays as it was. A captured step is made again when the page pools grow (they move):
  `Capture.run` sees the pools' version change and captures anew, keeping the slots' fields as they were.

Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch
from transformers import PreTrainedModel

from grpo.configs.sampling import SamplingConfig
from grpo.sampling.draws import uniform_at
from grpo.sampling.local.cpu_decoder import COPY_MAX_BYTES, LeanLayer, PackedLinear, lean_layer, rms_norm

F = torch.nn.functional

FIRST_COLUMNS = 32  # an eager state's chosen-token columns to start with (they grow with the rows: `reach`)
# entries per block of `inverse_cdf`: ~150 blocks and one block's cumsum for Qwen's 151,936, not a cumsum of them all
CDF_BLOCK = 1024


def decoder(model: torch.nn.Module) -> PreTrainedModel:
    """The transformers model the step reads: inside a peft LoRA model, its base model (the adapters injected into
    its projections, which `PackedLinear` computes); any other model is itself."""
    return model.get_base_model() if type(model).__module__.startswith("peft.") else model


def choose_tokens(logits: torch.Tensor, u: torch.Tensor | None, s: SamplingConfig,
                  want_logprobs: bool = True, scratch: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The token of each row picked by the inverse CDF at its uniform `u`, and its log-prob when asked.

    logits [B, V], u [B] in [0, 1) (unread, and may be None, at temperature 0). Greedy at temperature 0; otherwise temperature, then top-k, then top-p (the
    smallest prefix whose mass reaches top_p), as `backend._pick`, then `inverse_cdf`. scratch: the caller reads
    `logits` no more, so the temperature divides them in place and, with no cut-off and no log-prob asked,
    exp(logits - max) is taken in their memory: no other [B, V] tensor a step (at a 151,936-entry vocabulary, two
    19 MB tensors a step at 32 rows made and freed made glibc take ~10,000 page faults a step).

    The log-prob is the chosen token's under the tempered full distribution, log softmax(logits / temperature),
    before top-k/top-p (at temperature 0 the plain log softmax(logits), the argmax's): the number the trainer
    computes for the token (`grpo.training.logprobs.token_logps` at the sampling temperature), whose policy is that
    distribution. Not the log-prob under the truncated, renormalised distribution the token was drawn from: that is
    the tempered one less log(kept mass), so pi_train / pi_sampler would be the kept mass (< 1) on every token,
    and a truncated-importance-sampling or decoupled-PPO behaviour weight built on it biased even where no weight
    changed (TRL issue #7120). The log-sum-exp is taken of the tempered logits before the cut-offs; the chosen
    token's logit is one the cut-offs keep: no second full-vocabulary tensor. No host sync: it runs inside a
    captured step.
    """
    logits = raw = logits.float()  # [B, V]
    lse = None
    if s.temperature == 0:
        tok = logits.argmax(-1)  # [B]
        if want_logprobs:
            lse = logits.logsumexp(-1)  # [B]
    else:
        if s.temperature != 1.0:
            logits = raw = logits.div_(s.temperature) if scratch else logits / s.temperature
        if want_logprobs:
            lse = logits.logsumexp(-1)  # [B] the tempered full distribution's, before top-k/top-p
        if s.top_k:
            kth = torch.topk(logits, min(s.top_k, logits.size(-1)), dim=-1).values[:, -1:]  # [B, 1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if s.top_p < 1.0:
            sorted_logits, order = logits.sort(-1, descending=True)  # [B, V] each
            p = sorted_logits.softmax(-1)
            drop = p.cumsum(-1) - p > s.top_p
            logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
        if scratch and not want_logprobs and logits is raw:  # no cut-off and no log-prob: the logits' own memory
            probs = logits.sub_(logits.amax(-1, keepdim=True)).exp_()  # [B, V] unnormalised, as inverse_cdf takes
        else:
            probs = logits.softmax(-1)  # [B, V]
        tok = inverse_cdf(probs, u)  # [B]
    if not want_logprobs:
        return tok, None
    # the chosen token survived the cut-offs, so its entry is still its tempered logit
    return tok, logits.gather(-1, tok[:, None]).squeeze(-1) - lse  # [B], [B]


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


class Weights(NamedTuple):
    """The decoder's weights as the step reads them (references to the model's, or fused/packed copies)."""

    embed: torch.Tensor  # [V, H]
    norm: torch.Tensor  # [H] final RMSNorm
    head: PackedLinear  # [H] -> [V]
    layers: list[LeanLayer]
    qk_norms: list[tuple[torch.Tensor, torch.Tensor] | None]  # Qwen3's per-head q/k RMSNorm weights, [D] each


def read_weights(model: PreTrainedModel, rows: int, pack: bool = True, gemm: str = "auto") -> Weights:
    """The step's weights; pack=False leaves out the packed copies, which cannot be refreshed in place. gemm: the
    loop's `fp32_gemm`, which library packs (`cpu_decoder.PackedLinear`)."""
    model = decoder(model)
    core = model.model
    copies = sum(p.numel() * p.element_size() for p in model.parameters()) <= COPY_MAX_BYTES
    norms = [(layer.self_attn.q_norm.weight, layer.self_attn.k_norm.weight)
             if hasattr(layer.self_attn, "q_norm") else None for layer in core.layers]
    gemm = gemm if pack else None
    return Weights(core.embed_tokens.weight, core.norm.weight, PackedLinear([model.lm_head], rows, copies, gemm),
                   [lean_layer(layer, rows, copies, gemm) for layer in core.layers], norms)


def weight_tensors(w: Weights) -> list[torch.Tensor]:
    """Every tensor the step reads, in a fixed order (to refresh a captured step's copies in place)."""
    out = [w.embed, w.norm]
    for lin in [w.head] + [x for layer in w.layers for x in (layer.qkv, layer.o, layer.gate_up, layer.down)]:
        out += [t for pair in lin.parts for t in pair if t is not None] if lin.parts else \
            [t for t in (lin.weight, lin.bias) if t is not None]
        out += [t for t in (lin.lora_a, lin.lora_b) if t is not None]
    out += [t for layer in w.layers for t in (layer.ln1, layer.ln2)]
    out += [t for pair in w.qk_norms if pair for t in pair]
    return out


class SlotState:
    """The slots' own fields, which every decode step reads and writes, allocated once per shape (S slots, prompt
    bucket P, budget C): each slot holds one sample at its own point: `n` tokens chosen, its prompt's positions, its
    stream, its limit, its chosen tokens and their log-probs. Slots are kept packed at the front (`rows(m)` is the
    first m of every tensor, views of the same storage), so a step over the live slots is a step over a prefix.

    Where `grow` (an eager step), the fields a budget would size, the chosen tokens and log-probs ([S, columns]) and
    the rotary table ([positions, D]), start small and grow with the rows (`reach`, doubling, never past P + C):
    a budget the rows do not reach costs nothing. A captured step reads them at fixed addresses: there they are
    allocated at the budget's size ([S, C + 1], [P + C, D]).

    The keys and values are the subclass's (`pages.PagedState`): it answers `place`, `release`, `kv_len`,
    `kv_bytes` and `attention` for `slots.SlotBatch` and the step."""

    def __init__(self, model: PreTrainedModel, S: int, P: int, C: int, dtype: torch.dtype, device: torch.device,
                 grow: bool = False):
        self._slot_fields(model, S, P, C, dtype, device, grow)

    def _slot_fields(self, model: PreTrainedModel, S: int, P: int, C: int, dtype: torch.dtype,
                     device: torch.device, grow: bool = False) -> None:
        model = decoder(model)
        cfg, attn = model.config, model.model.layers[0].self_attn
        T = P + C
        self.n_kv, self.head_dim, self.scale = cfg.num_key_value_heads, attn.head_dim, attn.scaling
        self.n_layers, self.dtype, self.device = len(model.model.layers), dtype, device
        self.next_pos = torch.zeros(S, dtype=torch.long, device=device)  # [S] position of the first new token
        self.streams = torch.zeros(S, dtype=torch.long, device=device)  # [S] the slot's row's random stream
        self.n = torch.zeros(S, dtype=torch.long, device=device)  # [S] tokens chosen so far, per slot
        self.limit = torch.full((S,), C, dtype=torch.long, device=device)  # [S] the slot's row's budget (<= C)
        self.tok = torch.zeros(S, dtype=torch.long, device=device)  # [S] the last chosen token
        self.done = torch.ones(S, dtype=torch.bool, device=device)  # [S] ended (an end token), or the slot is free
        # the last column of these is a dump: a finished slot that a step still computes writes there
        width = min(C, FIRST_COLUMNS) if grow else C
        self.ids = torch.zeros(S, width + 1, dtype=torch.long, device=device)  # [S, columns + 1]
        self.alive = torch.zeros(S, width + 1, dtype=torch.bool, device=device)  # [S, columns + 1]
        self.logprobs = torch.zeros(S, width + 1, dtype=torch.float32, device=device)  # [S, columns + 1]
        self._rotary = model.model.rotary_emb, model.model.embed_tokens.weight[:1].to(dtype)
        self.S, self.P, self.C, self.T = S, P, C, T
        self._views: dict[int, SlotState] = {}
        self._rotary_table(min(T, P + FIRST_COLUMNS) if grow else T)

    def _rotary_table(self, T: int) -> None:
        """cos and sin [T, D] of positions 0 to T - 1, as HF's rotary computes them."""
        rotary, embed = self._rotary
        cos, sin = rotary(embed, position_ids=torch.arange(T, device=self.device)[None])  # [1, T, D] each
        half = self.head_dim // 2
        # rotate_half(x) * sin == flip_halves(x) * sin_signed: the halves swapped and the first half negated
        self.cos, self.sin = cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], -1)  # [T, D] each

    def reach(self, tokens: int, positions: int) -> None:
        """Room for `tokens` chosen tokens a slot and rotary positions below `positions` (both doubling as they grow,
        up to the budget's C and P + C): the next steps' rows."""
        grown = False
        columns = self.ids.size(1) - 1
        if tokens > columns:
            new = min(self.C, max(tokens, 2 * columns))
            for name in ("ids", "alive", "logprobs"):
                old = getattr(self, name)
                wider = old.new_zeros(old.size(0), new + 1)
                wider[:, :columns] = old[:, :columns]  # (the old dump column is not carried)
                setattr(self, name, wider)
            grown = True
        if positions > self.cos.size(0):
            self._rotary_table(min(self.T, max(positions, 2 * self.cos.size(0))))
            grown = True
        if grown:  # the views hold the old tensors
            self._views.clear()

    _PER_SLOT = ("next_pos", "streams", "n", "limit", "tok", "done", "ids", "alive", "logprobs")

    def rows(self, m: int) -> "SlotState":
        """The first m slots: the same object's tensors cut to their first m rows (views, so steps write through)."""
        if m == self.S:
            return self
        if m not in self._views:
            view = copy.copy(self)
            for name in self._PER_SLOT:
                setattr(view, name, getattr(self, name)[:m])
            view.S, view._views = m, {}
            self._views[m] = view
        return self._views[m]


def row_buckets(S: int) -> list[int]:
    """The row counts a captured step is made for: S, then halves down to 8 (or S itself when smaller). Once no
    sample waits, slots empty and a call runs the smallest bucket that holds its live slots, so at most half of a
    replayed step's rows (and never fewer than 8) can be finished ones."""
    out = [S]
    while out[-1] > 8 and out[-1] % 2 == 0:
        out.append(out[-1] // 2)
    return out


class Capture:
    """One shape's state and its decode step over the first m slots; on CUDA, the step captured as a graph for each
    of `row_buckets(S)` (views of one state: the graphs share its memory)."""

    def __init__(self, state: SlotState, step, graph: bool):
        self.state, self.step, self.graphs, self.version = state, step, {}, None
        if not graph:
            return
        self._capture()
        state.done.fill_(True)
        state.n.zero_()

    def _pools_version(self) -> int | None:
        pools = getattr(self.state, "pools", None)
        return None if pools is None else pools.version

    def _capture(self) -> None:
        """A graph for each of `row_buckets(S)`, over the state's tensors as they are now (the pools' addresses
        included). The warm-up and capture steps write the per-slot fields: the caller resets or restores them."""
        st = self.state
        self.version = self._pools_version()
        for m in row_buckets(st.S):  # all up front: a warm-up writes the state
            view = st.rows(m)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the capture: lazy inits and autotuning happen here
                for _ in range(2):
                    st.n.fill_(1)  # warm-up steps write slot P and read uniform 1: inside the buffers
                    self.step(view, st.T)
            torch.cuda.current_stream().wait_stream(side)
            self.graphs[m] = torch.cuda.CUDAGraph()
            st.n.fill_(1)
            with torch.cuda.graph(self.graphs[m]):
                self.step(view, st.T)

    def _recapture(self) -> None:
        """The graphs again after the page pools grew (they moved), mid-call: every per-slot field kept as it was,
        and the block tables emptied while the warm-up steps write, so they write into the null page alone."""
        st = self.state
        kept = {name: getattr(st, name).clone() for name in st._PER_SLOT}
        st.table.zero_()
        self.graphs = {}
        self._capture()
        for name, value in kept.items():
            getattr(st, name).copy_(value)

    def rows_run(self, m: int) -> int:
        """How many slots a step over the first m live ones computes: m eagerly, its bucket when replayed."""
        return m if not self.graphs else min(b for b in self.graphs if b >= m)

    def run(self, m: int, kv_len: int) -> None:
        """One decode step over the first m slots: replayed when captured (its bucket's graph, over the whole cache),
        else run eagerly over kv_len cache slots."""
        if not self.graphs:
            self.step(self.state.rows(m), kv_len)
            return
        if self._pools_version() != self.version:  # the pools grew since the capture
            self._recapture()
        self.graphs[self.rows_run(m)].replay()


def _choose(st: SlotState, logits: torch.Tensor, s: SamplingConfig, eos: torch.Tensor, pad_id: int,
            want_logprobs: bool) -> None:
    """Choose token number st.n[i] of every slot i from `logits` [S, V], each slot at its own count; a slot that
    has ended (an end token, the budget, or free) gets the pad id, written to the dump column, and stays as it is."""
    dump = st.ids.size(1) - 1
    ended = st.done | (st.n >= st.limit)  # [S]
    # [S] each slot's draw for its token; greedy reads none (24 us of a 2 ms CPU step at one row)
    u = uniform_at(st.streams, st.n) if s.temperature > 0 else None
    tok, lp = choose_tokens(logits, u, s, want_logprobs, scratch=True)  # [S], [S] (the step's logits, read once)
    tok = tok.masked_fill(ended, pad_id)
    col = st.n.masked_fill(ended, dump)[:, None]  # [S, 1]
    st.ids.scatter_(1, col, tok[:, None])
    st.alive.scatter_(1, col, ~ended[:, None])
    if lp is not None:
        st.logprobs.scatter_(1, col, lp.masked_fill(ended, 0.0)[:, None])
    st.done |= ~ended & (tok[:, None] == eos[None]).any(-1)
    st.tok.copy_(tok)
    st.n.add_((~ended).long())


def step_slots(st: SlotState, w: Weights, cfg, s: SamplingConfig, eos: torch.Tensor, pad_id: int, want_logprobs: bool,
          kv_len: int) -> None:
    """Feed each slot's last chosen token, then choose its next: fixed shapes when kv_len is the cache's length."""
    _choose(st, _decode(st, w, cfg, kv_len), s, eos, pad_id, want_logprobs)


def _decode(st, w: Weights, cfg, kv_len: int) -> torch.Tensor:
    """The logits [S, V] after each slot's last chosen token, whose keys and values go into the slot's pages
    (`pages.PagedState`), attending over what `st.attention` says it reads."""
    S, D, Hkv, Hq, eps = st.tok.size(0), st.head_dim, st.n_kv, cfg.num_attention_heads, cfg.rms_norm_eps
    pos = (st.next_pos + (st.n - 1)).clamp(min=0)  # [S] (a free slot's count may be 0)
    cos, sin = st.cos.index_select(0, pos)[:, None], st.sin.index_select(0, pos)[:, None]  # [S, 1, D]
    kv = st.attention(kv_len)
    x = F.embedding(st.tok, w.embed)  # [S, H]
    for i, (layer, qk_norm) in enumerate(zip(w.layers, w.qk_norms)):
        h = rms_norm(x, layer.ln1, eps)  # [S, H]
        qkv = layer.qkv(h)  # [S, (Hq+2Hkv) D]
        qk = qkv[:, : (Hq + Hkv) * D].view(S, Hq + Hkv, D)  # rotary goes on q and k together
        if qk_norm is not None:  # Qwen3 normalises each head before the rotary
            qk = torch.cat([rms_norm(qk[:, :Hq], qk_norm[0], eps), rms_norm(qk[:, Hq:], qk_norm[1], eps)], 1)
        qk = qk * cos + qk.view(S, Hq + Hkv, 2, D // 2).flip(2).view(S, Hq + Hkv, D) * sin
        kv.write(i, qk[:, Hq:], qkv[:, (Hq + Hkv) * D :].view(S, Hkv, D))  # [S, Hkv, D] each
        q = qk[:, :Hq].reshape(S, Hkv, Hq // Hkv, D)  # query head h reads KV head h // (Hq/Hkv)
        o = kv.attend(i, q)  # [S, Hkv, Hq/Hkv, D]
        x = x + layer.o(o.reshape(S, Hq * D))
        h = rms_norm(x, layer.ln2, eps)
        gate, up = layer.gate_up(h).chunk(2, -1)  # [S, I] each
        x = x + layer.down(F.silu(gate) * up)
    return w.head(rms_norm(x, w.norm, eps))  # [S, V]


def distinct_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For a [B, W] tensor: (inverse [B], first [U]) with rows[first][inverse] == rows and rows[first] distinct."""
    _, inverse = torch.unique(rows, dim=0, return_inverse=True)  # [B]
    n_unique = int(inverse.max()) + 1
    order = torch.arange(rows.size(0), device=rows.device)  # [B]
    first = torch.full((n_unique,), rows.size(0), device=rows.device).scatter_reduce(0, inverse, order, "amin")
    return inverse, first  # [B], [U]
