"""Continuous batching: rows that come and go through the slots of one paged decode step (`SlotBatch`).

The scheduler on the host: which row each slot holds, the queue of waiting rows, the prompts' prefills shared by
their rows, and what is handed back as rows end (`Ended`) or as tokens come (`new_tokens`, for streaming). The step
itself, its state and its captures are `grpo.sampling.local.decode_step`'s. Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import collections
import itertools
from typing import NamedTuple

import torch
from transformers import DynamicCache

from grpo.configs.sampling import SamplingConfig
from grpo.models import cached
from grpo.sampling.draws import draw_streams, uniform_at
from grpo.sampling.local.decode_step import F, choose_tokens, decoder

class Ended(NamedTuple):
    """A row that has ended, as `SlotBatch.step` hands it back (tensors on the sampler's device)."""

    key: int  # what the row was submitted as
    ids: torch.Tensor  # [n] its n tokens (its end token included): as long as the row, not the budget
    alive: torch.Tensor  # [n] bool: True (up to and including its last token)
    logprobs: torch.Tensor  # [n] each token's log-prob (0 throughout when not asked)
    truncated: bool  # its limit ran out before an end token (or it was cancelled)


class SlotBatch:
    """Continuous batching over one captured shape: S slots, prompts up to P tokens, at most C new tokens a row, one
    sampling setting. Rows are submitted at any time (`submit`), wait for a slot, and leave when they end or are
    cancelled; `step` fills free slots from the waiting rows and runs one decode step over the live ones. Its
    calls run under inference mode (the state is made in it); one thread drives it. `sampler` is the
    `static_sampler.StaticSampler` whose model, kept captures and `counts` it uses.

    A slot whose row ends takes the next waiting row before the next step: its prompt's keys and values (prefilled
    once per submitted prompt, its G rows sharing them; prompts are prefilled in chunks, the next S waiting rows'
    at once) written into pages once, read by the prompt's rows, its first token chosen from the prefill's logits.
    A row is admitted when its prompt's pages and one more fit (`pages.PagedState`), each row gets the pages its
    next steps write before they run, and when a budget's pool has too few the newest rows are preempted: back to the front of the queue with the tokens they
    chose, to resume from a forward over their prompt and those tokens, ending as they would have. Once no row
    waits, the live slots are moved to the front and a step computes those alone (a captured step: the smallest
    bucket of `row_buckets` that holds them). A row's tokens depend on its prompt and its random stream only, not on its
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
        self.cap = sampler.capture(self.model, S, P, s, self.eos, pad_id, want_logprobs)
        st = self.state = self.cap.state
        st.reset()  # every slot free, every page back in the pool (a kept state's pools are shared)
        self.S, self.P, self.C = S, P, s.max_new_tokens
        self.slot_row: list[int | None] = [None] * S  # slot -> the key of the row in it
        self.waiting: collections.deque[int] = collections.deque()  # keys, in the order they take slots
        self._rows: dict[int, tuple[int, int, int]] = {}  # key -> (its prompt, its random stream, limit)
        self._prompts: dict[int, list] = {}  # prompt -> [ids [P], mask [P], rows not yet in a slot]
        self._prefilled: dict[int, tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]] = {}  # K, V, logits
        self._reported: dict[int, int] = {}  # key -> tokens handed out by `new_tokens`
        self._next_prompt = self._next_key = 0
        # a paged cache (pages.PagedState): rows admitted by free pages and preempted when the pool runs dry
        self._row_prompt: dict[int, torch.Tensor] = {}  # key -> its prompt's tokens (no padding), while it decodes
        self._resume: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # preempted key -> (prompt,
        #   the tokens it had chosen, their log-probs)
        self._admitted: dict[int, int] = {}  # decoding key -> when it took its slot (the newest is preempted first)
        self._admissions = 0

    @property
    def busy(self) -> bool:
        """Whether any row waits or decodes."""
        return bool(self.waiting) or any(row is not None for row in self.slot_row)

    @property
    def live(self) -> int:
        return sum(row is not None for row in self.slot_row)

    @torch.inference_mode()
    def submit(self, ids: torch.Tensor, mask: torch.Tensor | None = None, streams: torch.Tensor | None = None, *,
               n: int = 1, keys: list[int] | None = None, limit: int | None = None) -> list[int]:
        """Queue `n` rows (or one per key) continuing one prompt: ids [P'] (P' <= P, left-padded where `mask` [P']
        says so). streams: [n] int64, the rows' random streams (`draws`; None: drawn here). limit: new tokens at
        most (<= C; None: C).
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
        if streams is None:
            streams = draw_streams(n, self.device)  # [n]
        streams = streams.tolist()
        if len(streams) != n:
            raise ValueError(f"{len(streams)} random streams for {n} rows")
        u = self._next_prompt
        self._next_prompt += 1
        self._prompts[u] = [ids, mask, n]
        for key, stream in zip(keys, streams):
            self._rows[key] = (u, stream, limit)
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
            self.state.release(slot)
            self._drop(key)

    def _drop(self, key: int) -> None:
        """A row that decoded is gone: what was kept for it."""
        for kept in (self._rows, self._reported, self._row_prompt, self._admitted):
            kept.pop(key, None)

    def _forget(self, key: int) -> None:
        """A waiting row leaves the queue: its prompt is let go when no other row needs it."""
        if self._resume.pop(key, None) is not None:  # a preempted row: its prompt was let go when it first decoded
            self._drop(key)
            return
        u = self._rows.pop(key)[0]
        self._prompts[u][2] -= 1
        if not self._prompts[u][2]:
            del self._prompts[u]
            self._prefilled.pop(u, None)

    @torch.inference_mode()
    def step(self) -> list[Ended]:
        """Hand back the rows that ended, refill their slots from the queue, then run one decode step (on CUDA,
        `check_every` of them: the host looks at the slots only that often) over the live slots."""
        st, out = self.state, []
        while True:
            taken = [i for i, row in enumerate(self.slot_row) if row is not None]
            fin = []
            if taken:
                top = taken[-1] + 1
                ended = (st.done[:top] | (st.n[:top] >= st.limit[:top])).tolist()
                fin = [i for i in taken if ended[i]]
            if fin:
                done, chosen = torch.stack([st.done[fin].long(), st.n[fin]]).tolist()
                self.sampler.counts.samples += len(fin)
                self.sampler.counts.tokens += sum(chosen)
                for j, slot in enumerate(fin):
                    key = self.slot_row[slot]
                    n = chosen[j]
                    out.append(Ended(key, st.ids[slot, :n].clone(), st.alive[slot, :n].clone(),
                                     st.logprobs[slot, :n].clone(), not done[j]))
                    self.slot_row[slot] = None
                    st.release(slot)
                    self._drop(key)
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
        every = self.sampler.check_every if self.device.type == "cuda" else 1  # a check syncs only on a device
        self._pages_ahead(every)
        taken = [i for i, row in enumerate(self.slot_row) if row is not None]
        if not taken:
            return out
        m = taken[-1] + 1
        if st.ids.size(1) - 1 < st.C or st.cos.size(0) < st.T:  # an eager state: its columns grow with the rows
            st.reach(int(st.n[:m].max()) + every, int((st.next_pos[:m] + st.n[:m]).max()) + every)
        counts = self.sampler.counts
        kv_len = st.kv_len(m, self.sampler.full_cache_attention)  # covers the pages taken ahead
        for _ in range(every):
            self.cap.run(m, kv_len)
            counts.steps += 1
            counts.rows_computed += self.cap.rows_run(m)
        counts.kv_positions_read += st.take_read()  # counted where attention read them
        counts.kv_bytes_allocated = max(counts.kv_bytes_allocated, st.kv_bytes())
        counts.pages_high_water = max(counts.pages_high_water, st.pool.high_water)
        return out

    def _pages_ahead(self, steps: int) -> None:
        """Every decoding row gets the pages its next `steps` steps write; where the pool has no room, the newest
        rows are preempted (back to the front of the queue, to resume from their prompt and tokens) until it does."""
        st = self.state
        live = [i for i, row in enumerate(self.slot_row) if row is not None]
        short = st.grow_rows(live, st.n[live].tolist(), steps) if live else []
        while short:
            victim = max((i for i, row in enumerate(self.slot_row) if row is not None),
                         key=lambda i: self._admitted[self.slot_row[i]])
            self._preempt(victim)
            short = [i for i in short if i != victim]
            short = st.grow_rows(short, st.n[short].tolist(), steps) if short else []

    def _preempt(self, slot: int) -> None:
        st, key = self.state, self.slot_row[slot]
        n = int(st.n[slot])
        self._resume[key] = (self._row_prompt.pop(key), st.ids[slot, :n].clone(), st.logprobs[slot, :n].clone())
        self._admitted.pop(key)
        self.slot_row[slot] = None
        st.release(slot)
        self.waiting.appendleft(key)
        self.sampler.counts.preemptions += 1

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
        """Fill `free` slots with the next waiting rows, while their pages fit; returns the slots filled."""
        st = self.state
        pairs, resumed = [], []
        room = st.room()
        placed: set = set()  # prompts whose pages this admission already counted
        while free[len(pairs) + len(resumed):] and self.waiting:
            key = self.waiting[0]
            if key in self._resume:
                prompt, chosen, _ = self._resume[key]
                need = st.pages_to_place(("resumed", key), prompt.numel() + chosen.numel() - 1)
            else:
                u = self._rows[key][0]
                need = 1 if u in placed else st.pages_to_place(u, int(self._prompts[u][1].sum()))
            if need > room:
                if not self.live and not pairs and not resumed:
                    raise RuntimeError(f"a row needs {need} pages and the KV cache has {room} free with no row "
                                       f"decoding")
                break
            room -= need
            if key not in self._resume:
                placed.add(self._rows[key][0])
            slot = free[len(pairs) + len(resumed)]
            (resumed if key in self._resume else pairs).append((slot, self.waiting.popleft()))
        for slot, key in resumed:
            self._place_resumed(slot, key)
        if pairs:
            self._place_new(pairs)
        return [slot for slot, _ in pairs + resumed]

    def _take_slot(self, slot: int, key: int) -> None:
        self.slot_row[slot] = key
        self._admitted[key] = self._admissions
        self._admissions += 1

    def _place_new(self, pairs: list[tuple[int, int]]) -> None:
        """New rows into their slots: their prompts' keys and values, their first tokens from the prefills."""
        st = self.state
        keys = [key for _, key in pairs]
        self._prefill([self._rows[k][0] for k in keys])
        slots = [slot for slot, _ in pairs]
        slots_t = torch.tensor(slots, device=self.device)  # [r]
        heads, streams, limits = [], [], []
        for slot, key in pairs:
            u, stream, limit = self._rows[key]
            self._take_slot(slot, key)
            heads.append(u)
            streams.append(stream)
            limits.append(limit)
            ids, mask = self._prompts[u][0], self._prompts[u][1]
            self._row_prompt[key] = ids[mask.bool()]
        mask = torch.stack([self._prompts[u][1] for u in heads])  # [r, P]
        logits = torch.stack([self._prefilled[u][2] for u in heads])  # [r, V]
        st.place(slots, heads, [self._prefilled[u][:2] for u in heads], mask)
        for key in keys:
            u = self._rows[key][0]
            self._prompts[u][2] -= 1
            if not self._prompts[u][2]:  # its last row is in a slot: its prompt is not needed again
                del self._prompts[u], self._prefilled[u]
        streams_t = torch.tensor(streams, dtype=torch.long, device=self.device)  # [r]
        st.next_pos[slots_t] = mask.long().sum(1).clamp(min=1)  # positions 0..len-1 taken by the prompt
        st.streams[slots_t] = streams_t
        st.limit[slots_t] = torch.tensor(limits, device=self.device)
        st.ids[slots_t], st.alive[slots_t], st.logprobs[slots_t] = self.pad_id, False, 0.0
        # the first token, from the prefill
        tok, lp = choose_tokens(logits, uniform_at(streams_t, 0), self.s, self.want_logprobs)  # [r], [r]
        st.ids[slots_t, 0], st.alive[slots_t, 0], st.tok[slots_t] = tok, True, tok
        if lp is not None:
            st.logprobs[slots_t, 0] = lp
        st.done[slots_t] = (tok[:, None] == self.eos[None]).any(-1)
        st.n[slots_t] = 1

    def _place_resumed(self, slot: int, key: int) -> None:
        """A preempted row back in a slot: its prompt and the tokens it had chosen (all but the last, which the next
        step feeds) recomputed by one forward into pages of its own, its counters as they were."""
        st = self.state
        prompt, chosen, logprobs = self._resume.pop(key)
        n = chosen.numel()
        st.reach(n + 1, max(1, prompt.numel()) + n + 1)
        ids = torch.cat([prompt, chosen[:-1]])[None]  # [1, p + n - 1]
        cache = DynamicCache()
        self.model(input_ids=ids, **cached(cache), logits_to_keep=1)
        st.place([slot], [("resumed", key)], [([layer.keys[0] for layer in cache.layers],
                                               [layer.values[0] for layer in cache.layers])],
                 torch.ones_like(ids), chosen=[n - 1])
        self._take_slot(slot, key)
        self._row_prompt[key] = prompt
        _, stream, limit = self._rows[key]
        st.next_pos[slot], st.streams[slot], st.limit[slot] = max(1, prompt.numel()), stream, limit
        st.ids[slot], st.alive[slot], st.logprobs[slot] = self.pad_id, False, 0.0
        st.ids[slot, :n], st.alive[slot, :n], st.logprobs[slot, :n] = chosen, True, logprobs
        st.tok[slot], st.done[slot], st.n[slot] = chosen[-1], False, n

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
