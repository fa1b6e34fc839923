"""LLM-as-judge: one interface, `judge(prompt, response, reference) -> Verdict`, over a local model or an HTTP endpoint.

R1's rejection-sampling stage keeps a sampled response when a rule check accepts it, and for prompts a rule cannot
check it asks a generative reward model: DeepSeek-V3 sees the question, the reference answer and the response, and
judges. Here that judge is any chat model, asked to reply in a fixed two-line format that `parse_verdict` reads:

    VERDICT: yes
    REASON: the final answer 277 matches the reference.

Backends:
- `TransformersJudge`: a local causal LM with its chat template, batched greedy decoding (the local engine).
- `HTTPJudge`: any OpenAI-compatible `/chat/completions` endpoint (vLLM, TGI, a hosted API, or `r1 serve`), with
  retries and exponential backoff (`openai_client`); the API key is read from an environment variable named in the
  config, never stored in the config itself (configs are logged as run params). At most `max_workers` requests are
  in flight at once; judges that share one `in_flight` semaphore (a process's shard tasks) share the bound. A chat
  request carries one conversation, so the batching is the server's: it decodes the requests in flight together.

Each judge counts its `calls` (requests sent, retries included; a local judge: items judged), so a stage can log
how hard it was asked.

Differences from the paper: the judge model is whatever the recipe names (the tiny recipe's judge is a few-million
parameter model whose verdicts are mostly unparseable: `accepted=None`); the prompt is ours, not DeepSeek's.

Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, NamedTuple, Protocol

from grpo.configs.grading import JudgeConfig
from grpo.configs.sampling import GenerationConfig, SamplingConfig
from grpo.rewards.outcomes import JUDGE_HTTP_ERROR, JUDGE_NO_VERDICT, JUDGE_TIMEOUT
from grpo.sampling.openai_client import EndpointError, OpenAIEndpoint
from grpo.texts import NO_REFERENCE

if TYPE_CHECKING:  # an HTTP judge (`r1 audit-rewards --judge`) loads neither torch nor transformers
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


class Verdict(NamedTuple):
    """What a judge said about one response."""

    accepted: bool | None  # True = correct, False = wrong, None = no verdict (see `ungraded`)
    rationale: str  # the judge's whole reply, stripped, so a logged table shows exactly what it said
    # when `accepted` is None, why (`grpo.rewards.outcomes`): judge_timeout, judge_http_error (the request failed
    # after its retries, or the reply was not the OpenAI schema), judge_no_verdict (a reply without one)
    ungraded: str | None = None


def verdict_ungraded(verdict: Verdict | None) -> str:
    """Why a verdict without a decision is one: its own reason, else judge_no_verdict."""
    return getattr(verdict, "ungraded", None) or JUDGE_NO_VERDICT


class JudgeUnavailable(EndpointError):
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
        return Verdict(None, rationale, JUDGE_NO_VERDICT)
    match = _VERDICT_LINE.search(answer) or _BARE_ANSWER.match(answer)
    if match is None:
        return Verdict(None, rationale, JUDGE_NO_VERDICT)
    return Verdict(match.group(1).lower() == "yes", rationale)


# ----------------------------------------------------------------------------------------------------------------
# A local model


class TransformersJudge:
    """A causal LM in this process judges with its chat template and batched greedy decoding."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cfg: JudgeConfig,
                 generation: GenerationConfig | None = None):
        self.cfg = cfg
        from grpo.sampling.engines import build_engine

        self.engine = build_engine(generation or GenerationConfig(), model, tokenizer, who="the judge")
        self.sampling = SamplingConfig(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                       batch_size=cfg.batch_size)
        self.calls = 0  # items judged

    def judge(self, prompt: str, response: str, reference: str | None) -> Verdict:
        return self.judge_many([(prompt, response, reference)])[0]

    def judge_many(self, items: list[tuple[str, str, str | None]]) -> list[Verdict]:
        if not items:
            return []
        prompts = [render_judge_prompt(self.cfg.prompt_template, *item) for item in items]
        self.calls += len(prompts)
        rollout = self.engine.generate(prompts, 1, self.sampling)
        return [parse_verdict(text) for text in rollout.texts]


# ----------------------------------------------------------------------------------------------------------------
# An OpenAI-compatible endpoint


class HTTPJudge:
    """Any OpenAI-compatible chat endpoint judges, at most `cfg.max_workers` requests in flight.

    `in_flight`: a semaphore of `cfg.max_workers` shared with other judges of the same endpoint, so the bound holds
    across them (the shard tasks of one process each build a judge); None: this judge's own.
    """

    def __init__(self, cfg: JudgeConfig, in_flight: threading.Semaphore | None = None):
        self.cfg = cfg
        self.base_url = cfg.base_url
        self.endpoint = OpenAIEndpoint(cfg.base_url, api_key_env=cfg.api_key_env, timeout_s=cfg.timeout_s,
                                       label="judge", error=JudgeUnavailable)
        self.in_flight = in_flight or threading.BoundedSemaphore(cfg.max_workers)

    @property
    def calls(self) -> int:
        """Requests sent to the endpoint so far, each retry one more."""
        return self.endpoint.tries

    def check_available(self) -> list[str]:
        """The endpoint's model ids; raises JudgeUnavailable if it is down or does not serve `cfg.model`.

        Cheap, so a stage can call it before any sampling and fail in seconds instead of after an hour of work.
        """
        served = [m["id"] for m in self.endpoint.served_models(retries=self.cfg.max_retries,
                                                                backoff_s=self.cfg.backoff_s)]
        if self.cfg.model not in served:
            raise JudgeUnavailable(f"judge at {self.base_url} does not serve model {self.cfg.model!r}; "
                                   f"it serves {served}")
        return served

    def judge(self, prompt: str, response: str, reference: str | None) -> Verdict:
        """The endpoint's verdict; a request that fails after its retries (a timeout, a server error, a reply
        outside the schema) is a verdict-less one saying why, so one bad request loses one sample's grade, not the
        shard. A refusal (HTTP 4xx: a wrong key, an unknown model) or nothing listening at the address still
        raises: no request would pass."""
        try:
            with self.in_flight:
                text = self._complete(render_judge_prompt(self.cfg.prompt_template, prompt, response, reference))
        except JudgeUnavailable as e:
            if not getattr(e, "transient", False) or getattr(e, "refused", False):
                raise
            return Verdict(None, str(e), JUDGE_TIMEOUT if getattr(e, "timed_out", False) else JUDGE_HTTP_ERROR)
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
            error = JudgeUnavailable(f"judge at {self.base_url}/chat/completions answered outside the OpenAI "
                                     f"schema (expected choices[0].message.content): {str(body)[:200]}")
            error.transient = True  # this reply; the next may be right
            raise error from None
        return content or ""  # some servers send null content for an empty reply

    def _request(self, method: str, path: str, payload: dict | None = None) -> dict:
        return self.endpoint.request(method, path, payload, retries=self.cfg.max_retries, backoff_s=self.cfg.backoff_s)


# ----------------------------------------------------------------------------------------------------------------


def build_judge(cfg: JudgeConfig, model: PreTrainedModel | None = None,
                tokenizer: PreTrainedTokenizerBase | None = None,
                generation: GenerationConfig | None = None,
                in_flight: threading.Semaphore | None = None) -> TransformersJudge | HTTPJudge:
    """The judge `cfg` describes; a transformers judge uses `model`/`tokenizer` if given, else loads `cfg.model`, and
    samples with the engine `generation` (local) describes; an HTTP judge shares `in_flight` (see `HTTPJudge`)."""
    if cfg.backend == "http":
        return HTTPJudge(cfg, in_flight)
    if (model is None) != (tokenizer is None):
        raise ValueError("build_judge takes both model and tokenizer, or neither (then it loads cfg.model)")
    if model is None:
        import torch

        from grpo.configs.model import ModelConfig
        from grpo.models import load_model_and_tokenizer

        model, tokenizer = load_model_and_tokenizer(ModelConfig(name_or_path=cfg.model))
        model.to("cuda" if torch.cuda.is_available() else "cpu")
    return TransformersJudge(model, tokenizer, cfg, generation)
