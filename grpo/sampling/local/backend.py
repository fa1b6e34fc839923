"""The local engine: sampling with a transformers causal LM in this process (`grpo.sampling.engines` picks it).

It returns what GRPO needs and `model.generate` does not hand back cheaply: the completion token ids, their mask,
and the sampling policy's log-probability of every sampled token (what truncated importance sampling and `r1
serve`'s logprobs read: the tempered full distribution's, before top-k/top-p, as the trainer computes it; `_pick`).
Llama-family decoders (Qwen2, Qwen3, Llama, Mistral) sample through `grpo.sampling.local.static_sampler` (a static KV
cache, CUDA graphs on a GPU, from a bf16 copy where the stage computes in bf16; LoRA adapters included); any other
model, or one the static step cannot compute exactly (hooks, DoRA, quantized projections), through the decode loop
below (`cpu_decoder` for plain Qwen2/Llama models, the model's own forward otherwise), which stops as
soon as every sequence has ended. Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from grpo.configs.sampling import SamplingConfig
from grpo.data.tables import as_messages
from grpo.models import cached
from grpo.sampling.draws import draw_streams, uniform_at
from grpo.sampling.local.cpu_decoder import LeanDecoder
from grpo.sampling.local.static_sampler import StaticSampler, distinct_rows, inverse_cdf
from grpo.sampling.rollout import Rollout, cat_padded

log = logging.getLogger(__name__)
_REPORTED: set[str] = set()  # fallback reasons already logged: once each, not once a batch


def render_prompts(tokenizer: PreTrainedTokenizerBase, prompts: list) -> list[str]:
    """Prompt cells (strings or chat messages) as the text the model sees, ending where the assistant begins."""
    return [tokenizer.apply_chat_template(as_messages(p), add_generation_prompt=True, tokenize=False) for p in prompts]


def response_text(tokenizer: PreTrainedTokenizerBase, cell, prompt: str, response: str) -> str:
    """The response as the chat template closes an assistant turn (e.g. `...<|im_end|>` for Qwen).

    Rendering the whole conversation and cutting off the prompt keeps whatever end-of-turn marker the template
    uses, which for base models is often not `tokenizer.eos_token`. Templates that rewrite earlier turns (some
    strip reasoning from history) do not render the prompt as a prefix; those fall back to response + eos.
    """
    full = tokenizer.apply_chat_template(as_messages(cell) + [{"role": "assistant", "content": response}],
                                         tokenize=False)
    if full.startswith(prompt) and response in full[len(prompt):]:
        return full[len(prompt):]
    return response + tokenizer.eos_token


def _pick(logits: torch.Tensor, s: SamplingConfig, u: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose the next token of each row at its draw `u` [B] (None at temperature 0); return it and its log-prob
    under the tempered full distribution.

    The token is drawn from the distribution after temperature, top-k and top-p (as `choose_tokens`); its log-prob
    is log softmax(logits / temperature) before the cut-offs (at temperature 0 the plain log softmax, the
    argmax's), the number the trainer computes for it (`token_logps` at the sampling temperature), whose policy is
    that distribution. The truncated distribution's own log-prob is that less log(kept mass): pi_train /
    pi_sampler would be < 1 on every token, a biased importance weight (TRL issue #7120). The log-sum-exp is
    taken before the cut-offs, and the chosen token's logit survives them: no extra full-vocabulary tensor.
    """
    logits = logits.float()  # [B, V]
    if s.temperature == 0:
        logp = torch.log_softmax(logits, -1)
        tok = logp.argmax(-1)  # [B]
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
    if s.temperature != 1.0:  # dividing by 1 changes nothing: skip the full-vocab pass
        logits = logits / s.temperature
    lse = logits.logsumexp(-1)  # [B] the tempered full distribution's, before top-k/top-p
    if s.top_k:
        kth = torch.topk(logits, min(s.top_k, logits.size(-1)), dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > s.top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    # one uniform per row by inverting the CDF (as the static sampler: a seed picks the same tokens there and here),
    # instead of multinomial's one exponential per vocabulary entry (most of a small model's sampling time)
    tok = inverse_cdf(torch.log_softmax(logits, -1).exp(), u)  # [B] from the truncated distribution
    # the chosen token survived the cut-offs, so its entry is still its tempered logit
    return tok, logits.gather(-1, tok[:, None]).squeeze(-1) - lse


@torch.inference_mode()
def sample_batch(model: PreTrainedModel, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, s: SamplingConfig,
                 eos_ids: list[int], pad_id: int, dtype: torch.dtype | None = None,
                 sampler: StaticSampler | None = None, logprobs: bool = True,
                 fp32_gemm: str = "auto") -> tuple[torch.Tensor | None, ...]:
    """Decode one batch of left-padded prompts; returns (completion_ids, completion_mask, logprobs, truncated).

    With a `sampler` (a StaticSampler of `model`) that computes the model exactly, it samples; otherwise (no
    sampler, or a reason it cannot, logged once) the decode loop below does, under autocast to `dtype` where that
    is not the weights' own. logprobs: whether the static sampler computes the chosen tokens' log-probs (None
    without; the decode loop has them anyway).
    """
    if sampler is not None:
        reason = sampler.unsupported_reason(prompt_ids.size(1) + s.max_new_tokens)
        if reason is None:
            return tuple(sampler.sample(prompt_ids, prompt_mask, s, eos_ids, pad_id, return_logprobs=logprobs))
        if reason not in _REPORTED:
            _REPORTED.add(reason)
            log.info("static sampler off (%s): decoding through the model's forward, step by step", reason)
    device = next(model.parameters()).device
    ids, mask = prompt_ids.to(device), prompt_mask.to(device)  # [B, P]
    B = ids.size(0)
    eos = torch.tensor(eos_ids, device=device)
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, P] positions that ignore left padding
    autocast = dtype is not None and dtype != next(model.parameters()).dtype
    amp = torch.autocast(device.type, dtype=dtype) if autocast else contextlib.nullcontext()
    with amp:
        logits, cache = _prefill(model, ids, mask, pos)  # [B, V]
    next_pos = pos[:, -1] + 1  # [B]
    # autocast changes every op's dtype, which the lean path does not mirror: it keeps to the HF loop
    step = None if autocast else LeanDecoder.build(model, cache, mask, next_pos, s.max_new_tokens, fp32_gemm)
    if step is None:
        step = _HFDecoder(model, cache, mask, next_pos, amp)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    # each row's random stream, as the static sampler draws it for a batch of B rows (`draws`): the same seed, the
    # same tokens through either; greedy draws none
    streams = draw_streams(B, device) if s.temperature else None  # [B]
    toks, lps, alive = [], [], []
    for i in range(s.max_new_tokens):
        tok, lp = _pick(logits, s, uniform_at(streams, i) if streams is not None else None)  # [B], [B]
        alive.append(~done)
        toks.append(tok.masked_fill(done, pad_id))
        lps.append(lp.masked_fill(done, 0.0))
        done = done | torch.isin(tok, eos)
        if i == s.max_new_tokens - 1 or bool(done.all()):  # no decode step for a token nobody will read
            break
        logits = step(toks[-1])  # [B, V]
    completion_ids = torch.stack(toks, 1)  # [B, L] L: the steps its longest row took, not the budget
    completion_mask = torch.stack(alive, 1).long()  # [B, L]
    return completion_ids.cpu(), completion_mask.cpu(), torch.stack(lps, 1).float().cpu(), (~done).cpu()


def _prefill(model: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor,
             pos: torch.Tensor) -> tuple[torch.Tensor, DynamicCache]:
    """Next-token logits and the KV cache of every row, running each distinct prompt only once.

    The n rows of a group share their prompt, so one forward per prompt and a row gather of its cache give the
    same numbers as N forwards for a fraction of the work.
    """
    inverse, first = distinct_rows(torch.cat([ids, mask.to(ids.dtype)], 1))  # [B], [U]
    cache = DynamicCache()
    logits = model(input_ids=ids[first], attention_mask=mask[first], position_ids=pos[first], **cached(cache),
                   logits_to_keep=1).logits[:, -1]  # [U, V]
    if not torch.equal(first, torch.arange(ids.size(0), device=ids.device)):
        # [U, ...] -> [B, ...]; also when every row is distinct, since `first` then lists them in sorted order
        cache.reorder_cache(inverse)
    return logits[inverse], cache  # [B, V]


class _HFDecoder:
    """One decode step through the model's own forward: works for any causal LM that takes a DynamicCache."""

    def __init__(self, model: PreTrainedModel, cache: DynamicCache, mask: torch.Tensor, next_pos: torch.Tensor,
                 amp):
        self.model, self.cache, self.mask, self.pos, self.amp = model, cache, mask, next_pos[:, None], amp

    def __call__(self, tok: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)  # [B, P+t+1]
        with self.amp:
            logits = self.model(input_ids=tok[:, None], attention_mask=self.mask, position_ids=self.pos,
                                **cached(self.cache)).logits[:, -1]  # [B, V]
        self.pos = self.pos + 1
        return logits


class TransformersBackend:
    """Sampling with a transformers causal LM on whatever device it sits on.

    dtype: the weights to sample with (None: the model's own; bf16 over fp32 weights: the static sampler samples
    from a bf16 copy, the decode loop under bf16 autocast). static: use the static sampler where it can (False: the
    decode loop always). kv_cache_bytes: the static sampler's KV cache budget (None: half the free memory of a GPU,
    no limit on a CPU); a batch over it is sampled in parts. `grpo.sampling.engines.build_engine` builds it from a
    stage's `generation` section.
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, dtype: torch.dtype | None = None,
                 static: bool = True, kv_cache_bytes: int | None = None, fp32_gemm: str = "auto"):
        self.model, self.tokenizer, self.dtype, self.fp32_gemm = model, tokenizer, dtype, fp32_gemm
        self.eos_ids = sorted({tokenizer.eos_token_id, *_extra_eos(model)})
        self.sampler = StaticSampler(model, dtype=dtype, memory_budget=kv_cache_bytes,
                                     fp32_gemm=fp32_gemm) if static else None

    def sync_weights(self) -> None:
        """Make the next sampling use the model's current weights: refresh the bf16 copy and the captured steps'
        weights, where there are any (a trainer calls it after each optimizer step; a fused optimizer's step leaves
        no trace the sampler could see for itself)."""
        if self.sampler is not None:
            self.sampler.sync_weights(self.model)

    def decode_figures(self) -> dict[str, float]:
        """What the slots' decode steps did since the last call (`DecodeCounts.figures`: `sampler/...`), for a stage
        to log with its step; empty without the static sampler."""
        return self.sampler.counts.take().figures() if self.sampler is not None else {}

    def _streams(self, total_len: int) -> bool:
        """Whether rows go through the static sampler's slots (else the decode loop, a batch at a time)."""
        return self.sampler is not None and self.sampler.unsupported_reason(total_len) is None

    def generate(self, prompts: list, n: int, sampling: SamplingConfig, *, logprobs: bool = False) -> Rollout:
        """`n` completions of each prompt; with `logprobs`, each sampled token's log-prob under the sampler."""
        return self.generate_from_text(render_prompts(self.tokenizer, prompts), n, sampling, logprobs=logprobs)

    def sample_ids(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: SamplingConfig,
                   eos_ids: list[int] | None = None, logprobs: bool = True) -> tuple[torch.Tensor | None, ...]:
        """One batch of left-padded prompt ids through this engine's sampler (`sample_batch`'s four tensors)."""
        return sample_batch(self.model, prompt_ids, prompt_mask, sampling,
                            self.eos_ids if eos_ids is None else eos_ids, self.tokenizer.pad_token_id, self.dtype,
                            self.sampler, logprobs, self.fp32_gemm)

    def generate_from_text(self, texts: list[str], n: int, sampling: SamplingConfig, add_special_tokens: bool = False,
                           *, logprobs: bool = False) -> Rollout:
        """Sample `n` continuations of each text as it is (no chat template: `/v1/completions` does this)."""
        tok = self.tokenizer
        tok.padding_side = "left"
        enc = tok(texts, padding=True, return_tensors="pt", add_special_tokens=add_special_tokens)
        prompt_ids = enc["input_ids"].repeat_interleave(n, 0)  # [N, P]
        prompt_mask = enc["attention_mask"].repeat_interleave(n, 0)  # [N, P]
        was_training = self.model.training
        self.model.eval()
        parts = []
        try:
            if self._streams(prompt_ids.size(1) + sampling.max_new_tokens):
                # continuous batching: every row streams through batch_size slots, a slot taking the next row as
                # soon as its own ends, instead of each batch decoding until its longest row ends
                parts.append(tuple(self.sampler.sample(prompt_ids, prompt_mask, sampling, self.eos_ids,
                                                       tok.pad_token_id, return_logprobs=logprobs,
                                                       slots=sampling.batch_size)))
            else:
                for i in range(0, prompt_ids.size(0), sampling.batch_size):
                    sl = slice(i, i + sampling.batch_size)
                    parts.append(self.sample_ids(prompt_ids[sl], prompt_mask[sl], sampling, logprobs=logprobs))
        finally:
            self.model.train(was_training)
        completion_ids = cat_padded([p[0] for p in parts], tok.pad_token_id)  # [N, C]
        completion_mask = cat_padded([p[1] for p in parts], 0)  # [N, C]
        token_logps = cat_padded([p[2] for p in parts], 0.0) if logprobs else None  # [N, C]
        truncated = torch.cat([p[3] for p in parts])  # [N]
        texts = tok.batch_decode(completion_ids.masked_fill(completion_mask == 0, tok.pad_token_id),
                                 skip_special_tokens=True)
        return Rollout(texts, truncated, prompt_ids, prompt_mask, completion_ids, completion_mask, token_logps)


    def stream(self, prompts: list, n: int, sampling: SamplingConfig, *,
               logprobs: bool = False) -> Iterator[tuple[int, Rollout]]:
        """`generate`, a prompt at a time: (the prompt's index, its `n` completions) as soon as the last of them ends,
        in the order groups complete, so a consumer scores and trains on the first groups while the slots decode
        the rest. The same seed gives each group what `generate` gives it. A model the static sampler does not
        compute is sampled whole by the decode loop, then handed out prompt by prompt."""
        tok = self.tokenizer
        tok.padding_side = "left"
        enc = tok(render_prompts(tok, prompts), padding=True, return_tensors="pt", add_special_tokens=False)
        prompt_ids = enc["input_ids"].repeat_interleave(n, 0)  # [N, P]
        prompt_mask = enc["attention_mask"].repeat_interleave(n, 0)  # [N, P]
        if not self._streams(prompt_ids.size(1) + sampling.max_new_tokens):
            whole = self.generate(prompts, n, sampling, logprobs=logprobs)
            for i in range(len(prompts)):
                rows = slice(i * n, (i + 1) * n)
                yield i, Rollout(whole.texts[rows], *(None if t is None else t[rows] for t in whole[1:]))
            return
        was_training = self.model.training
        self.model.eval()
        try:
            for group in self.sampler.stream(prompt_ids, prompt_mask, sampling, self.eos_ids, tok.pad_token_id,
                                             group_size=n, return_logprobs=logprobs, slots=sampling.batch_size):
                out, rows = group.sampled, slice(group.rows.start, group.rows.stop)
                texts = tok.batch_decode(out.completion_ids.masked_fill(out.completion_mask == 0, tok.pad_token_id),
                                         skip_special_tokens=True)
                yield group.rows.start // n, Rollout(texts, out.truncated, prompt_ids[rows], prompt_mask[rows],
                                                     out.completion_ids, out.completion_mask, out.logprobs)
        finally:
            self.model.train(was_training)


def _extra_eos(model: PreTrainedModel) -> list[int]:
    """End-of-turn ids a real model's generation config lists besides the tokenizer's eos."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)
