"""The judge: its reply parser, a local tiny model as judge, and `r1 serve` reached over HTTP like any endpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from flows.cli.r1 import main
from flows.cli.serve import load_checkpoint, make_server
from grpo.configs.grading import JudgeConfig
from grpo.configs.model import ModelConfig, TinyModelConfig
from grpo.models import load_model_and_tokenizer
from grpo.ports import free_port
from grpo.sampling.judge import (
    HTTPJudge,
    JudgeUnavailable,
    TransformersJudge,
    Verdict,
    build_judge,
    parse_verdict,
    render_judge_prompt,
)
from grpo.texts import JUDGE_PROMPT
from grpo.tiny import build_tokenizer

SMALL = TinyModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=1024)
ITEMS = [("What is 2 + 3?", "<think>2 + 3 = 5</think><answer>5</answer>", "5"),
         ("Ava has 4 apples and eats 1. How many are left?", "<answer>2</answer>", "3"),
         ("Say hi.", "hi", None)]
KEY = "test-key-123"


# ----------------------------------------------------------------------------------------------------------------
# Parsing the judge's reply


@pytest.mark.parametrize("text, accepted", [
    ("VERDICT: yes\nREASON: 5 matches the reference.", True),
    ("VERDICT: no\nREASON: 2 is not 3.", False),
    ("  verdict :   YES  \nreason: fine", True),  # case and spacing
    ("**Verdict:** No.\n**Reason:** wrong total", False),  # markdown
    ("Let me check.\nVERDICT: [yes]\nREASON: ok", True),  # the verdict line need not come first
    ("Yes, 5 is right.", True),  # no format, but a bare answer up front
    ("no", False),
    ("<think>VERDICT: no... wait</think>\nVERDICT: yes\nREASON: ok", True),  # only what follows the thinking
    ("<think>VERDICT: yes, probably, but let me", None),  # cut off while thinking: no verdict yet
    ("Not sure.", None),  # "no" only as a whole word
    ("yesterday it said VERDICT maybe", None),
    ("The answer is correct. I would say yes.", None),  # yes/no must open the reply or follow VERDICT:
    ("", None),
])
def test_parse_verdict(text, accepted):
    verdict = parse_verdict(text)
    assert verdict == Verdict(accepted, text.strip(), None if accepted is not None else "judge_no_verdict")


def test_the_prompt_shows_question_reference_and_response():
    text = render_judge_prompt(JUDGE_PROMPT, "What is 2 + 3?", "\\boxed{5}", "5")
    assert "What is 2 + 3?" in text and "\\boxed{5}" in text and "Reference answer:\n5" in text
    assert "VERDICT: yes or no" in text
    assert "none given" in render_judge_prompt(JUDGE_PROMPT, "q", "r", None)


def test_config_errors_name_the_bad_field():
    with pytest.raises(ValidationError, match=r"unknown fields \['answer'\]"):
        JudgeConfig(prompt_template="{question} {answer} {response}")
    with pytest.raises(ValidationError, match=r"must contain \{response\}"):
        JudgeConfig(prompt_template="{question}")
    with pytest.raises(ValidationError, match="base_url must start with http"):
        JudgeConfig(base_url="localhost:8000/v1")
    assert "api_key" not in JudgeConfig.model_fields  # only the variable's name is config (and so logged)
    with pytest.raises(ValidationError, match="max_workers\n  Input should be greater than or equal to 1"):
        JudgeConfig(backend="http", max_workers=0)


# ----------------------------------------------------------------------------------------------------------------
# A local model as judge


@pytest.fixture(scope="module")
def tiny():
    model, tok = load_model_and_tokenizer(ModelConfig(tiny=SMALL))
    return model.eval(), tok


def test_transformers_judge_returns_a_verdict_per_item_with_the_models_text(tiny):
    model, tok = tiny
    judge = build_judge(JudgeConfig(max_new_tokens=12, batch_size=2), model, tok)  # 3 items: two batches
    assert isinstance(judge, TransformersJudge)
    verdicts = judge.judge_many(ITEMS)
    assert len(verdicts) == 3
    for v in verdicts:
        assert isinstance(v, Verdict) and v.accepted in (True, False, None) and isinstance(v.rationale, str)
    # the rationale is the model's own greedy reply to the judge prompt
    prompt = render_judge_prompt(JUDGE_PROMPT, *ITEMS[0])
    from grpo.configs.sampling import SamplingConfig
    from grpo.sampling.local.backend import TransformersBackend

    expected = TransformersBackend(model, tok).generate([prompt], 1, SamplingConfig(max_new_tokens=12, temperature=0))
    assert verdicts[0].rationale == expected.texts[0].strip()
    assert judge.judge(*ITEMS[0]) == verdicts[0]  # greedy: the same item gets the same verdict, batched or not
    assert judge.judge_many([]) == []


# ----------------------------------------------------------------------------------------------------------------
# `r1 serve` and the HTTP judge


@pytest.fixture(scope="module")
def checkpoint(tiny, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("judge-ckpt")
    model, tok = tiny
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(checkpoint):
    """The checkpoint served from its folder on a free port, requiring KEY as a Bearer token."""
    model, tok = load_checkpoint(str(checkpoint), device="cpu")
    srv = make_server(model, tok, "127.0.0.1", 0, model_name="judge", api_key=KEY)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _http_cfg(url: str, **kw) -> JudgeConfig:
    return JudgeConfig(backend="http", base_url=url, model="judge", max_new_tokens=8, backoff_s=0.01, **kw)


def test_http_judge_asks_the_served_checkpoint_with_its_key(server, monkeypatch):
    monkeypatch.setenv("R1_JUDGE_API_KEY", KEY)
    judge = build_judge(_http_cfg(server.url))
    assert isinstance(judge, HTTPJudge)
    assert judge.check_available() == ["judge"]
    verdicts = judge.judge_many(ITEMS)
    assert len(verdicts) == 3 and all(isinstance(v, Verdict) for v in verdicts)
    assert judge.judge(*ITEMS[0]) == verdicts[0]  # temperature 0 over HTTP too
    assert judge.calls == 1 + 3 + 1  # GET /models, three items, one more: each request counted once


def test_http_judge_without_the_key_is_refused_and_says_which_variable(server, monkeypatch):
    monkeypatch.delenv("R1_JUDGE_API_KEY", raising=False)
    judge = HTTPJudge(_http_cfg(server.url))
    with pytest.raises(JudgeUnavailable, match=r"HTTP 401.*\$R1_JUDGE_API_KEY") as err:
        judge.judge(*ITEMS[0])
    assert server.url in str(err.value)
    monkeypatch.setenv("OTHER_KEY", "not-the-key-987")
    with pytest.raises(JudgeUnavailable, match="HTTP 401") as err:
        HTTPJudge(_http_cfg(server.url, api_key_env="OTHER_KEY")).check_available()
    assert "not-the-key-987" not in str(err.value)  # the key never lands in a message


def test_check_available_names_the_model_the_server_does_serve(server, monkeypatch):
    monkeypatch.setenv("R1_JUDGE_API_KEY", KEY)
    cfg = _http_cfg(server.url).model_copy(update={"model": "gpt-judge"})
    with pytest.raises(JudgeUnavailable, match=r"does not serve model 'gpt-judge'; it serves \['judge'\]"):
        HTTPJudge(cfg).check_available()


def test_the_server_speaks_the_openai_chat_schema(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as client:
        models = client.get("/models").json()
        assert models["object"] == "list" and models["data"][0]["id"] == "judge"

        r = client.post("/chat/completions", json={
            "model": "judge", "messages": [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
            "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion" and body["model"] == "judge" and body["id"].startswith("chatcmpl-")
        choice = body["choices"][0]
        assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
        assert choice["finish_reason"] in ("stop", "length")
        usage = body["usage"]
        assert 0 < usage["completion_tokens"] <= 5
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        # the prompt is the rendered chat: the markers, the roles and both messages
        assert usage["prompt_tokens"] > len(build_tokenizer()("Be brief.Hi", add_special_tokens=False)["input_ids"]) + 4

        r = client.post("/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                   "max_tokens": 1, "temperature": 0})
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")  # model may be left out


@pytest.mark.parametrize("body, status, param", [
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "user"}]}, 400, "messages[1].content"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "10"}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400, "stream"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}, 404, "model"),
])
def test_a_bad_request_gets_an_openai_error_naming_the_field(server, body, status, param):
    r = httpx.post(f"{server.url}/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=30)
    assert r.status_code == status
    error = r.json()["error"]
    assert error["param"] == param and param.split("[")[0] in error["message"]


def test_the_server_refuses_non_json_unknown_routes_and_missing_keys(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{server.url}/chat/completions", content=b"{not json", headers=auth, timeout=30)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.get(f"{server.url}/completions", headers=auth, timeout=30)
    assert r.status_code == 405 and "/v1/chat/completions" in r.json()["error"]["message"]  # a POST route
    r = httpx.get(f"{server.url}/nowhere", headers=auth, timeout=30)
    assert r.status_code == 404 and "/v1/chat/completions" in r.json()["error"]["message"]
    r = httpx.get(f"{server.url}/models", timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.url.removesuffix("/v1") + "/health", timeout=30).json() == {"status": "ok"}


# ----------------------------------------------------------------------------------------------------------------
# Failures the HTTP judge retries, and the ones it reports at once




def test_a_judge_that_is_down_fails_fast_naming_the_url_and_cause():
    url = f"http://127.0.0.1:{free_port()}/v1"  # bound then released: nothing listens there
    judge = HTTPJudge(_http_cfg(url, max_retries=2))
    start = time.monotonic()
    with pytest.raises(JudgeUnavailable) as err:
        judge.check_available()
    assert time.monotonic() - start < 2  # backoffs 0.01 s and 0.02 s
    assert str(err.value) == f"could not reach judge at {url}/models: connection refused after 3 tries"
    with pytest.raises(JudgeUnavailable, match=f"could not reach judge at {url}/chat/completions"):
        judge.judge_many(ITEMS)


class _Flaky(BaseHTTPRequestHandler):
    """Answers `fail_first` requests with `status`, then with a canned completion."""

    status, fail_first, hits = 503, 2, 0

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).hits += 1
        if self.hits <= self.fail_first:
            body, code = {"error": {"message": "overloaded"}}, self.status
        else:
            body, code = {"choices": [{"message": {"content": "VERDICT: yes\nREASON: matches"}}]}, 200
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("status, fail_first, hits, accepted", [
    (503, 2, 3, True),  # 5xx: retried, the third try answers
    (429, 1, 2, True),  # rate limited: retried
    (400, 5, 1, None),  # a client error: never retried
])
def test_retries_only_what_may_pass(status, fail_first, hits, accepted):
    handler = type("Handler", (_Flaky,), {"status": status, "fail_first": fail_first, "hits": 0})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        judge = HTTPJudge(_http_cfg(f"http://127.0.0.1:{srv.server_address[1]}/v1", max_retries=2))
        if accepted is None:
            with pytest.raises(JudgeUnavailable, match="refused the request: HTTP 400 overloaded"):
                judge.judge(*ITEMS[0])
        else:
            assert judge.judge(*ITEMS[0]) == Verdict(True, "VERDICT: yes\nREASON: matches")
        assert handler.hits == hits
        assert judge.calls == hits  # a retry is one more call: what the endpoint was asked to answer
    finally:
        srv.shutdown()
        srv.server_close()


class _Slow(BaseHTTPRequestHandler):
    """Answers each request after 0.2 s, counting the most it held at once."""

    lock, now, most = threading.Lock(), 0, 0

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        cls = type(self)
        with cls.lock:
            cls.now += 1
            cls.most = max(cls.most, cls.now)
        time.sleep(0.2)
        with cls.lock:
            cls.now -= 1
        data = json.dumps({"choices": [{"message": {"content": "VERDICT: no"}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("shared, most", [(True, 2), (False, 4)])
def test_judges_sharing_one_bound_keep_at_most_max_workers_requests_in_flight(shared, most):
    """A process's shard tasks each build a judge: with one `in_flight` semaphore between them the endpoint sees
    at most `max_workers` requests at once, whatever the number of shards; each judge on its own would add its own."""
    handler = type("Handler", (_Slow,), {"lock": threading.Lock(), "now": 0, "most": 0})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        cfg = _http_cfg(f"http://127.0.0.1:{srv.server_address[1]}/v1", max_workers=2)
        slots = threading.BoundedSemaphore(cfg.max_workers) if shared else None
        judges = [build_judge(cfg, in_flight=slots) for _ in range(2)]
        answers = [None, None]
        threads = [threading.Thread(target=lambda i=i: answers.__setitem__(i, judges[i].judge_many(ITEMS * 2)))
                   for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [len(a) for a in answers] == [6, 6] and all(v.accepted is False for a in answers for v in a)
        assert handler.most == most
        assert [j.calls for j in judges] == [6, 6]
    finally:
        srv.shutdown()
        srv.server_close()


class _Faulty(BaseHTTPRequestHandler):
    """A judge endpoint that goes wrong in one way: it stalls past the client's timeout, answers with something that
    is not JSON, fails every try with a 503, or answers the schema without a verdict."""

    fault = "stall"

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.fault == "stall":
            time.sleep(1.0)
        code, data = 200, json.dumps({"choices": [{"message": {"content": "Hmm, hard to say."}}]}).encode()
        if self.fault == "nonsense":
            data = b"<html>gateway says hello</html>"
        elif self.fault == "503":
            code, data = 503, b'{"error": {"message": "overloaded"}}'
        try:
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client gave up on a stalled reply
            pass

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("fault, reason", [("stall", "judge_timeout"), ("nonsense", "judge_http_error"),
                                           ("503", "judge_http_error"), ("no verdict", "judge_no_verdict")])
def test_a_judge_that_stalls_or_answers_nonsense_leaves_the_item_ungraded_and_says_why(fault, reason):
    """A request that fails after its retries, or a reply without a verdict, is no verdict with its reason: one
    sample loses its grade, the batch goes on (a refusal or nothing listening still raises, above)."""
    handler = type("Handler", (_Faulty,), {"fault": fault})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        judge = HTTPJudge(_http_cfg(f"http://127.0.0.1:{srv.server_address[1]}/v1", max_retries=1, timeout_s=0.3,
                                    max_workers=2))
        verdicts = judge.judge_many(ITEMS[:2])
        assert [(v.accepted, v.ungraded) for v in verdicts] == [(None, reason)] * 2
        assert all(v.rationale for v in verdicts)  # what went wrong, for the samples table
    finally:
        srv.shutdown()
        srv.server_close()


# ----------------------------------------------------------------------------------------------------------------
# `r1 serve`


def test_serve_arguments_fail_before_loading_anything(capsys, tmp_path, monkeypatch):
    with pytest.raises(SystemExit):  # the checkpoint is required
        main(["serve"])
    assert "checkpoint" in capsys.readouterr().err
    missing = tmp_path / "no-such-checkpoint"
    assert main(["serve", str(missing)]) == 2
    assert str(missing) in capsys.readouterr().err
    assert main(["serve", "tiny", "--port", "70000"]) == 2
    assert "--port must be in 0..65535" in capsys.readouterr().err
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    assert main(["serve", "tiny", "--api-key-env", "NO_SUCH_KEY_VAR"]) == 2
    assert "$NO_SUCH_KEY_VAR" in capsys.readouterr().err


@pytest.mark.timeout(120)  # a server that never prints its address must not hang the suite
def test_r1_serve_runs_as_a_process(checkpoint, tmp_path):
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(tmp_path / "stderr.txt", "w+") as stderr:  # progress bars go there, not into the lines read here
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", str(checkpoint), "--port", "0",
                                 "--model-name", "judge"], cwd=root, env=env, stdout=subprocess.PIPE,
                                stderr=stderr, text=True)
        try:
            first = proc.stdout.readline()  # "serving 'judge' (Qwen2ForCausalLM on cpu) at http://127.0.0.1:<port>/v1"
            stderr.seek(0)
            assert first.startswith("serving 'judge'"), f"stdout: {first!r}\nstderr: {stderr.read()}"
            url = first.rsplit(" at ", 1)[1].strip()
            judge = HTTPJudge(_http_cfg(url))
            assert judge.check_available() == ["judge"]
            assert isinstance(judge.judge(*ITEMS[2]), Verdict)
        finally:
            proc.terminate()
            proc.wait(timeout=10)
