"""Row-wise argmax of logits (greedy decoding), first index on ties.

torch's argmax over one [1, V] row reduces it in a single thread block: about 13 µs
for V = 49152 in bf16 on an H200, three times over in every greedy draft round and once
per target step. Here two launches: (rows x vocab blocks) programs each find their
block's maximum and its first index, then one program per row combines the blocks
(the lowest index among the blocks holding the row's maximum). Values are compared in
float32, which preserves the order of bf16 / fp16 values. With a caller-owned ticket
buffer it is one launch: the last block program of each row (an acq_rel ticket, reset
by that program) combines the row and writes the token, optionally through an id map
(EAGLE-3's d2t: token = i + offsets[i]) into a strided output (a column of the draft
round's token table). A NaN ranks as the maximum,
as in torch (an all-NaN row gives 0; a row holding +inf and NaN gives the first of
either, where torch gives the first NaN): the index is always inside the row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import CachedLaunch, pdl_launch, specialization_key
from .paged_attention import _check_tensor, cdiv

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _block_argmax_kernel(
    x_ptr, stride_x, n_cols, part_val_ptr, part_idx_ptr, n_blocks, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN ranks as the maximum, as in torch
    m = tl.max(x, axis=0)
    idx = tl.min(tl.where((x == m) & mask, cols, n_cols), axis=0)
    tl.store(part_val_ptr + row * n_blocks + blk, m)
    tl.store(part_idx_ptr + row * n_blocks + blk, idx)


@triton.jit
def _combine_argmax_kernel(part_val_ptr, part_idx_ptr, n_blocks, n_cols, out_ptr, NB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b = tl.arange(0, NB)
    mask = b < n_blocks
    v = tl.load(part_val_ptr + row * n_blocks + b, mask=mask, other=float("-inf"))
    i = tl.load(part_idx_ptr + row * n_blocks + b, mask=mask, other=n_cols)
    m = tl.max(v, axis=0)
    best = tl.min(tl.where((v == m) & mask, i, n_cols), axis=0)
    tl.store(out_ptr + row, best.to(tl.int64))


@triton.jit
def _argmax_one_launch_kernel(
    x_ptr, stride_x, n_cols, part_val_ptr, part_idx_ptr, n_blocks, tickets_ptr,
    out_ptr, stride_out, off_ptr, BLOCK: tl.constexpr, NB: tl.constexpr,
    HAS_OFF: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    if GDC:  # the logits come from the kernel before; the next may launch and load now
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)
    m = tl.max(x, axis=0)
    idx = tl.min(tl.where((x == m) & mask, cols, n_cols), axis=0)
    tl.store(part_val_ptr + row * n_blocks + blk, m)
    tl.store(part_idx_ptr + row * n_blocks + blk, idx)
    # The ticket publishes this block's partials (release) and, for the last block of
    # the row, makes every other block's visible (acquire).
    ticket = tl.atomic_add(tickets_ptr + row, 1, sem="acq_rel")
    if ticket == n_blocks - 1:
        tl.store(tickets_ptr + row, 0)
        b = tl.arange(0, NB)
        bmask = b < n_blocks
        v = tl.load(part_val_ptr + row * n_blocks + b, mask=bmask, other=float("-inf"))
        i = tl.load(part_idx_ptr + row * n_blocks + b, mask=bmask, other=n_cols)
        best = tl.min(tl.where((v == tl.max(v, axis=0)) & bmask, i, n_cols), axis=0)
        best = best.to(tl.int64)
        if HAS_OFF:
            best += tl.load(off_ptr + best)
        tl.store(out_ptr + row * stride_out, best)


_BLOCK_LAUNCH = CachedLaunch(_block_argmax_kernel)
_COMBINE_LAUNCH = CachedLaunch(_combine_argmax_kernel)
_ONE_LAUNCH = CachedLaunch(_argmax_one_launch_kernel)


def _block_size(n_cols: int) -> int:
    # About 48 programs per row at V 49152: enough blocks in flight for one row.
    return max(16, min(1024, triton.next_power_of_2(cdiv(n_cols, 48))))


def check_argmax_args(
    logits: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    tickets: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
) -> None:
    """argmax_rows' argument checks (nothing launched)."""
    _check_tensor("logits", logits, 2, _DTYPES)
    if logits.shape[1] == 0:
        raise ValueError("logits has no columns: an argmax needs at least one")
    if logits.stride(1) != 1:
        raise ValueError(f"logits rows must be contiguous, got strides {logits.stride()}")
    rows, n = logits.shape
    if out is not None:
        if tickets is None:
            _check_tensor("out", out, 1, (torch.int64,))
        else:  # the one launch writes through out's stride (a column of a table)
            if isinstance(out, torch.Tensor) and out.dim() != 1:
                raise ValueError(f"out must have 1 dimension, got shape {tuple(out.shape)}")
            _check_tensor("out", out.unsqueeze(-1) if isinstance(out, torch.Tensor) else out,
                          2, (torch.int64,))  # fmt: skip
        if out.shape[0] != rows or out.device != logits.device:
            raise ValueError(
                f"out {tuple(out.shape)} on {out.device} must be [{rows}] on {logits.device}"
            )
    if tickets is not None:
        _check_tensor("tickets", tickets, 1, (torch.int32,))
        if tickets.shape[0] < rows or tickets.device != logits.device or tickets.stride(0) != 1:
            raise ValueError(
                f"tickets {tuple(tickets.shape)} on {tickets.device} must be a contiguous "
                f"[>= {rows}] int32 buffer of zeros on {logits.device}"
            )
    if offsets is not None:
        _check_tensor("offsets", offsets, 1, (torch.int64,))
        if offsets.shape[0] != n or offsets.device != logits.device or offsets.stride(0) != 1:
            raise ValueError(
                f"offsets {tuple(offsets.shape)} on {offsets.device} must be a contiguous "
                f"[{n}] int64 id map on {logits.device}"
            )
        if tickets is None:
            raise ValueError("offsets needs tickets (the one-launch path maps the ids)")


def argmax_rows(
    logits: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    tickets: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """int64 [rows]: the first index of each row's maximum (torch.argmax(dim=-1)), plus
    offsets[index] when an id map is given. out: any 1-D int64 view (e.g. a column).
    tickets: int32 zeros, at least one per row, that the caller keeps for this use
    alone (one call in flight at a time): the argmax then takes one launch and leaves
    them zero. pdl: that launch with programmatic dependent launch (the kernel after it
    may start and load its weights while it runs)."""
    check_argmax_args(logits, out=out, tickets=tickets, offsets=offsets)
    rows, n = logits.shape
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    block = _block_size(n)
    nb = cdiv(n, block)
    part_val = torch.empty((rows, nb), dtype=torch.float32, device=logits.device)
    part_idx = torch.empty((rows, nb), dtype=torch.int32, device=logits.device)
    warps = max(1, min(8, block // 256))
    dev = logits.device.index  # a compiled kernel is loaded on one device
    nbp = max(2, triton.next_power_of_2(nb))
    if tickets is not None:
        gdc, options = pdl_launch(pdl)
        args = (logits, logits.stride(0), n, part_val, part_idx, nb, tickets, out,
                out.stride(0), out if offsets is None else offsets, block, nbp,
                offsets is not None, gdc)  # fmt: skip
        _ONE_LAUNCH(specialization_key(args) + (dev,), (rows, nb), args,
                    {"num_warps": warps, **options})  # fmt: skip
        return out
    args = (logits, logits.stride(0), n, part_val, part_idx, nb, block)
    _BLOCK_LAUNCH(specialization_key(args) + (dev,), (rows, nb), args, {"num_warps": warps})
    args = (part_val, part_idx, nb, n, out, nbp)
    _COMBINE_LAUNCH(specialization_key(args) + (dev,), (rows,), args, {"num_warps": 1})
    return out
