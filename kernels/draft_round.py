"""The draft round's bookkeeping kernels: prepare, advance, epilogue.

A draft round (specdraft/drafter.py) runs as one CUDA graph: draft prefill over the
tokens the target just verified, then K_max - 1 draft decode steps. Everything that
depends on how many tokens the target accepted is computed here, on the device, from
persistent buffers, so the host never reads an accepted count (docs/architecture.md,
invariant 5) and a launch captured for (num_rows, W, K) serves any contents.

- prepare (one program per batch row): from each row's request slot, verified tokens
  [rows, W], accepted count a and the slot's draft KV length L, writes the draft
  prefill's input ids, positions (L .. L + a), slot mapping, ragged query_start_loc
  (a + 1 tokens per row, padding rows 0, padded tokens only at the tail), seq_lens,
  last-token indices and the step's block table; the decode steps' query_start_loc and
  last-token indices; the sampling-parameter row of each batch row; advances L by
  a + 1 (the new committed length); and, in program 0, the round counters.
- advance: before decode step s, each row's last sampled token becomes its input, its
  position moves by one, its seq_len and slot follow. Rows are independent: one program
  takes every row, or PARTS_ROWS of them when it also finishes an argmax.
- epilogue: tokens at j >= k[row] and on padding rows become -1 (up to 64 rows a
  program, PARTS_ROWS when it finishes an argmax).

A greedy step over an int8 lm_head leaves its argmax unfinished (ArgmaxParts: each
column block's maximum and first column, kernels.linear_int8_partials); advance, or the
epilogue after the last step, finishes it (the first block holding the row's largest
maximum, through the id map if any) and writes the token into the table before using
it. The step then has no argmax launch of its own: the kernel that reads the token
anyway does the reduction (a ticket for the last column block to do it instead
serialises one atomic per block: bench/NOTES.md, stops 36 and 39).

With programmatic dependent launch (kernels.pdl_supported) each of the three waits
before anything else, so the kernel after it (a step's first projection) may launch and
load its weights while it runs.

Row slots: -1 marks a padding row (it writes nothing and reads the null row); `null_row`
marks a dummy row used while capturing (it runs like a real row over the null row's
all-zero block table, so it writes no KV, and it never updates a length).
Block id 0 is the null block: a position whose block id is <= 0, or that lies past the
table's width, maps to slot -1 (nothing written).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .guard import check_tensors_runnable
from .launch import CachedLaunch, pdl_launch, pdl_supported, specialization_key

__all__ = [
    "ArgmaxParts",
    "DraftRoundBuffers",
    "DraftRoundKernels",
    "check_argmax_parts",
    "check_stage_inputs",
]


@triton.jit
def _slot_of(rows_ptr, row_base, pos, valid, max_blocks, BLOCK_SIZE: tl.constexpr):
    """int64 cache slot of each position (-1: write nothing), reading the request's
    persistent block-table row at row_base."""
    blk_idx = pos // BLOCK_SIZE
    ok = valid & (pos >= 0) & (blk_idx < max_blocks)
    blk = tl.load(rows_ptr + row_base + blk_idx, mask=ok, other=0).to(tl.int64)
    # int64: block ids times block_size pass 2^31 on caches over 2^31 / 64 blocks.
    return tl.where(ok & (blk > 0), blk * BLOCK_SIZE + pos % BLOCK_SIZE, -1)


@triton.jit
def _draft_prepare_kernel(
    slots_ptr,  # int64 [R] request slot of each row; -1 padding; null_row dummy
    k_ptr,  # int64 [R] speculative tokens of each row
    width_ptr,  # int64 [1] verified width of this round (rows beyond it are stale)
    verified_ptr,  # int64 [>= R, W]
    stride_ver,
    accepted_ptr,  # int64 [>= R]
    base_ptr,  # int32 [num_slots] draft KV length per slot
    rows_ptr,  # int32 [num_slots, max_blocks] persistent block-table rows
    stride_rows,
    table_ptr,  # int32 [>= R, max_blocks] the step's block table (out)
    stride_table,
    p_ids_ptr,  # int64 [R * W] prefill input ids (out)
    p_pos_ptr,  # int64 [R * W] prefill positions (out)
    p_slot_ptr,  # int64 [R * W] prefill slot mapping (out)
    p_src_ptr,  # int64 [R * W] row of the [R * W] verified block each token came from
    p_qsl_ptr,  # int32 [R + 1]
    p_seq_ptr,  # int32 [R]
    p_last_ptr,  # int64 [R]
    d_qsl_ptr,  # int32 [R + 1] decode steps: one token per real row
    d_last_ptr,  # int64 [R]
    param_ptr,  # int64 [R] sampling-parameter row (null_row for padding)
    cur_pos_ptr,  # int64 [R] position of each row's last written token
    counters_ptr,  # int64 [2 + K_CAP]: rounds, rows drafted, drafts per position
    num_rows,
    max_blocks,
    vocab_size,
    null_row,
    W: tl.constexpr,
    K_CAP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    GDC: tl.constexpr,
):
    if GDC:  # the inputs come from the kernels (or copies) before
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    r = tl.program_id(0)
    width = tl.load(width_ptr)
    width = tl.minimum(tl.maximum(width, 1), W)

    # Every program computes the prefix sums it needs from all rows (rows <= a few
    # hundred): no second launch and no inter-program ordering.
    ri = tl.arange(0, BLOCK_R)
    in_batch = ri < num_rows
    slot_all = tl.load(slots_ptr + ri, mask=in_batch, other=-1)
    real_all = in_batch & (slot_all >= 0)
    acc_all = tl.load(accepted_ptr + ri, mask=real_all, other=0).to(tl.int64)
    # Clamped: a count outside [0, width - 1] never reads or writes outside the buffers.
    acc_all = tl.minimum(tl.maximum(acc_all, 0), width - 1)
    cnt_all = tl.where(real_all, acc_all + 1, 0)
    start = tl.sum(tl.where(ri < r, cnt_all, 0), axis=0)
    total = tl.sum(cnt_all, axis=0)
    num_real = tl.sum(real_all.to(tl.int64), axis=0)
    cnt = tl.sum(tl.where(ri == r, cnt_all, 0), axis=0)

    slot = tl.load(slots_ptr + r)
    real = slot >= 0
    src_row = tl.where(real, slot, null_row).to(tl.int64)
    base = tl.load(base_ptr + src_row).to(tl.int64)
    base = tl.where(real, base, 0)
    row_base = src_row * stride_rows

    # The step's block table: row r is a copy of the request's persistent row.
    cols = tl.arange(0, ROW_BLOCK)
    table_row = table_ptr + r.to(tl.int64) * stride_table
    for c0 in range(0, max_blocks, ROW_BLOCK):
        m = c0 + cols < max_blocks
        tl.store(table_row + c0 + cols, tl.load(rows_ptr + row_base + c0 + cols, mask=m), mask=m)

    # Real tokens of row r go to [start, start + cnt); token j sits at position base + j.
    j = tl.arange(0, BLOCK_W)
    is_tok = j < cnt
    ids = tl.load(verified_ptr + r.to(tl.int64) * stride_ver + j, mask=is_tok, other=0)
    ids = tl.minimum(tl.maximum(ids, 0), vocab_size - 1)
    pos = base + j
    dst = start + j
    tl.store(p_ids_ptr + dst, ids, mask=is_tok)
    tl.store(p_pos_ptr + dst, pos, mask=is_tok)
    tl.store(
        p_slot_ptr + dst,
        _slot_of(rows_ptr, row_base, pos, is_tok, max_blocks, BLOCK_SIZE),
        mask=is_tok,
    )
    tl.store(p_src_ptr + dst, r.to(tl.int64) * W + j, mask=is_tok)
    # Padded tail: program r clears tokens [r * W, (r + 1) * W) that no row owns.
    t = r.to(tl.int64) * W + j
    is_pad = (j < W) & (t >= total)
    zero = tl.zeros([BLOCK_W], dtype=tl.int64)
    tl.store(p_ids_ptr + t, zero, mask=is_pad)
    tl.store(p_pos_ptr + t, zero, mask=is_pad)
    tl.store(p_slot_ptr + t, zero - 1, mask=is_pad)
    tl.store(p_src_ptr + t, zero, mask=is_pad)

    end = start + cnt
    tl.store(p_qsl_ptr + r + 1, end.to(tl.int32))
    tl.store(p_seq_ptr + r, (base + cnt).to(tl.int32))
    tl.store(p_last_ptr + r, tl.maximum(end - 1, 0))
    tl.store(d_qsl_ptr + r + 1, tl.minimum(r + 1, num_real).to(tl.int32))
    tl.store(d_last_ptr + r, tl.where(real, r, 0).to(tl.int64))
    tl.store(param_ptr + r, src_row)
    tl.store(cur_pos_ptr + r, tl.where(real, base + cnt - 1, 0))
    # The new committed length: the prefill wrote L .. L + a. Dummy rows never write it.
    tl.store(base_ptr + src_row, (base + cnt).to(tl.int32), mask=real & (slot != null_row))

    if r == 0:
        tl.store(p_qsl_ptr, 0)
        tl.store(d_qsl_ptr, 0)
        counted = real_all & (slot_all != null_row)
        k_all = tl.load(k_ptr + ri, mask=counted, other=0)
        k_all = tl.minimum(tl.maximum(k_all, 0), K_CAP)
        any_row = tl.sum(counted.to(tl.int64), axis=0)
        tl.store(counters_ptr, tl.load(counters_ptr) + tl.where(any_row > 0, 1, 0))
        tl.store(counters_ptr + 1, tl.load(counters_ptr + 1) + any_row)
        for jj in range(K_CAP):  # drafts proposed at position jj: rows with k > jj
            n_j = tl.sum((k_all > jj).to(tl.int64), axis=0)
            tl.store(counters_ptr + 2 + jj, tl.load(counters_ptr + 2 + jj) + n_j)


@triton.jit
def _token_of_parts(
    val_ptr, idx_ptr, stride_p, blocks, ri, in_batch, off_ptr,
    HAS_OFF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    """Rows ri's greedy tokens from linear_int8_partials' (maximum, first column) per
    column block: the column of the first block holding the largest maximum, mapped
    through the id map with HAS_OFF."""
    best = tl.full([BLOCK_R], float("-inf"), tl.float32)
    tok = tl.zeros([BLOCK_R], tl.int32)
    row = ri[:, None].to(tl.int64) * stride_p
    for b0 in range(0, blocks, BLOCK_P):
        bb = b0 + tl.arange(0, BLOCK_P)
        m = in_batch[:, None] & (bb < blocks)[None, :]
        v = tl.load(val_ptr + row + bb[None, :], mask=m, other=float("-inf"))
        i = tl.load(idx_ptr + row + bb[None, :], mask=m, other=2147483647)
        top = tl.max(v, axis=1)
        first = tl.min(tl.where((v == top[:, None]) & m, i, 2147483647), axis=1)
        take = top > best  # a later chunk wins only by a larger value: earlier columns
        tok = tl.where(take, first, tok)
        best = tl.where(take, top, best)
    tok = tok.to(tl.int64)
    if HAS_OFF:
        tok += tl.load(off_ptr + tok, mask=in_batch, other=0)
    return tok


@triton.jit
def _draft_advance_kernel(
    slots_ptr,  # int64 [R]
    tok_ptr,  # int64: the previous step's token of row r at tok_ptr + r * stride_tok
    stride_tok,
    val_ptr,  # FROM_PARTS: float32 / int32 [R, >= blocks] partials of the previous step,
    idx_ptr,  # whose token is written at tok_ptr first
    stride_p,
    blocks,
    off_ptr,  # HAS_OFF: int64 id map
    base_ptr,  # int32 [num_slots] (unused slots' rows are never read)
    rows_ptr,
    stride_rows,
    cur_pos_ptr,  # int64 [R] (in/out)
    d_ids_ptr,  # int64 [R] (out)
    d_pos_ptr,  # int64 [R] (out)
    d_seq_ptr,  # int32 [R] (out)
    d_slot_ptr,  # int64 [R] (out)
    num_rows,
    max_blocks,
    vocab_size,
    null_row,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    FROM_PARTS: tl.constexpr,
    HAS_OFF: tl.constexpr,
    BLOCK_P: tl.constexpr,
    GDC: tl.constexpr,
):
    ri = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_batch = ri < num_rows
    slot = tl.load(slots_ptr + ri, mask=in_batch, other=-1)
    real = in_batch & (slot >= 0)
    src_row = tl.where(real, slot, null_row).to(tl.int64)
    # The next position and its slot before the PDL wait: cur_pos was last written by
    # prepare or the previous advance, a whole step back (a PDL kernel starts only once
    # the one two back has finished: kernels/paged_attention.py), the table rows before
    # the round.
    pos = tl.load(cur_pos_ptr + ri, mask=real, other=0) + 1
    slot_out = _slot_of(rows_ptr, src_row * stride_rows, pos, real, max_blocks, BLOCK_SIZE)
    if GDC:  # the token (or its partials) comes from the step's last kernel
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if FROM_PARTS:  # the previous step's argmax finishes here: token table, then input
        tok = _token_of_parts(val_ptr, idx_ptr, stride_p, blocks, ri, in_batch, off_ptr,
                              HAS_OFF, BLOCK_R, BLOCK_P)  # fmt: skip
        tl.store(tok_ptr + ri.to(tl.int64) * stride_tok, tok, mask=in_batch)
        tok = tl.where(real, tok, 0)
    else:
        tok = tl.load(tok_ptr + ri.to(tl.int64) * stride_tok, mask=real, other=0)
    tok = tl.minimum(tl.maximum(tok, 0), vocab_size - 1)
    tl.store(cur_pos_ptr + ri, pos, mask=real)
    tl.store(d_ids_ptr + ri, tl.where(real, tok, 0), mask=in_batch)
    tl.store(d_pos_ptr + ri, tl.where(real, pos, 0), mask=in_batch)
    tl.store(d_seq_ptr + ri, tl.where(real, pos + 1, 0).to(tl.int32), mask=in_batch)
    tl.store(d_slot_ptr + ri, slot_out, mask=in_batch)


@triton.jit
def _draft_epilogue_kernel(
    slots_ptr,  # int64 [R]
    k_ptr,  # int64 [R]
    tok_ptr,  # int64 [R, K] contiguous (in/out)
    val_ptr,  # FROM_PARTS: the last step's partials (as advance's); its token is
    idx_ptr,  # written into column K - 1 here
    stride_p,
    blocks,
    off_ptr,
    num_rows,
    K,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FROM_PARTS: tl.constexpr,
    HAS_OFF: tl.constexpr,
    BLOCK_P: tl.constexpr,
    GDC: tl.constexpr,
):
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    ri = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_batch = ri < num_rows
    slot = tl.load(slots_ptr + ri, mask=in_batch, other=-1)
    k = tl.load(k_ptr + ri, mask=in_batch, other=0)
    k = tl.where(slot >= 0, k, 0)
    kk = tl.arange(0, BLOCK_K)
    m = in_batch[:, None] & (kk[None, :] < K)
    drop = kk[None, :] >= k[:, None]
    ptrs = tok_ptr + ri[:, None].to(tl.int64) * K + kk[None, :]
    if FROM_PARTS:  # column K - 1 written once: its token, or -1 where dropped
        tok = _token_of_parts(val_ptr, idx_ptr, stride_p, blocks, ri, in_batch, off_ptr,
                              HAS_OFF, BLOCK_R, BLOCK_P)  # fmt: skip
        last = kk[None, :] == K - 1
        vals = tl.where(drop, -1, tl.broadcast_to(tok[:, None], [BLOCK_R, BLOCK_K]))
        tl.store(ptrs, vals, mask=m & (drop | last))
    else:
        tl.store(ptrs, tl.full([BLOCK_R, BLOCK_K], -1, tl.int64), mask=m & drop)


@triton.jit
def _stage_inputs_kernel(
    ver_ptr,  # int32 / int64 [n, w] at strides (ver_s0, ver_s1)
    ver_s0,
    ver_s1,
    acc_ptr,  # int32 / int64 [n] at stride acc_s0
    acc_s0,
    hid_ptr,  # [n, w, h] at strides (hid_s0, hid_s1, hid_s2)
    hid_s0,
    hid_s1,
    hid_s2,
    ver_out_ptr,  # int64 [>= n, W] contiguous rows of W
    acc_out_ptr,  # int64 [>= n]
    hid_out_ptr,  # [>= n * W, h] contiguous
    w,
    h,
    W: tl.constexpr,
    COPY_VER: tl.constexpr,
    COPY_ACC: tl.constexpr,
    COPY_HID: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """One program per (row, verified column): the round's inputs into its buffers."""
    pid = tl.program_id(0)
    row = (pid // w).to(tl.int64)
    j = (pid % w).to(tl.int64)
    if COPY_VER:
        tok = tl.load(ver_ptr + row * ver_s0 + j * ver_s1)
        tl.store(ver_out_ptr + row * W + j, tok.to(tl.int64))
    if COPY_ACC:  # once a row
        first = j == 0
        acc = tl.load(acc_ptr + row * acc_s0, mask=first)
        tl.store(acc_out_ptr + row, acc.to(tl.int64), mask=first)
    if COPY_HID:
        src = hid_ptr + row * hid_s0 + j * hid_s1
        dst = hid_out_ptr + (row * W + j) * h
        for h0 in range(0, h, BLOCK_H):
            hh = h0 + tl.arange(0, BLOCK_H)
            x = tl.load(src + hh.to(tl.int64) * hid_s2, mask=hh < h)
            tl.store(dst + hh, x, mask=hh < h)


# Rows a program takes in advance / epilogue when it also finishes an argmax from
# partials ([PARTS_ROWS, <= 1024] loads): the batch spreads over SMs instead of one
# program reducing every row's blocks (batch 64: 64 x 384 partials in one program made
# the batch-64 round 5 % slower than its steps; bench/NOTES.md, stop 40).
PARTS_ROWS = 4


def _pow2(n: int, lo: int = 2) -> int:
    return max(lo, triton.next_power_of_2(max(int(n), 1)))


class DraftRoundBuffers:
    """The persistent tensors the three kernels read and write (see the kernels for
    shapes and dtypes). Built once by the drafter; the launchers check them once."""

    def __init__(self, **tensors: torch.Tensor):
        self.__dict__.update(tensors)


_SPEC = {
    # name: (dtype, ndim)
    "slots": (torch.int64, 1),
    "k": (torch.int64, 1),
    "width": (torch.int64, 1),
    "verified": (torch.int64, 2),
    "accepted": (torch.int64, 1),
    "base": (torch.int32, 1),
    "rows": (torch.int32, 2),
    "table": (torch.int32, 2),
    "p_ids": (torch.int64, 1),
    "p_pos": (torch.int64, 1),
    "p_slot": (torch.int64, 1),
    "p_src": (torch.int64, 1),
    "p_qsl": (torch.int32, 1),
    "p_seq": (torch.int32, 1),
    "p_last": (torch.int64, 1),
    "d_ids": (torch.int64, 1),
    "d_pos": (torch.int64, 1),
    "d_seq": (torch.int32, 1),
    "d_slot": (torch.int64, 1),
    "d_qsl": (torch.int32, 1),
    "d_last": (torch.int64, 1),
    "param": (torch.int64, 1),
    "cur_pos": (torch.int64, 1),
    "counters": (torch.int64, 1),
    "tokens": (torch.int64, 1),
}


def check_draft_round_buffers(
    b: DraftRoundBuffers, *, max_rows: int, width: int, k_cap: int, null_row: int
) -> None:
    """Shapes, dtypes, contiguity and one device for every buffer; raises ValueError /
    TypeError naming the buffer. Called once, when the launchers are built."""
    device = b.slots.device
    for name, (dtype, ndim) in _SPEC.items():
        t = getattr(b, name, None)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"draft round buffer {name} must be a tensor, got {type(t).__name__}")
        if t.dtype != dtype or t.dim() != ndim:
            raise TypeError(
                f"draft round buffer {name} must be {ndim}-D {dtype}, got {t.dim()}-D {t.dtype}"
            )
        if t.device != device:
            raise ValueError(f"draft round buffer {name} is on {t.device}, slots on {device}")
        if t.stride(-1) != 1:
            raise ValueError(f"draft round buffer {name} must have unit stride in its last dim")
    need = {
        "slots": max_rows,
        "k": max_rows,
        "width": 1,
        "accepted": max_rows,
        "base": null_row + 1,
        "p_ids": max_rows * width,
        "p_pos": max_rows * width,
        "p_slot": max_rows * width,
        "p_src": max_rows * width,
        "p_qsl": max_rows + 1,
        "p_seq": max_rows,
        "p_last": max_rows,
        "d_ids": max_rows,
        "d_pos": max_rows,
        "d_seq": max_rows,
        "d_slot": max_rows,
        "d_qsl": max_rows + 1,
        "d_last": max_rows,
        "param": max_rows,
        "cur_pos": max_rows,
        "counters": 2 + k_cap,
        "tokens": max_rows * k_cap,
    }
    for name, n in need.items():
        if getattr(b, name).numel() < n:
            raise ValueError(
                f"draft round buffer {name} has {getattr(b, name).numel()} entries, needs {n}"
            )
    if b.verified.shape[0] < max_rows or b.verified.shape[1] != width:
        raise ValueError(
            f"verified has shape {tuple(b.verified.shape)}, needs [>= {max_rows}, {width}]"
        )
    if b.rows.shape[0] < null_row + 1 or b.table.shape[0] < max_rows:
        raise ValueError(
            f"rows {tuple(b.rows.shape)} / table {tuple(b.table.shape)} are too "
            f"small for null_row {null_row} and {max_rows} rows"
        )
    if b.rows.shape[1] != b.table.shape[1]:
        raise ValueError(f"rows has {b.rows.shape[1]} columns, table {b.table.shape[1]}")
    check_tensors_runnable("draft round", list(vars(b).items()))


class DraftRoundKernels:
    """Launchers of the three kernels over one set of checked persistent buffers.
    Per call only the row count (and step / K) varies, each fixed by a graph's
    descriptor: the launches are graph-safe and cheap on the host."""

    def __init__(
        self,
        buffers: DraftRoundBuffers,
        *,
        max_rows: int,
        width: int,
        k_cap: int,
        block_size: int,
        vocab_size: int,
        null_row: int,
    ):
        check_draft_round_buffers(
            buffers, max_rows=max_rows, width=width, k_cap=k_cap, null_row=null_row
        )
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.b = buffers
        self.max_rows, self.width, self.k_cap = max_rows, width, k_cap
        self.block_size, self.vocab_size, self.null_row = block_size, vocab_size, null_row
        self.max_blocks = buffers.rows.shape[1]
        self._row_block = min(1024, _pow2(self.max_blocks))
        self._prepare = CachedLaunch(_draft_prepare_kernel)
        self._advance = CachedLaunch(_draft_advance_kernel)
        self._epilogue = CachedLaunch(_draft_epilogue_kernel)
        self._stage = CachedLaunch(_stage_inputs_kernel)
        # Programmatic dependent launch: each kernel waits first, so the next step's
        # first kernel can launch and load its weights while this one runs.
        self._gdc, self._opts = pdl_launch(pdl_supported(buffers.slots.device))

    def _rows(self, num_rows: int) -> int:
        if not 1 <= num_rows <= self.max_rows:
            raise ValueError(f"num_rows {num_rows} must be in [1, {self.max_rows}]")
        return _pow2(num_rows)

    def prepare(self, num_rows: int) -> None:
        b, block_r = self.b, self._rows(num_rows)
        args = (
            b.slots,
            b.k,
            b.width,
            b.verified,
            b.verified.stride(0),
            b.accepted,
            b.base,
            b.rows,
            b.rows.stride(0),
            b.table,
            b.table.stride(0),
            b.p_ids,
            b.p_pos,
            b.p_slot,
            b.p_src,
            b.p_qsl,
            b.p_seq,
            b.p_last,
            b.d_qsl,
            b.d_last,
            b.param,
            b.cur_pos,
            b.counters,
            num_rows,
            self.max_blocks,
            self.vocab_size,
            self.null_row,
            self.width,
            self.k_cap,
            self.block_size,
            block_r,
            _pow2(self.width),
            self._row_block,
            self._gdc,
        )
        warps = 4 if block_r >= 256 else 1  # each program reduces over all rows
        self._prepare(("prepare", num_rows), (num_rows,), args, {"num_warps": warps, **self._opts})

    def advance(self, num_rows: int, step: int, k_max: int, parts: ArgmaxParts | None = None):
        """Inputs of decode step `step` (1 .. k_max - 1) from the tokens of step - 1;
        with `parts`, those tokens are first reduced from the step's argmax partials and
        written into the token table."""
        if not 1 <= step < k_max <= self.k_cap:
            raise ValueError(f"step {step} must be in [1, k_max {k_max}) and k_max <= {self.k_cap}")
        b, block_r = self.b, self._rows(num_rows)
        if parts is not None:  # each program reduces its rows' partials
            block_r = min(PARTS_ROWS, block_r)
        tok = b.tokens[: num_rows * k_max].view(num_rows, k_max)[:, step - 1]
        pa = _parts_args(parts, num_rows, tok)
        args = (
            b.slots,
            tok,
            k_max,
            *pa[:5],
            b.base,
            b.rows,
            b.rows.stride(0),
            b.cur_pos,
            b.d_ids,
            b.d_pos,
            b.d_seq,
            b.d_slot,
            num_rows,
            self.max_blocks,
            self.vocab_size,
            self.null_row,
            self.block_size,
            block_r,
            *pa[5:],
            self._gdc,
        )
        # The token pointer moves with (rows, k_max, step): part of the key.
        self._advance(
            ("advance", num_rows, k_max, step) + _parts_key(parts),
            (triton.cdiv(num_rows, block_r),),
            args,
            {"num_warps": 4 if block_r >= 128 or parts is not None else 1, **self._opts},
        )

    def epilogue(self, num_rows: int, k_max: int, parts: ArgmaxParts | None = None) -> None:
        """Tokens past each row's k (and every token of a padding row) become -1; with
        `parts`, column k_max - 1 is first reduced from the last step's partials."""
        if not 1 <= k_max <= self.k_cap:
            raise ValueError(f"k_max {k_max} must be in [1, {self.k_cap}]")
        self._rows(num_rows)
        b, block_r = self.b, min(64 if parts is None else PARTS_ROWS, _pow2(num_rows))
        pa = _parts_args(parts, num_rows, b.tokens)
        args = (b.slots, b.k, b.tokens, *pa[:5], num_rows, k_max, block_r,
                _pow2(self.k_cap), *pa[5:], self._gdc)  # fmt: skip
        grid = (triton.cdiv(num_rows, block_r),)
        warps = 4 if parts is not None else 1
        self._epilogue(("epilogue", num_rows, k_max) + _parts_key(parts), grid, args,
                       {"num_warps": warps, **self._opts})  # fmt: skip

    def stage_inputs(
        self,
        verified: torch.Tensor | None,
        accepted: torch.Tensor | None,
        hidden: torch.Tensor | None = None,
        hidden_out: torch.Tensor | None = None,
    ) -> Callable[[], None] | None:
        """A launch that copies a round's inputs into its buffers: verified [n, w] into
        verified[:n, :w], accepted [n] into accepted[:n], hidden [n, w, h] into rows
        b * W + j of hidden_out [>= n * W, h] (None: that input is already in place).
        Returns a callable that runs the copy (one launch, arguments bound: calling it
        again copies whatever the same source tensors hold then), or None when there is
        nothing to copy. Checked here, once; the callable checks nothing."""
        n, w = check_stage_inputs(self, verified, accepted, hidden, hidden_out)
        if n == 0:
            return None
        check_tensors_runnable(
            "stage_inputs", [("verified", verified), ("accepted", accepted), ("hidden", hidden)]
        )
        b, dummy = self.b, self.b.accepted
        ver = verified if verified is not None else b.verified
        acc = accepted if accepted is not None else dummy
        hid = hidden if hidden is not None else hidden_out if hidden_out is not None else dummy
        hid_s = tuple(hid.stride()) if hidden is not None else (0, 0, 0)
        h = hid.shape[-1] if hidden is not None else 1
        out = hidden_out if hidden_out is not None else hid
        args = (ver, ver.stride(0) if verified is not None else 0,
                ver.stride(1) if verified is not None else 0,
                acc, acc.stride(0) if accepted is not None else 0,
                hid, *hid_s, b.verified, b.accepted, out, w, h, self.width,
                verified is not None, accepted is not None, hidden is not None,
                min(1024, _pow2(h, 16)))  # fmt: skip
        launch, key, grid = self._stage, ("stage", *specialization_key(args)), (n * w, 1, 1)
        warps = {"num_warps": 4 if h >= 512 else 1}
        return lambda: launch(key, grid, args, warps)


def check_stage_inputs(kernels, verified, accepted, hidden, hidden_out) -> tuple[int, int]:
    """(rows, width) of stage_inputs' sources; ValueError / TypeError naming the
    argument for a wrong type, dtype, device, shape or a size past the buffers."""
    device, n, w, first = kernels.b.slots.device, None, None, None
    ints = (torch.int32, torch.int64)
    for name, t, ndim, dtypes in (
        ("verified", verified, 2, ints),
        ("accepted", accepted, 1, ints),
        ("hidden", hidden, 3, None),
    ):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor or None, got {type(t).__name__}")
        if t.dim() != ndim or (dtypes is not None and t.dtype not in dtypes):
            want = f"{ndim}-D" + ("" if dtypes is None else " int32 / int64")
            raise TypeError(f"{name} must be a {want} tensor, got {t.dim()}-D {t.dtype}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, the round's buffers on {device}")
        if n is not None and t.shape[0] != n:
            raise ValueError(f"{name} has {t.shape[0]} rows, {first} {n}")
        if not 1 <= t.shape[0] <= kernels.max_rows:
            raise ValueError(f"{name} has {t.shape[0]} rows, must be in [1, {kernels.max_rows}]")
        if ndim > 1:
            if w is not None and t.shape[1] != w:
                raise ValueError(f"{name} has width {t.shape[1]}, verified {w}")
            if not 1 <= t.shape[1] <= kernels.width:
                raise ValueError(
                    f"{name} has width {t.shape[1]}, must be in [1, W = {kernels.width}]"
                )
            w = t.shape[1]
        n, first = t.shape[0], first or name
    if hidden is not None:
        out = hidden_out
        if not isinstance(out, torch.Tensor) or out.dim() != 2 or not out.is_contiguous():
            raise ValueError("hidden_out must be a contiguous 2-D tensor when hidden is given")
        if out.dtype != hidden.dtype or out.device != device or out.shape[1] != hidden.shape[2]:
            raise ValueError(
                f"hidden_out {tuple(out.shape)} {out.dtype} on {out.device} does not take hidden "
                f"{tuple(hidden.shape)} {hidden.dtype}"
            )
        if out.shape[0] < n * kernels.width:
            raise ValueError(f"hidden_out has {out.shape[0]} rows, needs {n} x W {kernels.width}")
    if n is None:
        return 0, 0
    return n, 1 if w is None else w


@dataclass(frozen=True)
class ArgmaxParts:
    """A greedy step's argmax left unfinished by kernels.linear_int8_partials: val /
    idx [>= rows, >= blocks] float32 / int32 (one row stride), `blocks` of them per row,
    and the id map (EAGLE-3's d2t) to apply to the column found, or None."""

    val: torch.Tensor
    idx: torch.Tensor
    blocks: int
    offsets: torch.Tensor | None = None


def _parts_key(parts: ArgmaxParts | None) -> tuple:
    if parts is None:
        return ()
    return (parts.blocks, parts.val.stride(0), parts.offsets is not None)


def _parts_args(parts: ArgmaxParts | None, num_rows: int, dummy: torch.Tensor) -> tuple:
    """(val, idx, stride, blocks, offsets, FROM_PARTS, HAS_OFF, BLOCK_P)."""
    if parts is None:
        return (dummy, dummy, 0, 0, dummy, False, False, 16)
    check_argmax_parts(parts, num_rows, dummy.device)
    off = parts.offsets if parts.offsets is not None else dummy
    block_p = min(1024, _pow2(parts.blocks, 16))  # a row's blocks in one load if they fit
    return (parts.val, parts.idx, parts.val.stride(0), parts.blocks, off, True,
            parts.offsets is not None, block_p)  # fmt: skip


def check_argmax_parts(parts: ArgmaxParts, num_rows: int, device: torch.device) -> None:
    """Types, shapes and device of a round step's argmax partials (ValueError /
    TypeError naming the field)."""
    if not isinstance(parts, ArgmaxParts):
        raise TypeError(f"parts must be an ArgmaxParts, got {type(parts).__name__}")
    if isinstance(parts.blocks, bool) or not isinstance(parts.blocks, int) or parts.blocks < 1:
        raise ValueError(f"parts.blocks must be a positive int, got {parts.blocks!r}")
    for name, t, dtype in (("val", parts.val, torch.float32), ("idx", parts.idx, torch.int32)):
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != 2:
            raise TypeError(f"parts.{name} must be a 2-D {dtype} tensor")
        if t.device != device or t.stride(1) != 1:
            raise ValueError(f"parts.{name} must be on {device} with unit column stride")
        if t.shape[0] < num_rows or t.shape[1] < parts.blocks:
            raise ValueError(
                f"parts.{name} {tuple(t.shape)} must be at least [{num_rows}, {parts.blocks}]"
            )
    if parts.idx.stride(0) != parts.val.stride(0):
        raise ValueError("parts.idx and parts.val must share one row stride")
    off = parts.offsets
    if off is not None and (
        not isinstance(off, torch.Tensor) or off.dtype != torch.int64 or off.dim() != 1
        or off.device != device or off.stride(0) != 1
    ):  # fmt: skip
        raise ValueError(f"parts.offsets must be a contiguous 1-D int64 id map on {device}")
