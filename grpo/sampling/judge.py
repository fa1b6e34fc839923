"""LLM-as-judge: one interface, `judge(prompt, response, reference) -> Verdict`, over a local model or an HTTP endpoint.

R1's rejection-sampling stage keeps a sampled response when a rule check accepts it, and for prompts a rule cannot
check it asks a generative reward model: DeepSeek-V3 sees the question, the reference answer and the response, and
judges. Here that judge is any chat model, asked to reply in a fixed two-line format that `parse_verdict` reads:

    VERDICT: yes
    REASON: the final answer 277 matches the reference.

Backends:
- `TransformersJudge`: a local causal LM with its chat template, batched greedy decoding (`TransformersBackend`).
- `HTTPJudge`: any OpenAI-compatible `/chat/completions` endpoint (vLLM, TGI, a hosted API, or `r1 serve`), with
  retries and exponential backoff; the API key is read from an environment variable named in the config, never
  stored in the config itself (configs are logged as run params).

Differences from the paper: the judge model is whatever the recipe names (the tiny recipe's judge is a few-million
parameter model whose verdicts are mostly unparseable: `accepted=None`); the prompt is ours, not DeepSeek's.

Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, Protocol

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo.config import JudgeConfig, SamplingConfig
from grpo.sampling.backend import TransformersBackend
from grpo.texts import NO_REFERENCE


class Verdict(NamedTuple):
    """What a judge said about one response."""

    accepted: bool | None  # True = correct, False = wrong, None = the judge's output had no verdict we could read
    rationale: str  # the judge's whole reply, stripped, so a logged table shows exactly what it said


class JudgeUnavailable(RuntimeError):
    """The judge could not be asked (unreachable, refusing requests, or answering outside the OpenAI schema)."""


class Judge(Protocol):
    def judge(self, prompt: str, response: str, reference: str | None) -> Verdict: ...

    def judge_many(self, items: list[tuple[str, str, str | None]]) -> list[Verdict]: ...


def render_judge_prompt(template: str, prompt: str, response: str, reference: str | None) -> str:
    """The judge's user message for one (question, response, reference)."""
    return template.format(question=prompt, response=response,
                           reference=NO_REFERENCE if reference is None else reference)


# "VERDICT: yes" at the start of any line, forgiving case, spacing and markdown ("**Verdict:** Yes.").
_VERDICT_LINE = re.compile(r"^[\s*_#>`-]*verdict[\s*_`]*[:=-][\s*_`\"'\[(]*(yes|no)\b", re.IGNORECASE | re.MULTILINE)
# A judge that skips the format but opens with the answer ("Yes, 277 matches.").
_BARE_ANSWER = re.compile(r"^[\s*_`\"'\[(]*(yes|no)\b", re.IGNORECASE)


def parse_verdict(text: str) -> Verdict:
    """Read a judge's reply: the first `VERDICT: yes|no` line, else a bare yes/no opening it; None if neither.

    A reasoning judge's thinking is skipped: only what follows the last `</think>` counts, and a reply still
    inside `<think>` (cut off by the token budget) has no verdict yet, whatever its draft lines say.

    >>> parse_verdict("VERDICT: yes\\nREASON: 277 matches").accepted
    True
    >>> parse_verdict("**Verdict:** No.").accepted
    False
    >>> parse_verdict("I cannot tell.").accepted is None
    True
    """
    rationale = text.strip()
    answer = rationale
    if "</think>" in answer:
        answer = answer.rsplit("</think>", 1)[1]
    elif "<think>" in answer:
        return Verdict(None, rationale)
    match = _VERDICT_LINE.search(answer) or _BARE_ANSWER.match(answer)
    if match is None:
        return Verdict(None, rationale)
    return Verdict(match.group(1).lower() == "yes", rationale)


# ----------------------------------------------------------------------------------------------------------------
# A local model


class TransformersJudge:
    """A causal LM in this process judges with its chat template and batched greedy decoding."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cfg: JudgeConfig):
        self.cfg = cfg
        self.backend = TransformersBackend(model, tokenizer)
        self.sampling = SamplingConfig(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                       batch_size=cfg.batch_size)

    def judge(self, prompt: str, response: str, reference: str | None) -> Verdict:
        return self.judge_many([(prompt, response, reference)])[0]

    def judge_many(self, items: list[tuple[str, str, str | None]]) -> list[Verdict]:
        if not items:
            return []
        prompts = [render_judge_prompt(self.cfg.prompt_template, *item) for item in items]
        rollout = self.backend.generate(prompts, 1, self.sampling)
        return [parse_verdict(text) for text in rollout.texts]


# ----------------------------------------------------------------------------------------------------------------
# An OpenAI-compatible endpoint


class _Retryable(Exception):
    """A failure worth another try (connection, timeout, 5xx, 429); `wait_s` is the server's Retry-After, if any."""

    def __init__(self, cause: str, wait_s: float | None = None):
        super().__init__(cause)
        self.cause, self.wait_s = cause, wait_s


class HTTPJudge:
    """Any OpenAI-compatible chat endpoint judges; `judge_many` keeps `cfg.max_workers` requests in flight."""

    def __init__(self, cfg: JudgeConfig):
        self.cfg = cfg
        self.base_url = cfg.base_url
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        key = os.environ.get(cfg.api_key_env)
        if key:  # the key lives only in this header, never in the config or a message
            self._headers["Authorization"] = f"Bearer {key}"

    def check_available(self) -> list[str]:
        """The endpoint's model ids; raises JudgeUnavailable if it is down or does not serve `cfg.model`.

        Cheap, so a stage can call it before any sampling and fail in seconds instead of after an hour of work.
        """
        body = self._request("GET", "/models")
        try:
            served = [m["id"] for m in body["data"]]
        except (KeyError, TypeError) as e:
            raise JudgeUnavailable(f"judge at {self.base_url}/models answered outside the OpenAI schema "
                                   f"(expected data[].id, missing {e}): {str(body)[:200]}") from None
        if self.cfg.model not in served:
            raise JudgeUnavailable(f"judge at {self.base_url} does not serve model {self.cfg.model!r}; "
                                   f"it serves {served}")
        return served

    def judge(self, prompt: str, response: str, reference: str | None) -> Verdict:
        text = self._complete(render_judge_prompt(self.cfg.prompt_template, prompt, response, reference))
        return parse_verdict(text)

    def judge_many(self, items: list[tuple[str, str, str | None]]) -> list[Verdict]:
        if not items:
            return []
        pool = ThreadPoolExecutor(max_workers=min(self.cfg.max_workers, len(items)), thread_name_prefix="judge")
        try:
            return list(pool.map(lambda item: self.judge(*item), items))
        finally:
            # on JudgeUnavailable the queued requests would only fail the same way: drop them
            pool.shutdown(wait=True, cancel_futures=True)

    def _complete(self, user_message: str) -> str:
        body = self._request("POST", "/chat/completions", {
            "model": self.cfg.model,
            "messages": [{"role": "user", "content": user_message}],
            "max_tokens": self.cfg.max_new_tokens,
            "temperature": self.cfg.temperature,
        })
        try:
            content = body["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise JudgeUnavailable(f"judge at {self.base_url}/chat/completions answered outside the OpenAI schema "
                                   f"(expected choices[0].message.content): {str(body)[:200]}") from None
        return content or ""  # some servers send null content for an empty reply

    def _request(self, method: str, path: str, payload: dict | None = None) -> dict:
        """One JSON request, retried with exponential backoff on failures that may pass; the parsed JSON reply."""
        url = f"{self.base_url}{path}"
        data = None if payload is None else json.dumps(payload).encode()
        tries = self.cfg.max_retries + 1
        for attempt in range(tries):
            try:
                return self._send(urllib.request.Request(url, data=data, headers=self._headers, method=method))
            except _Retryable as e:
                failure = e
            if attempt + 1 < tries:
                backoff = self.cfg.backoff_s * 2**attempt
                # a server's Retry-After wins over our schedule, within reason
                time.sleep(backoff if failure.wait_s is None else min(max(failure.wait_s, backoff), 60.0))
        raise JudgeUnavailable(f"could not reach judge at {url}: {failure.cause} after {tries} "
                               f"{'try' if tries == 1 else 'tries'}")

    def _send(self, request: urllib.request.Request) -> dict:
        """One request: the parsed JSON reply, _Retryable for a failure that may pass, else JudgeUnavailable."""
        url = request.full_url
        try:
            with urllib.request.urlopen(request, timeout=self.cfg.timeout_s) as reply:
                raw = reply.read()
        except urllib.error.HTTPError as e:
            detail = _error_detail(e.read())
            if e.code == 429 or e.code >= 500:
                retry_after = e.headers.get("Retry-After", "")
                wait = float(retry_after) if retry_after.replace(".", "", 1).isdigit() else None
                raise _Retryable(f"HTTP {e.code} {detail}".rstrip(), wait) from None
            hint = f" (is the key in ${self.cfg.api_key_env}?)" if e.code in (401, 403) else ""
            message = f"judge at {url} refused the request: HTTP {e.code} {detail}".rstrip()
            raise JudgeUnavailable(message + hint) from None
        except urllib.error.URLError as e:  # refused, unknown host, or a timeout while connecting
            raise _Retryable(_describe(e.reason, self.cfg.timeout_s)) from None
        except (TimeoutError, ConnectionError) as e:  # a timeout or reset while reading the reply
            raise _Retryable(_describe(e, self.cfg.timeout_s)) from None
        try:
            return json.loads(raw)
        except ValueError:
            message = f"judge at {url} answered with something other than JSON: {raw[:200]!r}"
        raise JudgeUnavailable(message)


def _describe(reason, timeout_s: float) -> str:
    """A connection failure in a few words: 'connection refused', 'timed out after 60s', or the OS's own message."""
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    if isinstance(reason, TimeoutError):
        return f"timed out after {timeout_s:g}s"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror.lower()
    return str(reason)


def _error_detail(raw: bytes) -> str:
    """The message of an OpenAI-style error body ({"error": {"message": ...}}), else the start of the body."""
    try:
        return str(json.loads(raw)["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return raw[:300].decode(errors="replace").strip()


# ----------------------------------------------------------------------------------------------------------------


def build_judge(cfg: JudgeConfig, model: PreTrainedModel | None = None,
                tokenizer: PreTrainedTokenizerBase | None = None) -> TransformersJudge | HTTPJudge:
    """The judge `cfg` describes; a transformers judge uses `model`/`tokenizer` if given, else loads `cfg.model`."""
    if cfg.backend == "http":
        return HTTPJudge(cfg)
    if (model is None) != (tokenizer is None):
        raise ValueError("build_judge takes both model and tokenizer, or neither (then it loads cfg.model)")
    if model is None:
        import torch

        from grpo.config import ModelConfig
        from grpo.models import load_model_and_tokenizer

        model, tokenizer = load_model_and_tokenizer(ModelConfig(name_or_path=cfg.model))
        model.to("cuda" if torch.cuda.is_available() else "cpu")
    return TransformersJudge(model, tokenizer, cfg)
