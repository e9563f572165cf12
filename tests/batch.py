"""Random paged batches for the kernel tests and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    q: torch.Tensor  # [num_tokens (+ padded), Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor  # int32 [num_reqs (+ padded) + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs (+ padded)]
    block_table: torch.Tensor  # int32 [num_reqs (+ padded), max_blocks]
    num_real_tokens: int
    max_query_len: int
    max_seq_len: int


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_paged_batch(
    q_lens: list[int],
    ctx_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    pad_reqs: int = 0,
    pad_tokens: int = 0,
    spare_blocks: int = 3,
    max_blocks: int | None = None,
    generator: torch.Generator | None = None,
) -> PagedBatch:
    """Requests with q_lens[i] new tokens after ctx_lens[i] cached ones, their blocks
    placed at random (permuted) ids, unused table entries pointing at random valid
    blocks, and optional padded requests (query length 0, seq_len 0) and padded tokens."""
    assert len(q_lens) == len(ctx_lens)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    blocks_per_req = [cdiv(s, block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + spare_blocks
    width = max(max(blocks_per_req, default=1), 1) if max_blocks is None else max_blocks
    g = generator
    perm = torch.randperm(num_blocks, generator=g)
    num_reqs = len(q_lens) + pad_reqs
    table = torch.randint(0, num_blocks, (num_reqs, width), generator=g, dtype=torch.int32)
    used = 0
    for r, nb in enumerate(blocks_per_req):
        table[r, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    total = sum(q_lens)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    qsl += [total] * pad_reqs
    q = torch.randn(total + pad_tokens, num_q_heads, head_dim, generator=g).to(dtype)
    dev = torch.device(device)
    return PagedBatch(
        q=q.to(dev),
        k_cache=k_cache.to(dev),
        v_cache=v_cache.to(dev),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens + [0] * pad_reqs, dtype=torch.int32, device=dev),
        block_table=table.to(dev),
        num_real_tokens=total,
        max_query_len=max(q_lens, default=1),
        max_seq_len=max(seq_lens, default=1),
    )
