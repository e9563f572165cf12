"""Paged attention against the float64 reference.

CPU runs use the Triton interpreter on small shapes in fp32 / fp16; tests marked gpu run
bf16, large shapes, a cache over 2^31 elements and CUDA-graph replay."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
import triton

from specdraft import kernels
from specdraft.kernels import paged_attention
from specdraft.kernels.paged_attention import (
    AttentionLaunchConfig,
    choose_launch_config,
)
from tests.batch import PagedBatch, make_paged_batch
from tests.reference import paged_attention_ref

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def run_and_check(
    b: PagedBatch,
    dtype: torch.dtype,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
    max_query_len: int | None = None,
    config: AttentionLaunchConfig | None = None,
) -> torch.Tensor:
    """Run the kernel on a NaN-poisoned output and compare every element with the
    reference: real rows within tolerance, padded rows exactly zero."""
    head_dim = b.q.shape[-1]
    scale = head_dim**-0.5
    out = torch.full_like(b.q, float("nan"))
    paged_attention(
        b.q,
        b.k_cache,
        b.v_cache,
        b.query_start_loc,
        b.seq_lens,
        b.block_table,
        scale,
        out=out,
        max_query_len=max_query_len or b.max_query_len,
        max_seq_len=b.max_seq_len,
        sliding_window=sliding_window,
        softcap=softcap,
        num_splits=num_splits,
        config=config,
    )
    ref = paged_attention_ref(
        b.q,
        b.k_cache,
        b.v_cache,
        b.query_start_loc,
        b.seq_lens,
        b.block_table,
        scale,
        sliding_window=sliding_window,
        softcap=softcap,
    )
    assert not torch.isnan(out).any(), "an output element was not written"
    real = b.num_real_tokens
    assert torch.equal(out[real:], torch.zeros_like(out[real:])), "padded rows must be zero"
    err = (out[:real].double() - ref[:real]).norm() / ref[:real].norm().clamp_min(1e-12)
    assert err < TOL[dtype], f"relative error {err:.3e} over {TOL[dtype]:.1e}"
    return out


@pytest.fixture
def tiled_rule(monkeypatch):
    """choose_launch_config without its token programs (tests/test_token_attention.py
    has theirs): the tiled kernel's own choice."""
    import importlib

    monkeypatch.setattr(importlib.import_module("specdraft.kernels.paged_attention"),
                        "TOKEN_WAVES", 0)  # fmt: skip


def random_lens(n: int, q_choices: list[int], ctx_max: int, rng: random.Random):
    return [rng.choice(q_choices) for _ in range(n)], [rng.randint(0, ctx_max) for _ in range(n)]


CPU_DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize(
    "kind, q_choices",
    [("decode", [1]), ("multi_token", [2, 4, 5, 9]), ("mixed", [1, 1, 3, 6, 23])],
)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)], ids=["gqa1", "gqa4", "gqa8"])
def test_batch_kinds(device, dtype, kind, q_choices, heads):
    rng = random.Random(hash((kind, heads, str(dtype))) & 0xFFFF)
    for _ in range(2):  # fresh inputs per check
        q_lens, ctx = random_lens(rng.randint(1, 6), q_choices, 75, rng)
        b = make_paged_batch(
            q_lens,
            ctx,
            num_q_heads=heads[0],
            num_kv_heads=heads[1],
            head_dim=64,
            dtype=dtype,
            device=device,
        )
        run_and_check(b, dtype)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_head_dims_and_block_sizes(device, head_dim, block_size):
    rng = random.Random(head_dim * 1000 + block_size)
    q_lens, ctx = random_lens(3, [1, 2, 7], 130, rng)
    b = make_paged_batch(
        q_lens,
        ctx,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.float32,
        device=device,
    )
    run_and_check(b, torch.float32)


def test_long_prefill_with_decodes(device):
    # One prefill of 70 tokens (spanning several query tiles and KV tiles) in a batch
    # with decodes and a short query; context lengths are not block multiples.
    b = make_paged_batch(
        [1, 70, 1, 5],
        [33, 0, 101, 20],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.float16,
        device=device,
    )
    run_and_check(b, torch.float16)


@pytest.mark.parametrize("num_splits", [2, 8, 32])
@pytest.mark.parametrize("q_choices", [[1], [1, 4, 8]], ids=["decode", "mixed"])
def test_split_kv(device, num_splits, q_choices):
    # 32 splits over short contexts leave most splits empty; they must contribute
    # nothing and produce no NaN.
    rng = random.Random(num_splits * 7 + len(q_choices))
    q_lens, ctx = random_lens(4, q_choices, 300, rng)
    q_lens[0], ctx[0] = 1, 0  # a request whose only key is its own token
    b = make_paged_batch(
        q_lens,
        ctx,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.float16,
        device=device,
        pad_reqs=2,
        pad_tokens=3,
    )
    run_and_check(b, torch.float16, num_splits=num_splits)


@pytest.mark.parametrize("block_m, block_n", [(32, 32), (16, 128)])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_explicit_launch_configs(device, block_m, block_n, num_splits):
    b = make_paged_batch(
        [1, 6, 1],
        [40, 20, 90],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.float16,
        device=device,
        pad_reqs=1,
        pad_tokens=1,
    )
    cfg = AttentionLaunchConfig(
        block_m=block_m,
        block_q=block_m // 4,
        block_n=block_n,
        num_splits=num_splits,
        num_warps=4,
        num_stages=2,
    )
    run_and_check(b, torch.float16, config=cfg)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_padded_requests_and_tokens(device, num_splits):
    b = make_paged_batch(
        [1, 3, 1],
        [17, 40, 64],
        num_q_heads=4,
        num_kv_heads=1,
        head_dim=64,
        dtype=torch.float32,
        device=device,
        pad_reqs=3,
        pad_tokens=5,
    )
    run_and_check(b, torch.float32, num_splits=num_splits, max_query_len=4)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("window", [1, 16, 37])
def test_sliding_window(device, window, num_splits):
    b = make_paged_batch(
        [1, 6, 1, 19],
        [90, 50, 3, 30],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.float32,
        device=device,
    )
    run_and_check(b, torch.float32, sliding_window=window, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_softcap(device, num_splits):
    b = make_paged_batch(
        [1, 5, 2],
        [60, 31, 0],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.float32,
        device=device,
    )
    b.q.mul_(4.0)  # large scores, so the cap changes the result
    out = run_and_check(b, torch.float32, softcap=5.0, num_splits=num_splits)
    plain = paged_attention_ref(
        b.q, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_table, 64**-0.5
    )
    assert (out.double() - plain).abs().max() > 1e-2, "softcap had no effect: test is blind"


# (q_lens, ctx_lens, heads, head_dim, dtype, block_m, block_n, splits, window, softcap)
PREFETCH_CASES = {
    "decode_splits": ([1, 1, 1], [257, 40, 700], (9, 3), 64, torch.float16, 16, 64, 4, None,
                      None),
    "decode_one_split": ([1, 1], [300, 77], (9, 3), 64, torch.float32, 16, 32, 1, None, None),
    "verify": ([4, 2, 1], [130, 61, 5], (8, 2), 64, torch.float32, 16, 32, 2, None, None),
    "window": ([1, 3, 1], [200, 90, 9], (4, 2), 64, torch.float32, 16, 32, 1, 37, None),
    "softcap": ([1, 2], [150, 33], (4, 2), 64, torch.float32, 16, 32, 2, None, 5.0),
    "odd_head_dim": ([1, 3], [140, 20], (4, 1), 48, torch.float16, 16, 32, 1, None, None),
    "prefill_tiles": ([40, 1], [70, 100], (4, 2), 32, torch.float32, 64, 32, 1, None, None),
}  # fmt: skip


@pytest.mark.parametrize("ahead", [1, 2])
@pytest.mark.parametrize("case", list(PREFETCH_CASES))
def test_prefetched_tiles_equal_the_loop_bitwise(device, case, ahead):
    """AttentionLaunchConfig.prefetch (the loads of the masked key tiles run one or two
    tiles ahead in registers) gives the same bits as the loop that loads each tile itself, over
    several tiles a program: decode with and without splits, verification, a window,
    a softcap, a padded head dim, and a prefill tile whose full tiles come first."""
    q_lens, ctx, heads, d, dtype, bm, bn, splits, window, cap = PREFETCH_CASES[case]
    b = make_paged_batch(q_lens, ctx, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=d,
                         dtype=dtype, device=device, pad_reqs=1, pad_tokens=2)  # fmt: skip
    b.q.mul_(3.0)  # scores past the softcap
    qpk = heads[0] // heads[1]
    cfg = AttentionLaunchConfig(bm, max(1, bm // qpk), bn, splits, 4, 2)
    plain = run_and_check(b, dtype, sliding_window=window, softcap=cap, config=cfg)
    got = run_and_check(b, dtype, sliding_window=window, softcap=cap,
                        config=replace(cfg, prefetch=ahead))  # fmt: skip
    assert torch.equal(got, plain)


@pytest.mark.parametrize(
    "bound, contexts",
    [(1024, ([300, 511, 1023], [40, 700, 512])), (1536, ([95, 1535, 1025], [600, 97, 1024]))],
)
def test_short_bound_decode_takes_32_key_tiles_and_matches_the_reference(
    device, bound, contexts, tiled_rule
):
    """One token a request at length bounds of 1024 and 1536 with SmolLM2's 9 / 3 x 64
    heads in fp16: the chosen launch (32-key tiles, 16 splits) against float64, contexts
    on both sides of the splits' cuts and one that fills the bound; NaN-poisoned out."""
    cfg = choose_launch_config(num_tokens=3, num_reqs=3, max_query_len=1, num_q_heads=9,
                               num_kv_heads=3, head_dim=64, max_seq_len=bound)  # fmt: skip
    assert (cfg.block_n, cfg.num_splits) == (32, 16)
    for ctx in contexts:
        b = make_paged_batch([1, 1, 1], ctx, num_q_heads=9, num_kv_heads=3, head_dim=64,
                             dtype=torch.float16, device=device)  # fmt: skip
        b.max_seq_len = bound  # the descriptor's bound, as a captured graph has it
        run_and_check(b, torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "heads, head_dim", [((9, 3), 64), ((32, 8), 128)], ids=["smollm2", "llama"]
)
@pytest.mark.parametrize("block_n, splits", [(128, 1), (64, 8), (256, 1)])
def test_gpu_prefetched_tiles_equal_the_loop_bitwise(heads, head_dim, block_n, splits):
    """bf16 on the GPU, where the two loops compile apart (registers against the
    compiler's shared-memory stages): decode and 4-token verification over contexts of
    one to dozens of tiles a program, the same bits."""
    b = make_paged_batch([1, 4, 1, 1], [257, 1000, 4000, 31], num_q_heads=heads[0],
                         num_kv_heads=heads[1], head_dim=head_dim, dtype=torch.bfloat16,
                         device="cuda", pad_reqs=1, pad_tokens=2)  # fmt: skip
    qpk = heads[0] // heads[1]
    bm = max(16, triton.next_power_of_2(4 * qpk))
    cfg = AttentionLaunchConfig(bm, bm // qpk, block_n, splits, 8 if block_n > 128 else 4, 2)
    plain = run_and_check(b, torch.bfloat16, config=cfg)
    for ahead in (1, 2):
        got = run_and_check(b, torch.bfloat16, config=replace(cfg, prefetch=ahead))
        assert torch.equal(got, plain), ahead


def test_fp32_on_strided_cache_view(device):
    # One [2, num_blocks, ...] allocation viewed as K and V, as a runtime may allocate it.
    b = make_paged_batch(
        [2, 1],
        [20, 45],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.float32,
        device=device,
    )
    kv = torch.stack([b.k_cache, b.v_cache])
    b.k_cache, b.v_cache = kv[0], kv[1]
    run_and_check(b, torch.float32)


def _verify_vs_decode(device, dtype, heads, head_dim, ctx_lens, q_len, bound, num_splits):
    """Rows of one verification step (each request's q_len tokens after ctx_lens[r]
    committed ones, ragged in one batch) against the same tokens decoded one a step,
    the whole batch in each step, over the same cache: the (token, context) pairs whose
    output differs in any bit. Decode and verification at one batch size take the same
    split count; a lone request would take more splits than a batch of 13 and so
    other bits (not a claim the engine makes: its decode runs the verified batch)."""
    hq, hkv = heads
    bs = 16
    per_req = -(-bound // bs)
    gen = torch.Generator(device=device).manual_seed(sum(ctx_lens) + q_len)
    n = len(ctx_lens)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    blocks = n * per_req + 1
    k_cache, v_cache = rnd(blocks, bs, hkv, head_dim), rnd(blocks, bs, hkv, head_dim)
    table = torch.randperm(n * per_req + 1, generator=gen, device=device)[: n * per_req]
    table = table.view(n, per_req).to(torch.int32)
    q = rnd(n * q_len, hq, head_dim)
    i32 = dict(dtype=torch.int32, device=device)
    kw = dict(max_seq_len=bound, num_splits=num_splits)
    scale = head_dim**-0.5
    block = paged_attention(
        q, k_cache, v_cache, torch.arange(n + 1, **i32) * q_len,
        torch.tensor([c + q_len for c in ctx_lens], **i32), table, scale,
        max_query_len=q_len, **kw,
    )  # fmt: skip
    bad = []
    for i in range(q_len):
        # Decode step i of the whole batch: every request's token i alone, as target-only
        # decoding at this batch size runs it (the same launch bounds but the width).
        step = paged_attention(
            q[i::q_len].contiguous(), k_cache, v_cache, torch.arange(n + 1, **i32),
            torch.tensor([c + i + 1 for c in ctx_lens], **i32), table, scale,
            max_query_len=1, **kw,
        )  # fmt: skip
        for r, ctx in enumerate(ctx_lens):
            if not torch.equal(step[r], block[r * q_len + i]):
                bad.append((i, ctx))
    return bad


def test_verified_rows_equal_decoded_rows_bitwise(device):
    """With splits, each row takes its own context's split of the keys, as a decode step
    of that token alone does: fp32, 4 splits of 32-key tiles, 2 tokens after 127
    committed ones (row 0 sees 4 tiles, 1 key a split; the request 5 tiles, 2 a split:
    the request's cut gave row 0 other bits) beside requests with no such change.
    2 tokens: under the interpreter numpy's matmul rounds rows 6 and up of a tile
    apart from the same row at the top of one, so a CPU check of more rows cannot hold
    (the GPU test takes 4)."""
    cfg = choose_launch_config(num_tokens=6, num_reqs=3, max_query_len=2, num_q_heads=6,
                               num_kv_heads=2, head_dim=32, element_size=4)  # fmt: skip
    assert cfg.block_n == 32
    bad = _verify_vs_decode(device, torch.float32, (6, 2), 32, [127, 61, 95], 2, 256, 4)
    assert not bad, bad


@pytest.mark.gpu
@pytest.mark.parametrize(
    "heads, head_dim", [((9, 3), 64), ((32, 8), 128)], ids=["smollm2", "llama"]
)
@pytest.mark.parametrize("q_len", [2, 4])
def test_gpu_verified_rows_equal_decoded_rows_bitwise(heads, head_dim, q_len):
    """bf16 and the default launch configuration at the main job's length bound (1024),
    contexts across every change of the split cut (16 splits of 32-key tiles: 512 keys).
    The widths (k 1 and 3) keep decode's tile, which holds up to 16 / (q heads per KV
    head) tokens; wider verification takes 128-key tiles and is not bit-equal."""
    ctx = [20, 61, 126, 300, 505, 507, 508, 509, 510, 511, 512, 600, 1000]
    bad = _verify_vs_decode("cuda", torch.bfloat16, heads, head_dim, ctx, q_len, 1024, None)
    assert not bad, bad


# ---- launch configuration is a function of descriptor bounds only ------------------


def test_launch_config_depends_only_on_bounds(tiled_rule):
    kw = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, num_sms_on_device=132)
    decode = choose_launch_config(num_tokens=64, num_reqs=64, max_query_len=1, **kw)
    assert decode.block_m == 16 and decode.block_q == 4
    verify = choose_launch_config(num_tokens=256, num_reqs=64, max_query_len=4, **kw)
    assert verify.block_m == 16 and verify.block_q == 4
    small = choose_launch_config(num_tokens=1, num_reqs=1, max_query_len=1, **kw)
    assert (small.block_n, small.num_splits) == (128, 32)
    prefill = choose_launch_config(num_tokens=8192, num_reqs=1, max_query_len=8192, **kw)
    assert prefill.block_m == 128 and prefill.num_splits == 1
    capped = choose_launch_config(num_tokens=1, num_reqs=1, max_query_len=1, max_seq_len=512, **kw)
    assert capped.num_splits == 4


@pytest.mark.parametrize(
    "heads, head_dim, batch, q_len, bound, want",
    [
        ((32, 8), 128, 1, 1, None, (128, 32, 3)),  # one wave: 128-key tiles, ~3 an SM
        ((32, 8), 128, 24, 1, None, (128, 2, 2)),  # > 2 programs an SM: two stages
        ((32, 8), 128, 32, 1, None, (128, 1, 3)),
        ((32, 8), 128, 64, 1, None, (64, 1, 3)),  # several waves: 64-key tiles
        ((32, 8), 128, 8, 8, None, (128, 4, 3)),  # verification tiles of 32 rows
        ((32, 8), 128, 1, 1, 8192, (128, 32, 3)),
        ((9, 3), 64, 1, 1, 1024, (32, 16, 2)),  # the bound caps the splits: 32-key tiles
        ((9, 3), 64, 8, 1, 1024, (32, 16, 2)),
        ((9, 3), 64, 1, 1, 1064, (32, 16, 2)),  # (at bounds 513-2047: 8 splits of 64 keys
        ((9, 3), 64, 8, 1, 2047, (32, 16, 2)),  # or fewer without the rule)
        ((9, 3), 64, 1, 1, 2048, (64, 16, 2)),
        ((12, 12), 64, 8, 1, 1064, (128, 4, 3)),  # a grid of about one wave: 128-key tiles
        ((9, 3), 64, 1, 1, 512, (64, 4, 2)),
        ((9, 3), 64, 1, 1, 320, (128, 1, 3)),  # ... or one: no merge launch
        ((9, 3), 64, 16, 1, 1024, (128, 4, 3)),  # ... or half
        ((9, 3), 64, 256, 1, 1024, (64, 1, 2)),
    ],
)
def test_launch_config_choice(heads, head_dim, batch, q_len, bound, want, tiled_rule):
    """The measured choice (bench/NOTES.md, stops 43, 56 and 58) in each of its regions on 132 SMs:
    (key tile, splits, pipeline stages)."""
    cfg = choose_launch_config(num_tokens=batch * q_len, num_reqs=batch, max_query_len=q_len,
                               num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                               max_seq_len=bound, num_sms_on_device=132)  # fmt: skip
    assert (cfg.block_n, cfg.num_splits, cfg.num_stages) == want


# ---- bad input: clear errors, nothing launched --------------------------------------


def _good(device):
    return make_paged_batch(
        [1, 2],
        [5, 9],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.float32,
        device=device,
    )


def _cfg(**over):
    """A valid launch configuration for _good's heads (2 q heads a KV head), with `over`."""
    return replace(AttentionLaunchConfig(16, 8, 64, 1, 4, 2), **over)


def _call(b, fn=paged_attention, **over):
    args = dict(
        q=b.q,
        k_cache=b.k_cache,
        v_cache=b.v_cache,
        query_start_loc=b.query_start_loc,
        seq_lens=b.seq_lens,
        block_table=b.block_table,
        scale=0.125,
    )
    kwargs = {k: over.pop(k) for k in list(over) if k not in args}
    args.update(over)
    return fn(*args.values(), **kwargs)


@pytest.mark.parametrize(
    "change, exc, words",
    [
        (lambda b: {"q": b.q.half()}, TypeError, "q dtype"),
        (lambda b: {"q": b.q[:, :3]}, ValueError, "multiple of num_kv_heads"),
        (lambda b: {"q": b.q[..., :32]}, ValueError, "head_dim"),
        (lambda b: {"q": b.q[0]}, ValueError, "q must have 3 dimensions"),
        (lambda b: {"query_start_loc": b.query_start_loc.long()}, TypeError, "query_start_loc"),
        (lambda b: {"seq_lens": b.seq_lens[:1]}, ValueError, "seq_lens"),
        (lambda b: {"block_table": b.block_table[:1]}, ValueError, "block_table"),
        (lambda b: {"block_table": b.block_table.t()}, ValueError, "block_table"),
        (lambda b: {"v_cache": b.v_cache[:, :, :1]}, ValueError, "v_cache"),
        (
            lambda b: {"k_cache": b.k_cache[:, :12], "v_cache": b.v_cache[:, :12]},
            ValueError,
            "block_size",
        ),
        (lambda b: {"scale": -1.0}, ValueError, "scale"),
        (lambda b: {"softcap": 0.0}, ValueError, "softcap"),
        (lambda b: {"sliding_window": 0}, ValueError, "sliding_window"),
        (lambda b: {"num_splits": 3}, ValueError, "num_splits"),
        (lambda b: {"max_query_len": 0}, ValueError, "max_query_len"),
        (lambda b: {"out": torch.empty(5, 4, 64)}, ValueError, "out"),
        (lambda b: {"q": "not a tensor"}, TypeError, "q must be a torch.Tensor"),
        # an explicit launch configuration (4 q heads over 2 KV heads: block_q <= 16 // 2)
        (lambda b: {"config": (16, 8, 64, 1, 4, 2)}, TypeError, "config must be an Attention"),
        (lambda b: {"config": _cfg(block_q=16)}, ValueError, r"config.block_q .* = 8\], got 16"),
        (lambda b: {"config": _cfg(block_q=0)}, ValueError, "config.block_q"),
        (lambda b: {"config": _cfg(block_m=24)}, ValueError, "config.block_m .* got 24"),
        (lambda b: {"config": _cfg(block_n=48)}, ValueError, "config.block_n .* got 48"),
        (lambda b: {"config": _cfg(num_splits=3)}, ValueError, "config.num_splits .* got 3"),
        (lambda b: {"config": _cfg(num_warps=64)}, ValueError, r"config.num_warps .* 32\]"),
        (lambda b: {"config": _cfg(num_stages=0)}, ValueError, "config.num_stages .* got 0"),
        (lambda b: {"config": _cfg(prefetch=3)}, ValueError, "config.prefetch must be 0, 1 or 2"),
        (lambda b: {"config": _cfg(prefetch="2")}, TypeError, "config.prefetch must be an int"),
        (lambda b: {"config": _cfg(), "num_splits": 4}, ValueError, "num_splits 4 conflicts"),
    ],
)
@pytest.mark.parametrize("unmerged", [False, True], ids=["merged", "unmerged"])
def test_bad_input_raises_and_writes_nothing(device, change, exc, words, unmerged):
    """Both launchers (paged_attention, paged_attention_unmerged) check the same."""
    b = _good(device)
    out = torch.full_like(b.q, 7.0)
    over = change(b)
    over.setdefault("out", out)
    fn = kernels.paged_attention_unmerged if unmerged else paged_attention
    with pytest.raises(exc, match=words):
        _call(b, fn, **over)
    assert torch.equal(out, torch.full_like(b.q, 7.0))


def test_combine_splits_takes_only_attention_splits(device):
    b = _good(device)
    out, splits = kernels.paged_attention_unmerged(
        b.q, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_table, 0.125,
        num_splits=4,
    )  # fmt: skip
    assert splits is not None
    out.fill_(7.0)
    snap = [t.clone() for t in (out, splits.part_out, splits.part_lse)]
    with pytest.raises(TypeError, match="splits must be an AttentionSplits"):
        kernels.combine_splits((splits.part_out, splits.part_lse))
    assert all(torch.equal(a, b) for a, b in zip(snap, (out, splits.part_out, splits.part_lse)))
    assert kernels.combine_splits(splits) is out and bool(torch.isfinite(out).all())
    ref = paged_attention(b.q, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens,
                          b.block_table, 0.125, num_splits=4)  # fmt: skip
    assert torch.equal(out, ref)


def test_combine_ignores_partials_of_empty_splits(device):
    """The merge loads every split's partial together with its lse (no load waits for an
    lse) and keeps only the splits that hold keys: NaN, infinite or huge values in an
    empty split's partial change no bit of the merged output (_merge_splits' select and
    clamp; without both the NaN leaks)."""
    b = _good(device)
    out, splits = kernels.paged_attention_unmerged(
        b.q, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_table, 0.125,
        num_splits=4,
    )  # fmt: skip
    tokens = int(b.query_start_loc[-1])
    empty = splits.part_lse[:, :tokens] == float("-inf")  # [splits, tokens, heads]
    assert empty.any() and (~empty).any(), "the batch must leave some splits empty"
    want = kernels.combine_splits(splits).clone()
    for poison in (float("nan"), float("inf"), float("-inf"), 1e30, -1e30):
        part = splits.part_out[:, :tokens]
        part[empty] = poison
        out.fill_(7.0)
        assert torch.equal(kernels.combine_splits(splits), want), poison


# ---- GPU: bf16, large shapes, > 2^31-element cache, CUDA-graph replay --------------


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(32, 8), (32, 32), (64, 8)], ids=["gqa4", "gqa1", "gqa8"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_gpu_bf16_mixed(heads, head_dim):
    rng = random.Random(heads[0] + heads[1] + head_dim)
    for q_choices, ctx_max in (([1], 5000), ([1, 4, 8], 3000), ([1, 1, 7, 300], 2000)):
        q_lens, ctx = random_lens(rng.randint(3, 24), q_choices, ctx_max, rng)
        b = make_paged_batch(
            q_lens,
            ctx,
            num_q_heads=heads[0],
            num_kv_heads=heads[1],
            head_dim=head_dim,
            dtype=torch.bfloat16,
            device="cuda",
            pad_reqs=2,
            pad_tokens=7,
        )
        run_and_check(b, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 16])
def test_gpu_window_softcap_bf16(num_splits):
    b = make_paged_batch(
        [1, 4, 1, 900],
        [4000, 1000, 10, 100],
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        dtype=torch.bfloat16,
        device="cuda",
        pad_reqs=1,
        pad_tokens=2,
    )
    run_and_check(b, torch.bfloat16, sliding_window=1000, softcap=30.0, num_splits=num_splits)


@pytest.mark.gpu
def test_gpu_long_prefill_bf16():
    b = make_paged_batch(
        [2048, 1, 3],
        [0, 8000, 500],
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        dtype=torch.bfloat16,
        device="cuda",
    )
    run_and_check(b, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_cache_over_2_31_elements():
    # 16 * 8 * 128 elements per block: block ids from 2^17 up put addresses past 2^31.
    block_size, hkv, d = 16, 8, 128
    first = (1 << 31) // (block_size * hkv * d)
    num_blocks = first + 600
    k_cache = torch.empty(num_blocks, block_size, hkv, d, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.empty_like(k_cache)
    assert k_cache.numel() > 2**31
    b = make_paged_batch(
        [1, 5, 1],
        [3000, 2000, 4000],
        num_q_heads=32,
        num_kv_heads=hkv,
        head_dim=d,
        dtype=torch.bfloat16,
        device="cuda",
    )
    # Move every request's blocks (and their contents) above block `first`.
    used = b.k_cache.shape[0]
    k_cache[first : first + used] = b.k_cache
    v_cache[first : first + used] = b.v_cache
    b.k_cache, b.v_cache = k_cache, v_cache
    b.block_table = b.block_table + first
    for num_splits in (1, 8):
        run_and_check(b, torch.bfloat16, num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch", [0, 1, 2], ids=["loop", "ahead1", "ahead2"])
@pytest.mark.parametrize("num_splits", [1, 8])
def test_gpu_graph_replay_with_new_lengths(num_splits, prefetch):
    """Capture once with one set of lengths; replay with others that fit the bounds
    (prefetch: the masked key tiles' loads run ahead, over a loop of any length)."""
    max_tokens, max_reqs, max_q, hq, hkv, d, bs = 96, 16, 8, 32, 8, 128, 16
    max_blocks, num_blocks = 256, 4096
    dev = "cuda"
    k_cache = torch.randn(num_blocks, bs, hkv, d, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    q_buf = torch.empty(max_tokens, hq, d, device=dev, dtype=torch.bfloat16)
    out_buf = torch.empty_like(q_buf)
    qsl_buf = torch.zeros(max_reqs + 1, dtype=torch.int32, device=dev)
    seq_buf = torch.zeros(max_reqs, dtype=torch.int32, device=dev)
    bt_buf = torch.zeros(max_reqs, max_blocks, dtype=torch.int32, device=dev)
    rng = random.Random(num_splits)

    def fill(num_reqs: int) -> PagedBatch:
        q_lens = [rng.randint(1, max_q) for _ in range(num_reqs)]
        ctx = [rng.randint(0, 3000) for _ in range(num_reqs)]
        total = sum(q_lens)
        qsl = [0]
        for n in q_lens:
            qsl.append(qsl[-1] + n)
        qsl += [total] * (max_reqs - num_reqs)
        seq = [c + q for c, q in zip(ctx, q_lens)] + [0] * (max_reqs - num_reqs)
        perm = torch.randperm(num_blocks, device=dev).to(torch.int32)
        bt_buf.copy_(perm[: max_reqs * max_blocks].view(max_reqs, max_blocks))
        qsl_buf.copy_(torch.tensor(qsl, dtype=torch.int32))
        seq_buf.copy_(torch.tensor(seq, dtype=torch.int32))
        q_buf.normal_()
        out_buf.fill_(float("nan"))
        return PagedBatch(
            q_buf, k_cache, v_cache, qsl_buf, seq_buf, bt_buf, total, max(q_lens), max(seq)
        )

    cfg = choose_launch_config(num_tokens=max_tokens, num_reqs=max_reqs, max_query_len=max_q,
                               num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                               num_splits=num_splits)  # fmt: skip
    cfg = replace(cfg, prefetch=prefetch)

    def step():
        paged_attention(
            q_buf, k_cache, v_cache, qsl_buf, seq_buf, bt_buf, d**-0.5, out=out_buf,
            max_query_len=max_q, config=cfg,
        )  # fmt: skip

    fill(max_reqs)
    step()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for num_reqs in (1, 3, 16, 7, 12):
        b = fill(num_reqs)
        graph.replay()
        torch.cuda.synchronize()
        ref = paged_attention_ref(
            b.q, k_cache, v_cache, qsl_buf, seq_buf, bt_buf, d**-0.5, dtype=torch.float32
        )
        out = out_buf
        assert not torch.isnan(out).any()
        real = b.num_real_tokens
        assert torch.equal(out[real:], torch.zeros_like(out[real:]))
        err = (out[:real].float() - ref[:real]).norm() / ref[:real].norm()
        assert err < TOL[torch.bfloat16], f"num_reqs={num_reqs}: relative error {err:.3e}"


def test_many_requests_binary_search_path(device):
    # A deep binary search for each tile's request (9 halvings over 300 requests; every
    # request count takes the same search, so more requests only add programs); padded
    # requests and tokens ride along.
    rng = random.Random(5)
    q_lens, ctx = random_lens(300, [1, 1, 2], 20, rng)
    b = make_paged_batch(
        q_lens,
        ctx,
        num_q_heads=1,
        num_kv_heads=1,
        head_dim=16,
        dtype=torch.float32,
        device=device,
        pad_reqs=3,
        pad_tokens=2,
    )
    run_and_check(b, torch.float32)
