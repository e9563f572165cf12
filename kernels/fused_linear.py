"""One decode-step projection in one launch: y = epilogue(prologue(x) W^T (+ bias)) (+ residual).

At decode sizes (a few rows) a projection is latency-bound: the H200 runs a 576 x 960
cuBLAS GEMM in ~3.5 µs where its weights take 0.25 µs to read, and the RMSNorm before it
and the SiLU-and-multiply or residual add around it are launches of their own. Here each
program holds a slice of W in registers and runs x's rows through it, with the work
around the GEMM folded in, all in float32 and the output rounded once:

- NORM: RMSNorm of x: the norm weight is folded into W at load (W * g is exact in
  float32 for bf16 / fp16 operands) and the row's 1 / rms scales the product;
- SILU: x is [M, 2K] = [gate | up] and silu(gate) * up is formed on load;
- GLU: W is [2N, K] = [gate; up] and the output is silu(x W_gate^T) * (x W_up^T): the
  gate/up projection with its SiLU-and-multiply, so the down projection reads N
  columns instead of forming the product per program;
- RES: the residual row is added before the rounding (out may be the residual itself:
  each program reads and writes only its own columns).

Two kernels. The rows kernel (K <= ROWS_MAX_K, no SILU) runs a program's rows all at
once over [columns, rows, K runs, K lanes] tiles: K lies along the 32 lanes of a warp,
and a row's sums do not depend on the row count. Where the warps go is the compiler's:
triton 3.6, the lent GPUs' version, puts them on the columns and rows, so every sum
stays inside a warp (one bar.sync a launch, for the output's store; offline sm_90 SASS
at 1 and 4 rows), where triton 3.9 gives them to the K runs and sums across warps
(21-265 bar.sync). The order [K runs, rows, columns, K lanes] ran 3.3x slower on the
H200 (SmolLM2's step 1151 against 348 µs at one row, stop 51), and summing K's lanes
before its runs 1.2x slower on an H100 (stop 54: a butterfly a run, a dependent shuffle
chain three times as long). The wide kernel (larger K, or SILU, whose product it forms
once a program) spreads K over all of a program's warps and runs its rows one after
another, two block-wide reductions a row, ROWS rows a program (the grid's second axis
covers the rest). H200, SmolLM2-135M decode step under a graph (stop 27,
bench.decode_step): rows kernel 390 / 470 / 562 / 677 µs at 1 / 2 / 4 / 8 rows against
416 / 489 / 601 / 771 with the wide kernel for every projection. A tensor-core variant
(x padded to 16 rows, K in pipelined chunks) measured 2.6x slower than the wide kernel
at 4 rows (stop 26); it waited before loading its weights and ran its K loop chunk after
chunk.

GDC (programmatic dependent launch, Hopper and later): the program loads its weights,
which no kernel writes, then waits for the previous kernel in the stream to finish
(griddepcontrol.wait) and lets the next one start launching. Every kernel launched with
PDL in specdraft waits before its first read of another kernel's output and before its
first write, so the chain stays ordered while each launch and its weight loads overlap
the kernel before it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_mma import MMA_MAX_ROWS, _epilogue, _rope_meta, _rope_store, mma_linear, mma_qkv_rope
from .guard import INTERPRET
from .launch import CachedLaunch, pdl_launch, specialization_key
from .paged_attention import AttentionSplits, _load_qsl, _merge_splits, combine_splits
from .validation import _check_tensor

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_ROWS = 8  # rows of x the rows and wide kernels take; past that, kernels/fused_mma.py
# From this many rows on fused_linear and fused_qkv_rope take the tensor-core kernels of
# kernels/fused_mma.py (up to MMA_MAX_ROWS); bench and tests set it lower.
MMA_FROM_ROWS = MAX_ROWS + 1
# Rows a program takes (None: rows_per_program's table); bench and tests set it.
ROWS_PER_PROGRAM: int | None = None
MAX_K = 16384  # the padded reduction width a program holds in registers
# K up to which the rows kernel takes a projection (at most 64 of K a thread); wider K
# goes to the wide kernel.
ROWS_MAX_K = 2048
# The rows kernel's tile when set (bench and tests): (layout, columns a program, warps),
# layout "runs" (K in runs of lanes x vector, _rows_tile's default) or "whole" (K padded
# to a power of two in one piece, as bench.phase_barrier's plain kernel holds it).
ROWS_TILE: tuple[str, int, int] | None = None


@triton.jit
def _rows_w(w_ptr, nn, N, K, stride_w, BASE: tl.constexpr, KH: tl.constexpr, KL: tl.constexpr):
    """One K piece of W for the rows kernel: K offsets [1, 1, KH, KL] from BASE, their
    mask, and W [BN, 1, KH, KL] in its own dtype (zero past N and K). The caller converts
    it after the PDL wait (see _rows_gemv)."""
    kk = BASE + tl.arange(0, KH)[None, None, :, None] * KL + tl.arange(0, KL)[None, None, None, :]
    km = kk < K
    w = tl.load(w_ptr + nn.to(tl.int64) * stride_w + kk, mask=(nn < N) & km, other=0.0)
    return kk, km, w


@triton.jit
def _rows_x(x_ptr, kk, km, rr, nn, M, stride_x):
    """The rows' x over one K piece, [BN, R, KH, KL] float32 (broadcast over the BN
    columns, so that it shares W's layout)."""
    ptr = x_ptr + rr * stride_x + kk + nn * 0
    return tl.load(ptr, mask=km & (rr < M) & (nn * 0 == 0), other=0.0).to(tl.float32)


@triton.jit
def _rows_x_merged(x_ptr, rr, nn, M, sp_out_ptr, sp_lse_ptr, qsl_ptr, num_reqs,
                   BASE: tl.constexpr, KH: tl.constexpr, KL: tl.constexpr, NQH: tl.constexpr,
                   HD: tl.constexpr, NSPLIT: tl.constexpr, PART_MAX: tl.constexpr):  # fmt: skip
    """_rows_x where x is a split attention launch's output not yet merged (KH runs of
    KL from BASE, KL a multiple of the head size HD, a power of two): the partials merged
    as the combine launch merges them (the same bits, rounded to x's dtype), over
    [rows, heads, HD] tiles (one lse load a head and split, the partials in HD-long
    vectors), then laid out as x; rows of padded tokens are zero, as the combine writes
    them."""
    ROWS: tl.constexpr = rr.shape[1]
    HP: tl.constexpr = KH * KL // HD
    r = tl.reshape(rr, [ROWS, 1, 1])
    hh = BASE // HD + tl.arange(0, HP)[None, :, None]
    ok = (r < M) & (hh < NQH)
    merged = _merge_splits(sp_out_ptr, sp_lse_ptr, (r * NQH + hh).to(tl.int64),
                           tl.arange(0, HD)[None, None, :], ok, M * NQH, HD, NSPLIT,
                           PART_MAX)  # fmt: skip
    merged = tl.where(ok & (r < _load_qsl(qsl_ptr, num_reqs, M)), merged, 0.0)
    merged = merged.to(x_ptr.dtype.element_ty).to(tl.float32)
    return tl.reshape(merged, [1, ROWS, KH, KL]) + (nn * 0).to(tl.float32)


@triton.jit
def _rows_part(w, x):
    """The partial sums of w * x over the K runs: [BN, R, KL] (inside each thread where
    the compiler keeps a thread's runs in its registers, as triton 3.6 does)."""
    return tl.sum(w * x, axis=2)


@triton.jit
def _lanes_sum(part):
    """The partials summed across the lanes of a warp (shuffles): [BN, R]."""
    return tl.sum(part, axis=2)


@triton.jit
def _rows_gemv(x_ptr, w_ptr, g_ptr, nn, rr, M, N, K, eps, stride_x, stride_w,
               KH1: tl.constexpr, KH2: tl.constexpr, KL: tl.constexpr, NORM: tl.constexpr,
               GLU: tl.constexpr, GDC: tl.constexpr, sp_out_ptr, sp_lse_ptr, qsl_ptr, num_reqs,
               MERGE: tl.constexpr, NQH: tl.constexpr, HD: tl.constexpr, NSPLIT: tl.constexpr,
               PART_MAX: tl.constexpr, r_ptr, stride_r, rows, cols, omask,
               RES: tl.constexpr):  # fmt: skip
    """The rows kernel's product over tiles [BN, R, KH, KL]: W (and with GLU the up rows, N
    rows further) and the norm weight loaded, then the wait (GDC), then x and (RES) the
    residual's [BN, R] block at (rows, cols), W taken to float32 with the norm weight folded
    in; returns (acc, acc_up, res) float32, acc and acc_up [BN, R] with RMSNorm's row scale
    applied (acc_up is acc without GLU; res 0.0 without RES). MERGE: x merged from split
    attention partials (_rows_x_merged: the partials' outputs and lses, query_start_loc,
    num_reqs; Hq NQH, head_dim HD, NSPLIT splits). The residual is loaded beside x, right
    after the wait: loaded after the sums, its L2 round trip came after them in the launch's
    chain."""
    k1, km1, w1 = _rows_w(w_ptr, nn, N, K, stride_w, 0, KH1, KL)
    if GLU:
        _, _, u1 = _rows_w(w_ptr + N * stride_w, nn, N, K, stride_w, 0, KH1, KL)
    if KH2 > 0:
        k2, km2, w2 = _rows_w(w_ptr, nn, N, K, stride_w, KH1 * KL, KH2, KL)
        if GLU:
            _, _, u2 = _rows_w(w_ptr + N * stride_w, nn, N, K, stride_w, KH1 * KL, KH2, KL)
    if NORM:  # W's layout
        g1 = tl.load(g_ptr + k1 + nn * 0, mask=km1 & (nn * 0 == 0), other=0.0)
        if KH2 > 0:
            g2 = tl.load(g_ptr + k2 + nn * 0, mask=km2 & (nn * 0 == 0), other=0.0)
    if GDC:  # weights are in flight; now wait for the kernel that wrote x
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    res = 0.0
    if RES:
        res = tl.load(r_ptr + rows * stride_r + cols, mask=omask, other=0.0).to(tl.float32)
    # W to float32 and the norm weight folded in (exact for bf16 / fp16: a 16-bit
    # product) only now. Written before the wait, these instructions (which wait for W's
    # loads) were placed by ptxas between griddepcontrol.wait and launch_dependents: 165
    # of them in the gate/up launch (triton 3.6 SASS), 73 written here. H100, SmolLM2's
    # step 368.5 -> 366.5 µs (bench/NOTES.md, stop 54).
    w1 = w1.to(tl.float32)
    if GLU:
        u1 = u1.to(tl.float32)
    if NORM:
        w1 = w1 * g1.to(tl.float32)
        if GLU:
            u1 = u1 * g1.to(tl.float32)
    if KH2 > 0:
        w2 = w2.to(tl.float32)
        if GLU:
            u2 = u2.to(tl.float32)
        if NORM:
            w2 = w2 * g2.to(tl.float32)
            if GLU:
                u2 = u2 * g2.to(tl.float32)
    if MERGE:
        x1 = _rows_x_merged(x_ptr, rr, nn, M, sp_out_ptr, sp_lse_ptr, qsl_ptr, num_reqs, 0,
                            KH1, KL, NQH, HD, NSPLIT, PART_MAX)  # fmt: skip
    else:
        x1 = _rows_x(x_ptr, k1, km1, rr, nn, M, stride_x)
    if KH2 > 0:
        if MERGE:
            x2 = _rows_x_merged(x_ptr, rr, nn, M, sp_out_ptr, sp_lse_ptr, qsl_ptr, num_reqs,
                                KH1 * KL, KH2, KL, NQH, HD, NSPLIT, PART_MAX)  # fmt: skip
        else:
            x2 = _rows_x(x_ptr, k2, km2, rr, nn, M, stride_x)
    part = _rows_part(w1, x1)
    if GLU:
        part_u = _rows_part(u1, x1)
    if NORM:
        sq = _rows_part(x1, x1)
    if KH2 > 0:
        part += _rows_part(w2, x2)
        if GLU:
            part_u += _rows_part(u2, x2)
        if NORM:
            sq += _rows_part(x2, x2)
    acc = _lanes_sum(part)
    acc_u = acc
    if GLU:
        acc_u = _lanes_sum(part_u)
    if NORM:  # RMSNorm's row scale, applied after the product
        rstd = tl.rsqrt(_lanes_sum(sq) / K + eps)
        acc = acc * rstd
        if GLU:
            acc_u = acc_u * rstd
    return acc, acc_u, res


@triton.jit
def _rows_program(M, N, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    """A rows-kernel program's rows and columns: the tile indices rr [1, R, 1, 1] and nn
    [BN, 1, 1, 1], the output's rows [1, R] and cols [BN, 1], and its mask."""
    n0 = tl.program_id(0) * BLOCK_N
    m0 = tl.program_id(1) * ROWS
    rr = m0 + tl.arange(0, ROWS)[None, :, None, None]
    nn = n0 + tl.arange(0, BLOCK_N)[:, None, None, None]
    rows = m0 + tl.arange(0, ROWS)[None, :]
    cols = n0 + tl.arange(0, BLOCK_N)[:, None]
    return rr, nn, rows, cols, (rows < M) & (cols < N)


@triton.jit
def _fused_rows_kernel(
    x_ptr, w_ptr, b_ptr, g_ptr, r_ptr, out_ptr, M, N, K, eps,
    stride_x, stride_w, stride_r, stride_o,
    KH1: tl.constexpr, KH2: tl.constexpr, KL: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, GLU: tl.constexpr, RES: tl.constexpr,
    GDC: tl.constexpr, ROWS: tl.constexpr,
    sp_out_ptr, sp_lse_ptr, qsl_ptr, num_reqs, MERGE: tl.constexpr, NQH: tl.constexpr,
    HD: tl.constexpr, NSPLIT: tl.constexpr, PART_MAX: tl.constexpr,
):  # fmt: skip
    """All ROWS rows of a program at once over tiles [BLOCK_N, ROWS, KH, KL]: K (KH1 + KH2
    pieces of KL) runs along the lanes of a warp, its runs in each thread (triton 3.6; see
    the module docstring), and each row costs its loads and arithmetic but no latency step
    of its own. GLU: W holds [gate; up] (2N rows) and the output is silu(x W_gate^T) * (x
    W_up^T). MERGE: x is split attention's output, merged from its partials on the way in
    (fused_linear's x_splits)."""
    rr, nn, rows, cols, omask = _rows_program(M, N, BLOCK_N, ROWS)
    bias, bias_u = 0.0, 0.0
    if HAS_BIAS:  # before the wait, with the weights
        bias = tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        if GLU:
            bias_u = tl.load(b_ptr + N + cols, mask=cols < N, other=0.0).to(tl.float32)
    acc, acc_u, res = _rows_gemv(x_ptr, w_ptr, g_ptr, nn, rr, M, N, K, eps, stride_x,
                                 stride_w, KH1, KH2, KL, NORM, GLU, GDC, sp_out_ptr, sp_lse_ptr,
                                 qsl_ptr, num_reqs, MERGE, NQH, HD, NSPLIT, PART_MAX, r_ptr,
                                 stride_r, rows, cols, omask, RES)  # fmt: skip
    acc = _epilogue(acc, acc_u, bias, bias_u, res, HAS_BIAS, GLU, RES)
    tl.store(out_ptr + rows * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _fused_qkv_rope_kernel(
    x_ptr, w_ptr, b_ptr, g_ptr, q_ptr, kc_ptr, vc_ptr, pos_ptr, slot_ptr, cs_ptr,
    M, N, K, eps, max_positions, num_slots,
    stride_x, stride_w, stride_q, stride_kcb, stride_kct, stride_kch,
    stride_vcb, stride_vct, stride_vch, stride_cs,
    KH1: tl.constexpr, KH2: tl.constexpr, KL: tl.constexpr, PAIRS: tl.constexpr,
    HALF: tl.constexpr, NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
    GDC: tl.constexpr, ROWS: tl.constexpr, LATE_META: tl.constexpr,
):  # fmt: skip
    """The QKV projection with rotary and the K/V store as its epilogue (the rows
    kernel's product; heads of 2 * HALF dims, rotated whole). A program takes PAIRS
    column pairs (d, d + HALF) of the heads: 2 * PAIRS columns, column n's pair partner
    at n + PAIRS. q heads go rotated to q, k heads rotated and
    v heads as they are to the cache at each row's slot (slot -1, or one outside the
    cache, writes nothing: rotary_store_kv's contract)."""
    p0 = tl.program_id(0) * PAIRS
    m0 = tl.program_id(1) * ROWS
    n = tl.arange(0, 2 * PAIRS)
    j = p0 + n % PAIRS  # the pair a column belongs to
    col = (j // HALF) * (2 * HALF) + j % HALF + (n // PAIRS) * HALF
    nn = col[:, None, None, None]
    rr = m0 + tl.arange(0, ROWS)[None, :, None, None]
    # A pair's head, its dim and each row's metadata: before the wait (see _rope_meta),
    # or after it with LATE_META (the kernel just before wrote them: embed_fc's advance).
    jp = p0 + tl.arange(0, PAIRS)[:, None]
    rows = m0 + tl.arange(0, ROWS)[None, :]
    if not LATE_META:
        head, d, live, rot, cos, sin, slot = _rope_meta(
            jp, rows, M, pos_ptr, slot_ptr, cs_ptr, max_positions, stride_cs, HALF,
            NUM_Q_HEADS, NUM_KV_HEADS,
        )  # fmt: skip
    if HAS_BIAS:
        bias = tl.load(b_ptr + col[:, None], mask=col[:, None] < N, other=0.0).to(tl.float32)
    acc, _, _ = _rows_gemv(x_ptr, w_ptr, g_ptr, nn, rr, M, N, K, eps, stride_x, stride_w,
                           KH1, KH2, KL, NORM, False, GDC, x_ptr, x_ptr, x_ptr, 0, False, 1, 1,
                           1, 1.0, x_ptr, 0, 0, 0, False, False)  # fmt: skip
    if LATE_META:
        head, d, live, rot, cos, sin, slot = _rope_meta(
            jp, rows, M, pos_ptr, slot_ptr, cs_ptr, max_positions, stride_cs, HALF,
            NUM_Q_HEADS, NUM_KV_HEADS,
        )  # fmt: skip
    if HAS_BIAS:
        acc += bias
    # Columns n and n + PAIRS are a pair, held by one thread: split them apart.
    x1, x2 = tl.split(tl.permute(tl.reshape(acc, [2, PAIRS, ROWS]), (1, 2, 0)))
    _rope_store(x1, x2, cos, sin, rows, head, d, live, rot, slot, q_ptr, kc_ptr, vc_ptr,
                num_slots, stride_q, stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct,
                stride_vch, HALF, NUM_Q_HEADS, NUM_KV_HEADS, BLOCK_SIZE)  # fmt: skip


@triton.jit
def _fused_linear_kernel(
    x_ptr, w_ptr, b_ptr, g_ptr, r_ptr, out_ptr, M, N, K, eps,
    stride_x, stride_w, stride_r, stride_o,
    KP: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
    SILU: tl.constexpr, GLU: tl.constexpr, RES: tl.constexpr, GDC: tl.constexpr,
    ROWS: tl.constexpr,
):  # fmt: skip
    """Wide K (past ROWS_MAX_K): a program holds [BLOCK_N, KP] of W (K across all its
    warps) and runs its rows one after another, two block-wide reductions a row."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m0 = tl.program_id(1) * ROWS
    end = tl.minimum(m0 + ROWS, M)
    ks = tl.arange(0, KP)
    kmask = ks < K
    cmask = cols < N
    wptr = w_ptr + cols[:, None].to(tl.int64) * stride_w + ks[None, :]
    wmask = cmask[:, None] & kmask[None, :]
    w = tl.load(wptr, mask=wmask, other=0.0).to(tl.float32)
    if GLU:
        wu = tl.load(wptr + N * stride_w, mask=wmask, other=0.0).to(tl.float32)
    if NORM:  # fold the norm weight into W (exact for bf16 / fp16: a 16-bit product)
        g = tl.load(g_ptr + ks, mask=kmask, other=0.0).to(tl.float32)
        w = w * g[None, :]
        if GLU:
            wu = wu * g[None, :]
    bias, bias_u = 0.0, 0.0
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        if GLU:
            bias_u = tl.load(b_ptr + N + cols, mask=cmask, other=0.0).to(tl.float32)
    if GDC:  # weights are in flight; now wait for the kernel that wrote x
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # Row m + 1's loads are issued before row m's product (software pipelining): with
    # several rows the loop waits on one load latency, not one a row.
    xa, xb, res = _load_row(x_ptr, r_ptr, m0, end, stride_x, stride_r, ks, kmask, cols, cmask,
                            K, SILU, RES)  # fmt: skip
    for m in range(m0, end):
        a, b, r = xa, xb, res
        xa, xb, res = _load_row(x_ptr, r_ptr, m + 1, end, stride_x, stride_r, ks, kmask, cols,
                                cmask, K, SILU, RES)  # fmt: skip
        x = a
        if SILU:
            x = a / (1.0 + tl.exp(tl.minimum(-a, 80.0))) * b
        acc = tl.sum(w * x[None, :], axis=1)
        acc_u = acc
        if GLU:
            acc_u = tl.sum(wu * x[None, :], axis=1)
        if NORM:
            rstd = tl.rsqrt(tl.sum(x * x, axis=0) / K + eps)
            acc = acc * rstd
            if GLU:
                acc_u = acc_u * rstd
        acc = _epilogue(acc, acc_u, bias, bias_u, r, HAS_BIAS, GLU, RES)
        tl.store(out_ptr + m * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _load_row(x_ptr, r_ptr, m, M, stride_x, stride_r, ks, kmask, cols, cmask, K,
              SILU: tl.constexpr, RES: tl.constexpr):  # fmt: skip
    """Row m's inputs as float32 (nothing read past row M - 1): x (with SILU, the gate
    half), the up half (SILU) and the residual's columns (RES); unused ones 0."""
    row = x_ptr + m * stride_x
    # m < M as a tensor: a plain bool mask term is refused by some interpreter versions
    kmask = kmask & ((ks * 0 + m) < M)
    a = tl.load(row + ks, mask=kmask, other=0.0).to(tl.float32)
    b = a
    if SILU:
        b = tl.load(row + K + ks, mask=kmask, other=0.0).to(tl.float32)
    r = tl.zeros(cols.shape, tl.float32)
    if RES:
        cmask = cmask & ((cols * 0 + m) < M)
        r = tl.load(r_ptr + m * stride_r + cols, mask=cmask, other=0.0).to(tl.float32)
    return a, b, r


_ROWS_LAUNCH = CachedLaunch(_fused_rows_kernel)
_WIDE_LAUNCH = CachedLaunch(_fused_linear_kernel)


def _check_x_splits(x: torch.Tensor, splits: AttentionSplits | None) -> None:
    """fused_linear's x_splits: x must be the split launch's output, viewed [T, Hq * D]."""
    if splits is None:
        return
    if not isinstance(splits, AttentionSplits):
        raise TypeError(f"x_splits must be an AttentionSplits or None, got {type(splits).__name__}")
    o = splits.out
    t, hq, d = o.shape
    if (x.data_ptr(), tuple(x.shape), x.stride(), x.dtype) != (o.data_ptr(), (t, hq * d),
                                                                (hq * d, 1), o.dtype):  # fmt: skip
        raise ValueError(
            f"x_splits: x (shape {tuple(x.shape)}, strides {x.stride()}) must be x_splits.out "
            f"viewed [{t}, {hq * d}], contiguous"
        )


def check_fused_linear_args(
    x, weight, *, bias=None, norm_weight=None, silu=False, glu=False, residual=None, out=None
) -> None:
    """fused_linear's argument checks (nothing launched)."""
    _check_tensor("x", x, 2, _DTYPES)
    _check_tensor("weight", weight, 2, (x.dtype,))
    m, width = x.shape
    if not 1 <= m <= MMA_MAX_ROWS:
        raise ValueError(f"x has {m} rows: fused_linear takes 1 to {MMA_MAX_ROWS}")
    if silu and m >= MMA_FROM_ROWS:
        raise ValueError(f"silu=True takes at most {MMA_FROM_ROWS - 1} rows, x has {m}")
    if silu and glu:
        raise ValueError("silu=True and glu=True cannot be combined")
    k = weight.shape[1]
    want = 2 * k if silu else k
    if width != want:
        raise ValueError(
            f"x has {width} columns; weight {tuple(weight.shape)} needs {want}"
            + (" ([gate | up] with silu=True)" if silu else "")
        )
    if not 1 <= k <= MAX_K:
        raise ValueError(f"weight has in_features {k}: fused_linear takes 1 to {MAX_K}")
    n = weight.shape[0]
    if glu:
        if n % 2:
            raise ValueError(
                f"weight has {n} rows: glu=True needs [gate; up], an even number of rows"
            )
        n //= 2
    for name, t in (("weight", weight), ("bias", bias), ("norm_weight", norm_weight),
                    ("residual", residual), ("out", out)):  # fmt: skip
        if t is not None and isinstance(t, torch.Tensor) and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    if bias is not None:
        _check_tensor("bias", bias, 1, (x.dtype,))
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias has shape {tuple(bias.shape)}, expected [{weight.shape[0]}]")
    if norm_weight is not None:
        if silu:
            raise ValueError("norm_weight and silu=True cannot be combined")
        _check_tensor("norm_weight", norm_weight, 1, (x.dtype,))
        if norm_weight.shape[0] != k:
            raise ValueError(f"norm_weight has shape {tuple(norm_weight.shape)}, expected [{k}]")
    for name, t in (("residual", residual), ("out", out)):
        if t is not None:
            _check_tensor(name, t, 2, (x.dtype,))
            if tuple(t.shape) != (m, n):
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected [{m}, {n}]")
    if out is not None and out.data_ptr() != 0:
        x_end = x.data_ptr() + x.element_size() * ((m - 1) * x.stride(0) + width)
        o_end = out.data_ptr() + out.element_size() * ((m - 1) * out.stride(0) + n)
        if out.data_ptr() < x_end and x.data_ptr() < o_end:
            raise ValueError("out overlaps x: every program reads all of x")
        same = residual is not None and residual.data_ptr() == out.data_ptr()
        if same and residual.stride() != out.stride():
            raise ValueError("out aliases residual with other strides")


def rows_per_program(m: int, *, interpret: bool = INTERPRET) -> int:
    """Rows of x one program of the wide kernel takes, for m rows (ROWS_PER_PROGRAM
    when set). Under the interpreter, which pays per program, all of them."""
    if ROWS_PER_PROGRAM is not None:
        return max(1, min(ROWS_PER_PROGRAM, m))
    if interpret:
        return m
    # H200, SmolLM2's four projections x 30 layers under a graph with PDL, on this
    # kernel before the rows kernel took them (µs for 1, 2, 3, 4 ... rows a program): 2
    # rows 288 / 281; 3 rows 352 / 374; 4 rows 410 / 389 / 427 (4); 8 rows 692 / 573 /
    # 603 (4) / 712 (8). One row a program multiplies the programs, each holding its W
    # slice in registers, into several waves; all rows in one program run them one
    # after another.
    return 1 if m == 1 else 2


# Programs a wide-kernel launch may take with more than 4 rows: each holds its W slice
# in registers, and past about this many (a few waves) the fused path lost to cuBLAS.
# H200, decode step at 8 rows under a graph (largest projection's programs, stop 26):
# SmolLM2-135M 867 vs 1027 µs unfused (1536), its one-layer EAGLE head 56.7 vs 61.5
# (1536), llama-68m 136 vs 109 (3072); llama-68m at 4 rows 94.9 vs 103 (1536).
PROGRAM_BUDGET = 1536
MIN_FUSED_ROWS = 4  # rows every model takes on the fused path
# Rows up to which models whose projections the rows kernel takes stay on the fused path
# (the tensor-core kernels past MAX_ROWS). H200, SmolLM2's projection chain (stop 33):
# 614 / 650 µs at 16 / 32 rows against the rows kernel's 539 at 8, 839 at 64 rows,
# where the unfused step (cuBLAS) overtakes the fused one.
MMA_FUSED_ROWS = 32


def max_fused_rows(shapes) -> int:
    """Rows up to which a model whose projections have these weight shapes ([N, K]
    pairs) takes the fused decode path: MMA_FUSED_ROWS when the rows kernel takes every
    projection (K <= ROWS_MAX_K; past MAX_ROWS rows the tensor-core kernels); else
    MIN_FUSED_ROWS, and more while no wide-kernel launch needs more than PROGRAM_BUDGET
    programs (GPU tiles, also under the interpreter, so the choice is the same on every
    machine); when that holds up to MAX_ROWS (small wide projections: latency-bound),
    MMA_FUSED_ROWS as well, the tensor-core kernels taking any K past MAX_ROWS. H200,
    llama-68m (down projection K 3072) decode step at context 256, fused against unfused
    (stop 35): 106 / 124 µs at 16 rows, 112 / 116 at 32, 156 / 132 at 64."""
    wide = [(int(n), int(k)) for n, k in shapes if int(k) > ROWS_MAX_K]
    if not wide:
        return MMA_FUSED_ROWS
    limit = MIN_FUSED_ROWS
    for m in range(MIN_FUSED_ROWS + 1, MAX_ROWS + 1):
        rows = rows_per_program(m, interpret=False)
        progs = max(
            triton.cdiv(n, _wide_tile(k, interpret=False)[1]) * triton.cdiv(m, rows)
            for n, k in wide
        )
        if progs > PROGRAM_BUDGET:
            return limit
        limit = m
    return MMA_FUSED_ROWS


def _wide_tile(k: int, *, interpret: bool = INTERPRET) -> tuple[int, int, int]:
    """(K padded, columns a program, warps) of the wide kernel: 64 weights a thread, 4
    warps up to K 8192, more warps past it. One warp a program (row reductions without
    barriers) measured 1.07-1.63x slower."""
    kp = triton.next_power_of_2(k)
    warps = min(16, max(4, kp // 2048))
    block_n = max(1, 64 * 32 * warps // kp)
    if interpret:  # the interpreter pays per program: larger slices
        block_n = max(block_n, min(64, 65536 // kp))
    return kp, block_n, warps


def _rows_tile(k: int, elem: int, *, interpret: bool = INTERPRET):
    """(KH1, KH2, KL, columns a program, warps) of the rows kernel: K in 16-byte
    vectors along up to 32 lanes (KL = lanes x vector), then in KH1 + KH2 (powers of
    two) such runs a thread; the columns along the 4 warps (and any lanes K leaves), one
    a thread. ROWS_TILE, when set, overrides the layout, the columns and the warps."""
    vec = 16 // elem
    lanes_k = min(32, triton.next_power_of_2(triton.cdiv(k, vec)))
    kl = lanes_k * vec
    runs = triton.cdiv(k, kl)
    kh1 = 1 << (runs.bit_length() - 1)
    kh2 = triton.next_power_of_2(runs - kh1) if runs > kh1 else 0
    warps = 4
    block_n = 32 // lanes_k * warps
    if ROWS_TILE is not None:
        layout, block_n, warps = ROWS_TILE
        if layout == "whole":
            kh1, kh2, kl = 1, 0, max(kl, triton.next_power_of_2(k))
        elif layout != "runs":
            raise ValueError(f"ROWS_TILE layout {layout!r}: 'runs' or 'whole'")
    if interpret:  # the interpreter pays per program: larger tiles
        block_n = max(block_n, 64)
    return kh1, kh2, kl, block_n, warps


def fused_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu: bool = False,
    glu: bool = False,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    pdl: bool = False,
    x_splits: AttentionSplits | None = None,
) -> torch.Tensor:
    """[M, N] = g(f(x) @ weight^T (+ bias)) (+ residual), M <= MAX_ROWS, one launch.

    f is the identity, RMSNorm with norm_weight and eps, or (silu=True, x [M, 2K])
    silu(x[:, :K]) * x[:, K:]. g is the identity, or (glu=True, weight [2N, K] =
    [gate; up], bias [2N]) silu(gate) * up: the gate/up projection with its
    SiLU-and-multiply. The prologue and epilogue run in float32; the output is rounded
    once. out may be residual itself (an in-place residual stream), never overlap x.
    pdl=True launches with programmatic dependent launch (CUDA, compute capability 9
    or later; see kernels.pdl_supported).

    x_splits: x is the output of a split attention launch whose partials are not merged
    yet (kernels.paged_attention_unmerged; x = x_splits.out viewed [T, Hq * D]). The
    rows kernel merges them on its loads, as the combine launch would (the same bits),
    and x is never written; where another kernel takes the shape (or with norm_weight /
    silu) the combine launch writes x first."""
    check_fused_linear_args(
        x, weight, bias=bias, norm_weight=norm_weight, silu=silu, glu=glu, residual=residual,
        out=out,
    )  # fmt: skip
    _check_x_splits(x, x_splits)
    m = x.shape[0]
    n, k = weight.shape
    n = n // 2 if glu else n
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    # The rows kernel takes the call (the wide kernel forms silu(gate) * up once a program)
    rows_kernel = m < MMA_FROM_ROWS and k <= ROWS_MAX_K and not silu
    if rows_kernel:
        kh1, kh2, kl, block_n, warps = _rows_tile(k, x.element_size())
    merge = False
    if x_splits is not None:
        # it merges the splits on its loads if its K runs hold whole power-of-two heads
        hd = x_splits.out.shape[2]
        merge = rows_kernel and n > 0 and norm_weight is None and kl % hd == 0
        merge = merge and hd == x_splits.part_out.shape[-1]
        if not merge:
            combine_splits(x_splits, pdl=pdl)
    if n == 0:
        return out
    gdc, options = pdl_launch(pdl)
    common = (x, weight, bias if bias is not None else weight,
              norm_weight if norm_weight is not None else weight,
              residual if residual is not None else out, out, m, n, k, float(eps),
              x.stride(0), weight.stride(0),
              residual.stride(0) if residual is not None else 0, out.stride(0))  # fmt: skip
    bias_norm = (bias is not None, norm_weight is not None)
    tail = (bool(glu), residual is not None, gdc)
    if m >= MMA_FROM_ROWS:
        mma_linear(common, m, n, k, x, bias_norm + tail, options)
        return out
    if rows_kernel:
        rows = triton.next_power_of_2(m)  # every row in one program
        if merge:
            sp = x_splits
            _, nqh, hd = sp.out.shape
            split = (sp.part_out, sp.part_lse, sp.query_start_loc, sp.num_reqs, True, nqh, hd,
                     sp.num_splits, sp.part_max)  # fmt: skip
        else:
            split = (x, x, x, 0, False, 1, 1, 1, 1.0)
        args = common + (kh1, kh2, kl, block_n) + bias_norm + tail + (rows,) + split
        launch = _ROWS_LAUNCH
    else:
        kp, block_n, warps = _wide_tile(k)
        if glu:  # two W slices a program
            block_n = max(1, block_n // 2)
        rows = rows_per_program(m)
        args = common + (kp, block_n) + bias_norm + (bool(silu),) + tail + (rows,)
        launch = _WIDE_LAUNCH
    key = specialization_key(args) + (x.device.index, warps)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, rows))
    launch(key, grid, args, {"num_warps": warps, **options})
    return out


_ROPE_LAUNCH = CachedLaunch(_fused_qkv_rope_kernel)
# Column pairs a program of the QKV + rotary kernel takes: 2 (a column a warp; the pair
# partners meet through one layout change) against 4 (both in one thread, x held twice:
# 253 registers with spills at 8 rows, offline sm_90 SASS).
ROPE_PAIRS = 2


ROPE_FUSED = True  # the layers' switch for fused_qkv_rope (bench and tests set it)


def late_meta_supported(rows: int) -> bool:
    """Whether fused_qkv_rope takes late_meta for this many rows (the rows kernel)."""
    return 1 <= rows < MMA_FROM_ROWS


def fused_qkv_rope_supported(k: int, head_dim: int, rotary_dim: int) -> bool:
    """Whether the fused decode path takes fused_qkv_rope for a QKV projection with
    this in_features, head_dim and rotary width: the rows kernel's K, whole heads
    rotated (and ROPE_FUSED on)."""
    return ROPE_FUSED and _rope_takes(k, head_dim, rotary_dim)


def _rope_takes(k: int, head_dim: int, rotary_dim: int) -> bool:
    return k <= ROWS_MAX_K and rotary_dim == head_dim and head_dim % 2 == 0


def fused_qkv_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    num_q_heads: int,
    bias: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    pdl: bool = False,
    late_meta: bool = False,
) -> torch.Tensor:
    """The QKV projection with rotary and the K/V store in one launch: qkv = f(x)
    weight^T (+ bias), f the identity or RMSNorm (norm_weight, eps) as in fused_linear,
    with weight [(Hq + 2 Hkv) D, K] (Hkv and D from the cache); then, as
    rotary_store_kv does it, q and k rotated (cos_sin_cache [max_positions, D]: whole
    heads), q returned [M, Hq, D] (in `out` [M, Hq D] when given; unit column stride),
    rotated k and v written to the cache at slot_mapping (a slot of -1, or outside the
    cache, writes nothing). Everything in float32, each output rounded once. Every
    check runs before the launch: a refused call writes nothing. late_meta: positions
    and slots are read after the PDL wait, not before (the kernel just before wrote
    them: embed_fc with a draft round's advance); rows kernel only (up to
    MMA_FROM_ROWS - 1 rows)."""
    from .rotary import check_rotary_store_kv_args  # rotary imports paged_attention

    check_fused_linear_args(x, weight, bias=bias, norm_weight=norm_weight)
    m, k = x.shape
    if isinstance(num_q_heads, bool) or not isinstance(num_q_heads, int) or num_q_heads < 1:
        raise ValueError(f"num_q_heads must be a positive int, got {num_q_heads!r}")
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache has shape {tuple(k_cache.shape)}, expected [num_blocks, block_size, "
            "num_kv_heads, head_dim]"
        )
    hkv, d = int(k_cache.shape[2]), int(k_cache.shape[3])
    n = (num_q_heads + 2 * hkv) * d
    if weight.shape[0] != n:
        raise ValueError(
            f"weight has {weight.shape[0]} rows, expected (num_q_heads {num_q_heads} + 2 x "
            f"{hkv} kv heads) x head_dim {d} = {n}"
        )
    if num_q_heads % hkv:
        raise ValueError(f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {hkv}")
    if not isinstance(cos_sin_cache, torch.Tensor) or cos_sin_cache.dim() != 2:
        raise ValueError("cos_sin_cache must be a [max_positions, rotary_dim] tensor")
    if not _rope_takes(k, d, int(cos_sin_cache.shape[1])):
        raise ValueError(
            f"fused_qkv_rope takes in_features <= {ROWS_MAX_K} and a rotary width equal to "
            f"head_dim; got in_features {k}, head_dim {d}, cos_sin_cache width "
            f"{cos_sin_cache.shape[1]}: use fused_linear and rotary_store_kv"
        )
    if not isinstance(late_meta, bool):
        raise TypeError(f"late_meta must be a bool, got {type(late_meta).__name__}")
    if late_meta and m >= MMA_FROM_ROWS:
        raise ValueError(
            f"late_meta takes at most {MMA_FROM_ROWS - 1} rows (the rows kernel), got {m}"
        )
    if out is None:
        out = torch.empty((m, num_q_heads * d), dtype=x.dtype, device=x.device)
    _check_tensor("out", out, 2, (x.dtype,))
    if tuple(out.shape) != (m, num_q_heads * d) or out.stride(1) != 1:
        raise ValueError(
            f"out has shape {tuple(out.shape)} and strides {out.stride()}, expected "
            f"[{m}, {num_q_heads * d}] with unit column stride"
        )
    if out.device != x.device:
        raise ValueError(f"out is on {out.device}, x on {x.device}")
    q = out.unflatten(1, (num_q_heads, d))
    # q's own shape stands in for k and v (same dtype, device and head layout): the
    # kernel reads neither, it writes them.
    stand_in = q[:, :hkv]
    block_size = check_rotary_store_kv_args(
        q, stand_in, stand_in, positions, cos_sin_cache, k_cache, v_cache, slot_mapping
    )
    if m == 0:
        return q
    gdc, options = pdl_launch(pdl)
    head = (x, weight, bias if bias is not None else weight,
            norm_weight if norm_weight is not None else weight, out, k_cache, v_cache,
            positions, slot_mapping, cos_sin_cache, m, n, k, float(eps),
            cos_sin_cache.shape[0], k_cache.shape[0] * block_size, x.stride(0),
            weight.stride(0), out.stride(0), k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            cos_sin_cache.stride(0))  # fmt: skip
    if m >= MMA_FROM_ROWS:
        tail = (d // 2, num_q_heads, hkv, block_size, bias is not None,
                norm_weight is not None, gdc)  # fmt: skip
        mma_qkv_rope(head, m, n // 2, k, x, tail, options)
        return q
    kh1, kh2, kl, _, warps = _rows_tile(k, x.element_size())
    pairs = 64 if INTERPRET else ROPE_PAIRS  # the interpreter pays per program
    rows = triton.next_power_of_2(m)
    args = head + (kh1, kh2, kl, pairs, d // 2, num_q_heads, hkv, block_size,
                   bias is not None, norm_weight is not None, gdc, rows, late_meta)  # fmt: skip
    key = specialization_key(args) + (x.device.index, warps)
    grid = (triton.cdiv(n // 2, pairs), triton.cdiv(m, rows))
    _ROPE_LAUNCH(key, grid, args, {"num_warps": warps, **options})
    return q
