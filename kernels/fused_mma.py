"""Decode-step projections for 9 to 64 rows on tensor cores, with fused_linear's prologue
and epilogue (RMSNorm, bias, gate/up with SiLU-and-multiply, residual) and the QKV
projection's rotary + K/V store.

fused_linear's rows kernel runs each row through FMA lanes: past 8 rows its arithmetic
grows with the rows, and the fused decode path stopped there (verification of 3 tokens
for 8 requests, 24 rows, then took cuBLAS and separate norm / rotary / SiLU launches, 1.4x
a decode step on the H200). Here a program takes BLOCK_M rows x BLOCK_N output columns
and runs K in BLOCK_K chunks through tl.dot (mma), so 32 rows cost about what 1 does:
~5 µs a launch on the H200 (SmolLM2's projections; the rows kernel takes 2.4 at 1 row
and 4.2 at 8, cuBLAS 4.4 without the fused prologue and epilogue). The SmolLM2 decode
step at 16 / 32 rows is 0.78 / 0.81 of the unfused one (stop 33).

Latency is what a decode-sized projection costs, so the program's weight slice is
prefetched into L2 before the programmatic-dependent-launch wait (the weights no kernel
writes), and after it the K loop reads W from L2 while x, just written by the kernel
before, streams in beside it. RMSNorm needs no pass of its own: x's sum of squares
accumulates in the K loop, the norm weight multiplies x chunk by chunk (the float32
product split into a 16-bit operand and its 16-bit remainder, two products, so nothing
is rounded that the rows kernel keeps), and the row's 1 / rms scales the float32
product at the end.

Rows are independent: a row's outputs do not depend on which other rows share its tile
or the step, so past MAX_ROWS a request gets the same bits whatever batch it is verified
or decoded in (they differ from the rows kernel's, which takes 1 to MAX_ROWS rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .guard import INTERPRET
from .launch import CachedLaunch, specialization_key


@triton.jit
def _prefetch_l2(ptrs):
    """prefetch.global.L2 for every address of `ptrs` (no result is read)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
        is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _prefetch_l1(ptrs):
    """prefetch.global.L1 for every address of `ptrs`: their lines into the SM's L1 (and
    L2 on the way), no register kept for them (GPU only: inline PTX)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L1 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
        is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _prefetch_rows(w_ptr, cols, live, K, stride_w, LINES: tl.constexpr):
    """The K-long rows `cols` [BLOCK_N, 1] of W into L2, a 128-byte line an element
    (addresses past a row's end clamped to its last element, rows not `live` to row 0)."""
    step: tl.constexpr = 1024 // w_ptr.dtype.element_ty.primitive_bitwidth
    kk = tl.minimum(tl.arange(0, LINES)[None, :] * step, K - 1)
    rows = tl.where(live, cols, 0).to(tl.int64)
    _prefetch_l2(w_ptr + rows * stride_w + kk)


@triton.jit
def _mma(a, w, acc, IEEE: tl.constexpr):
    """acc + a @ w^T, float32 accumulation (IEEE: full-precision float32 products)."""
    if IEEE:
        return tl.dot(a, tl.trans(w), acc, input_precision="ieee")
    return tl.dot(a, tl.trans(w), acc)


@triton.jit
def _epilogue(acc, acc_u, bias, bias_u, res, HAS_BIAS: tl.constexpr, GLU: tl.constexpr,
              RES: tl.constexpr):  # fmt: skip
    """The float32 output before its one rounding: bias, then silu(gate) * up (GLU),
    then the residual."""
    if HAS_BIAS:
        acc += bias
        if GLU:
            acc_u += bias_u
    if GLU:
        acc = acc / (1.0 + tl.exp(tl.minimum(-acc, 80.0))) * acc_u
    if RES:
        acc += res
    return acc


@triton.jit
def _rope_meta(jp, rows, M, pos_ptr, slot_ptr, cs_ptr, max_positions, stride_cs,
               HALF: tl.constexpr, NUM_Q_HEADS: tl.constexpr,
               NUM_KV_HEADS: tl.constexpr):  # fmt: skip
    """For column pairs jp (pair = head x HALF + d) and `rows` (broadcastable): (head,
    d, live, rot, cos, sin, slot). The metadata was written at least two kernels back
    (see kernels.paged_attention), so this runs before the PDL wait."""
    head = jp // HALF
    d = jp % HALF
    live = (rows < M) & (head < NUM_Q_HEADS + 2 * NUM_KV_HEADS)
    pos = tl.load(pos_ptr + rows, mask=rows < M, other=0)
    pos = tl.minimum(tl.maximum(pos, 0), max_positions - 1)
    rot = head < NUM_Q_HEADS + NUM_KV_HEADS  # q and k heads
    cos = tl.load(cs_ptr + pos * stride_cs + d, mask=live & rot, other=1.0)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + d, mask=live & rot, other=0.0)
    slot = tl.load(slot_ptr + rows, mask=rows < M, other=-1)
    return head, d, live, rot, cos, sin, slot


@triton.jit
def _rope_store(x1, x2, cos, sin, rows, head, d, live, rot, slot, q_ptr, kc_ptr, vc_ptr,
                num_slots, stride_q, stride_kcb, stride_kct, stride_kch, stride_vcb,
                stride_vct, stride_vch, HALF: tl.constexpr, NUM_Q_HEADS: tl.constexpr,
                NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr):  # fmt: skip
    """The pairs (x1 at dim d, x2 at d + HALF) of each head rotated (v heads: cos 1, sin
    0) and stored: q heads to q, k and v heads to the cache at each row's slot (slot
    -1, or one outside the cache, writes nothing)."""
    # Explicit fma: left to the compiler, which product fuses into the add differed with
    # the row count (a row among 4 got other bits than alone: 2-3 rows in 300 on the
    # H200), and verified tokens then differed from decoded ones.
    y1 = tl.fma(x1, cos, -(x2 * sin))
    y2 = tl.fma(x2, cos, x1 * sin)
    dt = q_ptr.dtype.element_ty
    y1, y2 = y1.to(dt), y2.to(dt)
    is_q = live & (head < NUM_Q_HEADS)
    q_off = rows * stride_q + head * (2 * HALF) + d
    tl.store(q_ptr + q_off, y1, mask=is_q)
    tl.store(q_ptr + q_off + HALF, y2, mask=is_q)
    ok = live & (slot >= 0) & (slot < num_slots) & (head >= NUM_Q_HEADS)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    is_k = ok & rot
    k_off = blk * stride_kcb + off * stride_kct + (head - NUM_Q_HEADS) * stride_kch + d
    tl.store(kc_ptr + k_off, y1, mask=is_k)
    tl.store(kc_ptr + k_off + HALF, y2, mask=is_k)
    is_v = ok & (head >= NUM_Q_HEADS + NUM_KV_HEADS)
    v_off = (blk * stride_vcb + off * stride_vct
             + (head - NUM_Q_HEADS - NUM_KV_HEADS) * stride_vch + d)  # fmt: skip
    tl.store(vc_ptr + v_off, y1, mask=is_v)
    tl.store(vc_ptr + v_off + HALF, y2, mask=is_v)


@triton.jit
def _chunk(xr, wa, wb, g_ptr, ks, mr, ma, mb, K, acc_a, acc_b, lo_a, lo_b, sq,
           NORM: tl.constexpr, TWO: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """One piece of K (offsets ks [1, KB]) into the accumulators: x's rows against W's
    at wa (and wb with TWO); with NORM, x times the norm weight in two 16-bit halves
    (high into acc, low into lo: the product is not rounded) and x^2 into sq."""
    km = ks < K
    x = tl.load(xr + ks, mask=mr & km, other=0.0)
    w_a = tl.load(wa + ks, mask=ma & km, other=0.0)
    if TWO:
        w_b = tl.load(wb + ks, mask=mb & km, other=0.0)
    if NORM:
        xf = x.to(tl.float32)
        sq += xf * xf
        xg = xf * tl.load(g_ptr + ks, mask=km, other=0.0).to(tl.float32)
        a = xg.to(x.dtype)
        if not IEEE:
            lo = (xg - a.to(tl.float32)).to(x.dtype)
            lo_a = _mma(lo, w_a, lo_a, IEEE)
            if TWO:
                lo_b = _mma(lo, w_b, lo_b, IEEE)
    else:
        a = x
    acc_a = _mma(a, w_a, acc_a, IEEE)
    if TWO:
        acc_b = _mma(a, w_b, acc_b, IEEE)
    return acc_a, acc_b, lo_a, lo_b, sq


@triton.jit
def _mma_product(x_ptr, w_ptr, g_ptr, rows, cols_a, cols_b, ma, mb, M, K, eps, stride_x,
                 stride_w, BLOCK_K: tl.constexpr, LINES: tl.constexpr, NORM: tl.constexpr,
                 TWO: tl.constexpr, GDC: tl.constexpr, PREFETCH: tl.constexpr,
                 STAGES: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """(x W[cols_a]^T, x W[cols_b]^T) over `rows`: [BLOCK_M, BLOCK_N] float32 each, with
    RMSNorm's row scale applied when NORM (the second is the first without TWO). ma, mb
    [BLOCK_N, 1]: which W rows exist. LINES: 128-byte lines of a W row, a power of two
    at least as large (the L2 prefetch)."""
    if PREFETCH:
        _prefetch_rows(w_ptr, cols_a[:, None], ma, K, stride_w, LINES)
        if TWO:
            _prefetch_rows(w_ptr, cols_b[:, None], mb, K, stride_w, LINES)
    if GDC:  # the weights are on their way to L2; now wait for the kernel that wrote x
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    wa = w_ptr + cols_a.to(tl.int64)[:, None] * stride_w
    wb = w_ptr + cols_b.to(tl.int64)[:, None] * stride_w
    xr = x_ptr + rows[:, None] * stride_x
    mr = (rows < M)[:, None]
    # Each chunk of K in two halves with accumulators of their own, and NORM's low
    # halves in theirs: independent mma chains where one would run several times as long
    # (an mma waits for the one before it into the same accumulator).
    z = tl.zeros([rows.shape[0], cols_a.shape[0]], tl.float32)
    acc_a0, acc_a1, acc_b0, acc_b1, lo_a0, lo_a1, lo_b0, lo_b1 = z, z, z, z, z, z, z, z
    # x^2 summed element-wise across the chunks, reduced across K once after the loop
    sq = tl.zeros([rows.shape[0], BLOCK_K // 2], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        ks = k0 + tl.arange(0, BLOCK_K // 2)[None, :]
        acc_a0, acc_b0, lo_a0, lo_b0, sq = _chunk(
            xr, wa, wb, g_ptr, ks, mr, ma, mb, K, acc_a0, acc_b0, lo_a0, lo_b0, sq, NORM, TWO,
            IEEE,
        )  # fmt: skip
        acc_a1, acc_b1, lo_a1, lo_b1, sq = _chunk(
            xr, wa, wb, g_ptr, ks + BLOCK_K // 2, mr, ma, mb, K, acc_a1, acc_b1, lo_a1, lo_b1,
            sq, NORM, TWO, IEEE,
        )  # fmt: skip
    acc_a = acc_a0 + acc_a1
    acc_b = acc_b0 + acc_b1
    if NORM and not IEEE:
        acc_a += lo_a0 + lo_a1
        acc_b += lo_b0 + lo_b1
    if NORM:
        rstd = tl.rsqrt(tl.sum(sq, axis=1) / K + eps)[:, None]
        acc_a = acc_a * rstd
        acc_b = acc_b * rstd
    if not TWO:
        acc_b = acc_a
    return acc_a, acc_b


@triton.jit
def _mma_linear_kernel(
    x_ptr, w_ptr, b_ptr, g_ptr, r_ptr, out_ptr, M, N, K, eps,
    stride_x, stride_w, stride_r, stride_o,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    LINES: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, GLU: tl.constexpr,
    RES: tl.constexpr, GDC: tl.constexpr, PREFETCH: tl.constexpr, STAGES: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    """[BLOCK_M rows, BLOCK_N columns] of fused_linear's output. GLU: W is [gate; up]
    (2N rows) and the output silu(x W_gate^T) * (x W_up^T)."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    bias, bias_u = 0.0, 0.0
    if HAS_BIAS:  # before the wait, with the weights
        bias = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if GLU:
            bias_u = tl.load(b_ptr + N + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    # GLU: the up rows of W lie N rows after the gate rows
    acc, acc_u = _mma_product(
        x_ptr, w_ptr, g_ptr, rows, cols, cols + N, cmask[:, None], cmask[:, None], M, K, eps,
        stride_x, stride_w, BLOCK_K, LINES, NORM, GLU, GDC, PREFETCH, STAGES, IEEE,
    )  # fmt: skip
    omask = (rows < M)[:, None] & cmask[None, :]
    res = 0.0
    if RES:
        res = tl.load(r_ptr + rows[:, None] * stride_r + cols[None, :], mask=omask, other=0.0)
        res = res.to(tl.float32)
    acc = _epilogue(acc, acc_u, bias, bias_u, res, HAS_BIAS, GLU, RES)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=omask)  # fmt: skip


@triton.jit
def _mma_qkv_rope_kernel(
    x_ptr, w_ptr, b_ptr, g_ptr, q_ptr, kc_ptr, vc_ptr, pos_ptr, slot_ptr, cs_ptr,
    M, N, K, eps, max_positions, num_slots,
    stride_x, stride_w, stride_q, stride_kcb, stride_kct, stride_kch,
    stride_vcb, stride_vct, stride_vch, stride_cs,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
    LINES: tl.constexpr, HALF: tl.constexpr, NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr, GDC: tl.constexpr, PREFETCH: tl.constexpr, STAGES: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    """fused_qkv_rope for [BLOCK_M rows, BLOCK_P column pairs]: the pair partners (dims
    d and d + HALF of a head) are two accumulators of one layout, so the rotation is
    element-wise."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    jp = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = (jp // HALF) * (2 * HALF) + jp % HALF
    live_c = cols < N
    head, d, live, rot, cos, sin, slot = _rope_meta(
        jp[None, :], rows, M, pos_ptr, slot_ptr, cs_ptr, max_positions, stride_cs, HALF,
        NUM_Q_HEADS, NUM_KV_HEADS,
    )  # fmt: skip
    if HAS_BIAS:
        bias1 = tl.load(b_ptr + cols, mask=live_c, other=0.0).to(tl.float32)[None, :]
        bias2 = tl.load(b_ptr + cols + HALF, mask=live_c, other=0.0).to(tl.float32)[None, :]
    x1, x2 = _mma_product(
        x_ptr, w_ptr, g_ptr, tl.reshape(rows, [BLOCK_M]), cols, cols + HALF,
        live_c[:, None], live_c[:, None], M, K, eps, stride_x, stride_w, BLOCK_K, LINES, NORM,
        True, GDC, PREFETCH, STAGES, IEEE,
    )  # fmt: skip
    if HAS_BIAS:
        x1 += bias1
        x2 += bias2
    _rope_store(x1, x2, cos, sin, rows, head, d, live, rot, slot, q_ptr, kc_ptr, vc_ptr,
                num_slots, stride_q, stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct,
                stride_vch, HALF, NUM_Q_HEADS, NUM_KV_HEADS, BLOCK_SIZE)  # fmt: skip


# ---- launchers (fused_linear and fused_qkv_rope call these past MAX_ROWS rows) ---------

MMA_MAX_ROWS = 64  # rows of x a launch takes (prefill-sized steps take cuBLAS)
# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps) of the mma kernels; None: mma_tile's choice.
# bench and tests set it.
MMA_TILE: tuple[int, int, int, int, int] | None = None
MMA_PREFETCH = True  # the L2 prefetch of W before the PDL wait (bench sets it)


def mma_tile(m: int, n: int, k: int, *, interpret: bool = INTERPRET):
    """(BLOCK_M, BLOCK_N, BLOCK_K, stages, warps) for m rows, n output columns (pairs
    for the rope kernel, a GLU's gate columns) and reduction width k.

    H200, SmolLM2's four projections x 30 layers under a graph with PDL (stop 33,
    bench.decode_step --chain). With each chunk's K halves in accumulators of their own
    (call 2), µs at 16 / 24 / 32 rows: 16/32/256/3/4 608 / 624 / 602; 16/32/128/5/4 712 /
    731 / 697; 128 of K with 8 stages 754 / 763 / 726; 16 columns 734 / 982 / 937; the
    rows kernel at 8 rows 508; cuBLAS GEMMs alone 553 / 558 / 527. Before the halves
    (call 1), at 16 / 32 / 64 rows: 16/32/128/5/4 614 / 650 / 839;
    16/32/64 with 3 stages 747 / 753 / 872, 6 stages 747 / 753 / 872, 10 stages 751 /
    756 / 885; 16 columns 716 / 907 / 1468; 64 columns 819 / 820 / 832; 32 rows a tile
    810 / 829 / 843; 8 warps 1058 / 1055 / 1396; without the L2 prefetch 965 / 955 /
    1241; cuBLAS GEMMs alone (no norm, SiLU or residual) 551 / 554 / 565. Whole K in one
    chunk (512-1024) spills in the RMSNorm prologue (offline sm_90)."""
    if MMA_TILE is not None:
        return MMA_TILE
    if interpret:  # the interpreter pays per program: large tiles
        return (min(64, triton.next_power_of_2(max(m, 16))),
                min(64, max(16, triton.next_power_of_2(n))),
                min(256, max(16, triton.next_power_of_2(k))), 1, 4)  # fmt: skip
    return 16, 32, 256, 3, 4


def _lines(k: int, elem: int) -> int:
    return triton.next_power_of_2(triton.cdiv(k * elem, 128))


_MMA_LINEAR = CachedLaunch(_mma_linear_kernel)
_MMA_ROPE = CachedLaunch(_mma_qkv_rope_kernel)


def _launch(launch: CachedLaunch, head: tuple, m: int, n: int, k: int, x, tail: tuple,
            options: dict) -> None:  # fmt: skip
    """One tensor-core launch: `head` the arguments before the tile constexprs, `tail`
    the flags after them (the last one GDC); n columns (pairs for the rope kernel)."""
    block_m, block_n, block_k, stages, warps = mma_tile(m, n, k)
    args = head + (block_m, block_n, block_k, _lines(k, x.element_size())) + tail + (
        tail[-1] and MMA_PREFETCH, stages, x.dtype == torch.float32)  # fmt: skip
    key = specialization_key(args) + (x.device.index, warps)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    launch(key, grid, args, {"num_warps": warps, **options})


def mma_linear(common: tuple, m: int, n: int, k: int, x, flags: tuple, options: dict) -> None:
    """fused_linear's launch past MAX_ROWS rows; `common` and `flags` as fused_linear
    builds them (its checks done): (has_bias, norm, glu, res, gdc)."""
    _launch(_MMA_LINEAR, common, m, n, k, x, flags, options)


def mma_qkv_rope(head: tuple, m: int, pairs: int, k: int, x, tail: tuple, options: dict) -> None:
    """fused_qkv_rope's launch past MAX_ROWS rows: `head` its arguments up to the
    strides, `tail` (half, num_q_heads, num_kv_heads, block_size, has_bias, norm,
    gdc)."""
    _launch(_MMA_ROPE, head, m, pairs, k, x, tail, options)
