"""y = (x W_q^T) * scale: a projection whose weights are int8 with one float32 scale per
output row (symmetric, per channel), for the few rows of a draft step.

What it is for: a draft's lm_head is most of the bytes it reads a step (the SmolLM2-
shaped EAGLE head: 56.6 MB of a bf16 [49152, 576] lm_head against ~9 MB for its layer;
Llama-3-8B's head: 1.05 GB against ~0.5 GB for its layer and fc). A draft only proposes,
and the target's verification decides what is emitted, so a draft whose lm_head reads
half the bytes stays lossless as long as each sampled draft's q is the distribution it
was drawn from, which holds: q is computed from these logits. What it can cost is
acceptance, where the rounding flips a near-tie; bench/int8_lm_head.py counts those
flips on the embedded model.

One launch over (column block, row block) programs: each keeps up to 16 rows of x (up to
64 past 16 rows) in a [rows, BLOCK_K] tile, streams its [BLOCK_N, K] slice of W_q once,
converts it to x's dtype (exact: every int8 value is a bf16 / fp16 / fp32 value) and
accumulates through tl.dot in float32; the row scales multiply the sums once at the end.
A tile of float32 products on the CUDA cores for one to four rows was slower on the H200
at every shape timed (bench/NOTES.md, stops 38-39) and is gone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .guard import INTERPRET
from .launch import CachedLaunch, pdl_launch, specialization_key
from .paged_attention import _check_tensor, cdiv

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


if INTERPRET:

    @triton.jit
    def _rint(v):
        """v rounded to the nearest integer, ties to even (torch.round), as float32."""
        f = tl.floor(v)
        d = v - f
        odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
        return tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)

else:
    from triton.language.extra import libdevice

    @triton.jit
    def _rint(v):
        # cvt.rni on the rounded product. The floor-and-compare form above let the
        # compiler fuse x * r_x into v - floor(v) (an FMA on the exact product): ties of
        # the float32 product went by the digits past it (stop 49's GPU failure).
        return libdevice.rint(v)


@triton.jit
def _x_row_scale(xrow, K, rmask, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Per row of x: s_x = absmax / 127 and r_x = 127 / absmax (each correctly rounded;
    1 and 0 for an all-zero or non-finite row), and whether the row is finite."""
    amax = tl.zeros((ROWS,), dtype=tl.float32)
    nans = tl.zeros((ROWS,), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(xrow + ks[None, :], mask=rmask[:, None] & (ks < K)[None, :], other=0.0)
        xt = xt.to(tl.float32)
        nans += tl.sum((xt != xt).to(tl.int32), axis=1)  # max() may pass a NaN over
        amax = tl.maximum(amax, tl.max(tl.where(xt != xt, 0.0, tl.abs(xt)), axis=1))
    finite = (amax < float("inf")) & (nans == 0)
    live = finite & (amax > 0)
    safe = tl.where(live, amax, 127.0)  # no division by 0 or inf in the lanes not taken
    sx = tl.where(live, tl.math.div_rn(safe, 127.0), 1.0)
    rx = tl.where(live, tl.math.div_rn(127.0, safe), 0.0)  # x_q = round(x * rx)
    return sx, rx, finite


@triton.jit
def _linear_int8_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_o, idx_ptr, xr_ptr,
    x_len, IEEE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr, ROWS: tl.constexpr, GDC: tl.constexpr, PARTS: tl.constexpr,
    GATHER: tl.constexpr, XQ: tl.constexpr,
):  # fmt: skip
    if GDC:  # x (and its row index) comes from the kernels before
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    rmask = rows < M
    cmask = cols < N
    wrow = w_ptr + cols[:, None].to(tl.int64) * stride_w
    src = rows.to(tl.int64)
    if GATHER:  # output row i reads x[x_rows[i]], clamped into x
        src = tl.load(xr_ptr + rows, mask=rmask, other=0)
        src = tl.minimum(tl.maximum(src, 0), x_len - 1)
    xrow = x_ptr + src[:, None] * stride_x
    if XQ:  # x's rows to int8 as well (absmax / 127 a row): int8 products, int32 sums
        sx, rx, finite = _x_row_scale(xrow, K, rmask, ROWS, BLOCK_K)
        acc_i = tl.zeros((ROWS, BLOCK_N), dtype=tl.int32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < K
            w = tl.load(wrow + ks[None, :], mask=cmask[:, None] & kmask[None, :], other=0)
            x = tl.load(xrow + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            v = tl.where(finite[:, None], x.to(tl.float32), 0.0) * rx[:, None]
            xq = _rint(v)  # x times r_x: one multiply an element, not a division
            xq = tl.minimum(tl.maximum(xq, -127.0), 127.0).to(tl.int8)
            acc_i += tl.dot(xq, tl.trans(w), out_dtype=tl.int32)
        acc = acc_i.to(tl.float32) * sx[:, None]
        acc = tl.where(finite[:, None], acc, float("nan"))  # a non-finite row: NaN logits
    else:
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < K
            w = tl.load(wrow + ks[None, :], mask=cmask[:, None] & kmask[None, :], other=0)
            x = tl.load(xrow + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            w = w.to(x.dtype)
            if IEEE:  # float32 x: full-precision products, as the float32 reference does
                acc += tl.dot(x, tl.trans(w), input_precision="ieee", out_dtype=tl.float32)
            else:
                acc += tl.dot(x, tl.trans(w), out_dtype=tl.float32)
    scale = tl.load(s_ptr + cols, mask=cmask, other=0.0)
    y = (acc * scale[None, :]).to(x_ptr.dtype.element_ty)
    if not PARTS:
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_o + cols[None, :], y,
                 mask=rmask[:, None] & cmask[None, :])  # fmt: skip
    else:  # greedy: this block's maximum of each row and its first column, no logits
        # The rounded logits compared in float32 (their order kept), NaN highest: the
        # ranking of kernels.argmax_rows over linear_int8's output.
        v = y.to(tl.float32)
        v = tl.where(v != v, float("inf"), v)
        v = tl.where(cmask[None, :], v, float("-inf"))
        best = tl.max(v, axis=1)
        first = tl.min(tl.where((v == best[:, None]) & cmask[None, :], cols[None, :], N), axis=1)
        at = rows.to(tl.int64) * stride_o + tl.program_id(0)
        tl.store(out_ptr + at, best, mask=rmask)
        tl.store(idx_ptr + at, first, mask=rmask)


_LAUNCH = CachedLaunch(_linear_int8_kernel)


def check_linear_int8_args(x, weight, scale, *, out=None, x_rows=None) -> None:
    """linear_int8's argument checks (nothing launched; x_rows' values are clamped by
    the kernel, checked by its callers)."""
    _check_tensor("x", x, 2, _DTYPES)
    _check_tensor("weight", weight, 2, (torch.int8,))
    _check_tensor("scale", scale, 1, (torch.float32,))
    m, k = _checked_rows(x, x_rows), x.shape[1]
    n = weight.shape[0]
    if weight.shape[1] != k or weight.device != x.device:
        raise ValueError(
            f"weight {tuple(weight.shape)} on {weight.device} must be [N, {k}] on {x.device}"
        )
    if scale.shape[0] != n or scale.device != x.device:
        raise ValueError(
            f"scale {tuple(scale.shape)} on {scale.device} must be [{n}] on {x.device}"
        )
    if out is not None:
        _check_tensor("out", out, 2, (x.dtype,))
        if tuple(out.shape) != (m, n) or out.device != x.device:
            raise ValueError(
                f"out {tuple(out.shape)} on {out.device} must be [{m}, {n}] on {x.device}"
            )


def _checked_rows(x, x_rows) -> int:
    """x_rows' checks (int64 [M] on x's device, nothing read from an empty x); returns
    the output's row count (_rows_of)."""
    if x_rows is not None:
        _check_tensor("x_rows", x_rows, 1, (torch.int64,))
        if x_rows.device != x.device:
            raise ValueError(f"x_rows is on {x_rows.device}, x on {x.device}")
        if x_rows.shape[0] and not x.shape[0]:
            raise ValueError(f"x_rows has {x_rows.shape[0]} rows to read from an empty x")
    return _rows_of(x, x_rows)


def _rows_of(x, x_rows) -> int:
    """The output's row count: x's, or with x_rows (checked) its length."""
    return x.shape[0] if x_rows is None else x_rows.shape[0]


def _config(m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, stages, warps, rows a program), chosen by a sweep on the H200
    (bench/NOTES.md, stop 39). Up to 16 rows: one 16-row tile, 128 columns and K in
    128-wide steps over 3 stages, 8 warps (64 columns and 256-wide steps, 4 warps, from
    K = 2048: Llama-3-8B's 4096). Past 16 rows one tile holds up to 64 rows, so a draft
    batch of up to 64 reads W once per column block: 128 columns, K in 64-wide steps over
    4 stages, 4 warps."""

    def fit(block: int, size: int) -> int:
        return min(block, max(16, triton.next_power_of_2(size)))

    if m > 16:
        return fit(128, n), fit(64, k), 4, 4, min(64, triton.next_power_of_2(m))
    if k >= 2048:
        return fit(64, n), fit(256, k), 3, 4, 16
    return fit(128, n), fit(128, k), 3, 8, 16


# act_int8's default (kept off: an experiment; bench/NOTES.md, stop 45)
ACT_INT8 = False


def resolve_act_int8(act_int8) -> bool:
    """act_int8 as given (a bool), or ACT_INT8 for None; TypeError otherwise."""
    if act_int8 is None:
        return ACT_INT8
    if not isinstance(act_int8, bool):
        raise TypeError(f"act_int8 must be a bool or None, got {type(act_int8).__name__}")
    return act_int8


def linear_int8(
    x, weight, scale, *, out=None, x_rows=None, pdl: bool = False, act_int8: bool | None = None
) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] int8 * scale [N, 1])^T -> [M, N] in x's dtype, the sums
    in float32 and each scaled once. x_rows (int64 [M'], values in [0, M); outside,
    clamped): the product of x's rows x_rows instead, [M', N], read in place (no
    gather launch). pdl: launch with programmatic dependent launch. act_int8 (None:
    ACT_INT8): each row of x is quantized too, x_q = round(x * r_x) in [-127, 127] with
    r_x = 127 / max |x| (float32, ties to even; a row that is not finite gives NaN), and
    y = float32(x_q W_q^T summed in int32) * s_x * scale, s_x = max |x| / 127: int8
    tensor-core products."""
    act_int8 = resolve_act_int8(act_int8)
    check_linear_int8_args(x, weight, scale, out=out, x_rows=x_rows)
    m, k = _rows_of(x, x_rows), x.shape[1]
    n = weight.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    _launch(x, weight, scale, out, pdl, x_rows=x_rows, act_int8=act_int8)
    return out


def _launch(x, weight, scale, out, pdl: bool, idx=None, x_rows=None, act_int8=False) -> None:
    """out: the logits; with idx, the partial maxima instead, idx their columns."""
    m, k = _rows_of(x, x_rows), x.shape[1]
    n = weight.shape[0]
    block_n, block_k, stages, warps, rows = _config(m, n, k)
    if act_int8:
        block_k = max(block_k, 32)  # an int8 tensor-core step is 32 deep
    gdc, opts = pdl_launch(pdl)
    gather = x_rows is not None
    args = (x, weight, scale, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
            out if idx is None else idx, x_rows if gather else out, x.shape[0],
            x.dtype == torch.float32, block_n, block_k, stages, rows, gdc, idx is not None,
            gather, act_int8)  # fmt: skip
    key = specialization_key(args) + (x.device.index, warps)
    _LAUNCH(key, (cdiv(n, block_n), cdiv(m, rows)), args, {"num_warps": warps, **opts})


def argmax_blocks(m: int, n: int, k: int) -> int:
    """Column blocks per row that linear_int8_partials writes for x [m, k], weight
    [n, k] (0 when there is nothing to rank)."""
    return cdiv(n, _config(m, n, k)[0]) if m > 0 and n > 0 and k > 0 else 0


def check_linear_int8_partials_args(x, weight, scale, part_val, part_idx, x_rows=None) -> None:
    """linear_int8_partials' argument checks (nothing launched)."""
    check_linear_int8_args(x, weight, scale, x_rows=x_rows)
    m, k = _rows_of(x, x_rows), x.shape[1]
    n = weight.shape[0]
    if n == 0 or k == 0:
        raise ValueError(f"weight {tuple(weight.shape)}: an argmax needs logits (N, K >= 1)")
    blocks = argmax_blocks(m, n, k)
    _check_tensor("part_val", part_val, 2, (torch.float32,))
    _check_tensor("part_idx", part_idx, 2, (torch.int32,))
    for name, t in (("part_val", part_val), ("part_idx", part_idx)):
        if t.shape[0] < m or t.shape[1] < blocks or t.device != x.device:
            raise ValueError(
                f"{name} {tuple(t.shape)} on {t.device} must be at least [{m}, {blocks}] "
                f"on {x.device}"
            )
    if part_idx.stride(0) != part_val.stride(0):
        raise ValueError(
            f"part_idx's row stride {part_idx.stride(0)} must be part_val's {part_val.stride(0)}"
        )


def linear_int8_partials(
    x, weight, scale, part_val, part_idx, *, x_rows=None, pdl: bool = False,
    act_int8: bool | None = None,
) -> int:  # fmt: skip
    """The first half of a greedy argmax over x (weight * scale)^T without writing the
    logits: for row i and column block b, part_val[i, b] = the block's maximum of the
    logits rounded to x's dtype (compared in float32; NaN ranks highest) and part_idx[i,
    b] its first column. Returns the number of blocks; the token is the part_idx of the
    first block holding the row's largest part_val (reduce_argmax_parts, or the draft
    round's advance / epilogue, which need the token anyway). x_rows, act_int8: as
    linear_int8's."""
    act_int8 = resolve_act_int8(act_int8)
    check_linear_int8_partials_args(x, weight, scale, part_val, part_idx, x_rows)
    m = _rows_of(x, x_rows)
    if m > 0:
        _launch(x, weight, scale, part_val, pdl, idx=part_idx, x_rows=x_rows, act_int8=act_int8)
    return argmax_blocks(m, weight.shape[0], x.shape[1])


def quantize_rows_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: scale = max |w| of the row / 127 (1 for an all-zero row),
    w_q = round(w / scale) in [-127, 127]. Computed in float32."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D tensor, got shape {tuple(weight.shape)}")
    if not weight.dtype.is_floating_point:
        raise TypeError(f"weight must be a floating-point tensor, got {weight.dtype}")
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()
