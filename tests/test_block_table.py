"""Block tables: random add / grow / remove sequences against a model, commit making the
device rows equal the host mirror, gather in batch order, and every error leaving all
state as it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from specdraft.block_table import BlockAllocator, BlockTables, OutOfBlocksError


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def snapshot(bt: BlockTables) -> tuple:
    """Everything observable: host mirror, device rows after commit, free count, requests."""
    bt.commit()
    reqs = {r: (bt.row_of(r), bt.blocks_of(r)) for r in list(bt._reqs)}
    return bt.host_rows.copy(), bt.rows.cpu().clone(), bt.num_free_blocks, len(bt), reqs


def assert_same(before: tuple, after: tuple) -> None:
    assert np.array_equal(before[0], after[0])
    assert torch.equal(before[1], after[1])
    assert before[2:] == after[2:]


def assert_device_matches_host(bt: BlockTables) -> None:
    assert bt.num_pending == 0
    assert np.array_equal(bt.rows.cpu().numpy(), bt.host_rows)


class BlockTableMachine(RuleBasedStateMachine):
    """Random operations on a small BlockTables, with a model of what each should do."""

    def __init__(self, device: str):
        super().__init__()
        self.device = device

    @initialize(
        max_num_reqs=st.integers(1, 4),
        max_blocks=st.integers(1, 5),
        block_size=st.sampled_from([1, 2, 4, 16]),
        num_blocks=st.integers(2, 12),
    )
    def setup(self, max_num_reqs, max_blocks, block_size, num_blocks):
        self.bt = BlockTables(max_num_reqs, max_blocks, block_size, num_blocks, self.device)
        self.num_blocks = num_blocks
        self.capacity = max_blocks * block_size
        self.model: dict[int, int] = {}  # req_id -> number of blocks
        self.ptrs = (self.bt.rows.data_ptr(), self.bt.table.data_ptr())

    def expect_unchanged(self, exc: type[Exception], match: str, fn, *args) -> None:
        before = snapshot(self.bt)
        with pytest.raises(exc, match=match):
            fn(*args)
        assert_same(before, snapshot(self.bt))

    @rule(req=st.integers(0, 5), num_tokens=st.integers(1, 90))
    def add(self, req, num_tokens):
        bt = self.bt
        need = cdiv(num_tokens, bt.block_size)
        if req in self.model:
            self.expect_unchanged(ValueError, "already present", bt.add_request, req, num_tokens)
        elif num_tokens > self.capacity:
            self.expect_unchanged(ValueError, "max_model_len", bt.add_request, req, num_tokens)
        elif len(self.model) == bt.max_num_reqs:
            self.expect_unchanged(ValueError, "max_num_reqs", bt.add_request, req, num_tokens)
        elif need > bt.num_free_blocks:
            self.expect_unchanged(OutOfBlocksError, f"n={need}", bt.add_request, req, num_tokens)
        else:
            used = {bt.row_of(r) for r in self.model}
            slot = bt.add_request(req, num_tokens)
            assert 0 <= slot < bt.max_num_reqs and slot not in used
            assert len(bt.blocks_of(req)) == need
            self.model[req] = need

    @precondition(lambda self: self.model)
    @rule(data=st.data(), num_tokens=st.integers(1, 90))
    def grow(self, data, num_tokens):
        bt = self.bt
        req = data.draw(st.sampled_from(sorted(self.model)))
        need = cdiv(num_tokens, bt.block_size)
        old = bt.blocks_of(req)
        if num_tokens > self.capacity:
            self.expect_unchanged(ValueError, "max_model_len", bt.grow, req, num_tokens)
            return
        free = bt.num_free_blocks
        ok = bt.grow(req, num_tokens)
        assert ok == (need - len(old) <= free)
        new = bt.blocks_of(req)
        if ok:
            assert new[: len(old)] == old and len(new) == max(need, len(old))
            self.model[req] = len(new)
        else:
            assert new == old and bt.num_free_blocks == free

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def remove(self, data):
        req = data.draw(st.sampled_from(sorted(self.model)))
        self.bt.remove_request(req)
        del self.model[req]
        assert req not in self.bt

    @rule(req=st.integers(6, 8), num_tokens=st.integers(1, 8))
    def unknown(self, req, num_tokens):
        self.expect_unchanged(ValueError, "unknown req_id", self.bt.grow, req, num_tokens)
        self.expect_unchanged(ValueError, "unknown req_id", self.bt.remove_request, req)

    @rule()
    def commit(self):
        self.bt.commit()
        assert_device_matches_host(self.bt)

    @invariant()
    def consistent(self):
        if not hasattr(self, "bt"):
            return
        bt = self.bt
        owned = [b for r in self.model for b in bt.blocks_of(r)]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert 0 not in owned, "the null block was handed out"
        assert all(0 < b < self.num_blocks for b in owned)
        assert len(owned) + bt.num_free_blocks == self.num_blocks - 1, "a block leaked"
        assert len(bt) == len(self.model)
        host = bt.host_rows
        expected = np.zeros_like(host)
        for r, n in self.model.items():
            blocks = bt.blocks_of(r)
            assert len(blocks) == n
            expected[bt.row_of(r), :n] = blocks
        assert np.array_equal(host, expected), "host mirror is not blocks followed by zeros"
        assert (bt.rows.data_ptr(), bt.table.data_ptr()) == self.ptrs, "a tensor was rebound"

    def teardown(self):
        if not hasattr(self, "bt"):
            return
        for r in list(self.model):
            self.bt.remove_request(r)
        assert self.bt.num_free_blocks == self.num_blocks - 1
        assert len(self.bt) == 0
        self.bt.commit()
        assert_device_matches_host(self.bt)
        assert not self.bt.rows.any(), "a removed request left block ids on the device"


def test_random_operations(device):
    run_state_machine_as_test(
        lambda: BlockTableMachine(device),
        settings=settings(max_examples=60, stateful_step_count=30, deadline=None),
    )


# ---- explicit cases ----------------------------------------------------------------------


def make(device, max_num_reqs=4, max_blocks=6, block_size=4, num_blocks=16) -> BlockTables:
    return BlockTables(max_num_reqs, max_blocks, block_size, num_blocks, device)


def test_commit_writes_rows_and_zeroes_removed(device):
    bt = make(device)
    s0 = bt.add_request("a", 9)  # 3 blocks
    s1 = bt.add_request("b", 4)  # 1 block
    assert bt.blocks_of("a") == [1, 2, 3] and bt.blocks_of("b") == [4]
    assert bt.num_pending == 4
    bt.commit()
    assert bt.rows[s0].tolist() == [1, 2, 3, 0, 0, 0]
    assert bt.rows[s1].tolist() == [4, 0, 0, 0, 0, 0]
    assert bt.grow("b", 10) and bt.blocks_of("b") == [4, 5, 6]
    bt.remove_request("a")
    s2 = bt.add_request("c", 2)  # takes a free row slot; rows of "a" were zeroed
    bt.commit()
    assert_device_matches_host(bt)
    assert bt.rows[s1].tolist() == [4, 5, 6, 0, 0, 0]
    assert bt.rows[s2, 1:].tolist() == [0] * 5 and bt.rows[s2, 0].item() == bt.blocks_of("c")[0]
    assert not bt.rows[s0].any() or s0 == s2
    assert not bt.rows[bt.null_row].any()


def test_reused_slot_shows_no_stale_blocks(device):
    bt = make(device, max_num_reqs=1)
    slot = bt.add_request("long", 24)  # 6 blocks: the whole row
    bt.commit()
    bt.remove_request("long")
    assert bt.add_request("short", 3) == slot  # same slot, 1 block, in the same commit
    bt.commit()
    assert bt.rows[slot].tolist() == [bt.blocks_of("short")[0], 0, 0, 0, 0, 0]


def test_commit_with_nothing_pending_does_nothing(device):
    bt = make(device)
    bt.add_request("a", 5)
    bt.commit()
    bt.rows[bt.row_of("a"), 5] = 99  # a write no commit should touch
    bt.commit()
    assert bt.rows[bt.row_of("a")].tolist() == [1, 2, 0, 0, 0, 99]


def test_commit_grows_its_staging(device):
    # 8 x 200 entries > the 1024 staged up front: the buffers must grow.
    bt = BlockTables(8, 200, 1, 1601, device)
    for r in range(8):
        bt.add_request(r, 200)
    assert bt.num_pending == 1600
    bt.commit()
    assert_device_matches_host(bt)
    assert bt.rows[:8].flatten().sort().values.tolist() == list(range(1, 1601))


def test_gather_batch_order_and_padding(device):
    bt = make(device, max_num_reqs=5)
    for r, n in (("a", 9), ("b", 4), ("c", 24)):
        bt.add_request(r, n)
    bt.commit()
    bt.table.fill_(-7)  # poison: every gathered row must be written, the rest left alone
    ptr = bt.table.data_ptr()
    order = [bt.row_of("c"), bt.row_of("a"), bt.null_row, bt.row_of("b")]
    bt.gather(torch.tensor(order, dtype=torch.int64, device=device))
    assert bt.table.data_ptr() == ptr
    assert bt.table[0].tolist() == [5, 6, 7, 8, 9, 10]
    assert bt.table[1].tolist() == [1, 2, 3, 0, 0, 0]
    assert bt.table[2].tolist() == [0] * 6  # padded position: the null row
    assert bt.table[3].tolist() == [4, 0, 0, 0, 0, 0]
    assert bt.table[4].tolist() == [-7] * 6  # past n: untouched
    bt.gather(torch.tensor([bt.null_row] * 2, dtype=torch.int64, device=device))
    assert not bt.table[:2].any() and bt.table[3].tolist() == [4, 0, 0, 0, 0, 0]


def test_gather_rejects_bad_row_slots(device):
    bt = make(device)
    with pytest.raises(TypeError, match="int64"):
        bt.gather(torch.zeros(2, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="max_num_reqs=4"):
        bt.gather(torch.zeros(5, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="1-D"):
        bt.gather(torch.zeros(2, 2, dtype=torch.int64, device=device))


ERROR_CASES = [
    # (name, call, exception, message fragment)
    ("duplicate", lambda bt: bt.add_request("a", 1), ValueError, r"req_id 'a' is already"),
    ("zero tokens", lambda bt: bt.add_request("x", 0), ValueError, "num_tokens must be >= 1"),
    ("over capacity", lambda bt: bt.add_request("x", 25), ValueError, "25 .*max_model_len.*24"),
    ("grow over", lambda bt: bt.grow("a", 25), ValueError, "25 .*max_model_len.*24"),
    ("grow unknown", lambda bt: bt.grow("zz", 2), ValueError, "unknown req_id 'zz'"),
    ("remove unknown", lambda bt: bt.remove_request("zz"), ValueError, "unknown req_id 'zz'"),
    ("row_of unknown", lambda bt: bt.row_of("zz"), ValueError, "unknown req_id 'zz'"),
]


@pytest.mark.parametrize(
    "call, exc, match", [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES]
)
def test_errors_leave_state_unchanged(device, call, exc, match):
    bt = make(device)
    bt.add_request("a", 9)
    bt.add_request("b", 1)
    bt.remove_request("b")  # pending zeros, flushed by the snapshot
    before = snapshot(bt)
    with pytest.raises(exc, match=match):
        call(bt)
    assert bt.num_pending == 0
    assert_same(before, snapshot(bt))


def test_no_free_row_slot(device):
    bt = make(device, max_num_reqs=2)
    bt.add_request(0, 1)
    bt.add_request(1, 1)
    before = snapshot(bt)
    with pytest.raises(ValueError, match="2 requests held, max_num_reqs is 2"):
        bt.add_request(2, 1)
    assert_same(before, snapshot(bt))
    assert 2 not in bt


def test_add_out_of_blocks(device):
    bt = make(device, num_blocks=8)  # 7 allocatable
    bt.add_request("a", 20)  # 5 blocks
    before = snapshot(bt)
    with pytest.raises(OutOfBlocksError, match="n=3 .*num_free=2"):
        bt.add_request("b", 9)
    assert_same(before, snapshot(bt))
    assert "b" not in bt
    assert bt.add_request("b", 8) == 1  # 2 blocks still fit; the slot was not leaked


def test_grow_fails_when_out_of_blocks_then_succeeds(device):
    bt = make(device, num_blocks=8)  # 7 allocatable
    bt.add_request("a", 4)  # 1 block
    bt.add_request("b", 20)  # 5 blocks
    before = snapshot(bt)
    assert bt.grow("a", 12) is False  # needs 2 more, 1 free
    assert_same(before, snapshot(bt))
    assert bt.grow("a", 8) is True  # 1 more fits
    assert bt.grow("a", 5) is True and len(bt.blocks_of("a")) == 2  # covered: no-op
    assert bt.num_free_blocks == 0 and bt.grow("a", 12) is False
    bt.remove_request("b")
    assert bt.grow("a", 12) is True
    assert bt.blocks_of("a")[:2] == [1, 7] and len(bt.blocks_of("a")) == 3
    bt.commit()
    assert bt.rows[bt.row_of("a")].tolist() == bt.blocks_of("a") + [0, 0, 0]


def test_allocator_errors_free_nothing():
    a = BlockAllocator(6)  # ids 1..5
    assert a.num_free == 5 and a.can_allocate(5) and not a.can_allocate(6)
    ids = a.allocate(3)
    assert ids == [1, 2, 3] and a.num_free == 2
    bad_frees = [
        ([1, 0], "block id 0 is reserved"),
        ([2, 6], "block id 6 .*range"),
        ([1, 4], "block id 4 is already free"),
        ([2, 2], "block id 2 .*double"),
    ]
    for bad, match in bad_frees:
        with pytest.raises(ValueError, match=match):
            a.free(bad)
        assert a.num_free == 2, f"free({bad}) freed something"
    with pytest.raises(OutOfBlocksError, match="n=3 .*num_free=2"):
        a.allocate(3)
    assert a.num_free == 2
    a.free(ids)
    assert a.num_free == 5 and sorted(a.allocate(5)) == [1, 2, 3, 4, 5]
    assert a.allocate(0) == [] and not a.can_allocate(1)


@pytest.mark.gpu
def test_commit_and_gather_never_synchronize():
    bt = BlockTables(16, 64, 16, 1025, "cuda")
    slots = torch.arange(16, dtype=torch.int64, device="cuda")
    bt.add_request(-1, 1)
    bt.commit()  # first use: CUDA context, pinned allocator
    bt.remove_request(-1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(50):
            for r in range(16):
                if r in bt and step % (r + 2) == 0:
                    bt.remove_request(r)
                elif r in bt:
                    bt.grow(r, 16 * (step % 64) + 1)
                else:
                    bt.add_request(r, 1 + (7 * r + step) % 1024)
            bt.commit()
            bt.gather(slots)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert_device_matches_host(bt)
    assert torch.equal(bt.table.cpu(), bt.rows[:16].cpu())
