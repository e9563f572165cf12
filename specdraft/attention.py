"""The attention layer over the paged cache: store this step's K/V, then attend."""

from __future__ import annotations

import math

import torch

from specdraft.kernels import AttentionSplits, as_int, check_paged_attention_args
from specdraft.kernels.validation import MAX_HEAD_DIM
from specdraft.ops import paged_attention, paged_attention_unmerged, store_kv

from .attn_metadata import AttentionMetadata


def _shape_error(name: str, t: torch.Tensor, expected: str) -> ValueError:
    return ValueError(f"{name} has shape {tuple(t.shape)}, expected {expected}")


class PagedAttention(torch.nn.Module):
    """Stores K/V at the metadata's slots and runs paged attention. Metadata is passed
    explicitly to every call: there is no global context.

    A caller that writes this step's K/V itself (Attention's fused rotary + store) calls
    `check` first, then its writer, then forward(..., stored=True)."""

    def __init__(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        scale: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ):
        super().__init__()
        num_q_heads = as_int("num_q_heads", num_q_heads)
        num_kv_heads = as_int("num_kv_heads", num_kv_heads)
        head_dim = as_int("head_dim", head_dim)
        for name, v in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if not 1 <= head_dim <= MAX_HEAD_DIM:
            raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
        if num_q_heads % num_kv_heads:
            raise ValueError(
                f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}"
            )
        scale = head_dim**-0.5 if scale is None else scale
        # Checked here, not at the first forward: the forward stores K/V before attention
        # runs, so a bad value found there would leave this step's K/V in the cache.
        if (
            isinstance(scale, bool)
            or not isinstance(scale, (int, float))
            or not (math.isfinite(scale) and scale > 0)
        ):
            raise ValueError(f"scale must be a positive finite number, got {scale!r}")
        if sliding_window is not None:
            sliding_window = as_int("sliding_window", sliding_window)
            if sliding_window < 1:
                raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        if softcap is not None and (
            isinstance(softcap, bool)
            or not isinstance(softcap, (int, float))
            or not (math.isfinite(softcap) and softcap > 0)
        ):
            raise ValueError(f"softcap must be a positive finite number or None, got {softcap!r}")
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.scale = float(scale)
        self.sliding_window = sliding_window
        self.softcap = None if softcap is None else float(softcap)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,
        *,
        stored: bool = False,
        pdl: bool = False,
    ) -> torch.Tensor:
        """q [num_tokens, Hq, D], k and v [num_tokens, Hkv, D] with num_tokens equal to
        meta.num_tokens; returns [num_tokens, Hq, D] (zeros on padded tokens).

        stored=True: the caller has run check() and then written this step's K/V into
        kv_cache at meta.slot_mapping (kernels.rotary_store_kv), so neither the layer's
        checks nor store_kv run again; attention reads K/V from the cache either way.
        pdl=True (Triton backend only): launch with programmatic dependent launch."""
        if not stored:
            self._check(q, k, v, kv_cache, meta, out)
        k_cache, v_cache = kv_cache
        if not stored:
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention(
            q, k_cache, v_cache, *self._metadata(meta), self.scale, out=out, pdl=pdl,
            **self._options(meta),
        )  # fmt: skip

    def forward_unmerged(
        self,
        q: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        *,
        pdl: bool = False,
    ) -> tuple[torch.Tensor, AttentionSplits | None]:
        """forward(q, ..., stored=True) on the Triton backend, a split launch's partials
        left unmerged: (out, None) when the launch does not split, else (out, its
        AttentionSplits), out unwritten (the caller merges: kernels.combine_splits, or
        kernels.fused_linear's x_splits)."""
        k_cache, v_cache = kv_cache
        return paged_attention_unmerged(
            q, k_cache, v_cache, *self._metadata(meta), self.scale, pdl=pdl,
            **self._options(meta),
        )  # fmt: skip

    def check(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> None:
        """The checks of forward(..., stored=True), nothing written: the layer's own and
        the attention kernel's argument checks (in validation mode the metadata's values
        too: one more host read). For callers that write the cache before that forward,
        so that a call refused here finds the cache as it was; the writer checks its own
        arguments (positions, slot_mapping) before it writes."""
        self._check(q, k, v, kv_cache, meta, out)
        k_cache, v_cache = kv_cache
        check_paged_attention_args(
            q, k_cache, v_cache, *self._metadata(meta), self.scale, out=out, **self._options(meta)
        )

    @staticmethod
    def _metadata(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return meta.query_start_loc, meta.seq_lens, meta.block_table

    def _options(self, meta: AttentionMetadata) -> dict:
        return dict(
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            sliding_window=self.sliding_window,
            softcap=self.softcap,
        )

    def _check(self, q, k, v, kv_cache, meta: AttentionMetadata, out) -> None:
        """Everything about q, k, v, the cache pair and out, before store_kv writes: a bad
        q must not leave this step's K/V in the cache."""
        if not isinstance(meta, AttentionMetadata):
            raise TypeError(f"meta must be an AttentionMetadata, got {type(meta).__name__}")
        t, hq, hkv, d = meta.num_tokens, self.num_q_heads, self.num_kv_heads, self.head_dim
        for name, x in (("q", q), ("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
        if tuple(q.shape) != (t, hq, d):
            raise _shape_error("q", q, f"[num_tokens {t}, {hq} heads, head_dim {d}]")
        for name, x in (("k", k), ("v", v)):
            if tuple(x.shape) != (t, hkv, d):
                raise _shape_error(name, x, f"[num_tokens {t}, {hkv} kv heads, head_dim {d}]")
        if not isinstance(kv_cache, (tuple, list)) or len(kv_cache) != 2:
            raise TypeError("kv_cache must be a (k_cache, v_cache) pair")
        k_cache = kv_cache[0]
        for name, x in (("q", q), ("k", k), ("v", v), ("v_cache", kv_cache[1])):
            if x.dtype != k_cache.dtype:
                raise TypeError(f"{name} is {x.dtype}, the cache {k_cache.dtype}")
            if x.device != k_cache.device:
                raise ValueError(f"{name} is on {x.device}, the cache on {k_cache.device}")
        if out is not None and (tuple(out.shape) != (t, hq, d) or out.dtype != q.dtype):
            raise ValueError(
                f"out is {tuple(out.shape)} {out.dtype}, expected [{t}, {hq}, {d}] {q.dtype}"
            )
