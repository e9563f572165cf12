"""Write this step's K and V rows into the paged cache at their slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_attention import _check_tensor, validate_kv_cache
from .validation import check_slot_mapping, validation_enabled


@triton.jit
def _kv_store_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_slots,
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
    NUM_KV_HEADS: tl.constexpr,
    HEADS_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok)
    # The contract (store_kv's docstring): slot -1 marks a padded token, and any slot
    # outside [0, num_slots) writes nothing rather than out of bounds.
    if (slot < 0) | (slot >= num_slots):
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_P)
    offs_d = tl.arange(0, HEAD_DIM_P)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = k_cache_ptr + blk * stride_kcb + off * stride_kct
    v_dst = v_cache_ptr + blk * stride_vcb + off * stride_vct
    tl.store(k_dst + offs_h[:, None] * stride_kch + offs_d[None, :], k, mask=mask)
    tl.store(v_dst + offs_h[:, None] * stride_vch + offs_d[None, :], v, mask=mask)


def check_store_kv_args(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> int:
    """store_kv's argument checks (nothing launched); returns the cache block size. In
    validation mode (kernels/validation.py) also the slots' values: one host read."""
    block_size, num_kv_heads, head_dim = validate_kv_cache(k_cache, v_cache)
    for name, t in (("k", k), ("v", v)):
        _check_tensor(name, t, 3, (k_cache.dtype,))
        if tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}, expected [num_tokens, {num_kv_heads}, "
                f"{head_dim}] to match the cache"
            )
        if t.device != k_cache.device:
            raise ValueError(f"{name} is on {t.device}, the cache on {k_cache.device}")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"v has {v.shape[0]} tokens, k has {k.shape[0]}")
    _check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,))
    num_tokens = k.shape[0]
    if slot_mapping.numel() < num_tokens:
        raise ValueError(
            f"slot_mapping has {slot_mapping.numel()} entries, fewer than num_tokens {num_tokens}"
        )
    if slot_mapping.device != k_cache.device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device}, the cache on {k_cache.device}")
    if num_tokens > 0 and validation_enabled(k):
        num_slots = k_cache.shape[0] * block_size
        check_slot_mapping(slot_mapping, num_tokens=num_tokens, num_slots=num_slots)
    return block_size


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim]; caches [num_blocks, block_size,
    num_kv_heads, head_dim]; slot_mapping: int64 [>= num_tokens], slot = block * block_size
    + offset, -1 for padding. Launches num_tokens programs, a host value fixed by the
    caller's descriptor.

    Contract, whatever slot_mapping holds: a slot < 0 or >= num_blocks * block_size
    writes nothing (it is dropped, never written out of bounds), so no value makes the
    kernel write outside the caches. In validation mode (kernels/validation.py; the
    default for CPU tensors) a slot past the cache, or a negative slot other than -1,
    raises ValueError before anything is written."""
    block_size = check_store_kv_args(k, v, k_cache, v_cache, slot_mapping)
    num_tokens = k.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if num_tokens == 0:
        return
    _kv_store_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k_cache.shape[0] * block_size,
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
        NUM_KV_HEADS=num_kv_heads,
        HEADS_P=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_P=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
