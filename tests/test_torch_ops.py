"""The PyTorch path (specdraft.torch_ops, through specdraft.ops) against the Triton
kernels under the interpreter, op by op, with padding and out-of-range metadata; and the
dispatch rules of specdraft.ops."""

from __future__ import annotations

import pytest
import torch

from specdraft import kernels, ops, torch_ops
from specdraft.kernels.validation import use_validation
from specdraft.selfcheck import _random_batch

pytestmark = pytest.mark.interpreter


def _pa_case(q_lens, ctx, gen, **kw):
    return _random_batch(
        q_lens, ctx, hq=8, hkv=2, d=32, block=16, dtype=torch.float32, device="cpu", gen=gen, **kw
    )


@pytest.mark.parametrize(
    "q_lens, ctx, window, softcap",
    [
        ([1, 1, 1], [40, 7, 90], None, None),
        ([1, 4, 9], [30, 64, 0], None, 5.0),
        ([6], [17], 8, None),
        ([3, 17, 1, 1], [0, 5, 100, 31], 20, 3.0),
    ],
)
def test_paged_attention_matches_kernel(q_lens, ctx, window, softcap):
    gen = torch.Generator().manual_seed(sum(ctx))
    q, kc, vc, qsl, sl, bt = _pa_case(q_lens, ctx, gen)
    kw = dict(sliding_window=window, softcap=softcap)
    want = kernels.paged_attention(q, kc, vc, qsl, sl, bt, 0.17, max_query_len=max(q_lens), **kw)
    out = torch.full_like(q, float("nan"))
    torch_ops.paged_attention(q, kc, vc, qsl, sl, bt, 0.17, out=out, **kw)
    torch.testing.assert_close(out, want, atol=2e-6, rtol=1e-5)


def test_paged_attention_corrupt_metadata_stays_in_bounds():
    """Block ids outside the cache, query ranges past q, seq_len below the query: no
    error, no write outside `out`, finite values (validation off)."""
    gen = torch.Generator().manual_seed(3)
    q, kc, vc, qsl, sl, bt = _pa_case([2, 3], [20, 40], gen)
    bt[0, 0] = 10_000
    bt[1, 1] = -7
    qsl[2] = 999
    sl[0] = 1
    big = torch.full((q.shape[0] + 4, *q.shape[1:]), 7.0)
    out = big[2:-2]
    with use_validation(False):
        torch_ops.paged_attention(q, kc, vc, qsl, sl, bt, 0.2, out=out)
    assert torch.isfinite(out).all()
    assert (big[:2] == 7.0).all() and (big[-2:] == 7.0).all()


def test_store_kv_matches_kernel_and_drops_bad_slots():
    gen = torch.Generator().manual_seed(5)
    kc = torch.randn(6, 16, 2, 32, generator=gen)
    vc = torch.randn(6, 16, 2, 32, generator=gen)
    k, v = torch.randn(2, 7, 2, 32, generator=gen)
    slots = torch.tensor([3, -1, 95, 96, 10_000, 17, 0])  # 96 = 6 * 16: past the cache
    a = (kc.clone(), vc.clone())
    b = (kc.clone(), vc.clone())
    with use_validation(False):  # the contract without the up-front check
        kernels.store_kv(k, v, *a, slots)
        torch_ops.store_kv(k, v, *b, slots)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], kc)


def test_rms_norm_rotary_silu_match_kernels():
    gen = torch.Generator().manual_seed(7)
    x, r = torch.randn(2, 5, 64, generator=gen)
    w = torch.randn(64, generator=gen)
    ka = kernels.rms_norm(x, w, 1e-5, residual=r.clone())
    ta = torch_ops.rms_norm(x, w, 1e-5, residual=r.clone())
    assert torch.equal(ka[0], ta[0]) and torch.equal(ka[1], ta[1])
    q, k = torch.randn(5, 4, 16, generator=gen), torch.randn(5, 2, 16, generator=gen)
    pos = torch.tensor([0, 3, 7, 2, 100])  # 100: past the table, clamped by both
    table = torch.randn(64, 12, generator=gen)  # rotary over 12 of 16 dims
    qa, ka2, qb, kb = q.clone(), k.clone(), q.clone(), k.clone()
    kernels.apply_rotary(qa, ka2, pos, table)
    torch_ops.apply_rotary(qb, kb, pos, table)
    torch.testing.assert_close(qa, qb, atol=1e-6, rtol=0)
    torch.testing.assert_close(ka2, kb, atol=1e-6, rtol=0)
    g = torch.randn(5, 48, generator=gen)
    torch.testing.assert_close(kernels.silu_and_mul(g), torch_ops.silu_and_mul(g))


def test_slot_mapping_matches_kernel():
    positions = torch.tensor([0, 1, 17, 5, 40, -3, 9, 9], dtype=torch.int64)
    qsl = torch.tensor([0, 3, 7, 7], dtype=torch.int32)
    table = torch.tensor([[4, 2, 0], [7, -1, 3], [1, 1, 1]], dtype=torch.int32)
    a = torch.full((8,), 123, dtype=torch.int64)
    b = a.clone()
    kernels.prepare_slot_mapping(positions, qsl, table, 16, a)(3, 8)
    torch_ops.prepare_slot_mapping(positions, qsl, table, 16, b)(3, 8)
    assert torch.equal(a, b)


def test_backend_dispatch_and_checks():
    x = torch.randn(3, 8)
    assert ops.backend_for(x) == "triton"  # the interpreter is on in the tests
    with ops.use_backend("torch"):
        assert ops.backend_for(x) == "torch"
        with pytest.raises(ValueError, match="eps"):
            ops.rms_norm(x, torch.ones(8), -1.0)  # the launcher's checks on the torch path
        with pytest.raises(ValueError, match="even last dimension"):
            ops.silu_and_mul(torch.randn(3, 7))
    assert ops.backend_for(x) == "triton"
    with pytest.raises(ValueError, match="backend"):
        ops.set_backend("cuda")


def test_bf16_refused_under_the_interpreter_but_fine_on_torch_path():
    x = torch.randn(4, 64).bfloat16()
    w = torch.randn(64).bfloat16()
    with pytest.raises(TypeError, match="bfloat16"):
        kernels.rms_norm(x, w, 1e-5)
    with ops.use_backend("torch"):
        y = ops.rms_norm(x, w, 1e-5)
    ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    ref = ref.bfloat16().float() * w.float()
    torch.testing.assert_close(y.float(), ref, atol=0.02, rtol=0.01)


def test_cpu_tensors_without_interpreter_get_a_clear_error(monkeypatch):
    from specdraft.kernels import guard

    monkeypatch.setattr(guard, "INTERPRET", False)
    with pytest.raises(ValueError, match="need an NVIDIA GPU.*TRITON_INTERPRET=1"):
        kernels.silu_and_mul(torch.randn(2, 8))


def test_paged_attention_ignores_nan_past_each_length():
    """The cache past a request's length holds whatever was there; NaN there must not
    reach the output (0 * NaN in the weighted sum of V was the failure mode)."""
    gen = torch.Generator().manual_seed(11)
    q, kc, vc, qsl, sl, bt = _pa_case([1, 3], [5, 20], gen)
    want = kernels.paged_attention(q, kc, vc, qsl, sl, bt, 0.2, max_query_len=3)
    for r, n in enumerate(sl.tolist()):
        row = bt[r]
        for pos in range(n, row.numel() * 16):
            blk = int(row[pos // 16])
            if blk:  # block 0 is shared padding
                kc[blk, pos % 16] = float("nan")
                vc[blk, pos % 16] = float("nan")
    kc[0], vc[0] = float("nan"), float("nan")
    got = torch_ops.paged_attention(q, kc, vc, qsl, sl, bt, 0.2)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[:4], want[:4], atol=2e-6, rtol=1e-5)
