"""PyTorch implementations of the kernels' math: the runtime's path on a machine without
a GPU (and a cross-check of the Triton path in the tests).

Each function has the contract of its Triton counterpart in specdraft.kernels (same
arguments, same outputs, same in-place writes, same treatment of padding and of
out-of-range metadata), computed with torch ops in float32. They read lengths on the
host, so they are for eager CPU execution, not for CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k[t], v[t] at slot_mapping[t]; slots < 0 or past the cache write nothing."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    slots = slot_mapping[:num_tokens]
    keep = (slots >= 0) & (slots < num_slots)
    idx = slots[keep]
    k_flat = k_cache.view(num_slots, *k_cache.shape[2:])
    v_flat = v_cache.view(num_slots, *v_cache.shape[2:])
    k_flat[idx] = k[keep].to(k_cache.dtype)
    v_flat[idx] = v[keep].to(v_cache.dtype)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **_launch_bounds,
) -> torch.Tensor:
    """Causal attention of each request's query tokens (the last ones of its sequence)
    over its paged keys, in float32. Metadata is clamped as the kernel clamps it: query
    ranges into [0, num_tokens], seq_len into what the block table row can hold, and a
    block id outside the cache hides its keys. Rows of padded tokens are zero."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    out[:num_tokens].zero_()
    num_reqs = query_start_loc.numel() - 1
    if num_reqs <= 0 or num_tokens == 0:
        return out
    width = block_table.shape[1]
    # Clamp as the kernel does: query ranges into [0, num_tokens] and monotone, seq_len
    # into what the table row can hold; a request with nothing left attends to nothing.
    qsl = query_start_loc.long().clamp(0, num_tokens)
    starts = qsl[:-1]
    ends = torch.maximum(qsl[1:], starts)
    n = ends - starts
    seq = seq_lens[:num_reqs].long().clamp(0, width * block_size)
    active = (n > 0) & (seq > 0)
    if not bool(active.any()):
        return out
    # All requests at once, padded to the longest query and context of the batch: one set
    # of tensor ops per call instead of a Python loop over requests.
    n_max, l_max = int(n.max()), int(seq.max())
    nb = -(-l_max // block_size)
    blocks = block_table[:num_reqs, :nb].long()
    blk_ok = (blocks >= 0) & (blocks < num_blocks)  # ids outside the cache hide their keys
    blocks = torch.where(blk_ok, blocks, 0)
    k = k_cache[blocks].reshape(num_reqs, nb * block_size, num_kv_heads, head_dim)[:, :l_max]
    v = v_cache[blocks].reshape(num_reqs, nb * block_size, num_kv_heads, head_dim)[:, :l_max]
    k_pos = torch.arange(l_max, device=q.device)
    key_ok = blk_ok.repeat_interleave(block_size, dim=1)[:, :l_max] & (k_pos < seq[:, None])
    # Keys a request may not see are zeroed, not only masked: the cache past a request's
    # length holds whatever was there (NaN included), and 0 * NaN in the weighted sum of
    # V would poison the row. The kernel's masked loads read 0 for them too.
    k = torch.where(key_ok[:, :, None, None], k, 0)
    v = torch.where(key_ok[:, :, None, None], v, 0)
    j = torch.arange(n_max, device=q.device)
    q_ok = (j < n[:, None]) & active[:, None]  # [R, n_max]
    tok = (starts[:, None] + j).clamp(max=num_tokens - 1)
    qr = q[tok].float().view(num_reqs, n_max, num_kv_heads, group, head_dim)
    scores = torch.einsum("rnhgd,rlhd->rhgnl", qr, k.float())
    if softcap is not None:
        scores = softcap * torch.tanh(scores * (scale / softcap))
    else:
        scores = scores * scale
    q_pos = seq[:, None] - n[:, None] + j  # [R, n_max]
    visible = (k_pos <= q_pos[:, :, None]) & key_ok[:, None, :]
    if sliding_window is not None:
        visible &= k_pos > q_pos[:, :, None] - sliding_window
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no visible key
    o = torch.einsum("rhgnl,rlhd->rnhgd", probs, v.float())
    o = o.reshape(num_reqs, n_max, num_q_heads, head_dim)
    out[tok[q_ok]] = o[q_ok].to(out.dtype)
    return out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
):
    """As kernels.rms_norm, with the same roundings: the sum with the residual is
    rounded to the residual's dtype, the normalised value to x's dtype before the
    weight multiplies it (as transformers' LlamaRMSNorm does)."""
    if residual is not None:
        residual_out = residual if residual_out is None else residual_out
        s = (x.float() + residual.float()).to(residual_out.dtype)
        residual_out.copy_(s)
        xf = s.float()
    else:
        xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = y.to(x.dtype).float() * weight.float()
    if out is None:
        out = torch.empty_like(x)
    out.copy_(y.to(out.dtype))
    return out if residual is None else (out, residual_out)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Rotate the first R dims of q and k in place (rotate-half layout); positions are
    clamped into the table as the kernel clamps them."""
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return
    half = cos_sin_cache.shape[1] // 2
    pos = positions[:num_tokens].clamp(0, cos_sin_cache.shape[0] - 1)
    rows = cos_sin_cache[pos]
    cos, sin = rows[:, None, :half], rows[:, None, half:]
    for t in (q, k):
        # float() is the same tensor for float32 input: copy before writing t.
        x1 = t[..., :half].float().clone()
        x2 = t[..., half : 2 * half].float().clone()
        t[..., :half] = (x1 * cos - x2 * sin).to(t.dtype)
        t[..., half : 2 * half] = (x2 * cos + x1 * sin).to(t.dtype)


def rotary_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """apply_rotary then store_kv, as the fused kernel: q rotated in place, the rotated
    k rows only in the cache (k itself is left as it was)."""
    k_rot = k.clone()
    apply_rotary(q, k_rot, positions, cos_sin_cache)
    store_kv(k_rot, v, k_cache, v_cache, slot_mapping)


def embed_rows(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, table)


def embed_concat(ids: torch.Tensor, table: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    return torch.cat([F.embedding(ids, table), hidden], dim=-1)


def _gathered(x, x_rows):
    """x's rows x_rows (clamped into x, as the kernels do), or x."""
    if x_rows is None:
        return x
    return x.index_select(0, x_rows.clamp(0, max(x.shape[0] - 1, 0)))


def _x_int8_scales(amax: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """act_int8's row scales s_x = absmax / 127 and r_x = 127 / absmax, each the float32
    nearest the exact quotient (float64 division, then one rounding: exact for float32
    operands; a tensor dividend, since torch takes `127.0 / a` as 127 * (1 / a)); 1 and 0
    where the row is not live."""
    a = amax.double()
    sx = torch.where(live, (a / 127.0).float(), torch.ones_like(amax))
    rx = torch.where(
        live, (a.new_full((), 127.0) / a.where(live, 1.0)).float(), torch.zeros_like(amax)
    )
    return sx, rx


def linear_int8(
    x, weight, scale, *, out=None, x_rows=None, pdl: bool = False, act_int8: bool = False
) -> torch.Tensor:
    """As kernels.linear_int8: float32 sums of x (its rows x_rows) times the int8
    weights, then each column scaled once, rounded to x's dtype. act_int8: x's rows to
    int8 as the kernel defines it; the integer sums are exact here (float64), rounded
    to float32 once as the kernel's int32 sums are, then the same two multiplies."""
    x = _gathered(x, x_rows)
    if act_int8:
        xf = x.float()
        amax = xf.abs().amax(dim=1, keepdim=True)
        finite = torch.isfinite(amax)
        live = finite & (amax > 0)
        # Both scales correctly rounded, as the kernel's div_rn: through float64, since
        # torch computes `127.0 / amax` as 127 * (1 / amax) (off by an ulp in ~1/4 of
        # rows, which moves x_q's rounding at halves; stop 48)
        sx, rx = _x_int8_scales(amax, live)
        xq = torch.round(torch.where(finite, xf * rx, 0.0)).clamp_(-127, 127)
        acc = (xq.double() @ weight.double().T).float() * sx
        y = torch.where(finite, acc * scale, float("nan")).to(x.dtype)
    else:
        y = (F.linear(x.float(), weight.float()) * scale).to(x.dtype)
    if out is None:
        return y
    return out.copy_(y)


def linear_int8_partials(
    x, weight, scale, part_val, part_idx, *, x_rows=None, pdl: bool = False,
    act_int8: bool = False,
) -> int:  # fmt: skip
    """As kernels.linear_int8_partials with one block a row: each row's maximum of the
    rounded logits (NaN highest) and its first column; returns 1."""
    x = _gathered(x, x_rows)
    v = linear_int8(x, weight, scale, act_int8=act_int8).float()
    v = torch.where(torch.isnan(v), float("inf"), v)
    m = x.shape[0]
    part_val[:m, 0] = v.max(dim=1).values
    part_idx[:m, 0] = v.argmax(dim=1).int()  # the first maximal column
    return 1


def reduce_argmax_parts(part_val, part_idx, rows: int, blocks: int, offsets=None):
    """int64 [rows]: the tokens of linear_int8_partials' output (the column of the first
    block holding each row's largest maximum), mapped through offsets when given."""
    v, i = part_val[:rows, :blocks], part_idx[:rows, :blocks].long()
    top = v.max(dim=1, keepdim=True).values
    tok = torch.where(v == top, i, torch.iinfo(torch.int64).max).min(dim=1).values
    return tok if offsets is None else tok + offsets[tok]


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    n = x.shape[1] // 2
    y = F.silu(x[:, :n].float()) * x[:, n:].float()
    if out is None:
        return y.to(x.dtype)
    out.copy_(y.to(out.dtype))
    return out


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
) -> Callable[[int, int], None]:
    """launch(num_reqs, num_tokens) with the contract of kernels.prepare_slot_mapping:
    optional gather of the step table, optional advance of positions and seq_lens by each
    request's query length, slot of each token, -1 for padding, negative positions,
    positions past the table and negative block ids."""
    width = block_table.shape[1]

    def launch(num_reqs: int, num_tokens: int) -> None:
        if rows is not None:
            block_table[:num_reqs] = rows[row_slots[:num_reqs]]
        if num_tokens == 0:
            return
        qsl = query_start_loc[: num_reqs + 1].long().clamp(0, num_tokens)
        qsl = torch.maximum(qsl, torch.cummax(qsl, 0).values)  # monotone, as clamped
        tok = torch.arange(num_tokens, device=out.device)
        # request of each token (searchsorted: repeat_interleave with tensor repeats is
        # milliseconds on the CPU); tokens outside every request are padding
        req_of = torch.searchsorted(qsl[1:], tok, right=True).clamp(max=max(num_reqs - 1, 0))
        owned = (tok >= qsl[0]) & (tok < qsl[-1])
        pos = positions[:num_tokens]
        if advance_seq_lens is not None:
            counts = qsl[1:] - qsl[:-1]
            advance_seq_lens[:num_reqs] += counts.to(advance_seq_lens.dtype)
            pos += torch.where(owned, counts[req_of], 0)
        blk_idx = torch.div(pos, block_size, rounding_mode="floor")
        ok = owned & (pos >= 0) & (blk_idx < width)
        blk = block_table[req_of, blk_idx.clamp(0, width - 1)].long()
        ok &= blk >= 0
        out[:num_tokens] = torch.where(ok, blk * block_size + pos % block_size, -1)

    return launch


def resolve_fed_ids(ids: torch.Tensor, last_token: torch.Tensor) -> torch.Tensor:
    """kernels.resolve_fed_ids in torch ops: fed ids -(row + 1) become last_token[row]."""
    return torch.where(ids < 0, last_token[(-1 - ids).clamp(0, last_token.shape[0] - 1)], ids)
