"""A checkpoint behind a small OpenAI-compatible HTTP API, so any stage (or any OpenAI client) can ask it questions.

    GET  /v1/models             the one model served
    POST /v1/chat/completions   non-streaming chat: messages -> chat template -> generate -> choices[0].message
    POST /v1/completions        non-streaming completion of text as given (a prompt or a list), n choices each
    GET  /health                200 when up

It exists so the pipeline's judge and rejection sampling's generation can be a model this project trained, reached
the same way as a vLLM or hosted endpoint (`HTTPJudge`, `HTTPGenerationBackend`). It is the standard library's
threading HTTP server around the local engine (`grpo.sampling.engines`): one model, one generation at a time (a
lock), no streaming, no batching across requests (a /v1/completions request's prompts x n are decoded together). For
throughput serve the checkpoint folder with vLLM instead; the API is the same. Differences from vLLM: no stop
strings, `logprobs` only 0 (the sampled token's log-prob, under the distribution sampled from: after temperature and
top-p), an over-long `max_tokens` trimmed to the model's length rather than refused.

Standard library HTTP server; must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo.config import GenerationConfig, ModelConfig, SamplingConfig
from grpo.models import load_model_and_tokenizer
from grpo.sampling.backend import render_prompts
from grpo.sampling.engines import build_engine

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256  # a request that names no max_tokens gets this many (vLLM: 16 for /v1/completions)
MAX_BODY_BYTES = 8 * 2**20  # larger bodies are refused before they are read
MAX_CHOICES = 1024  # prompts x n in one /v1/completions request
DECODE_BATCH = 64  # sequences of one /v1/completions request decoded together
ROLES = ("system", "user", "assistant")


class RequestError(Exception):
    """A request the server will not run: the HTTP status, the message, and the offending field (OpenAI `param`)."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


class ChatServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer that holds one model; handlers reach it as `self.server`."""

    daemon_threads = True  # a hung client never keeps the process alive

    def __init__(self, address: tuple[str, int], model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 model_name: str, api_key: str | None = None, generation: GenerationConfig | None = None):
        super().__init__(address, _Handler)
        self.model_name, self.api_key = model_name, api_key
        self.engine = build_engine(generation or GenerationConfig(), model, tokenizer, who="r1 serve")
        self.tokenizer = tokenizer
        # the longest prompt + completion the model was built for; None when its config does not say
        self.max_len: int | None = getattr(model.config, "max_position_embeddings", None)
        self.lock = threading.Lock()  # one model: concurrent requests take turns

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/v1"

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "r1-pipeline", "max_model_len": self.max_len}]}

    def chat_completion(self, request: dict) -> dict:
        """Run one validated chat request and return the OpenAI `chat.completion` object."""
        messages, sampling, seed = self._parse(request)
        # everything that touches the model or tokenizer under the lock: a fast tokenizer shared by threads
        # raises "Already borrowed", and one model generates one request at a time anyway
        with self.lock:
            text = render_prompts(self.tokenizer, [messages])[0]
            prompt_tokens = self._prompt_lengths([text], "messages")[0]
            sampling = self._fit_budget(sampling, prompt_tokens)
            if seed is not None:
                torch.manual_seed(seed)
            rollout = self.engine.generate([messages], 1, sampling)
        completion_tokens = int(rollout.completion_mask[0].sum())
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": rollout.texts[0]},
                         "logprobs": None, "finish_reason": "length" if bool(rollout.truncated[0]) else "stop"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
        }

    def completion(self, request: dict) -> dict:
        """Run one validated /v1/completions request: `n` continuations of each prompt text, no chat template.

        Choice `i * n + j` is prompt i's j-th sample, as vLLM numbers them; usage counts each prompt once.
        """
        prompts, n, sampling, seed, logprobs, add_special_tokens = self._parse_completion(request)
        with self.lock:
            lengths = self._prompt_lengths(prompts, "prompt", add_special_tokens)
            sampling = self._fit_budget(sampling, max(lengths))
            if seed is not None:
                torch.manual_seed(seed)
            rollout = self.engine.generate_from_text(prompts, n, sampling, add_special_tokens=add_special_tokens,
                                                     logprobs=logprobs is not None)
            per_token = self._token_logprobs(rollout) if logprobs is not None else None
        counts = rollout.completion_tokens.tolist()
        choices = [{"index": i, "text": text, "logprobs": per_token[i] if per_token else None,
                    "finish_reason": "length" if bool(rollout.truncated[i]) else "stop"}
                   for i, text in enumerate(rollout.texts)]
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {"prompt_tokens": sum(lengths), "completion_tokens": sum(counts),
                      "total_tokens": sum(lengths) + sum(counts)},
        }

    def _prompt_lengths(self, texts: list[str], field: str, add_special_tokens: bool = False) -> list[int]:
        """Tokens per prompt text; RequestError when one leaves the model no room to generate."""
        lengths = [len(ids) for ids in self.tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]]
        for i, length in enumerate(lengths):
            where = field if len(texts) == 1 else f"{field}[{i}]"
            if length == 0:
                raise RequestError(400, f"{where} is empty: there is nothing to continue", field)
            if self.max_len is not None and length >= self.max_len:
                raise RequestError(400, f"{where} is {length} tokens; this model takes at most {self.max_len} "
                                        f"tokens of prompt and completion together", field)
        return lengths

    def _fit_budget(self, sampling: SamplingConfig, prompt_tokens: int) -> SamplingConfig:
        """An over-long budget is trimmed rather than refused (vLLM refuses); the reply then ends "length"."""
        if self.max_len is None:
            return sampling
        return sampling.model_copy(update={"max_new_tokens": min(sampling.max_new_tokens,
                                                                  self.max_len - prompt_tokens)})

    def _token_logprobs(self, rollout) -> list[dict]:
        """OpenAI completion logprobs per choice: each sampled token, its log-prob and its text offset."""
        out = []
        for ids, mask, lps in zip(rollout.completion_ids, rollout.completion_mask, rollout.logprobs):
            n = int(mask.sum())
            tokens = [self.tokenizer.decode([t]) for t in ids[:n].tolist()]
            offsets = [sum(len(t) for t in tokens[:i]) for i in range(n)]
            values = [round(v, 6) for v in lps[:n].tolist()]
            out.append({"tokens": tokens, "token_logprobs": values, "text_offset": offsets,
                        "top_logprobs": [{t: v} for t, v in zip(tokens, values)]})
        return out

    def _check_model(self, request) -> None:
        if not isinstance(request, dict):
            raise RequestError(400, f"the body must be a JSON object, got {type(request).__name__}")
        model = request.get("model")
        if model is not None and model != self.model_name:
            raise RequestError(404, f"model {model!r} is not served here; this server serves {self.model_name!r}",
                               "model", "model_not_found")
        if request.get("stream"):
            raise RequestError(400, "stream=true is not supported; send stream=false or leave it out", "stream")
        if request.get("stop") not in (None, [], ""):
            raise RequestError(400, "stop sequences are not supported; generation ends at the end-of-turn token",
                               "stop")

    def _parse(self, request: dict) -> tuple[list[dict], SamplingConfig, int | None]:
        """The chat request's messages, sampling settings and seed; RequestError naming the first bad field."""
        self._check_model(request)
        messages = _messages(request.get("messages"))
        if request.get("n", 1) != 1:
            raise RequestError(400, f"n must be 1 (one choice per request), got {request['n']!r}", "n")
        sampling, seed = _sampling(request, batch_size=1)
        return messages, sampling, seed

    def _parse_completion(self, request: dict) -> tuple[list[str], int, SamplingConfig, int | None, int | None,
                                                        bool]:
        """(prompts, n, sampling, seed, logprobs, add_special_tokens) of a /v1/completions request."""
        self._check_model(request)
        prompt = request.get("prompt")
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
            raise RequestError(400, "prompt must be a string or a non-empty list of strings (token ids are not "
                                    "supported)", "prompt")
        n = _number(request.get("n"), "n", int, 1, low=1)
        if len(prompts) * n > MAX_CHOICES:
            raise RequestError(400, f"{len(prompts)} prompts x n={n} is more than the {MAX_CHOICES} choices one "
                                    f"request may ask for", "n")
        best_of = request.get("best_of")
        if best_of not in (None, n):
            raise RequestError(400, f"best_of must equal n or be left out, got {best_of!r}", "best_of")
        if request.get("echo"):
            raise RequestError(400, "echo=true is not supported", "echo")
        if request.get("suffix"):
            raise RequestError(400, "suffix is not supported", "suffix")
        logprobs = _number(request.get("logprobs"), "logprobs", int, None, low=0)
        if logprobs:
            raise RequestError(400, f"logprobs must be 0 (the sampled token's log-prob) or left out, got "
                                    f"{logprobs}: alternatives are not computed", "logprobs")
        add_special_tokens = request.get("add_special_tokens", True)
        if not isinstance(add_special_tokens, bool):
            raise RequestError(400, f"add_special_tokens must be true or false, got {add_special_tokens!r}",
                               "add_special_tokens")
        sampling, seed = _sampling(request, batch_size=DECODE_BATCH)
        return prompts, n, sampling, seed, logprobs, add_special_tokens


def _sampling(request: dict, batch_size: int) -> tuple[SamplingConfig, int | None]:
    """The sampling fields both routes share: max_tokens, temperature, top_p, top_k (a vLLM extension), seed."""
    max_tokens = request.get("max_completion_tokens", request.get("max_tokens"))
    field = "max_completion_tokens" if "max_completion_tokens" in request else "max_tokens"
    max_tokens = _number(max_tokens, field, int, DEFAULT_MAX_TOKENS, low=1)
    temperature = _number(request.get("temperature"), "temperature", float, 1.0, low=0.0)
    top_p = _number(request.get("top_p"), "top_p", float, 1.0, low=0.0)
    if top_p == 0 or top_p > 1:
        raise RequestError(400, f"top_p must be in (0, 1], got {top_p!r}", "top_p")
    top_k = _number(request.get("top_k"), "top_k", int, 0, low=-1)  # vLLM: -1 (or 0) keeps every token
    seed = _number(request.get("seed"), "seed", int, None)
    if seed is not None and not -2**63 <= seed < 2**64:  # what torch.manual_seed takes
        raise RequestError(400, f"seed must fit in 64 bits, got {seed}", "seed")
    sampling = SamplingConfig(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=max(top_k, 0),
                              batch_size=batch_size)
    return sampling, seed


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


class _Handler(BaseHTTPRequestHandler):
    server: ChatServer
    protocol_version = "HTTP/1.1"  # keep-alive, so a judge's thread pool reuses its connections

    def do_GET(self) -> None:
        def handle() -> dict:
            self._authorize()
            route = self.path.rstrip("/")
            if route == "/v1/models":
                return self.server.models()
            if route == "/health":
                return {"status": "ok"}
            raise self._no_route()

        self._respond(handle)

    def do_POST(self) -> None:
        def handle() -> dict:
            raw = self._read_body()  # first, so an early error never leaves a body unread on a kept-alive socket
            self._authorize()
            routes = {"/v1/chat/completions": self.server.chat_completion, "/v1/completions": self.server.completion}
            route = routes.get(self.path.rstrip("/"))
            if route is None:
                raise self._no_route()
            try:
                request = json.loads(raw)
            except ValueError as e:
                raise RequestError(400, f"the body is not valid JSON: {e}") from None
            return route(request)

        self._respond(handle)

    def _respond(self, handle) -> None:
        try:
            status, body = 200, handle()
        except RequestError as e:
            status, body = e.status, {"error": {"message": e.message, "type": e.kind, "param": e.param,
                                                "code": None}}
        except Exception as e:  # a bug or an out-of-memory: the client gets a 500, the server keeps serving
            logger.exception("request %s %s failed", self.command, self.path)
            status, body = 500, {"error": {"message": f"internal error: {type(e).__name__}: {e}",
                                           "type": "server_error", "param": None, "code": None}}
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorize(self) -> None:
        if self.server.api_key is None or self.path.rstrip("/") == "/health":
            return
        sent = self.headers.get("Authorization", "")
        expected = f"Bearer {self.server.api_key}"
        if not hmac.compare_digest(sent.encode(), expected.encode()):  # constant time: no guessing by timing
            raise RequestError(401, "missing or wrong API key; send it as 'Authorization: Bearer <key>'",
                               kind="authentication_error")

    def _read_body(self) -> bytes:
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            self.close_connection = True
            raise RequestError(400, "Content-Length must be an integer") from None
        if length > MAX_BODY_BYTES:
            self.close_connection = True  # the unread body would be taken for the next request
            raise RequestError(413, f"the body is {length} bytes; at most {MAX_BODY_BYTES} are accepted")
        return self.rfile.read(length)

    def _no_route(self) -> RequestError:
        return RequestError(404, f"no route {self.command} {self.path}; this server has GET /v1/models, "
                                 f"POST /v1/chat/completions, POST /v1/completions and GET /health",
                            kind="not_found_error")

    def log_message(self, format: str, *args) -> None:  # noqa: A002  (the base class's name)
        # the request line and status only: headers, and so API keys, are never logged
        logger.info("%s %s", self.address_string(), format % args)


def make_server(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, host: str = "127.0.0.1",
                port: int = 8000, *, model_name: str = "model", api_key: str | None = None,
                generation: GenerationConfig | None = None) -> ChatServer:
    """A server bound to (host, port), not yet serving: call `serve_forever()` (port 0 picks a free port).

    `api_key`, when given, must arrive as `Authorization: Bearer <key>` on every request but /health. `generation`:
    the local engine's settings (sampler, KV cache budget).
    """
    model.eval()
    return ChatServer((host, port), model, tokenizer, model_name, api_key, generation)


def serve(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, host: str = "127.0.0.1", port: int = 8000,
          *, model_name: str = "model", api_key: str | None = None) -> None:
    """Serve until interrupted (Ctrl-C)."""
    server = make_server(model, tokenizer, host, port, model_name=model_name, api_key=api_key)
    logger.info("serving %r at %s", model_name, server.url)
    serve_until_interrupted(server)


def serve_until_interrupted(server: ChatServer) -> None:
    """Answer requests until Ctrl-C, then release the port."""
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def load_checkpoint(name_or_path: str, *, dtype: str = "float32",
                    device: str | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A checkpoint folder (or hub name, or "tiny") loaded for serving, on `device` (default: CUDA if present)."""
    model, tok = load_model_and_tokenizer(ModelConfig(name_or_path=name_or_path, dtype=dtype))
    return model.to(device or ("cuda" if torch.cuda.is_available() else "cpu")).eval(), tok
