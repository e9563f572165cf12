"""Persistent state of the draft round: the device buffers its kernels and graphs read,
the per-request bookkeeping on the host, and the pinned one-round-late readback of the
draft's committed lengths. The round itself is in specdraft/drafter.py."""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from specdraft.kernels.draft_round import SOURCE_FIELDS, DraftRoundBuffers

from .staging import CurrentStream, PinnedRing


class SamplingMode(enum.IntEnum):
    """How a round draws its tokens; the host picks it from the batch's parameters (a
    host-side promise baked into each graph, as `specdraft.sampling` describes).

    GREEDY: every row greedy: argmax, no q. SAMPLE: some row samples, none uses top-k /
    top-p (no sort over the vocabulary). FILTER: some row uses top-k or top-p. A graph of
    a later mode serves the batches of an earlier one with the same results."""

    GREEDY = 0
    SAMPLE = 1
    FILTER = 2


MODE_NAMES = {
    "greedy": SamplingMode.GREEDY,
    "sample": SamplingMode.SAMPLE,
    "filter": SamplingMode.FILTER,
}


def make_round_buffers(
    *,
    max_rows: int,
    width: int,
    k_cap: int,
    null_row: int,
    rows: torch.Tensor,
    table: torch.Tensor,
    device: torch.device,
) -> tuple[DraftRoundBuffers, torch.Tensor]:
    """All round buffers, the host-filled ones (width, slots, k, src) packed into one
    int64 tensor so that a round's host inputs travel in one copy. Returns (buffers,
    packed)."""

    def z(n: int, dtype=torch.int64) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype, device=device)

    packed = z(1 + 2 * max_rows + SOURCE_FIELDS)
    tokens = max_rows * width
    b = DraftRoundBuffers(
        width=packed[:1],
        slots=packed[1 : 1 + max_rows],
        k=packed[1 + max_rows : 1 + 2 * max_rows],
        src=packed[1 + 2 * max_rows :],
        verified=z(max_rows * width).view(max_rows, width),
        accepted=z(max_rows),
        base=z(null_row + 1, torch.int32),
        rows=rows,
        table=table,
        p_ids=z(tokens),
        p_pos=z(tokens),
        p_slot=z(tokens) - 1,
        p_src=z(tokens),
        p_qsl=z(max_rows + 1, torch.int32),
        p_seq=z(max_rows, torch.int32),
        p_last=z(max_rows),
        d_ids=z(max_rows),
        d_pos=z(max_rows),
        d_seq=z(max_rows, torch.int32),
        d_slot=z(max_rows) - 1,
        d_qsl=z(max_rows + 1, torch.int32),
        d_last=z(max_rows),
        param=z(max_rows) + null_row,
        cur_pos=z(max_rows),
        counters=z(2 + k_cap),
        tokens=z(max_rows * k_cap) - 1,
    )
    return b, packed


_NO_SOURCES = np.zeros(SOURCE_FIELDS, dtype=np.int64)


class HostStage:
    """Pinned staging of a round's host inputs [width, slots..., k..., src...] (int64),
    one non-blocking copy into the packed device tensor. The ring is deep (128 rounds)
    so that the host can run that many rounds ahead of the GPU before it waits for a
    staging buffer's copy to have run (128 x 8 x (13 + 2 max_num_reqs) bytes pinned)."""

    def __init__(self, packed: torch.Tensor, max_rows: int, depth: int = 128):
        self.packed, self.max_rows = packed, max_rows
        self.ring = PinnedRing(packed.numel(), torch.int64, packed.device, depth=depth)
        self._views = [b.numpy() for b in self.ring.buffers]
        # What the last upload put in `packed` (this is its only writer): a round of the
        # same batch with the same k uploads nothing.
        self._last: tuple | None = None
        self.skipped = 0

    def upload(
        self, width: int, slots: np.ndarray, k: np.ndarray, pad_to: int, src: np.ndarray | None
    ) -> None:
        """slots / k of the real rows; rows [len(slots), pad_to) become padding (-1);
        src: the SOURCE_FIELDS values of the round's input sources (None: every input in
        place)."""
        src = _NO_SOURCES if src is None else src
        key = (int(width), int(pad_to), slots.dtype, slots.tobytes(), k.dtype, k.tobytes(),
               src.tobytes())  # fmt: skip
        if key == self._last:
            self.skipped += 1
            return
        self._last = key
        i, buf = self.ring.acquire()
        host = self._views[i]
        m, n = self.max_rows, len(slots)
        host[0] = width
        host[1 : 1 + n] = slots
        host[1 + n : 1 + pad_to] = -1
        host[1 + m : 1 + m + n] = k
        host[1 + m + n : 1 + m + pad_to] = 0
        host[1 + 2 * m :] = src
        self.ring.copy_to(i, self.packed, self.packed.numel())


@dataclass
class _Pending:
    event: torch.cuda.Event | None
    host: torch.Tensor
    slots: np.ndarray
    after: np.ndarray  # [n, 3] (lower, upper, generation) of the rows right after launch


class LengthBook:
    """What the host knows of each slot's draft KV length L without waiting for the GPU.

    The device holds the exact L (advanced by num_accepted + 1 inside each round). The
    host keeps bounds: a round adds between 1 and W_in tokens, so lower += 1 and
    upper += W_in at launch; after a round the new lengths of its rows are copied into
    pinned memory, and once that copy has completed (`poll`, which only queries an
    event, never waits) the bounds of those rows collapse onto the exact value plus
    whatever later rounds have added since. KV blocks are allocated to the upper bound.
    At most `depth` readbacks are in flight: a host further ahead skips them."""

    def __init__(self, num_slots: int, max_rows: int, device: torch.device, depth: int = 2):
        # per slot: lower bound, upper bound, generation (bumped when the slot changes
        # hands, so that a late readback of the previous request is ignored)
        self.state = np.zeros((num_slots, 3), dtype=np.int64)
        pin = device.type == "cuda"
        # (pinned buffer, reusable event) pairs not in flight
        self._free = deque(
            (
                torch.zeros(max_rows, dtype=torch.int32, pin_memory=pin),
                torch.cuda.Event() if pin else None,
            )
            for _ in range(depth)
        )
        self._pending: deque[_Pending] = deque()
        self._cuda = pin
        self._stream = CurrentStream(device) if pin else None
        self.skipped = 0  # rounds without a readback (host far ahead; bounds stay safe)
        self.applied = 0

    @property
    def lower(self) -> np.ndarray:
        return self.state[:, 0]

    @property
    def upper(self) -> np.ndarray:
        return self.state[:, 1]

    def set_exact(self, slot: int, length: int) -> None:
        self.state[slot] = (length, length, self.state[slot, 2] + 1)

    def launched(self, slots: np.ndarray, width: int, new_lengths: torch.Tensor) -> None:
        """A round over `slots` has been enqueued; new_lengths (device int32, one entry
        per batch row, as many as the readback buffers) will hold their exact lengths
        once it has run."""
        after = self.state[slots]
        after[:, 0] += 1
        after[:, 1] += width
        self.state[slots] = after
        if not self._free:
            # Every readback buffer is in flight: the host is rounds ahead of the GPU.
            # Skip this one (its rows keep looser, still safe, bounds) rather than wait.
            self.skipped += 1
            return
        host, event = self._free.popleft()
        host.copy_(new_lengths, non_blocking=self._cuda)  # whole buffer: no slicing
        if event is not None:
            event.record(self._stream())
        self._pending.append(_Pending(event, host, slots, after))

    def poll(self) -> None:
        """Apply every readback whose copy has completed (non-blocking)."""
        while self._pending:
            p = self._pending[0]
            if p.event is not None and not p.event.query():
                return
            self._pending.popleft()
            exact = p.host.numpy()[: len(p.slots)].astype(np.int64)
            # new bound = exact + what later rounds added = bound + (exact - bound at launch)
            adj = exact[:, None] - p.after[:, :2]
            stale = self.state[p.slots, 2] != p.after[:, 2]  # the slot changed hands since
            if stale.any():
                adj[stale] = 0
            self.state[p.slots, :2] += adj  # slots of one round are distinct
            self._free.append((p.host, p.event))
            self.applied += 1
