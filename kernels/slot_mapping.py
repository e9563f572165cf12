"""Slot mapping: the paged-cache slot of each token's K/V write, computed on the device.

One program per request walks its tokens in chunks of BLOCK; one extra program writes -1
over the padded tail. Loop bounds come from query_start_loc on the device, so a launch
captured for a descriptor's (num_reqs, num_tokens) is valid for any lengths within it.
"""

from __future__ import annotations

import operator

import torch
import triton
import triton.language as tl

from .guard import check_tensors_runnable
from .launch import CachedLaunch
from .paged_attention import _check_tensor, cdiv

MAX_BLOCK_SIZE = 256


# num_reqs and num_tokens change every step: not specialized, so one compiled kernel per
# BLOCK serves every step (kernels/launch.py).
@triton.jit(do_not_specialize=["num_reqs", "num_tokens"])
def _slot_mapping_kernel(
    out_ptr,
    table_ptr,
    rows_ptr,
    row_slots_ptr,
    positions_ptr,
    qsl_ptr,
    seq_lens_ptr,
    num_reqs,
    num_tokens,
    max_blocks,
    stride_table,
    stride_rows,
    BLOCK_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    GATHER: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    ADVANCE: tl.constexpr,
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

    table_row = table_ptr + req.to(tl.int64) * stride_table
    if GATHER:
        # The step table's row `req` is a copy of the request's persistent row; the
        # slots below read the source row, so they do not wait on the copy.
        src_row = rows_ptr + tl.load(row_slots_ptr + req).to(tl.int64) * stride_rows
        cols = tl.arange(0, ROW_BLOCK)
        for c0 in range(0, max_blocks, ROW_BLOCK):
            m = c0 + cols < max_blocks
            tl.store(table_row + c0 + cols, tl.load(src_row + c0 + cols, mask=m), mask=m)
        bt_row = src_row
    else:
        bt_row = table_row

    # Clamped to [0, num_tokens): inconsistent lengths never write outside out[:num_tokens].
    start = tl.maximum(tl.load(qsl_ptr + req), 0)
    end = tl.minimum(tl.load(qsl_ptr + req + 1), num_tokens)
    if ADVANCE:
        # The same requests one step later: each moves on by its query length (1 for
        # decode). Requests without tokens (padding) keep seq_len 0.
        q_len = tl.maximum(end - start, 0)
        seq = tl.load(seq_lens_ptr + req)
        tl.store(seq_lens_ptr + req, tl.where(q_len > 0, seq + q_len, seq))
    for t0 in range(start, end, BLOCK):
        tok = (t0 + offs).to(tl.int64)
        mask = tok < end
        pos = tl.load(positions_ptr + tok, mask=mask, other=-1)
        if ADVANCE:
            pos = pos + (end - start)
            tl.store(positions_ptr + tok, pos, mask=mask)
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
    *,
    rows: torch.Tensor | None = None,
    row_slots: torch.Tensor | None = None,
) -> None:
    """out[t] = block_table[r, positions[t] // block_size] * block_size
    + positions[t] % block_size for each token t of request r, in int64.

    positions: int64 [>= num_tokens]; query_start_loc: int32 [num_reqs + 1],
    non-decreasing, entries past the real requests repeating the real token count;
    block_table: int32 [>= num_reqs, max_blocks]; out: int64 [>= num_tokens].

    With `rows` (int32 [n, max_blocks]) and `row_slots` (int64 [>= num_reqs], values in
    [0, n)), the same launch first gathers the step's table: block_table[r] =
    rows[row_slots[r]] for r < num_reqs, and the slots come from those rows.

    Tokens in [query_start_loc[num_reqs], num_tokens) are padding and get -1, as do
    tokens with a negative position, a block index >= max_blocks or a negative block id.
    out[num_tokens:] is not touched. The launch (num_reqs + 1 programs, its constexprs)
    depends on num_reqs, num_tokens and block_table's shape only, so it can be captured
    once per descriptor and replayed with new contents in the same buffers.
    """
    num_reqs = query_start_loc.numel() - 1 if isinstance(query_start_loc, torch.Tensor) else 0
    launch = prepare_slot_mapping(
        positions, query_start_loc, block_table, block_size, out, rows=rows, row_slots=row_slots
    )
    launch(num_reqs, num_tokens)


def as_int(name: str, value: object) -> int:
    """value as a Python int: ints and integer-like scalars (numpy integers, 0-d integer
    tensors) pass; bool, floats and everything else raise TypeError naming `name`."""
    if isinstance(value, (bool, float)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None


class SlotMappingLaunch:
    """The per-step launch returned by prepare_slot_mapping: `launch(num_reqs,
    num_tokens)` checks the two integers against the buffers and launches;
    `launch.check(...)` only checks (and returns them as ints)."""

    def __init__(self, limits, launch_fn):
        self._limits, self._launch_fn = limits, launch_fn

    def check(self, num_reqs, num_tokens) -> tuple[int, int]:
        given = {"num_reqs": as_int("num_reqs", num_reqs)}
        given["num_tokens"] = as_int("num_tokens", num_tokens)
        for name, v in given.items():
            if v < 0:
                raise ValueError(f"{name} must be >= 0, got {v}")
        for name, most, why in self._limits:
            if given[name] > most:
                raise ValueError(f"{name} = {given[name]} is over {most}: {why}")
        return given["num_reqs"], given["num_tokens"]

    def __call__(self, num_reqs, num_tokens) -> None:
        self._launch_fn(*self.check(num_reqs, num_tokens))


def prepare_slot_mapping(
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    out: torch.Tensor,
    *,
    rows: torch.Tensor | None = None,
    row_slots: torch.Tensor | None = None,
    advance_seq_lens: torch.Tensor | None = None,
    _device_check: bool = True,
) -> SlotMappingLaunch:
    """Check persistent buffers once and return `launch(num_reqs, num_tokens)`, which
    runs compute_slot_mapping over their first num_reqs requests and num_tokens tokens
    with only those two integers checked: the per-step path of the metadata builder.
    With `advance_seq_lens` (int32 [>= num_reqs], the step's seq_lens), the launch first
    moves the same requests one step on, on the device: every token's position and every
    request's seq_len grow by the request's query length (requests without tokens are
    left alone). This is the next decode step of an unchanged batch without a host upload.
    (_device_check=False: the caller runs another implementation on these buffers and
    only wants the checks.)"""
    _check_tensor("positions", positions, 1, (torch.int64,))
    _check_tensor("query_start_loc", query_start_loc, 1, (torch.int32,))
    _check_tensor("block_table", block_table, 2, (torch.int32,))
    _check_tensor("out", out, 1, (torch.int64,))
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        block_size = as_int("block_size", block_size)
    if block_size < 1 or block_size > MAX_BLOCK_SIZE or block_size & (block_size - 1):
        raise ValueError(
            f"block_size must be a power of two in [1, {MAX_BLOCK_SIZE}], got {block_size}"
        )
    if query_start_loc.numel() < 1:
        raise ValueError("query_start_loc needs at least 1 entry, got 0")
    gather = rows is not None or row_slots is not None
    tensors = [("positions", positions), ("query_start_loc", query_start_loc)]
    tensors.append(("block_table", block_table))
    if gather:
        if rows is None or row_slots is None:
            raise ValueError("rows and row_slots go together: pass both or neither")
        _check_tensor("rows", rows, 2, (torch.int32,))
        _check_tensor("row_slots", row_slots, 1, (torch.int64,))
        if rows.shape[1] != block_table.shape[1]:
            raise ValueError(
                f"rows has {rows.shape[1]} columns, block_table {block_table.shape[1]}"
            )
        tensors += [("rows", rows), ("row_slots", row_slots)]
    advance = advance_seq_lens is not None
    if advance:
        _check_tensor("advance_seq_lens", advance_seq_lens, 1, (torch.int32,))
        tensors.append(("advance_seq_lens", advance_seq_lens))
    for name, t in tensors:
        if t.device != out.device:
            raise ValueError(f"{name} is on {t.device}, out on {out.device}")
    if _device_check:
        check_tensors_runnable("prepare_slot_mapping", tensors + [("out", out)])
    width = block_table.shape[1]
    row_block = min(1024, triton.next_power_of_2(max(width, 1)))
    src, src_slots = (rows, row_slots) if gather else (block_table, query_start_loc)
    # (argument, most it may be for these buffers, which buffer sets that bound)
    qsl_n = query_start_loc.numel()
    limits = [
        ("num_reqs", qsl_n - 1, f"query_start_loc has {qsl_n} entries"),
        ("num_reqs", block_table.shape[0], f"block_table has {block_table.shape[0]} rows"),
        ("num_tokens", positions.numel(), f"positions.numel() = {positions.numel()}"),
        ("num_tokens", out.numel(), f"out has {out.numel()} entries"),
    ]
    if gather:
        limits.append(("num_reqs", row_slots.numel(), f"row_slots has {row_slots.numel()} entries"))
    if advance:
        n = advance_seq_lens.numel()
        limits.append(("num_reqs", n, f"advance_seq_lens has {n} entries"))
    seq_arg = advance_seq_lens if advance else query_start_loc  # unread unless ADVANCE

    def launch(num_reqs: int, num_tokens: int) -> None:
        if num_tokens == 0 and not gather:
            return
        block = _choose_block(num_tokens, num_reqs)
        args = (out, block_table, src, src_slots, positions, query_start_loc, seq_arg)
        args += (num_reqs, num_tokens, width, block_table.stride(0), src.stride(0))
        args += (block_size, block, gather, row_block, advance)
        _launch(block, (num_reqs + 1, 1, 1), args, {"num_warps": max(1, block // 256)})

    _launch = CachedLaunch(_slot_mapping_kernel)
    return SlotMappingLaunch(limits, launch)
