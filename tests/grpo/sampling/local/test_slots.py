"""Continuous batching: rows stream through a fixed number of slots, a slot taking the next row when its own ends;
each row's tokens equal its prompt sampled alone, no decode step computes an ended row, groups come out as they
complete, and a slot batch takes rows while it decodes (what `r1 serve` does)."""

import pytest
import torch

from grpo.configs.sampling import SamplingConfig
from grpo.sampling.draws import draw_streams
from grpo.sampling.local import decode_step
from grpo.sampling.local.slots import SlotBatch
from grpo.sampling.local.static_sampler import StaticSampler
from tiny_decoders import EOS, PAD, V, fp32_gap, left_padded, make_model

pytestmark = pytest.mark.usefixtures("one_thread")  # one thread where numbers are compared (conftest)
CUDA_LIKE = dict(keep_captures=True, full_cache_attention=True, buckets=True)  # what CUDA runs, but for the graphs


def long_tailed(n_prompts: int = 6, repeat: int = 3, budget: int = 40, seed: int = 12):
    """Prompts of several lengths and a near-uniform model with 12 end ids in 96: completions of 1 to `budget`."""
    model = make_model(head_scale=1.0)
    ids, mask = left_padded([5, 11, 3, 7, 2, 9][:n_prompts], repeat=repeat)
    u = draw_streams(ids.size(0), generator=torch.Generator().manual_seed(seed))  # [B] the rows' random streams
    return model, ids, mask, SamplingConfig(max_new_tokens=budget, temperature=1.0), u


@pytest.mark.parametrize("mode", [{}, CUDA_LIKE], ids=["eager", "cuda-like"])
def test_a_refilled_row_equals_its_prompt_sampled_alone(mode):
    model, ids, mask, s, u = long_tailed()
    sampler = StaticSampler(model, **mode)
    streamed = sampler.sample(ids, mask, s, EOS, PAD, streams=u, slots=2)  # 18 rows through 2 slots
    lengths = streamed.completion_mask.sum(1)
    assert lengths.min() < 8 and lengths.max() >= 20  # the rows end far apart: slots are refilled many times
    for row in range(ids.size(0)):
        n = int(mask[row].sum())
        alone = StaticSampler(model, **mode).sample(ids[row:row + 1, -n:], mask[row:row + 1, -n:], s, EOS, PAD,
                                                    streams=u[row:row + 1])
        k = int(lengths[row])
        assert alone.completion_ids.size(1) == k
        assert torch.equal(alone.completion_ids[0], streamed.completion_ids[row, :k])
        assert torch.equal(alone.truncated[0], streamed.truncated[row])
        assert fp32_gap(streamed.logprobs[row, :k], alone.logprobs[0]) <= 1e-5


def test_the_slot_count_changes_no_token():
    model, ids, mask, s, u = long_tailed()
    runs = [StaticSampler(model).sample(ids, mask, s, EOS, PAD, streams=u, slots=k) for k in (1, 3, 7, 18)]
    for other in runs[1:]:
        assert torch.equal(runs[0].completion_ids, other.completion_ids)
        assert torch.equal(runs[0].completion_mask, other.completion_mask)
        assert torch.equal(runs[0].truncated, other.truncated)
        assert fp32_gap(other.logprobs, runs[0].logprobs) <= 1e-5


def test_a_decode_step_computes_no_finished_row(monkeypatch):
    model, ids, mask, s, u = long_tailed(repeat=4)
    steps = []  # (rows the step computes, how many of them had already ended)
    decode = decode_step._decode

    def counted(st, *a):
        steps.append((st.tok.size(0), int((st.done | (st.n >= st.C)).sum())))
        return decode(st, *a)

    monkeypatch.setattr(decode_step, "_decode", counted)
    sampler = StaticSampler(model)
    out = sampler.sample(ids, mask, s, EOS, PAD, streams=u, slots=5)
    assert steps and all(finished == 0 for _, finished in steps)
    assert max(rows for rows, _ in steps) == 5 and min(rows for rows, _ in steps) <= 2  # the tail shrinks
    # each token after a row's first came from one decode step of that row, and no step computed anything else
    tokens, samples = int(out.completion_mask.sum()), ids.size(0)
    assert sum(rows for rows, _ in steps) == tokens - samples == sampler.counts.rows_computed
    assert sampler.counts.steps == len(steps)


def test_groups_are_handed_out_as_each_completes():
    model, ids, mask, s, u = long_tailed(repeat=3)
    sampler = StaticSampler(model)
    whole = StaticSampler(model).sample(ids, mask, s, EOS, PAD, streams=u, slots=6)
    seen, at_step = [], []
    for group in sampler.stream(ids, mask, s, EOS, PAD, group_size=3, streams=u, slots=6):
        seen.append(group.rows)
        at_step.append(sampler.counts.steps)
        k = group.sampled.completion_ids.size(1)
        assert k == int(group.sampled.completion_mask.sum(1).max())  # as wide as its own longest
        assert torch.equal(group.sampled.completion_ids, whole.completion_ids[group.rows.start:group.rows.stop, :k])
        assert torch.equal(group.sampled.truncated, whole.truncated[group.rows.start:group.rows.stop])
    assert sorted(r.start for r in seen) == [0, 3, 6, 9, 12, 15]
    assert at_step[0] < at_step[-1]  # the first group came out while the slots still decoded the others
    with pytest.raises(ValueError, match="group_size"):
        next(sampler.stream(ids, mask, s, EOS, PAD, group_size=4))


def test_a_finished_slot_a_step_still_computes_stays_as_it_is():
    # a captured step computes its whole bucket between the host's checks: ended slots write the dump column only
    model = make_model()
    st = decode_step.SlotState(model, 3, 4, 5, torch.float32, torch.device("cpu"))
    st.done[:] = torch.tensor([False, True, False])
    st.n[:] = torch.tensor([2, 3, 5])  # the last has used its whole budget
    st.ids[:, :5] = 7
    before = st.ids.clone(), st.alive.clone(), st.n.clone()
    logits = torch.zeros(3, V)
    logits[:, 40] = 50.0
    decode_step._choose(st, logits, SamplingConfig(max_new_tokens=5, temperature=0), torch.tensor(EOS), PAD, True)
    assert st.ids[0, 2] == 40 and bool(st.alive[0, 2]) and st.n[0] == 3  # the live slot chose its third token
    assert torch.equal(st.ids[1:, :5], before[0][1:, :5]) and torch.equal(st.alive[1:, :5], before[1][1:, :5])
    assert torch.equal(st.n[1:], before[2][1:]) and not st.done[2]  # a row at its budget stays truncated
    assert decode_step.row_buckets(128) == [128, 64, 32, 16, 8] and decode_step.row_buckets(6) == [6]


def test_a_slot_batch_takes_rows_while_it_decodes_and_streams_their_tokens():
    # what `r1 serve` does with requests that come and go: rows submitted mid-decode, a row cancelled, a row with
    # a smaller limit; each row's tokens equal its prompt sampled alone, and the streamed pieces join to them
    model, ids, mask, s, u = long_tailed(n_prompts=4, repeat=1)
    sampler = StaticSampler(model)
    batch = SlotBatch(sampler, 2, ids.size(1), s, EOS, PAD)
    streamed, ended = {}, {}

    def run(steps: int | None = None) -> None:
        for _ in range(steps or 10**6):
            if not batch.busy:
                return
            for e in batch.step():
                ended[e.key] = e
            for key, (toks, _) in batch.new_tokens().items():
                streamed.setdefault(key, []).extend(toks)

    first = batch.submit(ids[0], mask[0], u[:1])
    run(3)  # decoding the first row when the others come
    later = batch.submit(ids[1], mask[1], u[1:2]) + batch.submit(ids[2], mask[2], u[2:3], limit=3)
    gone = batch.submit(ids[3], mask[3], u[3:4])
    batch.cancel(gone[0])
    run()
    assert sorted(ended) == sorted(first + later) and gone[0] not in ended
    for key, row, limit in ((first[0], 0, 40), (later[0], 1, 40), (later[1], 2, 3)):
        n = int(mask[row].sum())
        alone = StaticSampler(model).sample(ids[row:row + 1, -n:], mask[row:row + 1, -n:],
                                            s.model_copy(update={"max_new_tokens": limit}), EOS, PAD,
                                            streams=u[row:row + 1])
        k = int(ended[key].alive.sum())
        assert torch.equal(ended[key].ids[:k], alone.completion_ids[0]) and k <= limit
        assert ended[key].truncated == bool(alone.truncated[0])
        assert streamed[key] == ended[key].ids[:len(streamed[key])].tolist() and len(streamed[key]) >= k - 1
    with pytest.raises(ValueError, match="limit"):
        batch.submit(ids[0], mask[0], limit=41)


def test_the_engine_streams_each_prompts_group_as_generate_samples_it():
    from grpo.configs.model import TinyModelConfig
    from grpo.sampling.local.backend import TransformersBackend
    from grpo.tiny import build_tiny_model, build_tokenizer

    tok = build_tokenizer()
    model = build_tiny_model(TinyModelConfig(num_hidden_layers=1), tok).eval()
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] *= 12  # tied: completions end anywhere from 1 token to the budget
    engine = TransformersBackend(model, tok)
    prompts = [f"What is {a} + {a + 7}?" for a in range(6)]
    s = SamplingConfig(max_new_tokens=48, temperature=1.0, batch_size=4)
    torch.manual_seed(3)
    whole = engine.generate(prompts, 3, s, logprobs=True)
    torch.manual_seed(3)
    got = list(engine.stream(prompts, 3, s, logprobs=True))
    assert sorted(i for i, _ in got) == list(range(6)) and [i for i, _ in got] != list(range(6))  # out of order
    lengths = whole.completion_tokens
    assert lengths.min() < 8 and lengths.max() > 24
    for i, part in got:
        rows = slice(3 * i, 3 * i + 3)
        k = part.completion_ids.size(1)
        assert part.texts == whole.texts[rows] and torch.equal(part.truncated, whole.truncated[rows])
        assert torch.equal(part.completion_ids, whole.completion_ids[rows, :k])
        assert torch.equal(part.prompt_ids, whole.prompt_ids[rows])
        assert fp32_gap(part.logprobs, whole.logprobs[rows, :k]) <= 1e-5
