"""bench.phase_barrier's chains (square projections; a Llama layer's four projections)
against float64 chains rounded as they round, and against each other bit for bit (CPU:
one program, so the grid barrier never waits on a program the interpreter has not run;
GPU: as the benchmark runs them)."""

from __future__ import annotations

import pytest
import torch

from bench.phase_barrier import (
    chain_barrier,
    chain_launches,
    layer_weights,
    layers_barrier,
    layers_launches,
)

from .conftest import HAS_CUDA


def _reference(x0: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Each phase in float64 over the previous phase's rounded output, then rounded."""
    xs = [x0]
    for wl in w:
        xs.append((wl.double() @ xs[-1].double()).to(x0.dtype))
    return torch.stack(xs)


def _check(device: str, dtype: torch.dtype, d: int, layers: int, bn: int, bn_barrier: int):
    g = torch.Generator(device=device).manual_seed(d + layers)
    w = torch.randn(layers, d, d, device=device, dtype=dtype, generator=g) / d**0.5
    x = torch.full((layers + 1, d), float("nan"), device=device, dtype=dtype)
    x[0] = torch.randn(d, device=device, dtype=dtype, generator=g)
    want = _reference(x[0], w)
    chain_launches(x, w, bn=bn, pdl=False)
    got_launches = x.clone()
    x[1:] = float("nan")
    counter = torch.zeros(1, device=device, dtype=torch.int32)
    chain_barrier(x, w, counter, bn=bn_barrier)
    assert not got_launches.isnan().any() and not x.isnan().any()  # every element written
    assert int(counter.item()) == 0  # left as it was found, ready for the next replay
    # Float32 sums against float64 ones: a rounding of the output dtype at most, per phase.
    tol = 2 * torch.finfo(dtype).eps
    for got in (got_launches, x):
        err = (got.double() - want.double()).abs() / want.double().abs().clamp_min(1e-3)
        assert err.median() < tol, err.median()
    assert torch.equal(x, got_launches)  # the same tile code: the same sums


def _barriers_leave_zero(device, programs):
    from bench.phase_barrier import _barriers_kernel

    counter = torch.full((1,), 0, device=device, dtype=torch.int32)
    for layers in (1, 5):
        _barriers_kernel[(programs,)](counter, layers)
        assert int(counter.item()) == 0


def test_phase_chains_on_the_interpreter():
    if HAS_CUDA:
        pytest.skip("the interpreter's case; the GPU case is below")
    _check("cpu", torch.float16, d=64, layers=3, bn=16, bn_barrier=64)
    _barriers_leave_zero("cpu", 1)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")
def test_gpu_barriers_alone_leave_the_counter_at_zero():
    _barriers_leave_zero("cuda", torch.cuda.get_device_properties(0).multi_processor_count)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("bn", [8, 16])
def test_gpu_phase_chains(bn):
    _check("cuda", torch.bfloat16, d=576, layers=40, bn=bn, bn_barrier=bn)


def _check_layers(device: str, dtype: torch.dtype, h: int, nqkv: int, f: int, layers: int,
                  programs: int):  # fmt: skip
    w = layer_weights(layers, h, nqkv, f, device, dtype, seed=h + f)
    g = torch.Generator(device=device).manual_seed(1)
    x0 = torch.randn(1, h, device=device, dtype=dtype, generator=g)
    kw = {"device": device, "dtype": dtype}
    x, qkv, act = x0.clone(), torch.full((1, nqkv), float("nan"), **kw), torch.empty(1, f, **kw)
    act.fill_(float("nan"))
    layers_launches(x, qkv, act, w, pdl=False)
    want = (x.clone(), qkv.clone(), act.clone())
    # the same four projections in float64 from each rounded input, rounded as they are
    ref = x0.double()
    for i in range(layers):

        def norm(v, gw):
            return v * torch.rsqrt((v * v).mean(-1, keepdim=True) + 1e-6) * gw.double()

        q = (norm(ref, w[4][i]) @ w[0][i].double().T).to(dtype)
        ref = (ref + q[:, :h].double() @ w[1][i].double().T).to(dtype).double()
        gu = norm(ref, w[5][i]) @ w[2][i].double().T
        a = (torch.nn.functional.silu(gu[:, :f]) * gu[:, f:]).to(dtype)
        ref = (ref + a.double() @ w[3][i].double().T).to(dtype).double()
    err = (want[0].double() - ref).abs().max() / ref.abs().max()
    assert err < 8 * torch.finfo(dtype).eps, err
    x.copy_(x0), qkv.fill_(float("nan")), act.fill_(float("nan"))
    counter = torch.zeros(1, device=device, dtype=torch.int32)
    layers_barrier(x, qkv, act, w, counter, programs=programs)
    assert int(counter.item()) == 0
    for got, exp in zip((x, qkv, act), want):
        assert not got.isnan().any()
        assert torch.equal(got, exp)  # the rows kernel's helpers and tiles: the same bits


def test_layer_chains_on_the_interpreter():
    if HAS_CUDA:
        pytest.skip("the interpreter's case; the GPU case is below")
    _check_layers("cpu", torch.float16, h=64, nqkv=96, f=128, layers=2, programs=1)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("programs", [1, 37, 132])
def test_gpu_layer_chains(programs):
    _check_layers("cuda", torch.bfloat16, h=576, nqkv=960, f=1536, layers=4, programs=programs)
