"""Capture manager: descriptor sets, dispatch, the capture rule, and (GPU) replay against
eager execution, including the seed's stale-metadata bug as a regression test."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from specdraft.attn_metadata import MetadataBuilder
from specdraft.batch import ScheduledBatch
from specdraft.block_table import BlockTables
from specdraft.config import CacheConfig, LimitsConfig, ModelConfig
from specdraft.cuda_graph import (
    BatchExecutionDescriptor,
    CudaGraphBackend,
    CudaGraphManager,
    CUDAGraphMode,
    SpeculatorCudaGraphManager,
    default_capture_sizes,
)
from specdraft.input_buffers import InputBuffers
from specdraft.kv_cache import KVCache
from specdraft.simple_draft import SimpleDraftModel

pytestmark = pytest.mark.no_overflow_check  # see conftest

D = BatchExecutionDescriptor
FULL = CUDAGraphMode.FULL


class EagerBackend(CudaGraphBackend):
    """Stands in for CUDA graphs on the CPU: 'capture' runs the callable and keeps it,
    'replay' runs it again on whatever the persistent buffers hold."""

    executes_on_capture = True

    def __init__(self):
        self.captures = 0

    def pool(self):
        return None

    def capture(self, fn, pool):
        self.captures += 1
        return fn, fn()

    def replay(self, graph):
        return graph()

    def synchronize(self):
        pass

    def free_memory(self):
        return None


def test_descriptor_set():
    m = CudaGraphManager(
        max_num_reqs=8, max_num_tokens=32, uniform_token_counts=(1, 4), backend=EagerBackend()
    )
    assert default_capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    uniform1 = {D(s, s, 1, 1) for s in (1, 2, 4, 8)}  # 16 decode tokens > 8 requests
    uniform4 = {D(s, s // 4, 4, 4) for s in (4, 8, 16, 24, 32)}
    mixed = {D(s, min(s, 8), None, s) for s in (1, 2, 4, 8, 16, 24, 32)}
    assert set(m.descriptors) == uniform1 | uniform4 | mixed
    sizes = [d.num_tokens for d in m.descriptors]
    assert sizes == sorted(sizes, reverse=True), "capture goes largest first"
    small = CudaGraphManager(
        max_num_reqs=4, max_num_tokens=16, capture_sizes=[3, 16, 64], backend=EagerBackend()
    )
    assert {d.num_tokens for d in small.descriptors} == {3, 16}, "sizes over the limit dropped"
    none = CudaGraphManager(max_num_reqs=4, max_num_tokens=16, cg_mode=CUDAGraphMode.NONE)
    assert none.descriptors == []


def _captured_manager(**kw):
    m = CudaGraphManager(
        max_num_reqs=8, max_num_tokens=32, uniform_token_counts=(1, 4), backend=EagerBackend(), **kw
    )
    m.capture(lambda desc, warmup: lambda mode: desc)
    return m


def test_dispatch_picks_the_smallest_fitting_descriptor():
    m = _captured_manager()
    rng = random.Random(0)
    for _ in range(400):
        r = rng.randint(1, 8)
        kind = rng.choice(["decode", "verify", "mixed"])
        if kind == "decode":
            t, u, mq = r, 1, 1
        elif kind == "verify":
            t, u, mq = 4 * r, 4, 4
        else:
            counts = [rng.randint(1, 6) for _ in range(r)]
            t, u, mq = sum(counts), None, max(counts)
        if t > 32:
            continue
        got = m.dispatch(r, t, uniform_token_count=u, max_query_len=mq)
        fitting = [d for d in m.captured if d.fits(r, t, u, mq)]
        assert got is not None and got in fitting
        assert got.num_tokens == min(d.num_tokens for d in fitting)
        if u is not None:
            assert got.uniform_token_count == u, "a uniform descriptor of the same size wins"
        assert m.replay(got) == got


def test_dispatch_errors_and_eager_fallback(caplog):
    m = CudaGraphManager(
        max_num_reqs=8, max_num_tokens=32, capture_sizes=[1, 2, 4], backend=EagerBackend()
    )
    with pytest.raises(RuntimeError, match="capture"):
        m.replay(D(4, 4, None, 4))
    m.capture(lambda desc, warmup: lambda mode: None)
    with pytest.raises(ValueError, match="max_num_reqs"):
        m.dispatch(9, 9)
    with pytest.raises(ValueError, match="max_num_tokens"):
        m.dispatch(2, 33)
    with pytest.raises(ValueError, match="uniform_token_count"):
        m.dispatch(2, 5, uniform_token_count=2)
    with caplog.at_level(logging.WARNING, logger="specdraft.cuda_graph"):
        assert m.dispatch(3, 20) is None
        assert m.dispatch(8, 30) is None
    assert sum("running eagerly" in r.message for r in caplog.records) == 1, "logged once"


def test_no_fallback_warning_when_graphs_are_off(caplog):
    """With graphs off (cg_mode NONE: a CPU run, --no-graphs) every step runs eagerly by
    design: dispatch says nothing (it once warned on every CPU `specdraft generate`)."""
    for kw in ({"cg_mode": CUDAGraphMode.NONE}, {"capture_sizes": []}):
        m = CudaGraphManager(max_num_reqs=8, max_num_tokens=32, backend=EagerBackend(), **kw)
        m.capture(lambda desc, warmup: lambda mode: None)
        with caplog.at_level(logging.WARNING, logger="specdraft.cuda_graph"):
            assert m.dispatch(1, 1) is None and m.dispatch(8, 30) is None
    assert not [r for r in caplog.records if "running eagerly" in r.message]


def test_factory_called_twice_per_descriptor_largest_first():
    calls = []

    def factory(desc, warmup):
        calls.append((desc, warmup))
        return lambda mode: calls.append(("run", desc, warmup, mode))

    m = CudaGraphManager(
        max_num_reqs=4, max_num_tokens=8, uniform_token_counts=(1, 2), backend=EagerBackend()
    )
    m.capture(factory)
    expected = []
    for d in m.descriptors:
        expected += [
            (d, True),
            ("run", d, True, CUDAGraphMode.NONE),
            (d, False),
            ("run", d, False, FULL),
        ]
    assert calls == expected
    assert m.backend.captures == len(m.descriptors)


def _speculator_setup(device, dp_size=1):
    limits = LimitsConfig(max_num_reqs=8, max_num_tokens=32, max_model_len=256)
    bt = BlockTables(8, limits.max_blocks_per_req(16), 16, 64, device)
    buffers = InputBuffers(limits, device)
    builder = MetadataBuilder(limits, buffers, bt)
    m = SpeculatorCudaGraphManager(
        max_num_reqs=8,
        max_num_tokens=32,
        dp_size=dp_size,
        uniform_token_counts=(1, 4),
        backend=EagerBackend(),
    )
    return limits, bt, buffers, builder, m


@pytest.mark.parametrize("order", ["largest_first", "shuffled"])
def test_speculator_passes_see_their_own_descriptor(device, order):
    limits, bt, buffers, builder, m = _speculator_setup(device, dp_size=2)
    prepared = []
    real_prepare = builder.prepare_inputs_to_capture

    def counting_prepare(num_reqs, num_tokens, max_query_len):
        prepared.append((num_reqs, num_tokens, max_query_len))
        return real_prepare(num_reqs, num_tokens, max_query_len)

    builder.prepare_inputs_to_capture = counting_prepare
    seen = []

    def forward_fn(num_reqs, num_tokens, meta, slot_mappings, dp, cg_mode):
        # Contents of the persistent buffers at the moment this pass runs.
        qsl = buffers.query_start_loc[: num_reqs + 1].tolist()
        counts = [b - a for a, b in zip(qsl, qsl[1:])]
        assert (meta.num_reqs, meta.num_tokens) == (num_reqs, num_tokens)
        assert qsl[0] == 0 and all(c >= 1 for c in counts) and qsl[-1] <= num_tokens
        assert max(counts) <= meta.max_query_len
        assert buffers.seq_lens[:num_reqs].tolist() == counts
        assert buffers.slot_mapping[:num_tokens].tolist() == [-1] * num_tokens
        assert slot_mappings.data_ptr() == buffers.slot_mapping.data_ptr()
        assert not bt.table[:num_reqs].any()
        assert dp.tolist() == [num_tokens, num_tokens] and dp.dtype == torch.int32
        seen.append((num_reqs, num_tokens, meta.max_query_len, cg_mode))

    descs = list(m.descriptors)
    if order == "shuffled":
        random.Random(1).shuffle(descs)
    m.capture(forward_fn, builder, descriptors=descs)
    expected = []
    for d in descs:
        r = d.num_reqs or min(d.num_tokens, 8)
        mq = d.max_query_len or d.uniform_token_count
        expected += [(r, d.num_tokens, mq, CUDAGraphMode.NONE), (r, d.num_tokens, mq, FULL)]
    assert seen == expected
    assert prepared == [(r, t, mq) for r, t, mq, _ in expected], "fresh inputs for each pass"


# ---- GPU: replay against eager ---------------------------------------------------------


class StaleMetadataSpeculator(SpeculatorCudaGraphManager):
    """The seed's bug: metadata prepared once and reused for every descriptor."""

    def capture(self, forward_fn, metadata_builder, progress_bar_desc="", descriptors=None):
        cache = {}

        class Once:
            def prepare_inputs_to_capture(self, *args):
                if "meta" not in cache:
                    cache["meta"] = metadata_builder.prepare_inputs_to_capture(*args)
                return cache["meta"]

        super().capture(forward_fn, Once(), progress_bar_desc, descriptors)


def _runtime(
    manager_cls,
    order_seed=None,
    device="cuda",
    backend=None,
    sizes=(1, 2, 4, 8, 16, 32, 64),
    layers=2,
):
    """A SimpleDraftModel step captured by `manager_cls`: bf16 on the GPU, or fp32 on the
    CPU with EagerBackend standing in for graphs (same closures, same buffers)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    limits = LimitsConfig(max_num_reqs=16, max_num_tokens=64, max_model_len=1024)
    cfg = ModelConfig(layers, 8, 2, 64, 256, 512, dtype=dtype)
    cache = KVCache(cfg, CacheConfig(16, num_blocks=16 * 64 + 1), device)
    cache.data.normal_()
    cache.data[:, :, 0].zero_()
    bt = BlockTables(16, limits.max_blocks_per_req(16), 16, cache.num_blocks, device)
    builder = MetadataBuilder(limits, InputBuffers(limits, device), bt)
    model = SimpleDraftModel(cfg, 16, device)
    m = manager_cls(
        max_num_reqs=16,
        max_num_tokens=64,
        uniform_token_counts=(1, 4),
        capture_sizes=list(sizes),
        backend=backend,
    )
    descs = list(m.descriptors)
    if order_seed is not None:
        random.Random(order_seed).shuffle(descs)
    m.capture(lambda r, t, meta, slots, dp, mode: model(meta, cache), builder, descriptors=descs)
    return limits, cache, bt, builder, model, m


def _random_batch(bt, rng, kind, step, max_ctx):
    r = rng.randint(1, 16)
    if kind == "verify":
        r = min(r, 16)
        counts = [4] * r
    elif kind == "decode":
        counts = [1] * r
    else:
        counts = [rng.randint(1, 8) for _ in range(r)]
        while sum(counts) > 64:
            counts.pop()
    reqs = []
    for i, c in enumerate(counts):
        start = rng.randint(0, max_ctx)
        rid = f"{step}-{i}"
        bt.add_request(rid, start + c)
        reqs.append((rid, [rng.randrange(512) for _ in range(c)], start))
    u = {"decode": 1, "verify": 4}.get(kind)
    return ScheduledBatch.from_requests(reqs), u, max(counts)


def _compare_replays(runtime, trials, rng, max_ctx=900) -> list[str]:
    """Run each batch eagerly and by replay from the same cache state; return the list
    of mismatches (empty when replay equals eager everywhere)."""
    limits, cache, bt, builder, model, m = runtime
    problems = []
    kinds = ["mixed", "verify", "decode"]
    for step in range(trials):
        # big batches first, so stale buffer contents exist for the small ones
        batch, u, mq = _random_batch(bt, rng, kinds[step % 3], step, max_ctx)
        r, t = batch.num_reqs, batch.num_tokens
        desc = m.dispatch(r, t, uniform_token_count=u, max_query_len=mq)
        assert desc is not None
        pad = dict(
            num_reqs_padded=desc.num_reqs or min(desc.num_tokens, 16),
            num_tokens_padded=desc.num_tokens,
            max_query_len=desc.max_query_len,
        )
        before = cache.data.clone()
        meta = builder.build(batch, **pad)
        tok_e, hid_e = (x.clone() for x in model(meta, cache))
        cache_e = cache.data.clone()
        cache.data.copy_(before)
        meta = builder.build(batch, **pad)
        tok_g, hid_g = m.replay(desc)
        m.backend.synchronize()
        if not torch.equal(tok_e[:r], tok_g[:r]):
            problems.append(f"step {step} {desc}: token ids differ")
        if not torch.equal(hid_e[:r], hid_g[:r]):
            problems.append(f"step {step} {desc}: hidden states differ")
        if not torch.equal(cache_e, cache.data):
            problems.append(f"step {step} {desc}: KV cache differs from eager")
        # padded slots untouched: every changed cache row is one of the real tokens' slots
        changed = (cache.data != before).any(dim=(-1, -2)).any(dim=(0, 1))  # [blocks, bs]
        real = meta.slot_mapping[:t]
        allowed = torch.zeros_like(changed).view(-1)
        allowed[real] = True
        if (changed.view(-1) & ~allowed).any():
            problems.append(f"step {step} {desc}: a padded slot was written")
        for rid in batch.req_ids:
            bt.remove_request(rid)
    return problems


@pytest.mark.gpu
@pytest.mark.parametrize("order_seed", [None, 5], ids=["largest_first", "shuffled"])
def test_gpu_replay_matches_eager(order_seed):
    runtime = _runtime(SpeculatorCudaGraphManager, order_seed)
    assert len(runtime[-1].captured) == len(runtime[-1].descriptors)
    assert _compare_replays(runtime, 24, random.Random(11)) == []


@pytest.mark.gpu
def test_gpu_stale_metadata_bug_is_caught():
    runtime = _runtime(StaleMetadataSpeculator)
    problems = _compare_replays(runtime, 24, random.Random(11))
    assert problems, "the comparison must catch metadata reused across descriptors"


@pytest.mark.gpu
def test_gpu_every_backend_captures_on_the_one_capture_stream():
    """Two backends (two managers) and the shared pool's keeper capture on
    capture_stream(), which waits for the caller's stream first; the caller's stream is
    restored after. A new stream per capture would slow every graph of the process."""
    from specdraft.cuda_graph import capture_stream, shared_graph_pool

    pool = shared_graph_pool()
    here = torch.cuda.current_stream()
    x = torch.randn(4096, device="cuda")
    x.mul_(2.0)  # pending on the caller's stream when the captures start
    seen = []

    def fn():
        seen.append(torch.cuda.current_stream())
        return x + 1

    graphs = [CudaGraphBackend().capture(fn, pool) for _ in range(2)]
    assert seen[0] == seen[1] == capture_stream() != here
    assert torch.cuda.current_stream() == here
    want = x + 1
    for graph, out in graphs:
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


@pytest.mark.interpreter
@pytest.mark.parametrize("manager_cls", [SpeculatorCudaGraphManager, StaleMetadataSpeculator])
def test_cpu_replay_semantics_catch_stale_metadata(manager_cls):
    """The same comparison on the CPU, with closures standing in for graphs: the manager
    passes, the stale-metadata variant fails."""
    runtime = _runtime(
        manager_cls, device="cpu", backend=EagerBackend(), sizes=(4, 16, 64), layers=1
    )
    problems = _compare_replays(runtime, 6, random.Random(11), max_ctx=40)
    if manager_cls is SpeculatorCudaGraphManager:
        assert problems == []
    else:
        assert problems
