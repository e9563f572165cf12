"""Capture-manager benchmark (GPU): capture time and graph-pool memory of the default
descriptor set for the simple draft step, replay against eager per step at batch 1, 8
and 64, and the host time of one dispatch plus replay.

    python -m bench.capture [--out results]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

BAR_CAPTURE_S, BAR_DISPATCH_US = 0.2, 20.0


def run(out_dir: Path) -> int:
    from bench.common import eager_us, environment, markdown_table, save_results
    from specdraft.attn_metadata import MetadataBuilder
    from specdraft.batch import ScheduledBatch
    from specdraft.block_table import BlockTables
    from specdraft.config import CacheConfig, LimitsConfig, ModelConfig
    from specdraft.cuda_graph import SpeculatorCudaGraphManager
    from specdraft.input_buffers import InputBuffers
    from specdraft.kv_cache import KVCache
    from specdraft.simple_draft import SimpleDraftModel

    # llama-68m-shaped step: 2 layers, hidden 768, 12 heads of 64, vocab 32000
    cfg = ModelConfig(2, 12, 12, 64, 768, 32000, dtype=torch.bfloat16)
    limits = LimitsConfig(max_num_reqs=256, max_num_tokens=512, max_model_len=4096)
    cache = KVCache(cfg, CacheConfig(16, num_blocks=256 * 64 + 1), "cuda")
    cache.data.normal_()
    bt = BlockTables(256, limits.max_blocks_per_req(16), 16, cache.num_blocks, "cuda")
    builder = MetadataBuilder(limits, InputBuffers(limits, "cuda"), bt)
    model = SimpleDraftModel(cfg, 256, "cuda")
    manager = SpeculatorCudaGraphManager(
        max_num_reqs=256, max_num_tokens=512, uniform_token_counts=(1, 4)
    )

    def forward_fn(num_reqs, num_tokens, meta, slots, dp, mode):
        return model(meta, cache)

    torch.cuda.synchronize()
    manager.capture(forward_fn, builder)
    n = len(manager.captured)
    per_graph = manager.capture_seconds / n
    pool_gib = (manager.pool_bytes or 0) / 2**30
    print(
        f"captured {n} graphs in {manager.capture_seconds:.2f} s ({per_graph:.3f} s each, "
        f"bar {BAR_CAPTURE_S} s); graph pool {pool_gib:.3f} GiB",
        flush=True,
    )

    rng = random.Random(0)
    rows = []
    for batch_size in (1, 8, 64):
        reqs = []
        for i in range(batch_size):
            start = rng.randint(500, 3000)
            rid = f"b{batch_size}-{i}"
            bt.add_request(rid, start + 1)
            reqs.append((rid, [rng.randrange(32000)], start))
        batch = ScheduledBatch.from_requests(reqs)
        desc = manager.dispatch(batch_size, batch_size, uniform_token_count=1)
        meta = builder.build(
            batch, num_reqs_padded=desc.num_reqs, num_tokens_padded=desc.num_tokens, max_query_len=1
        )
        step_us = eager_us(lambda meta=meta: model(meta, cache), iters=100, warmup=10)
        replay_us = eager_us(lambda desc=desc: manager.replay(desc), iters=100, warmup=10)
        # host time of one dispatch (the descriptor lookup) and of one replay launch,
        # each launch on an idle queue; medians of 300
        look, launch = [], []
        for _ in range(300):
            t0 = time.perf_counter()
            d = manager.dispatch(batch_size, batch_size, uniform_token_count=1)
            t1 = time.perf_counter()
            manager.replay(d)
            t2 = time.perf_counter()
            torch.cuda.synchronize()
            look.append((t1 - t0) * 1e6)
            launch.append((t2 - t1) * 1e6)
        rows.append(
            {
                "batch": batch_size,
                "eager_us": step_us,
                "replay_us": replay_us,
                "speedup": step_us / replay_us,
                "dispatch_us": statistics.median(look),
                "launch_us": statistics.median(launch),
                "dispatch_host_us": statistics.median([a + b for a, b in zip(look, launch)]),
            }
        )
        for rid in batch.req_ids:
            bt.remove_request(rid)
    env = environment()
    cols = [
        ("batch", "batch"),
        ("eager_us", "eager µs"),
        ("replay_us", "replay µs"),
        ("speedup", "eager/replay"),
        ("dispatch_us", "dispatch host µs"),
        ("launch_us", "replay launch host µs"),
        ("dispatch_host_us", "dispatch+replay host µs"),
    ]
    head = (
        f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, {env['date']}. "
        f"Simple draft step (2 layers, hidden 768, 12 heads, vocab 32000, bf16), decode "
        f"with contexts 500-3000. {n} graphs captured in {manager.capture_seconds:.2f} s "
        f"({per_graph:.3f} s per graph; bar {BAR_CAPTURE_S} s), graph pool "
        f"{pool_gib:.3f} GiB; host bar {BAR_DISPATCH_US:.0f} µs.\n\n"
    )
    table = head + markdown_table(rows, cols)
    save_results(
        out_dir,
        "capture",
        {
            "env": env,
            "graphs": n,
            "capture_s": manager.capture_seconds,
            "pool_bytes": manager.pool_bytes,
            "rows": rows,
        },
        table,
    )
    manager.teardown()
    print("\n" + table)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.capture needs an NVIDIA GPU")
        return 2
    return run(args.out)


if __name__ == "__main__":
    sys.exit(main())
