"""The scheduler's view of one step: which requests run and with which new tokens."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class ScheduledBatch:
    """Requests of one step, in batch order.

    req_ids[i] runs num_new_tokens[i] tokens starting at position start_positions[i] (the
    number of its tokens already in the KV cache); token_ids holds all new tokens,
    request after request."""

    req_ids: Sequence[Hashable]
    token_ids: np.ndarray  # int64 [sum(num_new_tokens)]
    num_new_tokens: np.ndarray  # int64 [num_reqs]
    start_positions: np.ndarray  # int64 [num_reqs]

    @classmethod
    def from_requests(
        cls, requests: Sequence[tuple[Hashable, Sequence[int], int]]
    ) -> ScheduledBatch:
        """From (req_id, new token ids, start position) triples."""
        ids = [r[0] for r in requests]
        counts = np.fromiter((len(r[1]) for r in requests), dtype=np.int64, count=len(requests))
        starts = np.fromiter((r[2] for r in requests), dtype=np.int64, count=len(requests))
        tokens = (
            np.concatenate([np.asarray(r[1], dtype=np.int64) for r in requests])
            if requests
            else np.zeros(0, dtype=np.int64)
        )
        return cls(ids, tokens, counts, starts)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])
