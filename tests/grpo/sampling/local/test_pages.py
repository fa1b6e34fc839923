"""The paged KV cache (grpo.sampling.local.pages): the same tokens as the static cache, a prompt's pages written once
and read by its rows, no page lost after cancels and preemptions, a preempted row's tokens unchanged, and memory that
follows the rows' lengths, not the budget."""

import pytest
import torch

from benchmarks.bytes_alive import BytesAlive
from grpo.configs.sampling import SamplingConfig
from grpo.sampling.local.pages import PAGE_TOKENS, PagedState, page_bytes
from grpo.sampling.local.slots import SlotBatch
from grpo.sampling.local.static_sampler import StaticSampler
from paged_cases import AS_CUDA, long_tailed
from tiny_decoders import EOS, PAD, fp32_gap, left_padded, make_model

pytestmark = pytest.mark.usefixtures("one_thread")  # one thread where numbers are compared (conftest)


def assert_same_rows(got, want):
    assert torch.equal(got.completion_ids, want.completion_ids)
    assert torch.equal(got.completion_mask, want.completion_mask) and torch.equal(got.truncated, want.truncated)
    assert fp32_gap(got.logprobs, want.logprobs) <= 1e-5


def test_the_rows_of_a_prompt_read_its_pages_written_once():
    model = make_model(head_scale=1.0)
    ids, mask = left_padded([20])  # two pages of 16
    batch = SlotBatch(StaticSampler(model), 4, ids.size(1), SamplingConfig(max_new_tokens=8, temperature=1.0), [],
                      PAD)  # no end token: every row decodes its 8
    st = batch.state
    assert isinstance(st, PagedState)
    batch.submit(ids[0], mask[0], n=4)
    batch.step()
    prompt_pages = st.table[0, :2].tolist()
    assert all(st.table[slot, :2].tolist() == prompt_pages for slot in range(4))
    assert [st.pool.refs[p] for p in prompt_pages] == [4, 4]
    assert st.pool.in_use == 2 + 4  # the prompt's two pages, once, and one page each row writes its tokens in
    assert len({st.table[slot, 2].item() for slot in range(4)}) == 4
    while batch.busy:
        batch.step()
    assert st.pool.in_use == 0 and not st.resident


def test_no_page_is_lost_after_many_calls_cancels_and_preemptions():
    model, ids, mask, s, u = long_tailed()
    # room for 7 pages: rows wait for pages and are preempted
    sampler = StaticSampler(model, memory_budget=8 * page_bytes(model, torch.float32))
    batch = SlotBatch(sampler, 6, ids.size(1), s, EOS, PAD)
    st = batch.state
    for round_ in range(3):
        keys = []
        for row in range(0, ids.size(0), 3):
            keys += batch.submit(ids[row], mask[row], u[row:row + 3], n=3)
        for _ in range(3):
            batch.step()
        batch.cancel(keys[round_])  # decoding, or waiting
        batch.cancel(keys[-1])  # waiting
        while batch.busy:
            batch.step()
    assert sampler.counts.preemptions > 0
    assert st.pool.in_use == 0 and not st.resident and not any(st.pool.refs)
    assert sorted(st.pool.free) == list(range(1, st.pool.size))  # every page back once, the null page never out


def test_a_preempted_row_ends_with_the_tokens_it_would_have_had():
    model, ids, mask, s, u = long_tailed()
    roomy = StaticSampler(model).sample(ids, mask, s, EOS, PAD, streams=u, slots=6)
    tight = StaticSampler(model, memory_budget=10 * page_bytes(model, torch.float32))
    got = tight.sample(ids, mask, s, EOS, PAD, streams=u, slots=6)
    assert tight.counts.preemptions >= 3
    assert_same_rows(got, roomy)


def test_a_budget_too_small_for_one_row_is_refused_before_any_step():
    model, ids, mask, s, u = long_tailed()
    with pytest.raises(ValueError, match="holds no row: one row of 11 prompt and 40 new tokens takes up to 5 pages"):
        StaticSampler(model, memory_budget=4 * page_bytes(model, torch.float32)).sample(ids, mask, s, EOS, PAD,
                                                                                        streams=u)


def test_a_16k_budget_allocates_by_the_rows_lengths_and_samples_the_512_budgets_tokens():
    model, ids, mask, s, u = long_tailed(budget=16384, positions=16384 + 16)
    short = SamplingConfig(max_new_tokens=512, temperature=1.0)
    peaks, sampled = {}, {}
    for name, cfg in [("paged 512", short), ("paged 16k", s)]:
        sampler = StaticSampler(model)
        with BytesAlive() as alive:
            sampled[name] = sampler.sample(ids, mask, cfg, EOS, PAD, streams=u)
        peaks[name] = alive.peak
    assert sampled["paged 16k"].completion_mask.sum(1).max() < 200  # the rows are short
    assert_same_rows(sampled["paged 16k"], sampled["paged 512"])
    # what a static cache of P + budget positions a slot took: layers, K and V, rows, heads, positions, dims, bytes
    static_kv = 2 * 2 * ids.size(0) * 2 * (16384 + ids.size(1)) * 16 * 4
    # the paged call's K/V is the rows' pages (~0.6 MB); what it holds beyond the 512 one is the budget's per-row
    # bookkeeping (tokens, log-probs), a tenth of the static cache's K/V
    assert peaks["paged 16k"] < static_kv / 4, peaks


def test_the_counts_a_stage_logs_add_up():
    model, ids, mask, s, u = long_tailed()
    sampler = StaticSampler(model, memory_budget=8 * page_bytes(model, torch.float32))  # tight: rows are preempted
    out = sampler.sample(ids, mask, s, EOS, PAD, streams=u, slots=6)
    counts = sampler.counts.take()
    assert sampler.counts.steps == 0 and sampler.counts.tokens == 0  # taken: the next step's counts start at 0
    assert counts.tokens == int(out.completion_mask.sum()) and counts.samples == ids.size(0)
    f = counts.figures()
    decoded = counts.tokens - counts.samples  # each row's first token came from its prefill
    assert f["sampler/live_share"] == decoded / counts.rows_computed <= 1
    assert f["sampler/kv_read_per_token"] == counts.kv_positions_read / decoded
    assert f["sampler/preemptions"] == counts.preemptions > 0 and f["sampler/pages_high_water"] <= 7
    assert counts.figures() and sampler.counts.figures() == {}  # nothing decoded since the take


def wrote_and_read_bound(prompt_lengths: list[int], lengths: list[int]) -> tuple[int, int]:
    """What the decode steps of rows of these prompt lengths and token counts wrote before each read, summed: a row of
    p prompt tokens and n chosen has its first from the prefill and token j (1 <= j < n) from a step that reads its
    p prompt positions and the j tokens before it. And the most a step may read past that: under a page a row."""
    wrote = sum((n - 1) * p + n * (n - 1) // 2 for p, n in zip(prompt_lengths, lengths))
    return wrote, (PAGE_TOKENS - 1) * sum(n - 1 for n in lengths if n > 0)


def test_the_eager_steps_read_what_the_rows_wrote_up_to_a_page():
    """Counted where attention reads (each row in its group, `length_rows`): each live row's prompt and tokens, and
    less than a page more (a group is as wide as its longest row, whose page count every row of it has). The
    captured layout on the kernel reads exactly what the rows wrote (test_paged_attention.py)."""
    model, ids, mask, s, u = long_tailed()
    sampler = StaticSampler(model)
    out = sampler.sample(ids, mask, s, EOS, PAD, streams=u)
    lengths, c = out.completion_mask.sum(1), sampler.counts  # [B]
    wrote, slack = wrote_and_read_bound(mask.sum(1).tolist(), lengths.tolist())
    assert lengths.max() > PAGE_TOKENS and lengths.min() < lengths.max()  # ragged, and past a page of a row's own
    assert wrote <= c.kv_positions_read <= wrote + slack, (wrote, c.kv_positions_read)


def long_row_among_short_ones(budget: int, long: int = 200) -> tuple[dict, object, int]:
    """24 rows (6 prompts of 2 to 11 tokens, 4 rows each) through 8 slots at `budget`: the first row stops at `long`
    tokens, every other at 1 to 4 (their limits; no end token). The rows' tokens by key, the counts, and the most
    bytes of tensors alive at once during the call (the batch and its state made inside it)."""
    model, ids, mask, _, u = long_tailed(positions=16384 + 64, lengths=(5, 11, 3, 7, 2, 9), repeat=4)
    limits = [long] + [1 + i % 4 for i in range(1, ids.size(0))]
    sampler = StaticSampler(model)
    got = {}
    with BytesAlive() as alive:
        batch = SlotBatch(sampler, 8, ids.size(1), SamplingConfig(max_new_tokens=budget, temperature=1.0), [], PAD)
        for row in range(ids.size(0)):
            batch.submit(ids[row], mask[row], u[row:row + 1], keys=[row], limit=min(limits[row], budget))
        while batch.busy:
            got.update({e.key: e.ids[e.alive].tolist() for e in batch.step()})
    return got, sampler.counts, alive.peak


def test_one_long_row_among_short_ones_takes_and_reads_k_v_by_the_rows_lengths_at_any_budget():
    """One row of 200 tokens among 23 of 1 to 4: the K/V the call holds follows the rows' lengths (the pool the
    rows' pages are in, and each row once more, by its length), not 8 slots as wide as the longest (what the eager
    step held before: every slot's row as wide as the longest live one); attention reads what the rows wrote, up to a
    page a row; and at a budget of 16384 the rows sample the tokens of 512 with the same bytes alive at the peak, to
    the byte: nothing is sized by the budget (the chosen tokens' columns, the rotary table and the block tables grow
    with the rows)."""
    position = 2 * 2 * 2 * 16 * 4  # layers, K and V, KV heads, head dim, fp32: 512 bytes a position
    runs = {budget: long_row_among_short_ones(budget) for budget in (512, 16384)}
    (got, counts, peak), (got_16k, counts_16k, peak_16k) = runs[512], runs[16384]
    assert got_16k == got and len(got[0]) == 200 and max(len(t) for k, t in got.items() if k) <= 4
    longest = (5 + 200) * position  # the long row's prompt and tokens
    assert counts.kv_bytes_allocated == counts_16k.kv_bytes_allocated <= 4 * longest, counts
    assert 8 * longest > 2 * counts.kv_bytes_allocated  # what 8 slots as wide as the longest row would hold
    _, ids, mask, _, _ = long_tailed(lengths=(5, 11, 3, 7, 2, 9), repeat=4)
    wrote, slack = wrote_and_read_bound(mask.sum(1).tolist(), [len(got[k]) for k in range(ids.size(0))])
    assert wrote <= counts.kv_positions_read == counts_16k.kv_positions_read <= wrote + slack
    assert peak_16k == peak


def test_kept_shapes_share_one_pool_and_each_call_starts_with_every_page_free():
    model, ids, mask, s, u = long_tailed()
    sampler = StaticSampler(model, memory_budget=40 * page_bytes(model, torch.float32), **AS_CUDA)
    short = SamplingConfig(max_new_tokens=24, temperature=1.0)
    first = sampler.sample(ids, mask, s, EOS, PAD, streams=u)
    sampler.sample(ids, mask, short, EOS, PAD, streams=u)  # another shape: its own state, the same pages
    states = [c.state for c in sampler._captures.values()]
    assert len(states) == 2 and states[0].k is states[1].k and states[0].pools is states[1].pools
    assert states[0].pools.size <= 40  # grown as rows needed, never past the budget
    again = sampler.sample(ids, mask, s, EOS, PAD, streams=u)  # the first shape again, over pages the second wrote
    assert_same_rows(again, first)
    assert all(st.pool.in_use == 0 for st in states)
