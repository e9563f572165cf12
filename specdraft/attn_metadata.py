"""Attention metadata: views into the persistent buffers plus the host scalars a batch
descriptor fixes, filled from a real batch or with dummy contents for graph capture."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdraft.kernels import as_int
from specdraft.ops import prepare_slot_mapping

from .batch import ScheduledBatch
from .block_table import BlockTables
from .config import LimitsConfig
from .input_buffers import HostStaging, InputBuffers
from .kv_cache import KVCache

_min, _max, _sum = np.minimum.reduce, np.maximum.reduce, np.add.reduce


@dataclass(frozen=True)
class AttentionMetadata:
    """What every attention layer of one step reads. Tensors are views of persistent
    buffers; num_tokens / num_reqs / max_query_len / max_seq_len are the launch bounds
    (a descriptor's sizes when padded), num_real_* the batch's own counts."""

    num_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    num_real_tokens: int
    num_real_reqs: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs]
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks_per_req]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    input_ids: torch.Tensor  # int64 [num_tokens]
    last_token_idx: torch.Tensor  # int64 [num_reqs]
    # One token a request with num_tokens == num_reqs (a decode descriptor): request r's
    # last token is row r, padded requests' rows are padding rows (finite, never read as
    # a token's output), so logits need no gather. Set by MetadataBuilder from the
    # descriptor's bounds, which every batch it is replayed for satisfies.
    last_is_row: bool = False


def _int_array(name: str, value) -> np.ndarray:
    """batch.<name> as an int64 array; floats are refused, not truncated."""
    a = np.asarray(value)
    if a.dtype != np.int64:
        if a.size and a.dtype.kind not in "iu":
            raise TypeError(f"batch.{name} must hold integers, got dtype {a.dtype}")
        a = a.astype(np.int64)
    return a


def _check_parts(limits, buffers, block_tables, kv_cache) -> None:
    """The builder's parts fit each other: every size a batch within `limits` can reach
    has room in the buffers and the step table, so no build fails after its upload."""
    for name, value, cls in (
        ("limits", limits, LimitsConfig),
        ("buffers", buffers, InputBuffers),
        ("block_tables", block_tables, BlockTables),
    ):
        if not isinstance(value, cls):
            raise TypeError(f"{name} must be a {cls.__name__}, got {type(value).__name__}")
    if kv_cache is not None and not isinstance(kv_cache, KVCache):
        raise TypeError(f"kv_cache must be a KVCache or None, got {type(kv_cache).__name__}")
    for name, have, owner in (
        ("max_num_reqs", buffers.max_num_reqs, "buffers"),
        ("max_num_tokens", buffers.max_num_tokens, "buffers"),
        ("max_num_reqs", block_tables.max_num_reqs, "block_tables"),
    ):
        if have < getattr(limits, name):
            raise ValueError(
                f"limits.{name} is {getattr(limits, name)} but {owner} are sized for {name} "
                f"{have}: build {owner} from the same limits"
            )
    devices = {"buffers": buffers.slot_mapping.device, "block_tables": block_tables.rows.device}
    if kv_cache is not None:
        devices["kv_cache"] = kv_cache.data.device
    if len(set(devices.values())) > 1:
        raise ValueError(f"buffers, block tables and KV cache must share a device, got {devices}")


class MetadataBuilder:
    """Fills InputBuffers and the step block table for one step, and returns the
    metadata. Host work is vectorised numpy plus one staging copy; nothing waits for
    the GPU."""

    def __init__(
        self,
        limits: LimitsConfig,
        buffers: InputBuffers,
        block_tables: BlockTables,
        kv_cache: KVCache | None = None,
    ):
        _check_parts(limits, buffers, block_tables, kv_cache)
        if kv_cache is not None and block_tables.allocator.num_blocks > kv_cache.num_blocks:
            raise ValueError(
                f"block tables hand out block ids up to {block_tables.allocator.num_blocks - 1}"
                f" but the KV cache has {kv_cache.num_blocks} blocks"
            )
        if kv_cache is not None and kv_cache.block_size != block_tables.block_size:
            raise ValueError(
                f"block tables use block_size {block_tables.block_size}, the KV cache "
                f"{kv_cache.block_size}"
            )
        self.limits = limits
        self.buffers = buffers
        self.block_tables = block_tables
        self.block_size = block_tables.block_size
        self._arange = np.arange(max(limits.max_num_tokens, limits.max_num_reqs))
        self._row_mark = np.zeros(block_tables.max_num_reqs + 1, dtype=np.int64)
        # The step table's gather and the slot mapping: one launch, buffers checked once.
        self._slot_mapping = prepare_slot_mapping(
            buffers.positions,
            buffers.query_start_loc,
            block_tables.table,
            self.block_size,
            buffers.slot_mapping,
            rows=block_tables.rows,
            row_slots=buffers.row_slots,
        )
        # The same launch that first moves the last batch one step on (advance()).
        self._advance = prepare_slot_mapping(
            buffers.positions,
            buffers.query_start_loc,
            block_tables.table,
            self.block_size,
            buffers.slot_mapping,
            rows=block_tables.rows,
            row_slots=buffers.row_slots,
            advance_seq_lens=buffers.seq_lens,
        )
        self._last: AttentionMetadata | None = None  # what the buffers hold now
        self._views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    # ---- real batches -------------------------------------------------------------

    def build(
        self,
        batch: ScheduledBatch,
        *,
        num_reqs_padded: int | None = None,
        num_tokens_padded: int | None = None,
        max_query_len: int | None = None,
    ) -> AttentionMetadata:
        """Metadata for `batch`, padded to (num_reqs_padded, num_tokens_padded): requests
        past the batch get query length 0 and seq_len 0 (query_start_loc repeats the
        token count), tokens past it get slot -1. Raises ValueError before writing
        anything when the batch breaks a limit."""
        # Sizes first: a float or a string must fail here, not after the upload.
        if num_reqs_padded is not None:
            num_reqs_padded = as_int("num_reqs_padded", num_reqs_padded)
        if num_tokens_padded is not None:
            num_tokens_padded = as_int("num_tokens_padded", num_tokens_padded)
        if max_query_len is not None:
            max_query_len = as_int("max_query_len", max_query_len)
        if not isinstance(batch, ScheduledBatch):
            raise TypeError(f"batch must be a ScheduledBatch, got {type(batch).__name__}")
        counts = _int_array("num_new_tokens", batch.num_new_tokens)
        starts = _int_array("start_positions", batch.start_positions)
        tokens = _int_array("token_ids", batch.token_ids)
        r, t, ends, real_mq = self._validate(batch, counts, starts, tokens)
        rp = r if num_reqs_padded is None else num_reqs_padded
        tp = t if num_tokens_padded is None else num_tokens_padded
        mq = real_mq if max_query_len is None else max_query_len
        self._check_padding(r, t, rp, tp, real_mq, mq)
        rows = self._rows_with_capacity(batch.req_ids, ends)
        self._check_unique(batch.req_ids, rows)

        s = self.buffers.stage()
        qsl = s.query_start_loc
        qsl[0] = 0
        np.cumsum(counts, out=qsl[1 : r + 1])
        qsl[r + 1 : rp + 1] = t
        s.seq_lens[:r] = ends
        s.seq_lens[r:rp] = 0
        s.input_ids[:t] = tokens
        s.input_ids[t:tp] = 0
        # position of token j of request i: starts[i] + j
        s.positions[:t] = np.repeat(starts - qsl[:r], counts) + self._arange[:t]
        s.positions[t:tp] = 0
        s.last_token_idx[:r] = qsl[1 : r + 1] - 1
        s.last_token_idx[r:rp] = 0
        s.row_slots[:r] = rows
        s.row_slots[r:rp] = self.block_tables.null_row
        self._upload(s, rp, tp)
        self._last = self._metadata(rp, tp, mq, t, r)
        return self._last

    def _validate(self, batch, counts, starts, tokens) -> tuple[int, int, np.ndarray, int]:
        """(num_reqs, num_tokens, end position of each request, longest query)."""
        lim = self.limits
        r = len(batch.req_ids)
        if r < 1:
            raise ValueError("batch has no requests")
        if r > lim.max_num_reqs:
            raise ValueError(f"batch has {r} requests, over max_num_reqs {lim.max_num_reqs}")
        if counts.shape != (r,) or starts.shape != (r,):
            raise ValueError(
                f"num_new_tokens {counts.shape} and start_positions {starts.shape} must have "
                f"one entry per request ({r})"
            )
        ends = starts + counts
        # ufunc reductions directly: the ndarray methods add a Python layer per call
        if _min(counts) < 1:
            i = int(np.argmax(counts < 1))
            raise ValueError(
                f"num_new_tokens[{i}] = {counts[i]} for request {batch.req_ids[i]!r}: must be >= 1"
            )
        if _min(starts) < 0:
            i = int(np.argmax(starts < 0))
            raise ValueError(f"start_positions[{i}] = {starts[i]} must be >= 0")
        if _max(ends) > lim.max_model_len:
            i = int(np.argmax(ends > lim.max_model_len))
            raise ValueError(
                f"request {batch.req_ids[i]!r} reaches length {ends[i]}, over max_model_len "
                f"{lim.max_model_len}"
            )
        t = int(_sum(counts))
        if t > lim.max_num_tokens:
            raise ValueError(f"batch has {t} tokens, over max_num_tokens {lim.max_num_tokens}")
        if tokens.shape != (t,):
            raise ValueError(f"token_ids has shape {tokens.shape}, expected ({t},)")
        return r, t, ends, int(_max(counts))

    def _check_padding(self, r: int, t: int, rp: int, tp: int, real_mq: int, mq: int) -> None:
        lim = self.limits
        if not r <= rp <= lim.max_num_reqs:
            raise ValueError(
                f"num_reqs_padded {rp} must be in [{r}, max_num_reqs {lim.max_num_reqs}]"
            )
        if not t <= tp <= lim.max_num_tokens:
            raise ValueError(
                f"num_tokens_padded {tp} must be in [{t}, max_num_tokens {lim.max_num_tokens}]"
            )
        if mq < real_mq:
            raise ValueError(f"max_query_len {mq} is below the batch's longest query {real_mq}")

    def _check_unique(self, req_ids, rows: np.ndarray) -> None:
        """Distinct requests hold distinct row slots, so a repeated row is a repeated id."""
        mark, idx = self._row_mark, self._arange[: len(rows)]
        mark[rows] = idx  # the last index wins where a row repeats
        repeated = mark[rows] != idx
        if np.logical_or.reduce(repeated):
            raise ValueError(
                f"request id {req_ids[int(np.argmax(repeated))]!r} appears twice in the batch"
            )

    def _rows_with_capacity(self, req_ids, ends: np.ndarray) -> np.ndarray:
        """Block-table row of every request, checking its blocks cover its length."""
        rows, caps = self.block_tables.rows_of(req_ids)
        short = caps * self.block_size < ends
        if np.logical_or.reduce(short):
            i = int(np.argmax(short))
            raise ValueError(
                f"request {req_ids[i]!r} reaches length {ends[i]} but its {caps[i]} blocks hold "
                f"{caps[i] * self.block_size} tokens: grow it first"
            )
        return rows

    # ---- capture --------------------------------------------------------------------

    def prepare_inputs_to_capture(
        self, num_reqs: int, num_tokens: int, max_query_len: int
    ) -> AttentionMetadata:
        """Valid dummy contents for a descriptor, in the same persistent buffers: tokens
        spread across requests (at most max_query_len each; any rest is padding), seq_len
        equal to the query length, null-block tables, every slot -1 (nothing written to
        the cache)."""
        lim = self.limits
        num_reqs = as_int("num_reqs", num_reqs)
        num_tokens = as_int("num_tokens", num_tokens)
        max_query_len = as_int("max_query_len", max_query_len)
        if not 1 <= num_reqs <= lim.max_num_reqs:
            raise ValueError(f"num_reqs {num_reqs} must be in [1, {lim.max_num_reqs}]")
        if not num_reqs <= num_tokens <= lim.max_num_tokens:
            raise ValueError(
                f"num_tokens {num_tokens} must be in [num_reqs {num_reqs}, "
                f"max_num_tokens {lim.max_num_tokens}]"
            )
        if max_query_len < 1:
            raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
        base, rest = divmod(num_tokens, num_reqs)
        counts = np.full(num_reqs, base, dtype=np.int64)
        counts[:rest] += 1
        np.minimum(counts, max_query_len, out=counts)
        t = int(counts.sum())
        s = self.buffers.stage()
        qsl = s.query_start_loc
        qsl[0] = 0
        np.cumsum(counts, out=qsl[1 : num_reqs + 1])
        s.seq_lens[:num_reqs] = counts
        s.input_ids[:num_tokens] = np.arange(num_tokens) % 7 + 1
        s.positions[:t] = np.arange(t) - np.repeat(qsl[:num_reqs], counts)
        s.positions[t:num_tokens] = 0
        s.last_token_idx[:num_reqs] = np.maximum(qsl[1 : num_reqs + 1] - 1, 0)
        s.row_slots[:num_reqs] = self.block_tables.null_row
        self._upload(s, num_reqs, num_tokens)
        self.buffers.slot_mapping[:num_tokens].fill_(-1)
        self._last = None  # the buffers hold dummy contents now
        return self._metadata(num_reqs, num_tokens, max_query_len, t, num_reqs)

    # ---- shared ---------------------------------------------------------------------

    def _upload(self, s: HostStaging, rp: int, tp: int) -> None:
        self.buffers.upload(s)
        self.block_tables.commit()
        self._slot_mapping(rp, tp)

    def advance(self) -> AttentionMetadata:
        """The metadata of the batch last built, one step later, without a host upload:
        on the device every request's positions and seq_len move on by its query length
        (1 for decode) and the slots are recomputed; input ids stay as they are (the
        runner feeds decode tokens on the device). Block tables must already cover the
        new lengths (grow before calling); pending block-table writes are committed.
        The caller guarantees the batch is the same requests in the same order."""
        last = self._last
        if last is None:
            raise RuntimeError("advance() needs a batch built by build() first")
        self.block_tables.commit()
        self.launch_advance(last.num_reqs, last.num_tokens)
        return last

    def launch_advance(self, num_reqs: int, num_tokens: int) -> None:
        """advance()'s device work alone, over the first num_reqs requests and num_tokens
        tokens of the buffers: what a captured steady decode graph records. No commit and
        no host state: the caller commits block-table writes before replaying."""
        self._advance(num_reqs, num_tokens)

    def _metadata(self, rp: int, tp: int, mq: int, t: int, r: int) -> AttentionMetadata:
        views = self._views.get((rp, tp))
        if views is None:
            if len(self._views) >= 4096:  # eager runs of ever-new sizes: keep it bounded
                self._views.clear()
            b = self.buffers
            views = self._views[(rp, tp)] = (
                b.query_start_loc[: rp + 1],
                b.seq_lens[:rp],
                self.block_tables.table[:rp],
                b.slot_mapping[:tp],
                b.positions[:tp],
                b.input_ids[:tp],
                b.last_token_idx[:rp],
            )
        return AttentionMetadata(
            tp, rp, mq, self.limits.max_model_len, t, r, *views, last_is_row=mq == 1 and tp == rp
        )
