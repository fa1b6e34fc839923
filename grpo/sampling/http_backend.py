"""Generation from OpenAI-compatible servers: prompts sent to one or more `/v1/completions` endpoints.

For rejection sampling at scale, where the samples come from servers that batch continuously (vLLM, SGLang, TGI
in production; `r1 serve` in tests). The prompts are rendered here with the checkpoint's chat template, exactly
as `TransformersBackend` renders them, and sent as plain text (`add_special_tokens: false`, so no second BOS), so
a sample has the same form whichever backend drew it.

How the work is spread, and what a dead server costs:
- One request is one sample (`n: 1`). The server's `usage.completion_tokens` is then that sample's length (with
  `n > 1` only the sum is given), and each sample carries a seed of its own, derived from the shard's seed and
  its place in the shard, so a sample drawn again, by this endpoint or another, is the same sample. vLLM and
  SGLang cache the shared prompt prefix, so k requests of one prompt cost about what one request with n = k does.
- One pool of endpoints per backend object (a process's shard tasks share it): each endpoint has at most
  `max_in_flight` requests at once, and a request goes to the live endpoint with the fewest in flight, so a
  faster server takes more of the work. The shard is the unit of writing, not of spreading: its samples go to
  every endpoint.
- A sample whose request fails in a way that may pass (connection refused or reset, a timeout, HTTP 5xx or 429) is
  retried after a backoff, on another endpoint where one is live. An endpoint is marked dead at once when nothing
  listens (connection refused), or after `max_failures` failures in a row; its samples then go to the others. It
  stays dead for the life of the backend: a rerun resumes from the shards already written, with whichever
  endpoints the recipe then lists.
- `generate` returns only when every sample of the shard is back, and the stage writes the shard's file once,
  atomically (`grpo.rejection.shards`); a shard that fails (every endpoint dead, a sample out of retries, a request
  refused with a 4xx, which no other endpoint would take either) writes nothing, and its rerun starts it afresh.
  So no sample is lost or written twice, whichever server dies when.
- `check_available` is the pre-flight: every endpoint answers GET /models, lists the model, and completes one
  token; any that does not is named in one error before a shard is sampled.

What it returns is a text-only `Rollout` (texts, truncation, token counts): enough for rejection sampling, not for
GRPO, which needs token ids. Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from grpo.configs.sampling import GenerationConfig, SamplingConfig
from grpo.sampling.local import render_prompts
from grpo.sampling.openai_client import EndpointError, OpenAIEndpoint, Retryable
from grpo.sampling.rollout import Rollout

logger = logging.getLogger(__name__)


class GenerationUnavailable(EndpointError):
    """No sample could be had: endpoints down or refusing, or a sample out of retries."""


def sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """The request seed of one sample: fixed by (shard seed, prompt's place in the shard, sample number)."""
    digest = hashlib.sha256(f"sample-{seed}-{prompt_index}-{sample_index}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % 2**31  # 31 bits: every server takes it


@dataclass(eq=False)
class _Endpoint:
    client: OpenAIEndpoint
    in_flight: int = 0  # requests sent and not yet answered
    failures: int = 0  # failures in a row; an answer resets it
    answered: int = 0  # samples this endpoint gave back
    dead: str | None = None  # why it was given up, once it is

    @property
    def url(self) -> str:
        return self.client.base_url


class HTTPGenerationBackend:
    """Samples from OpenAI-compatible `/v1/completions` endpoints serving `model`; see the module docstring.

    `tokenizer` renders the prompts (the checkpoint's chat template); without one only `check_available` works.
    """

    takes_seed = True  # process_shard passes the shard's seed to `generate` instead of seeding torch

    def __init__(self, endpoints: list[str], model: str, tokenizer: PreTrainedTokenizerBase | None = None, *,
                 max_in_flight_per_endpoint: int = 32, timeout_s: float = 1800.0, retries: int = 3,
                 backoff_s: float = 1.0, max_failures: int = 3, api_key_env: str = "R1_GENERATION_API_KEY"):
        if not endpoints:
            raise ValueError("HTTPGenerationBackend needs at least one endpoint")
        self.model, self.tokenizer = model, tokenizer
        self.max_in_flight, self.retries, self.backoff_s, self.max_failures = (max_in_flight_per_endpoint, retries,
                                                                               backoff_s, max_failures)
        self.endpoints = [_Endpoint(OpenAIEndpoint(url, api_key_env=api_key_env, timeout_s=timeout_s,
                                                   label="generation endpoint", error=GenerationUnavailable))
                          for url in endpoints]
        self._cond = threading.Condition()
        # as many workers as requests may be in flight: a worker holds at most one endpoint slot
        self._pool = ThreadPoolExecutor(max_workers=len(endpoints) * max_in_flight_per_endpoint,
                                        thread_name_prefix="generate")

    # ------------------------------------------------------------------------------------------------------------
    # Pre-flight

    def check_available(self, sampling: SamplingConfig | None = None) -> None:
        """Every endpoint up, serving the model, with room for the completion budget, and answering a completion.

        One GenerationUnavailable naming each endpoint that is not, and what it serves, before any sampling.
        """
        problems = []
        for ep in self.endpoints:
            try:
                entries = ep.client.served_models(retries=self.retries, backoff_s=self.backoff_s)
                served = [m["id"] for m in entries]
                if self.model not in served:
                    problems.append(f"{ep.url} does not serve model {self.model!r}; it serves {served}")
                    continue
                max_len = next(m for m in entries if m["id"] == self.model).get("max_model_len")
                if sampling is not None and isinstance(max_len, int) and sampling.max_new_tokens >= max_len:
                    problems.append(f"{ep.url} serves {self.model!r} with max_model_len {max_len}, no room for "
                                    f"max_new_tokens {sampling.max_new_tokens} after a prompt")
                    continue
                self._parse(ep, ep.client.request("POST", "/completions", self._payload("Hi", 1, None, None),
                                                  retries=self.retries, backoff_s=self.backoff_s))
            except GenerationUnavailable as e:
                problems.append(str(e))
        if problems:
            raise GenerationUnavailable(f"{len(problems)} of {len(self.endpoints)} generation endpoint(s) cannot be "
                                        f"used; nothing was sampled:\n  " + "\n  ".join(problems))

    # ------------------------------------------------------------------------------------------------------------
    # Sampling

    def generate(self, prompts: list, n: int, sampling: SamplingConfig, seed: int | None = None) -> Rollout:
        """`n` samples of each prompt (chat messages or text), laid out prompt by prompt; all of them or an error."""
        if self.tokenizer is None:
            raise ValueError("HTTPGenerationBackend needs the checkpoint's tokenizer to render prompts with its chat "
                             "template; this one was built for check_available only")
        texts = render_prompts(self.tokenizer, prompts)
        futures = [self._pool.submit(self._sample, texts[i], sampling,
                                     None if seed is None else sample_seed(seed, i, j))
                   for i in range(len(texts)) for j in range(n)]
        try:
            pending = futures
            while pending:  # in short waits: an interrupt raised in this thread lands between them
                done, pending = wait(pending, timeout=0.5, return_when=FIRST_EXCEPTION)
                failed = next((f for f in done if f.exception() is not None), None)
                if failed is not None:
                    raise failed.exception()
        except BaseException:
            for f in futures:  # the shard fails whole: its queued samples are not sent
                f.cancel()
            raise
        results = [f.result() for f in futures]
        return Rollout(texts=[r[0] for r in results], truncated=torch.tensor([r[1] for r in results]),
                       token_counts=torch.tensor([r[2] for r in results]))

    def sync_weights(self) -> None:
        """Nothing to do: the servers serve the checkpoint they were started with (which is why only rejection
        sampling, whose model does not change, may use this engine)."""

    def _payload(self, text: str, max_tokens: int, s: SamplingConfig | None, seed: int | None) -> dict:
        payload = {"model": self.model, "prompt": text, "n": 1, "max_tokens": max_tokens,
                   "add_special_tokens": False}  # the rendered chat template already has them
        if s is not None:
            payload.update(temperature=s.temperature, top_p=s.top_p)
            if s.top_k:
                payload["top_k"] = s.top_k  # a vLLM/SGLang extension; sent only when the recipe asks for it
        if seed is not None:
            payload["seed"] = seed
        return payload

    def _sample(self, text: str, s: SamplingConfig, seed: int | None) -> tuple[str, bool, int]:
        """One sample, retried on other endpoints while it fails in ways that may pass: (text, truncated, tokens)."""
        payload = self._payload(text, s.max_new_tokens, s, seed)
        failures, last = [], None
        for attempt in range(self.retries + 1):
            ep = self._acquire(avoid=last)
            try:
                result = self._parse(ep, ep.client.send("POST", "/completions", payload))
            except Retryable as e:
                self._release(ep, e)
                failures.append(f"{ep.url}: {e.cause}")
                last = ep
                if attempt < self.retries:
                    backoff = self.backoff_s * 2**attempt
                    time.sleep(backoff if e.wait_s is None else min(max(e.wait_s, backoff), 60.0))
                continue
            except BaseException:  # refused for good (a 4xx, a reply off the schema): other endpoints would be too
                self._release(ep, None, answered=False)
                raise
            self._release(ep, None)
            return result
        raise GenerationUnavailable(f"a sample failed {len(failures)} time{'s' * (len(failures) > 1)}: "
                                    + "; ".join(failures))

    def _parse(self, ep: _Endpoint, body: dict) -> tuple[str, bool, int]:
        try:
            choice = body["choices"][0]
            text, finish, tokens = choice["text"] or "", choice.get("finish_reason"), body["usage"]["completion_tokens"]
        except (KeyError, IndexError, TypeError):
            raise GenerationUnavailable(f"generation endpoint at {ep.url}/completions answered outside the OpenAI "
                                        f"schema (expected choices[0].text and usage.completion_tokens): "
                                        f"{str(body)[:200]}") from None
        return text, finish == "length", int(tokens)

    # ------------------------------------------------------------------------------------------------------------
    # The pool: a slot on the least busy live endpoint; failures counted; a dead endpoint left out

    def _acquire(self, avoid: _Endpoint | None) -> _Endpoint:
        """A slot on the live endpoint with the fewest requests in flight (not `avoid`, if another is live)."""
        with self._cond:
            while True:
                live = [e for e in self.endpoints if e.dead is None]
                if not live:
                    raise GenerationUnavailable("every generation endpoint is down: " + "; ".join(
                        f"{e.url} ({e.dead})" for e in self.endpoints))
                allowed = [e for e in live if e is not avoid] or live
                free = [e for e in allowed if e.in_flight < self.max_in_flight]
                if free:
                    ep = min(free, key=lambda e: e.in_flight)
                    ep.in_flight += 1
                    return ep
                self._cond.wait()

    def _release(self, ep: _Endpoint, failure: Retryable | None, answered: bool = True) -> None:
        with self._cond:
            ep.in_flight -= 1
            if failure is None:
                ep.failures = 0
                ep.answered += answered
            elif failure.status != 429:  # busy is not broken
                ep.failures += 1
                if ep.dead is None and (failure.refused or ep.failures >= self.max_failures):
                    ep.dead = failure.cause
                    live = sum(e.dead is None for e in self.endpoints)
                    logger.warning("generation endpoint %s given up (%s, %d failure(s) in a row); its samples go "
                                   "to the %d live endpoint(s)", ep.url, failure.cause, ep.failures, live)
            self._cond.notify_all()

    def stats(self) -> dict[str, dict]:
        """Per endpoint: samples answered, requests in flight, and why it was given up (None while live)."""
        with self._cond:
            return {e.url: {"answered": e.answered, "in_flight": e.in_flight, "dead": e.dead} for e in self.endpoints}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def build_http_backend(cfg: GenerationConfig, tokenizer: PreTrainedTokenizerBase | None) -> HTTPGenerationBackend:
    """The HTTP backend a recipe's `generation` section describes."""
    return HTTPGenerationBackend(list(cfg.endpoints), cfg.model, tokenizer,
                                 max_in_flight_per_endpoint=cfg.max_in_flight, timeout_s=cfg.timeout_s,
                                 retries=cfg.retries, backoff_s=cfg.backoff_s, max_failures=cfg.max_failures,
                                 api_key_env=cfg.api_key_env)
