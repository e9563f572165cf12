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
  a + 1 (the new committed length); and, in program 0, the round counters. It reads
  the verified tokens, accepted counts and (EAGLE) hidden states either from the
  round's own buffers or, where buffers.src holds their address and strides
  (DraftRoundKernels.sources), straight from the engine's tensors, copying them into
  the buffers as it goes: the copy is part of the round's graph, so a round whose
  inputs sit where the last one's did costs the host one graph launch and nothing else.
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

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from .guard import check_tensors_runnable
from .launch import CachedLaunch, pdl_launch, pdl_supported

__all__ = [
    "AdvanceFold",
    "ArgmaxParts",
    "DraftRoundBuffers",
    "DraftRoundKernels",
    "check_argmax_parts",
    "check_hidden_buffer",
    "check_round_sources",
    "round_sources_shape",
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
    src_ptr,  # int64 [SOURCE_FIELDS]: where the engine keeps the inputs (sources())
    hidden_ptr,  # HAS_HID: [R * W, hidden] the round's hidden states (out, from source)
    hidden,
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
    HAS_HID: tl.constexpr,
    BLOCK_H: tl.constexpr,
    GDC: tl.constexpr,
):
    if GDC:  # the inputs come from the kernels (or copies) before
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    r = tl.program_id(0)
    width = tl.load(width_ptr)
    width = tl.minimum(tl.maximum(width, 1), W)
    # Rows [0, n_src) read each input whose address is set from the engine's tensor,
    # and copy it into the round's buffer as they go; address 0: already in place.
    n_src = tl.load(src_ptr)
    acc_addr = tl.load(src_ptr + 5)
    # Columns read from a source: never past its own width (whatever buffers.width says).
    src_w = tl.minimum(width, tl.load(src_ptr + 12))

    # Every program computes the prefix sums it needs from all rows (rows <= a few
    # hundred): no second launch and no inter-program ordering.
    ri = tl.arange(0, BLOCK_R)
    in_batch = ri < num_rows
    slot_all = tl.load(slots_ptr + ri, mask=in_batch, other=-1)
    real_all = in_batch & (slot_all >= 0)
    acc_rows = tl.where(acc_addr != 0, n_src, 0)  # rows whose count comes from the source
    acc_from = in_batch & (ri < acc_rows)
    acc_all = tl.load(accepted_ptr + ri, mask=real_all & (ri >= acc_rows), other=0)
    acc_all = acc_all.to(tl.int64)
    acc_off = ri.to(tl.int64) * tl.load(src_ptr + 6)
    if tl.load(src_ptr + 7) != 0:  # int32 counts
        got = tl.load(acc_addr.to(tl.pointer_type(tl.int32)) + acc_off, mask=acc_from, other=0)
        got = got.to(tl.int64)
    else:
        got = tl.load(acc_addr.to(tl.pointer_type(tl.int64)) + acc_off, mask=acc_from, other=0)
    acc_all = tl.where(acc_from, got, acc_all)
    tl.store(accepted_ptr + ri, acc_all, mask=acc_from & (ri == r))  # row r's copy
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
    ver_row = verified_ptr + r.to(tl.int64) * stride_ver
    ver_addr = tl.load(src_ptr + 1)
    if (r < n_src) & (ver_addr != 0):  # row r's verified tokens from the engine's tensor
        in_w = j < src_w
        off = r.to(tl.int64) * tl.load(src_ptr + 2) + j.to(tl.int64) * tl.load(src_ptr + 3)
        if tl.load(src_ptr + 4) != 0:
            ids = tl.load(ver_addr.to(tl.pointer_type(tl.int32)) + off, mask=in_w, other=0)
            ids = ids.to(tl.int64)
        else:
            ids = tl.load(ver_addr.to(tl.pointer_type(tl.int64)) + off, mask=in_w, other=0)
        tl.store(ver_row + j, ids, mask=in_w)
        kept = tl.load(ver_row + j, mask=is_tok & (j >= src_w), other=0)  # past the source
        ids = tl.where(is_tok, tl.where(in_w, ids, kept), 0)
    else:
        ids = tl.load(ver_row + j, mask=is_tok, other=0)
    if HAS_HID:  # row r's hidden states, rows r * W + j of the round's buffer
        hid_addr = tl.load(src_ptr + 8)
        if (r < n_src) & (hid_addr != 0):
            hs = hid_addr.to(hidden_ptr.dtype)
            h_row = r.to(tl.int64) * tl.load(src_ptr + 9)
            s1, s2 = tl.load(src_ptr + 10), tl.load(src_ptr + 11)
            # Rows j < src_w as one [BLOCK_W, BLOCK_H] tile a chunk, so every load of a
            # chunk is in flight at once (row by row, each row's loads queued behind the
            # store before them: one dependent round trip a row).
            hh = tl.arange(0, BLOCK_H)
            src_rows = hs + h_row + j.to(tl.int64)[:, None] * s1
            dst_rows = hidden_ptr + (r.to(tl.int64) * W + j)[:, None] * hidden
            for h0 in range(0, hidden, BLOCK_H):
                m = (j < src_w)[:, None] & (h0 + hh < hidden)[None, :]
                x = tl.load(src_rows + (h0 + hh).to(tl.int64)[None, :] * s2, mask=m)
                tl.store(dst_rows + (h0 + hh)[None, :], x, mask=m)
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
def _advance_slot(slots_ptr, ri, in_batch):
    """(real, slot): which rows ri are real rows (a request slot, not padding), and the slot."""
    slot = tl.load(slots_ptr + ri, mask=in_batch, other=-1)
    return in_batch & (slot >= 0), slot


@triton.jit
def _advance_position(cur_pos_ptr, rows_ptr, stride_rows, ri, real, slot, null_row, max_blocks,
                      BLOCK_SIZE: tl.constexpr):  # fmt: skip
    """(pos, cache slot) of rows ri's next decode token. Read before the PDL wait:
    cur_pos was last written by prepare or the previous step's advance, a whole step
    back (a PDL kernel starts only once the one two back has finished:
    kernels/paged_attention.py), the table rows before the round."""
    src_row = tl.where(real, slot, null_row).to(tl.int64)
    pos = tl.load(cur_pos_ptr + ri, mask=real, other=0) + 1
    return pos, _slot_of(rows_ptr, src_row * stride_rows, pos, real, max_blocks, BLOCK_SIZE)


@triton.jit
def _advance_token(
    tok_ptr, stride_tok, val_ptr, idx_ptr, stride_p, blocks, off_ptr, ri, in_batch, real,
    vocab_size, write, FROM_PARTS: tl.constexpr, HAS_OFF: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):  # fmt: skip
    """After the PDL wait: rows ri's input ids for the decode step (the previous step's
    tokens, clamped into the vocabulary; 0 on padding rows). FROM_PARTS: the previous
    step's argmax is finished here first, its tokens written into the table where
    `write`."""
    if FROM_PARTS:
        tok = _token_of_parts(val_ptr, idx_ptr, stride_p, blocks, ri, in_batch, off_ptr,
                              HAS_OFF, BLOCK_R, BLOCK_P)  # fmt: skip
        tl.store(tok_ptr + ri.to(tl.int64) * stride_tok, tok, mask=in_batch & write)
        tok = tl.where(real, tok, 0)
    else:
        tok = tl.load(tok_ptr + ri.to(tl.int64) * stride_tok, mask=real, other=0)
    tok = tl.minimum(tl.maximum(tok, 0), vocab_size - 1)
    return tl.where(real, tok, 0)


@triton.jit
def _advance_store(cur_pos_ptr, d_ids_ptr, d_pos_ptr, d_seq_ptr, d_slot_ptr, ri, in_batch, real,
                   tok, pos, slot_out):  # fmt: skip
    """The decode step's inputs: ids, positions, seq_lens and slots, and the new cur_pos."""
    tl.store(cur_pos_ptr + ri, pos, mask=real)
    tl.store(d_ids_ptr + ri, tok, mask=in_batch)
    tl.store(d_pos_ptr + ri, tl.where(real, pos, 0), mask=in_batch)
    tl.store(d_seq_ptr + ri, tl.where(real, pos + 1, 0).to(tl.int32), mask=in_batch)
    tl.store(d_slot_ptr + ri, slot_out, mask=in_batch)


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
    real, slot = _advance_slot(slots_ptr, ri, in_batch)
    pos, slot_out = _advance_position(cur_pos_ptr, rows_ptr, stride_rows, ri, real, slot,
                                      null_row, max_blocks, BLOCK_SIZE)  # fmt: skip
    if GDC:  # the token (or its partials) comes from the step's last kernel
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    tok = _advance_token(tok_ptr, stride_tok, val_ptr, idx_ptr, stride_p, blocks, off_ptr, ri,
                         in_batch, real, vocab_size, True, FROM_PARTS, HAS_OFF, BLOCK_R,
                         BLOCK_P)  # fmt: skip
    _advance_store(cur_pos_ptr, d_ids_ptr, d_pos_ptr, d_seq_ptr, d_slot_ptr, ri, in_batch, real,
                   tok, pos, slot_out)  # fmt: skip


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


# buffers.src: [n, verified (address, row stride, column stride, int32?), accepted
# (address, stride, int32?), hidden (address, 3 strides), the sources' width w];
# see DraftRoundKernels.sources.
SOURCE_FIELDS = 13

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
    "src": (torch.int64, 1),
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
        "src": SOURCE_FIELDS,
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


def check_hidden_buffer(hidden, rows: int, device: torch.device) -> None:
    """An EAGLE round's hidden-state buffer: None, or a contiguous [>= rows, h] tensor on
    `device` (rows b * W + j hold batch row b's verified row j)."""
    if hidden is None:
        return
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or not hidden.is_contiguous():
        raise TypeError("hidden must be None or a contiguous 2-D tensor")
    if hidden.device != device or hidden.shape[0] < rows:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} on {hidden.device} needs >= {rows} rows on {device}"
        )


class DraftRoundKernels:
    """Launchers of the three kernels over one set of checked persistent buffers.
    Per call only the row count (and step / K) varies, each fixed by a graph's
    descriptor: the launches are graph-safe and cheap on the host."""

    # prepare reads the inputs through the addresses in buffers.src: a captured round
    # reads whatever the next sources() pointed it at
    reads_sources_in_graph = True

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
        hidden: torch.Tensor | None = None,
    ):
        check_draft_round_buffers(
            buffers, max_rows=max_rows, width=width, k_cap=k_cap, null_row=null_row
        )
        check_hidden_buffer(hidden, max_rows * width, buffers.slots.device)
        check_tensors_runnable("draft round", [("hidden", hidden)])
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.b, self.hidden = buffers, hidden
        self.max_rows, self.width, self.k_cap = max_rows, width, k_cap
        self.block_size, self.vocab_size, self.null_row = block_size, vocab_size, null_row
        self.max_blocks = buffers.rows.shape[1]
        self._row_block = min(1024, _pow2(self.max_blocks))
        self._prepare = CachedLaunch(_draft_prepare_kernel)
        self._advance = CachedLaunch(_draft_advance_kernel)
        self._epilogue = CachedLaunch(_draft_epilogue_kernel)
        # Programmatic dependent launch: each kernel waits first, so the next step's
        # first kernel can launch and load its weights while this one runs.
        self._gdc, self._opts = pdl_launch(pdl_supported(buffers.slots.device))

    def _rows(self, num_rows: int) -> int:
        if not 1 <= num_rows <= self.max_rows:
            raise ValueError(f"num_rows {num_rows} must be in [1, {self.max_rows}]")
        return _pow2(num_rows)

    def prepare(self, num_rows: int) -> None:
        b, block_r, hid = self.b, self._rows(num_rows), self.hidden
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
            b.src,
            hid if hid is not None else b.src,
            0 if hid is None else hid.shape[1],
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
            hid is not None,
            16
            if hid is None
            else min(1024, _pow2(hid.shape[1], 16), max(16, 4096 // _pow2(self.width))),
            self._gdc,
        )
        # Each program reduces over all rows (one warp's shuffles while they are few) and
        # may copy its row's hidden states (W x h: more warps once that is large).
        big = block_r >= 256 or (hid is not None and hid.shape[1] * self.width >= 8192)
        warps = 4 if big else 1
        self._prepare(("prepare", num_rows), (num_rows,), args, {"num_warps": warps, **self._opts})

    def _step_token(self, num_rows: int, step: int, k_max: int) -> torch.Tensor:
        """Column step - 1 of the token table (rows num_rows, k_max columns): the tokens
        decode step `step` reads. Checks step and k_max."""
        if not 1 <= step < k_max <= self.k_cap:
            raise ValueError(f"step {step} must be in [1, k_max {k_max}) and k_max <= {self.k_cap}")
        return self.b.tokens[: num_rows * k_max].view(num_rows, k_max)[:, step - 1]

    def advance(self, num_rows: int, step: int, k_max: int, parts: ArgmaxParts | None = None):
        """Inputs of decode step `step` (1 .. k_max - 1) from the tokens of step - 1;
        with `parts`, those tokens are first reduced from the step's argmax partials and
        written into the token table."""
        tok = self._step_token(num_rows, step, k_max)
        b, block_r = self.b, self._rows(num_rows)
        if parts is not None:  # each program reduces its rows' partials
            block_r = min(PARTS_ROWS, block_r)
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

    def advance_fold(
        self, num_rows: int, step: int, k_max: int, parts: ArgmaxParts | None = None
    ) -> AdvanceFold:
        """advance(num_rows, step, k_max, parts), checked and packaged for the decode
        step's first kernel to do on the way (kernels.embed_fc's `advance`), or to run
        alone."""
        b, tok = self.b, self._step_token(num_rows, step, k_max)
        self._rows(num_rows)
        pa = _parts_args(parts, num_rows, tok)  # checks the partials
        # slots, token column and stride, the partials' (val, idx, row stride, blocks, id
        # map), table rows and stride, cur_pos, d_pos, d_seq, d_slot (d_ids is the
        # kernel's own ids), max_blocks, vocab_size, null_row; the constexprs BLOCK_SIZE,
        # FROM_PARTS, HAS_OFF, BLOCK_P
        args = (b.slots, tok, k_max, *pa[:5], b.rows, b.rows.stride(0), b.cur_pos, b.d_pos,
                b.d_seq, b.d_slot, self.max_blocks, self.vocab_size, self.null_row,
                self.block_size, *pa[5:])  # fmt: skip
        return AdvanceFold(self, num_rows, step, k_max, parts, args)

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

    def sources(self, verified, accepted, hidden=None, *, checked: bool = False) -> np.ndarray:
        """The SOURCE_FIELDS int64 values (for buffers.src, uploaded with the round's host
        inputs) that make prepare read the round's inputs where the engine keeps them:
        verified [n, w] (int32 / int64, any strides), accepted [n], hidden [n, w, h] (the
        hidden buffer's dtype); None: already in the round's own buffer. prepare copies
        each into its buffer (verified[:n, :w], accepted[:n], hidden rows b * W + j) as
        it reads it, inside the round's graph: a round whose inputs sit at the same
        addresses as the last one's needs no upload and no launch. The caller keeps the
        tensors alive while the fields are in buffers.src. checked=True: the caller has
        already checked them as check_round_sources does (Drafter.propose)."""
        n, w = round_sources_shape(self, verified, accepted, hidden, checked)
        f = np.zeros(SOURCE_FIELDS, dtype=np.int64)
        if n == 0:
            return f
        f[0], f[12] = n, w
        if verified is not None:
            f[1:5] = (verified.data_ptr(), *verified.stride(), verified.dtype == torch.int32)
        if accepted is not None:
            f[5:8] = (accepted.data_ptr(), accepted.stride(0), accepted.dtype == torch.int32)
        if hidden is not None:
            f[8:12] = (hidden.data_ptr(), *hidden.stride())
        return f


def round_sources_shape(ops, verified, accepted, hidden, checked: bool) -> tuple[int, int]:
    """(rows, width) of the sources, checked unless `checked` says the caller did."""
    if not checked:
        return check_round_sources(ops, verified, accepted, hidden)
    t = next((x for x in (verified, accepted, hidden) if x is not None), None)
    if t is None:
        return 0, 0
    wide = verified if verified is not None else hidden
    return t.shape[0], 1 if wide is None else wide.shape[1]


def check_round_sources(ops, verified, accepted, hidden) -> tuple[int, int]:
    """(rows, width) of a round's input sources (None: in place); ValueError / TypeError
    naming the argument for a wrong type, dtype, device or shape, or a size past the
    round's buffers."""
    device, n, w, first = ops.b.slots.device, None, None, None
    hid_buf = ops.hidden
    ints = (torch.int32, torch.int64)
    for name, t, ndim, dtypes in (
        ("verified", verified, 2, ints),
        ("accepted", accepted, 1, ints),
        ("hidden", hidden, 3, None if hid_buf is None else (hid_buf.dtype,)),
    ):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor or None, got {type(t).__name__}")
        if name == "hidden" and hid_buf is None:
            raise ValueError("hidden is for EAGLE heads: this round has no hidden buffer")
        if t.dim() != ndim or (dtypes is not None and t.dtype not in dtypes):
            want = f"{ndim}-D" + "".join(f" {d}" for d in dtypes or ())
            raise TypeError(f"{name} must be a {want} tensor, got {t.dim()}-D {t.dtype}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, the round's buffers on {device}")
        if n is not None and t.shape[0] != n:
            raise ValueError(f"{name} has {t.shape[0]} rows, {first} {n}")
        if not 1 <= t.shape[0] <= ops.max_rows:
            raise ValueError(f"{name} has {t.shape[0]} rows, must be in [1, {ops.max_rows}]")
        if ndim > 1:
            if w is not None and t.shape[1] != w:
                raise ValueError(f"{name} has width {t.shape[1]}, verified {w}")
            if not 1 <= t.shape[1] <= ops.width:
                raise ValueError(f"{name} has width {t.shape[1]}, must be in [1, W = {ops.width}]")
            w = t.shape[1]
        if name == "hidden" and t.shape[2] != hid_buf.shape[1]:
            raise ValueError(
                f"hidden has {t.shape[2]} features, the hidden buffer {hid_buf.shape[1]}"
            )
        n, first = t.shape[0], first or name
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


@dataclass(frozen=True)
class AdvanceFold:
    """A decode step's advance left for the step's first kernel to do on the way
    (kernels.embed_fc's `advance`: one launch less a step); run() launches it alone,
    for a step whose first kernel cannot take it."""

    kernels: DraftRoundKernels
    num_rows: int
    step: int
    k_max: int
    parts: ArgmaxParts | None
    args: tuple  # the kernel arguments of the advance (DraftRoundKernels.advance_fold)

    @property
    def d_ids(self) -> torch.Tensor:
        """The step's input ids, which the advance writes."""
        return self.kernels.b.d_ids[: self.num_rows]

    def run(self) -> None:
        self.kernels.advance(self.num_rows, self.step, self.k_max, self.parts)


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
