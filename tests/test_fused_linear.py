"""The fused decode projection (kernels.fused_linear) against a float64 reference of the
unfused ops it replaces (RMSNorm, SiLU-and-multiply, GEMM, bias, residual add); bad
inputs; and the fused decode path of a whole model against the unfused one.

CPU runs use the Triton interpreter in fp32 / fp16; tests marked gpu run bf16 at SmolLM2
and Llama shapes, with programmatic dependent launch, eagerly and under a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from specdraft import kernels, ops
from specdraft.kernels import fused_linear
from specdraft.kernels.fused_linear import MAX_ROWS, MMA_FUSED_ROWS
from specdraft.kernels.fused_mma import MMA_MAX_ROWS
from specdraft.models.tiny import (
    eagle_config,
    random_causal_lm,
    random_eagle_head,
    smollm2_135m_config,
    tiny_config,
)
from tests.model_helpers import PagedRunner


def reference(x, w, *, bias=None, norm_weight=None, eps=1e-6, silu=False, glu=False, residual=None):
    """float64 of the ops fused_linear fuses, nothing rounded in between (the kernels
    keep every intermediate in float32 and round the output once)."""
    xd = x.double()
    if silu:
        k = w.shape[1]
        g, u = xd[:, :k], xd[:, k:]
        xd = g * torch.sigmoid(g) * u
    if norm_weight is not None:
        rstd = torch.rsqrt((xd * xd).mean(-1, keepdim=True) + eps)
        xd = xd * rstd * norm_weight.double()
    y = xd @ w.double().T
    if bias is not None:
        y = y + bias.double()
    if glu:
        n = y.shape[1] // 2
        y = y[:, :n] * torch.sigmoid(y[:, :n]) * y[:, n:]
    if residual is not None:
        y = y + residual.double()
    return y


def rounding(y: torch.Tensor, dtype) -> float:
    """The reference's own rounding error in dtype: the yardstick for ours."""
    return (y.to(dtype).double() - y).abs().max().item()


def check_case(device, dtype, m, k, n, *, bias, norm, silu, res, inplace, glu=False, pdl=False):
    x = torch.randn(m, 2 * k if silu else k, device=device).to(dtype)
    rows = 2 * n if glu else n
    w = (torch.randn(rows, k, device=device) / k**0.5).to(dtype)
    b = torch.randn(rows, device=device).to(dtype) if bias else None
    g = (torch.rand(k, device=device) + 0.5).to(dtype) if norm else None
    r = torch.randn(m, n, device=device).to(dtype) if res else None
    want = reference(x, w, bias=b, norm_weight=g, eps=1e-5, silu=silu, glu=glu, residual=r)
    x0 = x.clone()
    if inplace:
        out = r
    else:
        out = torch.full((m, n), float("nan"), device=device, dtype=dtype)
    got = fused_linear(
        x, w, bias=b, norm_weight=g, eps=1e-5, silu=silu, glu=glu, residual=r, out=out, pdl=pdl
    )
    assert got.data_ptr() == out.data_ptr()
    assert torch.isfinite(got).all(), "every element written"
    assert torch.equal(x, x0), "x unchanged"
    err = (got.double() - want).abs().max().item()
    # float32 sums of at most 2K products: a few ulps of the row's magnitude; in fp16 /
    # bf16, the output's one rounding (an element on a rounding boundary may round the
    # other way) on top of that.
    scale = want.abs().max().item() + 1.0
    tol = 1e-5 * scale if dtype == torch.float32 else 3 * rounding(want, dtype) + 1e-5 * scale
    assert err <= tol, (err, tol)


def _flag_id(flags: dict) -> str:
    return "-".join(k for k, v in flags.items() if v) or "plain"


FLAGS = [
    dict(bias=False, norm=False, silu=False, res=False, inplace=False),
    dict(bias=True, norm=False, silu=False, res=False, inplace=False),
    dict(bias=False, norm=True, silu=False, res=False, inplace=False),
    dict(bias=True, norm=True, silu=False, res=False, inplace=False),
    dict(bias=False, norm=False, silu=True, res=True, inplace=True),
    dict(bias=False, norm=False, silu=False, res=True, inplace=False),
    dict(bias=True, norm=False, silu=False, res=True, inplace=True),
    dict(bias=False, norm=True, silu=False, res=False, inplace=False, glu=True),
    dict(bias=True, norm=False, silu=False, res=True, inplace=False, glu=True),
]


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("flags", FLAGS, ids=_flag_id)
def test_fused_linear_matches_float64(dtype, flags):
    # K 300 (fp32) and 600 (fp16): the rows kernel's K in two pieces
    for m, k, n in ((1, 48, 40), (3, 96, 72), (MAX_ROWS, 64, 130), (5, 300, 24), (2, 600, 20)):
        check_case("cpu", dtype, m, k, n, **flags)


# Past MAX_ROWS rows the tensor-core kernels (kernels/fused_mma.py) take a projection; no
# SiLU prologue there.
MMA_FLAGS = [f for f in FLAGS if not f["silu"]]


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("flags", MMA_FLAGS, ids=_flag_id)
def test_fused_linear_tensor_cores_match_float64(dtype, flags):
    # tiles of 16 to 64 rows, a ragged last one; K in one and in several chunks
    for m, k, n in ((MAX_ROWS + 1, 48, 40), (20, 96, 72), (33, 300, 24), (MMA_MAX_ROWS, 64, 130)):
        check_case("cpu", dtype, m, k, n, **flags)


@pytest.mark.interpreter
@pytest.mark.parametrize("flags", MMA_FLAGS[2:4] + MMA_FLAGS[-2:], ids=_flag_id)
def test_fused_linear_tensor_cores_at_few_rows(flags, monkeypatch):
    """The tensor-core kernel forced down to one row (the benchmark's crossover runs)."""
    import importlib

    monkeypatch.setattr(importlib.import_module("specdraft.kernels.fused_linear"),
                        "MMA_FROM_ROWS", 1)  # fmt: skip
    for m, k, n in ((1, 48, 40), (3, 300, 24)):
        check_case("cpu", torch.float16, m, k, n, **flags)


def _mma_rows_independent(device, dtype, k, n):
    """A row's output is the same bits at any place in any tile of the tensor-core
    kernel (a verification batch and a decode batch of the same rows agree)."""
    x = torch.randn(24, k, device=device).to(dtype)
    pad = torch.randn(13, k, device=device).to(dtype)
    w = (torch.randn(2 * n, k, device=device) / k**0.5).to(dtype)
    g = (torch.rand(k, device=device) + 0.5).to(dtype)
    r = torch.randn(24, n, device=device).to(dtype)
    r_pad = torch.cat([torch.randn(13, n, device=device).to(dtype), r])
    for wt, kw, kw_pad in ((w, dict(norm_weight=g), None),
                           (w, dict(norm_weight=g, glu=True), None),
                           (w[:n], dict(residual=r), dict(residual=r_pad))):  # fmt: skip
        a = fused_linear(x, wt, **kw)
        b = fused_linear(torch.cat([pad, x]), wt, **(kw_pad or kw))
        assert torch.equal(a, b[13:]), list(kw)


@pytest.mark.interpreter
def test_fused_linear_tensor_core_rows_independent():
    _mma_rows_independent("cpu", torch.float16, 300, 24)


@pytest.mark.gpu
def test_gpu_fused_linear_tensor_core_rows_independent():
    for k, n in ((576, 960), (1536, 576)):
        _mma_rows_independent("cuda", torch.bfloat16, k, n)


def _rows_alone_equal_rows_together(device, dtype, k, n):
    """Each row's output is the same bits whether it comes alone or with MAX_ROWS - 1
    others (the per-row arithmetic does not depend on the row count), so a decode step
    and a verification step of the same rows agree."""
    x = torch.randn(MAX_ROWS, k, device=device).to(dtype)
    w = (torch.randn(2 * n, k, device=device) / k**0.5).to(dtype)
    g = (torch.rand(k, device=device) + 0.5).to(dtype)
    for kw in (dict(norm_weight=g), dict(norm_weight=g, glu=True)):
        together = fused_linear(x, w, **kw)
        for i in (0, 3, MAX_ROWS - 1):
            alone = fused_linear(x[i : i + 1], w, **kw)
            assert torch.equal(alone[0], together[i]), (kw.keys(), i)


@pytest.mark.interpreter
def test_fused_linear_row_alone_equals_row_in_a_batch():
    _rows_alone_equal_rows_together("cpu", torch.float16, 600, 24)


@pytest.mark.interpreter
@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("flags", FLAGS[::2] + FLAGS[-3:-2], ids=_flag_id)
def test_fused_linear_rows_per_program(rows, flags, monkeypatch):
    """The wide kernel (forced for these small K) with x's rows split over the grid's
    second axis, ROWS to a program (a last program with fewer): every row computed
    once, by the program that owns it."""
    import importlib

    fl = importlib.import_module("specdraft.kernels.fused_linear")
    monkeypatch.setattr(fl, "ROWS_PER_PROGRAM", rows)
    monkeypatch.setattr(fl, "ROWS_MAX_K", 0)
    for m, k, n in ((MAX_ROWS, 64, 40), (5, 48, 72)):
        check_case("cpu", torch.float16, m, k, n, **flags)


@pytest.mark.interpreter
@pytest.mark.parametrize("tile", [("whole", 8, 4), ("whole", 2, 1), ("runs", 8, 1)])
@pytest.mark.parametrize("flags", FLAGS[::2] + FLAGS[-3:-2], ids=_flag_id)
def test_fused_linear_rows_tile_variants(tile, flags, monkeypatch):
    """The rows kernel with ROWS_TILE set (K whole in one padded piece, or in runs;
    other column counts and warps): the same float64 agreement as the default tile."""
    import importlib

    fl = importlib.import_module("specdraft.kernels.fused_linear")
    monkeypatch.setattr(fl, "ROWS_TILE", tile)
    for m, k, n in ((3, 300, 40), (1, 64, 72)):
        check_case("cpu", torch.float16, m, k, n, **flags)


def test_rows_tile_refuses_an_unknown_layout(monkeypatch):
    import importlib

    fl = importlib.import_module("specdraft.kernels.fused_linear")
    monkeypatch.setattr(fl, "ROWS_TILE", ("columns", 8, 4))
    with pytest.raises(ValueError, match="ROWS_TILE layout 'columns'"):
        fl._rows_tile(576, 2)


def test_max_fused_rows_follows_the_program_budget():
    """Projections the rows kernel takes (K <= ROWS_MAX_K) take up to MMA_FUSED_ROWS rows
    (the tensor-core kernels past MAX_ROWS): SmolLM2's; the llama-68m draft's widest
    ([768, 3072], the wide kernel) needs 1536 programs at 8 rows, within the budget, so
    it takes MMA_FUSED_ROWS too; Llama-3-8B's (K 4096 and 14336) stay at the floor of 4,
    and a budget that runs out before 8 rows stops there; the same answer under the
    interpreter as on the GPU."""
    from specdraft.kernels import max_fused_rows
    from specdraft.models.tiny import llama_68m_config

    smol = random_causal_lm(smollm2_135m_config(), seed=0, device="cpu", max_positions=32)
    assert max_fused_rows([(960, 576), (576, 576), (3072, 576), (576, 1536)]) == MMA_FUSED_ROWS
    assert smol.fused_rows() == MMA_FUSED_ROWS
    assert max_fused_rows([(6144, 768), (768, 3072)]) == MMA_FUSED_ROWS
    assert max_fused_rows([(6144, 768), (1536, 3072)]) == 4  # past the budget at 5 rows
    assert max_fused_rows([(1024, 768), (1024, 3072)]) == 6  # past the budget at 7 rows
    assert max_fused_rows([(28672, 4096), (4096, 14336)]) == 4
    llama = random_causal_lm(llama_68m_config(), seed=0, device="cpu", max_positions=32)
    assert llama.fused_rows() == MMA_FUSED_ROWS
    head = random_eagle_head(eagle_config(smollm2_135m_config()), smol, seed=1, max_positions=32)
    assert head.fused_rows() == MMA_FUSED_ROWS


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("flags", FLAGS, ids=_flag_id)
def test_gpu_fused_linear_rows_per_program(rows, flags, monkeypatch):
    """The wide kernel at SmolLM2's K, rows split over programs."""
    import importlib

    fl = importlib.import_module("specdraft.kernels.fused_linear")
    monkeypatch.setattr(fl, "ROWS_PER_PROGRAM", rows)
    monkeypatch.setattr(fl, "ROWS_MAX_K", 0)
    pdl = kernels.pdl_supported("cuda")
    for m, k, n in ((4, 576, 960), (MAX_ROWS, 1536, 576), (7, 300, 77)):
        check_case("cuda", torch.bfloat16, m, k, n, pdl=pdl, **flags)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [("whole", 8, 4), ("whole", 4, 1), ("whole", 2, 1)])
@pytest.mark.parametrize("flags", FLAGS, ids=_flag_id)
def test_gpu_fused_linear_rows_tile_variants(tile, flags, monkeypatch):
    """The rows kernel's ROWS_TILE variants at SmolLM2's K, bf16."""
    import importlib

    fl = importlib.import_module("specdraft.kernels.fused_linear")
    monkeypatch.setattr(fl, "ROWS_TILE", tile)
    pdl = kernels.pdl_supported("cuda")
    for m, k, n in ((1, 576, 960), (4, 1536, 576), (7, 300, 77)):
        check_case("cuda", torch.bfloat16, m, k, n, pdl=pdl, **flags)


@pytest.mark.gpu
def test_gpu_fused_linear_row_alone_equals_row_in_a_batch():
    for k, n in ((576, 960), (1536, 576), (4096, 64)):  # rows kernel (two pieces), wide
        _rows_alone_equal_rows_together("cuda", torch.bfloat16, k, n)


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("flags", FLAGS, ids=_flag_id)
def test_gpu_fused_linear_bf16(flags, pdl):
    pdl = pdl and kernels.pdl_supported("cuda")
    # SmolLM2's projections (K 576 / 1536), Llama-3-8B's (4096), a ragged K and N; past
    # MAX_ROWS the tensor-core kernel (no SiLU prologue there)
    for m, k, n in ((1, 576, 960), (4, 576, 3072), (MAX_ROWS, 1536, 576), (2, 4096, 1000),
                    (5, 300, 77), (MAX_ROWS + 1, 576, 960), (24, 576, 3072), (32, 1536, 576),
                    (MMA_MAX_ROWS, 4096, 1000), (17, 300, 77)):  # fmt: skip
        if m <= MAX_ROWS or not flags["silu"]:
            check_case("cuda", torch.bfloat16, m, k, n, pdl=pdl, **flags)


def _bad(device):
    dt = torch.float32
    x = torch.randn(2, 32, device=device, dtype=dt)
    w = torch.randn(16, 32, device=device, dtype=dt)
    return x, w


@pytest.mark.parametrize(
    "make, exc, words",
    [
        (lambda x, w: dict(x=x[None]), ValueError, "x must have 2 dimensions"),
        (lambda x, w: dict(x=torch.randn(MMA_MAX_ROWS + 1, 32)), ValueError, "rows"),
        (
            lambda x, w: dict(x=torch.randn(MAX_ROWS + 1, 64), silu=True, residual=None, out=None),
            ValueError,
            "silu=True takes at most",
        ),
        (lambda x, w: dict(weight=w.half()), TypeError, "weight must have dtype"),
        (lambda x, w: dict(weight=w[:, :16]), ValueError, "x has 32 columns"),
        (lambda x, w: dict(silu=True), ValueError, "silu=True"),
        (lambda x, w: dict(bias=torch.randn(15)), ValueError, "bias has shape"),
        (lambda x, w: dict(norm_weight=torch.randn(31)), ValueError, "norm_weight has shape"),
        (
            lambda x, w: dict(x=torch.randn(2, 64), norm_weight=torch.randn(32), silu=True),
            ValueError,
            "cannot be combined",
        ),
        (lambda x, w: dict(residual=torch.randn(2, 15)), ValueError, "residual has shape"),
        (lambda x, w: dict(out=torch.randn(3, 16)), ValueError, "out has shape"),
        (lambda x, w: dict(out=torch.randn(2, 16).half()), TypeError, "out must have dtype"),
        (lambda x, w: dict(x="x"), TypeError, "x must be a torch.Tensor"),
        (
            lambda x, w: dict(x=torch.randn(2, 64), silu=True, glu=True),
            ValueError,
            "cannot be combined",
        ),
        (
            lambda x, w: dict(weight=torch.randn(15, 32), residual=None, out=None, glu=True),
            ValueError,
            "glu=True needs",
        ),
        (lambda x, w: dict(glu=True), ValueError, "residual has shape"),
    ],
)
def test_fused_linear_bad_inputs(make, exc, words, device):
    """A clear error naming the argument; nothing written (out and residual unchanged).
    The tensors go to the device the kernels run on (CPU ones on a GPU machine are
    refused before any argument check)."""
    x, w = _bad("cpu")
    kw = dict(x=x, weight=w, residual=torch.randn(2, 16), out=torch.randn(2, 16))
    kw.update(make(x, w))
    kw = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    snap = {k: v.clone() for k, v in kw.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(exc, match=words):
        kernels.check_fused_linear_args(**kw)
    with pytest.raises(exc, match=words):
        fused_linear(kw.pop("x"), kw.pop("weight"), **kw)
    for k, v in snap.items():
        now = kw.get(k, v)
        assert torch.equal(now, v), f"{k} changed"


def test_fused_linear_refuses_out_overlapping_x(device):
    buf = torch.randn(2, 48, device=device)
    x, w = buf[:, :32], torch.randn(16, 32, device=device)
    before = buf.clone()
    with pytest.raises(ValueError, match="out overlaps x"):
        fused_linear(x, w, out=buf[:, 32:])
    assert torch.equal(buf, before)


def _model_logits(model, cfg, device, fused: bool, steps: int = 3):
    """With the fused path on or off throughout: prefill two prompts (12 rows with the
    padding, past fused_linear's MAX_ROWS: the unfused path either way), then `steps`
    decode steps of 2 requests + 1 padded row; the hidden states, logits and aux states
    of every decode step."""
    before = ops._fused_decode
    ops.set_fused_decode(fused)
    try:
        runner = PagedRunner(cfg, device, dtype=model.dtype)
        meta = runner.step([(0, [3, 5, 7, 11, 13, 6]), (1, [2, 4, 9, 10])], pad_reqs=1,
                           pad_tokens=2)  # fmt: skip
        assert meta.num_tokens > MAX_ROWS
        model(meta.input_ids, meta, runner.cache)
        outs, nxt = [], [1, 2]
        for _ in range(steps):
            meta = runner.step([(0, [nxt[0]]), (1, [nxt[1]])], pad_reqs=1, pad_tokens=1)
            assert ops.fused_decode(model.embed_tokens(meta.input_ids)) == fused
            hidden, logits, aux = model(meta.input_ids, meta, runner.cache, aux_layers=(0, 1))
            outs.append((hidden[:2].float(), logits[:2].float(), aux[:2].float()))
            nxt = [int(x) for x in logits.argmax(-1)[:2]]
    finally:
        ops.set_fused_decode(before)
    return outs


def _compare_fused(device, dtype, tol):
    cfg = tiny_config("llama", num_layers=2)
    model = random_causal_lm(cfg, dtype=dtype, device=device, seed=3)
    with torch.no_grad():
        fused = _model_logits(model, cfg, device, True)
        plain = _model_logits(model, cfg, device, False)
    for (h1, l1, a1), (h2, l2, a2) in zip(fused, plain):
        for a, b in ((h1, h2), (l1, l2), (a1, a2)):
            assert torch.isfinite(a).all()
            err = (a - b).abs().max().item()
            assert err <= tol * (b.abs().max().item() + 1), err


@pytest.mark.interpreter
def test_fused_decode_path_matches_unfused_model():
    """Same hidden states, logits and EAGLE-3 aux states (fp32, interpreter); the
    planted check: with the path forced the fused forward really ran."""
    calls = []
    real = kernels.fused_linear, kernels.fused_qkv_rope, kernels.embed_rows

    def spy(i):
        def call(*a, **kw):
            calls.append(i)
            return real[i](*a, **kw)

        return call

    kernels.fused_linear, kernels.fused_qkv_rope, kernels.embed_rows = spy(0), spy(1), spy(2)
    try:
        _compare_fused("cpu", torch.float32, 1e-4)
    finally:
        kernels.fused_linear, kernels.fused_qkv_rope, kernels.embed_rows = real
    # 3 steps x 2 layers: QKV + rotary + store in one launch, then 3 projections; the
    # embedding gather a step (kernels.embed_rows: the unfused path gathers with torch)
    assert calls.count(1) == 3 * 2 and calls.count(0) == 3 * 2 * 3, calls
    assert calls.count(2) == 3, calls


def _verify_rows(model, cfg, device, fused: bool, reqs: int = 2):
    """A verification-shaped step of 4 x reqs rows (reqs requests x 4 tokens) after a
    prefill, with the fused path forced up to those rows or off; its hidden states and
    logits."""
    rows = 4 * reqs
    before = (ops._fused_decode, ops._fused_rows)
    ops.set_fused_decode(fused)
    ops._fused_rows = rows if fused else None
    try:
        runner = PagedRunner(cfg, device, dtype=model.dtype, max_num_reqs=max(4, reqs))
        prompts = [[3, 5, 7, 11, 13, 6], [2, 4, 9, 10], [8, 1, 12]][:reqs]
        meta = runner.step(list(enumerate(prompts)), pad_tokens=2)
        model(meta.input_ids, meta, runner.cache)
        meta = runner.step([(r, [1 + r, 2, 3 + r, 4]) for r in range(reqs)])
        assert meta.num_tokens == rows
        hidden, logits = model(meta.input_ids, meta, runner.cache, all_logits=True)
    finally:
        ops.set_fused_decode(before[0])
        ops._fused_rows = before[1]
    return hidden.float(), logits.float()


@pytest.mark.interpreter
@pytest.mark.parametrize("reqs", [2, 3])
def test_fused_decode_path_at_8_and_12_rows_matches_unfused_model(reqs):
    """8 rows (the rows kernel) and 12 (the tensor-core kernels): what a SmolLM2-sized
    model takes fused on the GPU (kernels.max_fused_rows); under the interpreter only
    when forced (ops._INTERPRET_FUSED_ROWS)."""
    cfg = tiny_config("llama", num_layers=2)
    model = random_causal_lm(cfg, dtype=torch.float32, device="cpu", seed=3)
    assert model.fused_rows() == MMA_FUSED_ROWS
    x = torch.zeros(4 * reqs, cfg.hidden_size)
    assert not ops.fused_decode(x, model.fused_rows()), "the interpreter's cap"
    calls = []
    real = kernels.fused_linear, kernels.fused_qkv_rope

    def spy(i):
        def call(*a, **kw):
            calls.append((i, a[0].shape[0]))
            return real[i](*a, **kw)

        return call

    kernels.fused_linear, kernels.fused_qkv_rope = spy(0), spy(1)
    try:
        with torch.no_grad():
            fused = _verify_rows(model, cfg, "cpu", True, reqs)
    finally:
        kernels.fused_linear, kernels.fused_qkv_rope = real
    # the verification step: 2 layers x (QKV + rotary + store, then 3 projections)
    assert calls.count((0, 4 * reqs)) == 2 * 3 and calls.count((1, 4 * reqs)) == 2, calls
    with torch.no_grad():
        plain = _verify_rows(model, cfg, "cpu", False, reqs)
    for a, b in zip(fused, plain):
        assert torch.isfinite(a).all()
        err = (a - b).abs().max().item()
        assert err <= 1e-4 * (b.abs().max().item() + 1), err


@pytest.mark.interpreter
def test_fused_decode_path_past_8_rows_with_a_wide_projection_matches_unfused_model():
    """A model whose down projection is past the rows kernel (K 2304 > ROWS_MAX_K: the
    wide kernel up to MAX_ROWS, as llama-68m's K 3072) at 12 rows: every projection on
    the tensor-core kernels, against the unfused model."""
    cfg = tiny_config("llama", num_layers=1, intermediate_size=2304)
    model = random_causal_lm(cfg, dtype=torch.float32, device="cpu", seed=4)
    assert model.fused_rows() == MMA_FUSED_ROWS
    calls = []
    real = kernels.fused_linear

    def spy(x, w, **kw):
        calls.append((x.shape[0], w.shape[1]))
        return real(x, w, **kw)

    kernels.fused_linear = spy
    try:
        with torch.no_grad():
            fused = _verify_rows(model, cfg, "cpu", True, 3)
    finally:
        kernels.fused_linear = real
    assert (12, 2304) in calls, calls  # the down projection, fused at 12 rows
    with torch.no_grad():
        plain = _verify_rows(model, cfg, "cpu", False, 3)
    for a, b in zip(fused, plain):
        assert torch.isfinite(a).all()
        err = (a - b).abs().max().item()
        assert err <= 1e-4 * (b.abs().max().item() + 1), err


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [None, ("whole", 8, 4), ("whole", 2, 1)])
def test_gpu_fused_decode_path_matches_unfused_model_bf16(tile, monkeypatch):
    """Also with the rows kernel's ROWS_TILE variants (QKV + rotary, the embedding's
    projection and the merge on the O projection's loads take the tile too)."""
    import importlib

    monkeypatch.setattr(importlib.import_module("specdraft.kernels.fused_linear"), "ROWS_TILE",
                        tile)  # fmt: skip
    _compare_fused("cuda", torch.bfloat16, 3e-2)


def _eagle_steps(head, cfg, device, fused: bool, steps: int = 3):
    """An EAGLE-1 head's steps with the fused path on or off: 2 requests + 1 padded row
    a step, the head's own hidden state carried; (hidden, logits) of each step."""
    before = ops._fused_decode
    ops.set_fused_decode(fused)
    try:
        runner = PagedRunner(cfg, device, dtype=head.dtype)
        gen = torch.Generator(device="cpu").manual_seed(5)
        hidden = torch.randn(3, cfg.hidden_size, generator=gen).to(device, head.dtype)
        outs, nxt = [], [1, 2]
        for _ in range(steps):
            meta = runner.step([(0, [nxt[0]]), (1, [nxt[1]])], pad_reqs=1, pad_tokens=1)
            hidden, logits = head(meta.input_ids, hidden, meta, runner.cache)
            outs.append((hidden[:2].float().clone(), logits[:2].float()))
            nxt = [int(x) for x in logits.argmax(-1)[:2]]
    finally:
        ops.set_fused_decode(before)
    return outs


@pytest.mark.interpreter
def test_fused_decode_path_matches_unfused_eagle_head():
    cfg = tiny_config("llama", num_layers=2)
    target = random_causal_lm(cfg, dtype=torch.float32, device="cpu", seed=3)
    head = random_eagle_head(eagle_config(cfg), target, seed=4)
    with torch.no_grad():
        fused = _eagle_steps(head, eagle_config(cfg), "cpu", True)
        plain = _eagle_steps(head, eagle_config(cfg), "cpu", False)
    for (h1, l1), (h2, l2) in zip(fused, plain):
        for a, b in ((h1, h2), (l1, l2)):
            assert torch.isfinite(a).all()
            assert (a - b).abs().max().item() <= 1e-4 * (b.abs().max().item() + 1)


def test_set_fused_decode_and_pdl_supported_bad_inputs():
    before = ops._fused_decode
    with pytest.raises(TypeError, match="enabled must be a bool"):
        ops.set_fused_decode("yes")
    assert ops._fused_decode == before
    with pytest.raises(TypeError, match="device must be"):
        kernels.pdl_supported(0.5)
    with pytest.raises(ValueError, match="device 'gpu0' is not a device"):
        kernels.pdl_supported("gpu0")
    assert kernels.pdl_supported("cpu") is False
    assert kernels.pdl_supported(torch.device("cpu")) is False


def _fed_logits(model, cfg, device, fused: bool, feed):
    """Prefill three prompts, then decode the tokens in `feed` (3 rows a step, the same
    tokens whatever the model predicts); the logits of every decode step."""
    before = ops._fused_decode
    ops.set_fused_decode(fused)
    try:
        runner = PagedRunner(cfg, device, dtype=model.dtype)
        meta = runner.step([(0, [3, 5, 7]), (1, [2, 4]), (2, [9])])
        model(meta.input_ids, meta, runner.cache)
        out = []
        for step in feed:
            meta = runner.step([(i, [t]) for i, t in enumerate(step)])
            out.append(model(meta.input_ids, meta, runner.cache)[1].double())
    finally:
        ops.set_fused_decode(before)
    return torch.stack(out)


@pytest.mark.gpu
def test_gpu_fused_decode_error_within_the_unfused_bf16_error():
    """SmolLM2's shapes, 6 layers, random weights: the fused path's bf16 logits are no
    further from the float32 model's (same bf16-rounded weights) than the unfused path's
    bf16 logits are. Judged against that error, not a fixed number."""
    cfg = smollm2_135m_config(num_layers=6)
    low = random_causal_lm(cfg, dtype=torch.bfloat16, device="cuda", seed=7)
    ref = random_causal_lm(cfg, dtype=torch.float32, device="cuda", seed=7)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.bfloat16().float())
        feed = [[11, 12, 13], [21, 22, 23], [31, 32, 33], [41, 42, 43]]
        want = _fed_logits(ref, cfg, "cuda", False, feed)
        plain = _fed_logits(low, cfg, "cuda", False, feed)
        fused = _fed_logits(low, cfg, "cuda", True, feed)
    err_plain = (plain - want).abs().max().item()
    err_fused = (fused - want).abs().max().item()
    assert torch.isfinite(fused).all()
    assert err_plain > 0, "the bf16 model must differ from the float32 one"
    assert err_fused <= 1.5 * err_plain, (err_fused, err_plain)


def _decode_then_verify(model, cfg, device, tokens, prompt):
    """Logits of `tokens` decoded one a step after `prompt`, and of the same tokens as
    one verification step of len(tokens) rows after the same prompt (fresh caches)."""
    one, block = [], None
    for verify in (False, True):
        runner = PagedRunner(cfg, device, dtype=model.dtype, max_model_len=128)
        meta = runner.step([(0, prompt)])
        model(meta.input_ids, meta, runner.cache)
        if verify:
            meta = runner.step([(0, tokens)])
            block = model(meta.input_ids, meta, runner.cache, all_logits=True)[1].float()
        else:
            for t in tokens:
                meta = runner.step([(0, [t])])
                one.append(model(meta.input_ids, meta, runner.cache)[1][0].float())
    return torch.stack(one), block


@pytest.mark.gpu
def test_gpu_verification_logits_equal_decode_logits():
    """SmolLM2's shapes, 4 layers, bf16: the logits of 4 tokens verified in one step are
    the bits the same tokens get decoded one a step (what makes greedy speculative
    output the target-only output at batch 1): the fused path's per-row arithmetic does
    not depend on the row count, nor the attention's on the number of query rows."""
    cfg = smollm2_135m_config(num_layers=4)
    model = random_causal_lm(cfg, dtype=torch.bfloat16, device="cuda", seed=11)
    prompt, tokens = list(range(100, 120)), [7, 300, 41, 9]
    with torch.no_grad():
        one, block = _decode_then_verify(model, cfg, "cuda", tokens, prompt)
    assert torch.isfinite(block).all()
    bad = [i for i in range(len(tokens)) if not torch.equal(one[i], block[i])]
    assert not bad, (bad, (one - block).abs().max().item())


def _one_row_linear(device, dtype, k, n, monkeypatch):
    """ops.linear at one row: through the wide kernel past K 2048 (counted), cuBLAS /
    torch below it and at two rows; each against float64, within the output dtype's own
    rounding of it (plus float32 summation error)."""
    calls = []
    real = kernels.fused_linear
    monkeypatch.setattr(kernels, "fused_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    w = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    b = torch.randn(n, device=device).to(dtype)
    for m in (1, 2):
        x = torch.randn(m, k, device=device).to(dtype)
        before = len(calls)
        got = ops.linear(x, w, b)
        assert len(calls) - before == (1 if m == 1 and k > 2048 else 0), (m, k)
        ref = reference(x, w, bias=b)
        err = (got.double() - ref).abs().max().item()
        assert err <= rounding(ref, dtype) + 1e-4 * ref.abs().max().item(), (m, k, err)


@pytest.mark.interpreter  # CPU tensors take the kernel only under the interpreter
@pytest.mark.parametrize("k", [2048, 2304])
def test_linear_one_row_wide_k_takes_the_fused_kernel(k, monkeypatch):
    _one_row_linear("cpu", torch.float32, k, 24, monkeypatch)


def test_linear_one_row_stays_on_torch_with_the_fused_path_off(monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, "fused_linear", lambda *a, **kw: calls.append(1))
    monkeypatch.setattr(ops, "_fused_decode", False)
    x, w = torch.randn(1, 2304), torch.randn(8, 2304)
    torch.testing.assert_close(ops.linear(x, w, None), x @ w.T)
    assert not calls


@pytest.mark.gpu
def test_gpu_linear_one_row_wide_k_takes_the_fused_kernel(monkeypatch):
    for k, n in ((4096, 3000), (14336, 512), (1536, 1000)):
        _one_row_linear("cuda", torch.bfloat16, k, n, monkeypatch)


# ------------------------------------------------- split attention merged in the O projection


def _split_attention(device, dtype, t, seed):
    """A split attention launch (4 splits, each holding keys: contexts of 300 and 520)
    over a ragged batch: 2 requests of 1 and 3 query tokens, the tokens past them
    padding, partials left unmerged; its `out` poisoned."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d, bs = 4, 2, 32, 16
    kc = torch.randn(80, bs, hkv, d, generator=g).to(device, dtype)
    vc = torch.randn(80, bs, hkv, d, generator=g).to(device, dtype)
    q = torch.randn(t, hq, d, generator=g).to(device, dtype)
    qsl = torch.tensor([0, 1, 4], dtype=torch.int32, device=device)
    seq = torch.tensor([300, 520], dtype=torch.int32, device=device)
    table = (torch.randperm(79, generator=g)[:66] + 1).to(torch.int32).view(2, 33).to(device)
    out = torch.full((t, hq, d), float("nan"), dtype=dtype, device=device)
    _, splits = kernels.paged_attention_unmerged(
        q, kc, vc, qsl, seq, table, 0.25, out=out, num_splits=4, max_query_len=3
    )
    assert splits is not None and splits.num_splits == 4
    live = (splits.part_lse[:, :4] > float("-inf")).sum(0)  # splits holding keys, per row
    assert int(live.min()) >= 2, live
    return out, splits


def _merged_against_combined(device, dtype, t, **kw):
    out, splits = _split_attention(device, dtype, t, seed=t)
    g = torch.Generator().manual_seed(100 + t)
    k = out.shape[1] * out.shape[2]
    w = (torch.randn(24, k, generator=g) / k**0.5).to(device, dtype)
    b = torch.randn(24, generator=g).to(device, dtype)
    res = torch.randn(t, 24, generator=g).to(device, dtype)
    x = out.view(t, k)
    merged = fused_linear(x, w, bias=b, residual=res.clone(), x_splits=splits, **kw)
    written = not bool(out.isnan().all())
    kernels.combine_splits(splits)
    assert not bool(out.isnan().any()) and bool((out[4:] == 0).all())  # padded tokens: zeros
    combined = fused_linear(x, w, bias=b, residual=res.clone(), **kw)
    return merged, combined, written


@pytest.mark.parametrize("t", [5, 8])
def test_fused_linear_merges_split_attention_on_its_loads(t, device):
    """x_splits: the rows kernel merges the partials as the combine launch would, so the
    output is bit for bit the combine launch's followed by the plain projection, padded
    tokens included, and x itself is never written."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    merged, combined, written = _merged_against_combined(device, dtype, t)
    assert not written
    assert torch.equal(merged, combined)


@pytest.mark.parametrize("t, kw", [(5, {"norm_weight": True}), (12, {})])
def test_fused_linear_x_splits_falls_back_to_the_merge_launch(t, kw, device):
    """Where the rows kernel does not take the call (a norm before it, or past MAX_ROWS
    rows: the tensor-core kernels) the combine launch writes x first: the same output."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    if kw.get("norm_weight"):
        kw = {"norm_weight": torch.rand(128, device=device, dtype=dtype) + 0.5}
    merged, combined, written = _merged_against_combined(device, dtype, t, **kw)
    assert written
    assert torch.equal(merged, combined)


def test_fused_linear_bad_x_splits(device):
    """x_splits must be an AttentionSplits whose output x is: a clear error, nothing
    written."""
    dtype = torch.float32
    out, splits = _split_attention(device, dtype, 5, seed=1)
    w = torch.randn(8, 128, device=device, dtype=dtype)
    y = torch.full((5, 8), 7.0, device=device, dtype=dtype)
    with pytest.raises(TypeError, match="x_splits must be an AttentionSplits"):
        fused_linear(out.view(5, 128), w, out=y, x_splits=(splits.part_out, splits.part_lse))
    with pytest.raises(ValueError, match="x_splits: x"):
        fused_linear(torch.zeros(5, 128, device=device, dtype=dtype), w, out=y, x_splits=splits)
    assert bool((y == 7.0).all()) and bool(out.isnan().all())


@pytest.mark.interpreter
def test_merge_in_o_projection_matches_the_merge_launch(monkeypatch):
    """layers.MERGE_IN_O_PROJ: the fused decode steps of a model with split attention
    (4 splits, as the GPU takes at long contexts) give the same hidden states, logits and
    aux states,
    bit for bit, with the O projection merging the partials and with the merge launch;
    the merge launch runs only in the latter."""
    import importlib

    from specdraft import layers

    pa = importlib.import_module("specdraft.kernels.paged_attention")

    choose = pa.choose_launch_config
    monkeypatch.setattr(pa, "choose_launch_config", lambda **kw: choose(**{**kw, "num_splits": 4}))
    cfg = tiny_config("llama", num_layers=2)
    model = random_causal_lm(cfg, dtype=torch.float32, device="cpu", seed=3)
    combines = []
    real = pa.combine_splits

    def spy(splits, **kw):
        combines.append(splits.out.shape[0])
        return real(splits, **kw)

    monkeypatch.setattr(pa, "combine_splits", spy)
    monkeypatch.setattr(layers, "MERGE_IN_O_PROJ", False)
    with torch.no_grad():
        plain = _model_logits(model, cfg, "cpu", True)
    launches = len(combines)
    monkeypatch.setattr(layers, "MERGE_IN_O_PROJ", True)
    with torch.no_grad():
        merged = _model_logits(model, cfg, "cpu", True)
    # 3 decode steps x 2 layers merged by a launch; none with the merge in O (the
    # unfused prefill merges by launch either way)
    assert launches - (len(combines) - launches) == 3 * 2, combines
    for a, b in zip(plain, merged):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_bench_rows_tiles_arg():
    """bench's --rows-tiles parser: items as ROWS_TILE takes them; a bad item is named."""
    from bench.common import rows_tiles_arg

    assert rows_tiles_arg("whole/8/4,runs/2/1") == [("whole", 8, 4), ("runs", 2, 1)]
    assert rows_tiles_arg("") == []
    for bad in ("whole/8", "cols/8/4", "whole/0/4", "whole/8/3", "whole/x/4"):
        with pytest.raises(SystemExit, match=f"--rows-tiles: '{bad}'"):
            rows_tiles_arg(bad)
