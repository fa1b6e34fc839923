"""Continuous batching: rows that come and go through the slots of one static-cache decode step (`SlotBatch`).

The scheduler on the host: which row each slot holds, the queue of waiting rows, the prompts' prefills shared by
their rows, and what is handed back as rows end (`Ended`) or as tokens come (`new_tokens`, for streaming). The step
itself, its state and its captures are `grpo.sampling.decode_step`'s. Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import collections
import itertools
from typing import NamedTuple

import torch
from transformers import DynamicCache

from grpo.config import SamplingConfig
from grpo.models import cached
from grpo.sampling.decode_step import F, choose_tokens, decoder

class Ended(NamedTuple):
    """A row that has ended, as `SlotBatch.step` hands it back (tensors on the sampler's device)."""

    key: int  # what the row was submitted as
    ids: torch.Tensor  # [C] its tokens, then the pad id
    alive: torch.Tensor  # [C] bool: True up to and including its last token
    logprobs: torch.Tensor  # [C] each token's log-prob (0 past the end; 0 throughout when not asked)
    truncated: bool  # its limit ran out before an end token (or it was cancelled)


class SlotBatch:
    """Continuous batching over one captured shape: S slots, prompts up to P tokens, at most C new tokens a row, one
    sampling setting. Rows are submitted at any time (`submit`), wait for a slot, and leave when they end or are
    cancelled; `step` fills free slots from the waiting rows and runs one decode step over the live ones. Its
    calls run under inference mode (the state is made in it); one thread drives it. `sampler` is the
    `static_sampler.StaticSampler` whose model, kept captures and `counts` it uses.

    A slot whose row ends takes the next waiting row before the next step: its prompt's keys and values (prefilled
    once per submitted prompt, its G rows sharing them; prompts are prefilled in chunks, the next S waiting rows'
    at once) written into the slot's prompt part, its first token chosen from the prefill's logits. Once no row
    waits, the live slots are moved to the front and a step computes those alone (a captured step: the smallest
    bucket of `row_buckets` that holds them). A row's tokens depend on its prompt and its uniforms only, not on its
    slot or its neighbours. `StaticSampler.sample` and `stream` run a fixed set of rows through one; `r1 serve`
    keeps one running while requests come and go.
    """

    @torch.inference_mode()
    def __init__(self, sampler, S: int, P: int, s: SamplingConfig, eos_ids: list[int], pad_id: int,
                 want_logprobs: bool = True):
        self.sampler, self.s, self.pad_id, self.want_logprobs = sampler, s, pad_id, want_logprobs
        self.model = decoder(sampler._sampling_model())  # inside a LoRA model its base, the adapters injected
        self.device = sampler.device
        self.eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=self.device)  # [E]
        self.cap = sampler._capture(self.model, S, P, s, self.eos, pad_id, want_logprobs)
        st = self.state = self.cap.state
        st.done.fill_(True)  # every slot free
        st.n.zero_()
        self.S, self.P, self.C = S, P, s.max_new_tokens
        self.slot_row: list[int | None] = [None] * S  # slot -> the key of the row in it
        self.waiting: collections.deque[int] = collections.deque()  # keys, in the order they take slots
        self._rows: dict[int, tuple[int, torch.Tensor, int]] = {}  # key -> (its prompt, uniforms [C], limit)
        self._prompts: dict[int, list] = {}  # prompt -> [ids [P], mask [P], rows not yet in a slot]
        self._prefilled: dict[int, tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]] = {}  # K, V, logits
        self._reported: dict[int, int] = {}  # key -> tokens handed out by `new_tokens`
        self._next_prompt = self._next_key = 0

    @property
    def busy(self) -> bool:
        """Whether any row waits or decodes."""
        return bool(self.waiting) or any(row is not None for row in self.slot_row)

    @property
    def live(self) -> int:
        return sum(row is not None for row in self.slot_row)

    @torch.inference_mode()
    def submit(self, ids: torch.Tensor, mask: torch.Tensor | None = None, uniforms: torch.Tensor | None = None, *,
               n: int = 1, keys: list[int] | None = None, limit: int | None = None) -> list[int]:
        """Queue `n` rows (or one per key) continuing one prompt: ids [P'] (P' <= P, left-padded where `mask` [P']
        says so). uniforms: [n, C] the rows' draws (None: drawn here). limit: new tokens at most (<= C; None: C).
        Returns the rows' keys (`keys` when given: the caller's numbering, which it keeps unique)."""
        if keys is None:
            keys = list(range(self._next_key, self._next_key + n))
            self._next_key += n
        n = len(keys)
        if ids.size(0) > self.P:
            raise ValueError(f"a prompt of {ids.size(0)} tokens does not fit this batch's {self.P}")
        limit = self.C if limit is None else limit
        if not 1 <= limit <= self.C:
            raise ValueError(f"limit must be 1 to {self.C} new tokens, got {limit}")
        if mask is None:
            mask = torch.ones_like(ids)
        ids = F.pad(ids.to(self.device), (self.P - ids.size(0), 0), value=self.pad_id)  # [P]
        mask = F.pad(mask.to(self.device), (self.P - mask.size(0), 0), value=0)  # [P]
        if uniforms is None:
            uniforms = torch.rand(self.C, n, dtype=torch.float64, device=self.device).T  # [n, C]
        uniforms = uniforms.to(self.device, torch.float64)
        u = self._next_prompt
        self._next_prompt += 1
        self._prompts[u] = [ids, mask, n]
        for key, draws in zip(keys, uniforms):
            self._rows[key] = (u, draws, limit)
            self.waiting.append(key)
        return keys

    @torch.inference_mode()
    def cancel(self, key: int) -> None:
        """Drop a row: out of the queue, or its slot freed before the next step (nothing is handed back for it)."""
        if key in self.waiting:
            self.waiting.remove(key)
            self._forget(key)
        elif key in self.slot_row:
            slot = self.slot_row.index(key)
            self.slot_row[slot] = None
            self.state.done[slot] = True
            self._rows.pop(key, None)
            self._reported.pop(key, None)

    def _forget(self, key: int) -> None:
        """A waiting row leaves the queue: its prompt is let go when no other row needs it."""
        u = self._rows.pop(key)[0]
        self._prompts[u][2] -= 1
        if not self._prompts[u][2]:
            del self._prompts[u]
            self._prefilled.pop(u, None)

    @torch.inference_mode()
    def step(self) -> list[Ended]:
        """Hand back the rows that ended, refill their slots from the queue, then run one decode step (on CUDA,
        `check_every` of them: the host looks at the slots only that often) over the live slots."""
        st, C, out = self.state, self.C, []
        while True:
            taken = [i for i, row in enumerate(self.slot_row) if row is not None]
            fin = []
            if taken:
                top = taken[-1] + 1
                ended = (st.done[:top] | (st.n[:top] >= st.limit[:top])).tolist()
                fin = [i for i in taken if ended[i]]
            if fin:
                done = st.done[fin].tolist()
                for j, slot in enumerate(fin):
                    key = self.slot_row[slot]
                    out.append(Ended(key, st.ids[slot, :C].clone(), st.alive[slot, :C].clone(),
                                     st.logprobs[slot, :C].clone(), not done[j]))
                    self.slot_row[slot] = None
                    self._rows.pop(key, None)
                    self._reported.pop(key, None)
            free = [i for i, row in enumerate(self.slot_row) if row is None]
            if not (self._admit(free) or fin):
                break  # nothing ended and nothing came in: decode (a new row may end at its first token)
        if not self.waiting:  # live slots to the front, so a step over a prefix computes them alone
            for hole in [i for i, row in enumerate(self.slot_row) if row is None]:
                last = max((i for i, row in enumerate(self.slot_row) if row is not None), default=-1)
                if last < hole:
                    break
                st.move(last, hole)
                self.slot_row[hole], self.slot_row[last] = self.slot_row[last], None
        taken = [i for i, row in enumerate(self.slot_row) if row is not None]
        if not taken:
            return out
        m = taken[-1] + 1
        kv_len = st.T if self.sampler.full_cache_attention else self.P + int(st.n[:m].max())
        every = self.sampler.check_every if self.device.type == "cuda" else 1  # a check syncs only on a device
        counts = self.sampler.counts
        for _ in range(every):
            self.cap.run(m, kv_len)
            counts.steps += 1
            counts.rows_computed += self.cap.rows_run(m)
            kv_len = min(kv_len + 1, st.T)
        return out

    @torch.inference_mode()
    def new_tokens(self) -> dict[int, tuple[list[int], list[float]]]:
        """Each decoding row's tokens (and log-probs) chosen since the last call: what a streaming client is sent.
        A row that ends is handed back whole by `step`; its tokens not yet sent are those past what this gave."""
        st, out = self.state, {}
        taken = [(i, key) for i, key in enumerate(self.slot_row) if key is not None]
        if not taken:
            return out
        counts = st.n[[i for i, _ in taken]].tolist()
        for (slot, key), n in zip(taken, counts):
            sent = self._reported.get(key, 0)
            if n > sent:
                out[key] = (st.ids[slot, sent:n].tolist(), st.logprobs[slot, sent:n].tolist())
                self._reported[key] = n
        return out

    def _admit(self, free: list[int]) -> list[int]:
        """Fill `free` slots with the next waiting rows; returns the slots filled."""
        st, P = self.state, self.P
        pairs = []
        while free[len(pairs):] and self.waiting:
            pairs.append((free[len(pairs)], self.waiting.popleft()))
        if not pairs:
            return []
        keys = [key for _, key in pairs]
        self._prefill([self._rows[k][0] for k in keys])
        slots_t = torch.tensor([slot for slot, _ in pairs], device=self.device)  # [r]
        heads, draws, limits = [], [], []
        for slot, key in pairs:  # the prompt's keys and values into the slot's prompt part, right-aligned
            u, row_draws, limit = self._rows[key]
            keys_u, values_u, _ = self._prefilled[u]
            width = keys_u[0].size(1)
            for i in range(len(st.k)):
                st.k[i][slot, :, P - width : P] = keys_u[i]
                st.v[i][slot, :, P - width : P] = values_u[i]
            self.slot_row[slot] = key
            heads.append(u)
            draws.append(row_draws)
            limits.append(limit)
        mask = torch.stack([self._prompts[u][1] for u in heads])  # [r, P]
        logits = torch.stack([self._prefilled[u][2] for u in heads])  # [r, V]
        for key in keys:
            u = self._rows[key][0]
            self._prompts[u][2] -= 1
            if not self._prompts[u][2]:  # its last row is in a slot: its prompt is not needed again
                del self._prompts[u], self._prefilled[u]
        uniforms = torch.stack(draws)  # [r, C]
        # additive, which SDPA on CPU runs faster than a bool mask; completion slots open as they are written
        floor = torch.finfo(st.bias.dtype).min
        bias = torch.full((len(pairs), st.T), floor, dtype=st.bias.dtype, device=self.device)  # [r, T]
        bias[:, :P].masked_fill_(mask.bool(), 0.0)
        st.bias[slots_t, 0, 0] = bias
        st.next_pos[slots_t] = mask.long().sum(1).clamp(min=1)  # positions 0..len-1 taken by the prompt
        st.uniforms[slots_t] = uniforms
        st.limit[slots_t] = torch.tensor(limits, device=self.device)
        st.ids[slots_t], st.alive[slots_t], st.logprobs[slots_t] = self.pad_id, False, 0.0
        # the first token, from the prefill
        tok, lp = choose_tokens(logits, uniforms[:, 0], self.s, self.want_logprobs)  # [r], [r]
        st.ids[slots_t, 0], st.alive[slots_t, 0], st.tok[slots_t] = tok, True, tok
        if lp is not None:
            st.logprobs[slots_t, 0] = lp
        st.done[slots_t] = (tok[:, None] == self.eos[None]).any(-1)
        st.n[slots_t] = 1
        return [slot for slot, _ in pairs]

    def _prefill(self, needed: list[int]) -> None:
        """The prompts `needed` and those of the next S waiting rows that are not prefilled yet, in one forward."""
        ahead = [self._rows[k][0] for k in itertools.islice(self.waiting, self.S)]
        us = [u for u in dict.fromkeys(needed + ahead) if u not in self._prefilled]
        if not us:
            return
        ids = torch.stack([self._prompts[u][0] for u in us])  # [u, P]
        mask = torch.stack([self._prompts[u][1] for u in us])  # [u, P]
        width = max(1, int(mask.sum(1).max()))  # the chunk's own longest prompt
        ids, mask = ids[:, self.P - width:], mask[:, self.P - width:]  # [u, width]
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)  # [u, width] positions that ignore left padding
        cache = DynamicCache()
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, **cached(cache),
                            logits_to_keep=1).logits[:, -1]  # [u, V]
        for j, u in enumerate(us):
            self._prefilled[u] = ([layer.keys[j] for layer in cache.layers],
                                  [layer.values[j] for layer in cache.layers], logits[j])  # [Hkv, width, D], [V]
