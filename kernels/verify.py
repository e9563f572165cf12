"""The verification step's inputs in one launch.

Speculative decoding verifies w = k + 1 rows per request: the last emitted token, then
the k drafts. Before the target's forward, every metadata buffer of that uniform batch
is built from the runner's persistent state: token ids, positions, seq_lens,
query_start_loc, the step's block-table rows (gathered from the persistent rows), the
last-row indices and the slot mapping. In torch that is about seventeen small kernels;
here one program per request writes all of it.

Per request r (row = rows[r], the request's persistent slot; base = committed[row]):
  ids[r w + j]   = first[r] for j = 0, else max(drafts[r, j - 1], 0) (a -1 draft, past
                   the request's own k, is fed as token 0)
  pos[r w + j]   = base + j;  seq_lens[r] = base + w
  slots          = table[row, pos // bs] * bs + pos % bs, or -1 for a padded request
                   (row == null_row) or a position past the table / on a missing block

A -1 draft's row writes its K/V like any other: the position lies inside the request's
seq_len, so attention loads that key tile for the request's real rows too, with weight
0, and 0 x (a value never written, NaN in a fresh cache) would be NaN. The position is
past what the step can commit (at most base + k + 1), so the next steps overwrite it
before anything reads it as committed. The blocks are there: they are allocated by the
bound committed + w.
  qsl[r] = r w (and qsl[num_reqs] = num_reqs w); row_slots[r] = row;
  last[r] = r w + w - 1;  step_table[r, :] = table[row, :]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import CachedLaunch, specialization_key
from .paged_attention import _check_tensor


@triton.jit(do_not_specialize=["num_reqs"])
def _verify_prepare_kernel(
    rows_ptr, committed_ptr, first_ptr, drafts_ptr, stride_d,
    src_ptr, stride_src, step_ptr, stride_step, max_blocks, null_row,
    ids_ptr, pos_ptr, seq_ptr, qsl_ptr, row_slots_ptr, last_ptr, slot_ptr,
    num_reqs, W,
    BLOCK_SIZE: tl.constexpr, WP: tl.constexpr, ROW_BLOCK: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + r)
    base = tl.load(committed_ptr + row)
    j = tl.arange(0, WP)
    jm = j < W
    real = (tl.zeros([WP], tl.int64) + row) != null_row  # a vector: masks stay i1
    d = tl.load(drafts_ptr + r * stride_d + j - 1, mask=jm & (j >= 1), other=0)
    first = tl.load(first_ptr + r)
    tok = tl.where(j == 0, first, tl.maximum(d, 0))
    t = r * W + j
    pos = base + j
    tl.store(ids_ptr + t, tok, mask=jm)
    tl.store(pos_ptr + t, pos, mask=jm)
    # the step's table row: a copy of the request's persistent row
    src = src_ptr + row * stride_src
    cols = tl.arange(0, ROW_BLOCK)
    for c0 in range(0, max_blocks, ROW_BLOCK):
        m = c0 + cols < max_blocks
        tl.store(step_ptr + r * stride_step + c0 + cols, tl.load(src + c0 + cols, mask=m), mask=m)
    blk_idx = pos // BLOCK_SIZE
    ok = jm & real & (pos >= 0) & (blk_idx < max_blocks)
    blk = tl.load(src + blk_idx, mask=ok, other=-1).to(tl.int64)
    ok = ok & (blk >= 0)
    tl.store(slot_ptr + t, tl.where(ok, blk * BLOCK_SIZE + pos % BLOCK_SIZE, -1), mask=jm)
    tl.store(seq_ptr + r, (base + W).to(tl.int32))
    tl.store(qsl_ptr + r, (r * W).to(tl.int32))
    if r == num_reqs - 1:
        tl.store(qsl_ptr + num_reqs, (num_reqs * W).to(tl.int32))
    tl.store(row_slots_ptr + r, row)
    tl.store(last_ptr + r, r * W + W - 1)


_LAUNCH = CachedLaunch(_verify_prepare_kernel)

_I64 = (torch.int64,)


def check_verify_prepare_args(
    num_reqs, w, rows, committed, first, drafts, table_rows, step_table, block_size,
    input_ids, positions, seq_lens, query_start_loc, row_slots, last_token_idx, slot_mapping,
) -> None:  # fmt: skip
    """verify_prepare's argument checks (nothing launched)."""
    for name, v in (("num_reqs", num_reqs), ("w", w), ("block_size", block_size)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if num_reqs < 0 or w < 1 or block_size < 1 or block_size & (block_size - 1):
        raise ValueError(
            f"need num_reqs >= 0, w >= 1 and a power-of-two block_size, got {num_reqs}, "
            f"{w}, {block_size}"
        )
    t = num_reqs * w
    for name, x, n in (("rows", rows, num_reqs), ("first", first, num_reqs),
                       ("input_ids", input_ids, t), ("positions", positions, t),
                       ("row_slots", row_slots, num_reqs),
                       ("last_token_idx", last_token_idx, num_reqs),
                       ("slot_mapping", slot_mapping, t), ("committed", committed, 1)):  # fmt: skip
        _check_tensor(name, x, 1, _I64)
        if x.shape[0] < n:
            raise ValueError(f"{name} has {x.shape[0]} entries, needs at least {n}")
    _check_tensor("seq_lens", seq_lens, 1, (torch.int32,))
    _check_tensor("query_start_loc", query_start_loc, 1, (torch.int32,))
    if seq_lens.shape[0] < num_reqs or query_start_loc.shape[0] < num_reqs + 1:
        raise ValueError(
            f"seq_lens / query_start_loc have {seq_lens.shape[0]} / "
            f"{query_start_loc.shape[0]} entries, need {num_reqs} / {num_reqs + 1}"
        )
    _check_tensor("drafts", drafts, 2, _I64)
    if drafts.shape[0] < num_reqs or drafts.shape[1] < w - 1:
        raise ValueError(
            f"drafts has shape {tuple(drafts.shape)}, needs [>= {num_reqs}, >= {w - 1}]"
        )
    _check_tensor("table_rows", table_rows, 2, (torch.int32,))
    _check_tensor("step_table", step_table, 2, (torch.int32,))
    if step_table.shape[0] < num_reqs or step_table.shape[1] != table_rows.shape[1]:
        raise ValueError(
            f"step_table has shape {tuple(step_table.shape)}, table_rows "
            f"{tuple(table_rows.shape)}: need [>= {num_reqs}, {table_rows.shape[1]}]"
        )
    devices = {x.device for x in (rows, committed, first, drafts, table_rows, step_table,
                                  input_ids, positions, seq_lens, query_start_loc, row_slots,
                                  last_token_idx, slot_mapping)}  # fmt: skip
    if len(devices) != 1:
        raise ValueError(f"every tensor must be on one device, got {devices}")


def verify_prepare(
    num_reqs: int, w: int, rows, committed, first, drafts, table_rows, step_table,
    block_size: int, null_row: int, input_ids, positions, seq_lens, query_start_loc,
    row_slots, last_token_idx, slot_mapping,
) -> None:  # fmt: skip
    """Write the verification step's metadata for num_reqs requests of w rows each
    (module docstring). rows / first [>= num_reqs] int64 (request slots, null_row for
    padding; the tokens emitted last); committed int64 per slot; drafts int64
    [>= num_reqs, >= w - 1] (-1 padded); table_rows int32 [slots, max_blocks] (the
    persistent rows), step_table int32 [>= num_reqs, max_blocks]. Row values are the
    caller's (the runner writes them): they are not read on the host."""
    check_verify_prepare_args(num_reqs, w, rows, committed, first, drafts, table_rows,
                              step_table, block_size, input_ids, positions, seq_lens,
                              query_start_loc, row_slots, last_token_idx, slot_mapping)  # fmt: skip
    if num_reqs == 0:
        return
    max_blocks = table_rows.shape[1]
    args = (rows, committed, first, drafts, drafts.stride(0), table_rows, table_rows.stride(0),
            step_table, step_table.stride(0), max_blocks, int(null_row), input_ids, positions,
            seq_lens, query_start_loc, row_slots, last_token_idx, slot_mapping, num_reqs, w,
            block_size, triton.next_power_of_2(w),
            min(1024, triton.next_power_of_2(max(max_blocks, 1))))  # fmt: skip
    # num_reqs (args[18]) is not specialized: one compiled kernel serves every batch size
    key = specialization_key(args[:18] + args[19:]) + (rows.device.index,)
    _LAUNCH(key, (num_reqs,), args, {"num_warps": 1})
