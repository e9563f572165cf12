"""Rotary position embedding applied in place to q and k, reading positions on the device.

The half-split ("NeoX", Hugging Face rotate_half) convention: for a head x, with
x1 = x[:R/2] and x2 = x[R/2:R] (R the rotary dim), x1 <- x1 cos - x2 sin and
x2 <- x2 cos + x1 sin. cos and sin come from a float32 table [max_positions, R] (cos in
the first R/2 columns, sin in the last R/2) that the runtime builds once per model, so
the kernel reads everything that varies per step (positions) from persistent buffers.
One program per token rotates every q and k head of that token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_attention import _check_tensor

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rotate_heads(
    base_ptr,
    stride_h,
    cos,
    sin,
    offs_d,
    d_mask,
    NUM_HEADS: tl.constexpr,
    HEADS_P: tl.constexpr,
    HALF: tl.constexpr,
):
    offs_h = tl.arange(0, HEADS_P)
    mask = (offs_h[:, None] < NUM_HEADS) & d_mask[None, :]
    p1 = base_ptr + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    dt = base_ptr.dtype.element_ty
    tl.store(p1, (x1 * cos[None, :] - x2 * sin[None, :]).to(dt), mask=mask)
    tl.store(p1 + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(dt), mask=mask)


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
    # Clamped: a padded token (position 0) or a position past the table never reads
    # outside it.
    pos = tl.load(positions_ptr + tok)
    pos = tl.minimum(tl.maximum(pos, 0), max_positions - 1)
    offs_d = tl.arange(0, HALF_P)
    d_mask = offs_d < HALF
    row = cos_sin_ptr + pos * stride_ct
    cos = tl.load(row + offs_d, mask=d_mask, other=0.0)
    sin = tl.load(row + HALF + offs_d, mask=d_mask, other=0.0)
    _rotate_heads(
        q_ptr + tok * stride_qt, stride_qh, cos, sin, offs_d, d_mask, NUM_Q_HEADS, HQ_P, HALF
    )
    _rotate_heads(
        k_ptr + tok * stride_kt, stride_kh, cos, sin, offs_d, d_mask, NUM_KV_HEADS, HKV_P, HALF
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
