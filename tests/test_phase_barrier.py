"""bench.phase_barrier's chains of square projections against float64 chains rounded as
they round, and against each other bit for bit (CPU: one program, so the grid barrier
never waits on a program the interpreter has not run; GPU: as the benchmark runs them)."""

from __future__ import annotations

import pytest
import torch

from bench.phase_barrier import chain_barrier, chain_launches

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
