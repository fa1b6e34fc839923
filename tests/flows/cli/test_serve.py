"""`r1 serve` batching its clients (issue 43, part 3): concurrent requests get the tokens serial ones get, streamed
chunks join to the whole text, stop strings end the text (across tokens, streamed too), a client that goes away
frees its slot, past the queue limit 429, the key still checked. A tiny Qwen2 from its config, served in a thread
on 127.0.0.1; no mocks."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from flows.cli.serve import make_server
from grpo.configs.model import ModelConfig
from grpo.configs.sampling import SamplingConfig
from grpo.models import load_model_and_tokenizer
from grpo.sampling.local.backend import TransformersBackend, render_prompts
from tiny_configs import TINY_MODEL as SMALL

KEY = "sk-test-batching"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = [f"Story {i}: the {w} went" for i, w in enumerate(["cat", "river", "train", "cloud"] * 8)]  # 32


@pytest.fixture(scope="module")
def tiny():
    model, tok = load_model_and_tokenizer(ModelConfig(tiny=SMALL))
    return model.eval(), tok


@pytest.fixture(scope="module")
def server(tiny):
    """8 slots, a roomy queue."""
    with make_server(*tiny, port=0, model_name="tiny", slots=8, max_waiting=64) as srv:
        yield srv


@pytest.fixture(scope="module")
def one_slot(tiny):
    """One slot, one request may wait, and a key."""
    with make_server(*tiny, port=0, model_name="tiny", api_key=KEY, slots=1, max_waiting=1) as srv:
        yield srv


def post(srv, route: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{srv.url}/{route}", json={"model": "tiny", **body}, timeout=60, **kw)


def stream(srv, route: str, body: dict, **kw) -> list[dict]:
    """The stream's chunks, in order; the last line must be [DONE]."""
    with httpx.stream("POST", f"{srv.url}/{route}", json={"model": "tiny", **body, "stream": True}, timeout=60,
                      **kw) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def joined(chunks: list[dict], index: int = 0) -> tuple[str, str | None]:
    """The text of choice `index` across a stream's chunks, and its finish_reason."""
    mine = [c for ch in chunks for c in ch["choices"] if c["index"] == index]
    text = "".join(c["delta"].get("content", "") if "delta" in c else c["text"] for c in mine)
    assert all(c["finish_reason"] is None for c in mine[:-1])
    return text, mine[-1]["finish_reason"]


def tokens_of(reply: dict) -> list[list[str]]:
    return [c["logprobs"]["tokens"] for c in reply["choices"]]


def test_32_concurrent_clients_get_the_tokens_serial_requests_get(server, tiny):
    bodies = [{"prompt": p, "max_tokens": 8 + 3 * i, "temperature": 0, "logprobs": 0} for i, p in enumerate(PROMPTS)]
    counts = server.engine.sampler.counts
    steps = counts.steps
    serial = [post(server, "completions", b).json() for b in bodies]
    serial_steps, steps = counts.steps - steps, counts.steps
    with ThreadPoolExecutor(32) as pool:
        concurrent = [r.json() for r in pool.map(lambda b: post(server, "completions", b), bodies)]
    assert [tokens_of(r) for r in concurrent] == [tokens_of(r) for r in serial]
    assert [r["choices"][0]["text"] for r in concurrent] == [r["choices"][0]["text"] for r in serial]
    assert counts.steps - steps < serial_steps / 2  # they were decoded together: far fewer steps
    assert server.engine.live == 0 and server.engine.waiting == 0
    # and what the pipeline's own engine samples for those prompts, alone
    local = TransformersBackend(*tiny)
    for i in (0, 17, 31):
        alone = local.generate_from_text([PROMPTS[i]], 1, SamplingConfig(max_new_tokens=8 + 3 * i, temperature=0),
                                         add_special_tokens=True)
        assert concurrent[i]["choices"][0]["text"] == alone.texts[0]
        assert concurrent[i]["usage"]["completion_tokens"] == int(alone.completion_tokens[0])


def test_requests_of_any_budget_and_prompt_join_one_batch(server, tiny):
    # a paged cache (this CPU's eager steps) holds what rows write: one batch as wide as the model serves every
    # request of a setting; a static one was shaped by its first requests' budget, and a larger one waited for a new
    bodies = [{"prompt": p, "max_tokens": m, "temperature": 0.7, "seed": i, "logprobs": 0}
              for i, (p, m) in enumerate([(PROMPTS[0], 8), (PROMPTS[1] * 6, 200), (PROMPTS[2], 8), (PROMPTS[3], 400)])]
    before = server.engine.batches
    replies = [post(server, "completions", b).json() for b in bodies]
    assert server.engine.batches - before <= 1  # a new one only where the last batch had another setting
    local = TransformersBackend(*tiny)
    for body, reply in zip(bodies, replies):  # each as the pipeline's own engine samples it alone, same seed
        torch.manual_seed(body["seed"])
        alone = local.generate_from_text([body["prompt"]], 1, SamplingConfig(max_new_tokens=body["max_tokens"],
                                                                            temperature=0.7), add_special_tokens=True)
        assert reply["choices"][0]["text"] == alone.texts[0]


def test_chat_requests_at_once_answer_as_alone(server):
    bodies = [{"messages": [{"role": "user", "content": p}], "max_tokens": 24, "temperature": 1.0, "seed": i}
              for i, p in enumerate(PROMPTS[:12])]
    serial = [post(server, "chat/completions", b).json()["choices"][0]["message"]["content"] for b in bodies]
    with ThreadPoolExecutor(12) as pool:
        replies = list(pool.map(lambda b: post(server, "chat/completions", b).json(), bodies))
    assert [r["choices"][0]["message"]["content"] for r in replies] == serial
    assert len(set(serial)) > 1  # seeded samples, each its own


def test_chat_n_answers_n_choices_sharing_the_prompts_pages(server, tiny):
    """n replies to one conversation: n choices (indexes 0..n-1), usage counting each, the tokens the pipeline's own
    engine samples for n rows of the rendered prompt with the same seed, its rows submitted as one prompt's n rows
    (their prompt's pages written once and shared); streamed, every index opens with the role and finishes; n past
    completions' bounds refused."""
    messages = [{"role": "user", "content": "Tell me about rivers."}]
    body = {"messages": messages, "n": 4, "max_tokens": 24, "temperature": 1.0, "seed": 11}
    r = post(server, "chat/completions", body)
    assert r.status_code == 200, r.text
    reply = r.json()
    choices = reply["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    texts = [c["message"]["content"] for c in choices]
    assert len(set(texts)) > 1 and all(c["message"]["role"] == "assistant" for c in choices)
    _, tok = tiny
    rendered = render_prompts(tok, [messages])[0]
    prompt_tokens = len(tok(rendered, add_special_tokens=False)["input_ids"])
    local = TransformersBackend(*tiny)
    torch.manual_seed(11)
    alone = local.generate_from_text([rendered], 4, SamplingConfig(max_new_tokens=24, temperature=1.0))
    assert texts == alone.texts
    assert reply["usage"] == {"prompt_tokens": prompt_tokens,
                              "completion_tokens": int(alone.completion_tokens.sum()),
                              "total_tokens": prompt_tokens + int(alone.completion_tokens.sum())}
    # the same request again: the same n choices (seeded), its n rows submitted as one prompt's
    batch = server.engine.batch
    prompts = batch._next_prompt
    assert [c["message"]["content"] for c in post(server, "chat/completions", body).json()["choices"]] == texts
    assert server.engine.batch is batch and batch._next_prompt == prompts + 1
    chunks = stream(server, "chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"] == reply["usage"]
    for c in choices:
        opening = next(ch["choices"][0] for ch in chunks if ch["choices"] and ch["choices"][0]["index"] == c["index"])
        assert opening["delta"] == {"role": "assistant", "content": ""}
        assert joined(chunks[:-1], c["index"]) == (c["message"]["content"], c["finish_reason"])
    # completions' bounds
    for n in (0, 1025, 2.5, "2"):
        r = post(server, "chat/completions", {**body, "n": n})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", n


@pytest.mark.parametrize("route", ["chat/completions", "completions"])
def test_streamed_chunks_join_to_the_whole_text(server, route):
    if route == "chat/completions":
        body = {"messages": [{"role": "user", "content": "Tell me about rivers."}], "max_tokens": 40, "seed": 7}
    else:
        body = {"prompt": PROMPTS[:2], "n": 2, "max_tokens": 40, "seed": 7}
    whole = post(server, route, body).json()
    chunks = stream(server, route, {**body, "stream_options": {"include_usage": True}})
    kind = "chat.completion.chunk" if route == "chat/completions" else "text_completion"
    assert {c["object"] for c in chunks} == {kind} and len({c["id"] for c in chunks}) == 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    if route == "chat/completions":
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    for choice in whole["choices"]:
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        assert joined(chunks[:-1], choice["index"]) == (text, choice["finish_reason"])
    assert len(chunks) > 5  # the text came in pieces


def test_a_stop_string_across_tokens_ends_the_text_before_it(server):
    body = {"prompt": PROMPTS[3], "max_tokens": 40, "temperature": 0}
    full = post(server, "completions", {**body, "logprobs": 0}).json()["choices"][0]
    tokens = full["logprobs"]["tokens"]
    k = next(i for i in range(4, len(tokens) - 1) if tokens[i].strip() and tokens[i + 1].strip())
    stop = tokens[k][-1] + tokens[k + 1][:2]  # the end of one token and the start of the next
    expected = full["text"][:full["text"].index(stop)]
    reply = post(server, "completions", {**body, "stop": [stop, "never-seen-here"]}).json()
    assert reply["choices"][0]["text"] == expected and reply["choices"][0]["finish_reason"] == "stop"
    assert reply["usage"]["completion_tokens"] <= k + 2 < len(tokens)  # the row stopped there
    assert joined(stream(server, "completions", {**body, "stop": stop})) == (expected, "stop")
    # a possible start of a stop string is held back while streaming, and sent when it turns out not to be one
    near = full["text"][len(expected):len(expected) + 2] + "\x00never"
    assert joined(stream(server, "completions", {**body, "stop": near})) == (full["text"], "length")


def test_chat_stops_at_a_stop_string_when_streamed(server):
    body = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 40, "seed": 3}
    text = post(server, "chat/completions", body).json()["choices"][0]["message"]["content"]
    stop = text[10:13]
    chunks = stream(server, "chat/completions", {**body, "stop": stop})
    assert joined(chunks) == (text[:text.index(stop)], "stop")


# 8 rows of 480 tokens through one slot: seconds of decoding, so the tests below act while it holds the slot
LONG = {"prompt": "Once upon a time", "n": 8, "max_tokens": 480, "temperature": 0}


def _wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_client_that_disconnects_mid_stream_frees_its_slot(one_slot):
    engine = one_slot.engine
    body = {"model": "tiny", **LONG, "stream": True}
    with httpx.stream("POST", f"{one_slot.url}/completions", json=body, headers=AUTH, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # decoding
        steps = engine.sampler.counts.steps
        assert engine.live == 1
    # the connection is closed: the rows are cancelled and the slot freed, long before their 8 x 480 tokens
    _wait_for(lambda: engine.live == 0)
    assert engine.sampler.counts.steps - steps < 1000
    reply = post(one_slot, "completions", {"prompt": "Next", "max_tokens": 4}, headers=AUTH)  # the slot is free
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4


def test_past_the_queue_limit_a_request_gets_429(one_slot):
    engine = one_slot.engine
    body = {"model": "tiny", **LONG, "stream": True}
    with ThreadPoolExecutor(1) as pool, httpx.stream("POST", f"{one_slot.url}/completions", json=body, headers=AUTH,
                                                     timeout=60) as first:
        lines = first.iter_lines()  # kept: a generator let go closes the connection
        assert next(lines).startswith("data: ")  # the one slot is taken
        waiting = pool.submit(post, one_slot, "completions", {"prompt": "Then", "max_tokens": 4}, headers=AUTH)
        _wait_for(lambda: engine.waiting == 1)  # the one place in the queue is taken
        refused = post(one_slot, "completions", {"prompt": "Also", "max_tokens": 4}, headers=AUTH)
        assert refused.status_code == 429 and refused.headers["retry-after"]
        error = refused.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and "busy" in error["message"]
    # the first client is gone: the waiting request gets the slot
    assert waiting.result().status_code == 200


def test_the_key_is_still_checked(one_slot):
    url = one_slot.url
    assert httpx.get(f"{url}/models").status_code == 401
    assert httpx.get(f"{url}/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    refused = post(one_slot, "chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{url}/models", headers=AUTH).json()["data"][0]["id"] == "tiny"
    assert httpx.get(url.removesuffix("/v1") + "/health").json() == {"status": "ok"}  # no key needed


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"prompt": "hi", "stop": 3}, 400, "stop"),
    ({"prompt": "hi", "stream": True, "logprobs": 0}, 400, "logprobs"),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ({"prompt": "x " * 600}, 400, "prompt"),  # longer than the model takes: found as the engine tokenizes it
])
def test_a_bad_request_is_refused_naming_the_field(server, body, status, param):
    r = post(server, "completions", body)
    assert r.status_code == status and r.json()["error"]["param"] == param


def test_the_servers_connections_send_without_waiting_for_acks(server):
    """TCP_NODELAY on every connection the server accepts: with Nagle on, a reply's body waited for the client's
    ack of its headers, which clients delay up to 40 ms, and one-token requests took 52-64 ms instead of 10-19."""
    with httpx.Client(timeout=60) as client:
        assert client.get(f"{server.url}/models").status_code == 200  # the connection is kept open
        sockets = [c.transport.get_extra_info("socket") for c in server._uvicorn.server_state.connections]
        assert sockets and all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in sockets)


def test_a_body_too_large_is_refused_before_it_is_read(server):
    r = httpx.post(f"{server.url}/completions", content=b"x" * (8 * 2**20 + 1), timeout=60)
    assert r.status_code == 413 and "at most" in r.json()["error"]["message"]


def test_a_budget_past_the_models_context_is_refused_and_the_default_one_trimmed(server, tiny):
    """max_tokens 100000 on a model that takes 512 tokens: HTTP 400 naming the field and what would fit (as OpenAI
    and vLLM answer), nothing sampled. A request that names no budget gets what the context leaves instead."""
    model, _ = tiny
    context = model.config.max_position_embeddings
    r = post(server, "completions", {"prompt": "Hello", "max_tokens": 100000, "temperature": 0})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "max_tokens" and f"at most {context} tokens" in error["message"]
    assert error["message"].startswith("max_tokens is 100000, and with the prompt's ")
    r = post(server, "chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                           "max_completion_tokens": context, "temperature": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    ok = post(server, "completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 4
    _, tok = tiny
    long = " ".join(["word"] * 400)
    prompt_tokens = len(tok(long)["input_ids"])
    assert context - prompt_tokens < 256  # less room than the default budget
    trimmed = post(server, "completions", {"prompt": long, "temperature": 0})
    assert trimmed.status_code == 200, trimmed.text
    assert trimmed.json()["usage"]["completion_tokens"] <= context - prompt_tokens


def test_a_stop_mid_request_answers_what_ends_in_the_grace_and_cuts_the_rest_with_503(tiny, monkeypatch):
    """Ctrl-C or SIGTERM (`shutdown()`, which uvicorn's signal handlers call) while requests decode: each still
    decoding after SHUTDOWN_GRACE_S ends with a 503 saying the server is shutting down (an error event when streamed)
    and the server is gone, instead of waiting for every long completion."""
    from flows.cli import serve

    monkeypatch.setattr(serve, "SHUTDOWN_GRACE_S", 0.2)
    srv = make_server(*tiny, port=0, model_name="tiny", slots=16).start()
    streamed: list[str] = []

    def stream_long():
        with httpx.stream("POST", f"{srv.url}/completions", json={"model": "tiny", **LONG, "stream": True},
                          timeout=60) as r:
            streamed.extend(line for line in r.iter_lines() if line)

    try:
        with ThreadPoolExecutor(2) as pool:
            whole = pool.submit(post, srv, "completions", LONG)
            parts = pool.submit(stream_long)
            _wait_for(lambda: srv.engine.live == 16)  # both requests' 8 rows decoding
            t0 = time.monotonic()
            srv.shutdown()
            stopped_in = time.monotonic() - t0
            reply = whole.result(timeout=30)
            parts.result(timeout=30)
    finally:
        srv.stop()
    assert stopped_in < 30  # a bound on a hang; its time on a quiet machine is a few tenths of a second
    assert reply.status_code == 503 and "shutting down" in reply.json()["error"]["message"]
    last = json.loads(streamed[-1][6:])
    assert "shutting down" in last["error"]["message"] and len(streamed) > 1  # text came, then the error
    with pytest.raises(httpx.ConnectError):  # and nothing answers any more
        post(srv, "completions", {"prompt": "Next", "max_tokens": 4})


def test_the_engine_thread_decodes_on_the_threads_it_is_given(tiny):
    """Each thread has its own OpenMP setting: the engine sets its threads in its own thread (r1 serve: the cores
    but one on a CPU, the user's OMP_NUM_THREADS first), and reads back what it got there."""
    from flows.cli.serve import engine_threads
    from grpo.sampling.batcher import RequestBatcher

    assert engine_threads("cpu", {}, 2) == 1 and engine_threads("cpu", {}, 16) == 15
    assert engine_threads("cpu", {"OMP_NUM_THREADS": "3"}, 2) == 3 and engine_threads("cuda", {}, 2) is None
    wanted = torch.get_num_threads() + 1  # not what a thread of this process gets by itself
    batcher = RequestBatcher(TransformersBackend(*tiny), slots=2, threads=wanted)
    batcher.start()
    try:
        deadline = time.time() + 30
        while batcher.engine_threads is None and time.time() < deadline:
            time.sleep(0.01)
    finally:
        batcher.stop()
    assert batcher.engine_threads == wanted
    with pytest.raises(ValueError, match="threads at least 1"):
        RequestBatcher(TransformersBackend(*tiny), threads=0)
