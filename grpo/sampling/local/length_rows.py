"""The rows the eager decode step's attention reads on a CPU, grouped by their page counts (`LengthRows`).

CPU attention (SDPA) reads rectangular batches: [rows, Hkv, positions, D], every row as long as the batch's
longest. One batch of every slot as wide as the longest live row (what the eager step read before) brought back the
static cache's size with one long row among short ones: 64 slots of the tiny model, one row to 16k and the rest a few
tokens, held 4.2 GB of K/V (5.4 GB peak RSS) where the rows wrote ~64 MB. Here each slot's keys and values are kept
contiguous (its prefix, then its own tokens: no gap at the prefix's last page), in a group of the rows with as many
pages as it (`PAGE_TOKENS` positions a page), each group one tensor of all layers; a step's attention is one SDPA a
group over its rows, as long as the group's longest, so no row reads past its written length by a page or more, and
a row's bytes follow its length.

Chosen from one layer's attention for 64 slots of the embedded model's shape, one thread of a Xeon with AMX, busy
(benchmarks/ragged_attention.py; docs/benchmarks/sampling.md, "One long row among short ones"): one SDPA over kept
rows every slot as wide as the longest, the eager step's before, is fastest where lengths are equal (0.57 ms at 128,
these groups 0.81) but 36 ms with one row of 4k among rows of 30 (these 1.0) and 3.7 ms on a long-tailed mix (these
1.7, in 18 groups); one SDPA a slot costs ~2 to 3 ms at any lengths (~40 us a slot); gathering each slot's pages
every step (the kernel's torch reference) 1.3 to 145 ms: the copy is as large as the read, as wide as the widest.
FlexAttention was not measured: eager it scores the whole pool, compiled it is a C++ kernel per shape on a CPU.
Rows of a group are often the same length (the G rows of a GRPO prompt start together), so the common case stays
one batched SDPA, unmasked. A row crossing a page boundary moves to the next group: a copy of its row once per
`PAGE_TOKENS` steps (a sixteenth of what attention reads in those steps).

Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import torch


def pages_for(tokens: int, page: int) -> int:
    return -(-tokens // page)


class _Group:
    """The rows of `pages` pages: kv [capacity, layers, 2 (K, V), Hkv, pages x page, D]; row r is slot `slots[r]`'s
    (the first len(slots) rows are taken, packed: a row that leaves is filled by the last)."""

    def __init__(self, shape: tuple, dtype: torch.dtype, device: torch.device):
        self.kv = torch.empty(shape, dtype=dtype, device=device)  # each row's tail zeroed as it comes (`add`)
        self.slots: list[int] = []

    def add(self, slot: int, written: int) -> int:
        """A row for `slot`, of which the caller writes the first `written` positions; the rest are zeroed: a
        shorter row's positions past its end are read under the mask, and must be numbers."""
        r = len(self.slots)
        if r == self.kv.size(0):  # full: twice the rows
            grown = self.kv.new_empty((2 * r,) + tuple(self.kv.shape[1:]))
            grown[:r] = self.kv
            self.kv = grown
        self.kv[r, :, :, :, written:] = 0
        self.slots.append(slot)
        return r

    def remove(self, r: int) -> int | None:
        """Row r leaves; the last row moves into it. Returns the slot that moved (None when none did)."""
        last = len(self.slots) - 1
        moved = None
        if r != last:
            self.kv[r] = self.kv[last]
            moved = self.slots[r] = self.slots[last]
        self.slots.pop()
        return moved


class LengthRows:
    """Each decoding slot's keys and values, contiguous, in the group of its page count (see the module docstring).

    `arrange` puts every live slot in the group its next token needs (a slot that took a row read from its pages,
    one that outgrew its group moved up) and returns a step's `Plan`; the step writes and attends through it."""

    def __init__(self, n_layers: int, n_kv: int, head_dim: int, dtype: torch.dtype, device: torch.device, page: int):
        self.n_layers, self.n_kv, self.head_dim, self.page = n_layers, n_kv, head_dim, page
        self.dtype, self.device = dtype, device
        self.groups: dict[int, _Group] = {}  # pages -> the group of rows that have as many
        self.home: dict[int, tuple[int, int]] = {}  # slot -> (its group's pages, its row there)

    def clear(self) -> None:
        self.groups.clear()
        self.home.clear()

    def nbytes(self) -> int:
        return sum(g.kv.numel() * g.kv.element_size() for g in self.groups.values())

    def forget(self, slot: int) -> None:
        """The slot's row has left (or its slot took another): its row goes."""
        if slot not in self.home:
            return
        self._leave(*self.home.pop(slot))

    def _leave(self, pages: int, r: int) -> None:
        """Row r of the group of `pages` pages leaves (its slot's `home` already changed)."""
        group = self.groups[pages]
        moved = group.remove(r)
        if moved is not None:
            self.home[moved] = (pages, r)
        if not group.slots:  # an empty group holds no memory
            del self.groups[pages]

    def relabel(self, src: int, dst: int) -> None:
        """Slot src's row is slot dst's now (the scheduler moved it): nothing is copied."""
        self.forget(dst)
        if src in self.home:
            pages, r = self.home[dst] = self.home.pop(src)
            self.groups[pages].slots[r] = dst

    def _take(self, slot: int, pages: int, written: int) -> tuple[_Group, int]:
        group = self.groups.get(pages)
        if group is None:
            shape = (1, self.n_layers, 2, self.n_kv, pages * self.page, self.head_dim)
            group = self.groups[pages] = _Group(shape, self.dtype, self.device)
        r = group.add(slot, written)
        self.home[slot] = (pages, r)
        return group, r

    def arrange(self, st, live: list[int], fresh: set[int]) -> "Plan":
        """Every slot of `live` (decoding slots of `st`, a `pages.PagedState`) in the group its next token needs;
        `fresh` the slots that took a row since they were last arranged (their rows are read from their pages)."""
        plen, start, base, n = (t.tolist() for t in (st.plen, st.start, st.base, st.n))
        lengths = {}  # slot -> positions its row holds after this step's token
        for s in live:
            own = base[s] + n[s] - start[s]  # own positions after this step's token (a resumed row: fewer)
            lengths[s] = plen[s] + own
        for s in [s for s in self.home if s not in lengths]:  # free or ended slots read nothing
            self.forget(s)
        for s in live:
            need = pages_for(lengths[s], self.page)
            if s in fresh or s not in self.home:
                self.forget(s)
                group, r = self._take(s, need, lengths[s] - 1)
                self._read_pages(st, s, group, r, plen[s], lengths[s] - plen[s] - 1)
            elif self.home[s][0] != need:  # it outgrew its group: its row moves up
                old_pages, old_r = self.home[s]
                row = self.groups[old_pages].kv[old_r]  # [layers, 2, Hkv, old_pages x page, D]
                group, r = self._take(s, need, row.size(-2))  # copied before it leaves: another row may move
                group.kv[r, :, :, :, : row.size(-2)] = row  # into its place
                self._leave(old_pages, old_r)
        return Plan(self, lengths)

    def _read_pages(self, st, slot: int, group: _Group, r: int, prefix: int, own: int) -> None:
        """A row's prefix and its own `own` tokens written so far, from its pages into its row."""
        pos = list(range(prefix)) + list(range(int(st.start[slot]), int(st.start[slot]) + own))
        if not pos:
            return
        pos_t = torch.tensor(pos, device=self.device)
        flat = st.table[slot, pos_t // self.page] * self.page + pos_t % self.page  # [len] into a pool's positions
        for i in range(self.n_layers):
            group.kv[r, i, 0, :, : len(pos)] = st.k[i].index_select(1, flat)
            group.kv[r, i, 1, :, : len(pos)] = st.v[i].index_select(1, flat)


class Plan:
    """One step's reading of the rows: the live slots in group order (`order`), each group's run of them, the
    position each slot's new token goes to, and each group's width (its longest row) and mask."""

    def __init__(self, rows: LengthRows, lengths: dict[int, int]):
        self.rows, self.runs, order, read = rows, [], [], []
        for pages, group in rows.groups.items():
            got = [lengths[s] for s in group.slots]
            width = max(got)  # the group's longest row: every row of it is within a page of it
            at = torch.tensor([x - 1 for x in got], device=rows.device)  # [r] the new token's position in its row
            bias = None
            if min(got) < width:  # rows of unequal lengths: each row's positions past its own end masked
                pos = torch.arange(width, device=rows.device)[None]  # [1, W]
                bias = torch.zeros(len(got), width, dtype=rows.dtype, device=rows.device).masked_fill_(
                    pos >= (at + 1)[:, None], torch.finfo(rows.dtype).min)[:, None, None]  # [r, 1, 1, W]
            index = at.view(-1, 1, 1, 1, 1).expand(-1, 2, rows.n_kv, 1, rows.head_dim)  # [r, 2, Hkv, 1, D]
            self.runs.append((group, len(order), len(order) + len(got), width, bias, index))
            order += group.slots
            read += [width] * len(got)
        self.order = torch.tensor(order, dtype=torch.long, device=rows.device)  # [N]
        self.read = torch.tensor(read, dtype=torch.long, device=rows.device)  # [N] positions each row reads
        # one group whose rows are slots 0..N-1 in order, every slot of the step (one row, or rows that came
        # together): the step's tensors are already in group order, and nothing is gathered or scattered back
        self.in_order = len(self.runs) == 1 and order == list(range(len(order)))

    def write(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [S, Hkv, D]: each live slot's new token's, into its row of layer i."""
        kv = torch.stack([k, v], 1)  # [S, 2, Hkv, D]
        if not (self.in_order and kv.size(0) == self.order.size(0)):
            kv = kv.index_select(0, self.order)  # [N, 2, Hkv, D]
        for group, a, b, _, _, index in self.runs:
            group.kv[: b - a, i].scatter_(3, index, kv[a:b, :, :, None])

    def attend(self, i: int, q: torch.Tensor, scale: float, read: torch.Tensor | None) -> torch.Tensor:
        """q [S, Hkv, G, D] over layer i's rows, each live slot its own: [S, Hkv, G, D] (zeros for the others).
        read: [S] int64 or None; where given, the positions each slot read are added to it."""
        whole = self.in_order and q.size(0) == self.order.size(0)  # the rows are the step's slots, in order
        qs = q if whole else q.index_select(0, self.order)  # [N, Hkv, G, D]
        outs = []
        for group, a, b, width, bias, _ in self.runs:
            kv = group.kv[: b - a, i, :, :, :width]  # [r, 2, Hkv, W, D]
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                qs[a:b], kv[:, 0], kv[:, 1], attn_mask=bias, scale=scale))
        if read is not None:
            read.add_(self.read) if whole else read.index_add_(0, self.order, self.read)
        if whole:
            return outs[0]
        out = q.new_zeros(q.shape)
        if outs:
            out.index_copy_(0, self.order, torch.cat(outs) if len(outs) > 1 else outs[0])
        return out
