"""Pinned host staging for host-to-device copies that never make the host wait.

A step writes its host data into a staging buffer and issues one non-blocking copy. The
buffer must not be rewritten until that copy has run, so buffers rotate in a ring, each
guarded by a CUDA event recorded after its copy; by the time a buffer comes round again
its copy has long finished and `event.query()` says so without blocking. Only if the
host laps the device by the whole ring does it wait."""

from __future__ import annotations

import torch

from .config import _check_int, check_device


class PinnedRing:
    """`depth` host buffers of `numel` elements of `dtype`, pinned when CUDA is present."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, depth: int = 4):
        numel = _check_int("numel", numel, 0)
        depth = _check_int("depth", depth, 1)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__} {dtype!r}")
        self.device = check_device(device)
        pin = self.device.type == "cuda"
        self._bufs = [torch.empty(numel, dtype=dtype, pin_memory=pin) for _ in range(depth)]
        # One reusable event per buffer, recorded after each of its copies.
        self._events = [torch.cuda.Event() if pin else None for _ in range(depth)]
        self._pending = [False] * depth  # an event recorded and not yet seen complete
        self._next = 0
        self._stream = CurrentStream(self.device) if pin else None
        self.waits = 0  # times the host had to wait for a copy: expected to stay 0

    @property
    def buffers(self) -> list[torch.Tensor]:
        return list(self._bufs)

    def acquire(self) -> tuple[int, torch.Tensor]:
        """A buffer free for writing, and its slot for `copy_to`."""
        slot = self._next
        self._next = (slot + 1) % len(self._bufs)
        if self._pending[slot]:
            ev = self._events[slot]
            if not ev.query():
                self.waits += 1
                ev.synchronize()
            self._pending[slot] = False
        return slot, self._bufs[slot]

    def copy_to(self, slot: int, dst: torch.Tensor, n: int) -> None:
        """Copy the first n elements of buffer `slot` into dst[:n], asynchronously."""
        # Plain int comparisons first: this runs on every step.
        if type(slot) is not int:
            slot = _check_int("slot", slot, 0)
        if type(n) is not int:
            n = _check_int("n", n, 0)
        if not 0 <= slot < len(self._bufs):
            raise ValueError(f"slot must be in [0, {len(self._bufs)}), got {slot}")
        if not isinstance(dst, torch.Tensor):
            raise TypeError(f"dst must be a tensor, got {type(dst).__name__}")
        src = self._bufs[slot]
        if not 0 <= n <= src.numel() or n > dst.numel():
            raise ValueError(
                f"n = {n} elements must be in [0, {min(src.numel(), dst.numel())}]: the "
                f"staging buffer holds {src.numel()}, dst {dst.numel()}"
            )
        if n == 0:
            return
        if n != src.numel():
            src = src[:n]
        if n != dst.numel():
            dst = dst[:n]
        dst.copy_(src, non_blocking=True)
        ev = self._events[slot]
        if ev is not None:
            ev.record(self._stream())
            self._pending[slot] = True


class CurrentStream:
    """`stream()` is torch.cuda.current_stream(device), which builds a Stream object on
    every call (microseconds on a per-step path; Event.record() without a stream calls
    it too): the last one is kept while the raw stream stays the same."""

    def __init__(self, device: torch.device):
        index = device.index
        self._index = torch.cuda.current_device() if index is None else index
        self._device = device
        self._stream: torch.cuda.Stream | None = None
        self._raw = None

    def __call__(self) -> torch.cuda.Stream:
        raw = _raw_stream(self._index)
        if raw is None or raw != self._raw:
            self._stream = torch.cuda.current_stream(self._device)
            self._raw = raw
        return self._stream


def _raw_stream(device_index: int) -> int | None:
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Triton's launcher reads
    return None if get is None else get(device_index)
