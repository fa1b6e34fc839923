"""A checkpoint behind an OpenAI-compatible HTTP API (`r1 serve`), so any stage (or any OpenAI client) can ask it
questions, its concurrent requests decoded together.

    GET  /v1/models             the one model served
    POST /v1/chat/completions   chat: messages -> chat template -> n choices (stream: chat.completion.chunk events)
    POST /v1/completions        completion of text as given (a prompt or a list), n choices each (stream too)
    GET  /health                200 when up

It exists so the pipeline's judge and rejection sampling's generation can be a model this project trained, reached
the same way as a vLLM or hosted endpoint (`HTTPJudge`, `HTTPGenerationBackend`). FastAPI on uvicorn; every
request's rows go through one engine thread that batches them continuously (`grpo.sampling.batcher`: the
batching rules, seeds, stop strings), and the handlers wait on it in asyncio. Streaming is OpenAI's: server-sent
`data: {...}` chunks, then `data: [DONE]`. `stop` strings end the text before them (finish_reason "stop"), the row's
slot freed at once; a client that goes away has its request cancelled; past `max_waiting` requests waiting for a
slot, 429. Differences from vLLM: `logprobs` only 0 (the sampled token's log-prob) and not with streaming, and that
log-prob is the tempered full distribution's, log softmax(logits / temperature) before top-k/top-p (the raw log
softmax at temperature 0), where vLLM's and OpenAI's default is the raw model's; an over-long `max_tokens` trimmed
to the model's length rather than refused.

Beside it, the alignment stage registers the final model in MLflow's registry (`tasks.promotion.register_model`:
`mlflow.transformers.log_model`, task llm/v1/chat), so `mlflow models serve -m models:/<name>@champion
--env-manager local` serves it too: MLflow's generic pyfunc scoring server, POST /invocations, one request at a
time through the logged model, for MLflow's deployment tooling (its Docker images, SageMaker, Azure ML) and for
checking what was registered (tests/tasks/test_promotion.py). `r1 serve` is the one to generate with: the OpenAI API
that the judge, the HTTP backend and other clients speak, batched across requests, streamed, with stop strings.

FastAPI and uvicorn; must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import threading
import time
import uuid

import torch
import uvicorn
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo.cores import cpu_cores, user_threads
from grpo.configs.model import ModelConfig
from grpo.configs.sampling import GenerationConfig
from grpo.models import load_model_and_tokenizer
from grpo.sampling.batcher import RequestBatcher, Delta, Failed, Finished, QueueFull
from grpo.sampling.engines import build_engine
from grpo.sampling.openai_requests import Request, RequestError, parse_chat, parse_completion

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 2**20  # larger bodies are refused before they are read
SLOTS = 64  # rows decoded at once (fewer where the KV cache budget holds fewer)
MAX_WAITING = 256  # requests waiting for a slot; one more is answered 429
# on SIGINT or SIGTERM (or `shutdown()`): new connections are refused at once, the requests in flight get this long to
# finish, then each still decoding is cut with a 503 ("the server is shutting down"; an error event when streamed)
SHUTDOWN_GRACE_S = 2.0


class _Server(uvicorn.Server):
    """uvicorn's server, whose shutdown also cuts the engine's requests past SHUTDOWN_GRACE_S: uvicorn by itself
    waits for every open request, and a long completion under load kept `r1 serve` up for its whole graceful
    timeout after Ctrl-C."""

    def __init__(self, config: uvicorn.Config, engine: RequestBatcher):
        super().__init__(config)
        self.engine = engine

    async def shutdown(self, sockets=None) -> None:
        cut = threading.Timer(SHUTDOWN_GRACE_S, self.engine.stop)
        cut.daemon = True
        cut.start()
        try:
            await super().shutdown(sockets)
        finally:
            cut.cancel()
_GONE = object()  # what a request's event queue gets when its client disconnects


def engine_threads(device: str, environ=None, cores: int | None = None) -> int | None:
    """The engine thread's CPU threads: on a CPU, the cores but one (at least one), which the HTTP thread, the
    tokenizer and the clients of a machine this size need while the engine decodes (2 cores, the tiny model, 1, 8
    and 32 clients: 1.73x, 1.48x and 1.21x the tokens/s of two threads; docs/benchmarks/sampling.md); what the user
    set in OMP_NUM_THREADS wins; None (torch's own) off the CPU.

    >>> engine_threads("cpu", {}, 2), engine_threads("cpu", {}, 16), engine_threads("cpu", {"OMP_NUM_THREADS": "2"}, 2)
    (1, 15, 2)
    """
    if device != "cpu":
        return None
    return user_threads(environ) or max(1, (cores or cpu_cores()) - 1)


class ChatServer:
    """One model behind the API, bound to its address at once (port 0: a free one, read back from `url`).

    `serve_forever()` answers until `shutdown()` (from another thread) or Ctrl-C; `start()` does it in a thread of
    its own and `stop()` ends it and releases the port.
    """

    def __init__(self, address: tuple[str, int], model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 model_name: str, api_key: str | None = None, generation: GenerationConfig | None = None, *,
                 slots: int = SLOTS, max_waiting: int = MAX_WAITING):
        self.model_name, self.api_key = model_name, api_key
        # the longest prompt + completion the model was built for; None when its config does not say
        self.max_len: int | None = getattr(model.config, "max_position_embeddings", None)
        backend = build_engine(generation or GenerationConfig(), model, tokenizer, who="r1 serve")
        device = next(model.parameters()).device.type
        self.engine = RequestBatcher(backend, slots=slots, max_waiting=max_waiting, max_len=self.max_len,
                                     threads=engine_threads(device))
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.socket = socket.create_server(address, family=family)  # bound now: the url is known before serving
        # the connections it accepts inherit this. asyncio sets it only on sockets made with IPPROTO_TCP, and these
        # are made with proto 0: without it Nagle held a reply's body until the client acked its headers, which a
        # client delays up to 40 ms (a 1-token request took 52-64 ms at 1 client, 10-19 ms with it)
        self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server_address = self.socket.getsockname()
        config = uvicorn.Config(_AccessLog(build_app(self)), log_config=None, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=SHUTDOWN_GRACE_S + 2)
        self._uvicorn = _Server(config, self.engine)
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/v1"

    def serve_forever(self, poll_interval: float | None = None) -> None:
        """Answer requests until `shutdown()` or a signal (SIGINT, SIGTERM: in the main thread, uvicorn's handlers
        let the requests in flight finish, then raise the signal again). `poll_interval` is ignored (the
        socketserver argument, kept for callers of the server this one replaced)."""
        self._stopped.clear()
        self.engine.start()
        try:
            self._uvicorn.run(sockets=[self.socket])
        finally:
            self.engine.stop()
            self._stopped.set()

    def start(self) -> ChatServer:
        """Serve in a daemon thread; returns once the server accepts connections."""
        self._thread = threading.Thread(target=self.serve_forever, name="r1-serve-http", daemon=True)
        self._thread.start()
        while not self._uvicorn.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"r1 serve at {self.url} stopped as it started")
            time.sleep(0.01)
        return self

    def shutdown(self) -> None:
        """Stop serving (requests in flight finish first, for up to SHUTDOWN_GRACE_S, then are cut with a 503) and
        wait until it has stopped."""
        if self._uvicorn.started or (self._thread is not None and self._thread.is_alive()):
            self._uvicorn.should_exit = True
            self._stopped.wait()

    def server_close(self) -> None:
        self.socket.close()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()

    def __enter__(self) -> ChatServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "r1-pipeline", "max_model_len": self.max_len}]}

    def authorize(self, request: HTTPRequest) -> None:
        if self.api_key is None:
            return
        sent = request.headers.get("authorization", "")
        expected = f"Bearer {self.api_key}"
        if not hmac.compare_digest(sent.encode(), expected.encode()):  # constant time: no guessing by timing
            raise RequestError(401, "missing or wrong API key; send it as 'Authorization: Bearer <key>'",
                               kind="authentication_error")


def build_app(server: ChatServer) -> FastAPI:
    """The routes, each answering errors with OpenAI's error body."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(RequestError)
    async def refused(request: HTTPRequest, e: RequestError) -> JSONResponse:
        headers = {"Retry-After": "1"} if e.status == 429 else None
        return JSONResponse(e.body(), e.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def no_route(request: HTTPRequest, e: HTTPException) -> JSONResponse:
        try:
            server.authorize(request)  # an unknown route tells a client without the key nothing either
        except RequestError as refusal:
            return await refused(request, refusal)
        return await refused(request, RequestError(
            e.status_code, f"no route {request.method} {request.url.path}; this server has GET /v1/models, POST "
                           f"/v1/chat/completions, POST /v1/completions and GET /health", kind="not_found_error"))

    @app.exception_handler(Exception)
    async def failed(request: HTTPRequest, e: Exception) -> JSONResponse:  # a bug: a 500, the server goes on
        logger.error("request %s %s failed", request.method, request.url.path, exc_info=e)
        return JSONResponse({"error": {"message": f"internal error: {type(e).__name__}: {e}", "type": "server_error",
                                       "param": None, "code": None}}, 500)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: HTTPRequest) -> dict:
        server.authorize(request)
        return server.models()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        body = await _read_json(server, request)
        return await _answer(server, request, parse_chat(body, server.model_name))

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        body = await _read_json(server, request)
        return await _answer(server, request, parse_completion(body, server.model_name))

    return app


async def _read_json(server: ChatServer, request: HTTPRequest):
    """The body as JSON: 413 when it is too large (before it is read, or the key checked), 401 without the key."""
    try:
        length = int(request.headers.get("content-length", "0"))
    except ValueError:
        raise RequestError(400, "Content-Length must be an integer") from None
    if length > MAX_BODY_BYTES:
        raise RequestError(413, f"the body is {length} bytes; at most {MAX_BODY_BYTES} are accepted")
    server.authorize(request)
    raw = bytearray()
    async for part in request.stream():  # a chunked body names no length: counted as it comes
        raw += part
        if len(raw) > MAX_BODY_BYTES:
            raise RequestError(413, f"the body is over {MAX_BODY_BYTES} bytes, the most accepted")
    try:
        return json.loads(raw)
    except ValueError as e:
        raise RequestError(400, f"the body is not valid JSON: {e}") from None


async def _answer(server: ChatServer, request: HTTPRequest, req: Request):
    """Hand the request to the engine thread and answer from its events (a stream, or one JSON reply)."""
    loop, events = asyncio.get_running_loop(), asyncio.Queue()

    def emit(event) -> None:  # called from the engine thread
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the loop has closed (the server stopped): nobody is listening
            pass

    try:
        job = server.engine.submit(req, emit)
    except QueueFull as e:
        raise RequestError(429, f"the server is busy: {e}; retry later", kind="requests",
                           code="rate_limit_exceeded") from None
    watcher = asyncio.ensure_future(_watch_disconnect(request, events))
    finished = False
    try:
        first = await events.get()  # Started, or Failed: a prompt the model cannot take
        if first is _GONE:
            return None
        if isinstance(first, Failed):
            raise first.error
        reply = _Reply(server.model_name, req, first.prompt_tokens)
        if req.stream:
            finished = True  # the stream owns the job (and the watcher) from here
            return StreamingResponse(_stream(server, job, events, reply, watcher), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        while len(reply.done) < reply.choices:
            event = await events.get()
            if event is _GONE:
                return None
            if isinstance(event, Failed):
                raise event.error
            if isinstance(event, Finished):
                reply.done[event.choice] = event
        finished = True
        return reply.whole()
    finally:
        if not finished:
            server.engine.cancel(job)
        if not req.stream or not finished:
            watcher.cancel()


async def _watch_disconnect(request: HTTPRequest, events: asyncio.Queue) -> None:
    """Put _GONE in `events` when the client disconnects (the body is read by then: only that message comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    events.put_nowait(_GONE)


async def _stream(server: ChatServer, job, events: asyncio.Queue, reply: _Reply, watcher: asyncio.Future):
    """Server-sent events: a first chunk, the text as it comes, each choice's last chunk, usage, [DONE]. A client
    that goes away (the watcher, or Starlette cancelling this generator) has its request cancelled."""
    ended = False
    try:
        for chunk in reply.opening():
            yield _sse(chunk)
        while len(reply.done) < reply.choices:
            event = await events.get()
            if event is _GONE:
                return
            if isinstance(event, Failed):
                e = event.error
                body = e.body() if isinstance(e, RequestError) else {"error": {
                    "message": f"internal error: {type(e).__name__}: {e}", "type": "server_error", "param": None,
                    "code": None}}
                ended = True
                yield _sse(body)
                return
            if isinstance(event, Delta):
                yield _sse(reply.chunk(event.choice, event.text))
            elif isinstance(event, Finished):
                reply.done[event.choice] = event
                if event.rest:
                    yield _sse(reply.chunk(event.choice, event.rest))
                yield _sse(reply.chunk(event.choice, None, event.finish_reason))
        ended = True
        if reply.req.include_usage:
            yield _sse(reply.usage_chunk())
        yield "data: [DONE]\n\n"
    finally:
        watcher.cancel()
        if not ended:
            server.engine.cancel(job)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class _Reply:
    """The OpenAI objects of one request: the whole reply, or its stream's chunks."""

    def __init__(self, model_name: str, req: Request, prompt_tokens: list[int]):
        self.model_name, self.req, self.prompt_tokens = model_name, req, prompt_tokens
        self.choices = len(prompt_tokens) * req.n
        self.done: dict[int, Finished] = {}
        self.id = f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_name}

    def usage(self) -> dict:
        prompt, completion = sum(self.prompt_tokens), sum(len(f.token_ids) for f in self.done.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def whole(self) -> dict:
        done = [self.done[i] for i in range(self.choices)]
        if self.req.chat:
            choices = [{"index": f.choice, "message": {"role": "assistant", "content": f.text}, "logprobs": None,
                        "finish_reason": f.finish_reason} for f in done]
            return {**self._head("chat.completion"), "choices": choices, "usage": self.usage()}
        choices = [{"index": f.choice, "text": f.text, "logprobs": _token_logprobs(f) if self.req.logprobs else None,
                    "finish_reason": f.finish_reason} for f in done]
        return {**self._head("text_completion"), "choices": choices, "usage": self.usage()}

    def opening(self) -> list[dict]:
        """Chat's first chunk of each choice names the role; completions start with text."""
        return [self.chunk(i, None, role=True) for i in range(self.choices)] if self.req.chat else []

    def chunk(self, choice: int, text: str | None, finish_reason: str | None = None, role: bool = False) -> dict:
        if self.req.chat:
            delta = {"role": "assistant", "content": ""} if role else {} if text is None else {"content": text}
            entry = {"index": choice, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [entry]}
        entry = {"index": choice, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [entry]}

    def usage_chunk(self) -> dict:
        kind = "chat.completion.chunk" if self.req.chat else "text_completion"
        return {**self._head(kind), "choices": [], "usage": self.usage()}


def _token_logprobs(f: Finished) -> dict:
    """OpenAI completion logprobs of a choice: each sampled token, its log-prob and its text offset.

    The log-prob is the token's under the tempered full distribution, log softmax(logits / temperature), before
    top-k/top-p cut the distribution the token was drawn from (temperature 0: log softmax(logits)); OpenAI's and
    vLLM's default is the raw model's, log softmax(logits), whatever the temperature. It is the number a GRPO
    trainer computes for the token at that temperature, so an importance weight built on it is 1 where the
    weights are the same (`grpo.sampling.local.decode_step.choose_tokens`)."""
    offsets = [sum(len(t) for t in f.token_texts[:i]) for i in range(len(f.token_texts))]
    values = [round(v, 6) for v in f.logprobs]
    return {"tokens": f.token_texts, "token_logprobs": values, "text_offset": offsets,
            "top_logprobs": [{t: v} for t, v in zip(f.token_texts, values)]}


class _AccessLog:
    """ASGI wrapper: one log line per request (client, method, path, status; never headers, so never a key), and a
    trailing slash dropped from the path, as the server before this one took it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope["path"] = scope["path"].rstrip("/") or "/"
        status = []

        async def sending(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            client = scope.get("client") or ("-", 0)
            logger.info('%s "%s %s" %s', client[0], scope["method"], scope["path"], status[0] if status else "-")


def make_server(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, host: str = "127.0.0.1",
                port: int = 8000, *, model_name: str = "model", api_key: str | None = None,
                generation: GenerationConfig | None = None, slots: int = SLOTS,
                max_waiting: int = MAX_WAITING) -> ChatServer:
    """A server bound to (host, port), not yet serving: call `serve_forever()` or `start()` (port 0 picks a free
    port).

    `api_key`, when given, must arrive as `Authorization: Bearer <key>` on every request but /health. `generation`:
    the local engine's settings (sampler, KV cache budget). slots: rows decoded at once; max_waiting: requests that
    may wait for a slot before the next is answered 429.
    """
    model.eval()
    return ChatServer((host, port), model, tokenizer, model_name, api_key, generation, slots=slots,
                      max_waiting=max_waiting)


def serve(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, host: str = "127.0.0.1", port: int = 8000,
          *, model_name: str = "model", api_key: str | None = None) -> None:
    """Serve until interrupted (Ctrl-C)."""
    server = make_server(model, tokenizer, host, port, model_name=model_name, api_key=api_key)
    logger.info("serving %r at %s", model_name, server.url)
    serve_until_interrupted(server)


def serve_until_interrupted(server: ChatServer) -> None:
    """Answer requests until Ctrl-C (or SIGTERM), then release the port."""
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
