"""A paged KV cache for the decode step: keys and values in fixed-size pages that rows take as they grow.

A static cache row of P + C positions a slot (what the captured step had before) holds the budget whatever its row
writes, so memory and the work of each step follow the budget. Here (`PagedState`, the slots' fields of
`decode_step.SlotState` and the cache) each layer's keys and values live in one pool of pages of
`PAGE_TOKENS` positions ([kv_heads, pages x PAGE_TOKENS, head_dim]: a head's page is one block of memory, so the
pages a step gathers line up as [kv_heads, slots, positions, head_dim] with each slot's positions contiguous, the
layout CPU attention reads fastest); a slot has a block table, the pages it reads in order, and takes a page each
`PAGE_TOKENS` tokens it writes:

- a prompt's keys and values go into pages once, and the G rows of that prompt read those same pages (counted: a
  page goes back to the pool when the last row reading it ends); a row's own tokens start on a page of its own, so
  a prompt's last page, partly filled, is never written by its rows;
- a step writes each slot's new keys and values at its own position (page and offset from its table; on the eager
  path, where attention reads rows, into the slot's row alone) and attends over each slot's own positions;
- attention reads, on the eager path (`layout="rows"`, a CPU), each slot's row kept from step to step in the group
  of rows with as many pages (`length_rows.LengthRows`: one SDPA a group, so no row reads or holds K/V a page or
  more past its own length, whatever the longest row); in the captured layout (`layout="kernel"`, what CUDA graphs
  replay) the pages themselves, each slot as far as it has written (`paged_attention.paged_decode`), the pools
  shared by a sampler's kept states (`SharedPools`);
- the pool (`PagePool`) starts at each slot's prompt and two pages and grows as rows need (doubling, never past
  what the slots could hold at the budget), up to the KV cache budget (`memory_budget`, `generation.kv_cache_mb`)
  when there is one; with a budget, `slots.SlotBatch` admits a row when its prompt's pages and
  one more fit, and when the pool runs dry mid-decode it preempts the newest row, which later resumes from its
  prompt and the tokens it had chosen (recomputed by one forward; its tokens depend on its prompt and stream
  alone, as before).

Page 0 is never handed out: a table's unused entries point at it and a free slot a step still computes writes
there, so no step writes into a page some row reads. Must not depend on Prefect or MLflow.
"""

from __future__ import annotations


import torch
from transformers import PreTrainedModel

from grpo.sampling.local.decode_step import SlotState, decoder
from grpo.sampling.local.length_rows import LengthRows
from grpo.sampling.local.paged_attention import paged_decode

PAGE_TOKENS = 16  # positions a page holds (vLLM's default block size): a row wastes fewer than this at its end


def pages_for(tokens: int, page: int = PAGE_TOKENS) -> int:
    return -(-tokens // page)


def page_bytes(model: PreTrainedModel, dtype: torch.dtype, page: int = PAGE_TOKENS) -> int:
    """Bytes one page of `model`'s keys and values takes in `dtype`, over every layer."""
    model = decoder(model)
    cfg = model.config
    return 2 * cfg.num_hidden_layers * page * cfg.num_key_value_heads * model.model.layers[0].self_attn.head_dim * \
        dtype.itemsize


class PagePool:
    """Which pages of a pool are free and how many rows read each (host-side bookkeeping; page 0 is the null page).

    `size` pages in all; `limit` the most it may grow to (None: no limit, `grow` doubles it when it runs dry)."""

    def __init__(self, size: int, limit: int | None = None):
        if size < 2:
            raise ValueError(f"a page pool needs at least 2 pages (one is the null page), got {size}")
        self.size, self.limit = size, limit
        self.free = list(range(size - 1, 0, -1))  # taken from the end: low pages first
        self.refs = [0] * size
        self.high_water = 0  # the most pages in use at once

    @property
    def in_use(self) -> int:
        return self.size - 1 - len(self.free)

    def room(self) -> int:
        """Pages that can still be taken, growing included."""
        return len(self.free) + (10**12 if self.limit is None else self.limit - self.size)

    def take(self, k: int) -> list[int] | None:
        """k free pages, each read by one row now; None (nothing taken) when the pool cannot hold them."""
        if k > self.room():
            return None
        if k > len(self.free):
            return None  # the caller grows the pool's tensors first (`PagedState.take`)
        pages = [self.free.pop() for _ in range(k)]
        for p in pages:
            self.refs[p] = 1
        self.high_water = max(self.high_water, self.in_use)
        return pages

    def clear(self, size: int) -> None:
        """Every page free again, the pool `size` pages."""
        self.__init__(size, self.limit)

    def grow(self, new_size: int) -> None:
        self.free = list(range(new_size - 1, self.size - 1, -1)) + self.free
        self.refs += [0] * (new_size - self.size)
        self.size = new_size

    def hold(self, pages: list[int]) -> None:
        """One more row reads `pages`."""
        for p in pages:
            self.refs[p] += 1

    def release(self, pages: list[int]) -> None:
        """One row fewer reads `pages`; those no row reads go back to the pool."""
        for p in pages:
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free.append(p)
            elif self.refs[p] < 0:
                raise RuntimeError(f"page {p} released more often than it was held")


class SharedPools:
    """The page pools of every layer ([Hkv, pages x page, D] keys and values each), which the kept states of one
    sampler share (one call at a time decodes, and each starts with every page free): a budget's cache is allocated
    once, not once per captured shape. The lists are shared, so a pool grown by one state is seen by all."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], page: int):
        self.k, self.v, self.page = k, v, page
        self.version = 0  # bumped when the pools move (grown): a captured step made before reads the old ones

    @classmethod
    def allocate(cls, st: "PagedState", pages: int) -> "SharedPools":
        k = [torch.zeros(st.n_kv, pages * st.page, st.head_dim, dtype=st.dtype, device=st.device)
             for _ in range(st.n_layers)]
        return cls(k, [torch.zeros_like(t) for t in k], st.page)

    @property
    def size(self) -> int:
        return self.k[0].size(1) // self.page

    def grow(self, pages: int, zeros: bool = True) -> None:
        """The pools grown to `pages`; zeros=False leaves the new pages unwritten (a reader of written positions
        only: the eager path's; the memory a page takes is then only touched as rows write it)."""
        for pools in (self.k, self.v):
            for i, t in enumerate(pools):
                grown = (t.new_zeros if zeros else t.new_empty)(t.size(0), pages * self.page, t.size(2))
                grown[:, : t.size(1)] = t
                pools[i] = grown
        self.version += 1


class PagedState(SlotState):
    """The slots' fields (`SlotState`) and their keys and values, in pages of a pool (a view of the first m slots,
    `rows(m)`, shares the pools and the rows by length: the same objects, so a grown pool is seen by every view). Per
    slot, on the device: its block table [S, max pages], its prefix's valid length (`plen`: the prompt, or for a
    resumed row the prompt and the tokens it had chosen),
    where its own tokens start (`start`: a page boundary) and `base` (start less the chosen tokens its prefix holds):
    token j of the row sits at position base + j of the slot's pages. Host-side: the pages each slot reads (`prefix`,
    shared with the other rows of its prompt) and owns (`own`), and the pages each prompt's prefix is in."""

    _PER_SLOT = ("next_pos", "streams", "n", "limit", "tok", "done", "ids", "alive", "logprobs", "table", "plen",
                 "start", "base", "read")

    def __init__(self, model: PreTrainedModel, S: int, P: int, C: int, dtype: torch.dtype, device: torch.device,
                 max_pages: int | None = None, page: int = PAGE_TOKENS, layout: str = "rows",
                 pools: "SharedPools | None" = None):
        if layout not in ("rows", "kernel"):
            raise ValueError(f"layout must be 'rows' or 'kernel', got {layout!r}")
        self._slot_fields(model, S, P, C, dtype, device, grow=layout == "rows")  # captured: fixed addresses
        self.page, self.layout = page, layout
        self.max_pages_a_row = pages_for(P, page) + pages_for(C, page) + 1  # a resumed row's prefix may end mid-page
        if max_pages is not None and max_pages - 1 < self.max_pages_a_row:
            raise ValueError(f"a KV cache of {max_pages - 1} pages holds no row: one row of {P} prompt and {C} new "
                             f"tokens takes up to {self.max_pages_a_row} pages of {page}; raise generation.kv_cache_mb "
                             f"or shorten max_new_tokens")
        start_pages = min(pages_for(P, page), 2) + 2  # a slot's to start with: a short prompt's and two of its own
        if pools is None:  # grown as rows need, to the budget (P may be a whole context: `r1 serve` on a paged cache)
            first = 1 + S * start_pages
            pools = SharedPools.allocate(self, first if max_pages is None else min(first, max_pages))
        self.pools = pools
        self.pool = PagePool(pools.size, limit=max_pages)
        self.k, self.v = pools.k, pools.v  # [Hkv, pages * page, D] each: the same lists, a grown pool seen by all
        # [S, pages a row]: the budget's width where a step is captured, else a prompt's and two, grown as rows do
        width = self.max_pages_a_row if layout == "kernel" else min(self.max_pages_a_row, pages_for(P, page) + 2)
        self.table = torch.zeros(S, width, dtype=torch.long, device=device)
        self.plen = torch.zeros(S, dtype=torch.long, device=device)  # [S]
        self.start = torch.zeros(S, dtype=torch.long, device=device)  # [S]
        self.base = torch.zeros(S, dtype=torch.long, device=device)  # [S]
        # [S] K/V positions each slot's attention read since the last `take_read`, added where they are read (the
        # kernel, the reference or the rows by length), on the device: a captured step counts as it replays
        self.read = torch.zeros(S, dtype=torch.long, device=device)
        self.prefix: list[list[int]] = [[] for _ in range(S)]  # slot -> pages it reads, its prompt's (shared)
        self.own: list[list[int]] = [[] for _ in range(S)]  # slot -> pages it wrote itself
        self.chosen_in_prefix = [0] * S  # slot -> tokens of its row its prefix holds (a resumed row's)
        self.resident: dict[object, list[int]] = {}  # prompt -> the pages its prefix is in, while rows read them
        self.stale: set[int] = set()
        # the rows the eager step's attention reads (`length_rows`): each slot's keys and values contiguous, in the
        # group of its page count, kept from step to step (a step writes its token into them as into the pages),
        # read from the pages only for a slot that took a new row (`stale`); in the kernel layout attention reads
        # the pages themselves (`paged_attention`)
        self.by_length = None if layout == "kernel" else LengthRows(self.n_layers, self.n_kv, self.head_dim, dtype,
                                                                    device, page)

    def reset(self) -> None:
        """Every slot free and every page back in the pool (a kept state at the start of a call: its pools may have
        been written by another shape's state since, so no prompt's pages are taken as resident)."""
        self.pool.clear(self.pools.size)  # in place, as every other field: the state's views share them
        self.prefix[:] = [[] for _ in range(self.S)]
        self.own[:] = [[] for _ in range(self.S)]
        self.chosen_in_prefix[:] = [0] * self.S
        self.resident.clear()
        self.stale.clear()
        if self.by_length is not None:
            self.by_length.clear()
        self.table.zero_()
        self.read.zero_()  # a capture's warm-up steps read too
        self.done.fill_(True)
        self.n.zero_()

    def move(self, src: int, dst: int) -> None:
        for name in self._PER_SLOT:
            if name == "read":  # a count, summed over the slots: it stays where it was made
                continue
            t = getattr(self, name)
            t[dst] = t[src]
        self.prefix[dst], self.own[dst], self.prefix[src], self.own[src] = self.prefix[src], self.own[src], [], []
        self.chosen_in_prefix[dst] = self.chosen_in_prefix[src]
        self.table[src] = 0
        self.done[src] = True
        if src in self.stale:  # its row not read from its pages yet: dst's is to be
            self.stale.discard(src)
            self.stale.add(dst)
        if self.by_length is not None:  # the row it reads goes with it
            self.by_length.relabel(src, dst)

    # pages

    def _take(self, k: int) -> list[int] | None:
        """k pages, growing the pool's tensors (doubling, up to its limit) when too few are free; None when a
        limited pool has no room."""
        limit = self.pool.limit
        if k > len(self.pool.free) and (limit is None or self.pool.size < limit):
            # doubling, but never past what this state's slots could hold at once at its budget (the static
            # layout's size): a pool doubled to 4,104 pages where 2,433 were the most its rows could take held 0.3
            # GiB more at a GRPO step's peak (benchmarks/grpo_step.py --memory-at-peak)
            new = max(min(2 * self.pool.size, 1 + self.S * self.max_pages_a_row), self.pool.size + k)
            new = new if limit is None else min(new, limit)
            self.pools.grow(new, zeros=self.layout == "kernel")  # the kernel's reference reads whole pages
            self.pool.grow(new)
        return self.pool.take(k)

    def _write_prefix(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> list[int] | None:
        """Pages holding `keys`/`values` (per layer [Hkv, length, D]) from position 0; None when there is no room."""
        length = keys[0].size(1)
        pages = self._take(pages_for(length, self.page))
        if pages is None:
            return None
        flat = (torch.tensor(pages, device=self.device)[:, None] * self.page
                + torch.arange(self.page, device=self.device)).flatten()[:length]  # [length]
        for i in range(self.n_layers):
            self.k[i].index_copy_(1, flat, keys[i].to(self.dtype))
            self.v[i].index_copy_(1, flat, values[i].to(self.dtype))
        return pages

    def pages_to_place(self, prompt, length: int) -> int:
        """Pages a row of `prompt` (a prefix of `length` positions) needs to start: its prefix's, unless resident,
        and one for its first tokens."""
        return (0 if prompt in self.resident else pages_for(length, self.page)) + 1

    def room(self) -> int:
        return self.pool.room()

    def place(self, slots: list[int], prompts: list, prefilled: list[tuple], mask: torch.Tensor,
              chosen: list[int] | None = None) -> None:
        """Each slot's prefix into pages (a prompt's once, read by all its rows): `prefilled` per slot the prefix's
        keys and values, per layer [Hkv, width, D] right-aligned with padding where `mask` [r, width'] is 0 (its
        last `width` columns line up with them). `chosen`: per slot, how many of the prefix's last positions are
        tokens the row chose before it was preempted (0 for a new row). The caller checked `pages_to_place`."""
        chosen = chosen or [0] * len(slots)
        real = mask.long().sum(1).tolist()
        for j, (slot, prompt, (keys, values)) in enumerate(zip(slots, prompts, prefilled)):
            length = real[j]
            pages = self.resident.get(prompt)
            if pages is None:
                width = keys[0].size(1)
                pages = self._write_prefix([k[:, width - length:] for k in keys],
                                           [v[:, width - length:] for v in values])
                if pages is None:
                    raise RuntimeError("no room for a prompt's pages: check `pages_to_place` first")
                self.resident[prompt] = pages
            else:
                self.pool.hold(pages)
            self.prefix[slot], self.own[slot] = pages, []
            start = len(pages) * self.page
            self.table[slot] = 0
            self._widen_table(len(pages))
            self.table[slot, : len(pages)] = torch.tensor(pages, device=self.device)
            self.plen[slot], self.start[slot], self.base[slot] = length, start, start - chosen[j]
            self.chosen_in_prefix[slot] = chosen[j]
            self.stale.add(slot)

    def release(self, slot: int) -> None:
        """The slot's row has left: its own pages back to the pool, its prefix's read by one row fewer."""
        self.pool.release(self.own[slot])
        prefix = self.prefix[slot]
        self.pool.release(prefix)
        if prefix and self.pool.refs[prefix[0]] == 0:  # no row reads this prompt's pages any more
            self.resident = {p: pages for p, pages in self.resident.items() if pages is not prefix}
        self.prefix[slot], self.own[slot] = [], []
        self.table[slot] = 0
        self.done[slot] = True
        self.stale.discard(slot)
        if self.by_length is not None:
            self.by_length.forget(slot)

    def grow_rows(self, slots: list[int], counts: list[int], ahead: int) -> list[int]:
        """Give each of `slots` (with `counts` tokens chosen) the pages its next `ahead` steps write; returns the
        slots that could not get theirs (a limited pool ran dry), in the order given, having taken nothing for
        them."""
        short = []
        for slot, n in zip(slots, counts):
            start = len(self.prefix[slot])
            last = n - 1 + ahead - 1 - self.chosen_in_prefix[slot]  # the furthest own position the next steps write
            need = pages_for(last + 1, self.page) - len(self.own[slot])
            if need <= 0:
                continue
            need = min(need, self.max_pages_a_row - start - len(self.own[slot]))
            pages = self._take(need) if need > 0 else []
            if pages is None:
                short.append(slot)
                continue
            at = start + len(self.own[slot])
            self.own[slot] += pages
            self._widen_table(at + len(pages))
            self.table[slot, at : at + len(pages)] = torch.tensor(pages, device=self.device)
        return short

    def _widen_table(self, width: int) -> None:
        """Block tables of `width` pages a row at least (doubling, up to the most a row can have)."""
        if width <= self.table.size(1):
            return
        wider = self.table.new_zeros(self.S, min(self.max_pages_a_row, max(width, 2 * self.table.size(1))))
        wider[:, : self.table.size(1)] = self.table
        self.table = wider
        self._views.clear()  # they hold the old table

    def kv_bytes(self) -> int:
        rows = 0 if self.by_length is None else self.by_length.nbytes()
        return sum(t.numel() * t.element_size() for t in self.k + self.v) + rows

    def take_read(self) -> int:
        """K/V positions the steps' attention read since the last take, summed over the slots (a sync on a GPU)."""
        got = int(self.read.sum())
        self.read.zero_()
        return got

    def kv_len(self, m: int, full: bool) -> int:
        """Positions the torch reference of the kernel layout reads a slot over the first m slots (the pages of the
        slot that has the most; every page a row could have when `full`). The kernel reads each slot's own pages
        alone, and the eager path each slot's row (`length_rows`)."""
        held = [len(self.prefix[s]) + len(self.own[s]) for s in range(m)]
        if full:
            return self.max_pages_a_row * self.page
        return max(held) * self.page or self.page

    def attention(self, kv_len: int) -> "_PagedAttention | _KernelAttention":
        return _KernelAttention(self, kv_len) if self.layout == "kernel" else _PagedAttention(self, kv_len)


class _PagedAttention:
    """One step's cache access on the eager path: each slot's new K/V at the end of its row (`length_rows`), and
    attention over the rows, each live slot its own, one SDPA a group of rows with as many pages.

    The pages are the record of what a row holds (shared, given back, counted against the budget); the rows are what
    attention reads on this eager path: gathering every slot's pages each step cost as much again as the attention
    itself (+30% a step on a CPU), while a row is read from the pages only when its slot takes it. A row holds its
    prefix and tokens, no more than a page past them; no row is as wide as another's. What is read from the pages
    is a prefix (`place` writes it) and never a row's own tokens (a new row has none yet; a resumed one has them in
    its recomputed prefix), so a step writes its tokens into the rows alone: the two page writes a layer, and the
    position arithmetic for them, were 1-2 us each of a ~2 ms step at one row."""

    def __init__(self, st: PagedState, kv_len: int):
        S = st.tok.size(0)
        done = st.done.tolist()
        fresh = {s for s in st.stale if s < S}
        st.stale.difference_update(fresh)
        self.plan = st.by_length.arrange(st, [s for s in range(S) if not done[s]], fresh)
        self.st = st

    def write(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [S, Hkv, D]: each slot's new token's, at the end of its row."""
        self.plan.write(i, k, v)

    def attend(self, i: int, q: torch.Tensor) -> torch.Tensor:
        """q [S, Hkv, Hq/Hkv, D] over layer i's rows: [S, Hkv, Hq/Hkv, D]."""
        st = self.st  # every layer reads the same positions: the first counts them
        return self.plan.attend(i, q, st.scale, st.read if i == 0 else None)


class _KernelAttention:
    """One step's cache access in the kernel layout (what a captured CUDA step runs): each slot's new K/V written at
    position base + n - 1 of its pages, then `paged_attention.paged_decode` over each slot's own positions, read
    from the pages (a slot that has ended reads nothing). Everything it computes is on the device, from the state's
    tensors, so a graph replays it as the rows grow."""

    def __init__(self, st: PagedState, kv_len: int):
        page = st.page
        at = st.base + st.n - 1  # [S] the new token's position in the slot's pages
        row_page = st.table.gather(1, (at // page).clamp(min=0, max=st.table.size(1) - 1)[:, None]).squeeze(1)
        self.flat = row_page * page + at % page  # [S] into a pool's positions
        self.at = at.masked_fill(st.done, -1)  # [S]
        self.st, self.kv_len = st, kv_len

    def write(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [S, Hkv, D]: each slot's new token's, at its position."""
        self.st.k[i].index_copy_(1, self.flat, k.transpose(0, 1))
        self.st.v[i].index_copy_(1, self.flat, v.transpose(0, 1))

    def attend(self, i: int, q: torch.Tensor) -> torch.Tensor:
        """q [S, Hkv, Hq/Hkv, D] over layer i's pages, each slot its own positions: [S, Hkv, Hq/Hkv, D]."""
        st = self.st
        return paged_decode(q, st.k[i], st.v[i], st.table, st.plen, st.start, self.at, st.scale, st.page,
                            kv_len=self.kv_len, read=st.read if i == 0 else None)  # the first layer counts
