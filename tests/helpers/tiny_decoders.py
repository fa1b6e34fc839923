"""Tiny random Llama-family decoders, left-padded prompts and a naive sampling loop: what the sampler tests compare
against (tests/grpo/sampling/local/: test_static_sampler.py, test_slots.py). They compare on one thread
(conftest's `one_thread` fixture)."""

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from grpo.configs.sampling import SamplingConfig
from grpo.sampling.draws import uniform_at
from grpo.sampling.local import decode_step, slots
from grpo.sampling.local.static_sampler import choose_tokens

V, PAD, EOS = 96, 0, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]  # 12 end ids in 96: rows end after ~8 tokens
KINDS = ["qwen2", "llama", "qwen3", "mistral"]


def fp32_gap(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference relative to the largest value: fp32 rounding scales with the values, and another GEMM
    blocking (another CPU kind) rounds apart by a few 1e-6 of them (1.03e-5 absolute on logits of ~4 on a Zen 4)."""
    return ((got - want).abs().max() / want.abs().max()).item()


def make_model(kind: str = "qwen2", vocab: int = V, seed: int = 0, head_scale: float = 20.0, positions: int = 512):
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=positions, pad_token_id=PAD,
                  tie_word_embeddings=False)
    model = {"qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**common)),
             "llama": lambda: LlamaForCausalLM(LlamaConfig(**common, attention_bias=True, mlp_bias=True)),
             "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16)),
             "mistral": lambda: MistralForCausalLM(MistralConfig(**common, sliding_window=None))}[kind]()
    with torch.no_grad():
        for p in model.parameters():  # biases and norm weights start at 0 and 1: make them matter
            p.add_(torch.randn_like(p) * 0.05)
        model.lm_head.weight.mul_(head_scale)  # peakier next-token distributions than a random init's near-uniform
    return model.float().eval()


def left_padded(lengths: list[int], seed: int = 1, repeat: int = 1, vocab: int = V) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of the given lengths, left-padded; each repeated `repeat` times (a group shares a prompt)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = torch.randint(len(EOS) + 1, vocab, (n,), generator=g)
        mask[i, width - n :] = 1
    return ids.repeat_interleave(repeat, 0), mask.repeat_interleave(repeat, 0)  # [B, P] each


def forward_logits(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The model's own logits at every position of left-padded sequences: [B, T, V]."""
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits


def reference_loop(model, ids, mask, s: SamplingConfig, streams: torch.Tensor):
    """Naive sampling: a full forward over the whole sequence for every token, the same choice rule and each row's
    draws from its stream (`draws.uniform_at`)."""
    B = ids.size(0)
    done = torch.zeros(B, dtype=torch.bool)
    toks, lps, alive = [], [], []
    for k in range(s.max_new_tokens):
        full_ids = torch.cat([ids, *[t[:, None] for t in toks]], 1)
        full_mask = torch.cat([mask, *[a[:, None].long() for a in alive]], 1)
        logits = forward_logits(model, full_ids, full_mask)[:, -1]  # [B, V]
        tok, lp = choose_tokens(logits, uniform_at(streams, k), s)
        alive.append(~done)
        toks.append(tok.masked_fill(done, PAD))
        lps.append(lp.masked_fill(done, 0.0))
        done = done | torch.isin(tok, torch.tensor(EOS))
        if done.all():
            break
    return torch.stack(toks, 1), torch.stack(alive, 1).long(), torch.stack(lps, 1), ~done


def greedy_reference(model, ids, mask, budget: int):
    """Greedy decoding written apart from the engine: a full forward over the whole sequence for every token (no
    cache), its argmax, and the token's log softmax; a row stops at its first end id. (ids [B, C], mask [B, C],
    logprobs [B, C]) as the sampler returns them."""
    B = ids.size(0)
    done = torch.zeros(B, dtype=torch.bool)
    toks, lps, alive = [], [], []
    for _ in range(budget):
        full_ids = torch.cat([ids, *[t[:, None] for t in toks]], 1)
        full_mask = torch.cat([mask, *[a[:, None].long() for a in alive]], 1)
        logits = forward_logits(model, full_ids, full_mask)[:, -1]  # [B, V]
        tok = logits.argmax(-1)  # [B]
        alive.append(~done)
        toks.append(tok.masked_fill(done, PAD))
        lps.append(logits.log_softmax(-1).gather(1, tok[:, None]).squeeze(1).masked_fill(done, 0.0))
        done = done | torch.isin(tok, torch.tensor(EOS))
        if done.all():
            break
    return torch.stack(toks, 1), torch.stack(alive, 1).long(), torch.stack(lps, 1)


def allowed_tokens(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The tokens top-k then top-p sampling may draw, written apart from the engine, in float64: [..., V] bool.

    The k most likely under softmax(logits / temperature) (ties at the k-th kept), renormalised; of those, the most
    likely first, each token whose predecessors' mass is below top_p (the smallest prefix that reaches it)."""
    probs = (logits.double() / temperature).softmax(-1)  # [..., V]
    kth = probs.topk(top_k, -1).values[..., -1:]  # [..., 1]
    probs = torch.where(probs >= kth, probs, 0.0)
    probs = probs / probs.sum(-1, keepdim=True)
    ordered, order = probs.sort(-1, descending=True)
    before = ordered.cumsum(-1) - ordered  # [..., V] the mass of the tokens ahead of each
    keep = (before < top_p) & (ordered > 0)
    return torch.zeros_like(keep).scatter(-1, order, keep)


def recorded_logits(monkeypatch) -> list:
    """The logits [B, V] of each of the sampler's choices (the prefill's, then each step's), in float32, in order."""
    seen = []
    choose = decode_step.choose_tokens
    for module in (decode_step, slots):  # a row's first token is chosen as it takes a slot, the rest in the step
        monkeypatch.setattr(module, "choose_tokens", lambda logits, *a, **k: seen.append(logits.float().clone()) or
                            choose(logits, *a, **k))
    return seen
