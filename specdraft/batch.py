"""The scheduler's view of one step: which requests run and with which new tokens."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from specdraft.kernels import as_int


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
        """From (req_id, new token ids, start position) triples. Token ids and start
        positions must be integers (numpy integers too): a float is refused here rather
        than truncated. The values themselves are checked by MetadataBuilder.build."""
        if isinstance(requests, str | bytes) or not isinstance(requests, Sequence):
            raise TypeError(
                "requests must be a sequence of (req_id, token ids, start position) triples, "
                f"got {type(requests).__name__}"
            )
        ids, tokens = [], []
        counts = np.empty(len(requests), dtype=np.int64)
        starts = np.empty(len(requests), dtype=np.int64)
        for i, r in enumerate(requests):
            if not isinstance(r, tuple | list) or len(r) != 3:
                raise ValueError(
                    f"requests[{i}] must be a (req_id, token ids, start position) triple, got "
                    f"{r!r:.80}"
                )
            toks = np.asarray(r[1])
            if toks.ndim != 1:
                raise ValueError(f"requests[{i}] token ids must be 1-D, got shape {toks.shape}")
            if toks.dtype != np.int64:
                if toks.size and toks.dtype.kind not in "iu":
                    raise TypeError(
                        f"requests[{i}] token ids must be integers, got dtype {toks.dtype}"
                    )
                toks = toks.astype(np.int64)
            start = r[2]
            if type(start) is not int:
                start = as_int(f"requests[{i}] start position", start)
            ids.append(r[0])
            tokens.append(toks)
            counts[i] = toks.shape[0]
            starts[i] = start
        token_ids = np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.int64)
        return cls(ids, token_ids, counts, starts)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])
