"""The compact SwiGLU MLP: the same numbers and gradients as transformers' module, one tensor less kept per layer."""

import torch

from grpo.configs.model import ModelConfig, TinyModelConfig
from grpo.kernels.mlp import compact_mlp
from grpo.models import load_model_and_tokenizer

SMALL = TinyModelConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2)


def _model():
    model, tok = load_model_and_tokenizer(ModelConfig(tiny=SMALL))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.train()


def _run(model, ids):
    """Loss, gradients and the bytes autograd keeps for the backward (each storage counted once)."""
    kept: dict[int, int] = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, sum(kept.values())


def test_compact_mlp_gives_identical_gradients_and_keeps_less():
    torch.manual_seed(0)
    model = _model()
    ids = torch.randint(0, 200, (4, 30))
    loss, grads, kept = _run(model, ids)
    with compact_mlp(model):
        assert all("forward" in vars(layer.mlp) for layer in model.model.layers)
        loss2, grads2, kept2 = _run(model, ids)
    assert not any("forward" in vars(layer.mlp) for layer in model.model.layers)  # their own forward back
    assert torch.equal(loss, loss2)
    for name, g in grads.items():
        assert torch.equal(grads2[name], g), name
    per_layer = 4 * 30 * SMALL.intermediate_size * 4  # one [tokens, intermediate] fp32 tensor
    assert kept - kept2 == SMALL.num_hidden_layers * per_layer


def test_a_hooked_mlp_keeps_its_own_forward():
    model = _model()
    model.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    with compact_mlp(model):
        assert "forward" not in vars(model.model.layers[0].mlp)
        assert "forward" in vars(model.model.layers[1].mlp)
    with compact_mlp(None):
        pass
