"""KV store kernel against the in-place reference: every slot written exactly once,
padded (-1) and out-of-range slots write nothing."""

from __future__ import annotations

import pytest
import torch

from specdraft.kernels import store_kv, use_validation
from tests.reference import store_kv_ref


def _case(device, dtype, num_tokens, num_blocks, block_size, hkv, d, num_padded):
    k = torch.randn(num_tokens, hkv, d).to(dtype).to(device)
    v = torch.randn(num_tokens, hkv, d).to(dtype).to(device)
    k_cache = torch.randn(num_blocks, block_size, hkv, d).to(dtype).to(device)
    v_cache = torch.randn_like(k_cache)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[torch.randperm(num_tokens)[:num_padded]] = -1
    return k, v, k_cache, v_cache, slots.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("hkv, d", [(1, 64), (2, 96), (8, 128), (3, 256)])
def test_store_matches_reference(device, dtype, block_size, hkv, d):
    k, v, kc, vc, slots = _case(device, dtype, 37, 6, block_size, hkv, d, num_padded=5)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    store_kv(k, v, kc, vc, slots)
    store_kv_ref(k, v, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    # the test can fail: the written slots really changed
    written = slots[slots >= 0]
    bs = kc.shape[1]
    assert torch.equal(kc[written // bs, written % bs], k[slots >= 0])


def test_padded_tokens_write_nothing(device):
    k, v, kc, vc, slots = _case(device, torch.float32, 16, 4, 16, 2, 64, num_padded=16)
    before = (kc.clone(), vc.clone())
    store_kv(k, v, kc, vc, slots)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


def test_slots_past_the_cache_are_dropped(device):
    k, v, kc, vc, slots = _case(device, torch.float32, 8, 2, 16, 2, 64, num_padded=0)
    slots[3] = kc.shape[0] * kc.shape[1]  # one past the last slot
    slots[5] = 10**12
    kc_ref, vc_ref = kc.clone(), vc.clone()
    # The kernel's contract, below validation mode (on by default for CPU tensors, where
    # it refuses these slots: tests/test_kernel_safety.py).
    with use_validation(False):
        store_kv(k, v, kc, vc, slots)
    store_kv_ref(k, v, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_longer_slot_mapping_uses_first_num_tokens(device):
    k, v, kc, vc, slots = _case(device, torch.float32, 10, 4, 16, 2, 64, num_padded=0)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    store_kv(k[:6], v[:6], kc, vc, slots)
    store_kv_ref(k[:6], v[:6], kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


@pytest.mark.parametrize(
    "change, exc, words",
    [
        (lambda a: {"slot_mapping": a["slot_mapping"].int()}, TypeError, "slot_mapping"),
        (lambda a: {"slot_mapping": a["slot_mapping"][:3]}, ValueError, "slot_mapping"),
        (lambda a: {"k": a["k"].half()}, TypeError, "k must have dtype"),
        (lambda a: {"v": a["v"][:, :1]}, ValueError, "v has shape"),
        (lambda a: {"v": a["v"][:4]}, ValueError, "v has 4 tokens"),
        (lambda a: {"k_cache": a["k_cache"][..., :32]}, ValueError, "v_cache"),
    ],
)
def test_bad_input_raises_and_writes_nothing(device, change, exc, words):
    k, v, kc, vc, slots = _case(device, torch.float32, 8, 2, 16, 2, 64, num_padded=0)
    args = dict(k=k, v=v, k_cache=kc, v_cache=vc, slot_mapping=slots)
    before = (kc.clone(), vc.clone())
    args.update(change(args))
    with pytest.raises(exc, match=words):
        store_kv(**args)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


@pytest.mark.gpu
def test_gpu_store_bf16_large_cache():
    # Slots past 2^31 elements: block ids above 2^17 with 16 x 8 x 128 per block.
    bs, hkv, d = 16, 8, 128
    num_blocks = (1 << 31) // (bs * hkv * d) + 64
    kc = torch.zeros(num_blocks, bs, hkv, d, dtype=torch.bfloat16, device="cuda")
    vc = torch.zeros_like(kc)
    n = 300
    k = torch.randn(n, hkv, d, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    slots = torch.randperm(64 * bs, device="cuda")[:n] + (num_blocks - 64) * bs
    slots[::7] = -1
    store_kv(k, v, kc, vc, slots)
    keep = slots >= 0
    s = slots[keep]
    assert torch.equal(kc[s // bs, s % bs], k[keep]) and torch.equal(vc[s // bs, s % bs], v[keep])
    assert kc.count_nonzero().item() == keep.sum().item() * hkv * d - (k[keep] == 0).sum().item()
