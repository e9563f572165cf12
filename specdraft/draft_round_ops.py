"""The draft round's prepare / advance / epilogue on whichever path the tensors allow.

CUDA tensors (and CPU tensors under the Triton interpreter) run the Triton kernels of
`specdraft.kernels.draft_round`; other CPU tensors run the PyTorch implementation below,
which computes the same values with fixed-shape tensor ops (no host read, no
data-dependent shape, so it can be captured too). `specdraft.ops.use_backend` forces a
path as it does for every other kernel call.
"""

from __future__ import annotations

import numpy as np
import torch

from specdraft import torch_ops
from specdraft.kernels.draft_round import (
    SOURCE_FIELDS,
    ArgmaxParts,
    DraftRoundBuffers,
    DraftRoundKernels,
    check_argmax_parts,
    check_hidden_buffer,
    round_sources_shape,
)
from specdraft.ops import backend_for


class TorchDraftRound:
    """The kernels' math in PyTorch (see kernels/draft_round.py for the contract)."""

    # prepare copies the tensors sources() kept, as Python objects: a CUDA graph would
    # replay the copies of its capture, so the Drafter runs these rounds without one
    reads_sources_in_graph = False

    def __init__(
        self,
        buffers: DraftRoundBuffers,
        *,
        max_rows: int,
        width: int,
        k_cap: int,
        block_size: int,
        vocab_size: int,
        null_row: int,
        hidden: torch.Tensor | None = None,
    ):
        check_hidden_buffer(hidden, max_rows * width, buffers.slots.device)
        self.b, self.hidden, self._src = buffers, hidden, None
        self.max_rows, self.width, self.k_cap = max_rows, width, k_cap
        self.block_size, self.vocab_size, self.null_row = block_size, vocab_size, null_row
        self.max_blocks = buffers.rows.shape[1]

    def _slot_of(self, src_row: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor):
        """Cache slots of positions pos [r, n] of rows src_row [r]; -1 writes nothing."""
        bs, mb = self.block_size, self.max_blocks
        idx = pos // bs
        ok = valid & (pos >= 0) & (idx < mb)
        table = self.b.rows.index_select(0, src_row)
        blk = torch.gather(table, 1, idx.clamp(0, mb - 1)).long()
        return torch.where(ok & (blk > 0), blk * bs + pos % bs, -1)

    def prepare(self, num_rows: int) -> None:
        for dst, src in self._src or ():  # the inputs not written in place
            dst.copy_(src)
        b, r, w = self.b, num_rows, self.width
        width = b.width[:1].clamp(1, w)
        slots = b.slots[:r]
        real = slots >= 0
        acc = torch.minimum(b.accepted[:r].clamp(min=0), width - 1)
        cnt = torch.where(real, acc + 1, 0)
        end = torch.cumsum(cnt, 0)
        start = end - cnt
        src = torch.where(real, slots, self.null_row)
        base = torch.where(real, b.base.index_select(0, src).long(), 0)
        b.table[:r].copy_(b.rows.index_select(0, src))

        j = torch.arange(w, device=slots.device)
        is_tok = j[None, :] < cnt[:, None]
        ids = b.verified[:r, :w].clamp(0, self.vocab_size - 1)
        pos = base[:, None] + j[None, :]
        slot_map = self._slot_of(src, pos, is_tok)
        srcrow = torch.arange(r, device=slots.device)[:, None] * w + j[None, :]
        # Scatter the ragged tokens into [0, total); everything else is padding. Index
        # r * w is a dump slot for non-tokens (fixed shapes: capturable).
        dst = torch.where(is_tok, start[:, None] + j[None, :], r * w).reshape(-1)
        for out, vals, pad in (
            (b.p_ids, ids, 0),
            (b.p_pos, pos, 0),
            (b.p_slot, slot_map, -1),
            (b.p_src, srcrow, 0),
        ):
            tmp = torch.full((r * w + 1,), pad, dtype=torch.int64, device=slots.device)
            tmp.scatter_(0, dst, vals.reshape(-1).long())
            out[: r * w].copy_(tmp[: r * w])
        b.p_qsl[:1].zero_()
        b.p_qsl[1 : r + 1].copy_(end)
        b.p_seq[:r].copy_(base + cnt)
        b.p_last[:r].copy_((end - 1).clamp(min=0))
        num_real = real.long().sum().view(1)
        rows = torch.arange(r, device=slots.device)
        b.d_qsl[:1].zero_()
        b.d_qsl[1 : r + 1].copy_(torch.minimum(rows + 1, num_real))
        b.d_last[:r].copy_(torch.where(real, rows, 0))
        b.param[:r].copy_(src)
        b.cur_pos[:r].copy_(torch.where(real, base + cnt - 1, 0))
        upd = real & (slots != self.null_row)
        # Rows that keep their length write the null row's own value back onto it
        # (every such duplicate writes the same value, so the order does not matter).
        keep = b.base[self.null_row : self.null_row + 1].long()
        b.base.index_copy_(
            0, torch.where(upd, src, self.null_row), torch.where(upd, base + cnt, keep).int()
        )
        counted = real & (slots != self.null_row)
        k = torch.where(counted, b.k[:r].clamp(0, self.k_cap), 0)
        kk = torch.arange(self.k_cap, device=slots.device)
        per_pos = (k[:, None] > kk[None, :]).long().sum(0)
        rows_counted = counted.long().sum()
        b.counters[0] += (rows_counted > 0).long()
        b.counters[1] += rows_counted
        b.counters[2 : 2 + self.k_cap] += per_pos

    def _finish_argmax(self, parts: ArgmaxParts | None, r: int, column: torch.Tensor) -> None:
        if parts is not None:
            check_argmax_parts(parts, r, column.device)
            column.copy_(
                torch_ops.reduce_argmax_parts(parts.val, parts.idx, r, parts.blocks, parts.offsets)
            )

    def advance(self, num_rows: int, step: int, k_max: int, parts: ArgmaxParts | None = None):
        b, r = self.b, num_rows
        slots = b.slots[:r]
        real = slots >= 0
        src = torch.where(real, slots, self.null_row)
        column = b.tokens[: r * k_max].view(r, k_max)[:, step - 1]
        self._finish_argmax(parts, r, column)
        tok = column.clamp(0, self.vocab_size - 1)
        pos = torch.where(real, b.cur_pos[:r] + 1, b.cur_pos[:r])
        b.cur_pos[:r].copy_(pos)
        slot_map = self._slot_of(src, pos.view(r, 1), real.view(r, 1)).view(r)
        b.d_ids[:r].copy_(torch.where(real, tok, 0))
        b.d_pos[:r].copy_(torch.where(real, pos, 0))
        b.d_seq[:r].copy_(torch.where(real, pos + 1, 0))
        b.d_slot[:r].copy_(slot_map)

    def advance_fold(self, num_rows: int, step: int, k_max: int, parts=None) -> None:
        """None: no kernel of the PyTorch path takes the advance on the way (the caller
        runs advance)."""
        return None

    def epilogue(self, num_rows: int, k_max: int, parts: ArgmaxParts | None = None) -> None:
        b, r = self.b, num_rows
        k = torch.where(b.slots[:r] >= 0, b.k[:r], 0)
        toks = b.tokens[: r * k_max].view(r, k_max)
        self._finish_argmax(parts, r, toks[:, k_max - 1])
        kk = torch.arange(k_max, device=toks.device)
        toks.masked_fill_(kk[None, :] >= k[:, None], -1)

    def sources(self, verified, accepted, hidden=None, *, checked: bool = False) -> np.ndarray:
        """DraftRoundKernels.sources on the PyTorch path: the tensors are kept here and
        prepare copies them into the buffers first. Returns all-zero fields."""
        n, w = round_sources_shape(self, verified, accepted, hidden, checked)
        self._src = None
        if n:
            self._src = [(dst, src) for dst, src in (
                (self.b.verified[:n, :w], verified),
                (self.b.accepted[:n], accepted),
                (None if hidden is None else self.hidden[: n * self.width].view(
                    n, self.width, -1)[:, :w], hidden),
            ) if src is not None]  # fmt: skip
        return np.zeros(SOURCE_FIELDS, dtype=np.int64)


def draft_round_ops(buffers: DraftRoundBuffers, **kw) -> DraftRoundKernels | TorchDraftRound:
    """The Triton launchers where Triton can run these tensors, else the PyTorch path."""
    if backend_for(buffers.slots) == "triton":
        return DraftRoundKernels(buffers, **kw)
    return TorchDraftRound(buffers, **kw)
