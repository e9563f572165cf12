"""Paged attention over a ragged batch: decode, short multi-token queries and prefill.

One kernel serves every query shape. Programs tile the batch along three axes:

- axis 0, query tiles: each request's query tokens are cut into tiles of BLOCK_Q tokens,
  and a tile carries the QPK query heads that share one KV head, so a program's rows
  are BLOCK_Q tokens x QPK heads (padded up to BLOCK_M). The tile index space has
  cdiv(num_tokens, BLOCK_Q) + num_reqs entries, an upper bound that depends on the
  descriptor only; each program finds its request by a binary search over
  query_start_loc on the device. Programs past the last real request zero the rows of
  padded tokens.
- axis 1, KV heads.
- axis 2, KV splits (flash-decoding). With NUM_SPLITS > 1 every program writes a
  normalised partial output and its log-sum-exp, and `_combine_splits_kernel` merges
  them. The count is a host constant; the boundaries are each row's own: its context
  (from seq_lens on the device) in BLOCK_N-key tiles, cut into NUM_SPLITS runs, as a
  decode step of that token alone cuts it. A token verified among others then sums the
  same keys in the same order as when decoded one a step, and gets the same bits (for
  the same key tile width: a verification of up to BLOCK_M / QPK tokens in decode's
  BLOCK_M).

Short queries of small batches at short length bounds take another kernel instead:
kernels/token_attention.py (choose_launch_config's per_token), one program a (token,
query head, key chunk) that loads its keys before the PDL wait.

All lengths are read on the device, so one captured CUDA graph is valid for every
batch whose num_tokens / num_reqs / max_query_len fit the launch it was captured with.

Metadata is never trusted for addresses (as in kernels/slot_mapping.py): query starts
and ends are clamped into [0, num_tokens] with end >= start, seq_len into [0, the block
table's width x block_size], and block ids outside [0, num_blocks) are never
dereferenced (their keys load as zeros). So no metadata makes a kernel read outside q,
the cache or the metadata, or write outside `out`, and every value written is finite (a
row that sees no key, or only such zero keys, gets zeros). kernels/validation.py turns
such metadata into errors before the launch where a host read is affordable.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

# The argument checks live with the others in validation.py. The other launchers import
# _check_tensor and validate_kv_cache from here (re-exported: `name as name`), and
# specdraft.kernels exports check_paged_attention_args from here.
# _load_qsl is re-exported for kernels/fused_linear.py.
from .attention_common import _load_qsl as _load_qsl
from .attention_common import _softcapped
from .launch import pdl_launch
from .token_attention import token_attention
from .validation import MAX_NUM_SPLITS, check_paged_attention_args
from .validation import _check_tensor as _check_tensor
from .validation import validate_kv_cache as validate_kv_cache


@triton.jit
def _find_request(qsl_ptr, tile, num_reqs, num_tokens, BLOCK_Q: tl.constexpr):
    """Largest r in [0, num_reqs] whose first tile index qsl[r] // BLOCK_Q + r <= tile,
    or 0 when there is none (a tile before a request 0 that starts past row 0).

    r == num_reqs means the tile lies past every request (padded tokens)."""
    lo: tl.int32 = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_tile = _load_qsl(qsl_ptr, mid, num_tokens) // BLOCK_Q + mid
        go_right = first_tile <= tile
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid - 1)
    return lo


@triton.jit
def _tile_ids(bt_row, kv0, kv_hi, num_blocks, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
              MASK: tl.constexpr):  # fmt: skip
    """The key tile at kv0's block ids (int64, an id outside [0, num_blocks) replaced by
    0), whether each was in range, and which keys lie below kv_hi."""
    offs_n = kv0 + tl.arange(0, BLOCK_N)
    n_valid = offs_n < kv_hi
    if MASK:
        blk = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_valid, other=0)
    else:
        blk = tl.load(bt_row + offs_n // BLOCK_SIZE)
    # A block id outside [0, num_blocks) is never dereferenced: its keys load as zero
    # vectors (masked K and V loads), so they score 0 and add nothing to the output
    # beyond a share of the softmax denominator; a row whose visible keys are all such
    # gets zeros. Masking their scores to -inf instead (true "no key") needs the ids in
    # the scores' MMA layout, a shared-memory layout conversion per key tile: measured on
    # the H200 (Hq 32, Hkv 8, D 128, bf16) it cost 1.37-1.48x on decode and 1.21x on
    # prefill. This way costs a compare pair and a select per key plus masks on loads
    # whose layout already holds the ids: 0.96-1.04x (decode b64 ctx 4096 251 -> 258 us,
    # b8 41.4 -> 42.9 us, verify b32 q8 88.8 -> 87.1 us, prefill 2x4096 944 -> 905 us).
    blk_ok = (blk >= 0) & (blk < num_blocks)
    # int64: block id * block stride exceeds 2^31 elements on large caches.
    return tl.where(blk_ok, blk, 0).to(tl.int64), blk_ok, n_valid


@triton.jit
def _tile_kv(head_ptr, kv0, blk, blk_ok, n_valid, offs_d, d_mask, stride_b, stride_t,
             BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
             EVEN_D: tl.constexpr, TRANS: tl.constexpr):  # fmt: skip
    """The key tile at kv0 of one cache (K or V) for one KV head: [HEAD_DIM_P, BLOCK_N]
    with TRANS (keys, as the scores' dot takes them), else [BLOCK_N, HEAD_DIM_P]; keys
    of out-of-range blocks (and with MASK, keys at or past kv_hi) are zeros."""
    in_blk = (kv0 + tl.arange(0, BLOCK_N)) % BLOCK_SIZE
    ok = blk_ok
    if MASK:
        ok = n_valid & blk_ok
    if TRANS:
        ptrs = head_ptr + blk[None, :] * stride_b + in_blk[None, :] * stride_t + offs_d[:, None]
        mask = ok[None, :]
        if MASK or not EVEN_D:
            mask = mask & d_mask[:, None]
    else:
        ptrs = head_ptr + blk[:, None] * stride_b + in_blk[:, None] * stride_t + offs_d[None, :]
        mask = ok[:, None]
        if MASK or not EVEN_D:
            mask = mask & d_mask[None, :]
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _tile_scores(q, k, m_i, l_i, kv0, row_lo, row_hi, scale, qk_scale, softcap,
                 BLOCK_N: tl.constexpr, USE_SOFTCAP: tl.constexpr, MASK: tl.constexpr,
                 LO_MASK: tl.constexpr, LO_TILE: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):  # fmt: skip
    """The online softmax's step over one key tile's scores: (the new running max, the
    new running sum, the tile's probabilities p, the old terms' factor alpha). Row r
    sees keys [row_lo[r], row_hi[r]): LO_MASK compares each key with row_lo, LO_TILE
    (row_lo a multiple of BLOCK_N) each row's row_lo with the tile's start; neither:
    row_lo is 0. MASK False: every key of the tile is visible to every row (the caller
    guarantees it), so no mask is built."""
    s = tl.dot(q, k, input_precision=DOT_PRECISION)
    if USE_SOFTCAP:
        s = _softcapped(s, scale, softcap)
    else:
        s = s * qk_scale
    if MASK:
        offs_n = kv0 + tl.arange(0, BLOCK_N)
        # row_hi <= kv_hi (the caller clamps it), so it also masks the ragged end.
        hi = row_hi
        if LO_TILE:
            # Splits without a window: row_lo is a multiple of BLOCK_N, so a row sees
            # all of this tile from kv0 up or none of it: one select a row, not a
            # compare a score (SmolLM2's heads, batch 8, context 32768, 4 tokens:
            # 89.6 -> 87.7 us; 84.6 before rows took their own splits).
            hi = tl.where(row_lo <= kv0, row_hi, 0)
        visible = offs_n[None, :] < hi[:, None]
        if LO_MASK:
            visible = visible & (offs_n[None, :] >= row_lo[:, None])
        s = tl.where(visible, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return m_new, l_i * alpha + tl.sum(p, 1), p, alpha


@triton.jit
def _attend_tile(
    q,
    m_i,
    l_i,
    acc,
    kv0,
    kv_hi,
    row_lo,
    row_hi,
    bt_row,
    num_blocks,
    k_head,
    v_head,
    offs_d,
    d_mask,
    scale,
    qk_scale,
    softcap,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    MASK: tl.constexpr,
    LO_MASK: tl.constexpr,
    LO_TILE: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One key tile of the online softmax, its block ids, keys and values loaded here
    (_tile_scores has the masks' contract)."""
    blk, blk_ok, n_valid = _tile_ids(bt_row, kv0, kv_hi, num_blocks, BLOCK_SIZE, BLOCK_N, MASK)
    k = _tile_kv(k_head, kv0, blk, blk_ok, n_valid, offs_d, d_mask, stride_kb, stride_kt,
                 BLOCK_SIZE, BLOCK_N, MASK, EVEN_D, True)  # fmt: skip
    m_new, l_i, p, alpha = _tile_scores(q, k, m_i, l_i, kv0, row_lo, row_hi, scale, qk_scale,
                                        softcap, BLOCK_N, USE_SOFTCAP, MASK, LO_MASK, LO_TILE,
                                        DOT_PRECISION)  # fmt: skip
    v = _tile_kv(v_head, kv0, blk, blk_ok, n_valid, offs_d, d_mask, stride_vb, stride_vt,
                 BLOCK_SIZE, BLOCK_N, MASK, EVEN_D, False)  # fmt: skip
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _tile_kv_pair(k_head, v_head, kv0, ids, offs_d, d_mask, stride_kb, stride_kt, stride_vb,
                  stride_vt, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                  EVEN_D: tl.constexpr):  # fmt: skip
    """The masked key tile at kv0's keys and values, from its _tile_ids."""
    blk, ok, nv = ids
    k = _tile_kv(k_head, kv0, blk, ok, nv, offs_d, d_mask, stride_kb, stride_kt, BLOCK_SIZE,
                 BLOCK_N, True, EVEN_D, True)  # fmt: skip
    v = _tile_kv(v_head, kv0, blk, ok, nv, offs_d, d_mask, stride_vb, stride_vt, BLOCK_SIZE,
                 BLOCK_N, True, EVEN_D, False)  # fmt: skip
    return k, v


@triton.jit
def _attend_prefetched(
    q, m_i, l_i, acc, kv_lo, kv_hi, row_lo, row_hi, bt_row, num_blocks, k_head, v_head,
    offs_d, d_mask, scale, qk_scale, softcap, stride_kb, stride_kt, stride_vb, stride_vt,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    LO_MASK: tl.constexpr, LO_TILE: tl.constexpr, EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, AHEAD: tl.constexpr,
):  # fmt: skip
    """The masked key tiles [kv_lo, kv_hi) as _attend_tile takes them, one after another
    with the same arithmetic (the same bits), but with the loads run ahead in registers:
    the keys and values of the tile AHEAD (1 or 2) tiles on are requested before a tile
    is attended, and the block ids of the one after them, so in a long run a round trip
    serves AHEAD tiles (the compiler's shared-memory stages put the indirect K / V loads
    only one tile ahead, behind a wait for all of them; its pipelining is off here). The
    first tiles' block ids load together. Loads past kv_hi are masked off (no memory
    traffic). AHEAD 2 holds three tiles of K and V in registers."""
    ids = _tile_ids(bt_row, kv_lo, kv_hi, num_blocks, BLOCK_SIZE, BLOCK_N, True)
    if AHEAD == 2:
        ids1 = _tile_ids(bt_row, kv_lo + BLOCK_N, kv_hi, num_blocks, BLOCK_SIZE, BLOCK_N, True)
    far_ids = _tile_ids(bt_row, kv_lo + AHEAD * BLOCK_N, kv_hi, num_blocks, BLOCK_SIZE, BLOCK_N,
                        True)  # fmt: skip
    k, v = _tile_kv_pair(k_head, v_head, kv_lo, ids, offs_d, d_mask, stride_kb, stride_kt,
                         stride_vb, stride_vt, BLOCK_SIZE, BLOCK_N, EVEN_D)  # fmt: skip
    if AHEAD == 2:
        k1, v1 = _tile_kv_pair(k_head, v_head, kv_lo + BLOCK_N, ids1, offs_d, d_mask, stride_kb,
                               stride_kt, stride_vb, stride_vt, BLOCK_SIZE, BLOCK_N,
                               EVEN_D)  # fmt: skip
    for kv0 in tl.range(kv_lo, kv_hi, BLOCK_N, num_stages=1):
        far = kv0 + AHEAD * BLOCK_N
        k_far, v_far = _tile_kv_pair(k_head, v_head, far, far_ids, offs_d, d_mask, stride_kb,
                                     stride_kt, stride_vb, stride_vt, BLOCK_SIZE, BLOCK_N,
                                     EVEN_D)  # fmt: skip
        far_ids = _tile_ids(bt_row, far + BLOCK_N, kv_hi, num_blocks, BLOCK_SIZE, BLOCK_N, True)
        m_new, l_i, p, alpha = _tile_scores(q, k, m_i, l_i, kv0, row_lo, row_hi, scale,
                                            qk_scale, softcap, BLOCK_N, USE_SOFTCAP, True,
                                            LO_MASK, LO_TILE, DOT_PRECISION)  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
        if AHEAD == 2:
            k, v = k1, v1
            k1, v1 = k_far, v_far
        else:
            k, v = k_far, v_far
    return m_i, l_i, acc


@triton.jit
def _key_range(q_pos, window, split, USE_WINDOW: tl.constexpr, NUM_SPLITS: tl.constexpr,
               BLOCK_N: tl.constexpr):  # fmt: skip
    """[lo, hi): the keys a query at q_pos sees in this split. Causal, the window, and
    with splits this split's share of the query's own context (its length in BLOCK_N
    tiles over NUM_SPLITS), cut as a decode step of that token alone cuts it, so a token
    verified among others sums the same keys in the same order: the same bits. Both ends
    are non-decreasing in q_pos."""
    hi = q_pos + 1
    lo = hi * 0
    if USE_WINDOW:
        lo = q_pos - window + 1
    if NUM_SPLITS > 1:
        tiles_per_split = tl.cdiv(tl.cdiv(tl.maximum(hi, 0), BLOCK_N), NUM_SPLITS)
        lo = tl.maximum(lo, split * tiles_per_split * BLOCK_N)
        hi = tl.minimum(hi, (split + 1) * tiles_per_split * BLOCK_N)
    return lo, hi


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    qsl_ptr,
    seq_lens_ptr,
    block_table_ptr,
    num_reqs,
    num_tokens,
    num_blocks,
    kv_cap,
    scale,
    softcap,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    QPK: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    GDC: tl.constexpr = False,
    PREFETCH: tl.constexpr = 0,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Programmatic dependent launch (GDC): the metadata (query_start_loc, seq_lens) is read
    # before the wait. When a PDL kernel starts, every program of the kernel before it has
    # passed its own wait, so the kernel two back has completed: the metadata, written
    # before the step's first projection, is final. q and this step's K/V rows come from
    # the kernel just before (rotary + store): read after the wait, as is every write.
    req = _find_request(qsl_ptr, tile, num_reqs, num_tokens, BLOCK_Q)
    q_start = _load_qsl(qsl_ptr, req, num_tokens)
    q_block = tile - (q_start // BLOCK_Q + req)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_mask = offs_d < HEAD_DIM
    local_q = offs_m // QPK
    head = kv_head * QPK + offs_m % QPK

    if req == num_reqs:
        # Past every request: rows of padded tokens get zeros (invariant 2). With splits
        # the combine kernel writes them instead.
        if NUM_SPLITS == 1:
            if GDC:
                tl.extra.cuda.gdc_wait()
                tl.extra.cuda.gdc_launch_dependents()
            # q_start is clamped and q_block >= 0 here: rows stay in [0, num_tokens).
            tok = q_start + q_block * BLOCK_Q + local_q
            rows = (local_q < BLOCK_Q) & (tok < num_tokens)
            o_ptrs = (
                out_ptr
                + tok.to(tl.int64)[:, None] * stride_ot
                + head[:, None] * stride_oh
                + offs_d[None, :]
            )
            zeros = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=out_ptr.dtype.element_ty)
            tl.store(o_ptrs, zeros, mask=rows[:, None] & d_mask[None, :])
        return

    # end >= start: a decreasing query_start_loc gives an empty request, never a
    # negative length.
    q_len = tl.minimum(tl.maximum(tl.load(qsl_ptr + req + 1), q_start), num_tokens) - q_start
    if (q_block < 0) | (q_block * BLOCK_Q >= q_len):
        return
    # [0, kv_cap] (the table's width x block_size): keys past the table's last column do
    # not exist, and with both lengths bounded no position below can overflow int32. A
    # seq_len below the query length puts the first queries at negative positions,
    # which see no key (zeros).
    seq_len = tl.minimum(tl.maximum(tl.load(seq_lens_ptr + req), 0), kv_cap)
    ctx_len = seq_len - q_len

    q_idx = q_block * BLOCK_Q + local_q
    rows = (local_q < BLOCK_Q) & (q_idx < q_len)
    tok = (q_start + q_idx).to(tl.int64)
    q_pos = ctx_len + q_idx
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=rows[:, None] & d_mask[None, :],
        other=0.0,
    )

    # The keys each row sees, [row_lo, row_hi) (see _key_range). Both ends grow with the
    # position, so the tile's range, the union of its rows', runs from its first token's
    # row_lo to its last token's row_hi.
    row_lo, row_hi = _key_range(q_pos, window, split, USE_WINDOW, NUM_SPLITS, BLOCK_N)
    first_pos = ctx_len + q_block * BLOCK_Q
    last_pos = ctx_len + tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len) - 1
    first_lo, first_hi = _key_range(first_pos, window, split, USE_WINDOW, NUM_SPLITS, BLOCK_N)
    last_lo, last_hi = _key_range(last_pos, window, split, USE_WINDOW, NUM_SPLITS, BLOCK_N)
    kv_lo = tl.maximum(first_lo, 0)
    kv_hi = last_hi
    row_hi = tl.minimum(row_hi, kv_hi)  # rows past the request's last token see none past it
    kv_start = (kv_lo // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vh

    # Key tiles every row of this query tile sees in full (below the causal diagonal,
    # inside kv_hi) skip the mask; the rest (the diagonal, the ragged end, windows) mask.
    # Only for prefill-sized tiles: with short tiles (decode, verification) the second
    # loop's pipeline prologue cost more than the mask saved (b64 ctx 4096 decode 257 ->
    # 348 us, prefill 1079 -> 946 us on the H200; bench/NOTES.md).
    full_end = kv_start
    if not USE_WINDOW and BLOCK_M >= 64:
        # Tiles inside every row's range [last_lo, first_hi): from kv_start when every
        # row starts there.
        full_end = tl.maximum(kv_start + ((first_hi - kv_start) // BLOCK_N) * BLOCK_N, kv_start)
        full_end = tl.where(last_lo <= kv_start, full_end, kv_start)
    for kv0 in range(kv_start, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, kv0, kv_hi, row_lo, row_hi, bt_row, num_blocks, k_head, v_head,
            offs_d, d_mask, scale, qk_scale, softcap, stride_kb, stride_kt, stride_vb, stride_vt,
            BLOCK_SIZE, BLOCK_N, USE_SOFTCAP, False, False, False, HEAD_DIM == HEAD_DIM_P,
            DOT_PRECISION,
        )  # fmt: skip
    if PREFETCH:
        m_i, l_i, acc = _attend_prefetched(
            q, m_i, l_i, acc, full_end, kv_hi, row_lo, row_hi, bt_row, num_blocks, k_head,
            v_head, offs_d, d_mask, scale, qk_scale, softcap, stride_kb, stride_kt, stride_vb,
            stride_vt, BLOCK_SIZE, BLOCK_N, USE_SOFTCAP, USE_WINDOW,
            NUM_SPLITS > 1 and not USE_WINDOW, HEAD_DIM == HEAD_DIM_P, DOT_PRECISION, PREFETCH,
        )  # fmt: skip
    else:
        for kv0 in range(full_end, kv_hi, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, kv0, kv_hi, row_lo, row_hi, bt_row, num_blocks, k_head,
                v_head, offs_d, d_mask, scale, qk_scale, softcap, stride_kb, stride_kt,
                stride_vb, stride_vt, BLOCK_SIZE, BLOCK_N, USE_SOFTCAP, True, USE_WINDOW,
                NUM_SPLITS > 1 and not USE_WINDOW, HEAD_DIM == HEAD_DIM_P, DOT_PRECISION,
            )  # fmt: skip

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    store_mask = rows[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        # Partials: [NUM_SPLITS, num_tokens, NUM_Q_HEADS, HEAD_DIM_P] and
        # [NUM_SPLITS, num_tokens, NUM_Q_HEADS]; an empty split leaves lse = -inf.
        row = (split * num_tokens + tok) * NUM_Q_HEADS + head
        tl.store(
            part_out_ptr + row[:, None] * HEAD_DIM_P + offs_d[None, :],
            o,
            mask=rows[:, None] & (offs_d[None, :] < HEAD_DIM_P),
        )
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(part_lse_ptr + row, lse, mask=rows)


@triton.jit
def _merge_splits(part_out_ptr, part_lse_ptr, row, d, ok, split_rows, HEAD_DIM_P: tl.constexpr,
                  NUM_SPLITS: tl.constexpr, PART_MAX: tl.constexpr):  # fmt: skip
    """The merged attention output (float32) at partial rows `row` (token * NUM_Q_HEADS +
    head, the first split's) and dims `d`, where `ok`; split s's rows lie split_rows
    further on. The splits are summed one after another in split order: the combine
    launch and a consumer merging on its loads (kernels.fused_linear's x_splits) give
    the same bits.

    With consistent metadata every split wrote a finite or -inf lse and a bounded
    partial. A token no request covers (only with an inconsistent query_start_loc: rows
    before its first entry, or skipped by a decreasing one) holds whatever the allocator
    left: NaN / +inf lse count as empty splits, and partials count only for splits that
    count, zeroed where NaN and clamped to +-PART_MAX, so the merged value is
    finite (garbage, but finite)."""
    lse_max = tl.full(row.shape, float("-inf"), tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        lse = tl.load(part_lse_ptr + s * split_rows + row, mask=ok, other=float("-inf"))
        lse = tl.where((lse == lse) & (lse < float("inf")), lse, float("-inf"))
        lse_max = tl.maximum(lse_max, lse)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    num = tl.zeros(d.shape, tl.float32) + tl.zeros(row.shape, tl.float32)
    den = tl.zeros(row.shape, tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        lse = tl.load(part_lse_ptr + s * split_rows + row, mask=ok, other=float("-inf"))
        lse = tl.where((lse == lse) & (lse < float("inf")), lse, float("-inf"))
        w = tl.exp2(lse - lse_max)
        # Loaded whatever w is, then selected: a load masked by w waited for the lse
        # loads, one more L2 round trip in the chain (the buffer holds every split's
        # rows, so the read stays inside it).
        part = tl.load(part_out_ptr + (s * split_rows + row) * HEAD_DIM_P + d, mask=ok,
                       other=0.0)  # fmt: skip
        part = tl.where((w > 0.0) & (part == part), part, 0.0)
        part = tl.minimum(tl.maximum(part, -PART_MAX), PART_MAX)
        num += w * part
        den += w
    return num / tl.where(den == 0.0, 1.0, den)


@triton.jit
def _combine_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    qsl_ptr,
    num_reqs,
    num_tokens,
    stride_ot,
    stride_oh,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PART_MAX: tl.constexpr,
    GDC: tl.constexpr = False,
):
    # One program per (token, head) of the launch: reads and writes stay inside the
    # partials and `out` whatever the metadata says.
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    # query_start_loc before the wait: metadata, final once the attention launch before
    # this one has started (see _paged_attention_kernel), so its L2 round trip leaves
    # the chain after the wait.
    tokens_end = _load_qsl(qsl_ptr, num_reqs, num_tokens)
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_mask = offs_d < HEAD_DIM
    o_ptrs = out_ptr + tok * stride_ot + head * stride_oh + offs_d
    if tok >= tokens_end:
        # Padded token: no request owns it, and no partial was written for it.
        tl.store(o_ptrs, tl.zeros([HEAD_DIM_P], dtype=out_ptr.dtype.element_ty), mask=d_mask)
        return
    row = tl.zeros([1], tl.int64) + tok * NUM_Q_HEADS + head
    # tok * 0 + num_tokens: an int64 tensor even where the JIT made num_tokens == 1 a
    # Python int (it specializes integer arguments equal to 1)
    merged = _merge_splits(part_out_ptr, part_lse_ptr, row, offs_d, row >= 0,
                           (tok * 0 + num_tokens) * NUM_Q_HEADS, HEAD_DIM_P, NUM_SPLITS,
                           PART_MAX)  # fmt: skip
    tl.store(o_ptrs, merged.to(out_ptr.dtype.element_ty), mask=d_mask)


@dataclass(frozen=True)
class AttentionLaunchConfig:
    """Host constants of one launch. They depend on the descriptor bounds and the head
    configuration only, never on the contents of seq_lens or query_start_loc."""

    block_m: int
    block_q: int
    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int
    # Masked key tiles with their loads run 1 or 2 tiles ahead in registers
    # (_attend_prefetched) instead of the compiler's pipeline (0): the same bits.
    prefetch: int = 0
    # kernels/token_attention.py instead: one program a (token, query head, key chunk),
    # block_n keys a chunk, num_splits chunks over the length bound, num_warps; the
    # other fields unused.
    per_token: bool = False


@cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; a small fixed number off the GPU."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _num_sms(index)


def choose_launch_config(
    *,
    num_tokens: int,
    num_reqs: int,
    max_query_len: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_seq_len: int | None = None,
    num_sms_on_device: int = 132,
    num_splits: int | None = None,
    element_size: int = 2,
) -> AttentionLaunchConfig:
    """Pick tile sizes and the split count from descriptor-level bounds, or the token
    programs (per_token_config) where they take the launch and num_splits is not given.

    Every input here is fixed by a batch descriptor (or by the model), which is what
    makes the launch graph-safe."""
    qpk = num_q_heads // num_kv_heads
    max_query_len = max(1, min(max_query_len, num_tokens))
    if num_splits is None:
        token = per_token_config(num_reqs=num_reqs, max_query_len=max_query_len,
                                 num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                 head_dim=head_dim, max_seq_len=max_seq_len,
                                 num_sms_on_device=num_sms_on_device,
                                 element_size=element_size)  # fmt: skip
        if token is not None:
            return token
    rows = max_query_len * qpk
    cap = 64 if head_dim > 128 else 128
    block_m = max(16, triton.next_power_of_2(qpk), min(cap, triton.next_power_of_2(rows)))
    block_q = max(1, block_m // qpk)
    if head_dim > 128:
        block_n = 32 if block_m >= 64 else 64
    else:
        # Multi-token tiles (block_m >= 32) amortise their longer softmax over wider key
        # tiles: verification with 8 tokens 380 -> 294 us, prefill 1195 -> 1083 us (H200).
        block_n = 128 if block_m >= 32 else 64
    num_warps = 8 if block_m >= 64 else 4
    # 3 stages only for short tiles of 65-128-dim heads. Heads of 64 or fewer dims take 2
    # (decode and verification tiles on the H200, SmolLM2's 9 / 3 x 64 heads, batch 1 / 8,
    # context 128-1000, 1-4 tokens: 5-13% faster than 3, e.g. batch 1 context 256 4.14 ->
    # 3.81 us; llama-68m's 12 / 12 x 64 at batch 64: 16.7 -> 15.9 us; bench/NOTES.md,
    # stop 35).
    num_stages = 3 if 64 < head_dim <= 128 and block_m < 64 else 2
    if element_size > 2:
        # fp32 tiles take twice the shared memory per stage.
        block_n, num_stages = max(16, block_n // 2), 2

    tiles = min(cdiv(num_tokens, block_q) + num_reqs, num_reqs * cdiv(max_query_len, block_q))
    work = max(1, tiles * num_kv_heads)
    if num_splits is None and block_m <= 32 and head_dim <= 128 and element_size == 2:
        # Decode and verification tiles whose grid fits about one wave: 128-key tiles,
        # split to about 3 programs an SM. H200, against 64-key tiles at about 4
        # programs an SM (bench/NOTES.md, stop 43): Llama-3-8B's heads batch 1 context
        # 4096 15.0 -> 12.5 us, batch 12 context 6000 94.8 -> 77.0, batch 48 context 6000
        # 345 -> 277; SmolLM2's batch 64 context 4096 83.1 -> 61.4; verification of 8
        # tokens (already 128-key tiles) at batch 8 context 4096, 8 splits 50.1 us, 4
        # splits 44.7. A grid of several waves (batch 64 and up for Llama's heads) keeps
        # the old choice, and so does a length bound that leaves fewer than half the
        # splits: SmolLM2's batch 1 at bound 1024, 8 splits of 64 keys 4.5 us against 4
        # of 128 keys 4.7; unless it leaves one split, with no merge launch (batch 1 at
        # bound 320: 5.9 -> 5.2 us).
        wide = min(_floor_pow2(max(1, 3 * num_sms_on_device // work)), MAX_NUM_SPLITS)
        capped = wide
        if max_seq_len is not None:
            capped = min(wide, _floor_pow2(max(1, max_seq_len // 256)))
        if work <= 3 * num_sms_on_device and (capped * 2 >= wide or capped == 1):
            # Three stages, but two for 128-dim heads once the grid holds more than two
            # programs an SM (measured, not explained): batch 24 context 6000 166 -> 141
            # us with two, batch 1 context 4096 13.2 -> 12.3 with three.
            many = head_dim > 64 and work * capped > 2 * num_sms_on_device
            return AttentionLaunchConfig(block_m, block_q, 128, capped, num_warps, 2 if many else 3)
    if num_splits is None:
        # Split the keys until there are about four programs per SM (measured on the
        # H200 with 8 KV heads: 8 splits at batch 8, none at batch 64; bench/NOTES.md).
        # With a known length bound a split keeps at least two key tiles.
        num_splits = _floor_pow2(max(1, 4 * num_sms_on_device // work))
        if max_seq_len is not None:

            def bound_cap(key_tile: int) -> int:
                return _floor_pow2(max(1, max_seq_len // (2 * key_tile)))

            short = 512 < max_seq_len < 2048  # 8 splits of 64-key tiles, or fewer
            if short and bound_cap(block_n) < num_splits and block_m == 16 and head_dim <= 64:
                # The bound, not the SMs, limits the splits of 16-row query tiles
                # (decode, short verification) of small heads: 32-key tiles give twice
                # the splits at two tiles a split. H100 (bench/NOTES.md, stops 56-58),
                # SmolLM2's step at 1 / 4 / 8 rows: bound 1024, context 256, 367 -> 359,
                # 517 -> 513, 692 -> 657 us; bound 1064, context 1000, 418 -> 408,
                # 600 -> 567, 763 -> 722.
                block_n = 32
            num_splits = min(num_splits, bound_cap(block_n))
        num_splits = min(num_splits, MAX_NUM_SPLITS)
    if num_splits >= 16:
        # Short per-program loops: a shallower pipeline leaves room for more programs per
        # SM (batch 1, context 32768: 42 us with 2 stages against 54 us with 3); with few
        # splits 3 stages stay ahead (batch 32, context 32768: 1010 against 1026 us).
        num_stages = 2
    return AttentionLaunchConfig(block_m, block_q, block_n, num_splits, num_warps, num_stages)


# Where the token programs (kernels/token_attention.py) take a launch: queries of up to
# TOKEN_MAX_QUERY tokens a request, when a program for every (request, query head, key
# chunk of the length bound) fits one wave (a program holds its chunk in registers: one
# an SM), times TOKEN_WAVES. The rule reads no token count, so a batch's decode and its
# verification take the same launch (the same bits). H100, SmolLM2's step (bound 1024,
# 4 chunks of 256 keys; bench/NOTES.md, stop 60): 1 row, context 256 / 1000, 356-358 ->
# 338-340 / 409-411 -> 378-379 µs; a first version at 8 rows (288 programs, three
# waves): 652 -> 604 / 722 -> 900, so the rule keeps it to one wave.
#
# TOKEN_WALK: where the bound's chunks do not fit that wave, fewer programs a (request,
# head), the last one walking the chunks past them (loaded after the PDL wait), at most
# TOKEN_WALK chunks in all. It pays at short contexts and costs at long ones, and the
# launch is fixed before the lengths are known, so it stays off (1: a program a chunk).
# H100, SmolLM2's step, one process, bound 1024 (stop 61), tiled kernel -> walking:
# 4 rows (3 programs, walk 2) context 256 501 -> 445 µs, context 1000 561 -> 589; 8 rows
# (1 program, walk 4) 643 -> 584 / 716 -> 868; 4 rows at bound 2048, context 200 (walk
# 6) 515 -> 442.
TOKEN_MAX_QUERY = 8
TOKEN_WAVES = 1
TOKEN_WALK = 1


def token_chunk(head_dim: int, element_size: int = 2) -> int:
    """Keys a token program holds in registers (K and V of [chunk, head_dim] at 8 warps:
    64 registers a thread for 16-bit caches)."""
    per = triton.next_power_of_2(head_dim) * max(1, element_size // 2)
    return max(16, min(512, 16384 // per))


def per_token_config(
    *,
    num_reqs: int,
    max_query_len: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_seq_len: int | None,
    num_sms_on_device: int = 132,
    element_size: int = 2,
) -> AttentionLaunchConfig | None:
    """The token programs' launch for these bounds, or None where the tiled kernel takes
    it (TOKEN_MAX_QUERY, TOKEN_WAVES; no length bound, or more than MAX_NUM_SPLITS
    chunks: the tiled kernel)."""
    if max_seq_len is None or max_query_len > TOKEN_MAX_QUERY:
        return None
    chunk = token_chunk(head_dim, element_size)
    need = max(1, cdiv(max_seq_len, chunk))
    # programs a (request, head) that fit the waves; the last one walks the chunks past
    # them, at most TOKEN_WALK in all
    room = TOKEN_WAVES * num_sms_on_device // max(1, num_reqs * num_q_heads)
    splits = min(need, room)
    if need > MAX_NUM_SPLITS or splits < 1 or need - splits + 1 > TOKEN_WALK:
        return None
    qpk = num_q_heads // num_kv_heads
    warps = 8 if chunk * triton.next_power_of_2(head_dim) <= 16384 else 16
    return AttentionLaunchConfig(max(16, triton.next_power_of_2(qpk)), 1, chunk, splits, warps, 1,
                                 per_token=True)  # fmt: skip


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _floor_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def paged_attention(q: torch.Tensor, *args, pdl: bool = False, **kw) -> torch.Tensor:
    """Causal attention of a ragged batch of queries over a paged K/V cache (the
    arguments and their contract: paged_attention_unmerged); split launches merge their
    partials in a second launch."""
    return paged_attention_unmerged(q, *args, pdl=pdl, merge=True, **kw)[0]


def paged_attention_unmerged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
    config: AttentionLaunchConfig | None = None,
    pdl: bool = False,
    merge: bool = False,
) -> tuple[torch.Tensor, AttentionSplits | None]:
    """Causal attention of a ragged batch of queries over a paged K/V cache: (out, None)
    when the launch does not split its keys or merges them itself (the token programs,
    config.per_token), else (out, its AttentionSplits), out then written only with
    merge=True (the combine launch), else left to the caller (combine_splits, or a
    consumer that merges on its loads).

    q: [num_tokens, num_q_heads, head_dim]; k_cache, v_cache:
    [num_blocks, block_size, num_kv_heads, head_dim]; query_start_loc: int32
    [num_reqs + 1]; seq_lens: int32 [>= num_reqs], each request's context including its
    query tokens; block_table: int32 [>= num_reqs, max_blocks].

    num_tokens, num_reqs (query_start_loc.numel() - 1), max_query_len and max_seq_len are
    host-side bounds, the only values that shape the launch: pass a descriptor's bounds
    and the launch can be captured once and replayed for any lengths within them.
    Tokens past query_start_loc[num_reqs] are padding and get zero output. Requests with
    zero query tokens get none. sliding_window W lets a query at position p see keys
    p - W + 1 .. p; softcap c maps scores s to c * tanh(s / c) before the softmax.

    Inconsistent metadata never makes the kernels read outside q, the cache and the
    metadata, or write outside `out`: query starts and ends are clamped into
    [0, num_tokens] (end >= start), seq_lens into [0, block_table width x block_size],
    and block ids outside [0, num_blocks) are never dereferenced: their keys and values
    load as zero vectors (score 0, value 0). Query i of a request of q_len tokens sits at
    position seq_len - q_len + i; a row that sees no key gets zeros.
    Rows that no request covers (before query_start_loc[0], or skipped by a decreasing
    query_start_loc) are not written without splits and get finite values with them.
    With validation mode on (kernels/validation.py; the default for CPU tensors) such
    metadata raises ValueError before anything is launched. pdl: launch with
    programmatic dependent launch (kernels.pdl_supported; ignored by the interpreter).
    config: the launch's tiles, splits, warps and stages instead of choose_launch_config's
    (checked: powers of two, block_q * q heads a KV head <= block_m; num_splits, if also
    given, must agree with it).
    """
    check_paged_attention_args(
        q,
        k_cache,
        v_cache,
        query_start_loc,
        seq_lens,
        block_table,
        scale,
        out=out,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        sliding_window=sliding_window,
        softcap=softcap,
        num_splits=num_splits,
        config=config,
    )
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    num_tokens, num_q_heads, _ = q.shape
    num_reqs = query_start_loc.numel() - 1
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0:
        return out, None
    if max_query_len is None:
        max_query_len = num_tokens

    cfg = config or choose_launch_config(
        num_tokens=num_tokens,
        num_reqs=num_reqs,
        max_query_len=max_query_len,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_seq_len=max_seq_len,
        num_sms_on_device=num_sms(q.device),
        num_splits=num_splits,
        element_size=q.element_size(),
    )
    if cfg.per_token:
        token_attention(
            out, q, k_cache, v_cache, query_start_loc, seq_lens, block_table, scale,
            chunk=cfg.block_n, num_splits=cfg.num_splits, num_warps=cfg.num_warps,
            sliding_window=sliding_window, softcap=softcap, pdl=pdl,
        )  # fmt: skip
        return out, None
    qpk = num_q_heads // num_kv_heads
    head_dim_p = triton.next_power_of_2(head_dim)
    if cfg.num_splits > 1:
        part_out = torch.empty(
            (cfg.num_splits, num_tokens, num_q_heads, head_dim_p),
            dtype=torch.float32,
            device=q.device,
        )
        part_lse = torch.empty(
            (cfg.num_splits, num_tokens, num_q_heads), dtype=torch.float32, device=q.device
        )
    else:
        part_out = part_lse = out  # unused by the kernel when NUM_SPLITS == 1
    grid = (cdiv(num_tokens, cfg.block_q) + num_reqs, num_kv_heads, cfg.num_splits)
    pdl, launch_pdl = pdl_launch(pdl)
    _paged_attention_kernel[grid](
        out,
        part_out,
        part_lse,
        q,
        k_cache,
        v_cache,
        query_start_loc,
        seq_lens,
        block_table,
        num_reqs,
        num_tokens,
        k_cache.shape[0],
        block_table.shape[1] * block_size,
        float(scale),
        float(softcap or 0.0),
        int(sliding_window or 0),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_table.stride(0),
        QPK=qpk,
        NUM_Q_HEADS=num_q_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_P=head_dim_p,
        BLOCK_SIZE=block_size,
        BLOCK_M=cfg.block_m,
        BLOCK_Q=cfg.block_q,
        BLOCK_N=cfg.block_n,
        NUM_SPLITS=cfg.num_splits,
        USE_SOFTCAP=softcap is not None,
        USE_WINDOW=sliding_window is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        GDC=pdl,
        PREFETCH=int(cfg.prefetch),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **launch_pdl,
    )
    if cfg.num_splits == 1:
        return out, None
    splits = AttentionSplits(out, part_out, part_lse, query_start_loc, num_reqs, cfg.num_splits)
    if merge:
        combine_splits(splits, pdl=pdl)
    return out, splits


# paged_attention takes paged_attention_unmerged's arguments but merge (the guard's
# error messages name arguments from the signature).
paged_attention.__signature__ = inspect.signature(paged_attention_unmerged).replace(
    parameters=[
        p for n, p in inspect.signature(paged_attention_unmerged).parameters.items() if n != "merge"
    ],
    return_annotation="torch.Tensor",
)


@dataclass(frozen=True)
class AttentionSplits:
    """A split launch's partials before their merge: what the combine launch reads, or
    a consumer that merges them on its loads (kernels.fused_linear's x_splits)."""

    out: torch.Tensor  # [num_tokens, Hq, D]: where the merge writes (its dtype, its rows)
    part_out: torch.Tensor  # [num_splits, num_tokens, Hq, D padded] float32
    part_lse: torch.Tensor  # [num_splits, num_tokens, Hq] float32 (log2 units)
    query_start_loc: torch.Tensor
    num_reqs: int
    num_splits: int

    @property
    def part_max(self) -> float:
        """Bound on partials that no program wrote (_merge_splits): the out dtype's range
        for fp16, a value no real attention output reaches otherwise."""
        return 65504.0 if self.out.dtype == torch.float16 else 1e30


def combine_splits(splits: AttentionSplits, *, pdl: bool = False) -> torch.Tensor:
    """Merge a split launch's partials into splits.out (one launch); returns it."""
    if not isinstance(splits, AttentionSplits):
        raise TypeError(f"splits must be an AttentionSplits, got {type(splits).__name__}")
    out = splits.out
    num_tokens, num_q_heads, head_dim = out.shape
    head_dim_p = splits.part_out.shape[-1]
    pdl, launch_pdl = pdl_launch(pdl)
    _combine_splits_kernel[(num_tokens, num_q_heads)](
        out,
        splits.part_out,
        splits.part_lse,
        splits.query_start_loc,
        splits.num_reqs,
        num_tokens,
        out.stride(0),
        out.stride(1),
        NUM_Q_HEADS=num_q_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_P=head_dim_p,
        NUM_SPLITS=splits.num_splits,
        PART_MAX=splits.part_max,
        GDC=pdl,
        num_warps=1 if head_dim_p <= 128 else 2,
        **launch_pdl,
    )
    return out
