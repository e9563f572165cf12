"""bench.decode_step off the GPU: layers_aliased (the --alias-layers column) and the
command line without a GPU."""

from __future__ import annotations

import pytest
import torch

from bench import decode_step
from specdraft.models.tiny import random_causal_lm, tiny_config


def _model(seed: int, **overrides):
    cfg = tiny_config(num_layers=3, **overrides)
    return random_causal_lm(cfg, seed=seed).eval()


def _snapshot(model):
    return [(name, p.data_ptr(), p.detach().clone()) for name, p in model.named_parameters()]


def test_layers_alias_layer_0_inside_and_get_their_own_back():
    model = _model(seed=3)
    before = _snapshot(model)
    first = dict(model.layers[0].named_parameters())
    with decode_step.layers_aliased(model) as m:
        assert m is model
        for layer in model.layers[1:]:
            for name, p in layer.named_parameters():
                assert p.data_ptr() == first[name].data_ptr(), name
        # Outside the layers nothing moves.
        assert model.embed_tokens.weight.data_ptr() == before[0][1]
    after = _snapshot(model)
    assert [(n, ptr) for n, ptr, _ in after] == [(n, ptr) for n, ptr, _ in before]
    for (name, _, old), (_, _, new) in zip(before, after):
        assert torch.equal(old, new), name


def test_an_aliased_model_computes_as_copies_of_layer_0():
    model = _model(seed=4)
    twin = _model(seed=5)
    twin.load_state_dict(model.state_dict())
    for layer in twin.layers[1:]:
        layer.load_state_dict(twin.layers[0].state_dict())
    x = torch.randn(5, model.cfg.hidden_size, dtype=model.dtype)

    def run(m):
        h = x
        for layer in m.layers:  # the layers' weights only: no cache needed
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h

    with torch.inference_mode():
        plain = run(model)
        with decode_step.layers_aliased(model):
            aliased = run(model)
        want = run(twin)
        again = run(model)
    assert torch.equal(aliased, want)
    assert not torch.equal(plain, want)  # the layers differ: the check can fail
    assert torch.equal(again, plain)


def test_layers_with_other_shapes_are_refused_and_nothing_changes():
    model = _model(seed=6)
    layer = model.layers[2].mlp.down_proj
    layer.weight.data = torch.randn(layer.weight.shape[0], layer.weight.shape[1] + 1)
    before = _snapshot(model)
    refused = pytest.raises(ValueError, match="differs from layer 0's")
    with refused, decode_step.layers_aliased(model):
        pass
    after = _snapshot(model)
    assert [(n, ptr) for n, ptr, _ in after] == [(n, ptr) for n, ptr, _ in before]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU path measures")
def test_without_a_gpu_it_exits_2(capsys, tmp_path):
    assert decode_step.main(["--out", str(tmp_path), "--alias-layers"]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().out
    assert not any(tmp_path.iterdir()), "nothing written"
