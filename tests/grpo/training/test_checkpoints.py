"""Checkpoints are verified, not trusted: the faults made for real on the files the SFT and GRPO loops wrote.

Each case trains a tiny model with checkpoints every two steps, crashes after the step-4 checkpoint, damages it the
way a lost machine or a short copy does (a weights file cut in half, an optimizer file cut short, a flipped byte, the
manifest gone), and runs the same loop again: one log line names the checkpoint and what is wrong, the loop resumes
from step 2, and it ends with exactly the weights of a run that never crashed. Nothing whole left: it starts over.
"""

from __future__ import annotations

import logging
import os

import pandas as pd
import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo.configs.sampling import SamplingConfig
from grpo.configs.training import GRPOConfig, SFTConfig
from grpo.models import load_model_and_tokenizer
from grpo.training.checkpoints import MANIFEST, latest_checkpoint, verify_manifest, write_manifest
from grpo.training.loops.grpo_trainer import GRPOTrainer
from grpo.training.loops.sft_trainer import train_sft
from tiny_configs import SMALL

ROWS = pd.DataFrame({"prompt": [f"What is {i} + 1?" for i in range(16)],
                     "response": [f"<think>{i} + 1 = {i + 1}.</think><answer>{i + 1}</answer>" for i in range(16)]})
SFT = SFTConfig(max_steps=6, batch_size=4, learning_rate=3e-3, warmup_steps=1, log_every=1, checkpoint_every=2,
                mixed_precision="no")
WEIGHTS, OPTIMIZER = "pytorch_model.bin", "optimizer.bin"


class Interrupt(Exception):
    pass


def crash_at(stop: int):
    def on_metrics(step, _):
        if step == stop:
            raise Interrupt
    return on_metrics


def cut_in_half(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def flip_a_byte(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


FAULTS = {  # what happens to step-4, and words of the one line that names it
    "a truncated weights file": (lambda ck: cut_in_half(ck / WEIGHTS), f"{WEIGHTS} has"),
    "a truncated optimizer file": (lambda ck: cut_in_half(ck / OPTIMIZER), f"{OPTIMIZER} has"),
    "a damaged byte in the weights": (lambda ck: flip_a_byte(ck / WEIGHTS), "does not match its checksum"),
    "a missing manifest": (lambda ck: (ck / MANIFEST).unlink(), f"no {MANIFEST}"),
}


def weights(folder):
    return AutoModelForCausalLM.from_pretrained(folder).state_dict()


def same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def straight_sft(tmp_path_factory):
    """The run that never crashed."""
    model, tok = load_model_and_tokenizer(SMALL)
    out = tmp_path_factory.mktemp("straight")
    return weights(train_sft(model, tok, ROWS, SFT, out, progress=False).model_dir)


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_damaged_checkpoint_is_named_and_sft_resumes_from_the_one_before(fault, straight_sft, tmp_path, caplog):
    damage, words = FAULTS[fault]
    model, tok = load_model_and_tokenizer(SMALL)
    with pytest.raises(Interrupt):
        train_sft(model, tok, ROWS, SFT, tmp_path, crash_at(5), progress=False)
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-2", "step-4"]  # the last two stay
    damage(ckpts / "step-4")

    steps = []
    model, tok = load_model_and_tokenizer(SMALL)  # fresh weights: everything must come from a checkpoint
    with caplog.at_level(logging.WARNING, logger="grpo.training.checkpoints"):
        resumed = train_sft(model, tok, ROWS, SFT, tmp_path, lambda s, _: steps.append(s), progress=False)
    lines = [r.getMessage() for r in caplog.records if r.name == "grpo.training.checkpoints"]
    assert len(lines) == 1, lines
    assert str(ckpts / "step-4") in lines[0] and words in lines[0] and "resuming from step-2" in lines[0]
    assert steps == [3, 4, 5, 6]
    assert same_weights(weights(resumed.model_dir), straight_sft)


def test_with_no_whole_checkpoint_left_the_loop_starts_over(straight_sft, tmp_path, caplog):
    model, tok = load_model_and_tokenizer(SMALL)
    with pytest.raises(Interrupt):
        train_sft(model, tok, ROWS, SFT, tmp_path, crash_at(5), progress=False)
    cut_in_half(tmp_path / "checkpoints" / "step-4" / WEIGHTS)
    (tmp_path / "checkpoints" / "step-2" / MANIFEST).unlink()
    # and a save a dead process left half-written, never renamed into place
    (tmp_path / "checkpoints" / ".tmp-step-6").mkdir()

    steps = []
    model, tok = load_model_and_tokenizer(SMALL)
    with caplog.at_level(logging.WARNING, logger="grpo.training.checkpoints"):
        resumed = train_sft(model, tok, ROWS, SFT, tmp_path, lambda s, _: steps.append(s), progress=False)
    lines = [r.getMessage() for r in caplog.records if r.name == "grpo.training.checkpoints"]
    assert len(lines) == 2 and all("no earlier one is left: starting over" in line for line in lines), lines
    assert steps == [1, 2, 3, 4, 5, 6]
    assert same_weights(weights(resumed.model_dir), straight_sft)


def test_grpo_resumes_past_a_truncated_weights_file_to_the_uninterrupted_weights(tmp_path, caplog):
    prompts = pd.DataFrame({"prompt": [f"Say {i}" for i in range(8)], "answer": [str(i) for i in range(8)]})

    def digits(completions, **_):
        return [float(sum(ch.isdigit() for ch in c)) for c in completions]

    def trainer(out, on_metrics=None):
        model, tok = load_model_and_tokenizer(SMALL)
        cfg = GRPOConfig(max_steps=5, prompts_per_step=2, num_generations=4, checkpoint_every=2, beta=0.04,
                         learning_rate=1e-3, mixed_precision="no", sampling=SamplingConfig(max_new_tokens=8),
                         rewards={"digits": 1.0})
        return GRPOTrainer(model, tok, prompts, cfg, out, reward_functions={"digits": digits}, progress=False,
                           on_metrics=on_metrics)

    trainer(tmp_path / "straight").train()
    with pytest.raises(Interrupt):
        trainer(tmp_path / "resumed", crash_at(5)).train()
    ckpts = tmp_path / "resumed" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-2", "step-4"]
    cut_in_half(ckpts / "step-4" / WEIGHTS)
    steps = []
    with caplog.at_level(logging.WARNING, logger="grpo.training.checkpoints"):
        trainer(tmp_path / "resumed", lambda s, _: steps.append(s)).train()
    assert steps == [3, 4, 5]
    assert any("step-4 is damaged" in r.getMessage() for r in caplog.records)
    assert same_weights(weights(tmp_path / "resumed" / "model"), weights(tmp_path / "straight" / "model"))


def test_the_manifest_names_what_is_missing_cut_short_or_changed(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.bin").write_bytes(b"abcdef")
    (tmp_path / "sub" / "b.bin").write_bytes(b"xyz")
    write_manifest(tmp_path)
    assert verify_manifest(tmp_path) is None
    (tmp_path / "a.bin").write_bytes(b"abcdeF")  # same size, other bytes
    assert verify_manifest(tmp_path, checksums=False) is None  # sizes alone cannot see it
    assert verify_manifest(tmp_path) == "a.bin does not match its checksum (damaged)"
    (tmp_path / "a.bin").write_bytes(b"abc")
    assert verify_manifest(tmp_path) == "a.bin has 3 bytes where its manifest says 6 (cut short)"
    (tmp_path / "a.bin").write_bytes(b"abcdef")
    (tmp_path / "sub" / "b.bin").unlink()
    assert verify_manifest(tmp_path) == "sub/b.bin is missing"
    (tmp_path / MANIFEST).write_text("{not json")
    assert verify_manifest(tmp_path) == f"its {MANIFEST} is not readable"
    assert latest_checkpoint(tmp_path) is None  # no step-* folder here


def test_the_room_a_first_checkpoint_needs_counts_weights_optimizer_state_and_fp32_masters(tmp_path):
    from grpo.training.accelerator import make_accelerator
    from grpo.training.checkpoints import checkpoint_bytes, save_checkpoint
    from grpo.training.optimizers import make_optimizer

    model, _ = load_model_and_tokenizer(SMALL)
    n = sum(p.numel() for p in model.parameters())
    optimizer = make_optimizer(model, 1e-3, 0.0, master_weights=True)  # fp32 masters beside the weights
    model.to(torch.bfloat16)
    acc = make_accelerator("no", 1)
    model, optimizer = acc.prepare(model, optimizer)
    model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    optimizer.step()  # AdamW's two moments per master now exist
    # bf16 weights (tied embeddings counted under both names), fp32 masters, two fp32 moments: at least 14 bytes
    assert checkpoint_bytes(acc, tmp_path / "checkpoints") > 14 * n
    save_checkpoint(acc, tmp_path / "checkpoints", 1, keep=2)
    assert verify_manifest(tmp_path / "checkpoints" / "step-1") is None
    assert checkpoint_bytes(acc, tmp_path / "checkpoints") == sum(  # then: what the last one took
        p.stat().st_size for p in (tmp_path / "checkpoints" / "step-1").rglob("*") if p.is_file())
