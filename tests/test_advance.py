"""MetadataBuilder.advance: the next decode step of an unchanged batch computed on the
device equals building that step from the host, on both kernel paths."""

from __future__ import annotations

import pytest
import torch

from specdraft import ops
from specdraft.attn_metadata import MetadataBuilder
from specdraft.batch import ScheduledBatch
from specdraft.block_table import BlockTables
from specdraft.config import LimitsConfig
from specdraft.input_buffers import InputBuffers


def _runtime(device):
    limits = LimitsConfig(max_num_reqs=6, max_num_tokens=32, max_model_len=128)
    tables = BlockTables(6, limits.max_blocks_per_req(16), 16, 60, device)
    return tables, MetadataBuilder(limits, InputBuffers(limits, device), tables)


def _state(builder, meta):
    b = builder.buffers
    return [
        b.positions[: meta.num_tokens].clone(),
        b.seq_lens[: meta.num_reqs].clone(),
        b.slot_mapping[: meta.num_tokens].clone(),
        builder.block_tables.table[: meta.num_reqs].clone(),
    ]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("pad", [0, 2])
def test_advance_equals_fresh_build(device, backend, pad):
    lens = {"a": 14, "b": 31, "c": 1, "d": 47}  # a and b cross a block boundary below
    with ops.use_backend(backend):
        t1, b1 = _runtime(device)
        t2, b2 = _runtime(device)
        for tables in (t1, t2):
            for rid, n in lens.items():
                tables.add_request(rid, n + 1)

        def batch(step):
            return ScheduledBatch.from_requests(
                [(rid, [-1 - i], n + step) for i, (rid, n) in enumerate(lens.items())]
            )

        kw = dict(num_reqs_padded=4 + pad, num_tokens_padded=4 + pad)
        meta = b1.build(batch(0), **kw)
        for step in range(1, 6):
            for tables in (t1, t2):
                for rid, n in lens.items():
                    assert tables.grow(rid, n + step + 1)
            got = b1.advance()
            want = b2.build(batch(step), **kw)
            assert (got.num_reqs, got.num_tokens) == (want.num_reqs, want.num_tokens)
            for x, y in zip(_state(b1, got), _state(b2, want)):
                assert torch.equal(x, y)
        assert meta.num_reqs == 4 + pad


def test_advance_needs_a_build():
    _, builder = _runtime("cpu")
    with pytest.raises(RuntimeError, match="build"):
        builder.advance()
