"""The greedy head in one launch: token = argmax(x[rows] W^T), no logits tensor.

A greedy step needs only the index of each row's largest logit. As two kernels (the
lm_head GEMM, then kernels.argmax_rows over its [rows, V] output) it costs two launches
and, for a gather of each request's last row, a third; on the H200 the draft round of a
SmolLM2-shaped EAGLE head spent 48.6 µs of its 138 in cuBLAS's lm_head (V 49152, K 576:
a 16.2 µs GEMM for 12.6 µs of weights at 4.5 TB/s) and 7.5 µs in the argmax (three
draws, bench/NOTES.md stop 35). Here each program loads a slice of W's rows into
registers (before the PDL wait: no kernel writes W, so the loads overlap the kernel
before), runs every row of x through it (each row read in the slice layout of W's, so
it broadcasts without a layout change; float32 products and sums), rounds the logits to
W's dtype as the GEMM's output would be, and writes its slice's maximum and first
index per row; the last program to finish (an acq_rel ticket, as in argmax_rows)
combines the slices and writes each row's token, optionally through an id map
(EAGLE-3's d2t).

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
from .guard import INTERPRET
from .launch import CachedLaunch, pdl_launch, specialization_key
from .validation import _check_tensor, validation_enabled

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Rows one launch takes (every row in every program, each a pass over the W slice in
# registers). Offline sm_90 SASS at SmolLM2's lm_head (K 576, 16 columns a program): 78
# registers at 1 row, 253 with spills at 4, 585 spill stores at 8.
MAX_ROWS = 4
MAX_K = 2048  # reduction width (a program holds its [columns, K] slice of W in registers)
# (columns a program, warps); bench and tests set it. None: the default (_tile).
TILE: tuple[int, int] | None = None


@triton.jit
def _head_dot(wa, wb, x_ptr, xrow, K, KA: tl.constexpr, KB: tl.constexpr):
    """One row of x (row index xrow) times the program's W slice [BN, KA] + [BN, KB]:
    [BN] float32. x is read in the slice layout of W's, so it broadcasts for free."""
    ka = tl.arange(0, KA)
    xa = tl.load(x_ptr + xrow + ka, mask=ka < K, other=0.0).to(tl.float32)
    s = tl.sum(wa.to(tl.float32) * xa[None, :], axis=1)
    if KB > 0:
        kb = KA + tl.arange(0, KB)
        xb = tl.load(x_ptr + xrow + kb, mask=kb < K, other=0.0).to(tl.float32)
        s += tl.sum(wb.to(tl.float32) * xb[None, :], axis=1)
    return s


@triton.jit
def _combine(val_ptr, idx_ptr, r2, b, pmask, stride_p, N):
    """Each row's maximum over partial columns b and the lowest index holding it."""
    v = tl.load(val_ptr + r2 * stride_p + b, mask=pmask, other=float("-inf"), cache_modifier=".cg")
    i = tl.load(idx_ptr + r2 * stride_p + b, mask=pmask, other=N, cache_modifier=".cg")
    best = tl.max(v, axis=1)
    return best, tl.min(tl.where((v == best[:, None]) & pmask, i, N), axis=1)


@triton.jit
def _head_argmax_kernel(
    x_ptr, rows_ptr, w_ptr, part_val_ptr, part_idx_ptr, tickets_ptr, out_ptr, off_ptr,
    M, N, K, n_blocks, stride_x, stride_w, stride_out, stride_p,
    KA: tl.constexpr, KB: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
    RP: tl.constexpr, G: tl.constexpr, NG: tl.constexpr, HAS_ROWS: tl.constexpr,
    HAS_OFF: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    """K = KA (a power of two) + at most KB more; ROWS = M rows, each a pass over the
    W slice held in registers."""
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    wrow = w_ptr + cols[:, None].to(tl.int64) * stride_w
    ka = tl.arange(0, KA)[None, :]
    # W's slice first: no kernel writes it, so its loads overlap the kernel before.
    wa = tl.load(wrow + ka, mask=(cols[:, None] < N) & (ka < K), other=0.0)
    wb = wa
    if KB > 0:
        kb = KA + tl.arange(0, KB)[None, :]
        wb = tl.load(wrow + kb, mask=(cols[:, None] < N) & (kb < K), other=0.0)
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rsel = tl.arange(0, RP)[None, :]
    acc = tl.zeros((BLOCK_N, RP), dtype=tl.float32)
    for r in tl.static_range(ROWS):
        xrow = r
        if HAS_ROWS:
            xrow = tl.load(rows_ptr + r)
        s = _head_dot(wa, wb, x_ptr, xrow * stride_x, K, KA, KB)
        acc = tl.where(rsel == r, s[:, None], acc)
    # The logit as the GEMM would store it, then NaN ranked as the maximum.
    logit = acc.to(w_ptr.dtype.element_ty).to(tl.float32)  # [BN, RP]
    c2 = cols[:, None]
    logit = tl.where(logit != logit, float("inf"), logit)
    logit = tl.where(c2 < N, logit, float("-inf"))
    m = tl.max(logit, axis=0)  # [RP]
    idx = tl.min(tl.where(logit == m[None, :], c2, N), axis=0)
    r1 = tl.arange(0, RP)
    r2 = r1[:, None]
    tl.store(part_val_ptr + r1 * stride_p + pid, m, mask=r1 < M)
    tl.store(part_idx_ptr + r1 * stride_p + pid, idx, mask=r1 < M)
    # Two levels of tickets, so that no address takes more than max(G, groups) atomics
    # (same-address atomics serialise: one ticket for 1536 programs cost more than the
    # GEMV's own time on the H200). Every thread's partials are stored before a ticket
    # publishes them (release); the last arrival's acquire makes the others' visible.
    # The last program of a group combines its G slices into column n_blocks + group;
    # the last group's combines the groups and writes the tokens.
    grp = pid // G
    n_groups = tl.cdiv(n_blocks, G)
    tl.debug_barrier()
    ticket = tl.atomic_add(tickets_ptr + 1 + grp, 1, sem="acq_rel")
    if ticket == tl.minimum(G, n_blocks - grp * G) - 1:
        tl.store(tickets_ptr + 1 + grp, 0)
        b = grp * G + tl.arange(0, G)[None, :]
        best, i = _combine(part_val_ptr, part_idx_ptr, r2, b, (r2 < M) & (b < n_blocks),
                           stride_p, N)  # fmt: skip
        tl.store(part_val_ptr + r1 * stride_p + n_blocks + grp, best, mask=r1 < M)
        tl.store(part_idx_ptr + r1 * stride_p + n_blocks + grp, i, mask=r1 < M)
        tl.debug_barrier()
        ticket = tl.atomic_add(tickets_ptr, 1, sem="acq_rel")
        if ticket == n_groups - 1:
            tl.store(tickets_ptr, 0)
            b = n_blocks + tl.arange(0, NG)[None, :]
            pmask = (r2 < M) & (b < n_blocks + n_groups)
            _, i = _combine(part_val_ptr, part_idx_ptr, r2, b, pmask, stride_p, N)
            tok = i.to(tl.int64)
            if HAS_OFF:
                tok += tl.load(off_ptr + tok, mask=r1 < M, other=0)
            tl.store(out_ptr + r1 * stride_out, tok, mask=r1 < M)


_LAUNCH = CachedLaunch(_head_argmax_kernel)


MAX_GROUPS = 64  # second-level tickets
TICKETS = 1 + MAX_GROUPS  # the ticket buffer head_argmax needs


def _groups(n_blocks: int) -> tuple[int, int]:
    """(slices a group, groups): groups of a power-of-two size, at most MAX_GROUPS."""
    g = max(2, triton.next_power_of_2(triton.cdiv(n_blocks, MAX_GROUPS)))
    return g, triton.cdiv(n_blocks, g)


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
    check_ticket_args(tickets, offsets, tickets_needed=TICKETS, n_cols=n, device=x.device)


def _tile(k: int, *, interpret: bool = INTERPRET) -> tuple[int, int, int, int]:
    """(KA, KB, columns a program, warps): K as a power of two plus a rest; 64 to 128
    weights a thread (TILE overrides the columns and warps)."""
    ka = 1 << (k.bit_length() - 1)
    kb = triton.next_power_of_2(k - ka) if k > ka else 0
    per = max(1, 16384 // (ka + kb))
    block_n, warps = TILE if TILE is not None else (1 << (per.bit_length() - 1), 4)
    if interpret:  # the interpreter pays per program: larger tiles
        block_n = max(block_n, 64)
    return ka, kb, block_n, warps


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
    (a column of a token table). tickets: at least TICKETS int32 zeros the caller keeps
    for this use alone (left zero). pdl: programmatic dependent launch
    (see kernels.pdl_supported)."""
    check_head_argmax_args(x, weight, out=out, tickets=tickets, rows=rows, offsets=offsets)
    m = x.shape[0] if rows is None else rows.shape[0]
    n, k = weight.shape
    ka, kb, block_n, warps = _tile(k)
    nb = triton.cdiv(n, block_n)
    g, groups = _groups(nb)
    # each row's slice partials, then its group partials
    part_val = torch.empty((m, nb + groups), dtype=torch.float32, device=x.device)
    part_idx = torch.empty((m, nb + groups), dtype=torch.int32, device=x.device)
    gdc, options = pdl_launch(pdl)
    args = (x, rows if rows is not None else tickets, weight, part_val, part_idx, tickets,
            out, offsets if offsets is not None else out, m, n, k, nb, x.stride(0),
            weight.stride(0), out.stride(0), nb + groups, ka, kb, block_n, m,
            triton.next_power_of_2(m), g, max(2, triton.next_power_of_2(groups)),
            rows is not None, offsets is not None, gdc)  # fmt: skip
    key = specialization_key(args) + (x.device.index, warps)
    _LAUNCH(key, (nb,), args, {"num_warps": warps, **options})
    return out
