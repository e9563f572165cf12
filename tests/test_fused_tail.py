"""kernels.fused_layer_tail: a layer's O + residual, norm + gate/up + SiLU-and-multiply and
down + residual in one persistent launch, bit for bit the three fused_linear launches
(the same helpers and tiles), close to a float64 reference of the three, split
attention merged on its loads; bad input refused with nothing written.

CPU: the interpreter runs one program (a grid barrier cannot wait on a program it has
not run yet); GPU: the default grid (one program a multiprocessor) and a few others."""

from __future__ import annotations

import pytest
import torch

from specdraft import kernels
from specdraft.kernels.fused_tail import fused_layer_tail, fused_layer_tail_supported

from .conftest import HAS_CUDA
from .test_fused_linear import _split_attention, reference, rounding


def _layer(device, dtype, m, h, ko, f, seed, bias=False):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

    w = {
        "o_weight": rand(h, ko, scale=ko**-0.5),
        "norm_weight": (torch.rand(h, generator=g) + 0.5).to(device, dtype),
        "gate_up_weight": rand(2 * f, h, scale=h**-0.5),
        "down_weight": rand(h, f, scale=f**-0.5),
    }
    if bias:
        w |= {"o_bias": rand(h), "gate_up_bias": rand(2 * f), "down_bias": rand(h)}
    return rand(m, ko), rand(m, h), w


def _three_launches(x, stream, w, eps, x_splits=None):
    """The fused decode path's tail before fused_layer_tail: three fused_linear calls."""
    s = stream.clone()
    kernels.fused_linear(x, w["o_weight"], bias=w.get("o_bias"), residual=s, out=s,
                         x_splits=x_splits)  # fmt: skip
    act = kernels.fused_linear(s, w["gate_up_weight"], bias=w.get("gate_up_bias"),
                               norm_weight=w["norm_weight"], eps=eps, glu=True)  # fmt: skip
    kernels.fused_linear(act, w["down_weight"], bias=w.get("down_bias"), residual=s, out=s)
    return s, act


def _check(device, dtype, m, h, ko, f, *, bias=False, programs=None, seed=0):
    x, stream, w = _layer(device, dtype, m, h, ko, f, seed, bias)
    want_s, want_a = _three_launches(x, stream, w, 1e-5)
    s = stream.clone()
    act = torch.full((m, f), float("nan"), device=device, dtype=dtype)
    x0 = x.clone()
    got = fused_layer_tail(x, s, **w, eps=1e-5, act=act, programs=programs)
    assert got.data_ptr() == act.data_ptr()
    assert not act.isnan().any() and not s.isnan().any()  # every element written
    assert torch.equal(x, x0)
    assert torch.equal(act, want_a) and torch.equal(s, want_s)
    assert int(kernels.grid_sync.grid_counter(s.device).item()) == 0
    # float64 of the three, each from the previous one's rounded output
    s1 = reference(x, w["o_weight"], bias=w.get("o_bias"), residual=stream).to(dtype)
    a = reference(s1, w["gate_up_weight"], bias=w.get("gate_up_bias"),
                  norm_weight=w["norm_weight"], eps=1e-5, glu=True)  # fmt: skip
    s2 = reference(a.to(dtype), w["down_weight"], bias=w.get("down_bias"), residual=s1)
    for ours, ref in ((act, a), (s, s2)):
        err = (ours.double() - ref).abs().max().item()
        scale = ref.abs().max().item() + 1.0
        tol = 1e-5 * scale if dtype == torch.float32 else 3 * rounding(ref, dtype) + 1e-5 * scale
        assert err <= tol, (err, tol)


@pytest.mark.interpreter
@pytest.mark.parametrize("m, bias", [(1, False), (3, True)])
def test_fused_layer_tail_equals_three_launches(m, bias):
    if HAS_CUDA:
        pytest.skip("the interpreter's case")
    _check("cpu", torch.float16, m, h=64, ko=64, f=96, bias=bias, seed=m)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("m", [1, 2, 8])
@pytest.mark.parametrize("programs", [None, 1, 7])
def test_gpu_fused_layer_tail_bf16(m, programs):
    # SmolLM2-135M's widths
    _check("cuda", torch.bfloat16, m, h=576, ko=576, f=1536, programs=programs, seed=m)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")
def test_gpu_fused_layer_tail_bias_and_odd_widths():
    _check("cuda", torch.bfloat16, 3, h=200, ko=128, f=320, bias=True, seed=5)


@pytest.mark.parametrize("t", [5, 8])
def test_fused_layer_tail_merges_split_attention(t, device):
    """x_splits: the O phase merges the partials as fused_linear's rows kernel does; x
    itself is never written, and the outputs equal the three launches over the
    combined x."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    out, splits = _split_attention(device, dtype, t, seed=t)
    x = out.view(t, -1)
    _, stream, w = _layer(device, dtype, t, 48, x.shape[1], 64, seed=10 + t)
    s = stream.clone()
    act = fused_layer_tail(x, s, **w, x_splits=splits)
    assert bool(out.isnan().all())  # merged on its loads, never combined into x
    kernels.combine_splits(splits)
    want_s, want_a = _three_launches(x, stream, w, 1e-6)
    assert torch.equal(act, want_a) and torch.equal(s, want_s)


def test_fused_layer_tail_supported():
    assert fused_layer_tail_supported(1, 576, 576, 1536)
    assert fused_layer_tail_supported(8, 576, 576, 1536)
    assert not fused_layer_tail_supported(9, 576, 576, 1536)
    assert not fused_layer_tail_supported(1, 768, 768, 3072)  # llama-68m: down K 3072


def _bad_cases(device):
    dtype = torch.float32
    x, stream, w = _layer(device, dtype, 2, 32, 32, 48, seed=3)
    f16 = {k: v.half() for k, v in w.items()}
    return x, stream, w, [
        (dict(x=x[:, :16]), ValueError, "x has 16 columns"),
        (dict(stream=stream[:1]), ValueError, "residual has shape"),
        (dict(w={**w, "gate_up_weight": w["gate_up_weight"][:-1]}), ValueError, "glu=True"),
        (dict(w={**w, "down_weight": w["down_weight"][:, :40]}), ValueError, "down_weight"),
        (dict(w={**w, "norm_weight": w["norm_weight"][:5]}), ValueError, "norm_weight"),
        (dict(w={**w, "o_weight": f16["o_weight"]}), TypeError, "weight"),
        (dict(act=torch.empty(2, 40, device=device)), ValueError, "out has shape"),
        (dict(x=torch.randn(9, 32, device=device), stream=torch.randn(9, 32, device=device)),
         ValueError, "rows 9"),
        (dict(programs=0), ValueError, "programs 0"),
    ]  # fmt: skip


@pytest.mark.parametrize("case", range(9))
def test_fused_layer_tail_bad_inputs(case, device):
    """A clear error naming the argument; the stream, act and the counter unchanged."""
    x, stream, w, cases = _bad_cases(device)
    change, exc, words = cases[case]
    if change.get("programs") == 0 and kernels.INTERPRET:
        pytest.skip("the interpreter runs one program whatever programs says")
    kw = dict(x=x, stream=stream.clone(), w=w, act=None, programs=None) | change
    s0 = kw["stream"].clone()
    act = kw["act"]
    a0 = None if act is None else act.clone()
    with pytest.raises(exc, match=words):
        fused_layer_tail(kw["x"], kw["stream"], **kw["w"], act=act, programs=kw["programs"])
    assert torch.equal(kw["stream"], s0)
    assert a0 is None or torch.equal(act, a0)


@pytest.mark.interpreter
def test_fused_decode_path_with_the_tail_equals_without(monkeypatch):
    """A model's fused decode steps with the tail on: the same hidden states, logits and
    aux states, bit for bit, as with the three launches; and the tail really ran."""
    from specdraft.kernels import fused_tail
    from specdraft.models.tiny import random_causal_lm, tiny_config

    from .test_fused_linear import _model_logits

    cfg = tiny_config("llama", num_layers=2)
    model = random_causal_lm(cfg, dtype=torch.float32, device="cpu", seed=3)
    calls = []
    real = kernels.fused_layer_tail

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    with torch.no_grad():
        plain = _model_logits(model, cfg, "cpu", True)
        monkeypatch.setattr(fused_tail, "TAIL_FUSED", True)
        monkeypatch.setattr(kernels, "fused_layer_tail", spy)
        tail = _model_logits(model, cfg, "cpu", True)
    assert len(calls) == 3 * 2  # 3 decode steps x 2 layers
    for a, b in zip(tail, plain):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
