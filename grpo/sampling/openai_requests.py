"""What `r1 serve` accepts: an OpenAI chat or completions request body, checked field by field before any work.

`parse_chat` and `parse_completion` turn a body into a `Request`, the engine thread's unit of work
(`grpo.sampling.batcher`), or raise `RequestError` naming the first bad field (OpenAI's `param`), which the
HTTP layer (`flows.cli.serve`) answers with OpenAI's error body. Nothing here touches the model or the
tokenizer: a prompt's length is checked in the engine thread, the only one that tokenizes. Must not depend on
Prefect or MLflow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from grpo.configs.sampling import SamplingConfig

DEFAULT_MAX_TOKENS = 256  # a request that names no max_tokens gets this many (vLLM: 16 for /v1/completions)
MAX_CHOICES = 1024  # choices in one request: prompts x n (/v1/completions), n (/v1/chat/completions)
MAX_STOPS = 4  # stop strings in one request, as OpenAI allows
ROLES = ("system", "user", "assistant")


class RequestError(Exception):
    """A request the server will not run: the HTTP status, the message, the offending field (OpenAI `param`), the
    error's type and code."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Request:
    """One checked request, as the engine thread runs it: `len(prompts) * n` rows, choice `i * n + j` prompt i's
    j-th sample."""

    chat: bool  # prompts are chat messages, rendered with the chat template (else text continued as it is)
    prompts: tuple  # chat: one list of {role, content}; completions: the prompt texts
    n: int  # samples per prompt
    sampling: SamplingConfig  # max_new_tokens is the request's max_tokens, or DEFAULT_MAX_TOKENS
    seed: int | None  # the rows' streams come from a generator seeded with it: the same tokens however busy
    stop: tuple[str, ...]  # the text ends before the first of these; the row stops there
    logprobs: bool  # each sampled token's log-prob in the reply (/v1/completions' logprobs: 0; serve._token_logprobs)
    add_special_tokens: bool  # completions: the tokenizer's BOS etc. around the prompt text (chat: False)
    stream: bool  # server-sent events, a chunk as text comes
    include_usage: bool  # stream_options.include_usage: a last chunk with the token counts
    # the field that set the completion budget (max_tokens or max_completion_tokens), None where the request named
    # none: a named budget past the model's context is refused, the default one trimmed to what is left
    budget_field: str | None = None


def parse_chat(body, model_name: str) -> Request:
    """A /v1/chat/completions body as a Request: `n` replies to the messages; RequestError naming the first bad
    field."""
    _check_model(body, model_name)
    messages = _messages(body.get("messages"))
    n = _number(body.get("n"), "n", int, 1, low=1)
    if n > MAX_CHOICES:
        raise RequestError(400, f"n={n} is more than the {MAX_CHOICES} choices one request may ask for", "n")
    return Request(True, (messages,), n, *_common(body), logprobs=False, add_special_tokens=False,
                   **_streaming(body), budget_field=_budget_field(body))


def parse_completion(body, model_name: str) -> Request:
    """A /v1/completions body as a Request: `n` continuations of each prompt text, no chat template."""
    _check_model(body, model_name)
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise RequestError(400, "prompt must be a string or a non-empty list of strings (token ids are not "
                                "supported)", "prompt")
    n = _number(body.get("n"), "n", int, 1, low=1)
    if len(prompts) * n > MAX_CHOICES:
        raise RequestError(400, f"{len(prompts)} prompts x n={n} is more than the {MAX_CHOICES} choices one "
                                f"request may ask for", "n")
    best_of = body.get("best_of")
    if best_of not in (None, n):
        raise RequestError(400, f"best_of must equal n or be left out, got {best_of!r}", "best_of")
    if body.get("echo"):
        raise RequestError(400, "echo=true is not supported", "echo")
    if body.get("suffix"):
        raise RequestError(400, "suffix is not supported", "suffix")
    logprobs = _number(body.get("logprobs"), "logprobs", int, None, low=0)
    if logprobs:
        raise RequestError(400, f"logprobs must be 0 (the sampled token's log-prob) or left out, got "
                                f"{logprobs}: alternatives are not computed", "logprobs")
    add_special_tokens = body.get("add_special_tokens", True)
    if not isinstance(add_special_tokens, bool):
        raise RequestError(400, f"add_special_tokens must be true or false, got {add_special_tokens!r}",
                           "add_special_tokens")
    streaming = _streaming(body)
    if streaming["stream"] and logprobs is not None:
        raise RequestError(400, "logprobs with stream=true is not supported; ask without streaming", "logprobs")
    return Request(False, tuple(prompts), n, *_common(body), logprobs=logprobs is not None,
                   add_special_tokens=add_special_tokens, **streaming, budget_field=_budget_field(body))


def _check_model(body, model_name: str) -> None:
    if not isinstance(body, dict):
        raise RequestError(400, f"the body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is not None and model != model_name:
        raise RequestError(404, f"model {model!r} is not served here; this server serves {model_name!r}",
                           "model", "model_not_found")


def _streaming(body: dict) -> dict:
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise RequestError(400, f"stream must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise RequestError(400, "stream_options must be an object like {\"include_usage\": true}", "stream_options")
    return {"stream": bool(stream), "include_usage": bool(options.get("include_usage"))}


def _budget_field(body: dict) -> str | None:
    """The field that names the completion budget, if any."""
    for field in ("max_completion_tokens", "max_tokens"):
        if body.get(field) is not None:
            return field
    return None


def _common(body: dict) -> tuple[SamplingConfig, int | None, tuple[str, ...]]:
    """The fields both routes share: max_tokens, temperature, top_p, top_k (a vLLM extension), seed, stop."""
    field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = _number(body.get(field), field, int, DEFAULT_MAX_TOKENS, low=1)
    temperature = _number(body.get("temperature"), "temperature", float, 1.0, low=0.0)
    top_p = _number(body.get("top_p"), "top_p", float, 1.0, low=0.0)
    if top_p == 0 or top_p > 1:
        raise RequestError(400, f"top_p must be in (0, 1], got {top_p!r}", "top_p")
    top_k = _number(body.get("top_k"), "top_k", int, 0, low=-1)  # vLLM: -1 (or 0) keeps every token
    seed = _number(body.get("seed"), "seed", int, None)
    if seed is not None and not -2**63 <= seed < 2**64:  # what torch.Generator.manual_seed takes
        raise RequestError(400, f"seed must fit in 64 bits, got {seed}", "seed")
    sampling = SamplingConfig(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=max(top_k, 0))
    return sampling, seed, _stops(body.get("stop"))


def _stops(value) -> tuple[str, ...]:
    """OpenAI's `stop`: a string or a list of up to 4 (null or empty: none)."""
    if value is None or value == "":
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(400, f"stop must be a non-empty string or a list of them, got {value!r}", "stop")
    if len(stops) > MAX_STOPS:
        raise RequestError(400, f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", "stop")
    return tuple(dict.fromkeys(stops))


def _messages(value) -> list[dict]:
    """OpenAI chat messages as {role, content} dicts with string content (text parts joined)."""
    if not isinstance(value, list) or not value:
        raise RequestError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(400, f"{where} must be an object with role and content, got {type(m).__name__}", where)
        if m.get("role") not in ROLES:
            raise RequestError(400, f"{where}.role must be one of {list(ROLES)}, got {m.get('role')!r}",
                               f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise RequestError(400, f"{where}.content parts must all be {{'type': 'text', 'text': str}}; "
                                        f"images and audio are not supported", f"{where}.content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(400, f"{where}.content must be a string, got {type(content).__name__}",
                               f"{where}.content")
        out.append({"role": m["role"], "content": content})
    return out


def _number(value, field: str, kind: type, default, low: float | None = None):
    """A JSON number field as `kind`, `default` when absent or null; RequestError when it is not a number in range."""
    if value is None:
        return default
    # bool is an int in Python and 2.0 is a fine integer in JSON; "2" and 2.5 are not
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or (kind is int and value != int(value))):
        raise RequestError(400, f"{field} must be {'an integer' if kind is int else 'a number'}, got {value!r}",
                           field)
    if low is not None and value < low:
        raise RequestError(400, f"{field} must be at least {low:g}, got {value!r}", field)
    return kind(value)
