"""The SFT loop on a real tiny model: it learns, it masks prompts out of the loss, and it resumes exactly."""

import pandas as pd
import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo.configs.training import SFTConfig
from grpo.data.tables import DataError
from grpo.models import is_checkpointing, load_model_and_tokenizer
from grpo.training.batches import batch_indices
from grpo.training.loops.sft_trainer import tokenize_rows, train_sft
from tiny_configs import SMALL

ROWS = pd.DataFrame({"prompt": [f"What is {i} + 1?" for i in range(16)],
                     "response": [f"<think>{i} + 1 = {i + 1}.</think><answer>{i + 1}</answer>" for i in range(16)]})


def test_labels_cover_the_response_only():
    _, tok = load_model_and_tokenizer(SMALL)
    (ex,) = tokenize_rows(ROWS.head(1), tok, 256)
    n_prompt = sum(1 for label in ex.labels if label == -100)
    response = tok.decode([t for t, label in zip(ex.input_ids, ex.labels) if label != -100])
    assert response == ROWS.response[0] + tok.eos_token + "\n"  # the turn as the chat template closes it
    assert tok.decode(ex.input_ids[:n_prompt]).endswith("assistant\n")


def test_a_prompt_too_long_fails_before_training():
    _, tok = load_model_and_tokenizer(SMALL)
    with pytest.raises(DataError, match="row 0, column 'prompt'"):
        tokenize_rows(ROWS.head(1), tok, 8, "cold.jsonl")


def test_batches_are_a_pure_function_of_the_step():
    assert batch_indices(10, 4, 5, seed=1) == batch_indices(10, 4, 5, seed=1)
    epoch0 = sum((batch_indices(12, 4, s, seed=1) for s in range(3)), [])
    assert sorted(epoch0) == list(range(12))  # one epoch visits every row once


def test_training_lowers_the_response_loss(tmp_path):
    model, tok = load_model_and_tokenizer(SMALL)
    seen = {}
    cfg = SFTConfig(max_steps=30, batch_size=8, learning_rate=3e-3, warmup_steps=2, log_every=5, checkpoint_every=0,
                    mixed_precision="no")
    result = train_sft(model, tok, ROWS, cfg, tmp_path, lambda step, m: seen.__setitem__(step, m["train/loss"]),
                       progress=False)
    assert sorted(seen) == [5, 10, 15, 20, 25, 30]
    assert seen[30] < 0.6 * seen[5]
    reloaded = AutoModelForCausalLM.from_pretrained(result.model_dir)
    assert sum(p.numel() for p in reloaded.parameters()) == sum(p.numel() for p in model.parameters())
    assert not list((tmp_path / "checkpoints").glob("*"))  # a finished run leaves only its final model


class Interrupt(Exception):
    pass


def test_an_interrupted_run_resumes_to_the_same_weights(tmp_path):
    cfg = SFTConfig(max_steps=6, batch_size=4, learning_rate=3e-3, warmup_steps=1, log_every=1, checkpoint_every=3,
                    mixed_precision="no")
    model, tok = load_model_and_tokenizer(SMALL)
    straight = train_sft(model, tok, ROWS, cfg, tmp_path / "straight", progress=False)

    def crash_at_5(step, _):
        if step == 5:
            raise Interrupt

    model, tok = load_model_and_tokenizer(SMALL)
    with pytest.raises(Interrupt):
        train_sft(model, tok, ROWS, cfg, tmp_path / "resumed", crash_at_5, progress=False)
    assert (tmp_path / "resumed" / "checkpoints" / "step-3" / "trainer_state.json").exists()

    steps_after_resume = []
    model, tok = load_model_and_tokenizer(SMALL)  # fresh weights: everything must come from the checkpoint
    resumed = train_sft(model, tok, ROWS, cfg, tmp_path / "resumed", lambda s, _: steps_after_resume.append(s),
                        progress=False)
    assert steps_after_resume == [4, 5, 6]
    a = AutoModelForCausalLM.from_pretrained(straight.model_dir).state_dict()
    b = AutoModelForCausalLM.from_pretrained(resumed.model_dir).state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_gradient_checkpointing_trains_to_the_same_weights(tmp_path):
    cfg = SFTConfig(max_steps=3, batch_size=4, learning_rate=3e-3, log_every=1, checkpoint_every=0,
                    mixed_precision="no")
    losses, during = {}, {}
    for ckpt in (False, True):
        model, tok = load_model_and_tokenizer(SMALL)

        def record(step, m, model=model, ckpt=ckpt):
            losses.setdefault(ckpt, []).append(m["train/loss"])
            during.setdefault(ckpt, []).append(is_checkpointing(model))

        out = train_sft(model, tok, ROWS, cfg.model_copy(update={"gradient_checkpointing": ckpt}), tmp_path / str(ckpt),
                        record, progress=False)
        assert during[ckpt] == [ckpt] * 3  # on while training, only when asked
        assert not is_checkpointing(model) and model.config.use_cache  # handed back as it came
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "False" / "model").state_dict()
    b = AutoModelForCausalLM.from_pretrained(out.model_dir).state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
