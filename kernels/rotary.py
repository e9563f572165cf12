"""Rotary position embedding applied in place to q and k, reading positions on the device.

The half-split ("NeoX", Hugging Face rotate_half) convention: for a head x, with
x1 = x[:R/2] and x2 = x[R/2:R] (R the rotary dim), x1 <- x1 cos - x2 sin and
x2 <- x2 cos + x1 sin. cos and sin come from a float32 table [max_positions, R] (cos in
the first R/2 columns, sin in the last R/2) that the runtime builds once per model, so
the kernel reads everything that varies per step (positions) from persistent buffers.
One program per token rotates every q and k head of that token.

rotary_store_kv fuses this rotation with the paged K/V store (kernels/kv_store.py) into
one launch for the attention layer: q is rotated in place, and the rotated k rows and
the v rows go straight to the cache slots, so k in its input buffer is never written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_store import check_store_kv_args
from .launch import pdl_launch
from .paged_attention import _check_tensor

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _load_cos_sin(
    positions_ptr,
    tok,
    cos_sin_ptr,
    max_positions,
    stride_ct,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
):
    """cos, sin [HALF_P] (float32, zero past HALF) of token `tok`'s position, and the
    column offsets and mask they go with."""
    # Clamped: a padded token (position 0) or a position past the table never reads
    # outside it.
    pos = tl.load(positions_ptr + tok)
    pos = tl.minimum(tl.maximum(pos, 0), max_positions - 1)
    offs_d = tl.arange(0, HALF_P)
    d_mask = offs_d < HALF
    row = cos_sin_ptr + pos * stride_ct
    cos = tl.load(row + offs_d, mask=d_mask, other=0.0)
    sin = tl.load(row + HALF + offs_d, mask=d_mask, other=0.0)
    return cos, sin, offs_d, d_mask


@triton.jit
def _rotate_heads(
    src_ptr,
    stride_src_h,
    dst_ptr,
    stride_dst_h,
    cos,
    sin,
    offs_d,
    d_mask,
    NUM_HEADS: tl.constexpr,
    HEADS_P: tl.constexpr,
    HALF: tl.constexpr,
):
    """Rotate the first 2 * HALF dims of NUM_HEADS heads read at src_ptr and write them
    at dst_ptr (the same rows for an in-place rotation: both halves are loaded before
    either is stored). apply_rotary and rotary_store_kv share this one expression, so
    the two paths round alike."""
    offs_h = tl.arange(0, HEADS_P)
    mask = (offs_h[:, None] < NUM_HEADS) & d_mask[None, :]
    src = src_ptr + offs_h[:, None] * stride_src_h + offs_d[None, :]
    dst = dst_ptr + offs_h[:, None] * stride_dst_h + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dt = dst_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos[None, :] - x2 * sin[None, :]).to(dt), mask=mask)
    tl.store(dst + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(dt), mask=mask)


@triton.jit
def _copy_heads(
    src_ptr,
    stride_src_h,
    dst_ptr,
    stride_dst_h,
    NUM_HEADS: tl.constexpr,
    HEADS_P: tl.constexpr,
    WIDTH: tl.constexpr,
    WIDTH_P: tl.constexpr,
):
    """Copy WIDTH contiguous elements of NUM_HEADS heads from src_ptr to dst_ptr."""
    offs_h = tl.arange(0, HEADS_P)
    offs_w = tl.arange(0, WIDTH_P)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_w[None, :] < WIDTH)
    x = tl.load(src_ptr + offs_h[:, None] * stride_src_h + offs_w[None, :], mask=mask)
    tl.store(dst_ptr + offs_h[:, None] * stride_dst_h + offs_w[None, :], x, mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cos_sin_ptr,
    max_positions,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ct,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HQ_P: tl.constexpr,
    HKV_P: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    cos, sin, offs_d, d_mask = _load_cos_sin(
        positions_ptr, tok, cos_sin_ptr, max_positions, stride_ct, HALF, HALF_P
    )
    q_row = q_ptr + tok * stride_qt
    k_row = k_ptr + tok * stride_kt
    _rotate_heads(
        q_row, stride_qh, q_row, stride_qh, cos, sin, offs_d, d_mask, NUM_Q_HEADS, HQ_P, HALF
    )
    _rotate_heads(
        k_row, stride_kh, k_row, stride_kh, cos, sin, offs_d, d_mask, NUM_KV_HEADS, HKV_P, HALF
    )


@triton.jit
def _rotary_store_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    positions_ptr,
    slot_mapping_ptr,
    cos_sin_ptr,
    max_positions,
    num_slots,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_vcb,
    stride_vct,
    stride_vch,
    stride_ct,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HQ_P: tl.constexpr,
    HKV_P: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    TAIL: tl.constexpr,
    TAIL_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GDC: tl.constexpr = False,
):
    tok = tl.program_id(0).to(tl.int64)
    # Positions, slots and the cos / sin table are read before the wait (programmatic
    # dependent launch): the metadata was written at least two kernels back (see
    # kernels.paged_attention); q, k, v come from the kernel just before.
    cos, sin, offs_d, d_mask = _load_cos_sin(
        positions_ptr, tok, cos_sin_ptr, max_positions, stride_ct, HALF, HALF_P
    )
    slot = tl.load(slot_mapping_ptr + tok)
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    q_row = q_ptr + tok * stride_qt
    _rotate_heads(
        q_row, stride_qh, q_row, stride_qh, cos, sin, offs_d, d_mask, NUM_Q_HEADS, HQ_P, HALF
    )
    # store_kv's contract: slot -1 marks a padded token, and any slot outside
    # [0, num_slots) writes nothing rather than out of bounds. q is rotated either way.
    if (slot >= 0) & (slot < num_slots):
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        k_row = k_ptr + tok * stride_kt
        k_dst = k_cache_ptr + blk * stride_kcb + off * stride_kct
        _rotate_heads(
            k_row, stride_kh, k_dst, stride_kch, cos, sin, offs_d, d_mask, NUM_KV_HEADS, HKV_P, HALF
        )
        if TAIL > 0:
            # Partial rotary: dims [2 * HALF, HEAD_DIM) of k are stored unrotated.
            _copy_heads(
                k_row + 2 * HALF,
                stride_kh,
                k_dst + 2 * HALF,
                stride_kch,
                NUM_KV_HEADS,
                HKV_P,
                TAIL,
                TAIL_P,
            )
        _copy_heads(
            v_ptr + tok * stride_vt,
            stride_vh,
            v_cache_ptr + blk * stride_vcb + off * stride_vct,
            stride_vch,
            NUM_KV_HEADS,
            HKV_P,
            HEAD_DIM,
            HEAD_DIM_P,
        )


def check_rotary_args(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """apply_rotary's argument checks (nothing launched)."""
    _check_tensor("q", q, 3, _DTYPES)
    _check_tensor("k", k, 3, (q.dtype,))
    _check_tensor("positions", positions, 1, (torch.int64,))
    _check_tensor("cos_sin_cache", cos_sin_cache, 2, (torch.float32,))
    num_tokens, num_q_heads, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(
            f"k has shape {tuple(k.shape)}, expected [{num_tokens}, num_kv_heads, {head_dim}]"
        )
    rot = cos_sin_cache.shape[1]
    if rot % 2 or rot > head_dim or rot < 2:
        raise ValueError(
            f"cos_sin_cache has {rot} columns: must be even and in [2, head_dim {head_dim}]"
        )
    if cos_sin_cache.shape[0] < 1:
        raise ValueError("cos_sin_cache has no rows")
    if positions.numel() < num_tokens:
        raise ValueError(
            f"positions has {positions.numel()} entries, fewer than num_tokens {num_tokens}"
        )
    for name, t in (("k", k), ("positions", positions), ("cos_sin_cache", cos_sin_cache)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError("q and k must be contiguous in head_dim")


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Rotate q [num_tokens, Hq, D] and k [num_tokens, Hkv, D] in place (they may be
    strided views of one fused QKV output); positions: int64 [>= num_tokens];
    cos_sin_cache: float32 [max_positions, R], R even and <= D. Positions outside
    [0, max_positions) are clamped into it. Launches num_tokens programs."""
    check_rotary_args(q, k, positions, cos_sin_cache)
    num_tokens, num_q_heads, head_dim = q.shape
    rot = cos_sin_cache.shape[1]
    if num_tokens == 0:
        return
    half = rot // 2
    num_kv_heads = k.shape[1]
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        positions,
        cos_sin_cache,
        cos_sin_cache.shape[0],
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HQ_P=triton.next_power_of_2(num_q_heads),
        HKV_P=triton.next_power_of_2(num_kv_heads),
        HALF=half,
        HALF_P=triton.next_power_of_2(half),
        num_warps=4 if num_q_heads * half >= 1024 else 1,
    )


def check_rotary_store_kv_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> int:
    """rotary_store_kv's argument checks (nothing launched): apply_rotary's and
    store_kv's, in validation mode the slots' values too; returns the cache block size.
    q, k, v and the caches share one dtype (k matches q, and the cache matches k)."""
    check_rotary_args(q, k, positions, cos_sin_cache)
    return check_store_kv_args(k, v, k_cache, v_cache, slot_mapping)


def rotary_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    pdl: bool = False,
) -> None:
    """apply_rotary(q, k, positions, cos_sin_cache) then store_kv(k, v, k_cache, v_cache,
    slot_mapping) in one launch of num_tokens programs, bit for bit: q ends rotated in
    place and the cache rows hold what the two kernels write (the same float32 math and
    rounding). k itself is NOT rotated in place: its rotated rows go only to the cache
    (the attention kernel reads K from there), which saves writing them back.

    Shapes as in the two launchers: q [num_tokens, Hq, D], k and v [num_tokens, Hkv, D]
    (strided views of one fused QKV output are fine), positions int64 [>= num_tokens],
    cos_sin_cache float32 [max_positions, R] with R even and <= D (dims past R are
    stored unrotated), caches [num_blocks, block_size, Hkv, D], slot_mapping int64
    [>= num_tokens]. Positions are clamped into the table; a token whose slot is -1, or
    outside the cache, has q rotated and writes no K/V. Every check runs before the
    launch, so a refused call writes nothing. pdl: launch with programmatic dependent
    launch (kernels.pdl_supported)."""
    block_size = check_rotary_store_kv_args(
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping
    )
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    num_kv_heads = k.shape[1]
    half = cos_sin_cache.shape[1] // 2
    tail = head_dim - 2 * half
    gdc, launch_pdl = pdl_launch(pdl)
    _rotary_store_kv_kernel[(num_tokens,)](
        q,
        k,
        v,
        k_cache,
        v_cache,
        positions,
        slot_mapping,
        cos_sin_cache,
        cos_sin_cache.shape[0],
        k_cache.shape[0] * block_size,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HQ_P=triton.next_power_of_2(num_q_heads),
        HKV_P=triton.next_power_of_2(num_kv_heads),
        HALF=half,
        HALF_P=triton.next_power_of_2(half),
        HEAD_DIM=head_dim,
        HEAD_DIM_P=triton.next_power_of_2(head_dim),
        TAIL=tail,
        TAIL_P=triton.next_power_of_2(max(tail, 1)),
        BLOCK_SIZE=block_size,
        GDC=gdc,
        num_warps=4 if max(num_q_heads * half, num_kv_heads * head_dim) >= 1024 else 1,
        **launch_pdl,
    )
