"""A clean terminal: the sampling, log-prob and evaluation paths of the tiny model raise no FutureWarning, so a
transformers release that removes a deprecated argument cannot break them unseen; the library log lines the
project cannot avoid at its calls are silenced by name (runtime/env.py), and nothing else is."""

import logging
import warnings

import pandas as pd
import torch

from grpo.configs.sampling import EvalConfig, SamplingConfig
from grpo.evaluate import evaluate
from grpo.models import load_model_and_tokenizer
from grpo.sampling.local.backend import TransformersBackend
from grpo.training.logprobs import token_logps
from tiny_configs import SMALL

ROWS = pd.DataFrame({"prompt": [f"What is {i} + 1?" for i in range(4)], "answer": [str(i + 1) for i in range(4)]})


def test_sampling_logprobs_and_evaluation_raise_no_future_warning():
    model, tok = load_model_and_tokenizer(SMALL)
    s = SamplingConfig(max_new_tokens=6, temperature=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("ignore", RuntimeWarning)  # "bf16 emulated" on a CPU without it: not ours to fix
        static = TransformersBackend(model, tok)  # the static sampler's prefill through the model's forward
        rollout = static.generate(["Hi", "Say 2"], 3, s, logprobs=True)
        # the decode loop through the model's forward, step by step (bf16 autocast keeps it off the lean path)
        TransformersBackend(model, tok, static=False, dtype=torch.bfloat16).generate(["Hi"], 2, s)
        ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)  # [N, P+C]
        mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1)  # [N, P+C]
        logps, _ = token_logps(model, ids, mask, rollout.completion_ids.size(1), 1.0)  # groups share a prompt pass
        result = evaluate(static, ROWS, EvalConfig(num_prompts=4, num_samples=2, max_new_tokens=6))
    assert logps.shape == rollout.completion_ids.shape and torch.isfinite(logps).all()
    assert 0.0 <= result.metrics["eval/accuracy"] <= 1.0


def test_only_the_named_library_lines_are_silenced(caplog):
    import runtime  # noqa: F401  (installs the filters)

    with caplog.at_level(logging.WARNING):
        logging.getLogger("bitsandbytes.backends.cpu.ops").warning(
            "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure ...", "offline")
        logging.getLogger("mlflow.transformers").warning("The model card could not be retrieved from the hub due "
                                                         "to not a repo id")
        logging.getLogger("mlflow.transformers").warning("Unable to find license information for this model. ...")
        logging.getLogger("mlflow.transformers").warning("something else mlflow wants a person to read")
    assert [r.getMessage() for r in caplog.records] == ["something else mlflow wants a person to read"]
