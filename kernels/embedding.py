"""Step inputs in one launch each: EAGLE-1's [embed(token); hidden] per token, and the
target's device-fed token ids resolved.

An EAGLE-1 head feeds fc with the concatenation of the token's embedding row and a
hidden state (the target's, or the head's own from the step before). torch builds it in
two launches (the embedding gather, then the cat); here one program per token copies
both halves into the [num_tokens, E + H] input of fc. Ids are the caller's to check
(the models validate input ids against the vocabulary before anything runs); an id
outside the table is clamped into it, so no read leaves the tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import CachedLaunch, specialization_key
from .paged_attention import _check_tensor

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _embed_concat_kernel(
    ids_ptr, table_ptr, stride_t, hid_ptr, stride_h, out_ptr, stride_o, n_vocab,
    E: tl.constexpr, H: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    tok = tl.load(ids_ptr + t).to(tl.int64)
    tok = tl.minimum(tl.maximum(tok, 0), n_vocab - 1)
    ce = tl.arange(0, BLOCK_E)
    e = tl.load(table_ptr + tok * stride_t + ce, mask=ce < E)
    tl.store(out_ptr + t * stride_o + ce, e.to(out_ptr.dtype.element_ty), mask=ce < E)
    ch = tl.arange(0, BLOCK_H)
    h = tl.load(hid_ptr + t * stride_h + ch, mask=ch < H)
    tl.store(out_ptr + t * stride_o + E + ch, h.to(out_ptr.dtype.element_ty), mask=ch < H)


_LAUNCH = CachedLaunch(_embed_concat_kernel)


def check_embed_concat_args(
    ids: torch.Tensor, table: torch.Tensor, hidden: torch.Tensor, out: torch.Tensor | None = None
) -> None:
    """embed_concat's argument checks (nothing launched)."""
    _check_tensor("ids", ids, 1, (torch.int32, torch.int64))
    _check_tensor("table", table, 2, _DTYPES)
    _check_tensor("hidden", hidden, 2, _DTYPES)
    n, e, h = ids.shape[0], table.shape[1], hidden.shape[1]
    if hidden.shape[0] != n:
        raise ValueError(f"hidden has {hidden.shape[0]} rows, ids {n}: one per token")
    if hidden.dtype != table.dtype:
        raise TypeError(f"hidden has dtype {hidden.dtype}, table {table.dtype}: they must agree")
    if table.shape[0] == 0:
        raise ValueError("table has no rows")
    devices = {t.device for t in (ids, table, hidden)}
    if out is not None:
        _check_tensor("out", out, 2, (table.dtype,))
        if tuple(out.shape) != (n, e + h):
            raise ValueError(f"out has shape {tuple(out.shape)}, expected [{n}, {e + h}]")
        devices.add(out.device)
    if len(devices) != 1:
        raise ValueError(f"ids, table, hidden and out must share a device, got {devices}")


def embed_concat(
    ids: torch.Tensor, table: torch.Tensor, hidden: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """[num_tokens, E + H]: table[ids] then hidden, row by row (torch.cat([F.embedding(
    ids, table), hidden], -1)). ids [num_tokens] int32/int64, table [vocab, E], hidden
    [num_tokens, H] of table's dtype."""
    check_embed_concat_args(ids, table, hidden, out)
    n, e, h = ids.shape[0], table.shape[1], hidden.shape[1]
    if out is None:
        out = torch.empty(n, e + h, dtype=table.dtype, device=table.device)
    if n == 0:
        return out
    args = (ids, table, table.stride(0), hidden, hidden.stride(0), out, out.stride(0),
            table.shape[0], e, h, triton.next_power_of_2(e), triton.next_power_of_2(h))  # fmt: skip
    warps = 4 if max(e, h) >= 512 else 1
    dev = table.device.index
    _LAUNCH(specialization_key(args) + (dev,), (n,), args, {"num_warps": warps})
    return out


@triton.jit
def _resolve_fed_ids_kernel(ids_ptr, last_ptr, out_ptr, n, n_rows, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    ids = tl.load(ids_ptr + offs, mask=live, other=0).to(tl.int64)
    fed = ids < 0
    row = tl.minimum(-1 - ids, n_rows - 1)  # fed: >= 0
    tok = tl.load(last_ptr + row, mask=live & fed, other=0)
    tl.store(out_ptr + offs, tl.where(fed, tok, ids), mask=live)


_RESOLVE = CachedLaunch(_resolve_fed_ids_kernel)


def check_resolve_fed_ids_args(
    ids: torch.Tensor, last_token: torch.Tensor, out: torch.Tensor | None = None
) -> None:
    """resolve_fed_ids's argument checks (nothing launched)."""
    _check_tensor("ids", ids, 1, (torch.int64,))
    _check_tensor("last_token", last_token, 1, (torch.int64,))
    if last_token.shape[0] == 0:
        raise ValueError("last_token has no rows")
    devices = {ids.device, last_token.device}
    if out is not None:
        _check_tensor("out", out, 1, (torch.int64,))
        if out.shape != ids.shape:
            raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(ids.shape)}")
        devices.add(out.device)
    if len(devices) != 1:
        raise ValueError(f"ids, last_token and out must share a device, got {devices}")


def resolve_fed_ids(
    ids: torch.Tensor, last_token: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """int64 [n]: ids with each device-fed entry -(row + 1) replaced by last_token[row]
    (the token the step before sampled for that block-table row), the others as they
    are; what torch does in five launches (compare, negate, clamp, gather, select) in
    one. A fed row past the table reads its last row: no read leaves last_token."""
    check_resolve_fed_ids_args(ids, last_token, out)
    n = ids.shape[0]
    if out is None:
        out = torch.empty_like(ids)
    if n == 0:
        return out
    block = min(1024, triton.next_power_of_2(n))
    args = (ids, last_token, out, n, last_token.shape[0], block)
    warps = 4 if block >= 512 else 1
    _RESOLVE(specialization_key(args) + (ids.device.index,), (triton.cdiv(n, block),), args,
             {"num_warps": warps})  # fmt: skip
    return out
