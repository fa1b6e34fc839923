"""Promotion of the final model: the accuracy gate on the alias, the model as MLflow loads and serves it, and a
person's approval in the Prefect UI. Real MLflow (SQLite in the session's temp folder), a real tiny model."""

import os
import subprocess
import sys
import threading
import time
import urllib.request
import json

import mlflow
import pytest

from grpo.configs.recipe import AlignmentGRPOConfig
from grpo.ports import free_port
from runtime import tracking
from tasks.promotion import AWAITING, Holder, decide, promote_model, register_model

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1}


def config(name: str, **kw) -> AlignmentGRPOConfig:
    return AlignmentGRPOConfig.model_validate({"model": {"tiny": TINY}, "registered_model": name, **kw})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny model's folder, as a stage's checkpoint artifact holds it."""
    from grpo.configs.model import ModelConfig
    from grpo.models import load_model_and_tokenizer

    folder = tmp_path_factory.mktemp("ckpt")
    model, tokenizer = load_model_and_tokenizer(ModelConfig.model_validate({"tiny": TINY}))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def stage_run_with(checkpoint) -> tuple[str, str]:
    """A finished alignment-like run holding the checkpoint: (run id, checkpoint URI)."""
    run_id = tracking.start_run("alignment_grpo", tags={"stage": "alignment_grpo"})
    uri = tracking.log_dir(run_id, checkpoint, "checkpoint")
    tracking.end_run(run_id)
    return run_id, uri


def register(checkpoint, cfg, accuracy, heldout="heldout-a"):
    run_id, uri = stage_run_with(checkpoint)
    version = register_model(run_id, uri, cfg, accuracy, heldout)
    return run_id, version, promote_model(run_id, cfg, version)


def alias_of(client, name: str) -> str:
    return str(client.get_model_version_by_alias(name, "champion").version)


def test_the_gate_promotes_a_model_at_least_as_good_as_the_holder():
    holder = Holder("3", 0.5, "k")
    cases = [  # (mode, accuracy, held-out key, holder) -> promoted?
        ("auto", 0.4, "k", None, True),  # the first version
        ("auto", 0.5, "k", holder, True),  # a tie goes to the newer model
        ("auto", 0.6, "k", holder, True),
        ("auto", 0.49, "k", holder, False),
        ("auto", None, None, holder, False),  # nothing to compare
        ("auto", 0.9, "other", holder, False),  # measured on something else
        ("auto", 0.1, "k", Holder("3", None, None), True),  # a holder with no figure gives way
        ("always", 0.1, "k", holder, True),
    ]
    for mode, accuracy, key, who, promoted in cases:
        assert decide(mode, accuracy, key, who).promote is promoted, (mode, accuracy, key, who)
    assert decide("auto", 0.4, "k", holder).reason == "held-out accuracy 0.400 < 0.500 of version 3"


def test_the_alias_moves_only_for_a_model_at_least_as_good(prefect_harness, mlflow_client, checkpoint):
    cfg = config("r1-gate")
    first, v1, decision = register(checkpoint, cfg, 0.5)
    assert decision.promote and alias_of(mlflow_client, "r1-gate") == v1
    assert mlflow_client.get_model_version("r1-gate", v1).tags["heldout_accuracy"] == "0.5"

    worse, v2, decision = register(checkpoint, cfg, 0.375)
    assert not decision.promote
    assert alias_of(mlflow_client, "r1-gate") == v1
    run = mlflow_client.get_run(worse)
    assert run.data.tags["promotion.decision"] == "kept" and run.data.tags["promotion.holder_version"] == v1
    assert run.data.tags["promotion.reason"] == f"held-out accuracy 0.375 < 0.500 of version {v1}"
    assert run.data.metrics["promotion/accuracy"] == 0.375 and run.data.metrics["promotion/holder_accuracy"] == 0.5
    assert run.data.metrics["promotion/promoted"] == 0
    assert mlflow_client.get_model_version("r1-gate", v2).tags["promotion.decision"] == "kept"

    better, v3, decision = register(checkpoint, cfg, 0.625)
    assert decision.promote and alias_of(mlflow_client, "r1-gate") == v3
    assert mlflow_client.get_run(better).data.tags["promotion.decision"] == "promoted"

    # a better figure on another held-out set does not compare; `promotion: always` moves the alias regardless
    _, v4, decision = register(checkpoint, cfg, 0.9, heldout="heldout-b")
    assert not decision.promote and "different held-out sets" in decision.reason
    _, v5, decision = register(checkpoint, config("r1-gate", promotion="always"), 0.125)
    assert decision.promote and alias_of(mlflow_client, "r1-gate") == v5


def test_the_registered_model_loads_with_pyfunc_and_from_pretrained(prefect_harness, mlflow_client, checkpoint):
    from transformers import AutoModelForCausalLM

    register(checkpoint, config("r1-load"), 0.5)
    model = mlflow.pyfunc.load_model("models:/r1-load@champion")
    reply = model.predict({"messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 6})
    answer = reply[0]["choices"][0]
    assert answer["message"]["role"] == "assistant" and isinstance(answer["message"]["content"], str)
    assert reply[0]["usage"]["completion_tokens"] <= 6
    # the stages (and `r1 serve`) read it as a checkpoint folder, tokenizer included
    folder = tracking.download("models:/r1-load@champion")
    assert AutoModelForCausalLM.from_pretrained(folder).config.num_hidden_layers == 1
    assert (folder / "tokenizer.json").is_file()




def test_mlflow_models_serve_answers_for_the_alias(prefect_harness, mlflow_client, checkpoint, tmp_path):
    register(checkpoint, config("r1-serve"), 0.5)
    port = free_port()
    bin_dir = os.path.dirname(sys.executable)  # `mlflow models serve --env-manager local` runs uvicorn from PATH
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"}
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen([os.path.join(bin_dir, "mlflow"), "models", "serve", "-m", "models:/r1-serve@champion",
                               "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)],
                              env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        body = json.dumps({"messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 4}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=body,
                                         headers={"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(request, timeout=60).read())
        assert reply[0]["choices"][0]["message"]["role"] == "assistant"
    finally:
        os.killpg(server.pid, 15)  # the server and the uvicorn it started, in their own session
        server.wait(timeout=30)
        log.close()


def test_a_person_approves_the_promotion_in_the_prefect_ui(prefect_harness, mlflow_client, checkpoint):
    from prefect import flow, get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
    from prefect.flow_runs import resume_flow_run

    cfg = config("r1-approve", promotion="approve")
    register(checkpoint, config("r1-approve"), 0.5)  # a holder: the new model is worse, and a person promotes it
    run_id, uri = stage_run_with(checkpoint)
    version = register_model(run_id, uri, cfg, 0.25, "heldout-a")

    @flow
    def approval() -> bool:
        return promote_model(run_id, cfg, version).promote

    outcome = {}
    waiting = threading.Thread(target=lambda: outcome.update(promoted=approval()))
    waiting.start()
    deadline = time.monotonic() + 60
    paused = []
    with get_client(sync_client=True) as client:
        while not paused and time.monotonic() < deadline:
            time.sleep(0.5)
            paused = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=["PAUSED"]))))
    assert paused, "the flow run never paused for approval"
    tags = mlflow_client.get_run(run_id).data.tags
    assert tags["promotion.decision"] == AWAITING and "the gate says: held-out accuracy 0.250 < 0.500" in \
        tags["promotion.reason"]
    resume_flow_run(paused[0].id, run_input={"promote": True, "note": "better answers on our own prompts"})
    waiting.join(timeout=60)
    assert outcome == {"promoted": True}
    assert alias_of(mlflow_client, "r1-approve") == version
    reason = mlflow_client.get_run(run_id).data.tags["promotion.reason"]
    assert reason.startswith("approved in the Prefect UI (better answers on our own prompts)")
