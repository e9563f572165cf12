"""The token programs (kernels/token_attention.py) against the float64 reference.

CPU runs force the launch (AttentionLaunchConfig(per_token=True)) with 16-key chunks, so
small contexts cross chunk boundaries, take the in-launch merge and run past the grid's
last chunk; tests marked gpu run bf16 at the shapes choose_launch_config gives them."""

from __future__ import annotations

import random

import pytest
import torch

from specdraft.kernels import paged_attention
from specdraft.kernels.paged_attention import AttentionLaunchConfig, choose_launch_config
from specdraft.kernels.token_attention import TICKETS
from tests.batch import make_paged_batch
from tests.reference import paged_attention_ref
from tests.test_paged_attention import _verify_vs_decode, run_and_check


def _cfg(chunk: int = 16, splits: int = 3, warps: int = 4) -> AttentionLaunchConfig:
    return AttentionLaunchConfig(16, 1, chunk, splits, warps, 1, per_token=True)


def _tickets_zero() -> bool:
    return all(int(buf.abs().sum()) == 0 for buf in TICKETS._live.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "q_choices, window, softcap",
    [([1], None, None), ([1, 2, 3, 5], None, None), ([1, 4], 7, None), ([1, 3], 40, 3.0)],
    ids=["decode", "verify", "window", "window_softcap"],
)
@pytest.mark.parametrize("heads", [(4, 2), (3, 1)], ids=["gqa2", "gqa3"])
def test_token_programs_match_the_reference(device, dtype, q_choices, window, softcap, heads):
    """Contexts 0-90 over 16-key chunks: one chunk, several merged in the launch, and
    past the grid's 3 (its last program walks the rest); padded requests and tokens
    zero; the tickets back at zero."""
    rng = random.Random(hash((str(dtype), tuple(q_choices), window, heads)) % 1000)
    q_lens = [rng.choice(q_choices) for _ in range(4)]
    ctx = [0, rng.randint(1, 15), rng.randint(16, 47), rng.randint(48, 90)]
    g = torch.Generator().manual_seed(len(q_lens) + ctx[-1])
    b = make_paged_batch(q_lens, ctx, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=32,
                         dtype=dtype, device=device, pad_reqs=1, pad_tokens=2,
                         generator=g)  # fmt: skip
    run_and_check(b, dtype, config=_cfg(), sliding_window=window, softcap=softcap)
    assert _tickets_zero()


@pytest.mark.parametrize("splits", [1, 2])
def test_head_dim_not_a_power_of_two(device, splits):
    b = make_paged_batch([1, 2], [20, 33], num_q_heads=4, num_kv_heads=2, head_dim=40,
                         device=device, generator=torch.Generator().manual_seed(3))  # fmt: skip
    run_and_check(b, torch.float32, config=_cfg(splits=splits))


def test_tokens_no_request_covers_get_zeros(device):
    """query_start_loc [0, 1, 1, 3] over 5 tokens with request 1 empty, then padding;
    and [2, 3, 4] (tokens 0-1 before the first request): every token outside a request
    is zero, the rest match the reference."""
    g = torch.Generator().manual_seed(5)
    for qsl, q_lens in (([0, 1, 1, 3], [1, 0, 2]), ([2, 3, 4], [1, 1])):
        b = make_paged_batch(q_lens, [30] * len(q_lens), num_q_heads=4, num_kv_heads=2,
                             head_dim=32, device=device, generator=g)  # fmt: skip
        q = torch.randn(5, 4, 32, generator=g).to(device)
        qsl_t = torch.tensor(qsl, dtype=torch.int32, device=device)
        out = torch.full_like(q, float("nan"))
        kw = dict(max_query_len=2, max_seq_len=64, config=_cfg())
        args = (q, b.k_cache, b.v_cache, qsl_t, b.seq_lens, b.block_table, 32**-0.5)
        from specdraft.kernels import validation

        with validation.use_validation(False):
            paged_attention(*args, out=out, **kw)
        ref = paged_attention_ref(*args)
        covered = torch.zeros(5, dtype=torch.bool)
        for r in range(len(qsl) - 1):
            covered[qsl[r] : qsl[r + 1]] = True
        assert torch.equal(out[~covered], torch.zeros_like(out[~covered]))
        err = (out[covered].double() - ref[covered]).abs().max()
        assert err < 1e-4, err


def test_garbage_metadata_stays_in_bounds(device):
    """Lengths past the table, negative ones, block ids outside the cache, a decreasing
    query_start_loc: no error, every output finite, nothing written outside `out`."""
    g = torch.Generator().manual_seed(11)
    blocks, bs, hq, hkv, d = 6, 16, 4, 2, 32
    k = torch.randn(blocks, bs, hkv, d, generator=g).to(device)
    v = torch.randn(blocks, bs, hkv, d, generator=g).to(device)
    q = torch.randn(6, hq, d, generator=g).to(device)
    i32 = dict(dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 3, 1, 6], **i32)
    seq = torch.tensor([500, -4, 7], **i32)
    table = torch.tensor([[0, 99, -3, 2], [5, 4, 3, 2], [1, 1, 1, 1]], **i32)
    big = torch.full((8, hq, d), 7.0, device=device)
    out = big[1:7]
    from specdraft.kernels import validation

    with validation.use_validation(False):
        paged_attention(q, k, v, qsl, seq, table, d**-0.5, out=out, max_query_len=3,
                        max_seq_len=64, config=_cfg(splits=2))  # fmt: skip
    assert torch.isfinite(out).all()
    assert (big[0] == 7.0).all() and (big[7] == 7.0).all()
    assert _tickets_zero()


def test_verified_rows_equal_decoded_rows_bitwise(device, monkeypatch):
    """choose_launch_config gives decode and verification of one batch the same token
    launch (on 132 SMs), and the verified rows carry the decoded rows' bits: one chunk,
    two, and three merged in the launch."""
    import importlib

    pa = importlib.import_module("specdraft.kernels.paged_attention")
    monkeypatch.setattr(pa, "num_sms", lambda dev: 132)
    for q_len in (1, 3):
        cfg = choose_launch_config(num_tokens=3 * q_len, num_reqs=3, max_query_len=q_len,
                                   num_q_heads=6, num_kv_heads=2, head_dim=32, max_seq_len=768,
                                   element_size=4)  # fmt: skip
        assert cfg.per_token and cfg.block_n == 256 and cfg.num_splits == 3, cfg
    bad = _verify_vs_decode(device, torch.float32, (6, 2), 32, [126, 300, 600], 3, 768, None)
    assert not bad, bad
    assert _tickets_zero()


def test_launch_rule():
    """Token programs where a program per (request, head, chunk of the bound) fits one
    wave, for queries of up to 8 tokens; the tiled kernel past that, without a bound,
    or when the caller fixes the splits."""
    kw = dict(num_q_heads=9, num_kv_heads=3, head_dim=64, num_sms_on_device=132)
    one = choose_launch_config(num_tokens=1, num_reqs=1, max_query_len=1, max_seq_len=1024, **kw)
    assert one.per_token and (one.block_n, one.num_splits, one.num_warps) == (256, 4, 8)
    four = choose_launch_config(num_tokens=4, num_reqs=1, max_query_len=4, max_seq_len=1024, **kw)
    assert four == one  # decode and verification: the same launch
    assert not choose_launch_config(num_tokens=9, num_reqs=1, max_query_len=9, max_seq_len=1024,
                                    **kw).per_token  # fmt: skip
    assert not choose_launch_config(num_tokens=8, num_reqs=8, max_query_len=1, max_seq_len=1024,
                                    **kw).per_token  # 288 programs  # fmt: skip
    assert choose_launch_config(num_tokens=8, num_reqs=8, max_query_len=1, max_seq_len=256,
                                **kw).per_token  # fmt: skip
    assert not choose_launch_config(num_tokens=1, num_reqs=1, max_query_len=1, **kw).per_token
    assert not choose_launch_config(num_tokens=1, num_reqs=1, max_query_len=1, max_seq_len=1024,
                                    num_splits=4, **kw).per_token  # fmt: skip
    one_head = dict(num_q_heads=1, num_kv_heads=1, head_dim=64, num_sms_on_device=132)
    assert choose_launch_config(num_tokens=1, num_reqs=1, max_query_len=1, max_seq_len=64 * 256,
                                **one_head).per_token  # 64 chunks  # fmt: skip
    assert not choose_launch_config(num_tokens=1, num_reqs=1, max_query_len=1,
                                    max_seq_len=64 * 256 + 1, **one_head).per_token  # fmt: skip
    llama = choose_launch_config(num_tokens=1, num_reqs=1, max_query_len=1, max_seq_len=512,
                                 num_q_heads=32, num_kv_heads=8, head_dim=128)  # fmt: skip
    assert llama.per_token and (llama.block_n, llama.num_splits) == (128, 4)


def test_launch_rule_with_a_walk(monkeypatch):
    """TOKEN_WALK > 1: past one wave, as many programs a (request, head) as the wave
    holds, the last one walking the rest of the bound's chunks, at most TOKEN_WALK."""
    import importlib

    pa = importlib.import_module("specdraft.kernels.paged_attention")
    kw = dict(num_q_heads=9, num_kv_heads=3, head_dim=64, num_sms_on_device=132,
              max_query_len=1, max_seq_len=1024)  # fmt: skip
    assert not choose_launch_config(num_tokens=4, num_reqs=4, **kw).per_token  # the default
    monkeypatch.setattr(pa, "TOKEN_WALK", 2)
    four = choose_launch_config(num_tokens=4, num_reqs=4, **kw)  # 132 // 36 = 3 programs
    assert four.per_token and four.num_splits == 3, four
    assert not choose_launch_config(num_tokens=8, num_reqs=8, **kw).per_token  # walk 4
    one = choose_launch_config(num_tokens=1, num_reqs=1, **kw)
    assert one.per_token and one.num_splits == 4  # one wave holds every chunk: no walk
    monkeypatch.setattr(pa, "TOKEN_WALK", 4)
    eight = choose_launch_config(num_tokens=8, num_reqs=8, **kw)
    assert eight.per_token and eight.num_splits == 1, eight
    # more (request, head) pairs than SMs: the tiled kernel, whatever the walk
    assert not choose_launch_config(num_tokens=16, num_reqs=16, **kw).per_token


def test_bad_per_token_config_refused(device):
    b = make_paged_batch([1], [5], num_q_heads=4, num_kv_heads=2, head_dim=32, device=device)
    out = torch.full_like(b.q, 3.0)
    args = (b.q, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_table, 0.1)
    with pytest.raises(TypeError, match="config.per_token must be a bool"):
        paged_attention(
            *args, out=out, config=AttentionLaunchConfig(16, 1, 16, 3, 4, 1, per_token=1)
        )
    with pytest.raises(ValueError, match=r"config.num_splits must be a power of two .* got 3"):
        paged_attention(*args, out=out, config=AttentionLaunchConfig(16, 1, 16, 3, 4, 1))
    with pytest.raises(ValueError, match=r"config.num_splits must be an int in \[1, 64\], got 0"):
        paged_attention(*args, out=out, config=_cfg(splits=0))
    assert (out == 3.0).all()


# ---- GPU: bf16 at the shapes the rule gives --------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("heads, head_dim", [((9, 3), 64), ((32, 8), 128)],
                         ids=["smollm2", "llama"])  # fmt: skip
@pytest.mark.parametrize("q_len", [1, 4])
def test_gpu_bf16_against_the_reference(heads, head_dim, q_len):
    """Contexts around every chunk boundary of the bound (1024: 4 chunks of 256 keys for
    64-dim heads, 8 of 128 for 128-dim), and past the bound (the last program's walk).
    Our error against float64 within 2x the reference's own bf16 rounding error (plus
    1e-3 of its norm), per request."""
    ctx = [0, 1, 126, 127, 128, 129, 255, 256, 257, 511, 512, 700, 1000, 1400]
    torch.manual_seed(q_len + head_dim)
    for group in (ctx[:7], ctx[7:]):
        b = make_paged_batch([q_len] * len(group), group, num_q_heads=heads[0],
                             num_kv_heads=heads[1], head_dim=head_dim, dtype=torch.bfloat16,
                             device="cuda", pad_tokens=3, max_blocks=128)  # fmt: skip
        # The launch the rule gives one request on a GPU with enough SMs for it (on 132
        # Llama's heads take it up to bound 512), used for the whole batch.
        cfg = choose_launch_config(num_tokens=q_len, num_reqs=1, max_query_len=q_len,
                                   num_q_heads=heads[0], num_kv_heads=heads[1],
                                   head_dim=head_dim, max_seq_len=1024,
                                   num_sms_on_device=1024)  # fmt: skip
        assert cfg.per_token, cfg
        out = torch.full_like(b.q, float("nan"))
        scale = head_dim**-0.5
        args = (b.q, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_table, scale)
        paged_attention(*args, out=out, max_query_len=q_len, max_seq_len=1024, config=cfg)
        ref = paged_attention_ref(*args)
        real = b.num_real_tokens
        assert not torch.isnan(out).any()
        assert torch.equal(out[real:], torch.zeros_like(out[real:]))
        for r, c in enumerate(group):
            rows = slice(r * q_len, (r + 1) * q_len)
            want = ref[rows]
            ours = (out[rows].double() - want).norm()
            rounding = (want.to(torch.bfloat16).double() - want).norm()
            assert ours <= 2 * rounding + 1e-3 * want.norm(), (c, float(ours), float(rounding))
    assert _tickets_zero()


@pytest.mark.gpu
def test_gpu_graph_replay_with_new_lengths():
    """One capture (PDL) of the launch the rule gives SmolLM2's heads at batch 2 and
    bound 1024, replayed with lengths across one to four chunks and past the bound,
    each replay equal to an eager launch, bit for bit; the tickets stay at zero."""
    from specdraft.kernels import pdl_supported

    dev, hq, hkv, d, bs, width = "cuda", 9, 3, 64, 16, 96
    k_cache = torch.randn(256, bs, hkv, d, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(2, hq, d, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device=dev)
    seq = torch.zeros(2, dtype=torch.int32, device=dev)
    table = torch.randperm(256, device=dev)[: 2 * width].view(2, width).to(torch.int32)
    pdl = pdl_supported(dev)

    def step(o):
        return paged_attention(q, k_cache, v_cache, qsl, seq, table, d**-0.5, out=o,
                               max_query_len=1, max_seq_len=1024, pdl=pdl)  # fmt: skip

    seq.copy_(torch.tensor([300, 40]))
    step(out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(out)
    for lens in ([1, 256], [257, 1024], [700, 1300], [12, 513]):
        seq.copy_(torch.tensor(lens))
        q.normal_()
        out.fill_(float("nan"))
        graph.replay()
        eager = step(torch.full_like(out, float("nan")))
        torch.cuda.synchronize()
        assert torch.equal(out, eager), lens
        assert _tickets_zero()


@pytest.mark.gpu
def test_gpu_tickets_made_inside_a_capture_stay_that_graphs_own(monkeypatch):
    """A token launch captured before any eager one on the device: its tickets are made
    inside the capture, zeroed by that graph when it replays, so they are never handed
    to another launch (a second graph replayed first would read unzeroed memory: stop
    61's GPU suite). Both graphs, replayed in either order, equal the eager launch bit
    for bit; the eager launch then makes the shared, zeroed buffer."""
    import importlib

    ta = importlib.import_module("specdraft.kernels.token_attention")
    fresh = ta._Tickets()
    monkeypatch.setattr(ta, "TICKETS", fresh)
    dev, hq, hkv, d, bs, width = "cuda", 9, 3, 64, 16, 96
    k_cache = torch.randn(256, bs, hkv, d, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(2, hq, d, device=dev, dtype=torch.bfloat16)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device=dev)
    seq = torch.tensor([700, 300], dtype=torch.int32, device=dev)  # 3 and 2 chunks: merges
    table = torch.randperm(256, device=dev)[: 2 * width].view(2, width).to(torch.int32)
    outs = [torch.full_like(q, float("nan")) for _ in range(2)]
    graphs = [torch.cuda.CUDAGraph() for _ in range(2)]
    for graph, out in zip(graphs, outs):
        with torch.cuda.graph(graph):
            paged_attention(q, k_cache, v_cache, qsl, seq, table, d**-0.5, out=out,
                            max_query_len=1, max_seq_len=1024)  # fmt: skip
    assert not fresh._live, "a buffer made inside a capture must not be shared"
    for order in ((1, 0), (0, 1)):
        for i in order:
            outs[i].fill_(float("nan"))
            graphs[i].replay()
    eager = paged_attention(q, k_cache, v_cache, qsl, seq, table, d**-0.5, max_query_len=1,
                            max_seq_len=1024)  # fmt: skip
    torch.cuda.synchronize()
    assert len(fresh._live) == 1 and int(next(iter(fresh._live.values())).abs().sum()) == 0
    for out in outs:
        assert torch.equal(out, eager)
