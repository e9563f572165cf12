"""Attention's split merge folded into the next projection: paged_attention(...,
merge=False) returns kernels.SplitPartials and kernels.fused_linear merges them as it
loads x. Checked against the combine launch (same bits: both sum the splits in one
order), against a float64 reference, with padded tokens and poisoned outputs; the
fallback where the rows kernel does not take the projection; bad inputs; and a whole
model's fused decode step with the fold on and off (same logits, bit for bit)."""

from __future__ import annotations

import sys

import pytest
import torch

from specdraft import kernels, layers
from specdraft.kernels import SplitPartials, fused_linear, paged_attention
from tests.batch import make_paged_batch
from tests.reference import paged_attention_ref

GPU = torch.cuda.is_available()


def _batch(device, dtype, g, *, q_lens, ctx_lens, hq=6, hkv=2, d=32, pad_tokens=1):
    return make_paged_batch(
        q_lens, ctx_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype,
        device=device, pad_tokens=pad_tokens, generator=g,
    )  # fmt: skip


def _attend(b, splits, *, merge):
    scale = b.q.shape[2] ** -0.5
    return paged_attention(
        b.q, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_table, scale,
        max_query_len=b.max_query_len, max_seq_len=b.max_seq_len, num_splits=splits,
        merge=merge,
    )  # fmt: skip


def _case(device, dtype, seed, *, splits, q_lens, ctx_lens, bias=True):
    g = torch.Generator().manual_seed(seed)
    b = _batch(device, dtype, g, q_lens=q_lens, ctx_lens=ctx_lens)
    t, hq, d = b.q.shape
    k = hq * d
    n = 48
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(device)
    bias_t = torch.randn(n, generator=g).to(dtype).to(device) if bias else None
    res = torch.randn(t, n, generator=g).to(dtype).to(device)
    return b, w, bias_t, res


@pytest.mark.interpreter
@pytest.mark.parametrize("splits", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_merge_on_load_equals_the_combine_launch(splits, dtype):
    """Decode rows and a 3-token verification in one batch, a padded token last: the
    fold's output is the projection of the combine launch's merged tensor, bit for bit,
    every element written (NaN poison), the padded row residual + bias only, and both
    within the dtype's rounding of a float64 reference."""
    for seed in range(2):
        b, w, bias, res = _case("cpu", dtype, seed, splits=splits, q_lens=[1, 3, 1],
                                ctx_lens=[40, 70, 9])  # fmt: skip
        parts = _attend(b, splits, merge=False)
        assert isinstance(parts, SplitPartials) and parts.num_splits == splits
        merged = _attend(b, splits, merge=True)
        assert torch.equal(parts.merge(), merged)
        out = torch.full_like(res, float("nan"))
        got = fused_linear(parts, w, bias=bias, residual=res, out=out)
        want = fused_linear(merged.flatten(1), w, bias=bias, residual=res)
        assert got.data_ptr() == out.data_ptr() and not got.isnan().any()
        assert torch.equal(got, want)
        t = b.num_real_tokens
        assert torch.equal(got[t:], (res[t:].float() + bias.float()).to(dtype))
        scale = b.q.shape[2] ** -0.5
        att = paged_attention_ref(b.q, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens,
                                  b.block_table, scale)  # fmt: skip
        y64 = att.flatten(1) @ w.double().T + bias.double() + res.double()
        err = (got.double() - y64).abs().max().item()
        # The merged input is rounded to dtype before the product (as the combine
        # launch's output is): the yardstick is that rounding carried through W.
        yard = ((att.to(dtype).double() - att).flatten(1).abs() @ w.double().abs().T).max()
        own = (y64.to(dtype).double() - y64).abs().max().item()
        assert err <= 2 * (yard.item() + own) + 1e-6, (err, yard.item(), own)


@pytest.mark.interpreter
def test_unsplit_launch_returns_the_output():
    """Without splits merge=False changes nothing: the output tensor comes back."""
    g = torch.Generator().manual_seed(5)
    b = _batch("cpu", torch.float32, g, q_lens=[1, 2], ctx_lens=[20, 5])
    got = _attend(b, 1, merge=False)
    assert isinstance(got, torch.Tensor)
    assert torch.equal(got, _attend(b, 1, merge=True))


@pytest.mark.interpreter
def test_wide_kernel_takes_partials_after_the_combine_launch(monkeypatch):
    """Where the rows kernel does not take the projection (its K bound lowered), the
    partials are merged by the combine launch first: the same output."""
    fl = sys.modules["specdraft.kernels.fused_linear"]  # the attribute is the function
    b, w, bias, res = _case("cpu", torch.float32, 7, splits=2, q_lens=[1, 1],
                            ctx_lens=[33, 50])  # fmt: skip
    parts = _attend(b, 2, merge=False)
    want = fused_linear(_attend(b, 2, merge=True).flatten(1), w, bias=bias, residual=res)
    monkeypatch.setattr(fl, "ROWS_MAX_K", 16)
    got = fused_linear(parts, w, bias=bias, residual=res)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _partials_cases():
    return [
        ("norm_weight", dict(norm_weight=True), ValueError, "norm_weight"),
        ("glu", dict(glu=True), ValueError, "glu"),
        ("silu", dict(silu=True), ValueError, "silu"),
        ("weight_k", dict(weight_k=10), ValueError, "weight"),
        ("weight_dtype", dict(weight_dtype=torch.float16), TypeError, "weight"),
        ("lse_shape", dict(lse_shape=True), ValueError, "part_lse"),
        ("qsl_dtype", dict(qsl_dtype=True), ValueError, "query_start_loc"),
    ]


@pytest.mark.interpreter
@pytest.mark.parametrize("name,kw,exc,word", _partials_cases(), ids=lambda c: str(c)[:12])
def test_partials_bad_inputs(name, kw, exc, word):
    """A clear error naming the argument, and the out buffer untouched."""
    b, w, bias, res = _case("cpu", torch.float32, 11, splits=2, q_lens=[1], ctx_lens=[40])
    parts = _attend(b, 2, merge=False)
    t, k = parts.shape
    args = {}
    if kw.get("norm_weight"):
        args["norm_weight"] = torch.ones(k)
    if kw.get("glu"):
        w = torch.randn(2 * w.shape[0], k)
        args["glu"] = True
    if kw.get("silu"):
        args["silu"] = True
    if "weight_k" in kw:
        w = torch.randn(w.shape[0], kw["weight_k"])
    if "weight_dtype" in kw:
        w = w.to(kw["weight_dtype"])
    if kw.get("lse_shape"):
        parts = SplitPartials(parts.part_out, parts.part_lse[:, :, :1], parts.query_start_loc,
                              parts.num_heads, parts.head_dim, parts.dtype)  # fmt: skip
    if kw.get("qsl_dtype"):
        parts = SplitPartials(parts.part_out, parts.part_lse, parts.query_start_loc.long(),
                              parts.num_heads, parts.head_dim, parts.dtype)  # fmt: skip
    out = torch.randn(t, w.shape[0] // (2 if args.get("glu") else 1))
    before = out.clone()
    with pytest.raises(exc, match=word):
        fused_linear(parts, w, out=out, **args)
    assert torch.equal(out, before)


def _decode_steps(device, dtype, fold: bool, *, steps: int = 2):
    """A random 2-layer model's fused decode steps (2 requests + 1 padded token) after
    a 150-token prefill, max_model_len 320 (attention splits its keys), with the merge
    fold on or off; the logits of every step and the partials fused_linear was given."""
    from specdraft import ops
    from specdraft.models.tiny import random_causal_lm, tiny_config
    from tests.model_helpers import PagedRunner

    cfg = tiny_config("llama", num_layers=2, max_position_embeddings=320)
    model = random_causal_lm(cfg, dtype=dtype, device=device, seed=3)
    seen, real = [], kernels.fused_linear

    def spy(x, *a, **kw):
        seen.append(isinstance(x, SplitPartials))
        return real(x, *a, **kw)

    before = ops._fused_decode, layers.MERGE_IN_O_PROJ, kernels.fused_linear
    ops.set_fused_decode(True)
    layers.MERGE_IN_O_PROJ, kernels.fused_linear = fold, spy
    try:
        g = torch.Generator().manual_seed(1)
        runner = PagedRunner(cfg, device, dtype=dtype, max_model_len=320, max_num_tokens=320)
        prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (150, 97)]
        with torch.no_grad():
            meta = runner.step([(0, prompts[0]), (1, prompts[1])])
            model(meta.input_ids, meta, runner.cache)
            outs, nxt = [], [1, 2]
            for _ in range(steps):
                meta = runner.step([(0, [nxt[0]]), (1, [nxt[1]])], pad_tokens=1)
                _, logits = model(meta.input_ids, meta, runner.cache)
                outs.append(logits.float())
                nxt = [int(x) for x in logits.argmax(-1)[:2]]
    finally:
        ops.set_fused_decode(before[0])
        layers.MERGE_IN_O_PROJ, kernels.fused_linear = before[1:]
    return outs, seen


@pytest.mark.interpreter
def test_fused_decode_steps_with_and_without_the_fold():
    """A whole model's fused decode steps with split attention: the logits with the
    merge in the O projection equal the combine launch's, bit for bit; and the fold
    really ran (the O projection got partials in every layer of every step)."""
    on, seen_on = _decode_steps("cpu", torch.float32, True)
    off, seen_off = _decode_steps("cpu", torch.float32, False)
    assert seen_on.count(True) == 2 * 2 and not any(seen_off), (seen_on, seen_off)
    for a, b in zip(on, off):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a GPU")
@pytest.mark.parametrize("splits", [2, 8])
def test_gpu_merge_on_load_equals_the_combine_launch_bf16(splits):
    """bf16 at SmolLM2's heads (9 / 3 x 64) and its O projection (576 x 576), 1 and 4
    rows and a padded token, with PDL: the same bits as the combine launch."""
    for q_lens, ctx in (([1], [300]), ([4], [517]), ([1, 1, 1], [40, 900, 129])):
        g = torch.Generator().manual_seed(len(q_lens) * 31 + splits)
        b = _batch("cuda", torch.bfloat16, g, q_lens=q_lens, ctx_lens=ctx, hq=9, hkv=3, d=64)
        t, hq, d = b.q.shape
        w = (torch.randn(576, hq * d, generator=g) / 24).to(torch.bfloat16).cuda()
        res = torch.randn(t, 576, generator=g).to(torch.bfloat16).cuda()
        parts = _attend(b, splits, merge=False)
        merged = _attend(b, splits, merge=True)
        assert torch.equal(parts.merge(), merged)
        out = torch.full_like(res, float("nan"))
        got = fused_linear(parts, w, residual=res, out=out, pdl=kernels.pdl_supported("cuda"))
        want = fused_linear(merged.flatten(1), w, residual=res)
        assert not got.isnan().any()
        assert torch.equal(got, want), (got.float() - want.float()).abs().max()
