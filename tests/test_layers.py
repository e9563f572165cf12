"""Fused element-wise kernels (RMSNorm + residual, SiLU-and-multiply, rotary) against
PyTorch references, the rotary tables against transformers, and launcher errors."""

from __future__ import annotations

import pytest
import torch

from specdraft.kernels import (
    apply_rotary,
    argmax_rows,
    embed_concat,
    embed_fc,
    embed_rows,
    fused_linear,
    linear_small_m,
    resolve_fed_ids,
    rms_norm,
    silu_and_mul,
)
from specdraft.layers import cos_sin_table, rope_inv_freq
from specdraft.models.config import DecoderConfig, RopeConfig, UnsupportedModelError

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def ref_rms(x, w, eps):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * y.to(x.dtype)  # transformers' LlamaRMSNorm rounding


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows, hidden", [(1, 6), (7, 42), (5, 123)])
def test_rms_norm(device, dtype, rows, hidden):
    x = torch.randn(rows, hidden, device=device).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    y = rms_norm(x, w, 1e-5, out=torch.full_like(x, float("nan")))
    torch.testing.assert_close(y, ref_rms(x, w, 1e-5), atol=TOL[dtype], rtol=TOL[dtype])

    res = torch.randn(rows, hidden, device=device).to(dtype)
    res0, x0 = res.clone(), x.clone()
    y, r = rms_norm(x, w, 1e-6, residual=res)
    s = (x0.float() + res0.float()).to(dtype)
    assert r is res and torch.equal(res, s), "the residual sum is written in place"
    torch.testing.assert_close(y, ref_rms(s, w, 1e-6), atol=TOL[dtype], rtol=TOL[dtype])

    # a separate residual_out leaves the input residual untouched; out may alias x
    res = res0.clone()
    r_out = torch.full_like(x, float("nan"))
    y, r = rms_norm(x0.clone(), w, 1e-6, residual=res, residual_out=r_out)
    assert torch.equal(res, res0) and torch.equal(r_out, s)
    xi = x0.clone()
    rms_norm(xi, w, 1e-5, out=xi)
    torch.testing.assert_close(xi, ref_rms(x0, w, 1e-5), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows, n", [(1, 5), (6, 42), (3, 2500)])
def test_silu_and_mul(device, dtype, rows, n):
    x = (3 * torch.randn(rows, 2 * n, device=device)).to(dtype)
    x[0, 0] = -200.0  # exp overflow must not produce NaN
    out = silu_and_mul(x, out=torch.full((rows, n), float("nan"), device=device, dtype=dtype))
    ref = torch.nn.functional.silu(x[:, :n].float()).to(dtype) * x[:, n:]
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows, n", [(1, 1), (1, 7), (5, 1000), (3, 3001)])
def test_argmax_rows_first_index_of_the_maximum(device, dtype, rows, n):
    """Fresh random rows; planted ties (the maximum repeated in another vocabulary block:
    the first index wins), -inf entries and a row of equal values; every output element
    written (poisoned first)."""
    x = torch.randn(rows, n, device=device).to(dtype)
    if n > 1:
        x[0, n // 3] = -float("inf")
        top = x[-1].float().max() + 1
        x[-1, n - 1] = top  # tie across blocks: the earlier index must win
        x[-1, n // 2] = top
    if rows > 2:
        x[1] = 0.25  # all equal: index 0
    out = torch.full((rows,), -7, dtype=torch.int64, device=device)
    got = argmax_rows(x, out=out)
    assert got is out
    want = x.float().argmax(dim=-1)
    assert torch.equal(got, want), (got, want)
    wide = torch.randn(rows, n + 5, device=device).to(dtype)[:, 2 : n + 2]  # row stride n + 5
    assert torch.equal(argmax_rows(wide), wide.float().argmax(dim=-1))
    if n > 1:  # NaN ranks as the maximum, as in torch: an all-NaN row gives 0
        x[0] = float("nan")
        x[-1, n // 4] = float("nan")
        assert torch.equal(argmax_rows(x), x.float().argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows, n", [(1, 7), (5, 1000), (3, 3001)])
def test_argmax_rows_one_launch_into_a_column_through_an_id_map(device, dtype, rows, n):
    """With tickets: one launch whose last block per row writes the token into a strided
    column, mapped through offsets (EAGLE-3's d2t), and leaves the tickets zero; called
    twice on fresh rows (a stale ticket would skip or double a row's combine). The rest
    of the table is untouched."""
    tickets = torch.zeros(rows + 3, dtype=torch.int32, device=device)
    offsets = torch.randint(0, 50_000, (n,), device=device)
    for call in range(2):
        x = torch.randn(rows, n, device=device).to(dtype)
        top = x[-1].float().max() + 1
        x[-1, n - 1] = x[-1, n // 2] = top  # tie across blocks: the earlier index wins
        table = torch.full((rows, 4), -7, dtype=torch.int64, device=device)
        col = table[:, 2]
        # the second call with programmatic dependent launch (on the GPU)
        got = argmax_rows(x, out=col, tickets=tickets, offsets=None if call else offsets,
                          pdl=call == 1)  # fmt: skip
        want = x.float().argmax(dim=-1)
        if not call:
            want = want + offsets[want]
        assert got is col and torch.equal(table[:, 2], want), (call, table, want)
        assert bool((table[:, [0, 1, 3]] == -7).all())
        assert int(tickets.abs().sum()) == 0


def test_argmax_rows_one_launch_bad_inputs(device):
    """Bad tickets / offsets: a ValueError or TypeError naming them, the output untouched."""
    x = torch.randn(3, 40, device=device)
    out = torch.full((3,), -7, dtype=torch.int64, device=device)
    zeros = torch.zeros(3, dtype=torch.int32, device=device)
    bad = [
        (TypeError, "tickets", dict(tickets=zeros.long())),
        (ValueError, "tickets", dict(tickets=zeros[:2])),
        (ValueError, "tickets", dict(tickets=torch.zeros_like(zeros).repeat(2)[::2])),
        (TypeError, "offsets", dict(tickets=zeros, offsets=torch.zeros(40, device=device))),
        (
            ValueError,
            "offsets",
            dict(tickets=zeros, offsets=torch.zeros(39, dtype=torch.int64, device=device)),
        ),  # fmt: skip
        (ValueError, "offsets", dict(offsets=torch.zeros(40, dtype=torch.int64, device=device))),
        (ValueError, "out", dict(out=torch.zeros(3, 2, dtype=torch.int64, device=device)[:, 0])),
    ]
    for exc, name, kw in bad:
        kw.setdefault("out", out)
        with pytest.raises(exc, match=name):
            argmax_rows(x, **kw)
        assert bool((out == -7).all()) and int(zeros.abs().sum()) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n, e, h", [(1, 8, 8), (5, 24, 40), (3, 576, 576)])
def test_embed_concat_is_embedding_then_hidden(device, dtype, n, e, h):
    """Fresh rows; the output poisoned first; bit-equal to torch's gather + cat, from a
    strided hidden view (an EAGLE round's carried state is a slice)."""
    table = torch.randn(50, e, device=device).to(dtype)
    ids = torch.randint(0, 50, (n,), device=device)
    wide = torch.randn(n, h + 3, device=device).to(dtype)
    hidden = wide[:, 1 : h + 1]
    out = torch.full((n, e + h), float("nan"), device=device, dtype=dtype)
    got = embed_concat(ids, table, hidden, out=out)
    assert got is out
    assert torch.equal(got, torch.cat([table[ids], hidden], dim=-1))
    assert torch.equal(embed_concat(ids.int(), table, hidden), got)


def test_embed_concat_bad_inputs(device):
    """A TypeError / ValueError naming the argument; out untouched."""
    table = torch.randn(10, 4, device=device)
    ids = torch.tensor([1, 2], device=device)
    hidden = torch.randn(2, 6, device=device)
    out = torch.full((2, 10), -7.0, device=device)
    bad = [
        (TypeError, "ids", dict(ids=ids.float())),
        (ValueError, "hidden", dict(hidden=hidden[:1])),
        (TypeError, "hidden", dict(hidden=hidden.half())),
        (ValueError, "out", dict(out=torch.zeros(2, 9, device=device))),
        (TypeError, "out", dict(out=torch.zeros(2, 10, device=device, dtype=torch.float16))),
        (ValueError, "table", dict(table=table[:0])),
    ]
    for exc, name, kw in bad:
        args = dict(ids=ids, table=table, hidden=hidden, out=out)
        args.update(kw)
        with pytest.raises(exc, match=name):
            embed_concat(args["ids"], args["table"], args["hidden"], out=args["out"])
        assert bool((out == -7.0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n, e", [(1, 8), (5, 40), (3, 576), (70, 24)])
def test_embed_rows_is_the_table_gather(device, dtype, n, e):
    """Fresh rows; the output poisoned first; bit-equal to F.embedding for int64 and
    int32 ids, and to ops' PyTorch backend; 70 rows span two programs under the
    interpreter; ids outside the table read its nearest row (the models check ids
    first)."""
    from specdraft import ops

    table = torch.randn(50, e, device=device).to(dtype)
    ids = torch.randint(0, 50, (n,), device=device)
    out = torch.full((n, e), float("nan"), device=device, dtype=dtype)
    got = embed_rows(ids, table, out=out)
    assert got is out
    want = torch.nn.functional.embedding(ids, table)
    assert torch.equal(got, want)
    assert torch.equal(embed_rows(ids.int(), table), want)
    with ops.use_backend("torch"):
        assert torch.equal(ops.embed_rows(ids, table), want)
    edge = torch.tensor([-3, 50, 7], device=device)
    assert torch.equal(embed_rows(edge, table), table[[0, 49, 7]])
    assert embed_rows(ids[:0], table).shape == (0, e)


def test_embed_rows_bad_inputs(device):
    """A TypeError / ValueError naming the argument; out untouched (both backends
    refuse alike)."""
    from specdraft import ops

    table = torch.randn(10, 4, device=device)
    ids = torch.tensor([1, 2], device=device)
    out = torch.full((2, 4), -7.0, device=device)
    bad = [
        (TypeError, "ids", dict(ids=ids.float())),
        (ValueError, "ids", dict(ids=ids.view(2, 1))),
        (TypeError, "table", dict(table=table.int())),
        (ValueError, "table", dict(table=table[:0])),
        (ValueError, "table", dict(table=table.t().contiguous().t())),
        (ValueError, "out", dict(out=torch.zeros(2, 5, device=device))),
        (TypeError, "out", dict(out=torch.zeros(2, 4, device=device, dtype=torch.float16))),
    ]
    for exc, name, kw in bad:
        args = dict(ids=ids, table=table, out=out)
        args.update(kw)
        with pytest.raises(exc, match=name):
            embed_rows(args["ids"], args["table"], out=args["out"])
        assert bool((out == -7.0).all())
        if "out" not in kw:
            with ops.use_backend("torch"), pytest.raises(exc, match=name):
                ops.embed_rows(args["ids"], args["table"])


@pytest.mark.gpu
def test_gpu_embed_rows_with_pdl_under_a_graph():
    """bf16, PDL on where the GPU has it: eager and graph replay (fresh ids copied in
    before each replay) bit-equal to the gather, every row written."""
    from specdraft import kernels

    pdl = kernels.pdl_supported("cuda")
    table = torch.randn(49152, 576, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 49152, (4,), device="cuda")
    out = torch.full((4, 576), float("nan"), device="cuda", dtype=torch.bfloat16)
    assert torch.equal(embed_rows(ids, table, out=out, pdl=pdl), table[ids])
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        embed_rows(ids, table, out=out, pdl=pdl)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in range(3):
        ids.copy_(torch.randint(0, 49152, (4,), generator=torch.Generator().manual_seed(seed)))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, table[ids]), seed


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n, e, h, out_f, bias", [(1, 8, 8, 16, True), (4, 24, 40, 70, False),
                                                   (8, 576, 576, 64, True)])  # fmt: skip
def test_embed_fc_is_embed_concat_then_fused_linear(device, dtype, n, e, h, out_f, bias):
    """Fresh inputs; hidden rows gathered through hidden_rows (repeats, any order) or
    taken in order, from a strided table: bit-equal to embed_concat of the gathered rows
    then fused_linear (the same tiles) in fp16 (float32: within its rounding), and within
    the dtype's rounding of float64."""
    table = torch.randn(50, e, device=device).to(dtype)
    ids = torch.randint(0, 50, (n,), device=device)
    hid = torch.randn(n + 3, h + 2, device=device).to(dtype)[:, 1 : h + 1]
    w = torch.randn(out_f, e + h, device=device).to(dtype) / (e + h) ** 0.5
    b = torch.randn(out_f, device=device).to(dtype) if bias else None
    for rows in (torch.randint(0, n + 3, (n,), device=device), None):
        src = hid[:n] if rows is None else hid[rows]
        got = embed_fc(ids, table, hid[:n] if rows is None else hid, w, b, hidden_rows=rows)
        x = embed_concat(ids, table, src)
        fused = fused_linear(x, w, bias=b)
        if dtype == torch.float32:  # products rounded, so contraction into FMAs may differ
            torch.testing.assert_close(got, fused, atol=1e-5, rtol=1e-5)
        else:  # 16-bit products are exact in float32: the same sums, the same bits
            assert torch.equal(got, fused)
        ref = x.double() @ w.double().T + (0 if b is None else b.double())
        torch.testing.assert_close(got.double(), ref, atol=TOL[dtype] * 10, rtol=TOL[dtype] * 10)


@pytest.mark.gpu
def test_gpu_embed_fc_bf16_bit_equal_to_the_unfused_chain():
    """SmolLM2-shaped EAGLE-1 fc (E = H = 576, N 576) in bf16: embed_fc equals
    embed_concat then fused_linear bit for bit at 1 to 8 rows, gathered or not."""
    table = torch.randn(49152, 576, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(576, 1152, device="cuda", dtype=torch.bfloat16) / 34
    b = torch.randn(576, device="cuda", dtype=torch.bfloat16)
    for n in (1, 3, 8):
        ids = torch.randint(0, 49152, (n,), device="cuda")
        hid = torch.randn(n + 4, 576, device="cuda", dtype=torch.bfloat16)
        rows = torch.randint(0, n + 4, (n,), device="cuda")
        got = embed_fc(ids, table, hid, w, b, hidden_rows=rows, pdl=True)
        assert torch.equal(got, fused_linear(embed_concat(ids, table, hid[rows]), w, bias=b))
        got = embed_fc(ids, table, hid[:n], w, None)
        assert torch.equal(got, fused_linear(embed_concat(ids, table, hid[:n]), w))


def test_embed_fc_bad_inputs(device):
    """A TypeError / ValueError naming the argument; nothing written (the output is
    fresh, so a refusal leaves every input as it was)."""
    table = torch.randn(10, 4, device=device)
    ids = torch.tensor([1, 2], device=device)
    hidden = torch.randn(3, 6, device=device)
    w = torch.randn(5, 10, device=device)
    rows = torch.tensor([2, 0], device=device)
    bad = [
        (TypeError, "ids", dict(ids=ids.float())),
        (TypeError, "hidden", dict(hidden=hidden.half())),
        (ValueError, "weight", dict(w=torch.randn(5, 9, device=device))),
        (ValueError, "9 ids", dict(ids=torch.ones(9, dtype=torch.int64, device=device),
                                   rows=torch.zeros(9, dtype=torch.int64, device=device))),
        (TypeError, "hidden_rows", dict(rows=rows.int())),
        (ValueError, "hidden_rows", dict(rows=rows[:1])),
        (ValueError, "hidden has 3 rows", dict(rows=None)),
        (TypeError, "bias", dict(b=torch.zeros(5, dtype=torch.float16, device=device))),
        (ValueError, "bias", dict(b=torch.zeros(4, device=device))),
        (ValueError, "table", dict(table=table[:0])),
    ]  # fmt: skip
    before = [t.clone() for t in (table, ids, hidden, w, rows)]
    for exc, name, kw in bad:
        args = dict(ids=ids, table=table, hidden=hidden, w=w, b=None, rows=rows)
        args.update(kw)
        with pytest.raises(exc, match=name):
            embed_fc(args["ids"], args["table"], args["hidden"], args["w"], args["b"],
                     hidden_rows=args["rows"])  # fmt: skip
        for t, b in zip((table, ids, hidden, w, rows), before):
            assert torch.equal(t, b)


@pytest.mark.parametrize("n", [1, 7, 1500])
def test_resolve_fed_ids_replaces_fed_entries_only(device, n):
    """Fresh ids, a third device-fed (-(row + 1)); the output poisoned first; equal to
    the torch expression the runner used, and to ops' torch backend; a fed row past the
    table reads its last row."""
    from specdraft import ops, torch_ops

    g = torch.Generator().manual_seed(n)
    rows = 9
    last = torch.randint(0, 50000, (rows,), generator=g).to(device)
    ids = torch.randint(0, 50000, (n,), generator=g)
    fed = torch.rand(n, generator=g) < 0.34
    ids[fed] = -1 - torch.randint(0, rows, (int(fed.sum()),), generator=g)
    ids = ids.to(device)
    out = torch.full((n,), -99, dtype=torch.int64, device=device)
    got = resolve_fed_ids(ids, last, out=out)
    assert got is out
    want = torch.where(ids < 0, last[(-1 - ids).clamp(min=0)], ids)
    assert torch.equal(got, want)
    assert torch.equal(torch_ops.resolve_fed_ids(ids, last), want)
    with ops.use_backend("torch"):
        assert torch.equal(ops.resolve_fed_ids(ids, last), want)
    past = torch.tensor([-1 - rows, -50, 3], device=device)
    assert resolve_fed_ids(past, last).tolist() == [last[-1].item(), last[-1].item(), 3]


def test_resolve_fed_ids_bad_inputs(device):
    """A TypeError / ValueError naming the argument; out untouched."""
    ids = torch.tensor([1, -2], device=device)
    last = torch.tensor([5, 6, 7], device=device)
    out = torch.full((2,), -7, dtype=torch.int64, device=device)
    bad = [
        (TypeError, "ids", dict(ids=ids.int())),
        (ValueError, "ids", dict(ids=ids.view(2, 1))),
        (TypeError, "last_token", dict(last_token=last.float())),
        (ValueError, "last_token", dict(last_token=last[:0])),
        (ValueError, "out", dict(out=torch.zeros(3, dtype=torch.int64, device=device))),
        (TypeError, "out", dict(out=torch.zeros(2, dtype=torch.int32, device=device))),
    ]
    for exc, name, kw in bad:
        args = dict(ids=ids, last_token=last, out=out)
        args.update(kw)
        with pytest.raises(exc, match=name):
            resolve_fed_ids(args["ids"], args["last_token"], out=args["out"])
        assert bool((out == -7).all())


@pytest.mark.gpu
def test_gpu_argmax_rows_bf16_vocab_49152():
    for rows in (1, 4, 64):
        x = torch.randn(rows, 49152, device="cuda", dtype=torch.bfloat16) * 4
        x[0, 40000] = x[0, 30000] = x[0].max() + 1  # a tie: 30000 wins
        got = argmax_rows(x)
        assert torch.equal(got, x.argmax(dim=-1)) and int(got[0]) == 30000


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, n, k, bias", [(1, 40, 24, False), (3, 70, 300, True),
                                           (16, 33, 17, False), (5, 130, 64, True)])  # fmt: skip
def test_linear_small_m_against_float64(device, dtype, m, n, k, bias):
    """Fresh random inputs; the output poisoned first; compared with the float64
    product, within the rounding of the dtype (fp32: ieee products)."""
    x = torch.randn(m, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    out = torch.full((m, n), float("nan"), device=device, dtype=dtype)
    got = linear_small_m(x, w, b, out=out)
    assert got is out and torch.isfinite(out).all()
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol * 4, rtol=tol)
    view = torch.randn(m, k + 8, device=device).to(dtype)[:, 4 : k + 4]  # row stride k + 8
    ref = view.double() @ w.double().T + (b.double() if bias else 0)
    torch.testing.assert_close(linear_small_m(view, w, b).double(), ref, atol=tol * 4, rtol=tol)


def test_ops_linear_switch(device):
    """ops.linear: F.linear unless the small-M kernel is switched on; then the kernel for
    up to 16 rows and F.linear past that; the same result either way."""
    from specdraft import ops

    w = torch.randn(24, 32, device=device)
    for m in (1, 16, 17):
        x = torch.randn(m, 32, device=device)
        want = torch.nn.functional.linear(x, w)
        try:
            ops.set_small_m_linear(True)
            got = ops.linear(x, w, None)
        finally:
            ops.set_small_m_linear(False)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="enabled"):
        ops.set_small_m_linear(1)


@pytest.mark.gpu
def test_gpu_linear_small_m_bf16_error_within_torchs():
    """bf16 at SmolLM2 and Llama-3-8B shapes: the error against the float32 product is
    within twice what cuBLAS's own bf16 result has."""
    for m, n, k in ((1, 960, 576), (4, 3072, 576), (16, 576, 1536), (1, 6144, 4096)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
        ref = x.float() @ w.float().T
        ours = (linear_small_m(x, w).float() - ref).abs().max()
        theirs = (torch.nn.functional.linear(x, w).float() - ref).abs().max()
        assert ours <= 2 * theirs + 1e-3, (m, n, k, float(ours), float(theirs))


def ref_rotary(x, pos, table):
    half = table.shape[1] // 2
    cos, sin = table[pos, :half][:, None], table[pos, half:][:, None]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hq, hkv, d", [(4, 2, 16), (6, 1, 24), (3, 3, 8)])
def test_rotary_on_fused_qkv_views(device, dtype, hq, hkv, d):
    n, max_pos = 9, 40
    table = cos_sin_table(d, RopeConfig(theta=100.0), max_pos, device)
    qkv = torch.randn(n, (hq + 2 * hkv) * d, device=device).to(dtype)
    q = qkv[:, : hq * d].view(n, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(n, hkv, d)
    v_before = qkv[:, (hq + hkv) * d :].clone()
    pos = torch.randint(0, max_pos, (n + 3,), device=device)
    pos[2] = 1000  # clamped to the last row
    ref_q = ref_rotary(q, pos[:n].clamp(max=max_pos - 1), table)
    ref_k = ref_rotary(k, pos[:n].clamp(max=max_pos - 1), table)
    apply_rotary(q, k, pos, table)
    torch.testing.assert_close(q, ref_q, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(k, ref_k, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(qkv[:, (hq + hkv) * d :], v_before), "v is not touched"


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ],
)
def test_rope_frequencies_match_transformers(scaling):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_cfg = dict(
        hidden_size=128, num_attention_heads=4, head_dim=32, rope_theta=5000.0, rope_scaling=scaling
    )
    ours = RopeConfig.from_hf(hf_cfg)
    hf = LlamaRotaryEmbedding(config=transformers.LlamaConfig(**hf_cfg))
    torch.testing.assert_close(rope_inv_freq(32, ours), hf.inv_freq.float(), rtol=1e-6, atol=0)
    # and the same spelling through to_hf / transformers 5.x rope_parameters
    assert RopeConfig.from_hf(ours.to_hf()) == ours
    params = {"rope_theta": 5000.0, **(scaling or {"rope_type": "default"})}
    assert RopeConfig.from_hf({"rope_parameters": params}) == ours


def test_rope_config_errors():
    with pytest.raises(UnsupportedModelError, match="'yarn' is not supported.*llama3"):
        RopeConfig.from_hf({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="head_dim must be even"):
        DecoderConfig(100, 30, 64, 1, 2, 2, head_dim=15)


def test_launcher_errors(device):
    x = torch.randn(4, 8, device=device)
    w = torch.ones(8, device=device)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(7, device=device), 1e-5)
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, w, 0.0)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, w, 1e-5, residual=torch.randn(3, 8, device=device))
    with pytest.raises(TypeError, match="x must have dtype"):
        rms_norm(x.long(), w, 1e-5)
    with pytest.raises(ValueError, match="even last dimension"):
        silu_and_mul(torch.randn(2, 5, device=device))
    with pytest.raises(ValueError, match="out"):
        silu_and_mul(x, out=torch.empty(4, 8, device=device))
    q, k = torch.randn(3, 2, 8, device=device), torch.randn(3, 1, 8, device=device)
    table = torch.randn(10, 8, device=device)
    pos = torch.zeros(3, dtype=torch.int64, device=device)
    with pytest.raises(TypeError, match="positions"):
        apply_rotary(q, k, pos.int(), table)
    with pytest.raises(ValueError, match="positions has 2 entries"):
        apply_rotary(q, k, pos[:2], table)
    with pytest.raises(ValueError, match="cos_sin_cache has 10 columns"):
        apply_rotary(q, k, pos, torch.randn(10, 10, device=device))
    with pytest.raises(ValueError, match="k has shape"):
        apply_rotary(q, torch.randn(2, 1, 8, device=device), pos, table)


@pytest.mark.gpu
def test_gpu_kernels_bf16_at_model_sizes():
    tol = dict(atol=2e-2, rtol=2e-2)
    for rows, hidden in [(64, 4096), (3, 8192), (1, 768)]:
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        res = torch.randn_like(x)
        w = (1 + 0.1 * torch.randn(hidden, device="cuda")).bfloat16()
        s = (x.float() + res.float()).bfloat16()
        y, r = rms_norm(x, w, 1e-5, residual=res)
        assert torch.equal(r, s)
        torch.testing.assert_close(y, ref_rms(s, w, 1e-5), **tol)
    x = 3 * torch.randn(64, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.functional.silu(x[:, :14336].float()).bfloat16() * x[:, 14336:]
    torch.testing.assert_close(silu_and_mul(x), ref, **tol)
    table = cos_sin_table(128, RopeConfig(theta=500000.0), 8192, "cuda")
    qkv = torch.randn(64, 48 * 128, device="cuda", dtype=torch.bfloat16)
    q, k = qkv[:, : 32 * 128].view(64, 32, 128), qkv[:, 32 * 128 : 40 * 128].view(64, 8, 128)
    pos = torch.randint(0, 8192, (64,), device="cuda")
    ref_q, ref_k = ref_rotary(q, pos, table), ref_rotary(k, pos, table)
    apply_rotary(q, k, pos, table)
    torch.testing.assert_close(q, ref_q, **tol)
    torch.testing.assert_close(k, ref_k, **tol)
