"""Pinned host staging for host-to-device copies that never make the host wait.

A step writes its host data into a staging buffer and issues one non-blocking copy. The
buffer must not be rewritten until that copy has run, so buffers rotate in a ring, each
guarded by a CUDA event recorded after its copy; by the time a buffer comes round again
its copy has long finished and `event.query()` says so without blocking. Only if the
host laps the device by the whole ring does it wait."""

from __future__ import annotations

import torch


class PinnedRing:
    """`depth` host buffers of `numel` elements of `dtype`, pinned when CUDA is present."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, depth: int = 4):
        self.device = torch.device(device)
        pin = self.device.type == "cuda"
        self._bufs = [torch.empty(numel, dtype=dtype, pin_memory=pin) for _ in range(depth)]
        self._events: list[torch.cuda.Event | None] = [None] * depth
        self._next = 0
        self.waits = 0  # times the host had to wait for a copy: expected to stay 0

    def acquire(self) -> tuple[int, torch.Tensor]:
        """A buffer free for writing, and its slot for `copy_to`."""
        slot = self._next
        self._next = (slot + 1) % len(self._bufs)
        ev = self._events[slot]
        if ev is not None and not ev.query():
            self.waits += 1
            ev.synchronize()
        return slot, self._bufs[slot]

    def copy_to(self, slot: int, dst: torch.Tensor, n: int) -> None:
        """Copy the first n elements of buffer `slot` into dst[:n], asynchronously."""
        if n == 0:
            return
        dst[:n].copy_(self._bufs[slot][:n], non_blocking=True)
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            self._events[slot] = ev
