"""The greedy head in one launch: token = argmax(x[rows] W^T), no logits tensor.

A greedy step needs only the index of each row's largest logit. As two kernels (the
lm_head GEMM, then kernels.argmax_rows over its [rows, V] output) it costs two launches
and, for a gather of each request's last row, a third; on the H200 the draft round of a
SmolLM2-shaped EAGLE head spent 48.6 µs of its 138 in cuBLAS's lm_head (V 49152, K 576:
a 16.2 µs GEMM for 12.6 µs of weights at 4.5 TB/s) and 7.5 µs in the argmax (three
draws, bench/NOTES.md stop 35). Here each program holds a block of W's rows in registers
(loaded before the PDL wait, like the fused decode path's projections,
kernels/fused_linear.py), multiplies every row of x by it (K along the lanes of a warp,
columns along the warps), rounds the logits to W's dtype as the GEMM's output would be,
and writes its block's maximum and first index per row; the last program to finish (an
acq_rel ticket, as in argmax_rows) combines the blocks and writes each row's token,
optionally through an id map (EAGLE-3's d2t).

rows: an optional int64 index of x's rows (each request's last verified row in a draft
prefill), read by the kernel instead of a gather launch before it.

Ties and NaN as in argmax_rows: the first index of the maximum, NaN ranking as the
maximum. The logits are rounded to W's dtype before the comparison, so two columns
whose bf16 logits tie resolve to the lower index, as an argmax over the GEMM's output
would; the float32 accumulation order differs from cuBLAS's, so a row whose top two
logits lie within a bf16 rounding step may pick the other of the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .argmax import check_ticket_args
from .fused_linear import _lanes_sum, _rows_part, _rows_tile, _rows_w
from .guard import INTERPRET
from .launch import CachedLaunch, pdl_launch, specialization_key
from .validation import _check_tensor, validation_enabled

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_ROWS = 8  # rows one launch takes (every row in every program)
MAX_K = 2048  # the rows kernel's reduction width (fused_linear.ROWS_MAX_K)
# (columns a thread, warps) of a program; bench and tests set it. None: the default.
TILE: tuple[int, int] | None = None


@triton.jit
def _head_x(x_ptr, xr, kk, km, rmask, nn, stride_x):
    """x's rows (row indices xr) over one K piece, [BN, R, KH, KL] float32."""
    ptr = x_ptr + xr * stride_x + kk + nn * 0
    return tl.load(ptr, mask=km & rmask & (nn * 0 == 0), other=0.0).to(tl.float32)


@triton.jit
def _head_argmax_kernel(
    x_ptr, rows_ptr, w_ptr, part_val_ptr, part_idx_ptr, tickets_ptr, out_ptr, off_ptr,
    M, N, K, n_blocks, stride_x, stride_w, stride_out,
    KH1: tl.constexpr, KH2: tl.constexpr, KL: tl.constexpr, BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr, NB: tl.constexpr, HAS_ROWS: tl.constexpr, HAS_OFF: tl.constexpr,
    GDC: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    n0 = pid * BLOCK_N
    nn = n0 + tl.arange(0, BLOCK_N)[:, None, None, None]
    rr = tl.arange(0, ROWS)[None, :, None, None]
    # W's block first: no kernel writes it, so its loads overlap the kernel before.
    k1, km1, w1 = _rows_w(w_ptr, nn, N, K, stride_w, 0, KH1, KL)
    if KH2 > 0:
        k2, km2, w2 = _rows_w(w_ptr, nn, N, K, stride_w, KH1 * KL, KH2, KL)
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rmask = rr < M
    xr = rr
    if HAS_ROWS:
        xr = tl.load(rows_ptr + rr, mask=rmask, other=0)
    part = _rows_part(w1, _head_x(x_ptr, xr, k1, km1, rmask, nn, stride_x))
    if KH2 > 0:
        part += _rows_part(w2, _head_x(x_ptr, xr, k2, km2, rmask, nn, stride_x))
    # The logit as the GEMM would store it, then NaN ranked as the maximum.
    logit = _lanes_sum(part).to(w_ptr.dtype.element_ty).to(tl.float32)  # [BN, R]
    cols = n0 + tl.arange(0, BLOCK_N)[:, None]
    logit = tl.where(logit != logit, float("inf"), logit)
    logit = tl.where(cols < N, logit, float("-inf"))
    m = tl.max(logit, axis=0)  # [R]
    idx = tl.min(tl.where(logit == m[None, :], cols, N), axis=0)
    r1 = tl.arange(0, ROWS)
    tl.store(part_val_ptr + r1 * n_blocks + pid, m, mask=r1 < M)
    tl.store(part_idx_ptr + r1 * n_blocks + pid, idx, mask=r1 < M)
    # Every thread's partials are stored before the ticket publishes them (release);
    # the last program's acquire makes every other program's visible.
    tl.debug_barrier()
    ticket = tl.atomic_add(tickets_ptr, 1, sem="acq_rel")
    if ticket == n_blocks - 1:
        tl.store(tickets_ptr, 0)
        b = tl.arange(0, NB)[None, :]
        r2 = r1[:, None]
        pmask = (r2 < M) & (b < n_blocks)
        v = tl.load(part_val_ptr + r2 * n_blocks + b, mask=pmask, other=float("-inf"),
                    cache_modifier=".cg")  # fmt: skip
        i = tl.load(part_idx_ptr + r2 * n_blocks + b, mask=pmask, other=N, cache_modifier=".cg")
        best = tl.min(tl.where((v == tl.max(v, axis=1)[:, None]) & pmask, i, N), axis=1)
        best = best.to(tl.int64)
        if HAS_OFF:
            best += tl.load(off_ptr + best, mask=r1 < M, other=0)
        tl.store(out_ptr + r1 * stride_out, best, mask=r1 < M)


_LAUNCH = CachedLaunch(_head_argmax_kernel)


def head_argmax_supported(x: torch.Tensor, weight: torch.Tensor, rows: int) -> bool:
    """Whether head_argmax takes this call: 1 to MAX_ROWS rows, K up to MAX_K."""
    return 1 <= rows <= MAX_ROWS and weight.dim() == 2 and weight.shape[1] <= MAX_K


def check_head_argmax_args(x, weight, *, out, tickets, rows=None, offsets=None) -> None:
    """head_argmax's argument checks (nothing launched); rows' values in validation
    mode only (reading them is a synchronisation on the GPU)."""
    _check_tensor("x", x, 2, _DTYPES)
    _check_tensor("weight", weight, 2, (x.dtype,))
    n, k = weight.shape
    if x.shape[1] != k or weight.device != x.device:
        raise ValueError(
            f"weight {tuple(weight.shape)} on {weight.device} must be [N, {x.shape[1]}] "
            f"on {x.device}"
        )
    if n == 0:
        raise ValueError("weight has no rows: an argmax needs at least one column")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight must have contiguous rows")
    m = x.shape[0]
    if rows is not None:
        _check_tensor("rows", rows, 1, (torch.int64,))
        if rows.device != x.device:
            raise ValueError(f"rows is on {rows.device}, x on {x.device}")
        m = rows.shape[0]
        if m and validation_enabled(rows):
            lo, hi = int(rows.min()), int(rows.max())
            if lo < 0 or hi >= x.shape[0]:
                bad = lo if lo < 0 else hi
                raise ValueError(f"rows holds {bad}, outside x's rows [0, {x.shape[0]})")
    if not head_argmax_supported(x, weight, m):
        raise ValueError(
            f"head_argmax takes 1 to {MAX_ROWS} rows and K <= {MAX_K}, got {m} rows, K {k}"
        )
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.dim() != 1:
        raise ValueError(f"out must have 1 dimension, got shape {tuple(out.shape)}")
    _check_tensor("out", out.unsqueeze(-1), 2, (torch.int64,))
    if out.shape[0] != m or out.device != x.device:
        raise ValueError(f"out {tuple(out.shape)} on {out.device} must be [{m}] on {x.device}")
    if tickets is None:
        raise TypeError("tickets must be a torch.Tensor, got NoneType")
    check_ticket_args(tickets, offsets, tickets_needed=1, n_cols=n, device=x.device)


def _tile(k: int, elem: int, *, interpret: bool = INTERPRET) -> tuple[int, int, int, int, int]:
    """(KH1, KH2, KL, columns a program, warps): the rows kernel's K layout, with more
    columns a thread and more warps than a projection takes (a vocabulary is long)."""
    kh1, kh2, kl, _, _ = _rows_tile(k, elem, interpret=interpret)
    cols_thread, warps = TILE if TILE is not None else (4, 8)
    lanes_k = kl // (16 // elem)
    block_n = 32 // lanes_k * warps * cols_thread
    if interpret:
        block_n = max(block_n, 64)
    return kh1, kh2, kl, block_n, warps


def head_argmax(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    out: torch.Tensor,
    tickets: torch.Tensor,
    rows: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """out[i] = argmax_j (x[rows[i]] . weight[j]) (+ offsets[j] at the argmax) for the
    rows given (every row of x when rows is None), one launch. out: any 1-D int64 view
    (a column of a token table). tickets: int32 zeros the caller keeps for this use
    alone (its first element is used, and left zero). pdl: programmatic dependent launch
    (see kernels.pdl_supported)."""
    check_head_argmax_args(x, weight, out=out, tickets=tickets, rows=rows, offsets=offsets)
    m = x.shape[0] if rows is None else rows.shape[0]
    n, k = weight.shape
    kh1, kh2, kl, block_n, warps = _tile(k, x.element_size())
    nb = triton.cdiv(n, block_n)
    part_val = torch.empty((m, nb), dtype=torch.float32, device=x.device)
    part_idx = torch.empty((m, nb), dtype=torch.int32, device=x.device)
    gdc, options = pdl_launch(pdl)
    args = (x, rows if rows is not None else tickets, weight, part_val, part_idx, tickets,
            out, offsets if offsets is not None else out, m, n, k, nb, x.stride(0),
            weight.stride(0), out.stride(0), kh1, kh2, kl, block_n,
            triton.next_power_of_2(m), max(2, triton.next_power_of_2(nb)),
            rows is not None, offsets is not None, gdc)  # fmt: skip
    key = specialization_key(args) + (x.device.index, warps)
    _LAUNCH(key, (nb,), args, {"num_warps": warps, **options})
    return out
