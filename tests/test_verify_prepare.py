"""The verification step's inputs in one launch (kernels.verify_prepare) against the
torch ops it replaces, on a real TargetRunner's buffers, and its bad-input errors."""

from __future__ import annotations

import pytest
import torch

from specdraft import kernels, ops
from specdraft.models.tiny import random_causal_lm, tiny_config
from specdraft.runner import TargetRunner


def _runner(device):
    model = random_causal_lm(tiny_config(), seed=0, dtype=torch.float32).to(device)
    runner = TargetRunner(
        model, max_num_reqs=6, max_num_tokens=64, max_model_len=128, num_blocks=49
    )
    runner._verify_buffers(5)
    return runner


def _outputs(runner, rp, w):
    buf, t = runner.buffers, rp * w
    return [x.clone() for x in (
        buf.input_ids[:t], buf.positions[:t], buf.seq_lens[:rp], buf.query_start_loc[: rp + 1],
        buf.row_slots[:rp], buf.last_token_idx[:rp], buf.slot_mapping[:t],
        runner.tables.table[:rp],
    )]  # fmt: skip


def _poison(runner):
    buf = runner.buffers
    for x in (buf.input_ids, buf.positions, buf.seq_lens, buf.query_start_loc, buf.row_slots,
              buf.last_token_idx, buf.slot_mapping, runner.tables.table):  # fmt: skip
        x.fill_(-77)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_verify_prepare_equals_the_torch_ops(device, k):
    """Fresh requests of random committed lengths (their blocks spread over the cache),
    -1 drafts mid-row, a padded request on the null row: every buffer the verify step
    reads equals the torch path's, after both start from poison."""
    runner = _runner(device)
    g = torch.Generator().manual_seed(k)
    tables, w = runner.tables, k + 1
    lens = torch.randint(1, 40, (4,), generator=g).tolist()
    for rid, n in enumerate(lens):
        tables.add_request(rid, n + w)
    rows = [tables.row_of(rid) for rid in range(4)] + [tables.null_row]
    rp = len(rows)
    runner.verify_rows[:rp].copy_(torch.tensor(rows))
    for rid, n in enumerate(lens):
        runner.committed[rows[rid]] = n
    runner.verify_first[:rp].copy_(torch.randint(0, 100, (rp,), generator=g))
    drafts = torch.randint(0, 100, (rp, 5), generator=g)
    drafts[1, k // 2 :] = -1
    runner.verify_drafts[:rp].copy_(drafts)
    tables.commit()
    got = []
    for backend in ("triton", "torch"):
        _poison(runner)
        with ops.use_backend(backend):
            runner._verify_inputs(rp, w)
        got.append(_outputs(runner, rp, w))
    names = ["input_ids", "positions", "seq_lens", "query_start_loc", "row_slots",
             "last_token_idx", "slot_mapping", "step table"]  # fmt: skip
    for name, a, b in zip(names, *got):
        assert torch.equal(a, b), (name, a, b)
    slots = got[0][6].view(rp, w)
    # the padded request writes nothing; a -1 draft's row writes its K/V (finite values
    # where the request's real rows load them)
    assert bool((slots[-1] == -1).all()) and bool((slots[:-1] >= 0).all())


def test_verify_prepare_bad_inputs(device):
    """A TypeError / ValueError naming the argument; nothing written."""
    runner = _runner(device)
    buf, tables = runner.buffers, runner.tables
    args = dict(rows=runner.verify_rows, committed=runner.committed, first=runner.verify_first,
                drafts=runner.verify_drafts, table_rows=tables.rows, step_table=tables.table,
                input_ids=buf.input_ids, positions=buf.positions, seq_lens=buf.seq_lens,
                query_start_loc=buf.query_start_loc, row_slots=buf.row_slots,
                last_token_idx=buf.last_token_idx, slot_mapping=buf.slot_mapping)  # fmt: skip
    _poison(runner)
    snap = _outputs(runner, 2, 4)

    def call(num_reqs=2, w=4, block_size=tables.block_size, **kw):
        a = dict(args, **kw)
        kernels.verify_prepare(
            num_reqs, w, a["rows"], a["committed"], a["first"], a["drafts"], a["table_rows"],
            a["step_table"], block_size, tables.null_row, a["input_ids"], a["positions"],
            a["seq_lens"], a["query_start_loc"], a["row_slots"], a["last_token_idx"],
            a["slot_mapping"],
        )  # fmt: skip

    bad = [
        (TypeError, "rows", dict(rows=runner.verify_rows.int())),
        (TypeError, "seq_lens", dict(seq_lens=buf.seq_lens.long())),
        (ValueError, "drafts", dict(drafts=runner.verify_drafts[:, :2])),
        (ValueError, "slot_mapping", dict(slot_mapping=buf.slot_mapping[:7])),
        (ValueError, "step_table", dict(step_table=tables.table[:, :1])),
        (TypeError, "w", dict(w=4.0)),
        (ValueError, "block_size", dict(block_size=3)),
    ]
    for exc, name, kw in bad:
        with pytest.raises(exc, match=name):
            call(**kw)
        for a, b in zip(snap, _outputs(runner, 2, 4)):
            assert torch.equal(a, b), name
