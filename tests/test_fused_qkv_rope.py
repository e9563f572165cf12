"""The QKV projection with rotary and the K/V store as its epilogue
(kernels.fused_qkv_rope) against a float64 reference of the three steps it replaces
(RMSNorm + QKV GEMM + bias, the half-split rotation of q and k, the store of k and v at
the slots); padding and out-of-cache slots; bad inputs, each refused before anything
is written.

CPU runs use the Triton interpreter in fp32 / fp16; tests marked gpu run bf16 at
SmolLM2's and Llama-3-8B-like shapes, with programmatic dependent launch."""

from __future__ import annotations

import pytest
import torch

from specdraft import kernels
from specdraft.kernels import fused_qkv_rope
from specdraft.kernels.fused_linear import MAX_ROWS
from specdraft.kernels.fused_mma import MMA_MAX_ROWS


def _table(max_positions: int, d: int, device) -> torch.Tensor:
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], 1).float().to(device)


def _case(device, dtype, m, hq, hkv, d, k, *, bias, norm, seed):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    n = (hq + 2 * hkv) * d
    num_blocks, block_size, max_pos = max(6, m // 2), 4, 40
    c = dict(
        x=rnd(m, k),
        w=rnd(n, k, scale=k**-0.5),
        b=rnd(n) if bias else None,
        g=(1 + rnd(k, scale=0.1)) if norm else None,
        cs=_table(max_pos, d, device),
        pos=torch.randint(0, max_pos, (m,), generator=g).to(device),
        kc=torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype, device=device),
        vc=torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype, device=device),
        slots=torch.randperm(num_blocks * block_size, generator=g)[:m].to(device),
    )
    if m > 1:  # a padded row, and one whose slot lies past the cache: no K/V written
        c["slots"][0] = -1
        c["slots"][-1] = num_blocks * block_size + 3
        c["pos"][1] = max_pos + 7  # clamped into the table
    return c


def _reference(c, hq, hkv, d):
    """float64 q, k, v [M, H, D] of the three unfused steps, q and k rotated."""
    x = c["x"].double()
    if c["g"] is not None:
        x = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * c["g"].double()
    qkv = x @ c["w"].double().T
    if c["b"] is not None:
        qkv = qkv + c["b"].double()
    m = x.shape[0]
    q = qkv[:, : hq * d].view(m, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(m, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(m, hkv, d)
    pos = c["pos"].clamp(0, c["cs"].shape[0] - 1)
    cos = c["cs"][pos][:, None, : d // 2].double()
    sin = c["cs"][pos][:, None, d // 2 :].double()

    def rot(t):
        a, b = t[..., : d // 2], t[..., d // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

    return rot(q), rot(k), v


def _check(device, dtype, m, hq, hkv, d, k, *, bias, norm, seed=0, pdl=False, late_meta=False):
    c = _case(device, dtype, m, hq, hkv, d, k, bias=bias, norm=norm, seed=seed)
    kc0, vc0 = c["kc"].clone(), c["vc"].clone()
    out = torch.full((m, hq * d), float("nan"), dtype=dtype, device=device)
    # Validation mode would refuse the slot past the cache: here the kernel's own bounds
    # are under test (it writes nothing for it).
    with kernels.use_validation(False):
        q = fused_qkv_rope(
            c["x"], c["w"], c["pos"], c["cs"], c["kc"], c["vc"], c["slots"], num_q_heads=hq,
            bias=c["b"], norm_weight=c["g"], out=out, pdl=pdl, late_meta=late_meta,
        )  # fmt: skip
    assert q.shape == (m, hq, d) and q.data_ptr() == out.data_ptr()
    qr, kr, vr = _reference(c, hq, hkv, d)

    def close(got, want, what):
        err = (got.double() - want).abs().max().item()
        scale = want.abs().max().item() + 1.0
        # float32 sums, one rounding to the dtype (an element on a boundary may round the
        # other way: up to a unit in the last place)
        tol = 1e-5 * scale if dtype == torch.float32 else 2 * scale * torch.finfo(dtype).eps
        assert err <= tol, (what, err, tol)

    assert torch.isfinite(out).all(), "every q element written"
    close(q, qr, "q")
    bs, slots = c["kc"].shape[1], c["slots"].tolist()
    written = set()
    for i, s in enumerate(slots):
        if 0 <= s < c["kc"].shape[0] * bs:
            written.add(s)
            close(c["kc"][s // bs, s % bs], kr[i], "k")
            close(c["vc"][s // bs, s % bs], vr[i], "v")
    for s in range(c["kc"].shape[0] * bs):
        if s not in written:
            for now, before in ((c["kc"], kc0), (c["vc"], vc0)):
                assert torch.isnan(now[s // bs, s % bs]).all(), f"slot {s} written"
                assert torch.isnan(before[s // bs, s % bs]).all()


FLAGS = [dict(bias=False, norm=True), dict(bias=True, norm=False), dict(bias=True, norm=True)]


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("flags", FLAGS, ids=["norm", "bias", "bias-norm"])
def test_fused_qkv_rope_matches_float64(dtype, flags):
    # Llama-style 4/2 heads of 16; SmolLM2's 9/3 of 64; MAX_ROWS rows, K in two pieces;
    # positions and slots read after the PDL wait (late_meta) in the second case
    for m, hq, hkv, d, k in ((1, 4, 2, 16, 48), (3, 9, 3, 64, 96), (MAX_ROWS, 6, 2, 32, 600)):
        _check("cpu", dtype, m, hq, hkv, d, k, late_meta=m == 3, **flags)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("flags", FLAGS, ids=["norm", "bias", "bias-norm"])
def test_fused_qkv_rope_tensor_cores_match_float64(dtype, flags):
    """Past MAX_ROWS rows: the tensor-core kernel, pair partners in two accumulators."""
    for m, hq, hkv, d, k in ((MAX_ROWS + 1, 4, 2, 16, 48), (20, 9, 3, 64, 96),
                             (MMA_MAX_ROWS, 6, 2, 32, 600)):  # fmt: skip
        _check("cpu", dtype, m, hq, hkv, d, k, **flags)


def _bad_call(kw):
    c = _case("cpu", torch.float32, 2, 4, 2, 16, 32, bias=False, norm=True, seed=1)
    c["out"] = torch.full((2, 64), 5.0)
    c.update(kw)
    return c


@pytest.mark.parametrize(
    "change, exc, words",
    [
        (dict(w=torch.randn(70, 32)), ValueError, "weight has 70 rows"),
        (dict(cs=_table(40, 8, "cpu")), ValueError, "cos_sin_cache width 8"),
        (dict(out=torch.zeros(2, 60)), ValueError, "out has shape"),
        (dict(num_q_heads=3), ValueError, "weight has 128 rows"),
        (dict(num_q_heads=0), ValueError, "num_q_heads must be a positive int"),
        (dict(pos=torch.zeros(2, dtype=torch.int32)), TypeError, "positions"),
        (dict(slots=torch.zeros(1, dtype=torch.int64)), ValueError, "slot_mapping has 1"),
        (dict(x=torch.randn(MMA_MAX_ROWS + 1, 32)), ValueError, "rows"),
        (dict(g=torch.ones(31)), ValueError, "norm_weight has shape"),
        (dict(late_meta=1), TypeError, "late_meta must be a bool"),
        (dict(x=torch.randn(MAX_ROWS + 1, 32), late_meta=True), ValueError, "late_meta takes"),
    ],
)
def test_fused_qkv_rope_bad_inputs(change, exc, words, device):
    """A clear error naming the argument; nothing written (cache and out unchanged)."""
    c = _bad_call(change)
    c = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in c.items()}
    hq = change.get("num_q_heads", 4)
    snap = {key: c[key].clone() for key in ("kc", "vc", "out")}
    with pytest.raises(exc, match=words):
        fused_qkv_rope(
            c["x"], c["w"], c["pos"], c["cs"], c["kc"], c["vc"], c["slots"], num_q_heads=hq,
            norm_weight=c["g"], out=c["out"], late_meta=c.get("late_meta", False),
        )  # fmt: skip
    for key, before in snap.items():
        assert torch.equal(c[key], before) or (
            torch.isnan(before).all() and torch.isnan(c[key]).all()
        ), f"{key} changed"


def test_fused_qkv_rope_supported():
    assert kernels.late_meta_supported(1) and kernels.late_meta_supported(MAX_ROWS)
    assert not kernels.late_meta_supported(MAX_ROWS + 1) and not kernels.late_meta_supported(0)
    assert kernels.fused_qkv_rope_supported(576, 64, 64)
    assert not kernels.fused_qkv_rope_supported(576, 64, 32)  # partial rotary
    assert not kernels.fused_qkv_rope_supported(4096, 128, 128)  # the wide kernel's K


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("flags", FLAGS, ids=["norm", "bias", "bias-norm"])
def test_gpu_fused_qkv_rope_bf16(flags, pdl):
    pdl = pdl and kernels.pdl_supported("cuda")
    # SmolLM2's heads; 32 / 8 heads of 128 at K 2048; past MAX_ROWS the tensor cores
    for m in (1, 4, MAX_ROWS, MAX_ROWS + 1, 24, MMA_MAX_ROWS):
        late = m <= MAX_ROWS and m % 2 == 0  # positions and slots after the wait
        _check("cuda", torch.bfloat16, m, 9, 3, 64, 576, seed=m, pdl=pdl, late_meta=late, **flags)
        _check("cuda", torch.bfloat16, m, 32, 8, 128, 2048, seed=m, pdl=pdl, **flags)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 4, MAX_ROWS])
def test_gpu_row_among_m_equals_row_alone(m):
    """A row's q and stored K/V are the bits it gets alone (what makes a verified token
    the decoded one). SmolLM2's shapes, bf16, 300 draws of x, positions and slots: with
    the rotation's fused multiply-add left to the compiler, 2-3 rows in 300 differed at
    4 rows on the H200."""
    hq, hkv, d, k = 9, 3, 64, 576
    g = torch.Generator(device="cuda").manual_seed(m)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    w, nw = rnd((hq + 2 * hkv) * d, k, scale=k**-0.5), 1 + rnd(k, scale=0.1)
    cs = _table(1024, d, "cuda")
    bad = []
    for trial in range(300):
        x = rnd(m, k, scale=2.0)
        pos = torch.randint(0, 1024, (m,), generator=g, device="cuda")
        slots = torch.randperm(64, generator=g, device="cuda")[:m]
        kc, vc = rnd(4, 16, hkv, d), rnd(4, 16, hkv, d)
        kc1, vc1 = kc.clone(), vc.clone()
        q = fused_qkv_rope(x, w, pos, cs, kc, vc, slots, num_q_heads=hq, norm_weight=nw)
        for r in range(m):
            one = fused_qkv_rope(x[r : r + 1], w, pos[r : r + 1], cs, kc1, vc1,
                                 slots[r : r + 1], num_q_heads=hq, norm_weight=nw)  # fmt: skip
            if not torch.equal(one[0], q[r]):
                bad.append((trial, r, "q"))
        if not (torch.equal(kc, kc1) and torch.equal(vc, vc1)):
            bad.append((trial, "cache"))
    assert not bad, bad[:10]
