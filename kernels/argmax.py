"""Row-wise argmax of logits (greedy decoding), first index on ties.

torch's argmax over one [1, V] row reduces it in a single thread block: about 13 µs
for V = 49152 in bf16 on an H200, three times over in every greedy draft round and once
per target step. Here two launches: (rows x vocab blocks) programs each find their
block's maximum and its first index, then one program per row combines the blocks
(the lowest index among the blocks holding the row's maximum). Values are compared in
float32, which preserves the order of bf16 / fp16 values. A NaN ranks as the maximum,
as in torch (an all-NaN row gives 0; a row holding +inf and NaN gives the first of
either, where torch gives the first NaN): the index is always inside the row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import CachedLaunch, specialization_key
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


_BLOCK_LAUNCH = CachedLaunch(_block_argmax_kernel)
_COMBINE_LAUNCH = CachedLaunch(_combine_argmax_kernel)


def _block_size(n_cols: int) -> int:
    # About 48 programs per row at V 49152: enough blocks in flight for one row.
    return max(16, min(1024, triton.next_power_of_2(cdiv(n_cols, 48))))


def check_argmax_args(logits: torch.Tensor, *, out: torch.Tensor | None = None) -> None:
    """argmax_rows' argument checks (nothing launched)."""
    _check_tensor("logits", logits, 2, _DTYPES)
    if logits.shape[1] == 0:
        raise ValueError("logits has no columns: an argmax needs at least one")
    if logits.stride(1) != 1:
        raise ValueError(f"logits rows must be contiguous, got strides {logits.stride()}")
    if out is not None:
        _check_tensor("out", out, 1, (torch.int64,))
        if out.shape[0] != logits.shape[0] or out.device != logits.device:
            raise ValueError(
                f"out {tuple(out.shape)} on {out.device} must be [{logits.shape[0]}] on "
                f"{logits.device}"
            )


def argmax_rows(logits: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [rows]: the first index of each row's maximum (torch.argmax(dim=-1))."""
    check_argmax_args(logits, out=out)
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
    args = (logits, logits.stride(0), n, part_val, part_idx, nb, block)
    _BLOCK_LAUNCH(specialization_key(args) + (dev,), (rows, nb), args, {"num_warps": warps})
    args = (part_val, part_idx, nb, n, out, max(2, triton.next_power_of_2(nb)))
    _COMBINE_LAUNCH(specialization_key(args) + (dev,), (rows,), args, {"num_warps": 1})
    return out
