"""Slot mapping: the paged-cache slot of each token's K/V write, computed on the device.

One program per request walks its tokens in chunks of BLOCK; one extra program writes -1
over the padded tail. Loop bounds come from query_start_loc on the device, so a launch
captured for a descriptor's (num_reqs, num_tokens) is valid for any lengths within it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_attention import _check_tensor, cdiv

MAX_BLOCK_SIZE = 256


@triton.jit
def _slot_mapping_kernel(
    out_ptr,
    positions_ptr,
    qsl_ptr,
    block_table_ptr,
    num_reqs,
    num_tokens,
    max_blocks,
    stride_bt,
    BLOCK_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    req = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    if req == num_reqs:
        # Padded tail: tokens no request owns write nothing to the cache.
        tail = tl.maximum(tl.minimum(tl.load(qsl_ptr + num_reqs), num_tokens), 0)
        for t0 in range(tail, num_tokens, BLOCK):
            tok = (t0 + offs).to(tl.int64)
            tl.store(out_ptr + tok, tl.full([BLOCK], -1, tl.int64), mask=tok < num_tokens)
        return

    # Clamped to [0, num_tokens): inconsistent lengths never write outside out[:num_tokens].
    start = tl.maximum(tl.load(qsl_ptr + req), 0)
    end = tl.minimum(tl.load(qsl_ptr + req + 1), num_tokens)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for t0 in range(start, end, BLOCK):
        tok = (t0 + offs).to(tl.int64)
        mask = tok < end
        pos = tl.load(positions_ptr + tok, mask=mask, other=-1)
        blk_idx = pos // BLOCK_SIZE
        # A negative position or one past the table's width reads nothing and maps to -1.
        valid = mask & (pos >= 0) & (blk_idx < max_blocks)
        # int64: block ids times block_size pass 2^31 on caches over 2^31 / 256 blocks.
        blk = tl.load(bt_row + blk_idx, mask=valid, other=-1).to(tl.int64)
        valid = valid & (blk >= 0)
        slot = tl.where(valid, blk * BLOCK_SIZE + pos % BLOCK_SIZE, -1)
        tl.store(out_ptr + tok, slot, mask=mask)


def _choose_block(num_tokens: int, num_reqs: int) -> int:
    """Tokens per chunk from the descriptor's average query length (64 .. 1024)."""
    avg = cdiv(num_tokens, max(num_reqs, 1))
    return min(1024, max(64, triton.next_power_of_2(max(avg, 1))))


def compute_slot_mapping(
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    out: torch.Tensor,
    num_tokens: int,
) -> None:
    """out[t] = block_table[r, positions[t] // block_size] * block_size
    + positions[t] % block_size for each token t of request r, in int64.

    positions: int64 [>= num_tokens]; query_start_loc: int32 [num_reqs + 1],
    non-decreasing, entries past the real requests repeating the real token count;
    block_table: int32 [>= num_reqs, max_blocks]; out: int64 [>= num_tokens].

    Tokens in [query_start_loc[num_reqs], num_tokens) are padding and get -1, as do
    tokens with a negative position, a block index >= max_blocks or a negative block id.
    out[num_tokens:] is not touched. The launch (num_reqs + 1 programs, its constexprs)
    depends on num_reqs, num_tokens and block_table's shape only, so it can be captured
    once per descriptor and replayed with new contents in the same buffers.
    """
    _check_tensor("positions", positions, 1, (torch.int64,))
    _check_tensor("query_start_loc", query_start_loc, 1, (torch.int32,))
    _check_tensor("block_table", block_table, 2, (torch.int32,))
    _check_tensor("out", out, 1, (torch.int64,))
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    if block_size < 1 or block_size > MAX_BLOCK_SIZE or block_size & (block_size - 1):
        raise ValueError(
            f"block_size must be a power of two in [1, {MAX_BLOCK_SIZE}], got {block_size}"
        )
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
        raise TypeError(f"num_tokens must be an int, got {type(num_tokens).__name__}")
    if num_tokens < 0 or num_tokens > positions.numel():
        raise ValueError(
            f"num_tokens must be in [0, positions.numel() = {positions.numel()}], got {num_tokens}"
        )
    if out.numel() < num_tokens:
        raise ValueError(f"out has {out.numel()} entries, fewer than num_tokens {num_tokens}")
    num_reqs = query_start_loc.numel() - 1
    if num_reqs < 0:
        raise ValueError("query_start_loc needs at least 1 entry, got 0")
    if block_table.shape[0] < num_reqs:
        raise ValueError(
            f"block_table has {block_table.shape[0]} rows, fewer than num_reqs {num_reqs}"
        )
    for name, t in (
        ("positions", positions),
        ("query_start_loc", query_start_loc),
        ("block_table", block_table),
    ):
        if t.device != out.device:
            raise ValueError(f"{name} is on {t.device}, out on {out.device}")
    if num_tokens == 0:
        return
    block = _choose_block(num_tokens, num_reqs)
    _slot_mapping_kernel[(num_reqs + 1,)](
        out,
        positions,
        query_start_loc,
        block_table,
        num_reqs,
        num_tokens,
        block_table.shape[1],
        block_table.stride(0),
        BLOCK_SIZE=block_size,
        BLOCK=block,
        num_warps=max(1, block // 256),
    )
