"""bench.attn_phase: its one-launch and split attention against the float64 reference (CPU:
interpreter; GPU: bf16 at SmolLM2's heads), and its command line off the GPU."""

from __future__ import annotations

import math

import pytest
import torch

from bench import attn_phase

from .conftest import HAS_CUDA


def _case(device, dtype, heads, num_kv, dim, ctx, seed, spare_blocks=3):
    g = torch.Generator(device=device).manual_seed(seed)
    blocks = -(-ctx // attn_phase.BLOCK_SIZE)
    table = torch.randperm(blocks + spare_blocks, device=device, generator=g)[:blocks] + 1
    table = torch.cat([table, torch.zeros(4, dtype=table.dtype, device=device)]).to(torch.int32)
    shape = (blocks + spare_blocks + 1, attn_phase.BLOCK_SIZE, num_kv, dim)
    kc = torch.randn(shape, device=device, dtype=dtype, generator=g)
    vc = torch.randn(shape, device=device, dtype=dtype, generator=g)
    q = torch.randn(heads, dim, device=device, dtype=dtype, generator=g)
    seq = torch.tensor([ctx], device=device, dtype=torch.int32)
    return q, kc, vc, table, seq


def _check(device, dtype, heads, num_kv, dim, ctx, block, preload, seed, tol, splits=0):
    q, kc, vc, table, seq = _case(device, dtype, heads, num_kv, dim, ctx, seed)
    scale = 1.0 / math.sqrt(dim)
    out = torch.full_like(q, float("nan"))
    if splits:  # block: the length bound
        attn_phase.split_merge(q, kc, vc, table, seq, scale, out, splits=splits, bound=block)
    else:
        attn_phase.one_launch(q, kc, vc, table, seq, scale, out, block=block, preload=preload)
    want = attn_phase.reference(q, kc, vc, table, ctx, scale)
    assert not out.isnan().any()  # every element written
    err = (out.double() - want).abs().max().item()
    assert err <= tol, (ctx, block, preload, err)
    # A key past seq_len or a wrong block id would move the output: the reference over one
    # key fewer differs by more than the tolerance, so this check can fail.
    if ctx > 1:
        short = attn_phase.reference(q, kc, vc, table, ctx - 1, scale)
        assert (out.double() - short).abs().max().item() > tol


@pytest.mark.parametrize("ctx", [1, 7, 16, 41])
@pytest.mark.parametrize("preload", [False, True])
def test_one_launch_matches_float64_on_the_interpreter(ctx, preload):
    if HAS_CUDA:
        pytest.skip("the interpreter's case; the GPU case is below")
    # 16-key chunks: 41 keys take three, the later two through the online softmax.
    _check("cpu", torch.float32, 4, 2, 16, ctx, 16, preload, seed=ctx, tol=1e-5)


def test_one_launch_at_float16_on_the_interpreter():
    if HAS_CUDA:
        pytest.skip("the interpreter's case; the GPU case is below")
    _check("cpu", torch.float16, 6, 2, 16, 33, 16, True, seed=5, tol=4e-3)


@pytest.mark.parametrize("ctx", [1, 3, 40, 64])
def test_split_merge_matches_float64_on_the_interpreter(ctx):
    if HAS_CUDA:
        pytest.skip("the interpreter's case; the GPU case is below")
    # bound 64 over 4 splits: 1 and 3 keys leave splits empty, 64 fills every one.
    _check("cpu", torch.float32, 4, 2, 16, ctx, 64, False, seed=ctx, tol=1e-5, splits=4)


@pytest.mark.gpu
@pytest.mark.parametrize("ctx", [1, 255, 256, 1000])
def test_gpu_one_launch_bf16_within_its_own_rounding(ctx):
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    for preload in (False, True):
        q, kc, vc, table, seq = _case("cuda", torch.bfloat16, 9, 3, 64, ctx, seed=ctx)
        scale = 0.125
        out = torch.full_like(q, float("nan"))
        attn_phase.one_launch(q, kc, vc, table, seq, scale, out, preload=preload, pdl=True)
        want = attn_phase.reference(q, kc, vc, table, ctx, scale)
        assert attn_phase._bf16_steps(out, want) <= 4.0
    out = torch.full_like(q, float("nan"))
    attn_phase.split_merge(q, kc, vc, table, seq, scale, out, splits=16, bound=1024, pdl=True)
    assert attn_phase._bf16_steps(out, want) <= 4.0


def test_bad_shapes_are_refused():
    q, kc, vc, table, seq = _case("cpu", torch.float32, 4, 2, 16, 5, seed=1)
    out = torch.empty_like(q)
    for bad in ({"block": 24}, {"q": q[:3]}):
        args = {"q": q, "block": 16, **bad}
        with pytest.raises(ValueError, match="block|heads"):
            attn_phase.one_launch(args["q"], kc, vc, table, seq, 0.25, out, block=args["block"])
    with pytest.raises(ValueError, match="splits 3"):
        attn_phase.split_merge(q, kc, vc, table, seq, 0.25, out, splits=3, bound=64)


@pytest.mark.parametrize(
    "argv, flag",
    [(["--ctx", "x"], "--ctx"), (["--heads", "9/4/64"], "--heads"),
     (["--ctx", "2000"], "--max-model-len"), (["--phases", "0"], "--phases")],
)  # fmt: skip
def test_bad_arguments_are_refused_by_name(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        attn_phase.main(argv)
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.skipif(HAS_CUDA, reason="the GPU path measures")
def test_without_a_gpu_it_exits_2(capsys, tmp_path):
    assert attn_phase.main(["--out", str(tmp_path)]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().out
    assert not any(tmp_path.iterdir()), "nothing written"
