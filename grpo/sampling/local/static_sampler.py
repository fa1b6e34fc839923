"""The static-shape sampler: every decode step the same shapes, its state on the device, so a GPU can replay it.

For Llama-family decoders (Qwen2, Qwen3, Llama, Mistral: RMSNorm, rotary, grouped-query attention, SwiGLU MLP).
One call samples a set of left-padded prompt rows by continuous batching:

- the rows stream through a fixed number of slots (`slots`: the stage's `sampling.batch_size`, fewer where the KV
  cache budget holds fewer): a slot whose row ends takes the next waiting row before the next step, so no decode
  step is spent on a row that has ended (`grpo.sampling.local.slots.SlotBatch`); once no row waits, the live slots move
  to the front and steps compute them alone;
- the prompts are left-padded to a length bucket (`prompt_bucket`: a multiple of 32 up to 256, of 128 beyond)
  where steps are captured, so a handful of shapes cover every call and a capture is reused from call to call
  (eager steps gain nothing from a bucket and skip it);
- each distinct prompt is prefilled once by the model's own forward (the G samples of a prompt share it), in
  chunks as its rows come up, and its keys and values copied into the slot each row takes;
- the keys and values live in pages (`grpo.sampling.local.pages`): a row takes a page each 16 tokens it writes and gives
  them back when it ends, a prompt's pages are written once and read by its G rows, and the cache's size follows
  the rows' lengths, not the budget; under a budget (`memory_budget`) rows are admitted by free pages and the
  newest is preempted when they run out (it resumes with the same tokens). Eager steps (a CPU) attend over each
  row's keys and values kept from step to step, grouped by length (`length_rows`: no row reads or holds a page past
  its own length); kept, captured steps (CUDA) over the pages themselves, each row as far as it has
  written (`paged_attention`), their pool shared by every kept shape (the static cache of P + C positions a slot,
  attended in full, that captured steps had before is gone: BENCHMARKS.md, "Long budgets", compares the two);
- each decode step (`grpo.sampling.local.decode_step`) reads the weights straight from the model, each slot at its own
  position, and samples inside the step, each row from its own counter-based random stream (`draws`: one 64-bit
  stream a row, drawn up front; tests inject them): a row's tokens depend on its prompt and its stream, not on its
  slot, its neighbours or the budget, so rows come out the same however many slots decode them;
- the host looks at the slots every step on CPU (it costs nothing there) and every `check_every` steps on CUDA (a
  look is a sync); on CUDA the step is captured as a `torch.cuda.CUDAGraph` per slot-count bucket and replayed;
  captures are kept for the next calls, and their weights are refreshed in place by `sync_weights`.

`sample` returns the rows in their order; `stream` hands out each group of G rows as its last row ends, for a
consumer that scores while the rest decode. `counts` says how many slot-steps the decode steps computed.

It samples in the model's own dtype or from a copy in another (bf16 where the recipe trains under bf16 autocast),
refreshed by `sync_weights(model)`, which the engine's `sync_weights` calls (a trainer: after each optimizer step).
A peft LoRA model samples the same way: the step reads its base weights and adds each adapter's (x A^T) B^T, the
adapters of a fused projection in one pair of small matmuls (`PackedLinear`), so LoRA costs no merged copy of
the weights and stays on the captured path. A model it does not compute exactly (DoRA, quantized projections,
hooks) gets `unsupported_reason` (a sentence) and the caller decodes another way. Must not depend on Prefect or
MLflow.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Iterator
from typing import NamedTuple

import torch
from transformers import PreTrainedModel

from grpo.configs.sampling import SamplingConfig
from grpo.sampling.draws import draw_streams
from grpo.sampling.local.cpu_decoder import STATIC_ROPE, lora_reason
from grpo.sampling.local.decode_step import (CDF_BLOCK, F, Capture, Weights, choose_tokens, decoder, distinct_rows,
                                             inverse_cdf, read_weights, step_slots, weight_tensors)
from grpo.sampling.local.pages import PagedState, SharedPools, page_bytes
from grpo.sampling.local.slots import Ended, SlotBatch

__all__ = ["CDF_BLOCK", "Group", "Sampled", "SlotBatch", "StaticSampler", "choose_tokens", "decoder", "distinct_rows",
           "inverse_cdf", "prompt_bucket", "unsupported_reason"]

_ARCHITECTURES = {"Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM"}
_MAX_CAPTURES = 8  # shapes kept captured at once; each holds its KV cache, so a few, not one per batch ever seen


def prompt_bucket(length: int) -> int:
    """The padded prompt length for a prompt of `length` tokens: a multiple of 32 up to 256, of 128 beyond.

    Fine steps where prompts are short (a few wasted prefill tokens cost little), coarse ones where they are long,
    so a run's prompts fall into a few buckets and each bucket's captured step is reused.
    """
    step = 32 if length <= 256 else 128
    return max(step, -(-length // step) * step)


def unsupported_reason(model: PreTrainedModel, total_len: int = 0) -> str | None:
    """None when the static step computes `model` exactly (for sequences of `total_len` tokens); else why not."""
    model = decoder(model)
    name = type(model).__name__
    if name not in _ARCHITECTURES:
        return f"{name} is not a decoder the static sampler computes (it knows {sorted(_ARCHITECTURES)})"
    cfg, core = model.config, getattr(model, "model", None)
    rotary = getattr(core, "rotary_emb", None)
    if rotary is None or getattr(rotary, "rope_type", None) not in STATIC_ROPE:
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


class Sampled(NamedTuple):
    """One batch's completions (on the CPU), as `backend.sample_batch` returns them."""

    completion_ids: torch.Tensor  # [B, L] right-padded with the pad id (L: the longest row's tokens, not the budget)
    completion_mask: torch.Tensor  # [B, L] 1 up to and including the end token
    logprobs: torch.Tensor | None  # [B, L] the chosen tokens' log-probs (0 on padding); None unless asked
    truncated: torch.Tensor  # [B] True when the budget ran out before an end token


class Group(NamedTuple):
    """One prompt's completions as `StaticSampler.stream` hands them out, when the last of them ends."""

    rows: range  # the rows of the call they are
    sampled: Sampled  # [G, C_g]: as wide as the group's longest completion


class DecodeCounts:
    """What the sampler's decode steps computed, summed over its calls (`StaticSampler.counts`; reset by making a
    new one). A sample's first token comes from its prompt's prefill and each later one from one decode step, so
    of `rows_computed`, `tokens - samples` went to live rows and the rest to finished or free slots."""

    def __init__(self):
        self.samples = 0  # rows that ended (an end token or their budget), preempted ones once
        self.tokens = 0  # the tokens those rows chose, their end tokens included
        self.steps = 0  # decode steps run
        self.rows_computed = 0  # slots those steps computed, summed over the steps
        self.kv_positions_read = 0  # cache positions those steps' attention read, summed over their slots and steps
        self.preemptions = 0  # rows a paged cache put back in the queue for want of pages
        self.pages_high_water = 0  # the most pages of a paged cache in use at once
        self.kv_bytes_allocated = 0  # the largest KV cache a call held: its page pool (and the rows by length, eagerly)

    def take(self) -> "DecodeCounts":
        """What was counted since the last take (or the start), and a fresh count from here."""
        taken = copy.copy(self)
        self.__init__()
        return taken

    def figures(self) -> dict[str, float]:
        """The counts as a stage logs them (`sampler/...`; empty where no decode step ran): how many steps, the share
        of the slots they computed that held a live row, K/V positions attention read per generated token, the K/V
        cache's size at most (MB), its pages in use at most, and rows preempted for want of pages."""
        if not self.steps:
            return {}
        decoded = max(0, self.tokens - self.samples)  # tokens that came from a decode step (not a prefill)
        return {"sampler/decode_steps": float(self.steps),
                "sampler/live_share": decoded / max(1, self.rows_computed),
                "sampler/kv_read_per_token": self.kv_positions_read / max(1, decoded),
                "sampler/kv_mb": self.kv_bytes_allocated / 2**20,
                "sampler/pages_high_water": float(self.pages_high_water),
                "sampler/preemptions": float(self.preemptions)}

    def __repr__(self) -> str:
        return (f"DecodeCounts(samples={self.samples}, tokens={self.tokens}, steps={self.steps}, rows_computed={self.rows_computed}, kv_positions_read="
                f"{self.kv_positions_read}, preemptions={self.preemptions}, pages_high_water={self.pages_high_water}, "
                f"kv_bytes_allocated={self.kv_bytes_allocated})")


GPU_FREE_SHARE = 0.5  # of a GPU's free memory, the KV cache's budget where the recipe sets none (kv_cache_mb)


class StaticSampler:
    """Samples completions from one model with a static KV cache; see the module docstring.

    dtype: the weights it samples with (None: the model's own; another: a copy in that dtype, made on first use and
    refreshed by `sync_weights`). memory_budget: bytes the KV cache may take (None: `GPU_FREE_SHARE` of a GPU's free
    memory, no limit on a CPU): the page pool's size at most (rows wait for pages, and are preempted when they run
    out).
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
                 buckets: bool | None = None, keep_captures: bool | None = None, fp32_gemm: str = "auto"):
        if check_every < 1:
            raise ValueError(f"check_every must be at least 1, got {check_every}")
        if memory_budget is not None and memory_budget <= 0:
            raise ValueError(f"memory_budget must be a positive number of bytes or None, got {memory_budget}")
        self.model, self._dtype, self.fp32_gemm = model, dtype, fp32_gemm
        self.dtype = dtype or next(model.parameters()).dtype
        self.memory_budget, self.check_every = memory_budget, check_every
        self.device = next(model.parameters()).device
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self.full_cache_attention = self.graphs if full_cache_attention is None else full_cache_attention
        self.buckets = self.graphs if buckets is None else buckets
        self.keep_captures = self.graphs if keep_captures is None else keep_captures
        self._copy: PreTrainedModel | None = None  # the model in self.dtype, when that is not its own
        self._weights: Weights | None = None  # kept while captures read them (refreshed in place)
        self._captures: dict[tuple, Capture] = {}
        self._pools: SharedPools | None = None  # the kept states' page pools (allocated once, by the budget)
        self._max_pages: int | None = None
        self._seen = None  # the policy's parameters (addresses and versions) at the last sync
        self.counts = DecodeCounts()

    def unsupported_reason(self, total_len: int = 0) -> str | None:
        return unsupported_reason(self.model, total_len)

    def sync_weights(self, model: PreTrainedModel | None = None) -> None:
        """Make the next sampling use `model`'s current weights (call it after each optimizer step)."""
        model = self.model if model is None else model
        seen = _fingerprint(model)
        if model is not self.model or self._seen is None or [a for a, _ in seen] != [a for a, _ in self._seen]:
            # another model, or parameters moved (cast, to another device): rebuild everything from it
            self.model, self._weights, self._captures, self._pools = model, None, {}, None
            self.device, self._copy = next(model.parameters()).device, None
            self.dtype = self._dtype or next(model.parameters()).dtype  # None follows the model's own
        # inference mode: the kept weights were made in it (inside `sample`), and only it may update them in place
        with torch.inference_mode():
            if self._copy is not None:
                for dst, src in zip(self._copy.parameters(), model.parameters()):
                    dst.copy_(src)
            if self._weights is not None:  # the captured steps read these: new values at the same addresses
                fresh = read_weights(self._sampling_model(), self._weights.head.rows, pack=False)
                olds, news = weight_tensors(self._weights), weight_tensors(fresh)
                if [t.shape for t in olds] != [t.shape for t in news]:  # adapters merged or turned off: new steps
                    self._weights, self._captures, self._pools = None, {}, None
                else:
                    for old, new in zip(olds, news):
                        if old is not new and old.data_ptr() != new.data_ptr():  # (a fused view is its own)
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
                made = self._fused_projections()
                made.update({id(p): torch.nn.Parameter(p.detach().to(self.dtype, copy=True), requires_grad=False)
                             for p in self.model.parameters() if id(p) not in made})
                self._copy = copy.deepcopy(self.model, made).eval()
        return self._copy

    def _fused_projections(self) -> dict[int, torch.nn.Parameter]:
        """The copy's q/k/v and gate/up weights of each layer made in one block of memory each, as views into it
        (`cpu_decoder.fused_view`): the step reads them fused with no second copy (0.44 GiB at 0.5B in bf16)."""
        made = {}
        for layer in decoder(self.model).model.layers:
            a, m = layer.self_attn, layer.mlp
            for group in ((a.q_proj, a.k_proj, a.v_proj), (m.gate_proj, m.up_proj)):
                if not all(type(x) is torch.nn.Linear for x in group):
                    continue  # a LoRA projection: its base is read as it is
                w = group[0].weight
                fused = w.new_empty(sum(x.out_features for x in group), w.size(1), dtype=self.dtype)  # [out, in]
                at = 0
                for x in group:  # each cast into its rows: no cast copy made on the way
                    fused[at : at + x.out_features].copy_(x.weight.detach())
                    made[id(x.weight)] = torch.nn.Parameter(fused[at : at + x.out_features], requires_grad=False)
                    at += x.out_features
        return made

    def _prepare(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, s: SamplingConfig, pad_id: int,
                 streams: torch.Tensor | None, slots: int | None) -> tuple[torch.Tensor, ...]:
        """The prompts left-padded to their bucket on the device, each row's random stream, and the slot count."""
        # a step since the last sync that bumped the parameters' versions: sync now (a fused optimizer's step does
        # not bump them, so whoever steps the model also calls sync_weights, as the trainers do)
        if self._seen != _fingerprint(self.model):
            self.sync_weights()
        if slots is not None and slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        B, C = prompt_ids.size(0), s.max_new_tokens
        longest = max(1, int(prompt_mask.sum(1).max()))
        P = prompt_bucket(longest) if self.buckets else longest
        ids, mask = prompt_ids[:, prompt_ids.size(1) - longest:], prompt_mask[:, prompt_mask.size(1) - longest:]
        ids = F.pad(ids.to(self.device), (P - longest, 0), value=pad_id)  # [B, P]
        mask = F.pad(mask.to(self.device), (P - longest, 0), value=0)  # [B, P]
        if streams is None and s.temperature == 0:  # greedy reads none: leave the generator as it is
            streams = torch.zeros(B, dtype=torch.long)  # [B]
        elif streams is None:
            # what the decode loop in `backend` draws for a batch of `slots` rows, so a seed samples the same tokens
            # whether rows are decoded a batch at a time or streamed through slots
            streams = draw_streams(B, self.device, per=slots or B)  # [B]
        S = min(B, slots or B)  # the pages' budget admits rows as their pages fit
        return ids, mask, streams.to(torch.long), S

    @torch.inference_mode()
    def sample(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, s: SamplingConfig, eos_ids: list[int],
               pad_id: int, *, return_logprobs: bool = True, streams: torch.Tensor | None = None,
               slots: int | None = None) -> Sampled:
        """Sample `s.max_new_tokens` at most for each left-padded prompt row, the rows streamed through `slots`
        decode slots (None: one per row, or as many as the memory budget holds).

        streams: [B] int64, each row's random stream (`draws.uniform_at` gives its token k's draw; None: drawn
        here from torch's generator on the model's device); the same streams give the same tokens however many
        slots decode them, at any budget the rows do not reach.
        """
        ids, mask, streams, S = self._prepare(prompt_ids, prompt_mask, s, pad_id, streams, slots)
        got: dict[int, Ended] = {}
        for ended in self._run(ids, mask, streams, s, eos_ids, pad_id, return_logprobs, S):
            got.update((e.key, e) for e in ended)
        return padded([got[row] for row in range(ids.size(0))], pad_id, return_logprobs)

    @torch.inference_mode()
    def stream(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, s: SamplingConfig, eos_ids: list[int],
               pad_id: int, *, group_size: int = 1, return_logprobs: bool = True,
               streams: torch.Tensor | None = None, slots: int | None = None) -> Iterator[Group]:
        """`sample`, handed out a group at a time as each group's last row ends (rows [g*group_size,
        (g+1)*group_size) are group g): a consumer can score and train on the first groups while the slots decode
        the rest. Each group's tensors are as wide as its own longest completion."""
        B = prompt_ids.size(0)
        if group_size < 1 or B % group_size:
            raise ValueError(f"group_size must divide the {B} rows, got {group_size}")
        ids, mask, streams, S = self._prepare(prompt_ids, prompt_mask, s, pad_id, streams, slots)
        got: dict[int, dict[int, Ended]] = {}
        for ended in self._run(ids, mask, streams, s, eos_ids, pad_id, return_logprobs, S):
            for e in ended:
                g = e.key // group_size
                got.setdefault(g, {})[e.key] = e
                if len(got[g]) < group_size:
                    continue
                members = got.pop(g)
                rows = range(g * group_size, (g + 1) * group_size)
                yield Group(rows, padded([members[r] for r in rows], pad_id, return_logprobs))

    def _kv_budget(self) -> int | None:
        """Bytes the KV cache may take: `memory_budget`, else on a GPU a share of what is free now (the trainer's
        activations are gone between steps; its weights, gradients and optimizer state stay: the rest is left to
        the prefill, the logits and the allocator's slack), else None (no limit)."""
        budget = self.memory_budget
        if budget is None and self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(GPU_FREE_SHARE * (free + torch.cuda.memory_reserved(self.device)
                                           - torch.cuda.memory_allocated(self.device)))
        return budget

    def _kernel_state(self, model: PreTrainedModel, S: int, P: int, C: int) -> PagedState:
        """A kept state in the kernel layout over the sampler's pools: allocated by the first, at the budget's size
        (a captured step's pool cannot grow: its graphs hold the addresses), and shared by every kept shape."""
        if self._pools is None:
            budget = self._kv_budget()
            self._max_pages = None if budget is None else budget // page_bytes(model, self.dtype)
            if self._max_pages is None and self.graphs:
                raise ValueError("captured decode steps need a KV cache budget (memory_budget) to size their pages")
        st = PagedState(model, S, P, C, self.dtype, self.device, max_pages=self._max_pages, layout="kernel",
                        pools=self._pools)
        self._pools = st.pools
        return st

    def _run(self, ids: torch.Tensor, mask: torch.Tensor, streams: torch.Tensor, s: SamplingConfig,
             eos_ids: list[int], pad_id: int, want_logprobs: bool, S: int) -> Iterator[tuple]:
        """The B rows streamed through S slots (`SlotBatch`). Yields the rows that ended since the last yield
        (`Ended`, keyed by their row, each as long as its own tokens), on the device."""
        batch = SlotBatch(self, S, ids.size(1), s, eos_ids, pad_id, want_logprobs)
        inverse, first = distinct_rows(torch.cat([ids, mask.to(ids.dtype)], 1))  # [B], [U]
        rows_of = collections.defaultdict(list)
        for row, u in enumerate(inverse.tolist()):
            rows_of[u].append(row)
        for u in sorted(rows_of, key=lambda u: rows_of[u][0]):  # prompts in the order their first row comes
            rows = rows_of[u]
            head = int(first[u])
            batch.submit(ids[head], mask[head], streams[rows], keys=rows)
        while batch.busy:
            ended = batch.step()
            if ended:
                yield ended

    def capture(self, model: PreTrainedModel, S: int, P: int, s: SamplingConfig, eos: torch.Tensor, pad_id: int,
                 want_logprobs: bool) -> Capture:
        """The shape's state and step: made afresh each call, or (on CUDA) captured once and kept for the next."""
        C = s.max_new_tokens
        if not self.keep_captures:  # made afresh each call, its pool at the budget's size (which it
            # never outgrows) or growing; attention reads rows kept from step to step, grouped by length (`length_rows`)
            budget = self._kv_budget()
            max_pages = None if budget is None else budget // page_bytes(model, self.dtype)
            st = PagedState(model, S, P, C, self.dtype, self.device, max_pages=max_pages)
            w = read_weights(model, S, gemm=self.fp32_gemm)
            return Capture(st, lambda view, kv_len: step_slots(view, w, model.config, s, eos, pad_id, want_logprobs,
                                                           kv_len), graph=False)
        key = (S, P, C, s.temperature, s.top_k, s.top_p, tuple(eos.tolist()), pad_id, want_logprobs)
        if key not in self._captures:
            if self._weights is None:
                self._weights = read_weights(model, S, pack=False)
            while len(self._captures) >= _MAX_CAPTURES:
                self._captures.pop(next(iter(self._captures)))  # the oldest shape first
            w, eos = self._weights, eos.clone()
            st = self._kernel_state(model, S, P, C)  # reads its pages in place (`paged_attention`), one pool for all
            self._captures[key] = Capture(
                st, lambda view, kv_len: step_slots(view, w, model.config, s, eos, pad_id, want_logprobs, kv_len),
                self.graphs)
        return self._captures[key]


def padded(rows: list[Ended], pad_id: int, logprobs: bool) -> Sampled:
    """Ended rows, in order, as one batch on the CPU: [r, the longest row's tokens], right-padded."""
    pad = torch.nn.utils.rnn.pad_sequence
    return Sampled(pad([e.ids for e in rows], batch_first=True, padding_value=pad_id).cpu(),
                   pad([e.alive for e in rows], batch_first=True).long().cpu(),
                   pad([e.logprobs for e in rows], batch_first=True).cpu() if logprobs else None,
                   torch.tensor([e.truncated for e in rows]))


def _fingerprint(model: PreTrainedModel) -> list[tuple[int, int]]:
    """Each parameter's address and version: an in-place optimizer step bumps the version, a cast the address."""
    return [(p.data_ptr(), p._version) for p in model.parameters()]
