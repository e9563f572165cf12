"""The int8 projection (kernels.linear_int8) and the draft's int8 lm_head built on it
(layers.Int8Linear, layers.quantize_lm_head).

- the kernel against float64 sums of x times the int8 weights, each column scaled once
  (fp32 / fp16 on the CPU interpreter, bf16 / fp16 with PDL and under a CUDA graph on the
  GPU): every element written, our error within the reference's own rounding;
- the PyTorch path against the kernel; the per-row quantization's bounds;
- bad input: the exception type, a message naming the argument, nothing written;
- greedy draft rounds of an EAGLE-1 and an EAGLE-3 head with an int8 lm_head equal a
  float64 reference whose lm_head is the dequantized weights; the target's own lm_head
  untouched."""

# ruff: noqa: F811 (fixtures imported from tests/drafter_helpers.py are test arguments)
from __future__ import annotations

import pytest
import torch

from specdraft import kernels, ops
from specdraft.layers import Int8Linear, Linear, quantize_lm_head
from tests.test_fused_linear import rounding

interp = pytest.mark.interpreter
gpu = pytest.mark.gpu


def reference(x, q, scale) -> torch.Tensor:
    return (x.double() @ q.double().T) * scale.double()


def check_case(device, dtype, m, k, n, *, pdl=False, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k, device=device, generator=g) / k**0.5
    w[n // 2] *= 50  # rows of very different magnitudes: a scale each
    q, s = kernels.quantize_rows_int8(w)
    x = torch.randn(m, k, device=device, generator=g).to(dtype)
    x0 = x.clone()
    out = torch.full((m, n), float("nan"), device=device, dtype=dtype)
    got = kernels.linear_int8(x, q, s, out=out, pdl=pdl)
    assert got.data_ptr() == out.data_ptr()
    assert torch.isfinite(got).all(), "every element written"
    assert torch.equal(x, x0), "x unchanged"
    assert_near_reference(got, x, q, s)
    return got


def assert_near_reference(got, x, q, s) -> None:
    """got within the float64 reference's own rounding: float32 sums of K exact
    products (int8 values are exact in every x dtype), then one float32 scale multiply,
    a few ulps of the row's magnitude; in fp16 / bf16 the output's one rounding on top
    (an element on a boundary may round the other way)."""
    want = reference(x, q, s)
    err = (got.double() - want).abs()
    mag = (x.double().abs() @ q.double().abs().T) * s.double()
    tol = 1e-6 * mag + 1e-30
    if x.dtype != torch.float32:
        tol = tol + 2 * rounding(want, x.dtype)
    assert bool((err <= tol).all()), (err.max().item(), (err / tol).max().item())


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_linear_int8_matches_float64(dtype):
    # rows: one 16-row tile, 32- and 64-row tiles, two 64-row tiles; N not a multiple of
    # the column block; K short, ragged, 576 (SmolLM2's hidden size: a masked last step
    # of 128), over one step, and past 2048 (256-wide steps, the last one masked)
    for m, k, n in ((1, 576, 200), (3, 40, 70), (16, 96, 64), (17, 130, 33), (40, 256, 16),
                    (65, 48, 40), (2, 2112, 24)):  # fmt: skip
        check_case("cpu", dtype, m, k, n, seed=m + k + n)


@interp
def test_torch_path_matches_kernel():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(90, 48, generator=g)
    q, s = kernels.quantize_rows_int8(w)
    x = torch.randn(5, 48, generator=g)
    a = ops.linear_int8(x, q, s)
    with ops.use_backend("torch"):
        b = ops.linear_int8(x, q, s)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    assert torch.allclose(b.double(), reference(x, q, s), rtol=1e-5, atol=1e-5)


def check_partials_case(device, dtype, m, k, n, *, ties=False, pdl=False, seed=0):
    """linear_int8_partials into poisoned buffers wider than needed: reduced, the tokens
    of argmax_rows over linear_int8's logits; exactly [m, blocks] written; x unchanged."""
    from specdraft.torch_ops import reduce_argmax_parts

    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k, device=device, generator=g) / k**0.5
    if ties:  # copies of one row at later columns (other blocks): the first wins
        w[n // 3 :: max(1, n // 5)] = w[n // 3]
    q, s = kernels.quantize_rows_int8(w)
    x = torch.randn(m, k, device=device, generator=g).to(dtype)
    if ties:  # that row the clear maximum
        x = (x * 0.1 + q[n // 3].to(dtype)).to(dtype)
    x0 = x.clone()
    blocks = kernels.argmax_blocks(m, n, k)
    val = torch.full((m + 2, blocks + 3), float("nan"), device=device)
    idx = torch.full((m + 2, blocks + 3), -7, dtype=torch.int32, device=device)
    assert kernels.linear_int8_partials(x, q, s, val, idx, pdl=pdl) == blocks
    assert not val[:m, :blocks].isnan().any() and bool((idx[:m, :blocks] >= 0).all())
    assert val[m:].isnan().all() and val[:, blocks:].isnan().all(), "nothing else written"
    assert bool((idx[m:] == -7).all()) and bool((idx[:, blocks:] == -7).all())
    assert torch.equal(x, x0)
    want = kernels.argmax_rows(kernels.linear_int8(x, q, s))
    assert torch.equal(reduce_argmax_parts(val, idx, m, blocks), want)
    if ties:
        assert bool((want == n // 3).all())
    # the float64 reference ranks the chosen column first, within the output's rounding
    ref = reference(x, q, s)
    gap = ref.max(dim=1).values - ref.gather(1, want[:, None]).squeeze(1)
    assert bool((gap <= 2 * rounding(ref.max(dim=1).values, dtype) + 1e-9).all()), gap.max()


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_linear_int8_partials_reduce_to_the_argmax(dtype):
    # a 16-row tile, one and two 64-row tiles, ragged N, K past 2048, ties across blocks
    for i, (m, k, n) in enumerate(((1, 576, 300), (3, 40, 70), (20, 64, 200), (65, 33, 16),
                                   (2, 2112, 40))):  # fmt: skip
        check_partials_case("cpu", dtype, m, k, n, seed=i)
    check_partials_case("cpu", dtype, 5, 64, 500, ties=True, seed=7)


def reference_a8(x, q, s) -> torch.Tensor:
    """act_int8's definition in float64: x's rows to int8 (times 127 / absmax in float32,
    ties to even), exact integer sums, then the two scales (absmax / 127 in float32)."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)
    live = amax > 0
    # each quotient correctly rounded, as the kernel's div_rn (torch's `127.0 / amax` is
    # 127 * (1 / amax), an ulp off in ~1/4 of rows)
    sx = torch.where(live, (amax.double() / 127.0).float(), torch.ones_like(amax))
    rx = torch.where(
        live, (amax.new_full((), 127.0).double() / amax.double()).float(), torch.zeros_like(amax)
    )
    xq = torch.round(xf * rx).clamp(-127, 127)
    return (xq.double() @ q.double().T) * sx.double() * s.double()


def check_a8_case(device, dtype, m, k, n, *, seed, gather=False, pdl=False):
    g = torch.Generator(device=device).manual_seed(seed)
    q, s = kernels.quantize_rows_int8(torch.randn(n, k, device=device, generator=g))
    x = (torch.randn(m, k, device=device, generator=g) * 3).to(dtype)
    x[0, k // 2] = 40.0  # an outlier sets row 0's scale
    if m > 1:
        x[1] = 0.0  # an all-zero row: scale 1, zero logits
    rows = torch.randint(0, m, (m + 2,), device=device, generator=g) if gather else None
    xr = x if rows is None else x[rows]
    out = torch.full((xr.shape[0], n), float("nan"), device=device, dtype=dtype)
    kernels.linear_int8(x, q, s, out=out, x_rows=rows, pdl=pdl, act_int8=True)
    want = reference_a8(xr, q, s)
    xq_mag = (reference_a8(xr.abs(), q.abs(), s)).abs()  # the sums' magnitude
    err = (out.double() - want).abs()
    tol = 4e-7 * xq_mag + 1e-30  # int32 -> float32, two float32 multiplies
    if dtype != torch.float32:
        tol = tol + 2 * rounding(want, dtype)
    assert torch.isfinite(out).all(), "every element written"
    assert bool((err <= tol).all()), (err.max().item(), (err / tol).max().item())
    # and the partials rank those logits as argmax_rows does
    blocks = kernels.argmax_blocks(xr.shape[0], n, k)
    val = torch.full((xr.shape[0], blocks), float("nan"), device=device)
    idx = torch.full((xr.shape[0], blocks), -7, dtype=torch.int32, device=device)
    kernels.linear_int8_partials(x, q, s, val, idx, x_rows=rows, pdl=pdl, act_int8=True)
    from specdraft.torch_ops import reduce_argmax_parts

    got = reduce_argmax_parts(val, idx, xr.shape[0], blocks)
    assert torch.equal(got, kernels.argmax_rows(out))


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_act_int8_matches_its_float64_definition(dtype):
    # SmolLM2's K with a 16-row tile, a 64-row tile, K below one 32-deep step, x_rows
    for i, (m, k, n) in enumerate(((1, 576, 300), (3, 200, 70), (20, 64, 130), (2, 20, 40))):
        check_a8_case("cpu", dtype, m, k, n, seed=60 + i)
    check_a8_case("cpu", dtype, 4, 96, 50, seed=70, gather=True)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_act_int8_torch_path_equals_the_kernel_bit_for_bit(dtype):
    from specdraft.torch_ops import reduce_argmax_parts

    g = torch.Generator().manual_seed(6)
    q, s = kernels.quantize_rows_int8(torch.randn(300, 576, generator=g))
    x = (torch.randn(4, 576, generator=g) * 2).to(dtype)
    x[2, 7] = float("nan")
    rows = torch.tensor([3, 0, 2, 2, 1])
    a = ops.linear_int8(x, q, s, x_rows=rows, act_int8=True)
    with ops.use_backend("torch"):
        b = ops.linear_int8(x, q, s, x_rows=rows, act_int8=True)
        nb = kernels.argmax_blocks(5, 300, 576)  # the buffers' size, whichever path
        val, idx = torch.empty(5, nb), torch.empty(5, nb, dtype=torch.int32)
        assert ops.linear_int8_partials(x, q, s, val, idx, x_rows=rows, act_int8=True) == 1
    assert bool(((a == b) | (a.isnan() & b.isnan())).all()), "bit for bit, NaN rows alike"
    assert a[2].isnan().all() and a[3].isnan().all() and not a[[0, 1, 4]].isnan().any()
    assert torch.equal(reduce_argmax_parts(val, idx, 5, 1), kernels.argmax_rows(a))


@interp
def test_act_int8_a_row_that_is_not_finite_gives_nan_and_spares_the_others():
    q, s = kernels.quantize_rows_int8(torch.randn(40, 64))
    x = torch.randn(3, 64)
    x[1, 5] = float("inf")
    out = kernels.linear_int8(x, q, s, act_int8=True)
    assert out[1].isnan().all()
    ref = reference_a8(x[[0, 2]], q, s)
    assert torch.allclose(out[[0, 2]].double(), ref, rtol=1e-6, atol=1e-6)


@interp
def test_act_int8_rounds_ties_to_even():
    # absmax 127: r_x = 1, so x * r_x is x and every .5 is a tie
    halves = [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5]
    x = torch.tensor([[127.0] + halves + [0.0] * 7])
    q = torch.eye(16, dtype=torch.int8)  # logits = x_q times the row scales
    s = torch.ones(16)
    out = kernels.linear_int8(x, q, s, act_int8=True)
    want = [127.0, 0.0, 2.0, 2.0, -0.0, -2.0, -2.0, 126.0, -126.0] + [0.0] * 7
    assert out[0].tolist() == want


@interp
@pytest.mark.parametrize("bad", [1, "yes", torch.tensor(True)])
def test_act_int8_must_be_a_bool(bad):
    q, s = kernels.quantize_rows_int8(torch.randn(40, 64))
    x = torch.randn(2, 64)
    out = torch.full((2, 40), 7.0)
    val = torch.full((2, 1), 7.0)
    idx = torch.full((2, 1), 7, dtype=torch.int32)
    with pytest.raises(TypeError, match="act_int8"):
        kernels.linear_int8(x, q, s, out=out, act_int8=bad)
    with pytest.raises(TypeError, match="act_int8"):
        kernels.linear_int8_partials(x, q, s, val, idx, act_int8=bad)
    assert bool((out == 7.0).all()) and bool((val == 7.0).all()) and bool((idx == 7).all())


@interp
def test_linear_int8_partials_torch_path_reduces_alike():
    from specdraft.torch_ops import reduce_argmax_parts

    g = torch.Generator().manual_seed(6)
    q, s = kernels.quantize_rows_int8(torch.randn(300, 48, generator=g))
    x = torch.randn(5, 48, generator=g)
    got = []
    for backend in ("triton", "torch"):
        val, idx = torch.empty(5, 8), torch.empty(5, 8, dtype=torch.int32)
        with ops.use_backend(backend):
            blocks = ops.linear_int8_partials(x, q, s, val, idx)
        got.append(reduce_argmax_parts(val, idx, 5, blocks))
    assert blocks == 1 and torch.equal(got[0], got[1])


def check_x_rows_case(device, dtype, *, pdl=False, seed=0):
    """linear_int8 / linear_int8_partials over x's rows x_rows (repeated, out of order,
    and outside x: clamped into it) equal the same call on the gathered rows, bit for
    bit, into poisoned outputs; x and x_rows unchanged."""
    g = torch.Generator(device=device).manual_seed(seed)
    m, k, n = 7, 576, 300
    q, s = kernels.quantize_rows_int8(torch.randn(n, k, device=device, generator=g))
    x = torch.randn(m, k, device=device, generator=g).to(dtype)
    x_rows = torch.tensor([6, 0, 6, 3, -4, 99], device=device)
    gathered = x[x_rows.clamp(0, m - 1)]
    x0, r0 = x.clone(), x_rows.clone()
    out = torch.full((6, n), float("nan"), device=device, dtype=dtype)
    got = ops.linear_int8(x, q, s, out=out, x_rows=x_rows, pdl=pdl)
    assert got.data_ptr() == out.data_ptr() and not out.isnan().any(), "every element written"
    assert torch.equal(got, ops.linear_int8(gathered, q, s, pdl=pdl))
    assert_near_reference(got, gathered, q, s)  # and the float64 reference of those rows
    parts = []
    for rows in (x_rows, None):
        val = torch.full((6, 8), float("nan"), device=device)
        idx = torch.full((6, 8), -7, dtype=torch.int32, device=device)
        src = x if rows is not None else gathered
        blocks = ops.linear_int8_partials(src, q, s, val, idx, x_rows=rows, pdl=pdl)
        parts.append((val[:, :blocks], idx[:, :blocks]))
    assert torch.equal(parts[0][0], parts[1][0]) and torch.equal(parts[0][1], parts[1][1])
    assert torch.equal(x, x0) and torch.equal(x_rows, r0)


@interp
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_x_rows_are_read_in_place(backend, dtype):
    with ops.use_backend(backend):
        check_x_rows_case("cpu", dtype, seed=3)


BAD_X_ROWS = [
    ("int32", lambda x: torch.tensor([0, 1], dtype=torch.int32), TypeError),
    ("2-D", lambda x: torch.zeros(1, 2, dtype=torch.int64), ValueError),
    ("float", lambda x: torch.zeros(2), TypeError),
    ("list", lambda x: [0, 1], TypeError),
]


@interp
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("case, make, exc", BAD_X_ROWS, ids=[b[0] for b in BAD_X_ROWS])
def test_bad_x_rows_names_it_and_writes_nothing(case, make, exc, backend):
    x, q, s = _args()
    x_rows = make(x)
    out = torch.full((2, 20), 7.0)
    val, idx = torch.full((2, 4), 7.0), torch.full((2, 4), 7, dtype=torch.int32)
    with ops.use_backend(backend):
        with pytest.raises(exc, match=r"\bx_rows\b"):
            ops.linear_int8(x, q, s, out=out, x_rows=x_rows)
        with pytest.raises(exc, match=r"\bx_rows\b"):
            ops.linear_int8_partials(x, q, s, val, idx, x_rows=x_rows)
        # rows to read from an empty x
        with pytest.raises(ValueError, match=r"\bx_rows\b"):
            ops.linear_int8(x[:0], q, s, x_rows=torch.zeros(2, dtype=torch.int64))
    assert bool((out == 7).all()) and bool((val == 7).all()) and bool((idx == 7).all())


@interp
def test_select_logits_hands_an_int8_head_its_rows():
    """select_logits gives an lm_head with takes_x_rows its row indices (no gather
    launch); the result equals the plain head on the gathered rows."""
    from types import SimpleNamespace

    from specdraft.layers import select_logits

    g = torch.Generator().manual_seed(8)
    head = Int8Linear(*kernels.quantize_rows_int8(torch.randn(50, 16, generator=g)))
    hidden = torch.randn(5, 16, generator=g)
    idx = torch.tensor([4, 1])
    seen = []
    calls = []

    def plain(x):
        calls.append(x.shape[0])
        return head(x)

    meta = SimpleNamespace(last_is_row=False)  # the rows come from logits_indices
    orig = torch.Tensor.index_select
    try:
        torch.Tensor.index_select = lambda *a, **k: seen.append(1) or orig(*a, **k)
        got = select_logits(hidden, head, meta, idx, False)
        assert not seen, "no gather"
        want = select_logits(hidden, plain, meta, idx, False)
        assert seen and calls == [2]
    finally:
        torch.Tensor.index_select = orig
    assert torch.equal(got, want) and torch.equal(got, head(hidden[idx]))


def _partials_args():
    x, q, s = _args()
    return x, q, s, torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.int32)


BAD_PARTIALS = [
    ("x int", lambda x, q, s, v, i: (x.long(), q, s, v, i), TypeError, "x"),
    ("weight not int8", lambda x, q, s, v, i: (x, q.float(), s, v, i), TypeError, "weight"),
    ("no logits", lambda x, q, s, v, i: (x, q[:0], s[:0], v, i), ValueError, "weight"),
    ("scale length", lambda x, q, s, v, i: (x, q, s[:19], v, i), ValueError, "scale"),
    ("part_val dtype", lambda x, q, s, v, i: (x, q, s, v.double(), i), TypeError, "part_val"),
    ("part_val rows", lambda x, q, s, v, i: (x, q, s, v[:1], i), ValueError, "part_val"),
    ("part_idx dtype", lambda x, q, s, v, i: (x, q, s, v, i.long()), TypeError, "part_idx"),
    ("part_idx blocks", lambda x, q, s, v, i: (x, q, s, v, i[:, :0]), ValueError, "part_idx"),
    ("part_idx stride", lambda x, q, s, v, i: (x, q, s, v, torch.zeros(2, 8, dtype=torch.int32)),
     ValueError, "part_idx"),
]  # fmt: skip


@interp
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("case, make, exc, name", BAD_PARTIALS, ids=[b[0] for b in BAD_PARTIALS])
def test_linear_int8_partials_bad_input(case, make, exc, name, backend):
    args = make(*_partials_args())
    before = [a.clone() for a in args]
    with ops.use_backend(backend), pytest.raises(exc, match=rf"\b{name}\b"):
        ops.linear_int8_partials(*args)
    assert all(torch.equal(a, b) for a, b in zip(before, args)), "nothing written"


def test_quantize_rows_int8_bounds():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(12, 33, generator=g) * torch.logspace(-3, 3, 12)[:, None]
    w[4] = 0.0
    q, s = kernels.quantize_rows_int8(w.bfloat16())
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert q.shape == (12, 33) and s.shape == (12,)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    wf = w.bfloat16().float()
    for r in range(12):
        if r == 4:
            assert float(s[r]) == 1.0 and bool((q[r] == 0).all())
            continue
        assert int(q[r].abs().max()) == 127, r  # the row's largest weight sets its scale
        # round to nearest: every weight within half a step of its dequantized value
        assert float((q[r].float() * s[r] - wf[r]).abs().max()) <= 0.5 * float(s[r]) * 1.0001
    with pytest.raises(TypeError, match="weight"):
        kernels.quantize_rows_int8(torch.ones(3, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="weight"):
        kernels.quantize_rows_int8(torch.ones(3))
    with pytest.raises(TypeError, match="weight"):
        kernels.quantize_rows_int8([[1.0, 2.0]])


def _args():
    g = torch.Generator().manual_seed(9)
    q, s = kernels.quantize_rows_int8(torch.randn(20, 16, generator=g))
    return torch.randn(2, 16, generator=g), q, s


BAD = [
    ("x 3-D", lambda x, q, s: (x[None], q, s, None), ValueError, "x"),
    ("x int", lambda x, q, s: (x.long(), q, s, None), TypeError, "x"),
    ("weight not int8", lambda x, q, s: (x, q.float(), s, None), TypeError, "weight"),
    ("weight K", lambda x, q, s: (x, q[:, :8].contiguous(), s, None), ValueError, "weight"),
    ("weight strided", lambda x, q, s: (x, q.t().contiguous().t(), s, None), ValueError, "weight"),
    ("scale dtype", lambda x, q, s: (x, q, s.double(), None), TypeError, "scale"),
    ("scale length", lambda x, q, s: (x, q, s[:19], None), ValueError, "scale"),
    ("out shape", lambda x, q, s: (x, q, s, torch.zeros(2, 19)), ValueError, "out"),
    ("out dtype", lambda x, q, s: (x, q, s, torch.zeros(2, 20, dtype=torch.float16)), TypeError,
     "out"),
]  # fmt: skip


@interp
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("case, make, exc, name", BAD, ids=[b[0] for b in BAD])
def test_bad_input_names_the_argument_and_writes_nothing(case, make, exc, name, backend):
    x, q, s, out = make(*_args())
    out = torch.full((2, 20), 7.0) if out is None and case != "out shape" else out
    before = [t.clone() for t in (x, q, s, out) if t is not None]
    with ops.use_backend(backend), pytest.raises(exc, match=rf"\b{name}\b"):
        ops.linear_int8(x, q, s, out=out)
    after = [t for t in (x, q, s, out) if t is not None]
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "nothing written"


def test_int8_linear_keeps_its_types_through_to():
    """Module.to(dtype) on a draft must not round the scales or touch the int8 weights."""
    g = torch.Generator().manual_seed(1)
    lin = Int8Linear(*kernels.quantize_rows_int8(torch.randn(10, 8, generator=g)))
    w, s = lin.weight.clone(), lin.scale.clone()
    lin.to(torch.float16)
    assert lin.weight.dtype == torch.int8 and torch.equal(lin.weight, w)
    assert lin.scale.dtype == torch.float32 and torch.equal(lin.scale, s)
    assert not lin.weight.requires_grad and not lin.scale.requires_grad


def test_int8_linear_refuses_what_it_cannot_copy():
    lin = Linear(8, 6, bias=True, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="bias"):
        Int8Linear.from_linear(lin)
    with pytest.raises(TypeError, match="linear"):
        Int8Linear.from_linear(torch.nn.Linear(8, 6, bias=False))
    with pytest.raises(TypeError, match="lm_head"):
        quantize_lm_head(torch.nn.Module())
    # a model whose lm_head is not a specdraft Linear is refused and left as it was
    model = torch.nn.Module()
    model.lm_head = torch.nn.Linear(8, 6, bias=False)
    head, before = model.lm_head, model.lm_head.weight.detach().clone()
    with pytest.raises(TypeError, match="lm_head"):
        quantize_lm_head(model)
    assert model.lm_head is head and torch.equal(head.weight, before)


# ---- a draft with an int8 lm_head ---------------------------------------------------------


@interp
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_quantize_lm_head_copies_the_heads_lm_head(kind):
    """The head gets an Int8Linear within half a step of its lm_head; quantizing again
    changes nothing; the target's lm_head (EAGLE-1 shares it) is left as it was."""
    pytest.importorskip("transformers")
    from tests.drafter_helpers import make_setup

    s = make_setup(kind, seed=3)
    orig = s.model.lm_head
    before = orig.weight.clone()
    assert quantize_lm_head(s.model) is s.model
    head = s.model.lm_head
    assert isinstance(head, Int8Linear) and quantize_lm_head(s.model).lm_head is head
    assert torch.equal(orig.weight, before)
    if kind == "eagle":
        assert s.target.lm_head is orig
    deq = head.weight.float() * head.scale[:, None]
    assert float((deq - before.float()).abs().max()) <= 0.5001 * float(head.scale.max())
    x = torch.randn(3, orig.in_features)
    with ops.use_backend("torch"):
        assert torch.allclose(head(x), x @ deq.T, rtol=1e-5, atol=1e-5)


@interp
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("kind", ["eagle", "eagle3", "eagle_vocab"])
def test_greedy_rounds_with_an_int8_lm_head_match_its_reference(kind, backend, monkeypatch):
    """Ragged batches, mixed accepted counts and k, K_max 3 and 1, as test_drafter's
    greedy test, with the head's lm_head an Int8Linear of random weights (far from the
    float one, so a round that still read the float lm_head would show): the drafts are
    the greedy tokens of a float64 reference whose lm_head is those weights dequantized,
    and they differ from the float lm_head's somewhere. Every step leaves its argmax as
    partials (no argmax of logits) that advance / the epilogue finish."""
    pytest.importorskip("transformers")
    from tests.drafter_helpers import EngineSim, drafter, make_setup
    from tests.model_helpers import RefEagle
    from tests.test_drafter import check_round

    s = make_setup(kind, seed=3)
    float_ref = s.ref
    g = torch.Generator().manual_seed(11)
    v, h = s.model.lm_head.out_features, s.model.lm_head.in_features
    q = torch.randint(-127, 128, (v, h), generator=g).to(torch.int8)
    scale = torch.rand(v, generator=g) / 64 + 1 / 256
    s.model.lm_head = Int8Linear(q, scale)
    deq = q.double() * scale.double()[:, None]
    embed = s.target.embed_tokens.weight if kind != "eagle3" else s.weights["embed_tokens.weight"]
    s.ref = lambda: RefEagle(s.weights, s.cfg, embed, deq, eagle3=kind == "eagle3")

    def float_greedy(tokens, hiddens, steps: int) -> list[int]:
        saved, s.ref = s.ref, float_ref
        try:
            return s.ref_greedy(tokens, hiddens, steps)
        finally:
            s.ref = saved

    calls = {"partials": 0, "argmax": 0}

    def spy(name, fn):
        def wrapped(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)

        return wrapped

    monkeypatch.setattr(ops, "linear_int8_partials", spy("partials", ops.linear_int8_partials))
    monkeypatch.setattr(ops, "argmax", spy("argmax", ops.argmax))
    differ = 0
    with ops.use_backend(backend):
        d = drafter(s)
        sim = EngineSim(s, d, seed=1)
        rids = [sim.join(n) for n in (7, 2, 5)]
        for ks, k_max, width in [((3, 1, 0), 3, 4), ((2, 3, 3), 3, 3), ((1, 0, 1), 1, 4)]:
            for r in rids:
                sq = sim.seqs[r]
                sq.verified = sq.verified[:width]
            ver, acc, hid = sim.inputs(rids, width)
            out = d.propose(rids, ver, acc, target_hidden=hid, k=list(ks), k_max=k_max)
            check_round(sim, rids, out.tokens, ks)
            for i, (r, k) in enumerate(zip(rids, ks)):
                differ += float_greedy(*sim.context(r), k) != out.tokens[i].tolist()[:k]
            sim.commit(rids)
    assert differ > 0, "the int8 weights gave the float lm_head's drafts everywhere"
    assert calls["partials"] > 0 and calls["argmax"] == 0, calls


@interp
@pytest.mark.parametrize("kind", ["llama", "eagle", "eagle3", "eagle_vocab"])
def test_greedy_rounds_finishing_the_argmax_from_parts_equal_the_argmax_of_logits(kind):
    """The same engine history through two drafters over one int8 lm_head: one finishes
    each step's argmax from partials in advance / the epilogue, the other (partials
    switched off) writes the logits and takes ops.argmax. The same tokens, every round;
    a Llama-style draft too."""
    pytest.importorskip("transformers")
    from tests.drafter_helpers import EngineSim, drafter, make_setup

    s = make_setup(kind, seed=4)
    g = torch.Generator().manual_seed(12)
    v, h = s.model.lm_head.out_features, s.model.lm_head.in_features
    q = torch.randint(-127, 128, (v, h), generator=g).to(torch.int8)
    s.model.lm_head = Int8Linear(q, torch.rand(v, generator=g) / 64 + 1 / 256)
    runs = []
    for fold in (True, False):
        d = drafter(s)
        assert d.loop._part_val is not None
        if not fold:
            d.loop._part_val = d.loop._part_idx = None
        sim = EngineSim(s, d, seed=2)
        rids = [sim.join(n) for n in (6, 3, 4)]
        tokens = []
        for ks, k_max, width in [((3, 2, 1), 3, 4), ((0, 3, 3), 3, 2), ((1, 1, 0), 1, 3)]:
            for r in rids:
                sim.seqs[r].verified = sim.seqs[r].verified[:width]
            ver, acc, hid = sim.inputs(rids, width)
            out = d.propose(rids, ver, acc, target_hidden=hid, k=list(ks), k_max=k_max)
            tokens.append(out.tokens.clone())
            sim.commit(rids)
        runs.append(tokens)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


# ---- GPU -------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pdl", [False, True])
def test_gpu_linear_int8_matches_float64(dtype, pdl):
    # SmolLM2's lm_head at draft-step rows (16-row tiles, one 64-row tile), a Llama-3-8B-
    # wide K (256-wide steps), ragged N
    for m, k, n in ((1, 576, 49152), (4, 576, 49152), (3, 4096, 2048), (33, 576, 1000),
                    (64, 576, 49152)):  # fmt: skip
        check_case("cuda", dtype, m, k, n, pdl=pdl, seed=m + k + n)


@gpu
def test_gpu_linear_int8_graph_replay_equals_eager():
    g = torch.Generator(device="cuda").manual_seed(4)
    q, s = kernels.quantize_rows_int8(torch.randn(49152, 576, device="cuda", generator=g))
    x = torch.randn(3, 576, device="cuda", generator=g).bfloat16()
    out = torch.empty(3, 49152, device="cuda", dtype=torch.bfloat16)
    kernels.linear_int8(x, q, s, out=out, pdl=True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.linear_int8(x, q, s, out=out, pdl=True)
    for _ in range(3):
        x.copy_(torch.randn(3, 576, device="cuda", generator=g))
        out.fill_(float("nan"))
        graph.replay()
        eager = kernels.linear_int8(x, q, s, pdl=True)
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pdl", [False, True])
def test_gpu_linear_int8_partials_reduce_to_the_argmax(dtype, pdl):
    # SmolLM2's lm_head at draft-step rows, a 64-row tile, a Llama-3-wide K; ties
    for i, (m, k, n) in enumerate(((1, 576, 49152), (4, 576, 49152), (64, 576, 49152),
                                   (3, 4096, 2048))):  # fmt: skip
        check_partials_case("cuda", dtype, m, k, n, pdl=pdl, seed=i)
    check_partials_case("cuda", dtype, 8, 576, 49152, ties=True, pdl=pdl, seed=9)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pdl", [False, True])
def test_gpu_act_int8_matches_its_float64_definition(dtype, pdl):
    for i, (m, k, n) in enumerate(((1, 576, 49152), (8, 576, 49152), (64, 576, 49152),
                                   (3, 4096, 2048), (2, 20, 40))):  # fmt: skip
        check_a8_case("cuda", dtype, m, k, n, seed=80 + i, pdl=pdl)
    check_a8_case("cuda", dtype, 4, 576, 1000, seed=90, gather=True, pdl=pdl)


def check_a8_ties(device, dtype, m, k, *, seed=49):
    """x_q read back through an identity weight (127 I, scale 1/127: y = x_q * s_x). The
    ties are products x * r_x that round to a half in float32 while the exact product
    does not: stop 49 found the kernel rounding those by the exact product (an FMA)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(m, k, device=device, generator=g) * 3).to(dtype)
    q = torch.eye(k, dtype=torch.int8, device=device) * 127
    s = torch.full((k,), 1.0 / 127, device=device)  # a scale an output column
    out = torch.full((m, k), float("nan"), device=device)
    kernels.linear_int8(x.float(), q, s, out=out, act_int8=True)
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)
    sx = (amax.double() / 127.0).float()
    rx = (amax.new_full((), 127.0).double() / amax.double()).float()
    v = xf * rx
    ties = (v - v.floor() == 0.5) & ((xf.double() * rx.double()) != v.double())
    assert int(ties.sum()) >= 10, "the inputs must hold float32 ties"
    got = torch.round(out.double() / sx.double())  # y = (127 x_q) * s_x / 127
    want = torch.round(v).clamp(-127, 127).double()
    assert torch.equal(got, want), int((got != want).sum())


@interp
def test_act_int8_rounds_the_float32_product_ties_to_even():
    # the interpreter has no FMA to round by: this runs the check itself (stop 51: its
    # GPU copy first failed on the scale's shape)
    check_a8_ties("cpu", torch.float16, 48, 2048)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_act_int8_rounds_the_float32_product_ties_to_even(dtype):
    check_a8_ties("cuda", dtype, 64, 4096)


@gpu
@pytest.mark.parametrize("pdl", [False, True])
def test_gpu_x_rows_are_read_in_place(pdl):
    check_x_rows_case("cuda", torch.bfloat16, pdl=pdl, seed=5)
