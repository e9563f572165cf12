"""Runtime core: configs, KV cache, input buffers, metadata from real batches and for
capture, and the attention layer end to end against a PyTorch reference."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specdraft.attention import PagedAttention
from specdraft.attn_metadata import MetadataBuilder
from specdraft.batch import ScheduledBatch
from specdraft.block_table import BlockTables
from specdraft.config import CacheConfig, LimitsConfig, ModelConfig
from specdraft.input_buffers import InputBuffers
from specdraft.kv_cache import KVCache, num_blocks_for_budget

pytestmark = pytest.mark.no_overflow_check  # see conftest

BS = 16


def make_runtime(device, *, max_num_reqs=8, max_num_tokens=64, max_model_len=256, blocks=80):
    limits = LimitsConfig(max_num_reqs, max_num_tokens, max_model_len)
    bt = BlockTables(max_num_reqs, limits.max_blocks_per_req(BS), BS, blocks, device)
    buffers = InputBuffers(limits, device)
    return limits, bt, buffers, MetadataBuilder(limits, buffers, bt)


def random_batch(bt: BlockTables, rng: random.Random, n: int, max_q: int, max_ctx: int):
    """n new requests with random context already cached and random new tokens."""
    reqs = []
    for _ in range(n):
        rid = f"r{rng.randrange(10**9)}"
        start, count = rng.randint(0, max_ctx), rng.randint(1, max_q)
        bt.add_request(rid, start + count)
        reqs.append((rid, [rng.randrange(1000) for _ in range(count)], start))
    return ScheduledBatch.from_requests(reqs)


def expected_slots(bt: BlockTables, batch: ScheduledBatch, tp: int) -> list[int]:
    slots = []
    for rid, n, start in zip(batch.req_ids, batch.num_new_tokens, batch.start_positions):
        blocks = bt.blocks_of(rid)
        slots += [blocks[p // BS] * BS + p % BS for p in range(start, start + n)]
    return slots + [-1] * (tp - len(slots))


def check_buffers(meta, batch: ScheduledBatch, bt: BlockTables) -> None:
    """Every element the kernels will read, against values computed here in Python."""
    r, rp, t, tp = batch.num_reqs, meta.num_reqs, batch.num_tokens, meta.num_tokens
    counts = [int(c) for c in batch.num_new_tokens]
    starts = [int(s) for s in batch.start_positions]
    qsl = np.concatenate([[0], np.cumsum(counts)]).tolist() + [t] * (rp - r)
    assert meta.query_start_loc.tolist() == qsl
    assert meta.seq_lens.tolist() == [s + c for s, c in zip(starts, counts)] + [0] * (rp - r)
    assert meta.input_ids.tolist() == batch.token_ids.tolist() + [0] * (tp - t)
    pos = [s + j for s, c in zip(starts, counts) for j in range(c)]
    assert meta.positions.tolist() == pos + [0] * (tp - t)
    assert meta.last_token_idx[:r].tolist() == [q - 1 for q in qsl[1 : r + 1]]
    # a decode descriptor: request i's token is row i (select_logits takes rows as they are)
    assert meta.last_is_row == (meta.max_query_len == 1 and tp == rp)
    if meta.last_is_row:
        assert meta.last_token_idx[:r].tolist() == list(range(r))
    table = meta.block_table.cpu()
    for i, rid in enumerate(batch.req_ids):
        blocks = bt.blocks_of(rid)
        assert table[i, : len(blocks)].tolist() == blocks
        assert not table[i, len(blocks) :].any()
    assert not table[r:rp].any(), "padded requests must see only the null block"
    assert meta.slot_mapping.tolist() == expected_slots(bt, batch, tp)
    assert (meta.num_real_reqs, meta.num_real_tokens) == (r, t)


def test_build_from_real_batches_for_several_descriptors(device):
    rng = random.Random(3)
    limits, bt, buffers, builder = make_runtime(device)
    batch = random_batch(bt, rng, 5, 6, 100)
    r, t = batch.num_reqs, batch.num_tokens
    descriptors = [(8, 64), (8, 40), (6, max(t, 24)), (r, t), (5, t + 1)]
    order = descriptors + rng.sample(descriptors, len(descriptors))
    for rp, tp in order:
        meta = builder.build(batch, num_reqs_padded=rp, num_tokens_padded=tp)
        assert (meta.num_reqs, meta.num_tokens) == (rp, tp)
        check_buffers(meta, batch, bt)


def test_capture_inputs_then_real_batch(device):
    rng = random.Random(4)
    limits, bt, buffers, builder = make_runtime(device)
    batch = random_batch(bt, rng, 3, 5, 60)
    for num_reqs, num_tokens, mq in [(8, 64, 8), (4, 32, 8), (8, 8, 1), (2, 9, 3), (1, 1, 1)]:
        meta = builder.prepare_inputs_to_capture(num_reqs, num_tokens, mq)
        qsl = meta.query_start_loc.tolist()
        counts = [b - a for a, b in zip(qsl, qsl[1:])]
        assert len(counts) == num_reqs and all(1 <= c <= mq for c in counts)
        assert sum(counts) <= num_tokens and qsl == sorted(qsl)
        assert meta.seq_lens.tolist() == counts
        assert not meta.block_table.any(), "capture tables point at the null block"
        assert meta.slot_mapping.tolist() == [-1] * num_tokens
        pos = [j for c in counts for j in range(c)]
        assert meta.positions.tolist() == pos + [0] * (num_tokens - len(pos))
        assert (meta.num_reqs, meta.num_tokens, meta.max_query_len) == (num_reqs, num_tokens, mq)
        # a real batch afterwards sees none of the dummy contents
        real = builder.build(batch, num_reqs_padded=8, num_tokens_padded=64)
        check_buffers(real, batch, bt)


def test_removed_requests_do_not_leak(device):
    rng = random.Random(5)
    limits, bt, buffers, builder = make_runtime(device)
    first = random_batch(bt, rng, 4, 3, 150)
    builder.build(first, num_reqs_padded=8, num_tokens_padded=32)
    for rid in first.req_ids:
        bt.remove_request(rid)
    second = random_batch(bt, rng, 2, 3, 20)  # reuses the freed row slots
    meta = builder.build(second, num_reqs_padded=8, num_tokens_padded=32)
    check_buffers(meta, second, bt)
    assert (
        not bt.rows[: limits.max_num_reqs]
        .cpu()[
            [
                i
                for i in range(limits.max_num_reqs)
                if i not in {bt.row_of(x) for x in second.req_ids}
            ]
        ]
        .any()
    )


class History:
    """Contiguous K/V per request, kept beside the paged cache as the reference."""

    def __init__(self):
        self.k: dict = {}
        self.v: dict = {}

    def append(self, rid, k, v):
        self.k[rid] = torch.cat([self.k[rid], k]) if rid in self.k else k
        self.v[rid] = torch.cat([self.v[rid], v]) if rid in self.v else v

    def attend(self, rid, q, scale):
        """Causal attention of q (the request's last q.shape[0] tokens), float64."""
        k = self.k[rid].double().repeat_interleave(q.shape[1] // self.k[rid].shape[1], 1)
        v = self.v[rid].double().repeat_interleave(q.shape[1] // self.v[rid].shape[1], 1)
        n, total = q.shape[0], k.shape[0]
        s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
        mask = torch.arange(total)[None, :] > torch.arange(total - n, total)[:, None]
        p = torch.softmax(s.masked_fill(mask.to(s.device), float("-inf")), -1)
        return torch.einsum("hqk,khd->qhd", p, v)


def run_layer_steps(device, dtype, hq, hkv, d, limits_kw, steps, tol, rng):
    """Prefill then mixed steps through PagedAttention, every output checked against
    the contiguous history; requests join, grow and finish between steps."""
    limits = LimitsConfig(**limits_kw)
    model = ModelConfig(1, hq, hkv, d, hq * d, 100, dtype=dtype)
    cache = KVCache(model, CacheConfig(BS, num_blocks=limits_kw["max_num_reqs"] * 40), device)
    bt = BlockTables(
        limits.max_num_reqs, limits.max_blocks_per_req(BS), BS, cache.num_blocks, device
    )
    buffers = InputBuffers(limits, device)
    builder = MetadataBuilder(limits, buffers, bt)
    layer = PagedAttention(hq, hkv, d)
    hist, lens = History(), {}
    for step in range(steps):
        # finish one request now and then, add new ones while there is room
        if lens and step % 3 == 2:
            gone = rng.choice(sorted(lens))
            bt.remove_request(gone)
            del lens[gone]
        while not lens or (len(lens) < limits.max_num_reqs - 1 and rng.random() < 0.7):
            rid = f"s{step}-{len(lens)}"
            bt.add_request(rid, 1)
            lens[rid] = 0
        reqs = []
        for rid in sorted(lens):
            n = rng.randint(20, 40) if lens[rid] == 0 else rng.choice([1, 1, 2, 5])
            assert bt.grow(rid, lens[rid] + n)
            reqs.append((rid, [0] * n, lens[rid]))
        batch = ScheduledBatch.from_requests(reqs)
        tp = batch.num_tokens + rng.randint(0, 3)
        meta = builder.build(batch, num_reqs_padded=limits.max_num_reqs, num_tokens_padded=tp)
        q = torch.randn(tp, hq, d, device=device).to(dtype)
        k = torch.randn(tp, hkv, d, device=device).to(dtype)
        v = torch.randn(tp, hkv, d, device=device).to(dtype)
        out = layer(q, k, v, cache.layer(0), meta, out=torch.full_like(q, float("nan")))
        assert not torch.isnan(out).any()
        assert not out[batch.num_tokens :].any(), "padded tokens must give zeros"
        start = 0
        for rid, toks, _ in reqs:
            n = len(toks)
            hist.append(rid, k[start : start + n], v[start : start + n])
            ref = hist.attend(rid, q[start : start + n], layer.scale)
            got = out[start : start + n].double()
            err = (got - ref).norm() / ref.norm()
            assert err < tol, f"step {step} request {rid}: relative error {err:.2e}"
            lens[rid] += n
            start += n


def test_attention_layer_end_to_end(device):
    run_layer_steps(
        device,
        torch.float32,
        4,
        2,
        64,
        dict(max_num_reqs=4, max_num_tokens=160, max_model_len=256),
        5,
        2e-5,
        random.Random(6),
    )


@pytest.mark.gpu
def test_gpu_attention_layer_end_to_end_bf16():
    run_layer_steps(
        "cuda",
        torch.bfloat16,
        32,
        8,
        128,
        dict(max_num_reqs=64, max_num_tokens=4096, max_model_len=4096),
        8,
        1.6e-2,
        random.Random(7),
    )


# ---- configs and the cache ----------------------------------------------------------


@pytest.mark.parametrize(
    "make, exc, words",
    [
        (lambda: ModelConfig(2, 6, 4, 64, 384, 100), ValueError, "multiple of num_kv_heads"),
        (lambda: ModelConfig(2, 4, 4, 512, 384, 100), ValueError, "head_dim"),
        (lambda: ModelConfig(0, 4, 4, 64, 384, 100), ValueError, "num_layers"),
        (lambda: ModelConfig(2, 4, 4, 64, 384, 100, dtype=torch.int8), TypeError, "dtype"),
        (lambda: CacheConfig(24, num_blocks=10), ValueError, "block_size"),
        (lambda: CacheConfig(16), ValueError, "exactly one"),
        (lambda: CacheConfig(16, num_blocks=10, gpu_memory_fraction=0.5), ValueError, "exactly"),
        (lambda: CacheConfig(16, gpu_memory_fraction=1.5), ValueError, "gpu_memory_fraction"),
        (lambda: LimitsConfig(8, 4, 100), ValueError, "max_num_tokens"),
        (lambda: LimitsConfig(8, 64, 2.5), TypeError, "max_model_len"),
    ],
)
def test_config_errors(make, exc, words):
    with pytest.raises(exc, match=words):
        make()


def test_kv_cache_layout_and_budget(device):
    model = ModelConfig(3, 4, 2, 64, 256, 100, dtype=torch.float16)
    cache = KVCache(model, CacheConfig(16, num_blocks=10), device)
    k, v = cache.layer(2)
    assert k.shape == v.shape == (10, 16, 2, 64) and k.dtype == torch.float16
    assert not cache.data[:, :, 0].any(), "the null block starts at zero"
    k[3].fill_(1.0)
    assert cache.data[2, 0, 3].eq(1.0).all()
    per_block = 16 * model.kv_bytes_per_token  # 16 * 2 * 3 * 2 * 64 * 2 bytes
    assert per_block == 16 * 1536
    assert (
        num_blocks_for_budget(model, CacheConfig(16, gpu_memory_fraction=0.5), 10 * per_block) == 5
    )
    with pytest.raises(ValueError, match="at least 2"):
        num_blocks_for_budget(model, CacheConfig(16, gpu_memory_fraction=0.1), per_block)
    with pytest.raises(ValueError, match="layer index"):
        cache.layer(3)


# ---- bad batches: a clear error and nothing changed ---------------------------------


def _snapshot(buffers: InputBuffers, bt: BlockTables):
    return (
        buffers._packed.clone(),
        buffers.slot_mapping.clone(),
        bt.table.clone(),
        bt.rows.clone(),
        bt.host_rows.copy(),
        bt.num_free_blocks,
        len(bt),
    )


def _same(a, b):
    return all(
        (torch.equal(x, y) if isinstance(x, torch.Tensor) else np.array_equal(x, y))
        for x, y in zip(a, b)
    )


@pytest.mark.parametrize(
    "mutate, words",
    [
        (lambda reqs, bt: reqs.append(("new", [1], 0)), "unknown req_id"),
        (lambda reqs, bt: reqs.append(reqs[0]), "appears twice"),
        (lambda reqs, bt: reqs.__setitem__(0, (reqs[0][0], [], 3)), "must be >= 1"),
        (lambda reqs, bt: reqs.__setitem__(0, (reqs[0][0], [1], -2)), "must be >= 0"),
        (lambda reqs, bt: reqs.__setitem__(0, (reqs[0][0], [1], 300)), "max_model_len"),
        (lambda reqs, bt: reqs.__setitem__(0, (reqs[0][0], [1] * 3, 40)), "grow it first"),
        (lambda reqs, bt: reqs.__setitem__(0, (reqs[0][0], [1] * 70, 0)), "max_num_tokens"),
    ],
)
def test_bad_batches(device, mutate, words):
    limits, bt, buffers, builder = make_runtime(device)
    reqs = [(f"a{i}", [5, 6], 10) for i in range(3)]
    for rid, toks, start in reqs:
        bt.add_request(rid, start + len(toks))
    builder.build(ScheduledBatch.from_requests(reqs), num_reqs_padded=8, num_tokens_padded=16)
    bt.add_request("big", 250)
    bt.commit()
    before = _snapshot(buffers, bt)
    mutate(reqs, bt)
    with pytest.raises(ValueError, match=words):
        builder.build(ScheduledBatch.from_requests(reqs), num_reqs_padded=8, num_tokens_padded=16)
    assert _same(before, _snapshot(buffers, bt))


def test_too_many_requests_and_bad_padding(device):
    limits, bt, buffers, builder = make_runtime(device, max_num_reqs=2)
    for i in range(2):
        bt.add_request(i, 4)
    ok = ScheduledBatch.from_requests([(0, [1, 2], 0), (1, [3], 0)])
    before = _snapshot(buffers, bt)
    cases = [
        (dict(num_reqs_padded=1), "num_reqs_padded"),
        (dict(num_reqs_padded=3), "num_reqs_padded"),
        (dict(num_tokens_padded=2), "num_tokens_padded"),
        (dict(num_tokens_padded=65), "num_tokens_padded"),
        (dict(max_query_len=1), "max_query_len"),
    ]
    for kw, words in cases:
        with pytest.raises(ValueError, match=words):
            builder.build(ok, **kw)
    with pytest.raises(ValueError, match="max_num_reqs"):
        builder.build(ScheduledBatch.from_requests([(0, [1], 0), (1, [1], 0), (2, [1], 0)]))
    with pytest.raises(ValueError, match="num_tokens"):
        builder.prepare_inputs_to_capture(2, 1, 1)
    assert _same(before, _snapshot(buffers, bt))


def test_block_tables_must_fit_the_cache(device):
    limits = LimitsConfig(4, 16, 64)
    model = ModelConfig(1, 2, 2, 16, 32, 10, dtype=torch.float32)
    cache = KVCache(model, CacheConfig(16, num_blocks=8), device)
    buffers = InputBuffers(limits, device)
    too_many = BlockTables(4, 4, 16, 9, device)  # would hand out block id 8
    with pytest.raises(ValueError, match="KV cache has 8 blocks"):
        MetadataBuilder(limits, buffers, too_many, kv_cache=cache)
    other_size = BlockTables(4, 2, 32, 8, device)
    with pytest.raises(ValueError, match="block_size"):
        MetadataBuilder(limits, buffers, other_size, kv_cache=cache)
    MetadataBuilder(limits, buffers, BlockTables(4, 4, 16, 8, device), kv_cache=cache)
