"""Persistent device inputs of a step, allocated once at the limits and never rebound.

All host-filled inputs live in one packed int64 device tensor (the int32 ones in a tail
region viewed as int32), so a step's inputs travel in one asynchronous host-to-device
copy from a pinned staging ring. CUDA graphs hold the addresses of the views below."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .config import LimitsConfig, check_device
from .staging import PinnedRing


@dataclass
class HostStaging:
    """numpy views of one pinned staging buffer, laid out like the device tensor."""

    slot: int
    input_ids: np.ndarray
    positions: np.ndarray
    last_token_idx: np.ndarray
    row_slots: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray


class InputBuffers:
    """input_ids, positions (int64, [max_num_tokens]); last_token_idx (int64, the index of
    each request's last token, where its logits are read) and row_slots (int64, each
    request's row in the block tables), [max_num_reqs]; query_start_loc (int32,
    [max_num_reqs + 1]) and seq_lens (int32, [max_num_reqs]); slot_mapping (int64,
    [max_num_tokens]), computed on the device."""

    def __init__(self, limits: LimitsConfig, device: torch.device | str):
        if not isinstance(limits, LimitsConfig):
            raise TypeError(f"limits must be a LimitsConfig, got {type(limits).__name__}")
        self.device = check_device(device)
        t, r = limits.max_num_tokens, limits.max_num_reqs
        n32 = (r + 1) + r
        words32 = -(-n32 // 2)
        self._offsets = {
            "input_ids": (0, t),
            "positions": (t, 2 * t),
            "last_token_idx": (2 * t, 2 * t + r),
            "row_slots": (2 * t + r, 2 * t + 2 * r),
        }
        self._i32_start = 2 * t + 2 * r
        total = self._i32_start + words32
        self._packed = torch.zeros(total, dtype=torch.int64, device=self.device)
        views = {k: self._packed[a:b] for k, (a, b) in self._offsets.items()}
        self.input_ids = views["input_ids"]
        self.positions = views["positions"]
        self.last_token_idx = views["last_token_idx"]
        self.row_slots = views["row_slots"]
        i32 = self._packed[self._i32_start :].view(torch.int32)
        self.query_start_loc = i32[: r + 1]
        self.seq_lens = i32[r + 1 : 2 * r + 1]
        self.slot_mapping = torch.full((t,), -1, dtype=torch.int64, device=self.device)
        self._ring = PinnedRing(total, torch.int64, self.device)
        self.max_num_tokens, self.max_num_reqs = t, r
        # numpy views of each staging buffer, made once (they cost more than the writes)
        self._staging = [self._host_views(i, b) for i, b in enumerate(self._ring.buffers)]

    def stage(self) -> HostStaging:
        """A staging buffer free for writing, as numpy views in the device layout."""
        slot, _ = self._ring.acquire()
        return self._staging[slot]

    def _host_views(self, slot: int, host: torch.Tensor) -> HostStaging:
        arr = host.numpy()
        i32 = host[self._i32_start :].view(torch.int32).numpy()
        r = self.max_num_reqs
        return HostStaging(
            slot,
            *(arr[a:b] for a, b in self._offsets.values()),
            query_start_loc=i32[: r + 1],
            seq_lens=i32[r + 1 : 2 * r + 1],
        )

    def upload(self, staging: HostStaging) -> None:
        """One non-blocking copy of the whole staging buffer into the device tensor."""
        self._ring.copy_to(staging.slot, self._packed, self._packed.numel())

    @property
    def ring_waits(self) -> int:
        """Times the host waited for a staging buffer's previous copy (expected 0)."""
        return self._ring.waits
