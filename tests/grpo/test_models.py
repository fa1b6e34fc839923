"""The embedded model and tokenizer, loading real models from local folders, and the generation backend."""

import os
import subprocess
import sys

import pytest
import torch

from grpo.configs.model import ModelConfig
from grpo.configs.sampling import SamplingConfig
from grpo.models import load_model_and_tokenizer
from grpo.sampling.local.backend import TransformersBackend, render_prompts
from grpo.tiny import build_tokenizer
from tiny_configs import TINY_MODEL as SMALL


@pytest.mark.parametrize("kind", ["bpe", "byte"])
def test_tokenizer_round_trips_text_and_keeps_tags_whole(kind):
    tok = build_tokenizer(kind)
    text = "<think>7 + 5 = 12. café 日本 x=12345\n\n</think><answer>12</answer>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    # generation decodes with the special tokens skipped: the tags must survive that
    assert tok.decode(ids + [tok.eos_token_id, tok.pad_token_id], skip_special_tokens=True) == text
    for tag in ("<think>", "</think>", "<answer>", "</answer>", "<|im_start|>", "<|im_end|>", "<|pad|>"):
        assert len(tok(tag, add_special_tokens=False)["input_ids"]) == 1
    rendered = render_prompts(tok, ["2+2?"])[0]
    assert rendered.endswith("<|im_start|>assistant\n") and "2+2?" in rendered


def test_bpe_tokenizer_is_the_same_every_time_and_short_on_the_task():
    """Built from generated text, the learned tokenizer must not depend on the process that builds it: a
    checkpoint saved by one stage is read by another (a fresh process) that builds the base tokenizer again."""
    code = ("import hashlib; from grpo.tiny import build_tokenizer; "
            "print(hashlib.sha256(build_tokenizer().backend_tokenizer.to_str().encode()).hexdigest())")
    digests = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(digests) == 1
    bpe, byte = build_tokenizer("bpe"), build_tokenizer("byte")
    assert len(bpe) == 1024 and len(build_tokenizer("bpe", 512)) == 512
    problem = "Ava has 12 chickens; 3 are roosters. 4 hens lay no eggs. How many hens lay eggs?"
    solution = "<think>Given 12, 3, 4. 12 - 3 = 9. 9 - 4 = 5.</think><answer>5</answer>"
    for text in (problem, solution):
        n_bpe, n_byte = (len(t(text, add_special_tokens=False)["input_ids"]) for t in (bpe, byte))
        assert n_bpe * 1.6 < n_byte, (text, n_bpe, n_byte)
    # a number of up to two digits is one token, with its leading space
    assert bpe.convert_ids_to_tokens(bpe(" 12 - 3 = 9", add_special_tokens=False)["input_ids"])[0] == "Ġ12"


def test_same_seed_same_weights_and_save_load_round_trip(tmp_path):
    cfg = ModelConfig(tiny=SMALL)
    m1, tok = load_model_and_tokenizer(cfg)
    m2, _ = load_model_and_tokenizer(cfg)
    assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values()))
    m1.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    m3, tok3 = load_model_and_tokenizer(ModelConfig(name_or_path=str(tmp_path)))
    ids = torch.tensor([tok("hello", add_special_tokens=False)["input_ids"]])
    assert torch.allclose(m1(ids).logits, m3(ids).logits)
    assert tok3.decode(tok3("<answer>", add_special_tokens=False)["input_ids"]) == "<answer>"
    # the folder is a Qwen2 model's: the reloaded tokenizer must still split text exactly as the one it was saved
    # from (not as Qwen2's own class would, one digit at a time)
    text = "Ava has 12 chickens; 3 are roosters. <think>Given 12, 3. 12 - 3 = 9.</think><answer>9</answer>"
    assert tok3(text)["input_ids"] == tok(text)["input_ids"]
    assert tok3.padding_side == "left" and tok3.chat_template == tok.chat_template


def test_missing_local_model_folder_fails_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model_and_tokenizer(ModelConfig(name_or_path=str(tmp_path / "missing")))


def test_greedy_matches_transformers_generate_and_logprobs_match_a_forward_pass():
    model, tok = load_model_and_tokenizer(ModelConfig(tiny=SMALL))
    backend = TransformersBackend(model, tok)
    prompts = ["What is 2 + 3?", "Hi", [{"role": "user", "content": "A longer prompt with more words in it."}]]
    out = backend.generate(prompts, 1, SamplingConfig(max_new_tokens=12, temperature=0))
    enc = tok(render_prompts(tok, prompts), padding=True, return_tensors="pt", add_special_tokens=False)
    ref = model.generate(**enc, max_new_tokens=12, do_sample=False)[:, enc["input_ids"].shape[1]:]
    width = out.completion_ids.shape[1]
    assert torch.equal(out.completion_ids[out.completion_mask.bool()], ref[:, :width][out.completion_mask.bool()])

    torch.manual_seed(0)
    s = backend.generate(prompts, 3, SamplingConfig(max_new_tokens=16, temperature=1.0), logprobs=True)
    assert s.completion_ids.shape[0] == 9 and len(s.texts) == 9
    ids = torch.cat([s.prompt_ids, s.completion_ids], 1)
    mask = torch.cat([s.prompt_mask, s.completion_mask], 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    P = s.prompt_ids.shape[1]
    lp = torch.log_softmax(logits[:, P - 1 : -1].float(), -1).gather(-1, s.completion_ids[..., None]).squeeze(-1)
    assert torch.allclose(lp * s.completion_mask, s.logprobs, atol=1e-4)
    # rows of a group share their prompt; a row is truncated exactly when it did not end with end-of-turn
    assert torch.equal(s.prompt_ids[0], s.prompt_ids[2])
    ended = [(row[m.bool()][-1].item() == tok.eos_token_id) for row, m in zip(s.completion_ids, s.completion_mask)]
    assert [not e for e in ended] == s.truncated.tolist()


def _grouped_batch(tok, groups: int = 3, G: int = 4, C: int = 12):
    """Rows in groups sharing a left-padded prompt (of different lengths), then right-padded completions."""
    torch.manual_seed(0)
    enc = tok(["Hi", "What is 2 + 3?", "Longer prompt here, please."][:groups], padding=True, return_tensors="pt",
              add_special_tokens=False)
    prompt_ids, prompt_mask = enc["input_ids"].repeat_interleave(G, 0), enc["attention_mask"].repeat_interleave(G, 0)
    completion_ids = torch.randint(0, 250, (groups * G, C))
    completion_mask = (torch.arange(C) < torch.randint(1, C + 1, (groups * G, 1))).long()  # ends at random
    completion_ids = completion_ids.masked_fill(completion_mask == 0, tok.pad_token_id)
    return torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1), C


def _plain_logps(model, ids, mask, C):
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -C - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, -C:, None]).squeeze(-1)


def test_token_logps_runs_a_shared_prompt_once_with_the_plain_forwards_values_and_gradients(monkeypatch):
    from grpo.training.logprobs import token_logps

    model, tok = load_model_and_tokenizer(ModelConfig(tiny=SMALL))
    model.train()
    ids, mask, C = _grouped_batch(tok)
    calls = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: calls.append(k["input_ids"].shape) or forward(*a, **k))
    logps, entropy = token_logps(model, ids, mask, C, 1.0, with_entropy=True)
    assert calls[0][0] == 3 and calls[1] == (12, C - 1)  # 3 distinct prompts once, then the 12 completions
    cm = mask[:, -C:].float()
    (logps * cm).sum().backward()
    shared = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    expected = _plain_logps(model, ids, mask, C)
    (expected * cm).sum().backward()
    assert torch.allclose(logps * cm, expected * cm, atol=1e-5)
    assert torch.isfinite(logps).all() and torch.isfinite(entropy).all()
    for n, p in model.named_parameters():
        # fp32 rounding scales with the gradient's largest values, not with each element: the embedding's rows sum
        # many tokens' gradients in another order when a prompt runs once (a Zen 4: 1.9e-6 apart on an element of
        # 7.4e-3, in a gradient whose largest is 11.2)
        gap = (shared[n] - p.grad).abs().max() / p.grad.abs().max().clamp(min=1e-12)
        assert gap.item() <= 1e-5, (n, gap.item())


def test_token_logps_without_shared_prompts_is_one_plain_forward(monkeypatch):
    from grpo.training.logprobs import token_logps

    model, tok = load_model_and_tokenizer(ModelConfig(tiny=SMALL))
    ids, mask, C = _grouped_batch(tok, groups=3, G=1)
    calls = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    with torch.no_grad():
        logps, _ = token_logps(model, ids, mask, C, 0.7)
        expected = torch.log_softmax(
            model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[
                :, -C - 1 : -1] / 0.7, -1).gather(-1, ids[:, -C:, None]).squeeze(-1)
    assert len(calls) == 2  # token_logps' one forward, then ours
    assert torch.allclose(logps * mask[:, -C:], expected * mask[:, -C:], atol=1e-5)
