"""Generation from OpenAI-compatible servers: `r1 serve`'s /v1/completions, the HTTP backend (its pre-flight, its
retries and failover), and the rejection stage spread over two `r1 serve` processes, one killed midway."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pandas as pd
import pytest
import torch
from pydantic import ValidationError

from flows.cli.serve import load_checkpoint, make_server
from grpo.configs.model import ModelConfig
from grpo.configs.recipe import RejectionSamplingConfig
from grpo.configs.rejection import RejectionConfig
from grpo.configs.sampling import GenerationConfig, SamplingConfig
from grpo.models import load_model_and_tokenizer
from grpo.ports import free_port
from grpo.rejection.shards import run_rejection_sampling, shard_seed
from grpo.sampling.engines import require_tokens
from grpo.sampling.http_backend import (
    GenerationUnavailable,
    HTTPGenerationBackend,
    sample_seed,
)
from grpo.sampling.local.backend import TransformersBackend, render_prompts
from tiny_configs import TINY_MODEL as SMALL

ROOT = Path(__file__).resolve().parents[3]
SAMPLING = SamplingConfig(max_new_tokens=24)
PROMPTS = [f"Problem {i}: what is it?" for i in range(24)]




@pytest.fixture(scope="module")
def checkpoint(answering_checkpoint) -> str:
    """The session's tiny model taught to answer `<answer>1</answer>` (conftest), so the rule check keeps some."""
    return answering_checkpoint


@pytest.fixture(scope="module")
def in_thread(checkpoint):
    """Two servers of the checkpoint in this process's threads, and its tokenizer (a seeded request draws from a
    generator of its own, so the two never share torch's)."""
    model, tok = load_checkpoint(checkpoint, device="cpu")
    servers = [make_server(model, tok, "127.0.0.1", 0, model_name="policy") for _ in range(2)]
    for srv in servers:
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield servers, model, tok
    for srv in servers:
        srv.shutdown()
        srv.server_close()


# ----------------------------------------------------------------------------------------------------------------
# `r1 serve`: POST /v1/completions


def test_completions_speak_the_openai_schema(in_thread):
    (server, _), _, tok = in_thread
    body = {"model": "policy", "prompt": ["Hello", "What is 2 + 3?"], "n": 3, "max_tokens": 6, "seed": 11,
            "logprobs": 0}
    r = httpx.post(f"{server.url}/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    reply = r.json()
    assert reply["object"] == "text_completion" and reply["id"].startswith("cmpl-") and reply["model"] == "policy"
    choices = reply["choices"]
    assert [c["index"] for c in choices] == list(range(6))  # prompt i's j-th sample is choice i * n + j
    assert all(c["finish_reason"] in ("stop", "length") and isinstance(c["text"], str) for c in choices)
    lengths = [len(c["logprobs"]["tokens"]) for c in choices]
    assert all(0 < n <= 6 for n in lengths)
    # a choice stops where it wrote the end-of-turn token (its last, counted), else it ran to the 6-token limit
    for c, n in zip(choices, lengths):
        stopped = c["logprobs"]["tokens"][-1] == tok.eos_token
        assert c["finish_reason"] == ("stop" if stopped else "length") and (stopped or n == 6), c
    assert all(len(c["logprobs"]["token_logprobs"]) == n and all(v <= 0 for v in c["logprobs"]["token_logprobs"])
               for c, n in zip(choices, lengths))
    usage = reply["usage"]
    assert usage["completion_tokens"] == sum(lengths)
    # the text goes in as it is, no chat template: each prompt counted once, whatever n
    assert usage["prompt_tokens"] == sum(len(tok(p)["input_ids"]) for p in body["prompt"])
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

    again = httpx.post(f"{server.url}/completions", json={**body, "logprobs": None}, timeout=30).json()
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in choices]  # the same seed, the same samples
    assert all(c["logprobs"] is None for c in again["choices"])
    one = httpx.post(f"{server.url}/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=30).json()
    assert len(one["choices"]) == 1 and one["usage"]["completion_tokens"] <= 2


@pytest.mark.parametrize("body, status, param", [
    ({}, 400, "prompt"),
    ({"prompt": [1, 2, 3]}, 400, "prompt"),  # token ids
    ({"prompt": ["fine", ""]}, 400, "prompt"),
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": "hi", "logprobs": 2}, 400, "logprobs"),
    ({"prompt": "hi", "echo": True}, 400, "echo"),
    ({"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),
])
def test_a_bad_completion_request_gets_an_error_naming_the_field(in_thread, body, status, param):
    server = in_thread[0][0]
    r = httpx.post(f"{server.url}/completions", json=body, timeout=30)
    assert r.status_code == status
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"]


# ----------------------------------------------------------------------------------------------------------------
# The HTTP backend


def _backend(urls: list[str], tok, **kw) -> HTTPGenerationBackend:
    return HTTPGenerationBackend(urls, "policy", tok, **{"max_in_flight_per_endpoint": 2, "backoff_s": 0.01, **kw})


def test_a_sample_is_the_same_whichever_endpoint_draws_it_and_as_the_local_backend_would(in_thread):
    servers, model, tok = in_thread
    prompts = [PROMPTS[0], [{"role": "user", "content": "Say hi."}]]  # text and chat messages
    both = _backend([s.url for s in servers], tok)
    one = _backend([servers[1].url], tok)
    try:
        spread = both.generate(prompts, 3, SAMPLING, seed=5)
        assert all(s["answered"] > 0 for s in both.stats().values())  # both endpoints drew some of them
        alone = one.generate(prompts, 3, SAMPLING, seed=5)
        assert alone.texts == spread.texts and torch.equal(alone.completion_tokens, spread.completion_tokens)
    finally:
        both.close()
        one.close()
    assert not spread.has_tokens and len(spread.texts) == 6
    # each sample is what the checkpoint gives for the chat-rendered prompt under that sample's seed
    local = TransformersBackend(model, tok)
    rendered = render_prompts(tok, prompts)
    for k, (i, j) in enumerate((i, j) for i in range(2) for j in range(3)):
        torch.manual_seed(sample_seed(5, i, j))
        expected = local.generate_from_text([rendered[i]], 1, SAMPLING)
        assert spread.texts[k] == expected.texts[0]
        assert int(spread.completion_tokens[k]) == int(expected.completion_tokens[0])
        assert bool(spread.truncated[k]) == bool(expected.truncated[0])
    assert spread.completion_ids is None and spread.logprobs is None  # a text-only rollout
    with pytest.raises(ValueError, match="GRPO needs the completions' token ids.*generation.backend: local"):
        require_tokens(spread, "GRPO")


class _Stub(BaseHTTPRequestHandler):
    """A server that lists the model and answers every completion with `status` (counting them in `hits`); status 0:
    a reply cut off, as a server killed while writing it leaves one."""

    status, hits = 503, 0

    def do_GET(self):
        self._reply(200, {"object": "list", "data": [{"id": "policy"}]})

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).hits += 1
        if self.status == 0:
            self.send_response(200)
            self.send_header("Content-Length", "320")
            self.end_headers()
            self.wfile.write(b'{"id": "cmpl-')  # and no more: the connection closes with 300 bytes to come
            self.close_connection = True
            return
        self._reply(self.status, {"error": {"message": f"stub says {self.status}"}})

    def _reply(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def _stub(status: int):
    handler = type("Handler", (_Stub,), {"status": status, "hits": 0})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}/v1", handler
    finally:
        srv.shutdown()
        srv.server_close()


# status 0: a server killed while it writes a reply, where urllib raises http.client.IncompleteRead; that escaped the
# backend and failed the whole shard, which its task's retry then sampled again (one shard's samples answered twice)
@pytest.mark.parametrize("status, why", [(503, "HTTP 503 stub says 503"),
                                         (0, "the reply was cut off (IncompleteRead)")], ids=["failing", "cut-off"])
def test_an_endpoint_that_keeps_failing_is_given_up_and_its_samples_go_to_the_other(in_thread, status, why):
    (server, _), _, tok = in_thread
    with _stub(status) as (broken, handler):
        backend = _backend([broken, server.url], tok, max_failures=2)
        try:
            out = backend.generate(PROMPTS[:4], 2, SAMPLING, seed=1)
            stats = backend.stats()
        finally:
            backend.close()
    assert len(out.texts) == 8
    assert stats[broken] == {"answered": 0, "in_flight": 0, "dead": why}
    assert stats[server.url]["answered"] == 8 and handler.hits >= 2


def test_a_refused_request_fails_at_once_without_retries(in_thread):
    tok = in_thread[2]
    with _stub(400) as (url, handler):
        backend = _backend([url], tok, retries=3)
        try:
            with pytest.raises(GenerationUnavailable, match=f"generation endpoint at {url}/completions refused the "
                                                            f"request: HTTP 400 stub says 400"):
                backend.generate(PROMPTS[:1], 1, SAMPLING, seed=1)
        finally:
            backend.close()
    assert handler.hits == 1


def test_the_preflight_names_each_endpoint_that_cannot_be_used(in_thread):
    (server, _), _, tok = in_thread
    down = f"http://127.0.0.1:{free_port()}/v1"  # bound then released: nothing listens there
    backend = _backend([server.url, down], tok, retries=1)
    start = time.monotonic()
    with pytest.raises(GenerationUnavailable) as err:
        backend.check_available(SAMPLING)
    assert time.monotonic() - start < 5
    assert str(err.value) == (f"1 of 2 generation endpoint(s) cannot be used; nothing was sampled:\n  could not "
                              f"reach generation endpoint at {down}/models: connection refused after 2 tries")
    wrong = HTTPGenerationBackend([server.url], "gpt-x", tok)
    with pytest.raises(GenerationUnavailable, match=rf"{server.url} does not serve model 'gpt-x'; it serves "
                                                     rf"\['policy'\]"):
        wrong.check_available(SAMPLING)
    with pytest.raises(GenerationUnavailable, match=f"max_model_len {SMALL.max_position_embeddings}, no room"):
        _backend([server.url], tok).check_available(SamplingConfig(max_new_tokens=SMALL.max_position_embeddings))
    _backend([server.url], tok).check_available(SAMPLING)  # up and serving: no error


def test_run_rejection_sampling_checks_the_servers_before_writing_anything(in_thread, tmp_path):
    (server, _), _, tok = in_thread
    prompts = pd.DataFrame({"prompt": PROMPTS[:6], "answer": ["1"] * 6})
    cfg = RejectionConfig(samples_per_prompt=2, sampling=SAMPLING, shard_size=3, decontamination_ngram=0)
    with pytest.raises(GenerationUnavailable, match="does not serve model 'gpt-x'"):
        run_rejection_sampling(HTTPGenerationBackend([server.url], "gpt-x", tok), prompts, cfg, tmp_path / "rs")
    assert not (tmp_path / "rs").exists()


def test_the_recipe_section_fails_on_what_cannot_work():
    with pytest.raises(ValidationError, match="backend 'http' needs endpoints"):
        GenerationConfig(backend="http", model="policy")
    with pytest.raises(ValidationError, match="must start with http"):
        GenerationConfig(backend="http", endpoints=["gpu-0:8000/v1"], model="policy")
    with pytest.raises(ValidationError, match="listed twice"):
        GenerationConfig(endpoints=["http://a:1/v1", "http://a:1/v1/"])
    assert "api_key" not in GenerationConfig.model_fields  # only the variable's name is config (and so logged)


# ----------------------------------------------------------------------------------------------------------------
# The stage over two `r1 serve` processes


def _start_server(checkpoint: str, log: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with open(log, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", checkpoint, "--port", "0",
                                 "--model-name", "policy"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=stderr, text=True)
    first = proc.stdout.readline()  # "serving 'policy' (...) at http://127.0.0.1:<port>/v1"
    assert first.startswith("serving 'policy'"), f"stdout: {first!r}\nstderr: {log.read_text()}"
    return proc, first.rsplit(" at ", 1)[1].strip()


@pytest.fixture(scope="module")
def two_servers(checkpoint, tmp_path_factory):
    """Two `r1 serve` processes of the checkpoint, started side by side; stopped (those still alive) at the end."""
    logs = tmp_path_factory.mktemp("serve-logs")
    with ThreadPoolExecutor(2) as pool:
        started = list(pool.map(lambda i: _start_server(checkpoint, logs / f"serve-{i}.txt"), range(2)))
    yield started
    for proc, _ in started:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=10)


def _stage_config(prompts_file: str, endpoints: list[str], **generation) -> RejectionSamplingConfig:
    return RejectionSamplingConfig.model_validate({
        "model": {"tiny": SMALL.model_dump()},
        "data": {"source": prompts_file, "num_train": len(PROMPTS), "num_heldout": 0},
        "rejection": {"samples_per_prompt": 2, "sampling": SAMPLING.model_dump(), "target_samples": 40,
                      "shard_size": 3, "decontamination_ngram": 0, "seed": 3},
        "generation": {"backend": "http", "endpoints": endpoints, "model": "policy", "max_in_flight": 2,
                       "backoff_s": 0.05, **generation},
    })


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    pd.DataFrame({"prompt": PROMPTS, "answer": ["1" if i % 3 else "2" for i in range(len(PROMPTS))]}).to_json(
        path, orient="records", lines=True)
    return str(path)


def _shards(r1_home: Path) -> dict[Path, tuple[int, int]]:
    """Every shard file of the stage's work folders, with (inode, mtime_ns): a file written again changes both."""
    files = sorted((r1_home / "work" / "rejection_sampling").glob("*/shard-*.parquet"))
    return {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in files}


@pytest.mark.timeout(240)
def test_the_stage_over_two_servers_survives_one_killed_midway(prefect_harness, r1_home, checkpoint, prompts_file,
                                                                two_servers, monkeypatch):
    from flows.rejection_sampling import rejection_sampling
    from grpo.rejection import shards
    from tasks import rejection as rejection_tasks
    from tasks.data import read_frame

    (_, survivor_url), (victim, victim_url) = two_servers
    cfg = _stage_config(prompts_file, [survivor_url, victim_url])
    before = set(_shards(r1_home))
    at_kill: dict[Path, tuple[int, int]] = {}
    lock = threading.Lock()
    write_shard = shards.write_shard

    def kill_after_the_first_shard(result, out_dir, index):
        # the victim dies as the first shard lands, in the writer itself: on a busy machine a watching thread could
        # wake only after every shard was written, and the kill would not be midway
        path = write_shard(result, out_dir, index)
        with lock:
            if not at_kill:
                at_kill.update({p: s for p, s in _shards(r1_home).items() if p not in before})
                victim.send_signal(signal.SIGKILL)
        return path

    monkeypatch.setattr(shards, "write_shard", kill_after_the_first_shard)  # tasks.rejection calls shards.write_shard
    result = rejection_sampling(checkpoint, cfg)
    monkeypatch.setattr(shards, "write_shard", write_shard)

    n_shards, total = len(PROMPTS) // 3, len(PROMPTS) * 2
    after = {p: s for p, s in _shards(r1_home).items() if p not in before}
    assert 0 < len(at_kill) < n_shards, f"the kill should land midway; {len(at_kill)} of {n_shards} were written"
    assert victim.wait(timeout=10) == -signal.SIGKILL
    assert len(after) == n_shards  # every shard written...
    assert all(after[p] == s for p, s in at_kill.items())  # ...once: none written before the kill was rewritten
    stats = next(iter(rejection_tasks._servers.values())).stats()
    assert stats[victim_url]["answered"] > 0 and stats[victim_url]["dead"]  # it served, then was given up
    assert stats[survivor_url]["dead"] is None
    # every sample answered exactly once over both servers: no shard was sampled twice, none lost
    assert sum(s["answered"] for s in stats.values()) == total
    assert result.metrics["rejection/generated"] == total

    rows = read_frame(result.uris["dataset"])
    assert 0 < len(rows) < total  # the rule check kept some samples and dropped others
    assert not rows.duplicated(["source_prompt_id", "sample_index"]).any()
    # and the very samples one server alone gives: each sample's seed, not the server, decides it
    _, tok = load_model_and_tokenizer(ModelConfig(name_or_path=checkpoint))
    alone = HTTPGenerationBackend([survivor_url], "policy", tok, max_in_flight_per_endpoint=2)
    try:
        expected = run_rejection_sampling(alone, pd.read_json(prompts_file, lines=True), cfg.rejection,
                                          r1_home / "expected-rs", progress=False).dataset
    finally:
        alone.close()
    got = rows.sort_values(["source_prompt_id", "sample_index"])[["source_prompt_id", "sample_index", "response"]]
    want = expected.sort_values(["source_prompt_id", "sample_index"])[["source_prompt_id", "sample_index",
                                                                       "response"]]
    pd.testing.assert_frame_equal(got.reset_index(drop=True), want.reset_index(drop=True), check_dtype=False)
    assert shard_seed(3, 0) != shard_seed(3, 1)  # the shards did not all share one seed


def test_the_stage_with_an_endpoint_down_at_the_start_fails_naming_it_and_samples_nothing(
        prefect_harness, r1_home, checkpoint, prompts_file, two_servers, mlflow_client):
    from flows.rejection_sampling import rejection_sampling

    survivor_url = two_servers[0][1]
    down = f"http://127.0.0.1:{free_port()}/v1"
    cfg = _stage_config(prompts_file, [survivor_url, down], retries=1)
    before = set(_shards(r1_home))
    with pytest.raises(Exception, match=f"could not reach generation endpoint at {down}/models: connection refused"):
        rejection_sampling(checkpoint, cfg.model_copy(update={"rejection": cfg.rejection.model_copy(
            update={"seed": 4})}))
    assert set(_shards(r1_home)) == before
    cfg = _stage_config(prompts_file, [survivor_url], model="gpt-x")
    with pytest.raises(Exception, match=rf"{survivor_url} does not serve model 'gpt-x'; it serves \['policy'\]"):
        rejection_sampling(checkpoint, cfg)
    assert set(_shards(r1_home)) == before
