"""The embedded model and tokenizer, loading real models from local folders, and the generation backend."""

import pytest
import torch

from grpo.generation import SamplingConfig, TransformersBackend, render_prompts
from grpo.models import ModelConfig, TinyModelConfig, build_tokenizer, load_model_and_tokenizer

SMALL = TinyModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1)


def test_tokenizer_round_trips_text_and_keeps_tags_whole():
    tok = build_tokenizer()
    text = "<think>7 + 5 = 12. café</think><answer>12</answer>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    for tag in ("<think>", "</think>", "<answer>", "</answer>"):
        assert len(tok(tag, add_special_tokens=False)["input_ids"]) == 1
    rendered = render_prompts(tok, ["2+2?"])[0]
    assert rendered.endswith("<|im_start|>assistant\n") and "2+2?" in rendered


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
    s = backend.generate(prompts, 3, SamplingConfig(max_new_tokens=16, temperature=1.0))
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
