"""Block tables of a paged KV cache: which KV blocks each request owns.

Two layers. `BlockAllocator` is pure bookkeeping over block ids. `BlockTables` keeps one
row of block ids per request in a persistent device tensor `rows`, indexed by a "row
slot" that a request holds for its lifetime, so a request's row is written once when
it arrives and one entry per new block as it grows, never per step. Each step gathers
the rows of its batch, in batch order, into the persistent `table` the kernels read.

The host owns the truth (a numpy mirror of `rows`); changes queue as (entry, value)
writes and `commit()` pushes them all with one non-blocking host-to-device copy and one
scatter, so the host never waits for the device (docs/architecture.md, invariant 5).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Sequence

import numpy as np
import torch

from specdraft import kernels
from specdraft.config import _check_int, check_device
from specdraft.staging import PinnedRing

# Staging entries allocated up front; the buffers double on demand up to the worst case
# (every entry of every row), which at 256 requests x 2048 blocks would pin 4 x 8 MiB.
_INITIAL_STAGE_ENTRIES = 1024


def _check_hashable(req_id: object) -> None:
    try:
        hash(req_id)
    except TypeError:
        raise TypeError(
            f"req_id must be hashable, got {type(req_id).__name__} {req_id!r:.80}"
        ) from None


class OutOfBlocksError(RuntimeError):
    """The allocator has fewer free blocks than asked for; nothing was allocated."""


class BlockAllocator:
    """Hands out KV block ids from a free list. Ids [0, num_reserved) are never handed
    out: block 0 is the null block that padded block-table entries point to."""

    def __init__(self, num_blocks: int, num_reserved: int = 1):
        num_reserved = _check_int("num_reserved", num_reserved, 0)
        num_blocks = _check_int("num_blocks", num_blocks, num_reserved + 1)
        self.num_blocks = num_blocks
        self.num_reserved = num_reserved
        self._free: deque[int] = deque(range(num_reserved, num_blocks))
        self._is_free = [False] * num_reserved + [True] * (num_blocks - num_reserved)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n block ids, all or none."""
        n = _check_int("n", n, 0)
        if n > len(self._free):
            raise OutOfBlocksError(
                f"cannot allocate n={n} blocks: num_free={len(self._free)} "
                f"(of {self.num_blocks - self.num_reserved} allocatable)"
            )
        ids = [self._free.popleft() for _ in range(n)]
        for i in ids:
            self._is_free[i] = False
        return ids

    def free(self, ids: Iterable[int]) -> None:
        """Return blocks to the free list. Every id is checked before any is freed, so a
        bad id leaves the allocator as it was."""
        ids = list(ids)
        seen: set[int] = set()
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
                raise TypeError(f"block id must be an int, got {type(i).__name__} {i!r}")
            if not self.num_reserved <= i < self.num_blocks:
                raise ValueError(
                    f"block id {i} is reserved or out of range: allocatable ids are "
                    f"[{self.num_reserved}, {self.num_blocks})"
                )
            if self._is_free[i] or i in seen:
                raise ValueError(f"block id {i} is already free (double free)")
            seen.add(i)
        for i in ids:
            self._is_free[i] = True
            self._free.append(int(i))


class BlockTables:
    """Per-request block tables, on the host and in persistent device tensors.

    `rows` [max_num_reqs + 1, max_blocks_per_req] int32: row r belongs to the request
    holding row slot r; entries past its blocks are 0. The last row (`null_row`) stays
    all zeros for padded batch positions to gather.
    `table` [max_num_reqs, max_blocks_per_req] int32: the step's block table in batch
    order, filled by `gather`. Neither tensor is ever rebound: graphs hold their addresses.

    Every ValueError / TypeError leaves all state, host and device, unchanged.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_blocks_per_req: int,
        block_size: int,
        num_blocks: int,
        device: str | torch.device,
    ):
        max_num_reqs = _check_int("max_num_reqs", max_num_reqs, 1)
        max_blocks_per_req = _check_int("max_blocks_per_req", max_blocks_per_req, 1)
        block_size = _check_int("block_size", block_size, 1)
        num_blocks = _check_int("num_blocks", num_blocks, 2, 2**31 - 1)  # block ids are int32
        device = check_device(device)
        self.max_num_reqs = max_num_reqs
        self.max_blocks_per_req = max_blocks_per_req
        self.block_size = block_size
        self.max_tokens_per_req = max_blocks_per_req * block_size
        self.null_row = max_num_reqs
        self.allocator = BlockAllocator(num_blocks, num_reserved=1)

        shape = (max_num_reqs + 1, max_blocks_per_req)
        self.rows = torch.zeros(shape, dtype=torch.int32, device=device)
        self.table = torch.zeros(shape[0] - 1, shape[1], dtype=torch.int32, device=device)
        self.device = self.rows.device
        self._host = np.zeros(shape, dtype=np.int32)
        self._reqs: dict[Hashable, tuple[int, list[int]]] = {}
        # Flat mirrors for per-step lookups of a whole batch without a Python loop.
        self._slot_of: dict[Hashable, int] = {}
        self._blocks_in_row = np.zeros(max_num_reqs + 1, dtype=np.int64)
        self._free_rows: deque[int] = deque(range(max_num_reqs))
        self._pending: dict[int, int] = {}  # flat index into rows -> value; last write wins

        # The null row is never written, so at most this many distinct entries are pending.
        self._max_stage_entries = max_num_reqs * max_blocks_per_req
        self._stage_entries = 0
        self._reserve_stage(min(_INITIAL_STAGE_ENTRIES, self._max_stage_entries))

    # ---- queries ---------------------------------------------------------------------

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._reqs

    def __len__(self) -> int:
        return len(self._reqs)

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def num_pending(self) -> int:
        """Entry writes queued for the next commit."""
        return len(self._pending)

    @property
    def host_rows(self) -> np.ndarray:
        """Read-only view of the host mirror of `rows` (what `rows` holds after commit)."""
        view = self._host.view()
        view.flags.writeable = False
        return view

    def blocks_of(self, req_id: Hashable) -> list[int]:
        return list(self._lookup(req_id)[1])

    def num_blocks_of(self, req_id: Hashable) -> int:
        """Blocks the request holds (no copy of the list, for per-step checks)."""
        return len(self._lookup(req_id)[1])

    def capacity_of(self, req_id: Hashable) -> int:
        """Tokens the request's blocks cover."""
        return len(self._lookup(req_id)[1]) * self.block_size

    def row_of(self, req_id: Hashable) -> int:
        return self._lookup(req_id)[0]

    def rows_of(self, req_ids: Sequence[Hashable]) -> tuple[np.ndarray, np.ndarray]:
        """Row slots and block counts of a batch of requests, as int64 arrays; a
        ValueError names the first unknown id. One C-level pass over the ids."""
        try:
            rows = np.fromiter(
                map(self._slot_of.__getitem__, req_ids), dtype=np.int64, count=len(req_ids)
            )
        except KeyError:
            unknown = next(r for r in req_ids if r not in self._slot_of)
            raise ValueError(f"unknown req_id {unknown!r} ({len(self)} requests held)") from None
        except TypeError:  # not a sequence, or an unhashable id
            if not isinstance(req_ids, Sequence):
                raise TypeError(
                    f"req_ids must be a sequence of request ids, got {type(req_ids).__name__}"
                ) from None
            for r in req_ids:
                _check_hashable(r)
            raise
        return rows, self._blocks_in_row[rows]

    # ---- changes ---------------------------------------------------------------------

    def add_request(self, req_id: Hashable, num_tokens: int) -> int:
        """Give a new request blocks for num_tokens tokens and a row slot; returns the slot.

        Raises OutOfBlocksError, with nothing changed, when the blocks are not there."""
        _check_hashable(req_id)
        if req_id in self._reqs:
            raise ValueError(f"req_id {req_id!r} is already present ({len(self)} requests)")
        need = self._blocks_needed(num_tokens)
        if not self._free_rows:
            raise ValueError(
                f"no free row slot for req_id {req_id!r}: {len(self)} requests held, "
                f"max_num_reqs is {self.max_num_reqs}"
            )
        blocks = self.allocator.allocate(need)  # raises before anything has changed
        slot = self._free_rows.popleft()
        self._reqs[req_id] = (slot, blocks)
        self._slot_of[req_id] = slot
        self._blocks_in_row[slot] = len(blocks)
        self._write(slot, 0, blocks)
        return slot

    def grow(self, req_id: Hashable, num_tokens: int) -> bool:
        """Make the request's blocks cover num_tokens tokens (never shrinks them).

        False, with nothing allocated, when the allocator is short: the caller preempts."""
        slot, blocks = self._lookup(req_id)
        need = self._blocks_needed(num_tokens) - len(blocks)
        if need <= 0:
            return True
        if not self.allocator.can_allocate(need):
            return False
        new = self.allocator.allocate(need)
        self._write(slot, len(blocks), new)
        blocks.extend(new)
        self._blocks_in_row[slot] = len(blocks)
        return True

    def remove_request(self, req_id: Hashable) -> None:
        """Free the request's blocks and row slot, and zero its row so that the next
        request in that slot cannot read stale block ids past its own."""
        slot, blocks = self._lookup(req_id)
        self.allocator.free(blocks)
        del self._reqs[req_id]
        del self._slot_of[req_id]
        self._blocks_in_row[slot] = 0
        self._write(slot, 0, [0] * len(blocks))  # entries past len(blocks) are already 0
        self._free_rows.append(slot)

    # ---- device ----------------------------------------------------------------------

    def commit(self) -> None:
        """Push the queued entry writes to `rows`: one non-blocking host-to-device copy of
        [indices..., values...] and one index_copy_, with no host-device synchronization."""
        n = len(self._pending)
        if n == 0:
            return
        self._reserve_stage(n)
        slot, buf = self._ring.acquire()
        host = buf.numpy()
        host[:n] = np.fromiter(self._pending.keys(), dtype=np.int64, count=n)
        host[n : 2 * n] = np.fromiter(self._pending.values(), dtype=np.int64, count=n)
        self._ring.copy_to(slot, self._dev_stage, 2 * n)
        self._dev_vals[:n].copy_(self._dev_stage[n : 2 * n])  # int64 -> int32, no alloc
        # Indices are distinct (coalesced), so index_copy_ is deterministic.
        self.rows.view(-1).index_copy_(0, self._dev_stage[:n], self._dev_vals[:n])
        self._pending.clear()

    def gather(self, row_slots: torch.Tensor) -> None:
        """table[:n] = rows[row_slots] on the device: row_slots is a device int64 tensor of
        n <= max_num_reqs row slots in batch order, `null_row` at padded positions. Only
        metadata is checked (reading the values would synchronize). Commit first."""
        if not isinstance(row_slots, torch.Tensor) or row_slots.dtype != torch.int64:
            got = getattr(row_slots, "dtype", type(row_slots).__name__)
            raise TypeError(f"row_slots must be an int64 tensor, got {got}")
        if row_slots.dim() != 1 or row_slots.numel() > self.max_num_reqs:
            raise ValueError(
                f"row_slots must be 1-D with at most max_num_reqs={self.max_num_reqs} "
                f"entries, got shape {tuple(row_slots.shape)}"
            )
        if row_slots.device != self.device:
            raise ValueError(f"row_slots is on {row_slots.device}, rows on {self.device}")
        n = row_slots.numel()
        if n and kernels.validation_enabled(row_slots):
            # A host read, so only where validation is on (CPU tensors by default): on the
            # CPU an index past `rows` fails inside index_select, on CUDA it is a device
            # assert that ends the process.
            lo, hi = int(row_slots.min()), int(row_slots.max())
            if lo < 0 or hi > self.null_row:
                raise ValueError(
                    f"row_slots holds {lo if lo < 0 else hi}, outside [0, {self.null_row}] "
                    f"(row slots, and null_row {self.null_row} for padding)"
                )
        torch.index_select(self.rows, 0, row_slots, out=self.table[:n])

    # ---- internals -------------------------------------------------------------------

    def _lookup(self, req_id: Hashable) -> tuple[int, list[int]]:
        try:
            return self._reqs[req_id]
        except TypeError:
            _check_hashable(req_id)
            raise
        except KeyError:
            raise ValueError(f"unknown req_id {req_id!r} ({len(self)} requests held)") from None

    def _blocks_needed(self, num_tokens: int) -> int:
        num_tokens = _check_int("num_tokens", num_tokens, 1)
        if num_tokens > self.max_tokens_per_req:
            raise ValueError(
                f"num_tokens {num_tokens} is over the max_model_len capacity "
                f"{self.max_tokens_per_req} (max_blocks_per_req {self.max_blocks_per_req} "
                f"x block_size {self.block_size})"
            )
        return -(-num_tokens // self.block_size)

    def _write(self, slot: int, start: int, values: list[int]) -> None:
        """Set entries [start, start + len(values)) of row `slot`, host and pending."""
        self._host[slot, start : start + len(values)] = values
        base = slot * self.max_blocks_per_req + start
        for j, v in enumerate(values):
            self._pending[base + j] = v

    def _reserve_stage(self, entries: int) -> None:
        """Staging for `entries` (index, value) pairs, doubling the buffers when short.
        Replacing them mid-flight is safe: the pinned host allocator keeps a buffer until
        its copy's event completes, and the device allocator orders reuse on the stream."""
        if entries <= self._stage_entries:
            return
        cap = min(max(entries, 2 * self._stage_entries), self._max_stage_entries)
        self._ring = PinnedRing(2 * cap, torch.int64, self.device)
        self._dev_stage = torch.empty(2 * cap, dtype=torch.int64, device=self.device)
        self._dev_vals = torch.empty(cap, dtype=torch.int32, device=self.device)
        self._stage_entries = cap
