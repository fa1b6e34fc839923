"""One seam for engines (grpo.sampling.engines): every stage's engine comes from its `generation` section, the trainer
gets an engine and a dtype, one rollout type, and an explicit weight sync after each optimizer step."""

import pandas as pd
import pytest
import torch

from grpo.configs.recipe import RecipeError, load_recipe
from grpo.configs.sampling import GenerationConfig, SamplingConfig
from grpo.configs.training import GRPOConfig
from grpo.models import load_model_and_tokenizer
from grpo.sampling.engines import Rollout, build_engine, local_generation, require_tokens, sampling_dtype
from grpo.sampling.http_backend import HTTPGenerationBackend
from grpo.sampling.local.backend import TransformersBackend
from grpo.training.loops.grpo_trainer import GRPOTrainer
from tiny_configs import SMALL

PROMPTS = pd.DataFrame({"prompt": [f"Say {i}" for i in range(8)], "answer": [str(i) for i in range(8)]})
HTTP = GenerationConfig(backend="http", endpoints=("http://127.0.0.1:9/v1",), model="policy")


def digits(completions, **_):
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def make_trainer(tmp_path, generation=None, **overrides):
    model, tok = load_model_and_tokenizer(SMALL)
    cfg = GRPOConfig(**{"max_steps": 1, "prompts_per_step": 2, "num_generations": 4, "checkpoint_every": 0,
                        "sampling": SamplingConfig(max_new_tokens=8), "rewards": {"digits": 1.0},
                        "learning_rate": 1e-2, "beta": 0.0, **overrides})
    return GRPOTrainer(model, tok, PROMPTS, cfg, tmp_path, reward_functions={"digits": digits}, progress=False,
                       generation=generation)


def test_the_local_engine_takes_the_sampler_and_kv_budget_from_the_generation_section():
    model, tok = load_model_and_tokenizer(SMALL)
    static = build_engine(GenerationConfig(kv_cache_mb=3), model, tok)
    assert isinstance(static, TransformersBackend) and static.sampler.memory_budget == 3 * 2**20
    loop = build_engine(GenerationConfig(sampler="loop"), model, tok)
    assert loop.sampler is None
    s = SamplingConfig(max_new_tokens=6, temperature=1.0)
    torch.manual_seed(3)
    a = static.generate(["Hi", "Say 2"], 2, s, logprobs=True)
    torch.manual_seed(3)
    b = loop.generate(["Hi", "Say 2"], 2, s, logprobs=True)
    # two samplers, one distribution and one draw a token: the same completions
    assert torch.equal(a.completion_ids, b.completion_ids) and a.texts == b.texts
    assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert torch.equal(a.completion_tokens, a.completion_mask.sum(-1))


def test_logprobs_only_when_asked():
    model, tok = load_model_and_tokenizer(SMALL)
    engine = build_engine(GenerationConfig(), model, tok)
    out = engine.generate(["Hi"], 2, SamplingConfig(max_new_tokens=4))
    assert out.logprobs is None and out.has_tokens


def test_a_text_only_engine_is_refused_where_token_ids_are_needed():
    with pytest.raises(ValueError, match="GRPO samples from the model it holds.*must be local, not http"):
        build_engine(HTTP, who="GRPO")
    assert isinstance(build_engine(HTTP, text_only_ok=True), HTTPGenerationBackend)
    text_only = Rollout(texts=["a"], truncated=torch.tensor([False]), token_counts=torch.tensor([3]))
    assert text_only.completion_tokens.tolist() == [3] and not text_only.has_tokens
    with pytest.raises(ValueError, match="evaluation needs the completions' token ids"):
        require_tokens(text_only, "evaluation")
    # a local judge beside http generation keeps the section's local settings
    assert local_generation(HTTP) == GenerationConfig()
    assert local_generation(GenerationConfig(sampler="loop")).sampler == "loop"


def test_the_recipe_allows_a_text_only_engine_in_rejection_sampling_only(tmp_path):
    http = {"backend": "http", "endpoints": ["http://127.0.0.1:9/v1"], "model": "policy"}
    path = tmp_path / "r.yaml"
    path.write_text(f"rejection_sampling:\n  generation: {http}\n")
    assert load_recipe(str(path)).rejection_sampling.generation.backend == "http"
    path.write_text(f"reasoning_grpo:\n  generation: {http}\n")
    with pytest.raises(RecipeError, match="reasoning_grpo: generation.backend http .*only rejection sampling can use it"):
        load_recipe(str(path))


def test_the_trainer_samples_with_the_stages_engine_in_its_precision(tmp_path):
    trainer = make_trainer(tmp_path, GenerationConfig(sampler="loop"), mixed_precision="no")
    assert isinstance(trainer.engine, TransformersBackend) and trainer.engine.sampler is None
    assert trainer.engine.dtype is None
    with pytest.raises(ValueError, match="GRPO samples from the model it holds"):
        make_trainer(tmp_path, HTTP)
    assert sampling_dtype("bf16") == torch.bfloat16 and sampling_dtype("no") is None


def test_truncated_importance_sampling_asks_the_engine_for_logprobs(tmp_path):
    assert make_trainer(tmp_path, mixed_precision="no").sample([0, 1]).logprobs is None
    rollout = make_trainer(tmp_path, mixed_precision="no", tis_cap=2.0).sample([0, 1])
    assert rollout.logprobs is not None and rollout.logprobs.shape == rollout.completion_ids.shape


def test_after_an_optimizer_step_the_next_rollout_samples_the_new_weights(tmp_path):
    # bf16 compute over fp32 weights: the engine samples from a bf16 copy, which only a sync refreshes (a fused
    # optimizer's step leaves no trace on the tensors); the trainer syncs after every step
    torch.manual_seed(0)
    trainer = make_trainer(tmp_path, mixed_precision="bf16", sampling=SamplingConfig(max_new_tokens=12))
    assert trainer.engine.dtype == torch.bfloat16
    rollout = trainer.sample([0, 1])
    copy = trainer.engine.sampler._copy
    assert copy is not None and next(copy.parameters()).dtype == torch.bfloat16
    policy = trainer.acc.unwrap_model(trainer.model)
    before = [p.detach().clone() for p in policy.parameters()]
    rewards = trainer.score(rollout, [0, 1]).total
    trainer.optimise(trainer.build_batch(rollout, rewards))
    assert any(not torch.equal(b, p) for b, p in zip(before, policy.parameters()))  # the step moved weights
    # and the copy the next rollout samples from holds them
    assert all(torch.equal(c, p.detach().to(torch.bfloat16)) for c, p in zip(copy.parameters(), policy.parameters()))
