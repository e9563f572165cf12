"""Host cost of filling the persistent buffers for one step (pytest-benchmark).

256 requests of mixed lengths (decodes, verification-sized queries and a few prefills),
padded to a descriptor; the bar is 100 us of host time per step and no host-device
synchronization. Needs a GPU: without one the slot-mapping kernel would run inside the
interpreter and the figure would mean nothing.

    python -m pytest bench/test_host_prep.py --benchmark-only
"""

from __future__ import annotations

import random

import pytest
import torch

from specdraft.attn_metadata import MetadataBuilder
from specdraft.batch import ScheduledBatch
from specdraft.block_table import BlockTables
from specdraft.config import LimitsConfig
from specdraft.input_buffers import InputBuffers

BAR_US = 100.0

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def mixed_batch(bt: BlockTables, rng: random.Random, n: int) -> ScheduledBatch:
    reqs = []
    for i in range(n):
        start = rng.randint(0, 4000)
        count = rng.choice([1] * 6 + [4, 5, 8] + ([rng.randint(100, 300)] if i % 64 == 0 else []))
        bt.add_request(i, start + count)
        reqs.append((i, [rng.randrange(32000) for _ in range(count)], start))
    return ScheduledBatch.from_requests(reqs)


def test_build_256_mixed_requests(benchmark):
    limits = LimitsConfig(max_num_reqs=256, max_num_tokens=8192, max_model_len=8192)
    bt = BlockTables(256, limits.max_blocks_per_req(16), 16, 256 * 600, "cuda")
    buffers = InputBuffers(limits, "cuda")
    builder = MetadataBuilder(limits, buffers, bt)
    batch = mixed_batch(bt, random.Random(0), 256)
    tp = 1 << (batch.num_tokens - 1).bit_length()  # pad to a power-of-two descriptor
    build = lambda: builder.build(batch, num_reqs_padded=256, num_tokens_padded=tp)  # noqa: E731
    build()
    torch.cuda.synchronize()
    # No synchronization: any synchronizing call inside build raises in this mode. The
    # mode's own checks cost host time, so the timed rounds below run without it.
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(20):
            build()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    benchmark.pedantic(build, rounds=200, iterations=5, warmup_rounds=10)
    torch.cuda.synchronize()
    median_us = benchmark.stats.stats.median * 1e6
    benchmark.extra_info.update(
        median_us=median_us, bar_us=BAR_US, tokens=batch.num_tokens, ring_waits=buffers.ring_waits
    )
    print(
        f"\nhost prep, 256 requests / {batch.num_tokens} tokens (padded {tp}): "
        f"median {median_us:.1f} us per step (bar {BAR_US:.0f} us), "
        f"staging waits {buffers.ring_waits}"
    )
