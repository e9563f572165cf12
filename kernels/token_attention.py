"""Paged attention of short queries, one program a (query token, query head, key chunk).

The decode launch for small batches at short length bounds (kernels.paged_attention
picks it: choose_launch_config's `per_token`). There a decode step is a chain of
dependent launches, so what matters is how much of a launch runs after the PDL wait, not
its bandwidth. Every key this step did not write is final before the wait (its K/V
rows, the block table, the lengths), so each program loads its whole key chunk into
registers before it; after the wait it loads q and this step's own K/V rows (written by
the kernel just before: rotary + store) and only computes. The products are float32 on
the CUDA cores (a [chunk, head_dim] tile against one query vector), with no tensor-core
tile to fill and no separate merge launch.

Programs tile the launch along three axes:
- axis 0, query tokens (request t first, a decode batch's layout, whose loads go out
  together; a binary search over query_start_loc where that guess misses);
- axis 1, query heads (a KV head's chunk is loaded by each of its query heads, from L2
  after the first);
- axis 2, key chunks of CHUNK keys at fixed boundaries [s * CHUNK, (s + 1) * CHUNK),
  NUM_SPLITS of them over the launch's length bound; the last one also walks every chunk
  past it, so a key beyond the bound is still attended (loaded after the wait).

A token whose keys span one chunk writes its output from that chunk's program. One that
spans several has each chunk write a normalised partial and its log-sum-exp, then take a
ticket (an acq_rel atomic on one int32 per (token, head)); the last to arrive merges the
partials in chunk order and puts the ticket back to zero. The chunks and the merge order
depend on the token's position only, so a token verified among others gets the same bits
as when decoded alone.

Metadata is never trusted for addresses, as in kernels/paged_attention.py: query starts
and ends are clamped into [0, num_tokens] with end >= start, seq_len into [0, the block
table's width x block_size], block ids outside [0, num_blocks) are never dereferenced
(their keys load as zeros). Tokens no request covers (padding past
query_start_loc[num_reqs], or rows an inconsistent query_start_loc skips) get zeros, as
does a query that sees no key.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_common import _load_qsl, _softcapped
from .launch import pdl_launch


@triton.jit
def _chunk_rows(bt_row, c0, lo, hi, num_blocks, stride_b, stride_t, BLOCK_SIZE: tl.constexpr,
                CHUNK: tl.constexpr):  # fmt: skip
    """Row offsets (int64, into a head of the cache) of keys c0 + [0, CHUNK) and which of
    them lie in [lo, hi) with a block id in [0, num_blocks) (the rest: offset 0, masked)."""
    pos = c0 + tl.arange(0, CHUNK)
    want = (pos >= lo) & (pos < hi)
    blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=want, other=0)
    ok = want & (blk >= 0) & (blk < num_blocks)
    rows = tl.where(ok, blk, 0).to(tl.int64) * stride_b + (pos % BLOCK_SIZE) * stride_t
    return rows, ok, want


@triton.jit
def _load_rows(head_ptr, rows, ok, offs_d, d_mask, other):
    """The rows where `ok` loaded, `other` elsewhere (0.0, or a tile to keep: the load
    then writes the registers that hold it, no second tile)."""
    return tl.load(head_ptr + rows[:, None] + offs_d[None, :], mask=ok[:, None] & d_mask[None, :],
                   other=other)  # fmt: skip


@triton.jit
def _scores(q, k, want, scale, qk_scale, softcap, USE_SOFTCAP: tl.constexpr):
    """log2-scaled scores of one chunk; -inf where a key is not visible."""
    s = tl.sum(k.to(tl.float32) * q[None, :], axis=1)
    if USE_SOFTCAP:
        s = _softcapped(s, scale, softcap)
    else:
        s = s * qk_scale
    return tl.where(want, s, float("-inf"))


@triton.jit
def _online(s, v, m_i, l_i, acc):
    """The online softmax's step over one more tile of scores s and values v."""
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new)
    return (
        m_new,
        l_i * alpha + tl.sum(p, axis=0),
        acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0),
    )


@triton.jit
def _token_attention_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, ticket_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    qsl_ptr, seq_lens_ptr, block_table_ptr, num_reqs, num_tokens, num_blocks, kv_cap,
    scale, softcap, window, stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt,
    stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    QPK: tl.constexpr, NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr,
    NUM_SPLITS: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head // QPK
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_mask = offs_d < HEAD_DIM
    o_ptrs = out_ptr + t.to(tl.int64) * stride_ot + head * stride_oh + offs_d

    # The request holding token t: the largest r in [0, num_reqs] with start(r) <= t.
    # Metadata only (final before the wait: every kernel before the one just before
    # this launch has completed when it starts, see kernels/paged_attention.py). First
    # a guess, request t (a decode batch's layout), whose loads go out together; a
    # binary search where the guess misses.
    guess = tl.minimum(t, tl.maximum(num_reqs - 1, 0))
    g_ok = guess < num_reqs
    q_start = _load_qsl(qsl_ptr, guess, num_tokens)
    q_end = tl.load(qsl_ptr + guess + 1, mask=g_ok, other=0)
    seq_len = tl.load(seq_lens_ptr + guess, mask=g_ok, other=0)
    in_req = g_ok & (q_start <= t) & (t < q_end)
    if not in_req:
        lo_r: tl.int32 = 0
        hi_r = num_reqs
        while lo_r < hi_r:
            mid = (lo_r + hi_r + 1) // 2
            go_right = _load_qsl(qsl_ptr, mid, num_tokens) <= t
            lo_r = tl.where(go_right, mid, lo_r)
            hi_r = tl.where(go_right, hi_r, mid - 1)
        in_req = lo_r < num_reqs
        found = tl.maximum(tl.minimum(lo_r, num_reqs - 1), 0)
        q_start = _load_qsl(qsl_ptr, found, num_tokens)
        q_end = tl.load(qsl_ptr + found + 1, mask=in_req, other=0)
        seq_len = tl.load(seq_lens_ptr + found, mask=in_req, other=0)
        guess = found
    req = guess
    q_end = tl.maximum(tl.minimum(q_end, num_tokens), q_start)
    covered = in_req & (q_start <= t) & (t < q_end)
    seq_len = tl.minimum(tl.maximum(seq_len, 0), kv_cap)
    ctx_len = seq_len - (q_end - q_start)  # keys final before this launch: [0, ctx_len)
    pos = ctx_len + (t - q_start)
    # The token sees keys [key_lo, pos]: its own key, pos, and the earlier ones
    # [key_lo, pos) in chunks at fixed boundaries (chunk c: [c * CHUNK, (c + 1) * CHUNK)).
    # The program of the last of them adds the own key (a decode step's, written by the
    # kernel just before), as a vector of its own: a token decoded alone, whose earlier
    # keys are all final before the wait, loads nothing but q and that row after it.
    # Grouped by the position only: a verified token gets a decoded one's bits.
    sees = covered & (pos >= 0)
    key_lo = tl.zeros_like(pos)
    if USE_WINDOW:
        key_lo = tl.maximum(pos - window + 1, 0)
    first = key_lo // CHUNK
    last = tl.maximum(tl.maximum(pos - 1, key_lo) // CHUNK, first)
    last_prog = tl.minimum(last, NUM_SPLITS - 1)  # the grid's last also holds those past it
    first_prog = tl.minimum(first, NUM_SPLITS - 1)
    n_parts = last_prog - first_prog + 1
    if (split < first_prog) | (split > last_prog) | ~sees:
        # No key of this token here. The program of chunk 0 writes the zeros of a token
        # that sees none (after the wait: the kernel before may still read `out`).
        if (split == 0) & ~sees:
            if GDC:
                tl.extra.cuda.gdc_wait()
                tl.extra.cuda.gdc_launch_dependents()
            tl.store(o_ptrs, tl.zeros([HEAD_DIM_P], out_ptr.dtype.element_ty), mask=d_mask)
        return

    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
    # This program's earlier keys [mine_lo, mine_hi) in CHUNK-key tiles from the tile of
    # mine_lo (more than one only for the grid's last program). The first tile's keys
    # below ctx_len load before the wait; a verified token's keys from ctx_len (this
    # step's other rows) after it, into the same registers: the same tile either way.
    mine_lo = tl.maximum(key_lo, split * CHUNK)
    mine_hi = tl.where(split == last_prog, pos, (split + 1) * CHUNK)
    own = split == last_prog
    c0 = (mine_lo // CHUNK) * CHUNK
    rows, ok, want = _chunk_rows(bt_row, c0, mine_lo, mine_hi, num_blocks, stride_kb,
                                 stride_kt, BLOCK_SIZE, CHUNK)  # fmt: skip
    early = ok & (c0 + tl.arange(0, CHUNK) < ctx_len)
    k = _load_rows(k_head, rows, early, offs_d, d_mask, 0.0)
    v = _load_rows(v_head, rows, early, offs_d, d_mask, 0.0)
    own_blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=own, other=-1)
    own_ok = own & (own_blk >= 0) & (own_blk < num_blocks)
    own_row = tl.where(own_ok, own_blk, 0).to(tl.int64) * stride_kb + (pos % BLOCK_SIZE) * stride_kt
    own_mask = offs_d < tl.where(own_ok, HEAD_DIM, 0)  # d_mask where the row exists
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    q = tl.load(q_ptr + t.to(tl.int64) * stride_qt + head * stride_qh + offs_d, mask=d_mask,
                other=0.0).to(tl.float32)  # fmt: skip
    k_own = tl.load(k_head + own_row + offs_d, mask=own_mask, other=0.0).to(tl.float32)
    v_own = tl.load(v_head + own_row + offs_d, mask=own_mask, other=0.0).to(tl.float32)
    if ctx_len < tl.minimum(mine_hi, c0 + CHUNK):
        late = ok & ~early
        k = _load_rows(k_head, rows, late, offs_d, d_mask, k)
        v = _load_rows(v_head, rows, late, offs_d, d_mask, v)
    qk_scale = scale * 1.4426950408889634
    s = _scores(q, k, want, scale, qk_scale, softcap, USE_SOFTCAP)
    if USE_SOFTCAP:
        s_own = _softcapped(tl.sum(k_own * q, axis=0), scale, softcap)
    else:
        s_own = tl.sum(k_own * q, axis=0) * qk_scale
    s_own = tl.where(own, s_own, float("-inf"))
    m_i = tl.maximum(tl.max(s, axis=0), s_own)
    p = tl.exp2(s - m_i)
    p_own = tl.exp2(s_own - m_i)
    l_i = tl.sum(p, axis=0) + p_own
    acc = tl.sum(p[:, None] * v.to(tl.float32), axis=0) + p_own * v_own
    # The grid's last program: its tiles past the first, loaded here (online softmax).
    for c in range(c0 + CHUNK, mine_hi, CHUNK):
        rows, ok, want = _chunk_rows(bt_row, c, mine_lo, mine_hi, num_blocks, stride_kb,
                                     stride_kt, BLOCK_SIZE, CHUNK)  # fmt: skip
        k = _load_rows(k_head, rows, ok, offs_d, d_mask, 0.0)
        v = _load_rows(v_head, rows, ok, offs_d, d_mask, 0.0)
        s = _scores(q, k, want, scale, qk_scale, softcap, USE_SOFTCAP)
        m_i, l_i, acc = _online(s, v, m_i, l_i, acc)
    # l_i >= 1: the largest score counts exp2(0).
    o = acc / l_i
    if NUM_SPLITS == 1:
        # One chunk a token: no partials, no tickets (the launcher passes none).
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=d_mask)
    elif n_parts == 1:
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=d_mask)
    else:
        # Partials [NUM_SPLITS, num_tokens, NUM_Q_HEADS, HEAD_DIM_P] and their lse.
        row = (split * num_tokens + t).to(tl.int64) * NUM_Q_HEADS + head
        tl.store(part_out_ptr + row * HEAD_DIM_P + offs_d, o)
        tl.store(part_lse_ptr + row, m_i + tl.log2(l_i))
        # Every thread's stores before the release of the ticket; the acquire makes the
        # other chunks' partials visible to the last one, which reads them past L1.
        tl.debug_barrier()
        ticket = ticket_ptr + t.to(tl.int64) * NUM_Q_HEADS + head
        if tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == n_parts - 1:
            tl.store(ticket, 0)
            m_all = tl.full([], float("-inf"), tl.float32)
            den = tl.zeros([], tl.float32)
            num = tl.zeros([HEAD_DIM_P], tl.float32)
            for sp in range(first_prog, last_prog + 1):
                r = (sp * num_tokens + t).to(tl.int64) * NUM_Q_HEADS + head
                lse = tl.load(part_lse_ptr + r, cache_modifier=".cg")
                part = tl.load(part_out_ptr + r * HEAD_DIM_P + offs_d, cache_modifier=".cg")
                m_new = tl.maximum(m_all, lse)
                alpha = tl.exp2(m_all - m_new)
                w = tl.exp2(lse - m_new)
                num = num * alpha + w * part
                den = den * alpha + w
                m_all = m_new
            tl.store(o_ptrs, (num / den).to(out_ptr.dtype.element_ty), mask=d_mask)


class _Tickets:
    """Zeroed int32 tickets, one buffer per device that grows: each launch's last program
    leaves its tickets at zero, so a buffer is zeroed once, when it is made, and that
    zeroing must run then. Made outside a capture (an eager launch: the capture
    managers' warm-up runs each step eagerly before capturing it), the buffer is shared
    by every later launch, captured ones included. Made inside a capture, its zeroing is
    a node of that graph and runs only when the graph replays, so the buffer stays that
    launch's own (the graph zeroes it first on each replay) and is never handed to
    another launch: handing it on let a graph replayed before the capturing one read
    whatever the memory held (stop 61's GPU suite: graph replay against eager). Buffers
    that were replaced stay alive (a captured graph may hold them). Token launches of
    one device take tickets after their PDL wait, so launches on one stream never share
    them; launches on two streams of a device must not run at once."""

    def __init__(self):
        self._live: dict[tuple, torch.Tensor] = {}
        self._old: list[torch.Tensor] = []

    def get(self, device: torch.device, need: int) -> torch.Tensor:
        key = (device.type, device.index)
        buf = self._live.get(key)
        if buf is not None and buf.numel() >= need:
            return buf
        fresh = torch.zeros(max(need, 4096), dtype=torch.int32, device=device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return fresh  # zeroed by the graph itself, at each replay: this launch's own
        if buf is not None:
            self._old.append(buf)
        self._live[key] = fresh
        return fresh


TICKETS = _Tickets()


def token_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    *,
    chunk: int,
    num_splits: int,
    num_warps: int,
    sliding_window: int | None,
    softcap: float | None,
    pdl: bool,
) -> torch.Tensor:
    """The launch (arguments checked by the caller: kernels.paged_attention_unmerged)."""
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    head_dim_p = triton.next_power_of_2(head_dim)
    if num_splits > 1:
        part_out = torch.empty((num_splits, num_tokens, num_q_heads, head_dim_p),
                               dtype=torch.float32, device=q.device)  # fmt: skip
        part_lse = torch.empty((num_splits, num_tokens, num_q_heads), dtype=torch.float32,
                               device=q.device)  # fmt: skip
        tickets = TICKETS.get(q.device, num_tokens * num_q_heads)
    else:
        part_out = part_lse = tickets = out  # unused by the kernel with NUM_SPLITS == 1
    gdc, launch_pdl = pdl_launch(pdl)
    _token_attention_kernel[(num_tokens, num_q_heads, num_splits)](
        out, part_out, part_lse, tickets, q, k_cache, v_cache, query_start_loc, seq_lens,
        block_table, query_start_loc.numel() - 1, num_tokens, k_cache.shape[0],
        block_table.shape[1] * block_size, float(scale), float(softcap or 0.0),
        int(sliding_window or 0), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
        v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        QPK=num_q_heads // num_kv_heads, NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim,
        HEAD_DIM_P=head_dim_p, BLOCK_SIZE=block_size, CHUNK=chunk, NUM_SPLITS=num_splits,
        USE_SOFTCAP=softcap is not None, USE_WINDOW=sliding_window is not None, GDC=gdc,
        num_warps=num_warps, **launch_pdl,
    )  # fmt: skip
    return out
