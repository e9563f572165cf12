"""Pure-PyTorch references for the kernels, in float64 by default. bench/ reuses them."""

from __future__ import annotations

import torch


def gather_request_kv(
    cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """[seq_len, num_kv_heads, head_dim] of one request, read through its block table."""
    block_size = cache.shape[1]
    positions = torch.arange(seq_len, device=cache.device)
    blocks = block_table_row[positions // block_size].long()
    return cache[blocks, positions % block_size]


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Causal paged attention, one request at a time, in `dtype`. Rows of tokens past
    query_start_loc[-1] (padding) are zero."""
    num_tokens, num_q_heads, head_dim = q.shape
    qpk = num_q_heads // k_cache.shape[2]
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=dtype, device=q.device)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for r in range(len(qsl) - 1):
        start, end = qsl[r], qsl[r + 1]
        q_len = end - start
        if q_len == 0:
            continue
        seq_len = lens[r]
        k = gather_request_kv(k_cache, block_table[r], seq_len).to(dtype)
        v = gather_request_kv(v_cache, block_table[r], seq_len).to(dtype)
        k = k.repeat_interleave(qpk, dim=1)  # [L, Hq, D]
        v = v.repeat_interleave(qpk, dim=1)
        qr = q[start:end].to(dtype)  # [Q, Hq, D]
        s = torch.einsum("qhd,khd->hqk", qr, k) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        s = s.masked_fill(~visible, float("-inf"))
        p = torch.softmax(s, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", p, v)
    return out


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """In-place reference of kernels.store_kv."""
    block_size = k_cache.shape[1]
    num_slots = k_cache.shape[0] * block_size
    for t, slot in enumerate(slot_mapping[: k.shape[0]].tolist()):
        if 0 <= slot < num_slots:
            k_cache[slot // block_size, slot % block_size] = k[t]
            v_cache[slot // block_size, slot % block_size] = v[t]


def slot_mapping_ref(
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    num_tokens: int,
) -> torch.Tensor:
    """int64 [num_tokens] reference of kernels.compute_slot_mapping: -1 for padded tokens,
    negative positions, block indices past the table's width and negative block ids."""
    out = [-1] * num_tokens
    pos = positions[:num_tokens].tolist()
    qsl = query_start_loc.tolist()
    table = block_table.tolist()
    max_blocks = block_table.shape[1]
    for r in range(len(qsl) - 1):
        for t in range(max(qsl[r], 0), min(qsl[r + 1], num_tokens)):
            p = pos[t]
            if p < 0 or p // block_size >= max_blocks:
                continue
            block = table[r][p // block_size]
            if block >= 0:
                out[t] = block * block_size + p % block_size
    return torch.tensor(out, dtype=torch.int64, device=positions.device)
