"""What the paged-cache tests share (tests/grpo/sampling/local/: test_pages.py, test_paged_attention.py, and the
interpreter's process, interpreted_kernel.py): rows that end anywhere, and one layer's pages laid out by hand."""

import torch

from grpo.configs.sampling import SamplingConfig
from grpo.sampling.draws import draw_streams
from tiny_decoders import left_padded, make_model

AS_CUDA = dict(keep_captures=True, full_cache_attention=True, buckets=True)  # the captured layout, stepped eagerly


def long_tailed(budget: int = 40, seed: int = 12, positions: int = 512, temperature: float = 1.0,
                lengths: tuple = (5, 11, 3, 7, 2, 9), repeat: int = 3):
    """18 rows (6 prompts of 2 to 11 tokens, 3 rows each) of a near-uniform model with 12 end ids in 96: rows end
    anywhere from their first token on."""
    model = make_model(head_scale=1.0, positions=positions)
    ids, mask = left_padded(list(lengths), repeat=repeat)
    u = draw_streams(ids.size(0), generator=torch.Generator().manual_seed(seed))  # [B] the rows' random streams
    return model, ids, mask, SamplingConfig(max_new_tokens=budget, temperature=temperature), u


def ragged_slots(seed: int = 0) -> dict:
    """One layer's pools (2 KV heads of 16 dims, pages of 16, 16 pages: page 0 the null page) and 6 slots, 3 query
    heads each (a group that does not fill the kernel's 16 rows):

    0 and 1 share a prompt of 20 (pages 1, 2; the second page's last 12 positions never written);
    0 has written 9 tokens of its own (page 3), 1 exactly one page (page 4: it ends on a page boundary);
    2 has a prompt of 5 (page 5) and 61 tokens (pages 6-9: past the kernel's 64-position block);
    3 is a resumed row: a prefix of its prompt (11) and the 10 tokens it had chosen, 21 positions ending mid-page
      (pages 10, 11), then 17 tokens of its own from the next page boundary (pages 12, 13: one past a boundary);
    4 has a prompt of 16 (page 14, full) and its first token (page 15);
    5 is free (at -1) and reads nothing.
    Every position outside what a slot wrote holds large values, so reading one would show."""
    g = torch.Generator().manual_seed(seed)
    page, Hkv, G, D = 16, 2, 3, 16
    k = torch.randn(Hkv, 16 * page, D, generator=g) * 50  # unwritten positions: far off
    v = torch.randn(Hkv, 16 * page, D, generator=g) * 50
    table = torch.zeros(6, 6, dtype=torch.long)  # [S, pages a row]: unused entries the null page
    rows = [([1, 2], 20, [3], 9), ([1, 2], 20, [4], 16), ([5], 5, [6, 7, 8, 9], 61), ([10, 11], 21, [12, 13], 17),
            ([14], 16, [15], 1)]
    plen, start, at = torch.zeros(6, dtype=torch.long), torch.zeros(6, dtype=torch.long), torch.full((6,), -1)
    for slot, (prefix, length, own, written) in enumerate(rows):
        table[slot, : len(prefix) + len(own)] = torch.tensor(prefix + own)
        plen[slot], start[slot] = length, len(prefix) * page
        at[slot] = start[slot] + written - 1
        for pages, n in ((prefix, length), (own, written)):  # what the row wrote: values of a unit's size
            flat = (torch.tensor(pages)[:, None] * page + torch.arange(page)).flatten()[:n]
            k[:, flat] = torch.randn(Hkv, n, D, generator=g)
            v[:, flat] = torch.randn(Hkv, n, D, generator=g)
    q = torch.randn(6, Hkv, G, D, generator=g)
    return {"q": q, "k": k, "v": v, "table": table, "plen": plen, "start": start, "at": at, "scale": D ** -0.5,
            "page": page}
